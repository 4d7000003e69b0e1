"""What workers report about the work they were given: a job's START (answered GO once its mark
is durable), a RESULT (the client answered, the work placed again, or the session opened or
ended), and the ACKs of results once what they changed is durable (every broker ACKs: a
standalone one at once, a pair's once its peer holds it). Pure: no sockets.

A RESULT is judged by its wire code: NOT_ACTIVE fences this broker, SHUTTING_DOWN and a GPU fault
place the work again elsewhere, a staged job that failed before it began is placed again; any
other answer goes to the client (a job's staged outputs are pulled into the spool first).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Protocol

from gpud import protocol
from gpud.errors import (
    Busy,
    GpudError,
    GpuFault,
    NotActive,
    ProtocolError,
    RemoteError,
    SessionLost,
    ShuttingDown,
)
from gpud.protocol import Command, Message, Peer
from gpud_broker.accounts import Accounts
from gpud_broker.config import BrokerConfig
from gpud_broker.dispatcher import Dispatcher, Send
from gpud_broker.leases import SessionLeases
from gpud_broker.queue import PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import Journal
from gpud_broker.sessions import SessionEnds
from gpud_broker.staging import Staging
from gpud_broker.starts import StartGate
from gpud_broker.stats import RequestStats
from gpud_broker.tasks import ENTRY_OVERHEAD, Session, State, Task, TaskTable

log = logging.getLogger(__name__)


# Wire codes a worker's RESULT is judged by.
_NOT_ACTIVE = NotActive.code
_SHUTTING_DOWN = ShuttingDown.code
_GPU_FAULT = GpuFault.code
_SESSION_LOST = SessionLost.code
_REMOTE_ERROR = RemoteError.code

MAX_UNKNOWN_KEPT = 256  # replies kept for RESULTs of ids the broker did not know, per worker at once


class ResultCore(Protocol):
    """What the results read of the broker's core (``BrokerCore``): the time, its role in a pair,
    the tables a takeover replaces, how work ends, and where a job's staged outputs go."""

    now: float
    config: BrokerConfig
    active: bool
    acking: bool  # in a pair: what is durable waits for the peer (ACKs, GOs, output pulls)
    fenced: bool
    journal: Journal
    queue: PendingQueue[Task]
    tasks: TaskTable
    counters: dict[str, int]

    def finish(self, task: Task, reply: list[Any]) -> None: ...
    def fail(self, task: Task, exc: GpudError) -> None: ...
    def pull_outputs(self, worker: WorkerRecord, task: Task, raw_header: bytes, frames: list[Any],
                     staged: Any) -> bool: ...


class Results:
    """Workers' STARTs and RESULTs, and the GOs and ACKs they are owed."""

    def __init__(self, core: ResultCore, registry: WorkerRegistry, accounts: Accounts, leases: SessionLeases,
                 session_ends: SessionEnds, dispatcher: Dispatcher, staging: Staging, stats: RequestStats, send_worker: Send) -> None:
        self.core = core
        self.registry = registry
        self.accounts = accounts
        self.leases = leases
        self.session_ends = session_ends
        self.dispatcher = dispatcher
        self.staging = staging
        self.stats = stats
        self.send_worker = send_worker
        self.starts = StartGate()  # jobs' STARTs: which may have begun, and the GOs waiting to be durable
        self.unacked: deque[tuple[int, bytes, bytes]] = deque()  # (seq, worker, RESULT id) to ACK once durable (standalone: seq 0, at once)
        self.unknown: dict[str, deque[bytes]] = {}  # by worker: ids of RESULTs not known, kept or remembered, oldest first
        self.unknown_dropped = 0  # such RESULTs not kept, so far

    def clear(self) -> None:
        """Forget the GOs and ACKs owed (the tables they were about are gone)."""
        self.unacked.clear()
        self.starts.clear()
        self.unknown.clear()

    # ------------------------------------------------------------------ START and GO

    def on_start(self, worker: WorkerRecord, header: dict[str, Any]) -> None:
        """A START (PROTOCOL.md §4.4): GO at once without a peer; with one, once the marks are
        durable (``take_go``). Refusals go at once: not starting is always safe."""
        core = self.core
        go, refused = self.starts.on_start(worker, header.get("ids"), self._mark_started, core.journal.seq, not core.acking)
        if go or refused:
            self._log_go(worker.name, go, refused)
            self.send_worker(worker.identity, self._go_message(go, refused))

    @staticmethod
    def _log_go(name: str, go: list[bytes], refused: list[bytes] | None = None) -> None:
        """One line per job told GO (it may have begun from here on: chaos tests read these)."""
        if log.isEnabledFor(logging.DEBUG):
            for rid in go:
                log.debug("GO %s to %s", rid.hex(), name)
        for rid in refused or ():
            log.info("START of %s refused to %s: it does not run there", protocol.id_text(rid), name)

    def _mark_started(self, task: Task) -> int:
        journal = self.core.journal
        journal.start(task.id)
        return journal.seq

    @staticmethod
    def _go_message(go: list[bytes], refused: list[bytes] | None = None) -> list[Any]:
        header: dict[str, Any] = {"ids": go}
        if refused:
            header["refused"] = refused
        return protocol.encode(Peer.WORKER, Command.GO, header)

    def take_go(self) -> dict[bytes, list[Any]]:
        """The GO messages due now (their START marks are held by the peer, ``journal.durable``),
        by worker identity."""
        due = self.starts.due(self.core.journal.durable, self.registry)
        by_identity = self.registry.by_identity
        for ident, ids in due.items():
            self._log_go(by_identity[ident].name, ids)
        return {ident: self._go_message(ids) for ident, ids in due.items()}

    def take_acks(self) -> dict[bytes, list[bytes]]:
        """The ACKs due now (their RESULTs' updates are held by the peer, ``journal.durable``; all
        of them without a peer), by worker identity: the shell sends one ACK message per worker."""
        pending, durable = self.unacked, self.core.journal.durable
        acks: dict[bytes, list[bytes]] = {}
        if pending and pending[-1][0] <= durable:  # all due (always, without a peer)
            for _, ident, rid in pending:
                acks.setdefault(ident, []).append(rid)
            pending.clear()
            return acks
        while pending and pending[0][0] <= durable:
            _, ident, rid = pending.popleft()
            acks.setdefault(ident, []).append(rid)
        return acks

    # ------------------------------------------------------------------ RESULT

    def on_result(self, worker: WorkerRecord, msg: Message, raw_header: bytes) -> None:
        """A RESULT. A passive broker leaves results unacknowledged: the active one takes them.
        The ACK waits for what the result changed to be durable (its updates are journalled now;
        a standalone broker's journal keeps nothing, so it is due at once, at the loop turn's end)."""
        core = self.core
        if core.active:
            rid = protocol.get_id(msg.header)
            if self._take(worker, rid, msg, raw_header):
                self.unacked.append((core.journal.seq, worker.identity, rid))

    def _take(self, worker: WorkerRecord, rid: bytes, msg: Message, raw_header: bytes) -> bool:
        """Take the RESULT ``rid``; returns whether to ACK it (False: the worker must keep it)."""
        header = msg.header
        task = worker.assigned.pop(rid, None)
        if task is None or task.state is not State.RUNNING:
            self._on_other_result(worker, rid, msg, raw_header)
            return True
        code = header.get("code")
        if code == _NOT_ACTIVE:
            log.error("worker %s refused %s: a broker with a later epoch is active", worker.name, protocol.id_text(rid))
            worker.assigned[rid] = task
            self.core.fenced = True
            return False
        ok = header.get("ok")
        if ok is not True and (ok is not False or type(code) is not str or type(header.get("message")) is not str):
            log.warning("malformed RESULT %s from %s", protocol.id_text(rid), worker.name)
            ok = False
            raw_header = protocol.packb(protocol.error_header(rid, ProtocolError(f"worker {worker.name} sent a malformed result")))
        if task.grant is not None:  # its slot is free again (``Dispatcher.freed``, inline: every result passes here)
            had = worker.has_slot
            worker.inflight -= 1
            if not had:
                self.dispatcher.open_changed(worker, had)
        if ok is False and self._placed_again(worker, task, code, header):
            return True
        return self._answer(worker, task, ok is True, code, header, raw_header, msg.frames)

    def _placed_again(self, worker: WorkerRecord, task: Task, code: Any, header: dict[str, Any]) -> bool:
        """A failed RESULT that means the work never ran as asked there: placed again elsewhere
        (returns whether it was)."""
        kind = task.kind
        if code == _SHUTTING_DOWN and kind != "call":
            # The worker is stopping and did not start it: place it elsewhere.
            self.dispatcher.set_draining(worker, True)
            why = "the worker is shutting down"
        elif code == _REMOTE_ERROR and kind == "job" and not task.started and self.staging.holds_inputs(task):
            # A staged job its worker could not fetch or set up: it never began (PROTOCOL.md §11.3).
            why = f"it failed there before it began: {header.get('message')}"
            if task.attempts >= self.core.config.max_attempts:  # the same failure everywhere: the job's, not a worker's
                self.release(worker, task)
                self.core.fail(task, RemoteError(f"the job failed before it began on {task.attempts} workers "
                                                 f"(max_attempts), last on {worker.name}: {header.get('message')}"))
                return True
        elif code == _GPU_FAULT and kind not in ("call", "session") and task.retryable:
            why = "its GPU failed"  # it failed under it: place it again, never on this worker
        else:
            return False
        self.release(worker, task)
        self.dispatcher.place_again(task, worker.name, why)
        return True

    def _answer(self, worker: WorkerRecord, task: Task, ok: bool, code: Any, header: dict[str, Any],
                raw_header: bytes, frames: list[Any]) -> bool:
        """Answer ``task``'s client with its RESULT; returns whether to ACK it now (a job's staged
        outputs are pulled first: ACKed once they are here, ``outputs_here``)."""
        core = self.core
        if ok:
            reply = protocol.reply(raw_header, frames)
        else:
            reply = protocol.reply(raw_header)
            self.stats.error(code, task.tenant)
        if header.get("timed_out") is True:
            core.counters["job_timeouts"] += 1
        kind = task.kind
        if kind == "session":
            self._session_answered(worker, task, ok)
        elif kind == "call":
            sid = task.session
            if sid is not None and (task.body.get("op") == "close" or code == _SESSION_LOST or code == _GPU_FAULT):
                if code is not None:  # lost: its replacement goes to the replica first
                    self.session_ends.lost(sid, worker.name)
                else:
                    self.session_ends.end(sid)
        else:
            self.release(worker, task)
            if ok and kind == "job" and "staged" in header:  # its outputs first (PROTOCOL.md §11.5)
                pulling = core.pull_outputs(worker, task, raw_header, list(frames), header["staged"])
                self.dispatcher.place_queued()
                return not pulling
        core.finish(task, reply)
        self.dispatcher.place_queued()
        return True

    def _session_answered(self, worker: WorkerRecord, task: Task, ok: bool) -> None:
        """A session's open was answered: it is open on ``worker`` from now on, or its grant is let go."""
        if not ok:
            self.release(worker, task)
            return
        grant = task.grant
        assert grant is not None  # a session is placed: it has a grant
        now = self.core.now
        s = self.leases.sessions[task.id] = Session(
            id=task.id, worker=worker.name, gpu=grant.gpus[0], grant=grant,
            tenant=task.tenant, route=task.route or b"", last_seen=now, opened=now,
        )
        self.core.journal.session(s)

    def _on_other_result(self, worker: WorkerRecord, rid: bytes, msg: Message, raw_header: bytes) -> None:
        """A RESULT for a task not running on this worker: after a failover, the answer to work
        the old active broker dispatched. Kept (never lost); a duplicate is dropped."""
        core = self.core
        task = core.tasks.tasks.get(rid)
        ok = msg.header.get("ok") is True
        reply = protocol.reply(raw_header, msg.frames) if ok else protocol.reply(raw_header)
        if task is None:
            tenant = msg.header.get("tenant")
            task = Task(id=rid, kind="echo", need=None, body={}, frames=[], route=None, created=core.now,
                        deadline=core.now, tenant=tenant if type(tenant) is str else "default")
            if not self._may_keep_unknown(worker, task, reply):
                return
            core.tasks.add(task)
            self.stats.take_over(task.kind)  # the other broker of the pair accepted it
            log.info("RESULT %s from %s for work this broker did not dispatch: kept for its client", protocol.id_text(rid), worker.name)
            core.finish(task, reply)
        elif task.state is State.QUEUED:
            log.info("RESULT %s from %s for a queued request: it ran already; answered", protocol.id_text(rid), worker.name)
            core.queue.remove(task)
            core.finish(task, reply)
        else:
            log.debug("stale RESULT %s from %s dropped", protocol.id_text(rid), worker.name)

    def _may_keep_unknown(self, worker: WorkerRecord, task: Task, reply: list[Any]) -> bool:
        """Whether to keep a RESULT for an id this broker does not know as the finished reply
        ``task`` (its tenant as the worker says). A worker is not a tenant: it brings back no
        reply dropped early (its retry stays RESULT_EXPIRED) and pushes out none of the tenant's
        replies: one that does not fit the tenant's share as it is is remembered as a reply
        dropped early (a retry gets RESULT_EXPIRED, and the work is not run again). Each worker
        has at most MAX_UNKNOWN_KEPT so kept or remembered at once; past them, nothing is. Either
        way it is ACKed (a RESULT re-sent after its task was answered and forgotten: the worker
        lets go of it)."""
        core = self.core
        tasks = core.tasks
        rid, tenant = task.id, task.tenant
        kept = self.unknown.get(worker.name)
        if kept is None:
            kept = self.unknown[worker.name] = deque()
        if len(kept) >= MAX_UNKNOWN_KEPT:  # forgotten since: no longer counted
            kept = self.unknown[worker.name] = deque(k for k in kept if k in tasks.tasks or k in tasks.expired)
        full = len(kept) >= MAX_UNKNOWN_KEPT
        if full or rid in tasks.expired:
            self._not_kept(worker, rid, "a reply dropped early" if not full else f"{MAX_UNKNOWN_KEPT} kept for its worker")
            return False
        kept.append(rid)
        if tasks.held_by(tenant) + ENTRY_OVERHEAD + sum(map(len, reply)) > tasks.share(tenant):
            tasks.mark_expired(rid, core.now + tasks.result_ttl, tenant)
            core.journal.expired(rid, tasks.result_ttl, tenant)
            self._not_kept(worker, rid, "its tenant's share of the reply store is full: its retry gets RESULT_EXPIRED")
            return False
        return True

    def _not_kept(self, worker: WorkerRecord, rid: bytes, why: str) -> None:
        self.unknown_dropped += 1
        if self.unknown_dropped in (1, 1000) or self.unknown_dropped % 100_000 == 0:
            log.warning("RESULT %s from %s for an id this broker does not know: not kept (%s; %d so far)",
                        protocol.id_text(rid), worker.name, why, self.unknown_dropped)

    def worker_gone(self, name: str) -> None:
        """Worker ``name`` left: what was kept for it stays in the reply store, uncounted."""
        self.unknown.pop(name, None)

    def outputs_here(self, task: Task, reply: list[Any], identity: bytes) -> None:
        """A job's staged outputs are in the spool: answer its client, and owe the ACK of its
        RESULT as any other (``take_acks``: once the reply is durable; a standalone broker's at
        once). The worker holds the outputs until then."""
        core = self.core
        core.finish(task, reply)
        self.unacked.append((core.journal.seq, identity, task.id))

    def outputs_lost(self, task: Task, exc: GpudError, identity: bytes) -> None:
        """A job's staged outputs could not all be pulled into the spool (``exc`` says why; the
        job ran): answer its client so, and owe the ACK of its RESULT as ``outputs_here`` does, so
        that its worker lets go of the outputs it holds for it now, not at its UNACKED_TTL."""
        core = self.core
        core.fail(task, exc)
        self.unacked.append((core.journal.seq, identity, task.id))

    def release(self, worker: WorkerRecord, task: Task) -> None:
        """Refund ``task``'s grant on ``worker``."""
        grant = task.grant
        if grant is not None:
            self.accounts.refund(grant, task.tenant, task.kind == "session", self.core.now, worker)

    def abort_staged(self, task: Task, exc: GpudError) -> None:
        """End a staged job that has not begun and whose inputs will not all come (its upload
        stalled, or the spool lost it): out of the queue, or off its worker, which is told to
        drop it (ERROR, PROTOCOL.md §11.3) and whose slot is freed."""
        self._off_worker(task, exc)
        self.core.fail(task, exc)
        self.dispatcher.place_queued()  # its slot is free

    def park_staged(self, task: Task, exc: GpudError) -> None:
        """Take a staged job that has not begun off its worker (told to drop it with ``exc``), its
        slot freed, to wait for its upload out of the queue (``Staging.parked``): not failed,
        and the placement not counted as an attempt."""
        self._off_worker(task, exc)
        task.state, task.grant, task.worker, task.started = State.QUEUED, None, None, False
        task.attempts -= 1
        self.core.journal.queued(task)
        self.dispatcher.place_queued()  # its slot is free

    def unpark_staged(self, task: Task) -> None:
        """Its upload is complete: a parked staged job is placed again, or queued. Its time
        parked was upload time, not queue time: its queue deadline starts again."""
        core = self.core
        task.deadline = max(task.deadline, core.now + (task.deadline - task.created))
        if not self.dispatcher.try_dispatch(task):
            if self.core.queue.push(task, front=True):
                self.core.journal.queued(task)
            else:
                self.core.fail(task, Busy("the job's upload completed, but the queue is full"))

    def _off_worker(self, task: Task, exc: GpudError) -> None:
        worker = self.registry.by_name.get(task.worker) if task.state is State.RUNNING and task.worker else None
        if worker is not None and worker.assigned.pop(task.id, None) is not None:
            if task.grant is not None:
                self.dispatcher.freed(worker)
            self.release(worker, task)
            self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.ERROR,
                                                              {"code": exc.code, "message": exc.message, "id": task.id}))
