"""Heartbeat liveness: when a peer counts as gone, and when it is time to send the next beat.

Units: intervals are seconds on a monotonic clock. A peer is gone when nothing has been heard from it
for ``liveness`` intervals. Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_INTERVAL_S = 1.0  # seconds between heartbeats
DEFAULT_LIVENESS = 3  # intervals of silence before a peer is gone


@dataclass(frozen=True, slots=True)
class HeartbeatPolicy:
    interval: float = DEFAULT_INTERVAL_S
    liveness: int = DEFAULT_LIVENESS

    @property
    def expiry(self) -> float:
        """Seconds of silence after which the peer is gone."""
        return self.interval * self.liveness

    def negotiate(self, other_interval: float, other_liveness: int) -> HeartbeatPolicy:
        """Both sides use the larger interval and the larger liveness (PROTOCOL.md §4.2)."""
        return HeartbeatPolicy(max(self.interval, other_interval), max(self.liveness, other_liveness))


class Liveness:
    """One peer's liveness: heard() on any message, expired(now) when silent too long."""

    __slots__ = ("policy", "last_heard", "last_sent", "seq_sent", "seq_heard")

    def __init__(self, policy: HeartbeatPolicy, now: float) -> None:
        self.policy = policy
        self.last_heard = now
        self.last_sent = now
        self.seq_sent = 0
        self.seq_heard = -1

    def heard(self, now: float, seq: int | None = None) -> None:
        self.last_heard = now
        if seq is not None and seq > self.seq_heard:
            self.seq_heard = seq

    def expired(self, now: float) -> bool:
        return now - self.last_heard > self.policy.expiry

    def silence(self, now: float) -> float:
        return now - self.last_heard

    def beat_due(self, now: float) -> bool:
        return now - self.last_sent >= self.policy.interval

    def sent(self, now: float) -> int:
        """Record that a heartbeat went out; returns its sequence number."""
        self.last_sent = now
        self.seq_sent += 1
        return self.seq_sent
