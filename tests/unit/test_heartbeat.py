"""gpud.heartbeat: the policy arithmetic and one peer's liveness, driven by a FakeClock."""

from __future__ import annotations

import pytest

from gpud.clock import FakeClock
from gpud.heartbeat import DEFAULT_INTERVAL_S, DEFAULT_LIVENESS, HeartbeatPolicy, Liveness


def test_policy_defaults_and_expiry() -> None:
    p = HeartbeatPolicy()
    assert (p.interval, p.liveness) == (DEFAULT_INTERVAL_S, DEFAULT_LIVENESS)
    assert p.expiry == DEFAULT_INTERVAL_S * DEFAULT_LIVENESS
    assert HeartbeatPolicy(0.25, 4).expiry == 1.0
    assert HeartbeatPolicy(2.0, 5).expiry == 10.0


@pytest.mark.parametrize(
    ("mine", "theirs", "expected"),
    [
        ((1.0, 3), (2.0, 2), (2.0, 3)),
        ((2.0, 2), (1.0, 3), (2.0, 3)),
        ((1.0, 3), (0.5, 10), (1.0, 10)),
        ((1.0, 3), (0.0, 0), (1.0, 3)),
        ((1.5, 4), (1.5, 4), (1.5, 4)),
    ],
)
def test_negotiate_takes_the_larger_of_each(
    mine: tuple[float, int], theirs: tuple[float, int], expected: tuple[float, int]
) -> None:
    got = HeartbeatPolicy(*mine).negotiate(*theirs)
    assert (got.interval, got.liveness) == expected
    # symmetric
    back = HeartbeatPolicy(*theirs).negotiate(*mine)
    assert (back.interval, back.liveness) == expected


def test_expired_boundary() -> None:
    clock = FakeClock(1000.0)
    live = Liveness(HeartbeatPolicy(0.5, 4), clock.monotonic())  # expiry 2.0 s
    clock.advance(1.0)
    assert not live.expired(clock.monotonic())
    clock.advance(1.0)  # exactly the expiry
    assert live.silence(clock.monotonic()) == 2.0
    assert not live.expired(clock.monotonic())
    clock.advance(0.001)
    assert live.expired(clock.monotonic())


def test_heard_resets() -> None:
    clock = FakeClock(50.0)
    live = Liveness(HeartbeatPolicy(1.0, 3), clock.monotonic())
    clock.advance(2.5)
    live.heard(clock.monotonic())
    assert live.silence(clock.monotonic()) == 0.0
    clock.advance(3.0)
    assert not live.expired(clock.monotonic())  # 3.0 since heard: exactly expiry
    clock.advance(0.5)
    assert live.expired(clock.monotonic())  # 5.5 since start, 3.5 since heard
    live.heard(clock.monotonic())
    assert not live.expired(clock.monotonic())


def test_heard_keeps_the_highest_seq() -> None:
    live = Liveness(HeartbeatPolicy(), 0.0)
    assert live.seq_heard == -1
    live.heard(1.0, 5)
    live.heard(2.0, 3)  # a late, stale beat
    assert live.seq_heard == 5
    assert live.last_heard == 2.0  # still counts as hearing from the peer
    live.heard(3.0)
    assert live.seq_heard == 5
    live.heard(4.0, 6)
    assert live.seq_heard == 6


def test_beat_due_and_sent_sequence() -> None:
    clock = FakeClock(10.0)
    live = Liveness(HeartbeatPolicy(1.0, 3), clock.monotonic())
    assert not live.beat_due(clock.monotonic())
    seqs = []
    for _ in range(5):
        clock.advance(0.5)
        assert not live.beat_due(clock.monotonic())
        clock.advance(0.5)  # exactly one interval since the last send
        assert live.beat_due(clock.monotonic())
        seqs.append(live.sent(clock.monotonic()))
        assert not live.beat_due(clock.monotonic())
        assert live.last_sent == clock.monotonic()
    assert seqs == [1, 2, 3, 4, 5]
    assert live.seq_sent == 5


def test_sending_does_not_count_as_hearing() -> None:
    clock = FakeClock(0.0)
    live = Liveness(HeartbeatPolicy(1.0, 2), clock.monotonic())
    for _ in range(3):
        clock.advance(1.0)
        live.sent(clock.monotonic())
    assert live.expired(clock.monotonic())
