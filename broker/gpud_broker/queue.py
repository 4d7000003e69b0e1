"""The pending queue: requests that cannot be placed now.

Order: higher priority first; at equal priority, round-robin between tenants (the tenant just served
goes to the back); FIFO within a tenant. Bounded in length (``push`` refuses past it: BUSY) and in
time (``expire`` hands back entries whose deadline passed: TIMEOUT). Pure: the caller passes the time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class Queueable(Protocol):
    priority: int
    tenant: str
    deadline: float
    queued: bool


T = TypeVar("T", bound=Queueable)


class PendingQueue(Generic[T]):
    def __init__(self, max_len: int = 10_000) -> None:
        self.max_len = max_len
        # priority -> tenant -> FIFO; tenants kept in round-robin order
        self._levels: dict[int, OrderedDict[str, deque[T]]] = {}
        self._deadlines: list[tuple[float, int, T]] = []
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, item: T, front: bool = False) -> bool:
        """Queue ``item``; False when the queue is full. ``front``: ahead of its tenant's FIFO."""
        if self._len >= self.max_len:
            return False
        tenants = self._levels.setdefault(item.priority, OrderedDict())
        fifo = tenants.get(item.tenant)
        if fifo is None:
            fifo = tenants[item.tenant] = deque()
        if front:
            fifo.appendleft(item)
        else:
            fifo.append(item)
        item.queued = True
        heapq.heappush(self._deadlines, (item.deadline, next(self._seq), item))
        self._len += 1
        return True

    def remove(self, item: T) -> bool:
        """Take ``item`` out (cancel). False when it is not queued."""
        if not item.queued:
            return False
        tenants = self._levels.get(item.priority)
        fifo = tenants.get(item.tenant) if tenants else None
        if fifo is None:
            return False
        try:
            fifo.remove(item)
        except ValueError:
            return False
        self._taken(item, tenants, fifo)  # type: ignore[arg-type]
        return True

    def _taken(self, item: T, tenants: OrderedDict[str, deque[T]], fifo: deque[T]) -> None:
        item.queued = False
        self._len -= 1
        if not fifo:
            del tenants[item.tenant]
            if not tenants:
                del self._levels[item.priority]

    def in_order(self) -> Iterator[T]:
        """Entries in placement order (a snapshot)."""
        for prio in sorted(self._levels, reverse=True):
            tenants = self._levels[prio]
            fifos = [list(f) for f in tenants.values()]
            for row in itertools.zip_longest(*fifos):
                yield from (x for x in row if x is not None)

    def place(self, try_place: Callable[[T], bool], scan_limit: int = 64) -> int:
        """Offer entries in order to ``try_place``; those it accepts leave the queue.

        An entry that does not fit now is skipped (up to ``scan_limit`` skips per call), so small
        work is not held behind large work. Returns how many were placed.
        """
        placed = 0
        skipped = 0
        for prio in sorted(self._levels, reverse=True):
            progress = True
            while progress and prio in self._levels:
                progress = False
                tenants = self._levels[prio]
                for tenant in list(tenants):
                    fifo = tenants.get(tenant)
                    if not fifo:
                        continue
                    for item in list(fifo):
                        if try_place(item):
                            fifo.remove(item)
                            self._taken(item, tenants, fifo)
                            if tenant in tenants:
                                tenants.move_to_end(tenant)
                            placed += 1
                            progress = True
                            break
                        skipped += 1
                        if skipped >= scan_limit:
                            return placed
                    if progress:
                        break
        return placed

    def expire(self, now: float) -> list[T]:
        """Remove and return entries whose deadline has passed."""
        out: list[T] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self._deadlines)
            if item.queued and item.deadline <= now and self.remove(item):
                out.append(item)
        if self._len == 0:
            self._deadlines.clear()
        return out
