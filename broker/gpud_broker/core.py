"""The broker's core: the dialog with clients, and what happens on every worker and timer event.
No sockets.

The socket shell (``broker.py``) decodes frames and calls ``on_client``/``on_worker``/``tick``; the
core answers through the two send functions it was given. Everything here is driven by the time the
caller passes, so tests run it with a fake clock and plain lists as sockets.

The core owns the tables (tasks, queue) and the broker's role in a pair (``active``, ``epoch``,
``journal``); its parts own the rest, each in its own module: ``admission`` (whether a request is
taken), ``dispatcher`` (placement and DISPATCH), ``workers`` (READY, heartbeats, losses, drain
marks), ``results`` (START, RESULT, GO and ACK), ``sessions`` (sessions' ends), ``accounts`` (ledger, fair share, limits),
``leases`` (sessions), ``takeover`` (the pair's turns) and ``staging`` (staged files).
"""


from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from gpud import protocol
from gpud.errors import (
    Busy,
    Cancelled,
    GpudError,
    InvalidRequest,
    NoCapacity,
    ProtocolError,
    ResultExpired,
    SessionLost,
    Timeout,
    UnknownCommand,
)
from gpud.protocol import Command, Message, Peer, Request
from gpud.resources import Grant, Need, TenantLimits
from gpud_broker import config as broker_config
from gpud_broker import replication
from gpud_broker.accounts import Accounts
from gpud_broker.admission import Admission
from gpud_broker.config import BrokerConfig
from gpud_broker.direct import RELAY_REFUSED, refuses_relay, session_body, silent_worker
from gpud_broker.dispatcher import Dispatcher, Send
from gpud_broker.leases import SessionLeases
from gpud_broker.queue import PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import NULL_JOURNAL, Journal
from gpud_broker.results import Results
from gpud_broker.sessions import SessionEnds
from gpud_broker.spool import Spool
from gpud_broker.staging import Staging
from gpud_broker.stats import RequestStats
from gpud_broker.takeover import Takeover
from gpud_broker.tasks import Session, State, Task, TaskTable
from gpud_broker.workers import WorkerDialog

__all__ = ["ID_IN_USE", "BrokerConfig", "BrokerCore"]

log = logging.getLogger(__name__)


COUNTERS = ("requests", "retries", "errors", "bad_messages", "bad_routes", "worker_losses", "takeovers",
            "job_timeouts", "session_replays", "refused_workers", "fd_pauses", "refused_connections",
            "bad_unanswered", "cut_connections", "worker_suspensions", "worker_resumes", "fetches_on_control",
            "fetches_on_data", "output_chunks_on_control", "output_chunks_on_data")
MAX_OWNERS = 1 << 18  # routing ids whose authenticated sender is remembered (oldest forgotten first)
MAX_USERS = 4096  # ZAP User-Ids whose parse is remembered

# The answer to a REQUEST or CALL whose id belongs to another tenant's work: it says nothing about
# that work (an honest client never meets it: ids are 128 random bits).
ID_IN_USE = "this request id is already in use; send new work under a fresh random id"


class BrokerCore:
    """The broker's dialogs with clients and workers, and its timers, over its tables: the
    registry, the tasks, the queue, the accounts (ledger, fair share, tenant limits), the session
    leases, and its role in a pair (``takeover``, ``journal``). ``rng`` draws the placement samples
    (seeded: the same events place the same way)."""

    def __init__(self, config: BrokerConfig, now: float, send_client: Send, send_worker: Send,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.name = config.name  # not reloadable: it stays
        self.started = now
        self.now = now
        self.send_client = send_client
        self.send_worker = send_worker
        self.registry = WorkerRegistry()
        self.tasks = self._task_table()
        self.accounts = Accounts(self.registry, config.tenant_weights, config.tenant_limits, broker_config.budgets(config))
        self.queue: PendingQueue[Task] = self._queue()
        self.leases = SessionLeases(config.session_lease)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.stats = RequestStats()  # by kind and by error code, for the metrics endpoint
        self._needs = protocol.NeedCache()
        # The broker pair (PROTOCOL.md §9). Standalone: always active, epoch 1, no journal.
        self.active = True
        self.epoch = 1
        self.max_epoch_seen = 1  # the largest epoch any worker or the peer has shown us
        self.fenced = False  # a worker showed a larger epoch while we were active: step down
        self.hold = False  # place nothing (passive, or settling after a takeover)
        self.takeover = Takeover(self)
        self.journal: Journal = NULL_JOURNAL  # replication updates not yet sent (a pair's active broker)
        # In a pair: what must be durable (ACKs, GOs, PUT REPLYs, output pulls) waits for the peer.
        # Every broker ACKs results; a standalone one at once (``Results.take_acks``).
        self.acking = False
        # CURVE: who (tenant and key, the ZAP User-Id) last sent from each routing id. A reply
        # goes to its task's route only while the route's last sender is the task's owner: a
        # connection that took over a routing id under another key never gets another's reply.
        self.owners: dict[bytes, str] = {}
        self._users: dict[str, tuple[str, str]] = {}  # User-Id -> (tenant, owner), memoized
        self.worker_names_bound = False  # CURVE: a worker's name must be its key's name
        # Staged job inputs (PROTOCOL.md §11): the spool and the PUT and FETCH dialogs.
        self.staging = Staging(Spool(config.spool_dir, config.spool_ram_bytes, keep_bytes=config.spool_keep_bytes),
                               config.max_job_input_bytes,
                               config.stage_ttl, config.stage_idle_s)
        self._parts(rng if rng is not None else random.Random(0))

    def _parts(self, rng: random.Random) -> None:
        """The parts the dialogs hand their concerns to (each module's docstring says what it owns)."""
        registry, accounts, leases, send_worker = self.registry, self.accounts, self.leases, self.send_worker
        self.admission = Admission(accounts, self.staging, leases)
        self.dispatcher = Dispatcher(self, registry, accounts, self.stats, send_worker, rng)
        self.session_ends = SessionEnds(self, leases, accounts, registry, self.dispatcher)
        self.results = Results(self, registry, accounts, leases, self.session_ends, self.dispatcher, self.staging,
                               self.stats, send_worker)
        self.starts = self.results.starts  # jobs' STARTs: which may have begun, and the GOs waiting to be durable
        self.unacked = self.results.unacked  # (seq, worker, RESULT id) to ACK once durable
        self.workers = WorkerDialog(self, registry, accounts, leases, self.session_ends, self.dispatcher,
                                    self.takeover.heard, self.starts, send_worker)

    def _task_table(self) -> TaskTable:
        """An empty task table whose replies dropped early are journalled (a pair's passive broker
        then refuses their retries RESULT_EXPIRED too, PROTOCOL.md §9.3)."""
        table = TaskTable(self.config.result_ttl, self.config.result_bytes, self._reply_share)
        table.on_expired = lambda rid, until, tenant: self.journal.expired(rid, until - self.now, tenant)
        return table

    def _queue(self) -> PendingQueue[Task]:
        cfg = self.config
        return PendingQueue(cfg.max_queue, self.accounts.fair, cfg.aging_s, cfg.reserve_after)

    def _reply_share(self, tenant: str) -> int:
        """``tenant``'s share of the reply store, in bytes (its budget)."""
        return self.accounts.budgets.of(tenant).reply_bytes

    @property
    def sessions(self) -> dict[bytes, Session]:
        """Open sessions by id (the leases')."""
        return self.leases.sessions

    # ------------------------------------------------------------------ what the pair asks of its broker
    # (gpud_standby.paired.PairedBroker)

    def join_pair(self) -> None:
        self.become_passive()
        self.acking = True

    def become_passive(self) -> None:
        """Passive from the start (or after a restart): accept no work, hold no tables yet."""
        self.active = False
        self.hold = True
        self.journal = NULL_JOURNAL

    def saw_epoch(self, epoch: int) -> None:
        self.max_epoch_seen = max(self.max_epoch_seen, epoch)

    def witness(self, within: float) -> bool:
        """Does some connected worker still hear another broker that says it is active?"""
        since = self.now - within
        return any(w.other_active_at > since for w in self.registry.by_identity.values())

    def snapshot(self) -> dict[str, Any]:
        self.journal.take()  # what it journalled is in the snapshot
        return replication.snapshot(self)

    def load(self, snap: Any, now: float) -> None:
        self.now = now
        replication.load(self, snap)

    def apply(self, updates: Any, now: float) -> None:
        if type(updates) is not list:
            raise ProtocolError("UPDATES must carry a list of updates")
        self.now = now
        for update in updates:
            replication.apply(self, update)

    def take_over(self, epoch: int, settle: float, now: float) -> None:
        self.takeover.take_over(epoch, settle, now)

    @property
    def settling(self) -> bool:
        return self.takeover.settling_until is not None

    def step_down(self) -> int:
        return self.takeover.step_down()

    def take_updates(self) -> list[list[Any]]:
        return self.journal.take()

    def set_durable(self, seq: int) -> None:
        self.journal.durable = seq

    @property
    def durable(self) -> int:
        return self.journal.durable

    def unheld(self) -> list[bytes]:
        return sorted(self.staging.unheld)

    def peer_unheld(self, jobs: Any) -> None:
        self.staging.peer_unheld(self, jobs)

    def spool_room(self) -> int | None:
        return self.staging.spool.room()

    def peer_spool_room(self, room: Any) -> None:
        self.staging.peer_room = room if type(room) is int else None

    @property
    def seq(self) -> int:
        return self.journal.seq

    # ------------------------------------------------------------------ client dialog

    def on_client(self, identity: bytes, msg: Message, user: str | None = None) -> None:
        """``user``: who the sender authenticated as (CURVE: the ZAP User-Id, ``TENANT KEY``); its
        work is then its tenant's whatever ``need.tenant`` says, ids of other tenants' work behave
        as unknown, replies are bound to the key as well as the routing id, and a direct session
        admits that key alone. None (security none): the declared tenant is taken at its word, no
        scoping; replies by routing id only."""
        cmd = msg.command
        tenant = owner = None
        if user is not None:
            tenant, owner = self._sender(identity, user)
        if cmd is Command.REQUEST:
            self._on_request(identity, msg, tenant, owner)
        elif cmd is Command.CALL:
            self._on_call(identity, msg, tenant, owner)
        elif cmd is Command.PING:
            self.leases.heard(msg.header.get("sessions"), tenant, self.now)
            self.send_client(identity, protocol.pong())
        elif cmd is Command.CANCEL:
            self._on_cancel(msg.header, tenant)
        elif cmd is Command.PUT:
            self.staging.on_put(self, identity, msg, tenant, owner)
        elif cmd is Command.FETCH:
            self.staging.on_client_fetch(self, identity, msg, tenant, owner)
        else:
            raise UnknownCommand(f"command {cmd.name} is not valid from a client")

    def _sender(self, identity: bytes, user: str) -> tuple[str, str]:
        """(tenant, owner) of ZAP User-Id ``user``, remembered as the last sender from ``identity``."""
        who = self._users.get(user)
        if who is None:
            if len(self._users) >= MAX_USERS:
                self._users.clear()
            who = self._users[user] = protocol.parse_client_user(user)
        owner = who[1]
        owners = self.owners
        if owners.get(identity) is not owner:
            if len(owners) >= MAX_OWNERS:
                del owners[next(iter(owners))]
            owners[identity] = owner
        return who

    def _on_request(self, identity: bytes, msg: Message, tenant: str | None = None, owner: str | None = None) -> None:
        rid = protocol.get_id(msg.header)
        self.counters["requests"] += 1
        if self._retry(identity, rid, tenant, owner):
            return
        try:
            request = protocol.parse_request(msg.header, len(msg.frames), self._needs, self.config.default_deadline_ms)
        except GpudError as exc:
            self._refuse(identity, rid, exc, tenant)
            return
        need = request.need
        if tenant is not None and need.tenant != tenant:
            need = self.dispatcher.as_tenant(need, tenant)
        nbytes = sum(map(len, msg.frames)) if msg.frames else 0
        refusal = self.admission.refusal(rid, request, need, nbytes, owner, self.config)
        if refusal is not None:
            self._refuse(identity, rid, refusal, need.tenant)
            return
        task = self._take(identity, rid, msg, request, need, nbytes, owner)
        lost = None
        if request.replaces is not None:
            self.counters["session_replays"] += 1  # a client replays a lost session's journal
            lost = self.leases.lost.get(request.replaces)
            if lost is None:  # still open here: its client found it silent on the direct path first
                lost = silent_worker(self.leases.sessions, request.replaces, tenant)
        dispatcher = self.dispatcher
        if (lost is not None and dispatcher.try_replica(task, lost)) or dispatcher.try_dispatch(task):
            self.stats.accept(task.kind, task.tenant)
        elif len(self.registry) and not dispatcher.could_ever_fit(need):
            self._forget(task)
            self._refuse(identity, rid, NoCapacity("no connected worker has GPUs that could satisfy this request"), task.tenant)
        else:
            self._enqueue(identity, task)

    def _take(self, identity: bytes, rid: bytes, msg: Message, request: Request, need: Need, nbytes: int,
              owner: str | None) -> Task:
        """Keep an admitted request: its task in the tables, its payload held, its update journalled."""
        kind, now = request.kind, self.now
        observe = self.dispatcher.observe
        if observe is not None:
            observe(need)
        body = session_body(self.config.data_path, protocol.user_key(owner)) if kind == "session" else request.body
        task = Task(id=rid, kind=kind, need=need, body=body, frames=msg.frames, route=identity, created=now,
                    deadline=now + request.deadline_ms / 1000.0, priority=need.priority, tenant=need.tenant,
                    retryable=request.retryable, owner=owner, held=nbytes)
        self.tasks.add(task)
        if kind == "job" and request.body.get("staged") is not None:
            self.staging.claim(rid)
        self.accounts.hold(task.tenant, nbytes, kind == "session")
        self.journal.task(task, now)
        return task

    def _enqueue(self, identity: bytes, task: Task) -> None:
        """Queue ``task``, which no GPU can take now (refused when its tenant or the queue is full)."""
        refusal = self.admission.queue_refusal(task.tenant, self.queue.queued_for(task.tenant))
        if refusal is None:
            if self.queue.push(task):
                self.stats.accept(task.kind, task.tenant)
                self.accounts.fair.activate(task.tenant, self.now)
                return
            refusal = Busy(f"the queue is full ({self.config.max_queue} requests); try later")
        self._forget(task)
        self._refuse(identity, task.id, refusal, task.tenant)

    def _forget(self, task: Task) -> None:
        """Drop a task refused after it was made (it never ran; its budgets are let go)."""
        self._let_go(task)
        self._unstage(task)
        self.tasks.forget(task)
        self.journal.forget(task.id)

    def _unstage(self, task: Task) -> None:
        """Release the staged inputs of a job that ended (PROTOCOL.md §11.1)."""
        if task.kind == "job" and "staged" in task.body:
            self.staging.release(self, task.id)

    def _let_go(self, task: Task) -> None:
        if task.held >= 0:
            self.accounts.let_go(task.tenant, task.held, task.kind == "session")
            task.held = -1

    def _refuse(self, identity: bytes, rid: bytes, exc: GpudError, tenant: str | None = None) -> None:
        """Answer a request that was not accepted (nothing is kept: a retry is judged afresh)."""
        self.counters["errors"] += 1
        self.stats.error(exc.code, tenant)
        log.info("refused %s: %s %s", protocol.id_text(rid), exc.code, exc.message)
        self.send_client(identity, protocol.error_reply(rid, exc))

    def _retry(self, identity: bytes, rid: bytes, tenant: str | None, owner: str | None = None) -> bool:
        """A REQUEST or CALL whose id is known: attach it (never run twice; answered with the
        original's reply once there is one), or, when the id is another tenant's or another key's,
        refuse it without saying anything about that work (its client is not touched). False if
        unknown."""
        known = self.tasks.tasks.get(rid)
        if known is None:
            dropped = self.tasks.expired.get(rid) if self.tasks.expired else None
            if dropped is None or (tenant is not None and dropped[1] != tenant):
                return False
            self._refuse(identity, rid, ResultExpired(
                "this request ran, and its reply was dropped before the retry window ended (its tenant's share "
                "of the reply store was full); it is not run again"))
            return True
        if tenant is not None and (known.tenant != tenant or (known.owner is not None and known.owner != owner)):
            log.warning("tenant %s sent an id of another tenant's or key's work (%s); refused", tenant, protocol.id_text(rid))
            self._refuse(identity, rid, InvalidRequest(ID_IN_USE))
            return True
        self.counters["retries"] += 1
        known.route = identity
        if known.state is State.DONE and known.reply is not None:
            self.send_client(identity, known.reply)
        return True

    def _on_call(self, identity: bytes, msg: Message, tenant: str | None = None, owner: str | None = None) -> None:
        rid = protocol.get_id(msg.header)
        if self._retry(identity, rid, tenant, owner):
            return
        try:
            call = protocol.parse_call(msg.header)
            session, worker = self._call_session(call.session, call.op, tenant)
        except GpudError as exc:
            self._refuse(identity, rid, exc)
            return
        nbytes = sum(map(len, msg.frames)) if msg.frames else 0
        why = self.accounts.over_budget(session.tenant, nbytes)
        if why is not None:
            self._refuse(identity, rid, Busy(why), session.tenant)
            return
        now = self.now
        session.last_seen = now
        session.route = identity
        if call.op == "close":
            session.closing = True
        task = Task(id=rid, kind="call", need=None, body={"session": call.session, "op": call.op, "args": call.args},
                    frames=msg.frames, route=identity, created=now, deadline=now, tenant=session.tenant,
                    session=call.session, owner=owner, held=nbytes)
        self.tasks.add(task)
        self.accounts.hold(task.tenant, nbytes)
        self.journal.task(task, now)
        self.stats.accept("call", session.tenant)
        self.dispatcher.send(worker, task)

    def _call_session(self, sid: bytes, op: str, tenant: str | None) -> tuple[Session, WorkerRecord]:
        """The open session a CALL of ``op`` goes to, and its worker (GpudError if there is none,
        or the call may not be relayed)."""
        session = self.leases.sessions.get(sid)
        if session is None or session.closing or (tenant is not None and session.tenant != tenant):
            raise SessionLost(f"session {protocol.id_text(sid)} is unknown or has ended")
        worker = self.registry.by_name.get(session.worker)
        if worker is None:
            raise SessionLost(f"the worker of session {protocol.id_text(sid)} is gone")
        if refuses_relay(self.config.data_path, op):
            raise InvalidRequest(RELAY_REFUSED)
        return session, worker

    def _on_cancel(self, header: dict[str, Any], tenant: str | None = None) -> None:
        task = self.tasks.tasks.get(protocol.get_id(header))
        if task is None or task.state is not State.QUEUED or (tenant is not None and task.tenant != tenant):
            return
        if self.queue.remove(task) or self.staging.parked.pop(task.id, None) is not None:
            self.fail(task, Cancelled("cancelled by its client"))

    def cancel(self, rid: bytes, why: str) -> bool:
        """Cancel queued request ``rid`` (admin ``cancel``): its client gets CANCELLED with ``why``.
        False when it is not queued (unknown, running or done: running work is not stopped)."""
        task = self.tasks.tasks.get(rid)
        if task is None or task.state is not State.QUEUED or not (
                self.queue.remove(task) or self.staging.parked.pop(rid, None) is not None):
            return False
        self.fail(task, Cancelled(why))
        return True

    # ------------------------------------------------------------------ finishing

    def finish(self, task: Task, reply: list[Any]) -> None:
        """End ``task`` with ``reply``: kept for retries, journalled, and sent to its client."""
        if task.held >= 0:
            self._let_go(task)
        self._unstage(task)
        self.tasks.finish(task, reply, self.now)
        self.journal.done(task.id, reply)
        self.stats.finish(task.kind, self.now - task.created)
        self.reply_to(task, reply)

    def reply_to(self, task: Task, reply: list[Any]) -> None:
        """Send ``reply`` to ``task``'s client: to its route, and under CURVE only while that
        route's last sender is the task's owner (else it waits in the reply store for a retry)."""
        route = task.route
        if route is None:
            return
        owner = task.owner
        if owner is not None and self.owners.get(route) != owner:
            log.warning("reply %s withheld: its routing id is now used by another key", protocol.id_text(task.id))
            return
        self.send_client(route, reply)

    def fail(self, task: Task, exc: GpudError) -> None:
        """End ``task`` with ``exc`` (its client is answered; a retry gets the same answer)."""
        self.counters["errors"] += 1
        self.stats.error(exc.code, task.tenant)
        if task.state is State.QUEUED and task.queued:
            self.queue.remove(task)
        self.finish(task, protocol.error_reply(task.id, exc))

    # ------------------------------------------------------------------ worker dialog

    def on_worker(self, identity: bytes, msg: Message, raw_header: bytes, user: str | None = None) -> None:
        """``user``: for a READY or a FETCH under CURVE, the name of the worker's key (the ZAP User-Id)."""
        cmd = msg.command
        worker = self.registry.by_identity.get(identity)
        if cmd is Command.READY:
            self.workers.on_ready(identity, worker, msg.header, user)
            return
        if worker is None:
            if cmd is Command.FETCH and "worker" in msg.header:
                self._on_data_fetch(identity, msg.header, user)
                return
            if cmd is Command.CHUNK and "worker" in msg.header:
                self._on_data_chunk(msg, user)
                return
            # Dropped: a RESULT among them is kept by its worker until ACKed and sent again after
            # its WELCOME (PROTOCOL.md §4.2, §9.4).
            log.info("%s from an unknown worker connection; asking it to reconnect", cmd.name)
            self.send_worker(identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": "unknown worker"}))
            return
        worker.liveness.heard(self.now)
        if worker.suspended_at:
            self.workers.resume(worker)
        if cmd is Command.RESULT:
            self.results.on_result(worker, msg, raw_header)
        elif cmd is Command.HEARTBEAT:
            self.workers.on_heartbeat(worker, msg.header)
        elif cmd is Command.FETCH:
            self.counters["fetches_on_control"] += 1
            if self.active:
                self.staging.on_fetch(self, worker, msg.header)
        elif cmd is Command.CHUNK:
            self.counters["output_chunks_on_control"] += 1
            if self.active:
                self.staging.on_output_chunk(self, worker, msg)
        elif cmd is Command.START:
            if self.active:  # a passive broker leaves STARTs to the active one (the worker asks it again)
                self.results.on_start(worker, msg.header)
        elif cmd is Command.DISCONNECT:
            reason = msg.header.get("reason")
            log.info("worker %s said goodbye (%s)", worker.name, reason if type(reason) is str else "")
            self.workers.lost(worker, "disconnected", graceful=True)
        else:
            raise UnknownCommand(f"command {cmd.name} is not valid from a worker")

    def _data_worker(self, what: str, header: dict[str, Any], user: str | None) -> WorkerRecord:
        """The worker a message on a data connection (PROTOCOL.md §11.3) is bound to: the one it
        names, when that worker is registered, the incarnation is the one its READY said and,
        under CURVE, the connection's key is that worker's. Anything else is a bad message
        (raised: the shell counts and answers it); it touches nothing of the worker named, whose
        liveness is its control connection's alone."""
        name = header.get("worker")
        worker = self.registry.by_name.get(name) if type(name) is str else None
        if (worker is None or not worker.incarnation or header.get("incarnation") != worker.incarnation
                or (self.worker_names_bound and user != worker.name)):
            raise InvalidRequest(f"a {what} on a data connection must name a connected worker and its incarnation, "
                                 "and come with that worker's key")
        return worker

    def _on_data_fetch(self, identity: bytes, header: dict[str, Any], user: str | None) -> None:
        """A FETCH of staged inputs on a worker's data connection, served on that connection."""
        worker = self._data_worker("FETCH", header, user)
        self.counters["fetches_on_data"] += 1
        if self.active:
            self.staging.on_fetch(self, worker, header, identity)

    def _on_data_chunk(self, msg: Message, user: str | None) -> None:
        """A CHUNK of a job's staged outputs on its worker's data connection (§11.5), taken as
        one from that worker's control connection."""
        worker = self._data_worker("CHUNK", msg.header, user)
        self.counters["output_chunks_on_data"] += 1
        if self.active:
            self.staging.on_output_chunk(self, worker, msg)

    def worker_gone(self, name: str) -> None:
        """Worker ``name`` left the registry: the settling and the output pulls stop waiting for it."""
        self.takeover.worker_gone(name)
        self.results.worker_gone(name)
        if self.staging.pulls:
            self.staging.worker_lost(self, name)

    def pull_outputs(self, worker: WorkerRecord, task: Task, raw_header: bytes, frames: list[Any], staged: Any) -> bool:
        """Pull a finished job's staged outputs into the spool (``Staging.pull``)."""
        return self.staging.pull(self, worker, task, raw_header, frames, staged)

    # What the shell and the staging call; the parts do it.

    def take_go(self) -> dict[bytes, list[Any]]:
        return self.results.take_go()

    def take_acks(self) -> dict[bytes, list[bytes]]:
        return self.results.take_acks()

    def outputs_here(self, task: Task, reply: list[Any], identity: bytes) -> None:
        self.results.outputs_here(task, reply, identity)

    def outputs_lost(self, task: Task, exc: GpudError, identity: bytes) -> None:
        self.results.outputs_lost(task, exc, identity)

    def abort_staged(self, task: Task, exc: GpudError) -> None:
        self.results.abort_staged(task, exc)

    def park_staged(self, task: Task, exc: GpudError) -> None:
        self.results.park_staged(task, exc)

    def unpark_staged(self, task: Task) -> None:
        self.results.unpark_staged(task)

    # ------------------------------------------------------------------ configuration

    def apply_config(self, new: BrokerConfig) -> tuple[list[str], list[str]]:
        """Take a reloaded configuration: returns (fields applied, fields that need a restart)."""
        old = self.config
        changed = [f for f in BrokerConfig.__slots__ if getattr(old, f) != getattr(new, f)]
        applied = [f for f in changed if f in broker_config.RELOADABLE]
        kept = [f for f in changed if f not in broker_config.RELOADABLE]
        # Keep the running values of what cannot change live, take the rest.
        self.config = cfg = replace(new, **{f: getattr(old, f) for f in kept})
        if "policy" in applied:
            self.dispatcher.set_policy(cfg.policy)
        self.queue.max_len = cfg.max_queue
        self.queue.aging_s = cfg.aging_s
        self.queue.reserve_after = cfg.reserve_after
        self.tasks.result_ttl = cfg.result_ttl
        self.tasks.max_bytes = cfg.result_bytes
        self.leases.lease = cfg.session_lease
        if "tenant_weights" in applied:
            self.accounts.fair.set_weights(cfg.tenant_weights)
        if "tenant_limits" in applied:
            self.set_tenant_limits(cfg.tenant_limits)
        if "budgets" in applied or "max_queue" in applied:
            self.accounts.budgets = broker_config.budgets(cfg)
        self.dispatcher.place_queued()
        return applied, kept

    def set_tenant_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Replace the limits (configuration reload) and recount what every tenant holds now."""
        self.accounts.set_limits(limits, self._held())
        if self.accounts.limits:
            self.dispatcher.place_queued()

    def _held(self) -> Iterator[tuple[str, Grant, bool]]:
        """(tenant, grant, is a session) of every live grant: open sessions, running work."""
        for s in self.leases.sessions.values():
            yield s.tenant, s.grant, True
        for worker in self.registry.by_identity.values():
            for task in worker.assigned.values():
                if task.grant is not None and task.state is State.RUNNING:
                    yield task.tenant, task.grant, task.kind == "session"

    def clear_work(self) -> None:
        """Forget every task, session, grant and queued request (a passive broker's tables are
        the snapshot it loads next). Workers stay registered."""
        self.tasks = self._task_table()
        self.accounts.clear()
        self.queue = self._queue()
        self.leases.clear()
        self.staging.clear(self)
        self.results.clear()
        for w in self.registry.by_identity.values():
            w.assigned.clear()
            w.inflight = 0
        self.dispatcher.open_workers = self.dispatcher.count_open_workers()

    # ------------------------------------------------------------------ timers

    def tick(self, now: float, caught_up: bool = True) -> None:
        """Heartbeats out, dead workers out, expired queue entries and leases, old replies.
        ``caught_up``: every worker message waiting was read (else no worker is judged silent)."""
        self.now = now
        self.workers.check_liveness(now, caught_up)
        self.takeover.tick(now)
        self.leases.forget_lost()
        if not self.active:
            self.tasks.evict(now)
            return
        self.session_ends.sweep(now)
        for task in self.queue.expire(now):
            self.fail(task, Timeout("no GPU could take the request before its deadline"))
        self.session_ends.expire_lapsed(now)
        if self.staging.spool.uploads:
            self.staging.expire(self, now)
        if self.staging.pulls:
            self.staging.pull_again(self)
        self.tasks.evict(now)

    def fail_queued(self, exc: GpudError) -> int:
        """Answer every queued request with ``exc`` (the broker is draining), and every staged job
        parked to wait for its upload out of the queue; returns how many."""
        queued = [t for t in self.queue.in_order(self.now) if t.state is State.QUEUED]
        queued += self.staging.parked.values()
        self.staging.parked.clear()
        for task in queued:
            self.fail(task, exc)
        return len(queued)

    def dispatched(self) -> int:
        """Requests and session operations sent to live workers and not answered yet: what a
        stopping broker waits for. Work bound to a worker suspended for its silence is not
        waited for: that worker keeps its RESULT until a broker ACKs it, and sends it again to
        the next one that welcomes it (PROTOCOL.md §9.4)."""
        return sum([len(w.assigned) for w in self.registry.by_identity.values() if not w.suspended_at])

    def shutdown(self) -> None:
        """Tell every worker goodbye (the broker is stopping)."""
        for worker in self.registry:
            self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": "broker stopping"}))
