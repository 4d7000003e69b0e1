"""How the broker ends device sessions: on a close or a loss (its grant refunded, the end
journalled), when its client's lease lapses or a worker holds one the broker does not (a close the
broker makes itself and sends the worker). Pure: no sockets.

Which sessions are open, and what keeps each one open, is ``leases``'; the CALLs a client sends
into a session are the client dialog's (``core``).
"""

from __future__ import annotations

import logging
from typing import Protocol

from gpud import protocol
from gpud_broker.accounts import Accounts
from gpud_broker.dispatcher import Dispatcher
from gpud_broker.leases import SessionLeases
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import Journal
from gpud_broker.tasks import Session, Task, TaskTable

log = logging.getLogger(__name__)


class SessionCore(Protocol):
    """What ending sessions reads of the broker's core (``BrokerCore``): the time, and the tables
    a takeover or a reload replaces."""

    now: float
    journal: Journal
    tasks: TaskTable


class SessionEnds:
    """The ends of the sessions in ``leases``, as the broker decides or learns them."""

    def __init__(self, core: SessionCore, leases: SessionLeases, accounts: Accounts, registry: WorkerRegistry,
                 dispatcher: Dispatcher) -> None:
        self.core = core
        self.leases = leases
        self.accounts = accounts
        self.registry = registry
        self.dispatcher = dispatcher

    def end(self, sid: bytes) -> None:
        """Session ``sid`` ended: out of the leases, journalled, its grant refunded."""
        s = self.leases.sessions.pop(sid, None)
        self.core.journal.end(sid)
        if s is not None:
            self.accounts.refund(s.grant, s.tenant, True, self.core.now, self.registry.by_name.get(s.worker))

    def lost(self, sid: bytes, worker: str) -> None:
        """Session ``sid`` was lost with ``worker``: ended, and the session that replaces it goes
        to that worker's replica first."""
        self.leases.lost[sid] = worker
        self.end(sid)

    def sweep(self, now: float) -> None:
        """End the sessions their workers' heartbeats no longer list (``SessionLeases.gone``)."""
        for s in self.leases.gone(self.registry, now):
            log.info("session %s is no longer on worker %s; ended", protocol.id_text(s.id), s.worker)
            self.lost(s.id, s.worker)

    def expire_lapsed(self, now: float) -> None:
        """Close the sessions whose client has been silent past the lease."""
        for s in self.leases.lapsed(now):
            self._expire(s)

    def _expire(self, s: Session) -> None:
        worker = self.registry.by_name.get(s.worker)
        log.info("session %s: client silent past the %.0fs lease; reclaiming", protocol.id_text(s.id), self.leases.lease)
        if worker is None:
            self.leases.sessions.pop(s.id, None)
            return
        s.closing = True
        self._send_close(worker, s.id, s.tenant, s.id)

    def close_stray(self, worker: WorkerRecord, sid: bytes, tenant: str) -> None:
        """``worker``'s heartbeat lists session ``sid``, which this broker does not hold open there
        (it ended it, or never knew it): the worker closes it, freeing what it holds (PROTOCOL.md
        §9.4). One close at a time: none while the last one sent is unanswered."""
        for task in worker.assigned.values():
            if task.kind == "call" and task.session is None and task.body.get("session") == sid:
                return
        log.info("worker %s still holds session %s, which this broker does not hold; closing it there",
                 worker.name, protocol.id_text(sid))
        self._send_close(worker, sid, tenant, None)

    def _send_close(self, worker: WorkerRecord, sid: bytes, tenant: str, ends: bytes | None) -> None:
        """Send ``worker`` a close of session ``sid``, made by the broker (no client waits for it);
        ``ends``: the session its RESULT ends in the tables (None: one the tables do not hold)."""
        now = self.core.now
        task = Task(
            id=protocol.new_id(), kind="call", need=None,
            body={"session": sid, "op": "close", "args": {}}, frames=[], route=None,
            created=now, deadline=now, tenant=tenant, session=ends,
        )
        self.core.tasks.add(task)
        self.dispatcher.send(worker, task)
