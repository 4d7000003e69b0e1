"""The broker's books: what is granted on each GPU (the ledger, kept on the registry's records),
each tenant's fair share of GPU time, and each tenant's limits with what it holds against them.
Pure: no sockets, the caller passes the time.

Every grant is charged here once (``charge``; ``restore`` for one the other broker of a pair
made) and refunded once (``refund``), so the three books always agree. A tenant's budgets belong
here too: ``TenantLimits`` (GPU share, memory, sessions, queued requests) is the first of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


class Accounts:
    """The ledger, fair share and tenant limits of one broker. ``limits`` is empty unless some
    tenant has limits, and then only is ``usage`` kept (the hot path of tenants without limits
    costs nothing more)."""

    def __init__(self, registry: WorkerRegistry, weights: dict[str, float], limits: dict[str, TenantLimits]) -> None:
        self.registry = registry
        self.fair = FairShare(weights)
        self.limits: dict[str, TenantLimits] = dict(limits)
        self.usage: dict[str, TenantUsage] = {}

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
