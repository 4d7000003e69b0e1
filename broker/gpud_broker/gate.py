"""The frontend's door: how many connections each source address holds, and in all, against their
bounds; and which sources are held off because their handshakes keep being refused. Pure: the
socket shell (``broker.Broker``) feeds it the frontend monitor's accept and disconnect events
(libzmq names each connection by its descriptor) and shuts down the connections it refuses; the
ZAP handler asks it which sources are held off; the caller passes the time.

ZeroMQ has no hook to refuse a connection before it is accepted. What it has is a monitor event
for each accepted connection, carrying its descriptor: the shell reads the peer's address from the
descriptor and, for a refused one, shuts the connection down (``shutdown(2)``, never ``close``: the
descriptor stays libzmq's, which then sees the end of the stream and closes it as for any peer
that left). A refused connection costs a descriptor for a moment and no CURVE handshake beyond
what libzmq did before the event was read.

A source held off (``limits.refusals`` handshakes refused within ``hold_off_s``: an outsider with
a fresh key each time) may open ``limits.held_off_rate`` connections a second; the rest are shut
down as they are accepted. That comes too late for the CURVE handshake, which libzmq's I/O
threads work through before the broker hears of the connection, so the shell also gives the held-off
IPv4 sources (``held_now``, which changes with ``held_changes``) to the listener's filter
(``gpud_broker.synfilter``): the kernel drops all but one in ``synfilter.KEEP_ONE_IN`` of their
SYNs. Its known keys are still admitted (a client sharing its address gets in, if at a slower
pace: its SYNs are retried, and the hold-off ends ``hold_off_s`` after the last refusal); its
unknown ones are refused without the key directories being read again
(``gpud.security.ZapHandler``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from gpud.ratelog import TokenBucket

MAX_HELD_OFF = 4096  # sources held off at once, at most (then the oldest go first)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """``[broker] max_connections`` and ``max_connections_per_source``, and how a source whose
    handshakes keep being refused (by ZAP: unknown keys) is held off."""

    total: int = 10_000  # connections on the frontend at once, from all sources
    per_source: int = 1_000  # connections on the frontend at once from one address (IPv6: one /64)
    refusals: int = 20  # refused handshakes of one source within ``hold_off_s`` before it is held off
    hold_off_s: float = 10.0  # how long a source is held off
    held_off_rate: float = 10.0  # new connections a second a held-off source may open (the rest: shut down)


def default_limits(nofile: int) -> ConnectionLimits:
    """Bounds sized from the descriptor limit: half of what is left above the reserves in all (a
    client connection is one descriptor), and a sixteenth of that per source (at least 64, at most
    1,024)."""
    total = max(64, (nofile - 256) // 2)
    return ConnectionLimits(total=total, per_source=max(64, min(1024, total // 16)))


def source_of(address: str) -> str:
    """The source a peer address counts under: an IPv4 address (also when IPv4-mapped), an IPv6
    address's /64 (one host is handed a whole /64), or the text itself (a non-IP address)."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class ConnectionGate:
    """Connections by descriptor, counted per source, against ``ConnectionLimits``."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.by_fd: dict[int, str] = {}  # descriptor -> source, of the connections admitted
        self.per_source: dict[str, int] = {}
        self.held_off: dict[str, float] = {}  # source -> until when (oldest first)
        self._refusals: dict[str, tuple[float, int]] = {}  # source -> (window start, refusals in it)
        self.refused = 0  # connections refused (shut down) so far
        self.refused_by: dict[str, int] = {"per_source": 0, "total": 0, "held_off": 0}
        # Held-off sources' connections a second: one second's worth at most.
        self._tokens = TokenBucket(limits.held_off_rate, limits.held_off_rate, MAX_HELD_OFF)
        self.held_changes = 0  # counts sources held off and let go (the listener's filter follows it)

    def __len__(self) -> int:
        return len(self.by_fd)

    def accept(self, fd: int, address: str, now: float) -> str | None:
        """A connection accepted on descriptor ``fd`` from ``address``: None when admitted (it is
        counted), else why it is refused (the caller shuts it down)."""
        self.closed(fd)  # a descriptor reused before its disconnect was seen
        source = source_of(address)
        why = self._why_not(source, now)
        if why is not None:
            self.refused += 1
            return why
        self.by_fd[fd] = source
        self.per_source[source] = self.per_source.get(source, 0) + 1
        return None

    def _why_not(self, source: str, now: float) -> str | None:
        if source in self.held_off and self.is_held_off(source, now) and not self._tokens.take(source, 1.0, now):
            self.refused_by["held_off"] += 1
            return (f"source {source} is held off (its handshakes keep being refused): "
                    f"{self.limits.held_off_rate:g} new connections a second at most")
        if self.per_source.get(source, 0) >= self.limits.per_source:
            self.refused_by["per_source"] += 1
            return f"source {source} holds {self.limits.per_source} connections, its bound max_connections_per_source"
        if len(self.by_fd) >= self.limits.total:
            self.refused_by["total"] += 1
            return f"the frontend holds {self.limits.total} connections, its bound max_connections"
        return None

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` is gone (or was never admitted: then nothing changes)."""
        source = self.by_fd.pop(fd, None)
        if source is not None:
            left = self.per_source[source] - 1
            if left:
                self.per_source[source] = left
            else:
                del self.per_source[source]

    def handshake_refused(self, address: str, now: float) -> None:
        """ZAP refused a handshake from ``address``: past ``limits.refusals`` of them within
        ``hold_off_s``, the source is held off for ``hold_off_s``."""
        source = source_of(address)
        start, n = self._refusals.get(source, (now, 0))
        if now - start >= self.limits.hold_off_s:
            start, n = now, 0
        n += 1
        if n < self.limits.refusals:
            if len(self._refusals) >= MAX_HELD_OFF and source not in self._refusals:
                self._refusals.clear()
            self._refusals[source] = (start, n)
            return
        self._refusals.pop(source, None)
        if len(self.held_off) >= MAX_HELD_OFF:
            del self.held_off[next(iter(self.held_off))]
        self.held_off[source] = now + self.limits.hold_off_s
        self.held_changes += 1

    def is_held_off(self, address: str, now: float) -> bool:
        source = source_of(address)
        until = self.held_off.get(source)
        if until is None:
            return False
        if now < until:
            return True
        del self.held_off[source]
        self._tokens.forget(source)
        self.held_changes += 1
        return False

    def held_now(self, now: float) -> list[str]:
        """The sources held off at ``now``, oldest first (those whose time is up are let go)."""
        return [s for s in list(self.held_off) if self.is_held_off(s, now)]

    def shown(self, now: float) -> dict[str, object]:
        """For admin ``status``: the bounds and what is held now."""
        top = sorted(self.per_source.items(), key=lambda kv: -kv[1])[:5]
        return {"max_connections": self.limits.total, "max_connections_per_source": self.limits.per_source,
                "connections": len(self.by_fd), "sources": len(self.per_source), "busiest": dict(top),
                "refused": dict(self.refused_by),
                "held_off": sorted(s for s, until in self.held_off.items() if until > now)[:20]}
