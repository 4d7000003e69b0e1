"""The pending queue: requests that cannot be placed now, and the order in which they get GPUs.

Order: by effective priority (priority plus one whole level per ``aging_s`` seconds waited, so low
priority never starves); at equal effective priority, the tenant with the smallest weighted share
of GPU-time actually granted goes first (``FairShare``), then the tenant served least recently (so
equal tenants alternate); FIFO within a tenant. A request that does not fit now is skipped so
smaller work behind it runs (backfill); once it has waited ``reserve_after`` seconds it reserves a
worker, and backfill stops using that worker until it is placed, which bounds its wait.

Bounded in length (``push`` refuses past it: BUSY) and in time (``expire`` hands back entries whose
deadline passed: TIMEOUT). Pure: the caller passes the time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Queueable(Protocol):
    priority: int
    tenant: str
    deadline: float
    created: float
    queued: bool
    reserved: str | None  # worker this entry has reserved, once it has waited long enough


T = TypeVar("T", bound=Queueable)

DEFAULT_AGING_S = 60.0  # seconds of waiting worth one priority level
DEFAULT_RESERVE_AFTER_S = 30.0  # seconds of waiting after which a blocked entry reserves a worker


@dataclass(slots=True)
class _Share:
    weight: float = 1.0
    usage: float = 0.0  # milli-GPU x seconds granted so far
    granted: int = 0  # milli-GPU granted now
    since: float = 0.0  # time usage was last brought up to date
    served: float = 0.0  # milli-GPU x seconds really granted (usage without the idle floor)


class FairShare:
    """Each tenant's GPU-time actually granted (milli-GPU x seconds), divided by its weight.

    The broker calls ``grant``/``release`` with each grant's total milli-GPU; ``vtime`` is the
    weighted usage the queue orders tenants by. A tenant that comes back after idling starts at
    the smallest usage among the others (it cannot bank credit while it asks for nothing).
    """

    def __init__(self, weights: dict[str, float] | None = None, default_weight: float = 1.0) -> None:
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.tenants: dict[str, _Share] = {}

    def set_weights(self, weights: dict[str, float]) -> None:
        """New weights (configuration reload); GPU-time already granted is kept."""
        self.weights = dict(weights)
        for tenant, share in self.tenants.items():
            share.weight = self.weights.get(tenant, self.default_weight)

    def _get(self, tenant: str, now: float) -> _Share:
        s = self.tenants.get(tenant)
        if s is None:
            weight = self.weights.get(tenant, self.default_weight)
            floor = min((self.vtime(t, now) for t in self.tenants), default=0.0)
            s = self.tenants[tenant] = _Share(weight=weight, usage=floor * weight, since=now)
        return s

    def _advance(self, s: _Share, now: float) -> None:
        if now > s.since:
            used = s.granted * (now - s.since)
            s.usage += used
            s.served += used
            s.since = now

    # grant and release run for every request: a known tenant costs no lookup call.

    def grant(self, tenant: str, milli: int, now: float) -> None:
        s = self.tenants.get(tenant) or self._get(tenant, now)
        if now > s.since:
            self._advance(s, now)
        s.granted += milli

    def release(self, tenant: str, milli: int, now: float) -> None:
        s = self.tenants.get(tenant) or self._get(tenant, now)
        if now > s.since:
            self._advance(s, now)
        s.granted = max(0, s.granted - milli)

    def usage(self, tenant: str, now: float) -> float:
        s = self.tenants.get(tenant)
        if s is None:
            return 0.0
        return s.usage + s.granted * max(0.0, now - s.since)

    def served(self, tenant: str, now: float) -> float:
        """Milli-GPU x seconds really granted to ``tenant`` (what it used; ``usage`` may have been
        raised to the others' floor when it came back from idling)."""
        s = self.tenants.get(tenant)
        if s is None:
            return 0.0
        return s.served + s.granted * max(0.0, now - s.since)

    def vtime(self, tenant: str, now: float) -> float:
        s = self.tenants.get(tenant)
        return 0.0 if s is None else self.usage(tenant, now) / s.weight

    def activate(self, tenant: str, now: float) -> None:
        """A tenant with nothing queued or running asks again: no banked credit from idling."""
        s = self.tenants.get(tenant)
        if s is None:
            self._get(tenant, now)
            return
        if s.granted:
            return
        others = [self.vtime(t, now) for t, o in self.tenants.items() if t != tenant and o.granted]
        if others:
            floor = min(others) * s.weight
            if s.usage < floor:
                s.usage = floor
                s.since = now


TryPlace = Callable[[T, Set[str]], bool]  # (entry, workers it must not use) -> placed?
Reserve = Callable[[T, Set[str]], str | None]  # (entry, workers already reserved) -> worker name


class PendingQueue(Generic[T]):
    def __init__(
        self,
        max_len: int = 10_000,
        fair: FairShare | None = None,
        aging_s: float = DEFAULT_AGING_S,
        reserve_after: float = DEFAULT_RESERVE_AFTER_S,
    ) -> None:
        self.max_len = max_len
        self.fair = fair or FairShare()
        self.aging_s = aging_s
        self.reserve_after = reserve_after
        self._fifos: dict[tuple[int, str], deque[T]] = {}
        self._reserved: dict[int, T] = {}  # id(entry) -> entry holding a reservation
        self._deadlines: list[tuple[float, int, T]] = []
        self._seq = itertools.count()
        self._served: dict[str, int] = {}  # tenant -> when last served (round robin at equal share)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def queued_for(self, tenant: str) -> int:
        """How many entries of ``tenant`` are waiting (all priorities)."""
        return sum([len(f) for (_, t), f in self._fifos.items() if t == tenant])

    def depths(self) -> dict[tuple[int, str], int]:
        """Queued entries by (priority, tenant)."""
        return {key: len(fifo) for key, fifo in list(self._fifos.items())}

    @property
    def reservations(self) -> dict[str, T]:
        """Worker name -> the entry that has reserved it."""
        return {e.reserved: e for e in self._reserved.values() if e.reserved is not None}

    def push(self, item: T, front: bool = False) -> bool:
        """Queue ``item``; False when the queue is full. ``front``: ahead of its tenant's FIFO."""
        if self._len >= self.max_len:
            return False
        key = (item.priority, item.tenant)
        fifo = self._fifos.get(key)
        if fifo is None:
            fifo = self._fifos[key] = deque()
        if front:
            fifo.appendleft(item)
        else:
            fifo.append(item)
        item.queued = True
        deadlines = self._deadlines
        if len(deadlines) > 2 * self._len + 1024:
            # Entries that left the queue linger in the heap until their deadline; drop them.
            deadlines[:] = [d for d in deadlines if d[2].queued]
            heapq.heapify(deadlines)
        heapq.heappush(deadlines, (item.deadline, next(self._seq), item))
        self._len += 1
        return True

    def remove(self, item: T) -> bool:
        """Take ``item`` out (placed, cancelled, expired). False when it is not queued."""
        if not item.queued:
            return False
        key = (item.priority, item.tenant)
        fifo = self._fifos.get(key)
        if fifo is None:
            return False
        try:
            fifo.remove(item)
        except ValueError:
            return False
        item.queued = False
        item.reserved = None
        self._reserved.pop(id(item), None)
        self._len -= 1
        if not fifo:
            del self._fifos[key]
        return True

    def drop_reservations_on(self, worker: str) -> None:
        """A worker is gone: entries that had reserved it reserve again later."""
        for e in list(self._reserved.values()):
            if e.reserved == worker:
                e.reserved = None
                del self._reserved[id(e)]

    def effective_priority(self, item: T, now: float) -> float:
        """Its priority plus one level per ``aging_s`` seconds waited."""
        waited = max(0.0, now - item.created)
        return item.priority + (waited // self.aging_s if self.aging_s > 0 else 0.0)

    def _rank(self, fifo: deque[T], now: float, served: dict[str, int]) -> tuple[float, float, int, float]:
        head = fifo[0]
        return (-self.effective_priority(head, now), self.fair.vtime(head.tenant, now), served.get(head.tenant, 0), head.created)

    def in_order(self, now: float = 0.0) -> Iterator[T]:
        """Entries in the order ``place`` would offer them if everything fit (a snapshot)."""
        fifos = {k: deque(f) for k, f in self._fifos.items()}
        served = dict(self._served)
        serial = max(served.values(), default=0)
        while fifos:
            key = min(fifos, key=lambda k: self._rank(fifos[k], now, served))
            fifo = fifos[key]
            yield fifo.popleft()
            serial += 1
            served[key[1]] = serial
            if not fifo:
                del fifos[key]

    def place(self, try_place: TryPlace[T], now: float = 0.0, reserve: Reserve[T] | None = None,
              scan_limit: int = 64) -> int:
        """Offer entries, best first, to ``try_place``; those it accepts leave the queue.

        An entry that does not fit is skipped (backfill), at most ``scan_limit`` skips per call. The
        best-ranked waiting entry, once it has waited ``reserve_after`` seconds, asks ``reserve`` for
        a worker; no other entry may then be placed on that worker. Returns how many were placed.
        """
        placed = 0
        skipped = 0
        blocked: set[tuple[int, str]] = set()
        fifos = self._fifos
        taken: set[str] = {e.reserved for e in self._reserved.values() if e.reserved is not None}
        while skipped < scan_limit and len(blocked) < len(fifos):
            if len(fifos) == 1:
                key = next(iter(fifos))
            else:
                key = min((k for k in fifos if k not in blocked),
                          key=lambda k: self._rank(fifos[k], now, self._served))
            fifo = fifos[key]
            head = fifo[0]
            progress = False
            for item in itertools.islice(fifo, 0, scan_limit - skipped):
                excluded = taken - {item.reserved} if item.reserved is not None else taken
                if try_place(item, excluded):
                    self.remove(item)  # breaks out before the FIFO is iterated further
                    self._served[item.tenant] = next(self._seq)
                    if item.reserved is not None:
                        taken.discard(item.reserved)
                    placed += 1
                    progress = True
                    break
                # Only the best-ranked entry still waiting may reserve: it is the one that
                # backfill would otherwise pass by.
                if (reserve is not None and item is head and item.reserved is None and not blocked
                        and now - item.created >= self.reserve_after):
                    worker = reserve(item, set(taken))
                    if worker is not None:
                        item.reserved = worker
                        self._reserved[id(item)] = item
                        taken.add(worker)
                skipped += 1
            if not progress:
                blocked.add(key)
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


# --------------------------------------------------------------------------- why an entry waits


@dataclass(frozen=True, slots=True)
class WaitFacts:
    """What decides whether one queued entry is placed, as the broker sees it now."""

    held: str | None  # why the broker places nothing at all now; None: it places
    within_limits: bool  # its tenant may take this grant under the tenant's limits
    ever_fits: bool  # some connected worker could take it if that worker were idle
    fits_now: bool  # some GPU could take it now
    fits_unreserved: bool  # ... on a worker no other (older) entry has reserved
    ahead_higher: int  # entries ahead of it with a higher effective priority
    ahead_same: int  # entries ahead of it at its effective priority (tenants with less fair share)
    reserved: str | None = None  # the worker it has reserved


WAIT_REASONS = ("held", "tenant_limit", "no_gpu_ever", "no_gpu_fits", "reserved", "priority", "fair_share", "next")
"""The codes ``why_waiting`` gives, in the order it checks them."""


def why_waiting(f: WaitFacts) -> tuple[str, str]:
    """Why an entry is still queued: a code of ``WAIT_REASONS`` and a sentence for people.

    The first that holds, in this order: the broker places nothing now; its tenant's limits;
    no GPU could ever take it; none can now; it fits only where an older entry has reserved; it
    is behind higher priority; behind tenants with less weighted share; none of these (it goes
    at the next placement round)."""
    if f.held is not None:
        return "held", f"the broker places nothing now: {f.held}"
    if not f.within_limits:
        return "tenant_limit", "its tenant holds as much as its limits allow; it goes when the tenant holds less"
    if not f.ever_fits:
        return "no_gpu_ever", "no connected worker could ever take it (GPU count, model, memory, CPU or host memory)"
    if not f.fits_now:
        mine = f"; it has reserved worker {f.reserved}" if f.reserved else ""
        return "no_gpu_fits", f"no GPU fits it now; it goes when enough is free{mine}"
    if not f.fits_unreserved:
        return "reserved", "it fits only on workers reserved for requests that have waited longer"
    if f.ahead_higher:
        return "priority", f"behind {f.ahead_higher} request(s) of higher priority"
    if f.ahead_same:
        return "fair_share", f"behind {f.ahead_same} request(s) of tenants with less fair share used"
    return "next", "it fits: it goes at the next placement round"
