"""Rate limits for what a peer can make a daemon do at will (refused handshakes, bad messages).

``RateLimit``, for log lines: per source, the first event of each interval is logged in full and
the rest are counted; a count is reported with the source's next full line, or on its own once the
interval is over (``due``), so a flood costs a few lines per interval and is never silent.
``WindowCount``, for answers: per source, the events of each window counted, so that the first so
many are answered and the rest only counted. ``TokenBucket``, for rates: per sender, a bucket of
tokens that fills at a steady rate up to a burst, taken from as it acts. Each remembers so many
sources at most: past that, the one seen least recently is forgotten (``remember``), so that a flood
of new sources (fresh routing ids) costs the busiest ones, a flooder's count among them, nothing.
Pure: the caller passes the clock (or the time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

OTHERS = "others"  # the source that new sources share once ``max_new`` are logged in one interval
MAX_SOURCES = 4096  # sources remembered at most (then the least recently seen is forgotten)

V = TypeVar("V")


def remember(table: dict[Hashable, V], source: Hashable, value: V, bound: int) -> tuple[Hashable, V] | None:
    """Set ``source``'s ``value`` in ``table`` as its most recently seen (a dict keeps its keys in
    the order they were put: the least recently seen first). A new source in a ``table`` of
    ``bound`` sources forgets the least recently seen one: returned, (source, value), else None.
    ``value`` must not be None."""
    forgot = None
    if table.pop(source, None) is None and len(table) >= bound:
        oldest = next(iter(table))
        forgot = oldest, table.pop(oldest)
    table[source] = value
    return forgot


class RateLimit:
    """At most one full line per source and ``interval``; counts what it held back.

    ``max_new`` (0: no bound): sources logged in full at most per interval, whoever they are; past
    it, events of new sources count under ``OTHERS`` (a peer with a fresh address or routing id per
    event is a few lines, not one per event). At most ``max_sources`` sources are remembered
    (and ``OTHERS``): a forgotten one's count held back goes to ``OTHERS``, reported as theirs."""

    def __init__(self, interval: float, clock: Callable[[], float], max_new: int = 0,
                 max_sources: int = MAX_SOURCES) -> None:
        self.interval = interval
        self.clock = clock
        self.max_new = max_new
        self.max_sources = max_sources
        self.seen: dict[Hashable, tuple[float, int]] = {}  # source -> (its last full line, held since), least recently seen first
        self._window = float("-inf")  # when the current interval of ``max_new`` began
        self._new = 0  # sources logged in full in it

    def __call__(self, source: Hashable) -> int | None:
        """None: stay quiet (counted); otherwise log in full, mentioning the returned count of
        events held back since this source's last full line."""
        now = self.clock()
        last = self.seen.get(source)
        if last is not None and now - last[0] < self.interval:
            remember(self.seen, source, (last[0], last[1] + 1), self.max_sources)
            return None
        if self.max_new and source != OTHERS:
            if now - self._window >= self.interval:
                self._window, self._new = now, 0
            if self._new >= self.max_new:
                return self(OTHERS)
            self._new += 1
        forgot = remember(self.seen, source, (now, 0), self.max_sources)
        if forgot is not None and forgot[1][1]:  # its count is not lost: it is reported as others'
            at, held = self.seen.pop(OTHERS, (now, 0))
            self.seen[OTHERS] = (at, held + forgot[1][1])
        return 0 if last is None else last[1]

    def due(self) -> list[tuple[Hashable, int]]:
        """(source, count) of every source whose interval is over with events held back: report
        each count now. Those sources start afresh (their next event is logged in full)."""
        now = self.clock()
        out = [(s, held) for s, (at, held) in self.seen.items() if held and now - at >= self.interval]
        for s, _ in out:
            del self.seen[s]
        return out


class WindowCount:
    """Each source's events counted in fixed windows of ``window`` seconds (a window begins at the
    source's first event after its last one ended): the caller answers, say, the first so many of
    each window and not the rest. At most ``max_sources`` sources are remembered: a new one past
    that forgets the least recently seen (which counts afresh if it comes back)."""

    def __init__(self, window: float, clock: Callable[[], float], max_sources: int = MAX_SOURCES) -> None:
        self.window = window
        self.clock = clock
        self.max_sources = max_sources
        self.used: dict[Hashable, tuple[float, int]] = {}  # source -> (its window's start, events in it), least recently seen first

    def __call__(self, source: Hashable) -> int:
        """This event's number in its source's window (1 for the first)."""
        now = self.clock()
        start, n = self.used.get(source, (now, 0))
        if now - start >= self.window:
            start, n = now, 0
        remember(self.used, source, (start, n + 1), self.max_sources)
        return n + 1


class TokenBucket:
    """A token bucket for each sender: it holds ``burst`` tokens at most and fills at ``rate`` a
    second; a sender never seen (or forgotten) has a full one. At most ``max_senders`` buckets are
    kept: past that, the least recently used one is forgotten (its sender starts again with a full
    bucket), so that a flood of new senders costs the busiest ones nothing. The caller passes the
    time."""

    def __init__(self, rate: float, burst: float, max_senders: int = MAX_SOURCES) -> None:
        self.rate = rate
        self.burst = burst
        self.max_senders = max_senders
        self.buckets: dict[Hashable, tuple[float, float]] = {}  # sender -> (tokens, as of when), least recently used first

    def __len__(self) -> int:
        return len(self.buckets)

    def level(self, sender: Hashable, now: float) -> float:
        """The tokens ``sender`` holds at ``now`` (below 0 after an overdraft: see ``spend``)."""
        bucket = self.buckets.get(sender)
        if bucket is None:
            return self.burst
        return min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)

    def take(self, sender: Hashable, n: float, now: float) -> bool:
        """Take ``n`` tokens if ``sender`` holds them: True if it did."""
        tokens = self.level(sender, now)
        ok = tokens >= n
        self._put(sender, tokens - n if ok else tokens, now)
        return ok

    def spend(self, sender: Hashable, n: float, now: float) -> None:
        """Take ``n`` tokens whatever ``sender`` holds (an overdraft leaves it below 0: it holds
        none until the bucket has filled back above 0)."""
        self._put(sender, self.level(sender, now) - n, now)

    def forget(self, sender: Hashable) -> None:
        self.buckets.pop(sender, None)

    def _put(self, sender: Hashable, tokens: float, now: float) -> None:
        remember(self.buckets, sender, (tokens, now), self.max_senders)
