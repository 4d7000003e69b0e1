"""The broker's books: what is granted on each GPU (the ledger, kept on the registry's records),
each tenant's fair share of GPU time, and each tenant's limits with what it holds against them.
Pure: no sockets, the caller passes the time.

Every grant is charged here once (``charge``; ``restore`` for one the other broker of a pair
made) and refunded once (``refund``), so the three books always agree. A tenant's budgets belong
here too: ``TenantLimits`` (GPU share, memory, sessions, queued requests: what it may be granted)
and ``Budgets`` (what the broker holds for it: requests outstanding and queued, their payload
bytes, open sessions, the longest deadline; and the broker's own total of payload bytes), on for
every tenant by default. Work is held once (``hold``, when accepted) and let go once (``let_go``,
when answered), so a tenant's flood stops at its own budgets and other tenants are not affected.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gpud.resources import Grant, Need, TenantLimits
from gpud_broker import ledger
from gpud_broker.queue import FairShare
from gpud_broker.registry import GpuRecord, WorkerRecord, WorkerRegistry


@dataclass(slots=True)
class TenantUsage:
    """What one tenant holds now, for ``TenantLimits`` (kept only while some tenant has limits)."""

    milli: int = 0
    mem: int = 0
    sessions: int = 0


def machine_memory() -> int:
    """This machine's physical memory in bytes (4 GiB when it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """What the broker holds for one tenant at most. Over one, a request is refused BUSY (or
    TOO_LARGE for a deadline) naming it."""

    max_queued: int = 2_500  # requests waiting in the queue
    max_outstanding: int = 5_000  # requests and calls accepted and not yet answered
    max_bytes: int = 1 << 30  # payload bytes of those (queued and in flight)
    max_sessions: int = 256  # open device sessions, those being opened included
    max_deadline_ms: int = 86_400_000  # the longest deadline_ms a request may ask for (a day)
    reply_bytes: int = 64 << 20  # its share of the reply store (finished replies kept for retries)
    max_spool_bytes: int = 8 << 30  # bytes of staged job inputs in the spool (PROTOCOL.md §11.2)


def default_budget(max_queue: int, memory: int | None = None, result_bytes: int = 256 << 20) -> TenantBudget:
    """A tenant's default budget, sized from the global queue and this machine's memory: a quarter
    of the queue (but not under 100 requests, or the whole of a smaller queue), and a sixteenth of
    the memory in payload (at most 4 GiB)."""
    mem = machine_memory() if memory is None else memory
    queued = max(min(max_queue, 100), max_queue // 4)
    return TenantBudget(max_queued=queued, max_outstanding=2 * queued, max_bytes=max(64 << 20, min(4 << 30, mem // 16)),
                        reply_bytes=max(1 << 20, result_bytes // 4))


def default_held_bytes(memory: int | None = None) -> int:
    """The broker's total of payload bytes held (queued and in flight), by default: a quarter of
    this machine's memory."""
    return max(256 << 20, (machine_memory() if memory is None else memory) // 4)


@dataclass(frozen=True, slots=True)
class Budgets:
    """Every tenant's budget (``default``, or its own in ``tenants``) and the broker's total."""

    default: TenantBudget = field(default_factory=TenantBudget)
    tenants: dict[str, TenantBudget] = field(default_factory=dict)
    max_held_bytes: int = 4 << 30  # payload bytes the broker holds for all tenants together
    max_spool_bytes: int = 16 << 30  # staged bytes in the spool for all tenants together (its quota)

    def of(self, tenant: str) -> TenantBudget:
        return self.tenants.get(tenant, self.default)

    def shown(self) -> dict[str, object]:
        """For admin ``status``: the defaults, the tenants' own, the total."""
        return {"default": _fields(self.default), "tenants": {t: _fields(b) for t, b in sorted(self.tenants.items())},
                "max_held_bytes": self.max_held_bytes, "max_spool_bytes": self.max_spool_bytes}


def _fields(b: TenantBudget) -> dict[str, int]:
    return {f: getattr(b, f) for f in TenantBudget.__slots__}


def with_overrides(base: TenantBudget, overrides: dict[str, int]) -> TenantBudget:
    """``base`` with the non-zero ``overrides`` (a tenant's own ``[broker.tenants.NAME]``)."""
    return replace(base, **{k: v for k, v in overrides.items() if v})


@dataclass(slots=True)
class TenantLoad:
    """What the broker holds for one tenant now, against its ``TenantBudget``."""

    outstanding: int = 0
    bytes: int = 0
    opening: int = 0  # session requests among ``outstanding``


class Accounts:
    """The ledger, fair share and tenant limits of one broker. ``limits`` is empty unless some
    tenant has limits, and then only is ``usage`` kept (the hot path of tenants without limits
    costs nothing more)."""

    def __init__(self, registry: WorkerRegistry, weights: dict[str, float], limits: dict[str, TenantLimits],
                 budgets: Budgets | None = None) -> None:
        self.registry = registry
        self.fair = FairShare(weights)
        self.limits: dict[str, TenantLimits] = dict(limits)
        self.usage: dict[str, TenantUsage] = {}
        self.budgets = budgets if budgets is not None else Budgets()
        self.load: dict[str, TenantLoad] = {}
        self.held_bytes = 0  # payload bytes held for all tenants
        self.spooled: dict[str, int] = {}  # bytes of staged uploads reserved, by tenant
        self.spooled_bytes = 0  # and for all tenants

    # ------------------------------------------------------------------ budgets: one hold, one let-go

    def over_budget(self, tenant: str, nbytes: int, sessions_open: int = -1) -> str | None:
        """Why accepting one more request of ``tenant`` with ``nbytes`` of payload is over a
        budget (the message of its BUSY), or None when it is within them all. ``sessions_open``:
        for a session request, how many sessions the tenant has open (-1: not a session)."""
        budget = self.budgets.of(tenant)
        load = self.load.get(tenant)
        if sessions_open >= 0 and sessions_open + (load.opening if load is not None else 0) >= budget.max_sessions:
            return f"tenant {tenant} has {budget.max_sessions} sessions open or opening, its budget max_sessions"
        if load is not None:
            if load.outstanding >= budget.max_outstanding:
                return (f"tenant {tenant} has {load.outstanding} requests outstanding, its budget "
                        f"max_outstanding; try later")
            if load.bytes + nbytes > budget.max_bytes:
                return (f"tenant {tenant} would hold {load.bytes + nbytes} payload bytes, over its budget "
                        f"max_bytes ({budget.max_bytes}); try later")
        elif nbytes > budget.max_bytes:
            return f"the request's {nbytes} payload bytes are over tenant {tenant}'s budget max_bytes ({budget.max_bytes})"
        if self.held_bytes + nbytes > self.budgets.max_held_bytes:
            return (f"the broker holds {self.held_bytes} payload bytes; {nbytes} more are over its budget "
                    f"max_held_bytes ({self.budgets.max_held_bytes}); try later")
        return None

    def hold(self, tenant: str, nbytes: int, session: bool = False) -> None:
        """Count an accepted request (or call) of ``tenant`` with ``nbytes`` of payload."""
        load = self.load.get(tenant)
        if load is None:
            load = self.load[tenant] = TenantLoad()
        load.outstanding += 1
        load.bytes += nbytes
        if session:
            load.opening += 1
        self.held_bytes += nbytes

    def let_go(self, tenant: str, nbytes: int, session: bool = False) -> None:
        """Un-count what ``hold`` counted (the request was answered)."""
        load = self.load[tenant]
        load.outstanding -= 1
        load.bytes -= nbytes
        if session:
            load.opening -= 1
        self.held_bytes -= nbytes
        if not load.outstanding:
            del self.load[tenant]

    # ------------------------------------------------------------------ the spool: one reserve, one release

    def over_spool(self, tenant: str, nbytes: int) -> str | None:
        """Why reserving ``nbytes`` of spool for an upload of ``tenant`` is over a budget (its
        BUSY), or None."""
        mine = self.spooled.get(tenant, 0)
        most = self.budgets.of(tenant).max_spool_bytes
        if mine + nbytes > most:
            return (f"tenant {tenant} would stage {mine + nbytes} bytes, over its budget max_spool_bytes ({most}); "
                    f"try later")
        if self.spooled_bytes + nbytes > self.budgets.max_spool_bytes:
            return (f"the spool holds {self.spooled_bytes} staged bytes; {nbytes} more are over its quota "
                    f"spool_quota_bytes ({self.budgets.max_spool_bytes}); try later")
        return None

    def reserve_spool(self, tenant: str, nbytes: int) -> None:
        self.spooled[tenant] = self.spooled.get(tenant, 0) + nbytes
        self.spooled_bytes += nbytes

    def release_spool(self, tenant: str, nbytes: int) -> None:
        left = self.spooled.get(tenant, 0) - nbytes
        if left > 0:
            self.spooled[tenant] = left
        else:
            self.spooled.pop(tenant, None)
        self.spooled_bytes -= nbytes

    # ------------------------------------------------------------------ one charge, one refund

    def charge(self, worker: WorkerRecord, gpus: list[GpuRecord], need: Need, tenant: str, session: bool,
               now: float, pool: bool = False) -> Grant:
        """Grant ``need`` on ``gpus`` of ``worker`` to ``tenant`` (``session``: it opens one;
        ``pool``: the work holds one of the worker's pool users)."""
        grant = ledger.grant(worker, gpus, need, pool=pool)
        self.fair.grant(tenant, need.total_milli, now)
        if self.limits:
            self._count(tenant, grant, session, 1)
        return grant

    def restore(self, worker: WorkerRecord, grant: Grant, tenant: str, session: bool, now: float) -> bool:
        """Account for a grant the other broker of the pair made (a takeover): facts, not requests
        to fit. False (nothing counted) when one of its GPUs is not registered here."""
        records = self.registry.gpus
        if not all(u in records for u in grant.gpus):
            return False
        ledger.restore(worker, [records[u] for u in grant.gpus], grant)
        self.fair.grant(tenant, grant.gpu_milli * len(grant.gpus), now)
        if self.limits:
            self._count(tenant, grant, session, 1)
        return True

    def refund(self, grant: Grant, tenant: str, session: bool, now: float, worker: WorkerRecord | None) -> None:
        """Give back ``grant`` (once). ``worker`` None: its worker is gone, and its ledger with it."""
        if worker is not None:
            ledger.release(worker, [self.registry.gpus[u] for u in grant.gpus], grant)
        self.fair.release(tenant, grant.gpu_milli * len(grant.gpus), now)
        if self.limits:
            self._count(tenant, grant, session, -1)

    def _count(self, tenant: str, grant: Grant, session: bool, sign: int) -> None:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        n = len(grant.gpus)
        usage.milli += sign * grant.gpu_milli * n
        usage.mem += sign * grant.mem * n
        if session:
            usage.sessions += sign

    # ------------------------------------------------------------------ limits

    def could_ever_admit(self, tenant: str, need: Need, session: bool) -> bool:
        """False when ``need`` alone is over ``tenant``'s limits (it could never be granted)."""
        limits = self.limits.get(tenant)
        return limits is None or limits.could_ever_admit(need, session)

    def within_limits(self, tenant: str, need: Need, session: bool) -> bool:
        """Would granting ``need`` now keep ``tenant`` within its limits?"""
        limits = self.limits.get(tenant)
        if limits is None:
            return True
        usage = self.usage.get(tenant)
        if usage is None:
            return True  # could_ever_admit was checked at the door
        if limits.max_milli is not None and usage.milli + need.total_milli > limits.max_milli:
            return False
        if limits.max_mem is not None and usage.mem + need.mem * need.gpu_count > limits.max_mem:
            return False
        return not (session and limits.max_sessions is not None and usage.sessions >= limits.max_sessions)

    def queue_full(self, tenant: str, queued: int) -> bool:
        """Has ``tenant``, with ``queued`` requests waiting, as many queued as its limit allows?"""
        limits = self.limits.get(tenant)
        return limits is not None and limits.max_queued is not None and queued >= limits.max_queued

    def set_limits(self, limits: dict[str, TenantLimits], held: Iterable[tuple[str, Grant, bool]]) -> None:
        """New limits (configuration reload); what each tenant holds is recounted from ``held``:
        (tenant, grant, is a session) of every live grant."""
        self.limits = dict(limits)
        self.usage = {}
        if self.limits:
            for tenant, grant, session in held:
                self._count(tenant, grant, session, 1)

    # ------------------------------------------------------------------ all of it

    def clear(self) -> None:
        """No grants at all (a passive broker's tables are dropped): the ledger on every
        registered worker back to zero, fair shares forgotten, nothing held."""
        for worker in self.registry.by_identity.values():
            ledger.clear(worker)
        self.fair = FairShare(self.fair.weights)
        self.usage = {}
        self.load = {}
        self.held_bytes = 0
