"""The broker's core: what happens on every client, worker and timer event. No sockets.

The socket shell (``broker.py``) decodes frames and calls ``on_client``/``on_worker``/``tick``; the
core answers through the two send functions it was given. Everything here is driven by the time the
caller passes, so tests run it with a fake clock and plain lists as sockets.

Placement at scale. Each decision (the policy call) is timed into ``placement_times`` (admin
``status`` shows its p50/p99). With the ``balanced`` policy and more than ``SAMPLE_ABOVE``
workers, the policy is first offered ``SAMPLE_K`` workers drawn at random from the registry
(power-of-k-choices: the least-loaded GPU of the sample, not of the cluster), and the whole
cluster only when none of the sample can take the request; so one decision costs about the same
with 1,000 workers as with 16, and a request that only a few workers can take still finds them.
The default, ``fgd-balanced``, samples inside the policy (``policies``: random workers plus
the ones it chose last); ``fgd`` and the packing policies always see every worker. ``open_workers`` counts the
workers with a free slot (not draining, fewer requests in flight than slots), kept at every
dispatch, result, worker arrival and loss, and drain change: while it is 0 nothing can be placed,
and placing returns at once instead of asking the policy to scan every worker.
"""


from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Any

from gpud import protocol
from gpud.errors import (
    Busy,
    Cancelled,
    GpudError,
    GpuFault,
    InvalidRequest,
    NoCapacity,
    NotActive,
    ProtocolError,
    RemoteError,
    ResultExpired,
    SessionLost,
    ShuttingDown,
    Timeout,
    TooLarge,
    UnknownCommand,
    WorkerLost,
)
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud.resources import Grant, Need, TenantLimits
from gpud_broker import replication
from gpud_broker.accounts import (
    Accounts,
    Budgets,
    default_budget,
    default_held_bytes,
    machine_memory,
)
from gpud_broker.direct import (
    RELAY_REFUSED,
    refuses_relay,
    renew_leases,
    session_body,
    silent_worker,
)
from gpud_broker.gate import ConnectionLimits
from gpud_broker.leases import SessionLeases
from gpud_broker.mix import TaskMix
from gpud_broker.policies import (
    FACTORIES,
    SAMPLE_ABOVE,
    SAMPLE_K,
    could_ever_fit,
    make_policy,
    pool_blocked,
    reserve_worker,
)
from gpud_broker.queue import DEFAULT_AGING_S, DEFAULT_RESERVE_AFTER_S, PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import NULL_JOURNAL, Journal
from gpud_broker.spool import DEFAULT_RAM_BYTES, DEFAULT_STAGE_TTL_S, Spool
from gpud_broker.staging import Staging
from gpud_broker.starts import Loss, StartGate, on_loss
from gpud_broker.stats import PlacementTimes, RequestStats
from gpud_broker.takeover import Takeover
from gpud_broker.tasks import Session, State, Task, TaskTable

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], object]

MAX_RUNNING_KEPT = 1000  # entries of a heartbeat's running list kept (more: it may be cut short)
DEFAULT_RESULT_BYTES = 256 << 20  # the reply store's default size
MAX_OWNERS = 1 << 18  # routing ids whose authenticated sender is remembered (oldest forgotten first)


DEFAULT_MAX_JOB_INPUT_BYTES = 4 << 30
DEFAULT_MAX_ECHO_BYTES = 256 << 10  # an echo is a probe; big data travels as staged files or session copies


def default_max_message_bytes() -> int:
    """The largest message by default: 1 GiB, or an eighth of this machine's memory if less."""
    return min(protocol.DEFAULT_MAX_MESSAGE_BYTES, machine_memory() // 8)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    name: str = "broker"
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    policy: str = "fgd-balanced"
    max_queue: int = 10_000
    default_deadline_ms: int = 30_000
    result_ttl: float = 60.0  # seconds a finished reply is kept for retries
    result_bytes: int = DEFAULT_RESULT_BYTES  # bytes of finished replies kept at most
    session_lease: float = 30.0  # seconds without hearing from a session's client
    max_attempts: int = 3  # placements of one request across worker losses
    max_message_bytes: int = field(default_factory=lambda: default_max_message_bytes())
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights (default 1)
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)  # per tenant (default: none)
    aging_s: float = DEFAULT_AGING_S  # seconds of waiting worth one priority level
    reserve_after: float = DEFAULT_RESERVE_AFTER_S  # seconds before a blocked request reserves a worker
    drain_timeout: float = 10.0  # seconds dispatched work may take to finish after SIGTERM (the shell's)
    tenant_pool_share: float = 0.5  # most of a worker's pool users one tenant may hold (policies.pool_allows)
    data_path: str = "auto"  # "broker": no session's CALLs go straight to its worker (PROTOCOL.md §10)
    budgets: Budgets | None = None  # what the broker holds per tenant and in all (None: sized from the machine)
    # The shell's: frontend connections per source and in all (None: sized from the descriptor
    # limit, gate.default_limits), and libzmq's I/O threads (0: sized from the CPUs).
    connection_limits: ConnectionLimits | None = None
    io_threads: int = 0
    echo_bytes_in_flight: int = 0  # the shell's: each sender's echo payload in flight (0: max_echo_bytes; intake.EchoShare)
    max_job_input_bytes: int = DEFAULT_MAX_JOB_INPUT_BYTES  # a job's input files together (PROTOCOL.md §11)
    max_echo_bytes: int = DEFAULT_MAX_ECHO_BYTES  # an echo's payload
    spool_dir: str = ""  # where staged inputs are spooled ("": a temporary directory of its own)
    spool_ram_bytes: int = DEFAULT_RAM_BYTES  # staged bytes held in memory at most (small files)
    stage_ttl: float = DEFAULT_STAGE_TTL_S  # seconds an upload no job claims is kept after its last PUT

    def __post_init__(self) -> None:
        if self.policy not in FACTORIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(FACTORIES)}")


# The answer to a REQUEST or CALL whose id belongs to another tenant's work: it says nothing about
# that work (an honest client never meets it: ids are 128 random bits).
ID_IN_USE = "this request id is already in use; send new work under a fresh random id"

# Wire codes a worker's RESULT is judged by.
_NOT_ACTIVE = NotActive.code
_SHUTTING_DOWN = ShuttingDown.code
_GPU_FAULT = GpuFault.code
_SESSION_LOST = SessionLost.code
_REMOTE_ERROR = RemoteError.code


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
        self.accounts = Accounts(self.registry, config.tenant_weights, config.tenant_limits, self._budgets(config))
        self.queue: PendingQueue[Task] = PendingQueue(config.max_queue, self.accounts.fair, config.aging_s, config.reserve_after)
        self.leases = SessionLeases(config.session_lease)
        # The running mix of requests the fragmentation-aware policies judge against: fed with
        # every accepted request's need, only when such a policy is configured.
        self.mix = TaskMix()
        self.policy = make_policy(config.policy, mix=self.mix)
        self._observe = self.mix.observe if config.policy.startswith("fgd") else None
        self.counters = {"requests": 0, "retries": 0, "errors": 0, "bad_messages": 0, "bad_routes": 0, "worker_losses": 0, "takeovers": 0,
                         "job_timeouts": 0, "session_replays": 0, "refused_workers": 0, "fd_pauses": 0,
                         "refused_connections": 0}
        self.stats = RequestStats()  # by kind and by error code, for the metrics endpoint
        self.placement_times = PlacementTimes()  # seconds per placement decision (admin status)
        self.open_workers = 0  # registered workers with a free slot (see the module docstring)
        self.rng = rng if rng is not None else random.Random(0)
        self._needs = protocol.NeedCache()
        self._fits: dict[Need, bool] = {}  # could_ever_fit by need; cleared when workers change
        self._tenant_needs: dict[tuple[Need, str], Need] = {}
        # The broker pair (PROTOCOL.md §9). Standalone: always active, epoch 1, no journal.
        self.active = True
        self.epoch = 1
        self.max_epoch_seen = 1  # the largest epoch any worker or the peer has shown us
        self.fenced = False  # a worker showed a larger epoch while we were active: step down
        self.hold = False  # place nothing (passive, or settling after a takeover)
        self.takeover = Takeover(self)
        self.journal: Journal = NULL_JOURNAL  # replication updates not yet sent (a pair's active broker)
        self.acking = False  # in a pair: workers keep results until ACKed (standalone: no ACKs)
        self.unacked: deque[tuple[int, bytes, bytes]] = deque()  # (seq, worker, RESULT id) to ACK once durable
        self.starts = StartGate()  # jobs' STARTs: which may have begun, and the GOs waiting to be durable
        # CURVE: who (tenant and key, the ZAP User-Id) last sent from each routing id. A reply
        # goes to its task's route only while the route's last sender is the task's owner: a
        # connection that took over a routing id under another key never gets another's reply.
        self.owners: dict[bytes, str] = {}
        self._users: dict[str, tuple[str, str]] = {}  # User-Id -> (tenant, owner), memoized
        self.worker_names_bound = False  # CURVE: a worker's name must be its key's name
        # Staged job inputs (PROTOCOL.md §11): the spool and the PUT and FETCH dialogs.
        self.staging = Staging(Spool(config.spool_dir, config.spool_ram_bytes), config.max_job_input_bytes,
                               config.stage_ttl)

    def _task_table(self) -> TaskTable:
        """An empty task table whose replies dropped early are journalled (a pair's passive broker
        then refuses their retries RESULT_EXPIRED too, PROTOCOL.md §9.3)."""
        table = TaskTable(self.config.result_ttl, self.config.result_bytes, self._reply_share)
        table.on_expired = lambda rid, until, tenant: self.journal.expired(rid, until - self.now, tenant)
        return table

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
            who = self._users.get(user)
            if who is None:
                if len(self._users) >= 4096:
                    self._users.clear()
                who = self._users[user] = protocol.parse_client_user(user)
            tenant, owner = who
            owners = self.owners
            if owners.get(identity) is not owner:
                if len(owners) >= MAX_OWNERS:
                    del owners[next(iter(owners))]
                owners[identity] = owner
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

    def _on_request(self, identity: bytes, msg: Message, tenant: str | None = None, owner: str | None = None) -> None:
        header = msg.header
        rid = protocol.get_id(header)
        self.counters["requests"] += 1
        if self._retry(identity, rid, tenant, owner):
            return
        try:
            request = protocol.parse_request(header, len(msg.frames), self._needs, self.config.default_deadline_ms)
        except GpudError as exc:
            self._refuse(identity, rid, exc, tenant)
            return
        kind, need = request.kind, request.need
        if tenant is not None and need.tenant != tenant:
            need = self._as_tenant(need, tenant)
        accounts = self.accounts
        budget = accounts.budgets.of(need.tenant)
        if request.deadline_ms > budget.max_deadline_ms:
            self._refuse(identity, rid, TooLarge(f"deadline_ms {request.deadline_ms} is over tenant {need.tenant}'s "
                                                 f"budget max_deadline_ms ({budget.max_deadline_ms})"), need.tenant)
            return
        nbytes = sum([len(f) for f in msg.frames]) if msg.frames else 0
        if nbytes and (kind == "echo" or kind == "job"):
            most = self.config.max_echo_bytes if kind == "echo" else self.config.max_job_input_bytes
            if nbytes > most:
                self._refuse(identity, rid, TooLarge(f"the {kind}'s payload is {nbytes} bytes, over the broker's "
                                                     f"max_{kind}_{'bytes' if kind == 'echo' else 'input_bytes'} ({most})"),
                             need.tenant)
                return
        staged = request.body.get("staged") if kind == "job" else None
        if staged is not None:
            try:
                self.staging.check(rid, need.tenant, owner, tuple(staged))
            except GpudError as exc:
                self._refuse(identity, rid, exc, need.tenant)
                return
        why = accounts.over_budget(need.tenant, nbytes, self._sessions_of(need.tenant) if kind == "session" else -1)
        if why is not None:
            self._refuse(identity, rid, Busy(why), need.tenant)
            return
        if accounts.limits and not accounts.could_ever_admit(need.tenant, need, kind == "session"):
            self._refuse(identity, rid, NoCapacity(f"the request is over tenant {need.tenant}'s limits"), need.tenant)
            return
        if self._observe is not None:
            self._observe(need)
        now = self.now
        body = session_body(self.config.data_path, protocol.user_key(owner)) if kind == "session" else request.body
        task = Task(id=rid, kind=kind, need=need, body=body, frames=msg.frames, route=identity, created=now,
                    deadline=now + request.deadline_ms / 1000.0, priority=need.priority, tenant=need.tenant,
                    retryable=request.retryable, owner=owner, held=nbytes)
        self.tasks.add(task)
        if staged is not None:
            self.staging.claim(rid)
        accounts.hold(task.tenant, nbytes, kind == "session")
        self.journal.task(task, now)
        lost = None
        if request.replaces is not None:
            self.counters["session_replays"] += 1  # a client replays a lost session's journal
            lost = self.leases.lost.get(request.replaces)
            if lost is None:  # still open here: its client found it silent on the direct path first
                lost = silent_worker(self.leases.sessions, request.replaces, tenant)
        if (lost is not None and self._try_replica(task, lost)) or self._try_dispatch(task):
            self.stats.accept(kind, task.tenant)
            return
        if len(self.registry) and not self._could_ever_fit(need):
            self._forget(task)
            self._refuse(identity, rid, NoCapacity("no connected worker has GPUs that could satisfy this request"), task.tenant)
            return
        queued = self.queue.queued_for(task.tenant)
        if accounts.limits and accounts.queue_full(task.tenant, queued):
            self._forget(task)
            self._refuse(identity, rid, Busy(f"tenant {task.tenant} has as many requests queued as its limit allows; try later"),
                         task.tenant)
        elif queued >= budget.max_queued:
            self._forget(task)
            self._refuse(identity, rid, Busy(f"tenant {task.tenant} has {queued} requests queued, its budget max_queued; try later"),
                         task.tenant)
        elif self.queue.push(task):
            self.stats.accept(kind, task.tenant)
            accounts.fair.activate(task.tenant, now)
        else:
            self._forget(task)
            self._refuse(identity, rid, Busy(f"the queue is full ({self.config.max_queue} requests); try later"), task.tenant)

    def _sessions_of(self, tenant: str) -> int:
        """Open sessions of ``tenant`` (counted when it asks for one more: sessions are few)."""
        return sum([1 for s in self.leases.sessions.values() if s.tenant == tenant])

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

    def _as_tenant(self, need: Need, tenant: str) -> Need:
        """``need`` with the authenticated tenant in place of the declared one (memoized)."""
        key = (need, tenant)
        out = self._tenant_needs.get(key)
        if out is None:
            if len(self._tenant_needs) >= 4096:
                self._tenant_needs.clear()
            out = self._tenant_needs[key] = replace(need, tenant=tenant)
        if need.tenant != "default":
            log.debug("a client of tenant %s declared tenant %s; using %s", tenant, need.tenant, tenant)
        return out

    def _could_ever_fit(self, need: Need) -> bool:
        """could_ever_fit, remembered until the set of workers changes."""
        fits = self._fits.get(need)
        if fits is None:
            fits = self._fits[need] = could_ever_fit(need, self.registry.by_identity.values())
        return fits

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
        header = msg.header
        rid = protocol.get_id(header)
        if self._retry(identity, rid, tenant, owner):
            return
        try:
            call = protocol.parse_call(header)
            session = self.leases.sessions.get(call.session)
            if session is None or session.closing or (tenant is not None and session.tenant != tenant):
                raise SessionLost(f"session {protocol.id_text(call.session)} is unknown or has ended")
            worker = self.registry.by_name.get(session.worker)
            if worker is None:
                raise SessionLost(f"the worker of session {protocol.id_text(call.session)} is gone")
            if refuses_relay(self.config.data_path, call.op):
                raise InvalidRequest(RELAY_REFUSED)
        except GpudError as exc:
            self._refuse(identity, rid, exc)
            return
        nbytes = sum([len(f) for f in msg.frames]) if msg.frames else 0
        why = self.accounts.over_budget(session.tenant, nbytes)
        if why is not None:
            self._refuse(identity, rid, Busy(why), session.tenant)
            return
        now = self.now
        session.last_seen = now
        session.route = identity
        if call.op == "close":
            session.closing = True
        task = Task(
            id=rid,
            kind="call",
            need=None,
            body={"session": call.session, "op": call.op, "args": call.args},
            frames=msg.frames,
            route=identity,
            created=now,
            deadline=now,
            tenant=session.tenant,
            session=call.session,
            owner=owner,
            held=nbytes,
        )
        self.tasks.add(task)
        self.accounts.hold(task.tenant, nbytes)
        self.journal.task(task, now)
        self.stats.accept("call", session.tenant)
        self._send_dispatch(worker, task)

    def _on_cancel(self, header: dict[str, Any], tenant: str | None = None) -> None:
        task = self.tasks.tasks.get(protocol.get_id(header))
        if task is None or task.state is not State.QUEUED or (tenant is not None and task.tenant != tenant):
            return
        if self.queue.remove(task):
            self.fail(task, Cancelled("cancelled by its client"))

    def cancel(self, rid: bytes, why: str) -> bool:
        """Cancel queued request ``rid`` (admin ``cancel``): its client gets CANCELLED with ``why``.
        False when it is not queued (unknown, running or done: running work is not stopped)."""
        task = self.tasks.tasks.get(rid)
        if task is None or task.state is not State.QUEUED or not self.queue.remove(task):
            return False
        self.fail(task, Cancelled(why))
        return True

    # ------------------------------------------------------------------ placement

    def _try_dispatch(self, task: Task, excluded: Set[str] = frozenset()) -> bool:
        """Place and dispatch ``task`` now if some GPU can take it (never on ``excluded`` workers)."""
        need = task.need
        assert need is not None  # only placed kinds reach here
        if self.open_workers <= 0 or self.hold:
            return False  # no worker has a free slot (or placing is held): nothing can be placed
        accounts = self.accounts
        if accounts.limits and not accounts.within_limits(task.tenant, need, task.kind == "session"):
            return False  # it waits until its tenant holds less
        avoid = task.avoid | excluded if excluded else task.avoid
        registry = self.registry
        if task.kind in ("job", "session"):  # work that holds a pool user on its worker
            blocked = pool_blocked(task.kind, task.tenant, registry.pool_index.candidates(task.tenant),
                                   self.config.tenant_pool_share)
            if blocked:
                avoid = avoid | blocked
        t0 = perf_counter()
        # Sampling keeps the intent of a load-spreading policy only (the policy may change on reload).
        if len(registry.workers) > SAMPLE_ABOVE and self.config.policy == "balanced":
            placement = self.policy(need, registry.sample(SAMPLE_K, self.rng), avoid)
            if placement is None:  # none of the sample can take it: ask the whole cluster
                placement = self.policy(need, registry.by_identity.values(), avoid)
        else:
            placement = self.policy(need, registry.by_identity.values(), avoid)
        self.placement_times.record(perf_counter() - t0)
        if placement is None:
            return False
        worker = placement.worker
        task.grant = accounts.charge(worker, placement.gpus, need, task.tenant, task.kind == "session", self.now,
                                     pool=task.kind in worker.pool_kinds)
        task.attempts += 1
        self._send_dispatch(worker, task)
        return True

    def _send_dispatch(self, worker: WorkerRecord, task: Task) -> None:
        if not task.dispatched_at:
            self.stats.dispatched(task.kind, self.now - task.created)
        task.state = State.RUNNING
        task.worker = worker.name
        task.dispatched_at = self.now
        worker.assigned[task.id] = task
        self.journal.run(task.id, worker.name, task.grant)
        if task.grant is not None:
            had = worker.has_slot
            worker.inflight += 1
            if had and not worker.has_slot:
                self._open_changed(worker, had)
        self.send_worker(worker.identity, self.dispatch_message(task))

    def dispatch_message(self, task: Task) -> list[Any]:
        """The DISPATCH of ``task`` (PROTOCOL.md §4.3): the grant the worker sets its limits from."""
        header: dict[str, Any] = {"id": task.id, "kind": task.kind, "tenant": task.tenant, "epoch": self.epoch}
        grant = task.grant
        if grant is not None:
            header["grant"] = {"gpus": list(grant.gpus), "gpu_milli": grant.gpu_milli, "mem": grant.mem,
                               "cpu_milli": grant.cpu_milli, "host_mem": grant.host_mem}
        if task.body:
            header.update(task.body)
        return protocol.dispatch(header, task.frames)

    def place_again(self, task: Task, worker_name: str, why: str) -> None:
        """Place a task again, never on ``worker_name`` (on its replica first, when it has one
        that can take it now); fail it when that is not possible."""
        task.grant = None
        task.state = State.QUEUED
        task.started = False
        task.avoid.add(worker_name)
        if task.attempts >= self.config.max_attempts:
            self.fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) after {task.attempts} attempts"))
        elif self._try_replica(task, worker_name) or self._try_dispatch(task):
            return
        elif self.queue.push(task, front=True):
            self.journal.queued(task)
        else:
            self.fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) and the queue is full"))

    def _try_replica(self, task: Task, lost: str) -> bool:
        """Dispatch ``task`` on a replica of worker ``lost`` (``--replica-of``) if one can take it."""
        replicas = {w.name for w in self.registry.by_identity.values() if w.replica_of == lost}
        if not replicas:
            return False
        others = frozenset(w.name for w in self.registry.by_identity.values() if w.name not in replicas)
        return self._try_dispatch(task, others)

    def place_queued(self) -> int:
        if not len(self.queue) or self.open_workers <= 0 or self.hold:
            return 0
        return self.queue.place(self._try_dispatch, self.now, self._reserve)

    def _reserve(self, task: Task, reserved: Set[str]) -> str | None:
        """The worker a long-waiting request reserves (``policies.reserve_worker``), unless its
        tenant's limit is what holds it back."""
        need = task.need
        assert need is not None
        if self.accounts.limits and not self.accounts.within_limits(task.tenant, need, task.kind == "session"):
            return None  # its tenant's limit holds it back, not a lack of GPUs: reserve nothing
        best = reserve_worker(need, self.registry.by_identity.values(), reserved, task.avoid)
        if best is not None:
            log.info("request %s waited %.0fs; reserving worker %s for it", protocol.id_text(task.id), self.now - task.created, best)
        return best

    # ------------------------------------------------------------------ free slots

    def _open_changed(self, worker: WorkerRecord, had: bool) -> None:
        """Keep ``open_workers`` after ``worker``'s inflight or draining changed (``had``: whether
        it had a free slot before). Workers no longer registered do not count."""
        has = worker.has_slot
        if has is not had and worker.pos >= 0:
            self.open_workers += 1 if has else -1

    def set_draining(self, worker: WorkerRecord, draining: bool) -> None:
        """Mark ``worker`` draining (no new work) or not; the one way to change ``draining``."""
        had = worker.has_slot
        worker.draining = draining
        self._open_changed(worker, had)

    def count_open_workers(self) -> int:
        """``open_workers`` recomputed from scratch (tests check that the two agree)."""
        return sum(1 for w in self.registry.workers if w.has_slot)

    # ------------------------------------------------------------------ configuration

    # Fields a running broker can take from a reloaded configuration; the rest need a restart.
    RELOADABLE = ("policy", "max_queue", "default_deadline_ms", "result_ttl", "result_bytes",
                  "session_lease", "max_attempts", "tenant_weights", "tenant_limits", "aging_s",
                  "reserve_after", "drain_timeout", "budgets")

    @staticmethod
    def _budgets(config: BrokerConfig) -> Budgets:
        """The configured budgets, or the defaults sized from the queue and this machine."""
        if config.budgets is not None:
            return config.budgets
        return Budgets(default=default_budget(config.max_queue, result_bytes=config.result_bytes),
                       max_held_bytes=default_held_bytes())

    def apply_config(self, new: BrokerConfig) -> tuple[list[str], list[str]]:
        """Take a reloaded configuration: returns (fields applied, fields that need a restart)."""
        old = self.config
        changed = [f for f in BrokerConfig.__slots__ if getattr(old, f) != getattr(new, f)]
        applied = [f for f in changed if f in self.RELOADABLE]
        kept = [f for f in changed if f not in self.RELOADABLE]
        # Keep the running values of what cannot change live, take the rest.
        self.config = replace(new, **{f: getattr(old, f) for f in kept})
        cfg = self.config
        if "policy" in applied:
            self.policy = make_policy(cfg.policy, mix=self.mix)
            self._observe = self.mix.observe if cfg.policy.startswith("fgd") else None
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
            self.accounts.budgets = self._budgets(cfg)
        self.place_queued()
        return applied, kept

    def set_tenant_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Replace the limits (configuration reload) and recount what every tenant holds now."""
        self.accounts.set_limits(limits, self._held())
        if self.accounts.limits:
            self.place_queued()

    def _held(self) -> Iterator[tuple[str, Grant, bool]]:
        """(tenant, grant, is a session) of every live grant: open sessions, running work."""
        for s in self.leases.sessions.values():
            yield s.tenant, s.grant, True
        for worker in self.registry.by_identity.values():
            for task in worker.assigned.values():
                if task.grant is not None and task.state is State.RUNNING:
                    yield task.tenant, task.grant, task.kind == "session"

    # ------------------------------------------------------------------ finishing

    def _finish(self, task: Task, reply: list[Any]) -> None:
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
        self._finish(task, protocol.error_reply(task.id, exc))

    # ------------------------------------------------------------------ worker dialog

    def on_worker(self, identity: bytes, msg: Message, raw_header: bytes, user: str | None = None) -> None:
        """``user``: for a READY under CURVE, the name of the worker's key (the ZAP User-Id)."""
        cmd = msg.command
        worker = self.registry.by_identity.get(identity)
        if cmd is Command.READY:
            self._on_ready(identity, worker, msg.header, user)
            return
        if worker is None:
            log.info("%s from an unknown worker connection; asking it to reconnect", cmd.name)
            self.send_worker(identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": "unknown worker"}))
            return
        worker.liveness.heard(self.now)
        if cmd is Command.RESULT:
            # A passive broker leaves results unacknowledged: the active one takes them. The ACK
            # waits for what the result changed to be durable (its updates are journalled now).
            if self.active and self._on_result(worker, msg, raw_header) and self.acking:
                self.unacked.append((self.journal.seq, identity, protocol.get_id(msg.header)))
        elif cmd is Command.HEARTBEAT:
            self._on_heartbeat(worker, msg.header)
        elif cmd is Command.FETCH:
            if self.active:
                self.staging.on_fetch(self, worker, msg.header)
        elif cmd is Command.CHUNK:
            if self.active:
                self.staging.on_output_chunk(self, worker, msg)
        elif cmd is Command.START:
            if self.active:  # a passive broker leaves STARTs to the active one (the worker asks it again)
                self._on_start(worker, msg.header)
        elif cmd is Command.DISCONNECT:
            reason = msg.header.get("reason")
            log.info("worker %s said goodbye (%s)", worker.name, reason if type(reason) is str else "")
            self.worker_lost(worker, "disconnected", graceful=True)
        else:
            raise UnknownCommand(f"command {cmd.name} is not valid from a worker")

    def _on_ready(self, identity: bytes, current: WorkerRecord | None, header: dict[str, Any],
                  user: str | None = None) -> None:
        """A worker's READY. Under CURVE (``worker_names_bound``) ``user`` is its key's name (the
        ZAP User-Id): the allow-list file ``workers/NAME.key`` admits worker NAME and no other."""
        try:
            ready = protocol.parse_ready(header)
        except ProtocolError as exc:
            self.counters["bad_messages"] += 1
            log.warning("bad message from worker %s: %s bad READY: %s", identity.hex()[:16], exc.code, exc.message)
            self.send_worker(identity, protocol.encode(Peer.WORKER, Command.ERROR, {"code": exc.code, "message": exc.message}))
            return
        name = ready.name
        # Refuse before tearing anything down: a refused READY must not cost a live worker.
        if self.worker_names_bound and user != name:
            self._refuse_worker(identity, name, f"refused: this worker's key is workers/{user}.key, which admits "
                                f"worker {user} only, not {name}: start it with --name {user}")
            return
        previous = self.registry.by_name.get(name)
        if previous is not None and previous is not current:
            if not previous.liveness.expired(self.now):
                self._refuse_worker(identity, name, (
                    f"refused: worker {name} is already connected from host {previous.hostname} (for "
                    f"{self.now - previous.connected_at:.0f}s); give each worker a name of its own (--name)"))
                return
        replaced = {w.name for w in (current, previous) if w is not None}
        for gpu in ready.gpus:
            holder = self.registry.gpus.get(gpu.uuid)
            if holder is not None and holder.worker.name not in replaced:
                self._refuse_worker(identity, name, f"refused: GPU {gpu.uuid} is already registered by worker {holder.worker.name}")
                return
        if current is not None:
            self.worker_lost(current, "sent READY again")
        if previous is not None and previous is not current:
            self.worker_lost(previous, "silent past its liveness, and a new connection of the same name came")
        policy = self.config.heartbeat.negotiate(ready.heartbeat_ms / 1000.0, ready.liveness)
        worker = self.registry.add(
            name=name,
            identity=identity,
            hostname=ready.hostname,
            gpus=ready.gpus,
            cpu_milli=ready.cpu_milli,
            host_mem=ready.host_mem,
            slots=ready.slots,
            policy=policy,
            now=self.now,
            simulated=ready.simulated,
            instance_id=ready.instance_id,
            replica_of=ready.replica_of,
        )
        worker.isolation, worker.job_network, worker.pool_users, worker.pool_kinds = ready.isolation
        self.registry.pool_index.file(worker)
        if worker.has_slot:
            self.open_workers += 1
        self._fits.clear()
        log.info(
            "worker %s ready: %d GPU(s)%s, %d slots, heartbeat %.3fs x %d",
            name, len(ready.gpus), " (simulated)" if worker.simulated else "", ready.slots, policy.interval, policy.liveness,
        )
        self.send_worker(identity, protocol.encode(Peer.WORKER, Command.WELCOME, {
            "heartbeat_ms": round(policy.interval * 1000), "liveness": policy.liveness, "broker": self.config.name,
            "active": self.active, "epoch": self.epoch, "acks": self.acking,
            "max_message_bytes": self.config.max_message_bytes}))
        self.place_queued()

    def _refuse_worker(self, identity: bytes, name: str, reason: str) -> None:
        """Refuse a READY: logged here, and the worker is told why (DISCONNECT: it retries later)."""
        self.counters["refused_workers"] += 1
        log.error("worker %s %s", name, reason)
        self.send_worker(identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": reason}))

    def _on_heartbeat(self, worker: WorkerRecord, header: dict[str, Any]) -> None:
        seq = header.get("seq")
        if type(seq) is int:
            worker.liveness.seq_heard = max(worker.liveness.seq_heard, seq)
        gpus = header.get("gpus")
        if type(gpus) is list:
            states = {}
            for raw in gpus[:64]:
                try:
                    uuid, state = protocol.parse_gpu_state(raw)
                except ProtocolError:
                    continue
                states[uuid] = state
            if self.registry.update_state(worker, states):
                self._fits.clear()
        running = header.get("running")
        if type(running) is list:
            worker.running = [r for r in running[:MAX_RUNNING_KEPT] if type(r) is dict]
            worker.running_at = self.now if len(running) < MAX_RUNNING_KEPT else 0.0  # a full list: maybe cut short
            if self.leases.sessions:
                renew_leases(self.leases.sessions, worker.name, worker.running, self.now)
            if self.active and not self.hold:
                for sid, tenant in self.leases.strays(worker.name, worker.running, self.tasks.tasks):
                    self._close_stray(worker, sid, tenant)
        if header.get("draining") is True and not worker.draining:
            log.info("worker %s is draining: no new work goes to it", worker.name)
            self.set_draining(worker, True)
        age = header.get("active_age_ms")
        if type(age) is int and age >= 0:
            worker.other_active_at = self.now - age / 1000.0
        epoch = header.get("epoch")
        if type(epoch) is int and epoch > self.max_epoch_seen:
            self.max_epoch_seen = epoch
            if self.active and epoch > self.epoch:
                log.error("worker %s has seen epoch %d, later than ours (%d): another broker is active", worker.name, epoch, self.epoch)
                self.fenced = True
        self.takeover.heard(worker, epoch, running)

    def _on_start(self, worker: WorkerRecord, header: dict[str, Any]) -> None:
        """A START (PROTOCOL.md §4.4): GO at once without a peer; with one, once the marks are
        durable (``take_go``). Refusals go at once: not starting is always safe."""
        go, refused = self.starts.on_start(worker, header.get("ids"), self._mark_started, self.journal.seq, not self.acking)
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
        self.journal.start(task.id)
        return self.journal.seq

    @staticmethod
    def _go_message(go: list[bytes], refused: list[bytes] | None = None) -> list[Any]:
        header: dict[str, Any] = {"ids": go}
        if refused:
            header["refused"] = refused
        return protocol.encode(Peer.WORKER, Command.GO, header)

    def take_go(self) -> dict[bytes, list[Any]]:
        """The GO messages due now (their START marks are held by the peer, ``journal.durable``),
        by worker identity."""
        due = self.starts.due(self.journal.durable, self.registry)
        by_identity = self.registry.by_identity
        for ident, ids in due.items():
            self._log_go(by_identity[ident].name, ids)
        return {ident: self._go_message(ids) for ident, ids in due.items()}

    def take_acks(self) -> dict[bytes, list[bytes]]:
        """The ACKs due now (their RESULTs' updates are held by the peer, ``journal.durable``), by
        worker identity: the shell sends one ACK message per worker."""
        pending, durable = self.unacked, self.journal.durable
        acks: dict[bytes, list[bytes]] = {}
        while pending and pending[0][0] <= durable:
            _, ident, rid = pending.popleft()
            acks.setdefault(ident, []).append(rid)
        return acks

    def _on_result(self, worker: WorkerRecord, msg: Message, raw_header: bytes) -> bool:
        """Take a RESULT; returns whether to ACK it (False: the worker must keep it)."""
        header = msg.header
        rid = protocol.get_id(header)
        task = worker.assigned.pop(rid, None)
        if task is None or task.state is not State.RUNNING:
            self._on_other_result(worker, rid, msg, raw_header)
            return True
        code = header.get("code")
        if code == _NOT_ACTIVE:
            log.error("worker %s refused %s: a broker with a later epoch is active", worker.name, protocol.id_text(rid))
            worker.assigned[rid] = task
            self.fenced = True
            return False
        ok = header.get("ok")
        if ok is not True and (ok is not False or type(code) is not str or type(header.get("message")) is not str):
            log.warning("malformed RESULT %s from %s", protocol.id_text(rid), worker.name)
            ok = False
            raw_header = protocol.packb(protocol.error_header(rid, ProtocolError(f"worker {worker.name} sent a malformed result")))
        kind = task.kind
        if task.grant is not None:
            had = worker.has_slot
            worker.inflight -= 1
            if not had:
                self._open_changed(worker, had)
        if ok is False and code == _SHUTTING_DOWN and kind != "call":
            # The worker is stopping and did not start it: place it elsewhere.
            self.set_draining(worker, True)
            self._release(worker, task)
            self.place_again(task, worker.name, "the worker is shutting down")
            return True
        if (ok is False and code == _REMOTE_ERROR and kind == "job" and not task.started
                and self.staging.holds_inputs(task)):
            # A staged job its worker could not fetch or set up: it never began (PROTOCOL.md §11.3).
            self._release(worker, task)
            self.place_again(task, worker.name, f"it failed there before it began: {header.get('message')}")
            return True
        if ok is False and code == _GPU_FAULT and kind not in ("call", "session") and task.retryable:
            # Its GPU failed under it: place it again, never on this worker.
            self._release(worker, task)
            self.place_again(task, worker.name, "its GPU failed")
            return True
        if ok:
            reply = protocol.reply(raw_header, msg.frames)
        else:
            reply = protocol.reply(raw_header)
            self.stats.error(code, task.tenant)
        if header.get("timed_out") is True:
            self.counters["job_timeouts"] += 1
        if kind == "session":
            if ok:
                grant = task.grant
                assert grant is not None  # a session is placed: it has a grant
                s = self.leases.sessions[rid] = Session(
                    id=rid, worker=worker.name, gpu=grant.gpus[0], grant=grant,
                    tenant=task.tenant, route=task.route or b"", last_seen=self.now, opened=self.now,
                )
                self.journal.session(s)
            else:
                self._release(worker, task)
        elif kind == "call":
            sid = task.session
            if sid is not None and (task.body.get("op") == "close" or code == _SESSION_LOST or code == _GPU_FAULT):
                if code is not None:
                    self.leases.lost[sid] = worker.name  # its replacement goes to the replica first
                self._end_session(sid)
        else:
            self._release(worker, task)
            if ok and kind == "job" and "staged" in header:  # its outputs first (PROTOCOL.md §11.5)
                pulling = self.staging.pull(self, worker, task, raw_header, list(msg.frames), header["staged"])
                self.place_queued()
                return not pulling  # ACKed once its outputs are here (outputs_here)
        self._finish(task, reply)
        self.place_queued()
        return True

    def outputs_here(self, task: Task, reply: list[Any], identity: bytes) -> None:
        """A job's staged outputs are in the spool: answer its client, and ACK its RESULT once
        that is durable (a standalone broker ACKs it too: the worker holds the outputs until then)."""
        self._finish(task, reply)
        if self.acking:
            self.unacked.append((self.journal.seq, identity, task.id))
        else:
            self.send_worker(identity, protocol.encode(Peer.WORKER, Command.ACK, {"ids": [task.id]}))

    def _release(self, worker: WorkerRecord, task: Task) -> None:
        grant = task.grant
        if grant is not None:
            self.accounts.refund(grant, task.tenant, task.kind == "session", self.now, worker)

    def abort_staged(self, task: Task, exc: GpudError) -> None:
        """End a staged job that has not begun and whose inputs will not all come (its upload
        stalled, or the spool lost it): out of the queue, or off its worker, which is told to
        drop it (ERROR, PROTOCOL.md §11.3) and whose slot is freed."""
        worker = self.registry.by_name.get(task.worker) if task.state is State.RUNNING and task.worker else None
        if worker is not None and worker.assigned.pop(task.id, None) is not None:
            if task.grant is not None:
                had = worker.has_slot
                worker.inflight -= 1
                if not had:
                    self._open_changed(worker, had)
            self._release(worker, task)
            self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.ERROR,
                                                              {"code": exc.code, "message": exc.message, "id": task.id}))
        self.fail(task, exc)

    def _on_other_result(self, worker: WorkerRecord, rid: bytes, msg: Message, raw_header: bytes) -> None:
        """A RESULT for a task not running on this worker: after a failover, the answer to work
        the old active broker dispatched. Kept (never lost); a duplicate is dropped."""
        task = self.tasks.tasks.get(rid)
        ok = msg.header.get("ok") is True
        reply = protocol.reply(raw_header, msg.frames) if ok else protocol.reply(raw_header)
        if task is None:
            tenant = msg.header.get("tenant")
            task = Task(id=rid, kind="echo", need=None, body={}, frames=[], route=None, created=self.now,
                        deadline=self.now, tenant=tenant if type(tenant) is str else "default")
            self.tasks.add(task)
            self.stats.take_over(task.kind)  # the other broker of the pair accepted it
            log.info("RESULT %s from %s for work this broker did not dispatch: kept for its client", protocol.id_text(rid), worker.name)
            self._finish(task, reply)
        elif task.state is State.QUEUED:
            log.info("RESULT %s from %s for a queued request: it ran already; answered", protocol.id_text(rid), worker.name)
            self.queue.remove(task)
            self._finish(task, reply)
        else:
            log.debug("stale RESULT %s from %s dropped", protocol.id_text(rid), worker.name)

    def _end_session(self, sid: bytes) -> None:
        s = self.leases.sessions.pop(sid, None)
        self.journal.end(sid)
        if s is not None:
            self.accounts.refund(s.grant, s.tenant, True, self.now, self.registry.by_name.get(s.worker))

    def _expire_session(self, s: Session) -> None:
        worker = self.registry.by_name.get(s.worker)
        log.info("session %s: client silent past the %.0fs lease; reclaiming", protocol.id_text(s.id), self.leases.lease)
        if worker is None:
            self.leases.sessions.pop(s.id, None)
            return
        s.closing = True
        self._send_close(worker, s.id, s.tenant, s.id)

    def _close_stray(self, worker: WorkerRecord, sid: bytes, tenant: str) -> None:
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
        task = Task(
            id=protocol.new_id(), kind="call", need=None,
            body={"session": sid, "op": "close", "args": {}}, frames=[], route=None,
            created=self.now, deadline=self.now, tenant=tenant, session=ends,
        )
        self.tasks.add(task)
        self._send_dispatch(worker, task)

    def worker_lost(self, worker: WorkerRecord, why: str, graceful: bool = False) -> None:
        """Remove a worker; place its retryable work again, fail the rest (PROTOCOL.md §4.3).
        ``graceful``: it said goodbye (not counted in ``counters["worker_losses"]``)."""
        if not graceful:
            self.counters["worker_losses"] += 1
        (log.info if graceful else log.warning)(
            "worker %s lost (%s): %d task(s) were on it", worker.name, why, len(worker.assigned))
        if worker.pos >= 0 and worker.has_slot:
            self.open_workers -= 1
        self.registry.remove(worker)
        self._fits.clear()
        self.takeover.worker_gone(worker.name)
        if self.staging.pulls:
            self.staging.worker_lost(self, worker.name)
        if not self.active:  # the passive broker keeps the tables as replicated; the active one decides
            return
        self.queue.drop_reservations_on(worker.name)
        for sid in self.leases.on_worker(worker.name):
            self.leases.lost[sid] = worker.name
            self._end_session(sid)  # its ledger went with the worker's record
        retry: list[Task] = []
        for task in worker.assigned.values():
            if task.state is not State.RUNNING:
                continue
            if task.grant is not None:  # its ledger went with the worker's record
                self.accounts.refund(task.grant, task.tenant, task.kind == "session", self.now, None)
            loss = on_loss(self.starts, task)
            if loss is Loss.SESSION_LOST:
                self.fail(task, SessionLost(f"the session's worker {worker.name} was lost ({why})"))
            elif loss is Loss.REPLACE:
                retry.append(task)
            else:
                self.fail(task, WorkerLost(f"worker {worker.name} was lost ({why}) while running it"))
        worker.assigned.clear()
        for task in retry:
            self.place_again(task, worker.name, why)

    # ------------------------------------------------------------------ the operator's marks

    def mark_drained(self, name: str, drained: bool) -> None:
        """The operator's (or the OpenStack controller's) drain mark on worker ``name``: kept
        across its reconnects, applied to it now if connected, and replicated."""
        registry = self.registry
        if drained:
            registry.drained.add(name)
        else:
            registry.drained.discard(name)
        w = registry.by_name.get(name)
        if w is not None and w.draining != drained:
            self.set_draining(w, drained)
        self.marks_changed()

    def marks_changed(self) -> None:
        """The operator drained or cordoned something (or undid it): replicate the marks."""
        self.journal.marks(self.registry.drained, self.registry.cordoned)

    def set_marks(self, drained: list[str], cordoned: list[str]) -> None:
        """Take the operator's marks as replicated (drained workers, cordoned GPUs)."""
        registry = self.registry
        registry.drained, registry.cordoned = set(drained), set(cordoned)
        for w in registry.by_identity.values():
            if w.draining != (w.name in registry.drained):
                self.set_draining(w, w.name in registry.drained)
            for gpu in w.gpus:
                gpu.cordoned = gpu.uuid in registry.cordoned

    def clear_work(self) -> None:
        """Forget every task, session, grant and queued request (a passive broker's tables are
        the snapshot it loads next). Workers stay registered."""
        self.tasks = self._task_table()
        self.accounts.clear()
        self.queue = PendingQueue(self.config.max_queue, self.accounts.fair, self.config.aging_s, self.config.reserve_after)
        self.leases.clear()
        self.staging.clear(self)
        self.unacked.clear()
        self.starts.clear()
        for w in self.registry.by_identity.values():
            w.assigned.clear()
            w.inflight = 0
        self.open_workers = self.count_open_workers()

    # ------------------------------------------------------------------ heartbeats to workers

    def beat_workers(self) -> None:
        """A HEARTBEAT to every worker now (our state changed: they must know at once)."""
        for worker in self.registry:
            self._beat(worker)

    def _beat(self, worker: WorkerRecord) -> None:
        seq = worker.liveness.sent(self.now)
        self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.HEARTBEAT, {
            "seq": seq, "active": self.active, "epoch": self.epoch, "acks": self.acking}))

    # ------------------------------------------------------------------ timers

    def tick(self, now: float) -> None:
        """Heartbeats out, dead workers out, expired queue entries and leases, old replies."""
        self.now = now
        for worker in self.registry:
            if worker.liveness.expired(now):
                self.worker_lost(worker, f"silent for {worker.liveness.silence(now):.1f}s")
            elif worker.liveness.beat_due(now):
                self._beat(worker)
        self.takeover.tick(now)
        self.leases.forget_lost()
        if not self.active:
            self.tasks.evict(now)
            return
        for s in self.leases.gone(self.registry, now):
            log.info("session %s is no longer on worker %s; ended", protocol.id_text(s.id), s.worker)
            self.leases.lost[s.id] = s.worker
            self._end_session(s.id)
        for task in self.queue.expire(now):
            self.fail(task, Timeout("no GPU could take the request before its deadline"))
        for s in self.leases.lapsed(now):
            self._expire_session(s)
        if self.staging.spool.uploads:
            self.staging.expire(self, now)
        if self.staging.pulls:
            self.staging.pull_again(self)
        self.tasks.evict(now)

    def fail_queued(self, exc: GpudError) -> int:
        """Answer every queued request with ``exc`` (the broker is draining); returns how many."""
        queued = [t for t in self.queue.in_order(self.now) if t.state is State.QUEUED]
        for task in queued:
            self.fail(task, exc)
        return len(queued)

    def dispatched(self) -> int:
        """Requests and session operations sent to workers and not answered yet."""
        return sum([len(w.assigned) for w in self.registry.by_identity.values()])

    def shutdown(self) -> None:
        """Tell every worker goodbye (the broker is stopping)."""
        for worker in self.registry:
            self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": "broker stopping"}))
