"""Admission: whether the broker takes a new REQUEST, judged before anything is kept for it (its
deadline and payload against the limits, its staged inputs, its tenant's budget and limits) and
whether it may wait in the queue when no GPU can take it now. Pure: no sockets.

Each check answers the error the client is refused with, or None; the client dialog (``core``)
sends the refusal.
"""

from __future__ import annotations

from gpud.errors import Busy, GpudError, NoCapacity, TooLarge
from gpud.protocol import Request
from gpud.resources import Need
from gpud_broker.accounts import Accounts
from gpud_broker.config import BrokerConfig
from gpud_broker.leases import SessionLeases
from gpud_broker.staging import Staging


class Admission:
    """The checks a new REQUEST passes, over the accounts (budgets, limits), the staged uploads
    and the open sessions."""

    def __init__(self, accounts: Accounts, staging: Staging, leases: SessionLeases) -> None:
        self.accounts = accounts
        self.staging = staging
        self.leases = leases

    def refusal(self, rid: bytes, request: Request, need: Need, nbytes: int, owner: str | None,
                config: BrokerConfig) -> GpudError | None:
        """Why ``request`` (id ``rid``, for tenant ``need.tenant``, ``nbytes`` of payload, sent by
        ``owner``) is refused before it is kept; None: it is taken."""
        tenant = need.tenant
        accounts = self.accounts
        budget = accounts.budgets.of(tenant)
        if request.deadline_ms > budget.max_deadline_ms:
            return TooLarge(f"deadline_ms {request.deadline_ms} is over tenant {tenant}'s "
                            f"budget max_deadline_ms ({budget.max_deadline_ms})")
        kind = request.kind
        if nbytes and (kind == "echo" or kind == "job"):
            most = config.max_echo_bytes if kind == "echo" else config.max_job_input_bytes
            if nbytes > most:
                return TooLarge(f"the {kind}'s payload is {nbytes} bytes, over the broker's "
                                f"max_{kind}_{'bytes' if kind == 'echo' else 'input_bytes'} ({most})")
        if kind == "job":
            staged = request.body.get("staged")
            if staged is not None:
                try:
                    self.staging.check(rid, tenant, owner, tuple(staged))
                except GpudError as exc:
                    return exc
        why = accounts.over_budget(tenant, nbytes, self.sessions_of(tenant) if kind == "session" else -1)
        if why is not None:
            return Busy(why)
        if accounts.limits and not accounts.could_ever_admit(tenant, need, kind == "session"):
            return NoCapacity(f"the request is over tenant {tenant}'s limits")
        return None

    def queue_refusal(self, tenant: str, queued: int) -> GpudError | None:
        """Why a request of ``tenant``, which has ``queued`` requests queued, may not wait in the
        queue (None: it may, if the queue has room)."""
        accounts = self.accounts
        if accounts.limits and accounts.queue_full(tenant, queued):
            return Busy(f"tenant {tenant} has as many requests queued as its limit allows; try later")
        if queued >= accounts.budgets.of(tenant).max_queued:
            return Busy(f"tenant {tenant} has {queued} requests queued, its budget max_queued; try later")
        return None

    def sessions_of(self, tenant: str) -> int:
        """Open sessions of ``tenant`` (counted when it asks for one more: sessions are few)."""
        return sum([1 for s in self.leases.sessions.values() if s.tenant == tenant])
