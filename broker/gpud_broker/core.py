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
Other policies (packing, fragmentation-aware) always see every worker. ``open_workers`` counts the
workers with a free slot (not draining, fewer requests in flight than slots), kept at every
dispatch, result, worker arrival and loss, and drain change: while it is 0 nothing can be placed,
and placing returns at once instead of asking the policy to scan every worker.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Any

from gpud import protocol as P
from gpud.errors import (
    Busy,
    Cancelled,
    GpudError,
    InvalidRequest,
    NoCapacity,
    NotActive,
    ProtocolError,
    SessionLost,
    Timeout,
    UnknownCommand,
    WorkerLost,
)
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud.resources import GpuInfo, Grant, Need, TenantLimits
from gpud_broker import ledger
from gpud_broker.mix import TaskMix
from gpud_broker.policies import FACTORIES, could_ever_fit, make_policy, pool_blocked
from gpud_broker.queue import DEFAULT_AGING_S, DEFAULT_RESERVE_AFTER_S, FairShare, PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.stats import PlacementTimes, RequestStats
from gpud_broker.tasks import Session, State, Task, TaskTable
from gpud_standby import replica as R

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], object]

MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
MAX_SLOTS = 100_000
SAMPLE_ABOVE = 64  # workers: above this many, ``balanced`` looks at a random sample first
SAMPLE_K = 16  # workers in that sample
SESSION_SWEEP_S = 1.0  # how often sessions are checked against their workers' heartbeats


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    name: str = "broker"
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    policy: str = "balanced"
    max_queue: int = 10_000
    default_deadline_ms: int = 30_000
    result_ttl: float = 60.0  # seconds a finished reply is kept for retries
    result_bytes: int = 256 << 20  # bytes of finished replies kept at most
    session_lease: float = 30.0  # seconds without hearing from a session's client
    max_attempts: int = 3  # placements of one request across worker losses
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights (default 1)
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)  # per tenant (default: none)
    aging_s: float = DEFAULT_AGING_S  # seconds of waiting worth one priority level
    reserve_after: float = DEFAULT_RESERVE_AFTER_S  # seconds before a blocked request reserves a worker
    drain_timeout: float = 10.0  # seconds dispatched work may take to finish after SIGTERM (the shell's)
    tenant_pool_share: float = 0.5  # most of a worker's pool users one tenant may hold (policies.pool_allows)

    def __post_init__(self) -> None:
        if self.policy not in FACTORIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(FACTORIES)}")


# The answer to a REQUEST or CALL whose id belongs to another tenant's work: it says nothing about
# that work (an honest client never meets it: ids are 128 random bits).
ID_IN_USE = "this request id is already in use; send new work under a fresh random id"


@dataclass(slots=True)
class TenantUsage:
    """What one tenant holds now, for ``TenantLimits`` (kept only while some tenant has limits)."""

    milli: int = 0
    mem: int = 0
    sessions: int = 0


_CLIENT_SIG = Peer.CLIENT.value
_WORKER_SIG = Peer.WORKER.value
_REPLY = P.CMD_BYTES[Command.REPLY]
_DISPATCH = P.CMD_BYTES[Command.DISPATCH]
_packb = P.packb


class BrokerCore:
    def __init__(self, config: BrokerConfig, now: float, send_client: Send, send_worker: Send) -> None:
        self.config = config
        self.started = now
        self.now = now
        self.send_client = send_client
        self.send_worker = send_worker
        self.registry = WorkerRegistry()
        self.tasks = TaskTable(config.result_ttl, config.result_bytes)
        self.fair = FairShare(config.tenant_weights)
        self.queue: PendingQueue[Task] = PendingQueue(config.max_queue, self.fair, config.aging_s, config.reserve_after)
        self.sessions: dict[bytes, Session] = {}
        # The running mix of requests the fragmentation-aware policies judge against: fed with
        # every accepted request's need, only when such a policy is configured.
        self.mix = TaskMix()
        self.policy = make_policy(config.policy, mix=self.mix)
        self._observe = self.mix.observe if config.policy.startswith("fgd") else None
        self.counters = {"requests": 0, "retries": 0, "errors": 0, "bad_messages": 0, "worker_losses": 0, "takeovers": 0,
                         "job_timeouts": 0, "session_replays": 0}
        self.stats = RequestStats()  # by kind and by error code, for the metrics endpoint
        self.placement_times = PlacementTimes()  # seconds per placement decision (admin status)
        self.open_workers = 0  # registered workers with a free slot (see the module docstring)
        self.rng = random.Random()
        self._needs: dict[Any, Need] = {}
        self._fits: dict[Need, bool] = {}  # could_ever_fit by need; cleared when workers change
        # Per-tenant limits; usage is tracked only while some tenant has limits (placement of
        # tenants without them stays as fast as before).
        self.limits: dict[str, TenantLimits] = dict(config.tenant_limits)
        self.usage: dict[str, TenantUsage] = {}
        self._tenant_needs: dict[tuple[Need, str], Need] = {}
        # The broker pair (PROTOCOL.md §9). Standalone: always active, epoch 1, no journal.
        self.active = True
        self.epoch = 1
        self.max_epoch_seen = 1  # the largest epoch any worker or the peer has shown us
        self.fenced = False  # a worker showed a larger epoch while we were active: step down
        self.hold = False  # place nothing (passive, or settling after a takeover)
        self.settling_until: float | None = None
        self.settle_wait: set[str] = set()  # workers not yet heard at the new epoch
        self.takeover_at = 0.0
        self.journal: list[list[Any]] | None = None  # replication updates not yet sent (pair only)
        self.seq = 0  # seq of the last update put in the journal
        self.durable_seq = 0  # updates up to here are held by the passive peer (set by the shell)
        self.acking = False  # in a pair: workers keep results until ACKed (standalone: no ACKs)
        self.unacked: deque[tuple[int, bytes, bytes]] = deque()  # (seq, worker, RESULT id) to ACK once durable
        self.lost_sessions: dict[bytes, str] = {}  # session id -> the worker it was lost with (recent)
        self._sweep_at = 0.0  # next look for sessions their workers no longer list

    # ------------------------------------------------------------------ replication

    def _rep(self, update: list[Any]) -> None:
        """Journal one replication update (callers check that ``journal`` is a list: a pair's
        active broker)."""
        self.seq += 1
        self.journal.append(update)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ client dialog

    def on_client(self, identity: bytes, msg: Message, tenant: str | None = None) -> None:
        """``tenant``: the tenant the sender authenticated as (CURVE: its key's tenant); its work is
        then its tenant's whatever ``need.tenant`` says, and ids of other tenants' work behave as
        unknown. None (security none): the declared tenant is taken at its word, no scoping."""
        cmd = msg.command
        if cmd is Command.REQUEST:
            self._on_request(identity, msg, tenant)
        elif cmd is Command.CALL:
            self._on_call(identity, msg, tenant)
        elif cmd is Command.PING:
            self._on_ping(identity, msg.header, tenant)
        elif cmd is Command.CANCEL:
            self._on_cancel(msg.header, tenant)
        else:
            raise UnknownCommand(f"command {cmd.name} is not valid from a client")

    def _on_request(self, identity: bytes, msg: Message, tenant: str | None = None) -> None:
        h = msg.header
        rid = P.get_id(h)
        self.counters["requests"] += 1
        if self._retry(identity, rid, tenant):
            return
        try:
            kind = h.get("kind")
            if kind not in P.KINDS:
                raise InvalidRequest(f"unknown request kind {kind!r}; known: {', '.join(P.KINDS)}")
            need = self._need(kind, h.get("need"))
            if tenant is not None and need.tenant != tenant:
                need = self._as_tenant(need, tenant)
            body: dict[str, Any]
            retryable = True
            if kind == "job":
                spec = P.parse_job(h, len(msg.frames))
                body = P.job_to_wire(spec)
                retryable = spec.idempotent
            else:
                body = {}
            deadline_ms = P.opt(h, "deadline_ms", int, self.config.default_deadline_ms)
            if not 0 <= deadline_ms <= MAX_DEADLINE_MS:
                raise InvalidRequest(f"field 'deadline_ms' must be in 0..{MAX_DEADLINE_MS}")
        except GpudError as exc:
            self._refuse(identity, rid, exc, tenant)
            return
        if self.limits:
            limits = self.limits.get(need.tenant)
            if limits is not None and not limits.could_ever_admit(need, kind == "session"):
                self._refuse(identity, rid, NoCapacity(f"the request is over tenant {need.tenant}'s limits"), need.tenant)
                return
        if self._observe is not None:
            self._observe(need)
        now = self.now
        task = Task(
            id=rid,
            kind=kind,
            need=need,
            body=body,
            frames=msg.frames,
            route=identity,
            created=now,
            deadline=now + deadline_ms / 1000.0,
            priority=need.priority,
            tenant=need.tenant,
            retryable=retryable,
        )
        self.tasks.add(task)
        if self.journal is not None:
            self._rep([R.TASK, R.task_to_wire(task, now)])
        replaces = h.get("replaces") if kind == "session" else None
        if type(replaces) is bytes:
            self.counters["session_replays"] += 1  # a client replays a lost session's journal
        lost = self.lost_sessions.get(replaces) if type(replaces) is bytes else None
        if (lost is not None and self._try_replica(task, lost)) or self._try_dispatch(task):
            self.stats.accept(kind, task.tenant)
            return
        if len(self.registry) and not self._could_ever_fit(need):
            self._forget(task)
            self._refuse(identity, rid, NoCapacity("no connected worker has GPUs that could satisfy this request"), task.tenant)
        elif self.limits and self._queue_limit_reached(task.tenant):
            self._forget(task)
            self._refuse(identity, rid, Busy(f"tenant {task.tenant} has as many requests queued as its limit allows; try later"),
                         task.tenant)
        elif self.queue.push(task):
            self.stats.accept(kind, task.tenant)
            self.fair.activate(task.tenant, now)
        else:
            self._forget(task)
            self._refuse(identity, rid, Busy(f"the queue is full ({self.config.max_queue} requests); try later"), task.tenant)

    def _forget(self, task: Task) -> None:
        self.tasks.forget(task)
        if self.journal is not None:
            self._rep([R.FORGET, task.id])

    def _need(self, kind: str, raw: Any) -> Need:
        """parse_need, memoized: clients send the same few need maps over and over."""
        try:
            # Types are part of the key: True == 1 and 1.0 == 1, but parse_need refuses them.
            key = (kind, tuple([(k, v.__class__, v) for k, v in raw.items()])) if type(raw) is dict else (kind, raw)
            need = self._needs.get(key)
        except TypeError:  # unhashable values (lists): parse every time
            return P.parse_need(kind, raw)
        if need is None:
            need = P.parse_need(kind, raw)
            if len(self._needs) >= 4096:
                self._needs.clear()
            self._needs[key] = need
        return need

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

    def _foreign_id(self, identity: bytes, rid: bytes, tenant: str) -> None:
        """A REQUEST or CALL reusing the id of another tenant's work: refused with a reply that
        reveals nothing about that work; the work itself and its client are not touched."""
        log.warning("tenant %s sent an id of another tenant's work (%s); refused", tenant, P.id_text(rid))
        self._refuse(identity, rid, InvalidRequest(ID_IN_USE))

    def _could_ever_fit(self, need: Need) -> bool:
        """could_ever_fit, remembered until the set of workers changes."""
        fits = self._fits.get(need)
        if fits is None:
            fits = self._fits[need] = could_ever_fit(need, self.registry.by_identity.values())
        return fits

    def _attach(self, identity: bytes, task: Task) -> None:
        """A retry of a known id: never run again; answer with the original's reply."""
        self.counters["retries"] += 1
        task.route = identity
        if task.state is State.DONE and task.reply is not None:
            self.send_client(identity, task.reply)

    def _refuse(self, identity: bytes, rid: bytes, exc: GpudError, tenant: str | None = None) -> None:
        """Answer a request that was not accepted (nothing is kept: a retry is judged afresh)."""
        self.counters["errors"] += 1
        self.stats.error(exc.code, tenant)
        log.info("refused %s: %s %s", P.id_text(rid), exc.code, exc.message)
        self.send_client(identity, [_CLIENT_SIG, _REPLY, _packb(P.error_header(rid, exc))])

    def _retry(self, identity: bytes, rid: bytes, tenant: str | None) -> bool:
        """A REQUEST or CALL whose id is known: attach it (never run twice), or, when the id is
        another tenant's, refuse it without saying anything about that work. False if unknown."""
        known = self.tasks.tasks.get(rid)
        if known is None:
            return False
        if tenant is not None and known.tenant != tenant:
            self._foreign_id(identity, rid, tenant)
        else:
            self._attach(identity, known)
        return True

    def _on_call(self, identity: bytes, msg: Message, tenant: str | None = None) -> None:
        h = msg.header
        rid = P.get_id(h)
        if self._retry(identity, rid, tenant):
            return
        try:
            sid = P.get_id(h, "session")
            op = h.get("op")
            if op not in P.SESSION_OPS:
                raise InvalidRequest(f"unknown session op {op!r}; known: {', '.join(P.SESSION_OPS)}")
            args = P.opt(h, "args", dict, {})
            session = self.sessions.get(sid)
            if session is None or session.closing or (tenant is not None and session.tenant != tenant):
                raise SessionLost(f"session {P.id_text(sid)} is unknown or has ended")
            worker = self.registry.by_name.get(session.worker)
            if worker is None:
                raise SessionLost(f"the worker of session {P.id_text(sid)} is gone")
        except ProtocolError as exc:
            self._refuse(identity, rid, InvalidRequest(exc.message))
            return
        except GpudError as exc:
            self._refuse(identity, rid, exc)
            return
        now = self.now
        session.last_seen = now
        session.route = identity
        if op == "close":
            session.closing = True
        task = Task(
            id=rid,
            kind="call",
            need=None,
            body={"session": sid, "op": op, "args": args},
            frames=msg.frames,
            route=identity,
            created=now,
            deadline=now,
            tenant=session.tenant,
            session=sid,
        )
        self.tasks.add(task)
        if self.journal is not None:
            self._rep([R.TASK, R.task_to_wire(task, now)])
        self.stats.accept("call", session.tenant)
        self._send_dispatch(worker, task)

    def _on_ping(self, identity: bytes, h: dict[str, Any], tenant: str | None = None) -> None:
        sessions = h.get("sessions")
        if type(sessions) is list:
            now = self.now
            for sid in sessions[:10_000]:
                s = self.sessions.get(sid) if type(sid) is bytes else None
                if s is not None and (tenant is None or s.tenant == tenant):
                    s.last_seen = now
        self.send_client(identity, [_CLIENT_SIG, P.CMD_BYTES[Command.PONG], _packb({})])

    def _on_cancel(self, h: dict[str, Any], tenant: str | None = None) -> None:
        rid = P.get_id(h)
        task = self.tasks.tasks.get(rid)
        if task is None or task.state is not State.QUEUED or (tenant is not None and task.tenant != tenant):
            return
        if self.queue.remove(task):
            self._fail(task, Cancelled("cancelled by its client"))

    def cancel(self, rid: bytes, why: str) -> bool:
        """Cancel queued request ``rid`` (admin ``cancel``): its client gets CANCELLED with ``why``.
        False when it is not queued (unknown, running or done: running work is not stopped)."""
        task = self.tasks.tasks.get(rid)
        if task is None or task.state is not State.QUEUED or not self.queue.remove(task):
            return False
        self._fail(task, Cancelled(why))
        return True

    # ------------------------------------------------------------------ placement

    def _try_dispatch(self, task: Task, excluded: Set[str] = frozenset()) -> bool:
        """Place and dispatch ``task`` now if some GPU can take it (never on ``excluded`` workers)."""
        need = task.need
        assert need is not None  # only placed kinds reach here
        if self.open_workers <= 0 or self.hold:
            return False  # no worker has a free slot (or placing is held): nothing can be placed
        if self.limits and not self._within_limits(task, need):
            return False  # it waits until its tenant holds less
        avoid = task.avoid | excluded if excluded else task.avoid
        reg = self.registry
        if task.kind in ("job", "session"):  # work that holds a pool user on its worker
            blocked = pool_blocked(task.kind, task.tenant, reg.by_identity.values(), self.config.tenant_pool_share)
            if blocked:
                avoid = avoid | blocked
        t0 = perf_counter()
        # Sampling keeps the intent of a load-spreading policy only (the policy may change on reload).
        if len(reg.workers) > SAMPLE_ABOVE and self.config.policy == "balanced":
            placement = self.policy(need, reg.sample(SAMPLE_K, self.rng), avoid)
            if placement is None:  # none of the sample can take it: ask the whole cluster
                placement = self.policy(need, reg.by_identity.values(), avoid)
        else:
            placement = self.policy(need, reg.by_identity.values(), avoid)
        self.placement_times.record(perf_counter() - t0)
        if placement is None:
            return False
        worker = placement.worker
        task.grant = ledger.grant(worker, placement.gpus, need, pool=task.kind in worker.pool_kinds)
        self.fair.grant(task.tenant, need.total_milli, self.now)
        if self.limits:
            self._charge(task.tenant, task.grant, task.kind == "session", 1)
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
        if self.journal is not None:
            self._rep([R.RUN, task.id, worker.name, R.grant_to_wire(task.grant)])
        if task.grant is not None:
            had = worker.has_slot
            worker.inflight += 1
            if had and not worker.has_slot:
                self._open_changed(worker, had)
        self.send_worker(worker.identity, self._dispatch_message(task))

    def _dispatch_message(self, task: Task) -> list[Any]:
        """The DISPATCH of ``task`` (PROTOCOL.md §4.3): the grant the worker sets its limits from."""
        header: dict[str, Any] = {"id": task.id, "kind": task.kind, "tenant": task.tenant, "epoch": self.epoch}
        g = task.grant
        if g is not None:
            header["grant"] = {"gpus": list(g.gpus), "gpu_milli": g.gpu_milli, "mem": g.mem,
                               "cpu_milli": g.cpu_milli, "host_mem": g.host_mem}
        if task.body:
            header.update(task.body)
        return [_WORKER_SIG, _DISPATCH, _packb(header), *task.frames]

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

    # ------------------------------------------------------------------ tenant limits

    def _within_limits(self, task: Task, need: Need) -> bool:
        """Would granting ``need`` keep the task's tenant within its limits?"""
        limits = self.limits.get(task.tenant)
        if limits is None:
            return True
        u = self.usage.get(task.tenant)
        if u is None:
            return True  # could_ever_admit was checked at the door
        if limits.max_milli is not None and u.milli + need.total_milli > limits.max_milli:
            return False
        if limits.max_mem is not None and u.mem + need.mem * need.gpu_count > limits.max_mem:
            return False
        return not (task.kind == "session" and limits.max_sessions is not None and u.sessions >= limits.max_sessions)

    def _queue_limit_reached(self, tenant: str) -> bool:
        limits = self.limits.get(tenant)
        return limits is not None and limits.max_queued is not None and self.queue.queued_for(tenant) >= limits.max_queued

    def _charge(self, tenant: str, g: Grant, session: bool, sign: int) -> None:
        """Count a grant (sign 1) or its release (-1) against its tenant."""
        u = self.usage.get(tenant)
        if u is None:
            u = self.usage[tenant] = TenantUsage()
        n = len(g.gpus)
        u.milli += sign * g.gpu_milli * n
        u.mem += sign * g.mem * n
        if session:
            u.sessions += sign

    # Fields a running broker can take from a reloaded configuration; the rest need a restart.
    RELOADABLE = ("policy", "max_queue", "default_deadline_ms", "result_ttl", "result_bytes",
                  "session_lease", "max_attempts", "tenant_weights", "tenant_limits", "aging_s",
                  "reserve_after", "drain_timeout")

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
        if "tenant_weights" in applied:
            self.fair.set_weights(cfg.tenant_weights)
        if "tenant_limits" in applied:
            self.set_tenant_limits(cfg.tenant_limits)
        self.place_queued()
        return applied, kept

    def set_tenant_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Replace the limits (configuration reload) and recount what every tenant holds now."""
        self.limits = dict(limits)
        self.usage = {}
        if not self.limits:
            return
        for s in self.sessions.values():
            self._charge(s.tenant, s.grant, True, 1)
        for worker in self.registry.by_identity.values():
            for task in worker.assigned.values():
                if isinstance(task, Task) and task.grant is not None and task.state is State.RUNNING:
                    self._charge(task.tenant, task.grant, task.kind == "session", 1)
        self.place_queued()

    def place_queued(self) -> int:
        if not len(self.queue) or self.open_workers <= 0 or self.hold:
            return 0
        return self.queue.place(self._try_dispatch, self.now, self._reserve)

    def _reserve(self, task: Task, reserved: Set[str]) -> str | None:
        """The worker a long-waiting request reserves: of those that could ever take it, the one
        with the most free share on fitting GPUs (it frees up soonest, on average)."""
        need = task.need
        assert need is not None
        if self.limits and not self._within_limits(task, need):
            return None  # its tenant's limit holds it back, not a lack of GPUs: reserve nothing
        best, best_free = None, -1
        for w in self.registry.by_identity.values():
            if w.name in reserved or w.name in task.avoid or not could_ever_fit(need, (w,)):
                continue
            free = sum(g.free_milli for g in w.gpus if need.fits_type(g.info))
            if free > best_free:
                best, best_free = w.name, free
        if best is not None:
            log.info("request %s waited %.0fs; reserving worker %s for it", P.id_text(task.id), self.now - task.created, best)
        return best

    # ------------------------------------------------------------------ finishing

    def _finish(self, task: Task, reply: list[Any]) -> None:
        self.tasks.finish(task, reply, self.now)
        if self.journal is not None:
            self._rep([R.DONE, task.id, R.frames_bytes(reply)])
        self.stats.finish(task.kind, self.now - task.created)
        if task.route is not None:
            self.send_client(task.route, reply)

    def _fail(self, task: Task, exc: GpudError) -> None:
        self.counters["errors"] += 1
        self.stats.error(exc.code, task.tenant)
        if task.state is State.QUEUED and task.queued:
            self.queue.remove(task)
        self._finish(task, [_CLIENT_SIG, _REPLY, _packb(P.error_header(task.id, exc))])

    # ------------------------------------------------------------------ worker dialog

    def on_worker(self, identity: bytes, msg: Message, raw_header: bytes) -> None:
        cmd = msg.command
        worker = self.registry.by_identity.get(identity)
        if cmd is Command.READY:
            self._on_ready(identity, worker, msg.header)
            return
        if worker is None:
            log.info("%s from an unknown worker connection; asking it to reconnect", cmd.name)
            self.send_worker(identity, [_WORKER_SIG, P.CMD_BYTES[Command.DISCONNECT], _packb({"reason": "unknown worker"})])
            return
        worker.liveness.heard(self.now)
        if cmd is Command.RESULT:
            # A passive broker leaves results unacknowledged: the active one takes them. The ACK
            # waits for what the result changed to be durable (its updates are journalled now).
            if self.active and self._on_result(worker, msg, raw_header) and self.acking:
                self.unacked.append((self.seq, identity, P.get_id(msg.header)))
        elif cmd is Command.HEARTBEAT:
            self._on_heartbeat(worker, msg.header)
        elif cmd is Command.DISCONNECT:
            reason = msg.header.get("reason")
            log.info("worker %s said goodbye (%s)", worker.name, reason if type(reason) is str else "")
            self.worker_lost(worker, "disconnected", graceful=True)
        else:
            raise UnknownCommand(f"command {cmd.name} is not valid from a worker")

    def _on_ready(self, identity: bytes, current: WorkerRecord | None, h: dict[str, Any]) -> None:
        try:
            name = h.get("name")
            if type(name) is not str or not 0 < len(name) <= 128:
                raise ProtocolError("READY needs 'name' (1-128 characters)")
            raw_gpus = h.get("gpus")
            if type(raw_gpus) is not list or len(raw_gpus) > 64:
                raise ProtocolError("READY needs 'gpus', a list of at most 64 GPUs")
            gpus: list[GpuInfo] = [P.parse_gpu_info(g) for g in raw_gpus]
            if len({g.uuid for g in gpus}) != len(gpus):
                raise ProtocolError("READY names a GPU uuid twice")
            cpu = P.opt(h, "cpu_milli", int, 0)
            host_mem = P.opt(h, "host_mem", int, 0)
            slots = P.opt(h, "slots", int, 64)
            hb_ms = P.opt(h, "heartbeat_ms", int, 0)
            liveness = P.opt(h, "liveness", int, 0)
            hostname = P.opt(h, "hostname", str, "")[:255]
            instance_id = P.opt(h, "instance_id", str, "")[:64]
            replica_of = P.opt(h, "replica_of", str, "")[:128]
            isolation = P.parse_isolation(h)
            if not (0 <= cpu and 0 <= host_mem and 1 <= slots <= MAX_SLOTS and 0 <= hb_ms <= 600_000 and 0 <= liveness <= 100):
                raise ProtocolError("READY has a value out of range")
        except GpudError as exc:
            # A READY with a wrong-typed field is malformed (PROTOCOL.md §2), whatever the check.
            code = "PROTOCOL" if exc.code == "INVALID_REQUEST" else exc.code
            self.counters["bad_messages"] += 1
            log.warning("bad message from worker %s: %s bad READY: %s", identity.hex()[:16], code, exc.message)
            self.send_worker(identity, [_WORKER_SIG, P.CMD_BYTES[Command.ERROR], _packb({"code": code, "message": exc.message})])
            return
        # Refuse before tearing anything down: a refused READY must not cost a live worker.
        replaced = {w.name for w in (current, self.registry.by_name.get(name)) if w is not None}
        for g in gpus:
            holder = self.registry.gpus.get(g.uuid)
            if holder is not None and holder.worker.name not in replaced:
                log.error("worker %s announces GPU %s, held by worker %s; refused", name, g.uuid, holder.worker.name)
                self.send_worker(identity, [_WORKER_SIG, P.CMD_BYTES[Command.DISCONNECT], _packb({"reason": f"GPU {g.uuid} is already registered"})])
                return
        if current is not None:
            self.worker_lost(current, "sent READY again")
        previous = self.registry.by_name.get(name)
        if previous is not None:
            self.worker_lost(previous, "replaced by a new connection of the same name")
        policy = self.config.heartbeat.negotiate(hb_ms / 1000.0, liveness)
        worker = self.registry.add(
            name=name,
            identity=identity,
            hostname=hostname,
            gpus=gpus,
            cpu_milli=cpu,
            host_mem=host_mem,
            slots=slots,
            policy=policy,
            now=self.now,
            simulated=bool(h.get("simulated", False)),
            instance_id=instance_id,
            replica_of=replica_of,
        )
        worker.isolation, worker.job_network, worker.pool_users, worker.pool_kinds = isolation
        if worker.has_slot:
            self.open_workers += 1
        self._fits.clear()
        log.info(
            "worker %s ready: %d GPU(s)%s, %d slots, heartbeat %.3fs x %d",
            name, len(gpus), " (simulated)" if worker.simulated else "", slots, policy.interval, policy.liveness,
        )
        self.send_worker(
            identity,
            [_WORKER_SIG, P.CMD_BYTES[Command.WELCOME], _packb({"heartbeat_ms": round(policy.interval * 1000), "liveness": policy.liveness, "broker": self.config.name, "active": self.active, "epoch": self.epoch, "acks": self.acking})],
        )
        self.place_queued()

    def _on_heartbeat(self, worker: WorkerRecord, h: dict[str, Any]) -> None:
        seq = h.get("seq")
        if type(seq) is int:
            worker.liveness.seq_heard = max(worker.liveness.seq_heard, seq)
        gpus = h.get("gpus")
        if type(gpus) is list:
            states = {}
            for raw in gpus[:64]:
                try:
                    uuid, state = P.parse_gpu_state(raw)
                except ProtocolError:
                    continue
                states[uuid] = state
            if self.registry.update_state(worker, states):
                self._fits.clear()
        running = h.get("running")
        if type(running) is list:
            worker.running = [r for r in running[:1000] if type(r) is dict]
            worker.running_at = self.now if len(running) < 1000 else 0.0  # a full list: maybe cut short
        if h.get("draining") is True and not worker.draining:
            log.info("worker %s is draining: no new work goes to it", worker.name)
            self.set_draining(worker, True)
        age = h.get("active_age_ms")
        if type(age) is int and age >= 0:
            worker.other_active_at = self.now - age / 1000.0
        epoch = h.get("epoch")
        if type(epoch) is int and epoch > self.max_epoch_seen:
            self.max_epoch_seen = epoch
            if self.active and epoch > self.epoch:
                log.error("worker %s has seen epoch %d, later than ours (%d): another broker is active", worker.name, epoch, self.epoch)
                self.fenced = True
        if self.settling_until is not None and worker.name in self.settle_wait and type(epoch) is int and epoch >= self.epoch:
            self.settle_wait.discard(worker.name)
            if type(running) is list:
                self._reconcile(worker, running)
            if not self.settle_wait:
                self._settled()

    def take_acks(self) -> dict[bytes, list[bytes]]:
        """The ACKs due now (their RESULTs' updates are held by the peer, ``durable_seq``), by
        worker identity: the shell sends one ACK message per worker."""
        pending, durable = self.unacked, self.durable_seq
        acks: dict[bytes, list[bytes]] = {}
        while pending and pending[0][0] <= durable:
            _, ident, rid = pending.popleft()
            acks.setdefault(ident, []).append(rid)
        return acks

    def _end_sessions_gone(self) -> None:
        """End the sessions their workers' last heartbeat no longer lists (the worker closed
        them: a GPU fault, its idle timeout), so their grants come back now rather than at the
        client's next call. A session opened after that heartbeat was sent is not judged: the
        worker lists a session before it answers its opening, and on the same connection."""
        listed: dict[str, set[Any]] = {}
        for s in list(self.sessions.values()):
            w = self.registry.by_name.get(s.worker)
            if w is None or s.closing or s.opened >= w.running_at:
                continue
            ids = listed.get(w.name)
            if ids is None:
                ids = listed[w.name] = {r.get("id") for r in w.running if r.get("kind") == "session"}
            if s.id not in ids:
                log.info("session %s is no longer on worker %s; ended", P.id_text(s.id), w.name)
                self.lost_sessions[s.id] = w.name
                self._end_session(s.id)

    def _on_result(self, worker: WorkerRecord, msg: Message, raw_header: bytes) -> bool:
        """Take a RESULT; returns whether to ACK it (False: the worker must keep it)."""
        h = msg.header
        rid = P.get_id(h)
        task = worker.assigned.pop(rid, None)
        if not isinstance(task, Task) or task.state is not State.RUNNING:
            self._on_other_result(worker, rid, msg, raw_header)
            return True
        if h.get("code") == "NOT_ACTIVE":
            log.error("worker %s refused %s: a broker with a later epoch is active", worker.name, P.id_text(rid))
            worker.assigned[rid] = task
            self.fenced = True
            return False
        ok = h.get("ok")
        if ok is not True and (ok is not False or type(h.get("code")) is not str or type(h.get("message")) is not str):
            log.warning("malformed RESULT %s from %s", P.id_text(rid), worker.name)
            ok = False
            raw_header = _packb(P.error_header(rid, ProtocolError(f"worker {worker.name} sent a malformed result")))
        kind = task.kind
        if task.grant is not None:
            had = worker.has_slot
            worker.inflight -= 1
            if not had:
                self._open_changed(worker, had)
        if ok is False and h.get("code") == "SHUTTING_DOWN" and kind != "call":
            # The worker is stopping and did not start it: place it elsewhere.
            self.set_draining(worker, True)
            self._release(worker, task)
            self._replace(task, worker.name, "the worker is shutting down")
            return True
        if ok is False and h.get("code") == "GPU_FAULT" and kind not in ("call", "session") and task.retryable:
            # Its GPU failed under it: place it again, never on this worker.
            self._release(worker, task)
            self._replace(task, worker.name, "its GPU failed")
            return True
        if ok:
            reply = [_CLIENT_SIG, _REPLY, raw_header, *msg.frames]
        else:
            reply = [_CLIENT_SIG, _REPLY, raw_header]
            self.stats.error(h.get("code"), task.tenant)
        if h.get("timed_out") is True:
            self.counters["job_timeouts"] += 1
        if kind == "session":
            if ok:
                assert task.grant is not None
                s = self.sessions[rid] = Session(
                    id=rid, worker=worker.name, gpu=task.grant.gpus[0], grant=task.grant,
                    tenant=task.tenant, route=task.route or b"", last_seen=self.now, opened=self.now,
                )
                if self.journal is not None:
                    self._rep([R.SESSION, R.session_to_wire(s)])
            else:
                self._release(worker, task)
        elif kind == "call":
            sid = task.session
            code = h.get("code")
            if sid is not None and (task.body.get("op") == "close" or code in ("SESSION_LOST", "GPU_FAULT")):
                if code is not None:
                    self.lost_sessions[sid] = worker.name  # its replacement goes to the replica first
                self._end_session(sid)
        else:
            self._release(worker, task)
        self._finish(task, reply)
        self.place_queued()
        return True

    def _release(self, worker: WorkerRecord, task: Task) -> None:
        g = task.grant
        if g is not None:
            ledger.release(worker, [self.registry.gpus[u] for u in g.gpus], g)
            self.fair.release(task.tenant, g.gpu_milli * len(g.gpus), self.now)
            if self.limits:
                self._charge(task.tenant, g, task.kind == "session", -1)

    def _on_other_result(self, worker: WorkerRecord, rid: bytes, msg: Message, raw_header: bytes) -> None:
        """A RESULT for a task not running on this worker: after a failover, the answer to work
        the old active broker dispatched. Kept (never lost); a duplicate is dropped."""
        task = self.tasks.tasks.get(rid)
        ok = msg.header.get("ok") is True
        reply = [_CLIENT_SIG, _REPLY, raw_header, *msg.frames] if ok else [_CLIENT_SIG, _REPLY, raw_header]
        if task is None:
            tenant = msg.header.get("tenant")
            task = Task(id=rid, kind="echo", need=None, body={}, frames=[], route=None, created=self.now,
                        deadline=self.now, tenant=tenant if type(tenant) is str else "default")
            self.tasks.add(task)
            self.stats.take_over(task.kind)  # the other broker of the pair accepted it
            log.info("RESULT %s from %s for work this broker did not dispatch: kept for its client", P.id_text(rid), worker.name)
            self._finish(task, reply)
        elif task.state is State.QUEUED:
            log.info("RESULT %s from %s for a queued request: it ran already; answered", P.id_text(rid), worker.name)
            self.queue.remove(task)
            self._finish(task, reply)
        else:
            log.debug("stale RESULT %s from %s dropped", P.id_text(rid), worker.name)

    def _end_session(self, sid: bytes) -> None:
        s = self.sessions.pop(sid, None)
        if self.journal is not None:
            self._rep([R.END, sid])
        if s is None:
            return
        self.fair.release(s.tenant, s.grant.gpu_milli, self.now)
        if self.limits:
            self._charge(s.tenant, s.grant, True, -1)
        worker = self.registry.by_name.get(s.worker)
        if worker is not None:
            ledger.release(worker, [self.registry.gpus[s.gpu]], s.grant)

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
        self.settle_wait.discard(worker.name)
        if not self.active:  # the passive broker keeps the tables as replicated; the active one decides
            return
        self.queue.drop_reservations_on(worker.name)
        for sid in [sid for sid, s in self.sessions.items() if s.worker == worker.name]:
            self.lost_sessions[sid] = worker.name
            self._end_session(sid)  # its ledger went with the worker's record
        retry: list[Task] = []
        for task in worker.assigned.values():
            if not isinstance(task, Task) or task.state is not State.RUNNING:
                continue
            if task.grant is not None:
                self.fair.release(task.tenant, task.grant.gpu_milli * len(task.grant.gpus), self.now)
                if self.limits:
                    self._charge(task.tenant, task.grant, task.kind == "session", -1)
            if task.kind == "call":
                self._fail(task, SessionLost(f"the session's worker {worker.name} was lost ({why})"))
            elif task.retryable:
                retry.append(task)
            else:
                self._fail(task, WorkerLost(f"worker {worker.name} was lost ({why}) while running it"))
        worker.assigned.clear()
        for task in retry:
            self._replace(task, worker.name, why)

    def _replace(self, task: Task, worker_name: str, why: str) -> None:
        """Place a task again, never on ``worker_name`` (on its replica first, when it has one
        that can take it now); fail it when that is not possible."""
        task.grant = None
        task.state = State.QUEUED
        task.avoid.add(worker_name)
        if task.attempts >= self.config.max_attempts:
            self._fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) after {task.attempts} attempts"))
        elif self._try_replica(task, worker_name) or self._try_dispatch(task):
            return
        elif self.queue.push(task, front=True):
            if self.journal is not None:
                self._rep([R.QUEUE, task.id, sorted(task.avoid)])
        else:
            self._fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) and the queue is full"))

    def _try_replica(self, task: Task, lost: str) -> bool:
        """Dispatch ``task`` on a replica of worker ``lost`` (``--replica-of``) if one can take it."""
        replicas = {w.name for w in self.registry.by_identity.values() if w.replica_of == lost}
        if not replicas:
            return False
        others = frozenset(w.name for w in self.registry.by_identity.values() if w.name not in replicas)
        return self._try_dispatch(task, others)

    # ------------------------------------------------------------------ the broker pair

    def mark_drained(self, name: str, drained: bool) -> None:
        """The operator's (or the OpenStack controller's) drain mark on worker ``name``: kept
        across its reconnects, applied to it now if connected, and replicated."""
        reg = self.registry
        if drained:
            reg.drained.add(name)
        else:
            reg.drained.discard(name)
        w = reg.by_name.get(name)
        if w is not None and w.draining != drained:
            self.set_draining(w, drained)
        self.marks_changed()

    def marks_changed(self) -> None:
        """The operator drained or cordoned something (or undid it): replicate the marks."""
        if self.journal is not None:
            self._rep([R.MARKS, sorted(self.registry.drained), sorted(self.registry.cordoned)])

    def set_marks(self, drained: list[str], cordoned: list[str]) -> None:
        """Take the operator's marks as replicated (drained workers, cordoned GPUs)."""
        reg = self.registry
        reg.drained, reg.cordoned = set(drained), set(cordoned)
        for w in reg.by_identity.values():
            if w.draining != (w.name in reg.drained):
                self.set_draining(w, w.name in reg.drained)
            for g in w.gpus:
                g.cordoned = g.uuid in reg.cordoned

    def witness(self, within: float) -> bool:
        """Does some connected worker still hear another broker that says it is active?"""
        since = self.now - within
        return any(w.other_active_at > since for w in self.registry.by_identity.values())

    def clear_work(self) -> None:
        """Forget every task, session, grant and queued request (a passive broker's tables are
        the snapshot it loads next). Workers stay registered."""
        self.tasks = TaskTable(self.config.result_ttl, self.config.result_bytes)
        self.fair = FairShare(self.config.tenant_weights)
        self.queue = PendingQueue(self.config.max_queue, self.fair, self.config.aging_s, self.config.reserve_after)
        self.sessions = {}
        self.usage = {}
        self.unacked.clear()
        for w in self.registry.by_identity.values():
            w.assigned.clear()
            w.grants.clear()
            w.inflight = 0
            w.granted_cpu = w.granted_host_mem = 0
            for g in w.gpus:
                g.granted_milli = g.granted_mem = g.tasks = 0
                g.exclusive = False
        self.open_workers = self.count_open_workers()

    def step_down(self) -> int:
        """Stop being active (another broker is): clients of unfinished work are told NOT_ACTIVE
        so they send it, same ids, to the other broker; the tables are dropped. Returns how many
        clients were told."""
        told = 0
        exc = NotActive(f"broker {self.config.name} is no longer the active one; use its peer")
        for task in self.tasks.tasks.values():
            if task.state is not State.DONE and task.route is not None:
                self.send_client(task.route, [_CLIENT_SIG, _REPLY, _packb(P.error_header(task.id, exc))])
                told += 1
        self.active = False
        self.hold = True
        self.fenced = False
        self.settling_until = None
        self.settle_wait = set()
        self.journal = None
        self.clear_work()
        self.beat_workers()
        log.warning("broker %s stepped down to passive; %d client(s) sent to the peer", self.config.name, told)
        return told

    def become_passive(self) -> None:
        """Passive from the start (or after a restart): accept no work, hold no tables yet."""
        self.active = False
        self.hold = True
        self.journal = None

    def take_over(self, epoch: int, settle: float) -> None:
        """Become the active broker at ``epoch`` with the replicated tables (and a new replication
        journal): rebuild the ledger
        from the running work and sessions on connected workers, queue what was queued, tell
        every worker, and settle (place nothing) until each has answered at the new epoch or
        ``settle`` seconds pass (PROTOCOL.md §9.4)."""
        now = self.now
        self.active = True
        self.epoch = epoch
        self.journal, self.seq, self.durable_seq = [], 0, 0  # a new stream: the peer syncs from a snapshot
        self.max_epoch_seen = max(self.max_epoch_seen, epoch)
        self.fenced = False
        self.takeover_at = now
        self.counters["takeovers"] += 1
        reg = self.registry
        for sid, s in list(self.sessions.items()):
            w = reg.by_name.get(s.worker)
            if w is None or s.gpu not in reg.gpus:
                del self.sessions[sid]
                self.lost_sessions[sid] = s.worker
                continue
            s.last_seen = now
            ledger.restore(w, [reg.gpus[s.gpu]], s.grant)
            self.fair.grant(s.tenant, s.grant.gpu_milli, now)
        lost: list[Task] = []
        queued: list[Task] = []
        for task in self.tasks.tasks.values():
            if task.state is not State.DONE:
                self.stats.take_over(task.kind)  # accepted by the other broker: answered by this one
            if task.state is State.QUEUED:
                queued.append(task)
            elif task.state is State.RUNNING:
                w = reg.by_name.get(task.worker or "")
                if w is None:
                    lost.append(task)
                    continue
                w.assigned[task.id] = task
                g = task.grant
                if g is not None and all(u in reg.gpus for u in g.gpus):
                    ledger.restore(w, [reg.gpus[u] for u in g.gpus], g)
                    self.fair.grant(task.tenant, g.gpu_milli * len(g.gpus), now)
                    w.inflight += 1
        for task in sorted(queued, key=lambda t: t.created):
            if not self.queue.push(task):
                self._fail(task, Busy("the queue is full"))
        self.open_workers = self.count_open_workers()
        self.hold = True
        self.settle_wait = {w.name for w in reg.by_identity.values()}
        self.settling_until = now + settle
        log.warning("broker %s is active at epoch %d: %d queued, %d running, %d session(s); settling with %d worker(s)",
                    self.config.name, epoch, len(queued), sum(len(w.assigned) for w in reg.by_identity.values()),
                    len(self.sessions), len(self.settle_wait))
        self.beat_workers()
        for task in lost:
            name = task.worker or "?"
            if task.kind == "call":
                self._fail(task, SessionLost(f"the session's worker {name} is gone"))
            elif task.retryable:
                self._replace(task, name, "not connected after the failover")
            else:
                self._fail(task, WorkerLost(f"worker {name} was lost during a broker failover while running it"))
        if not self.settle_wait:
            self._settled()

    def _reconcile(self, worker: WorkerRecord, running: list[Any]) -> None:
        """A worker's first heartbeat at our new epoch lists what it runs: work our tables had
        queued is running there; work we never heard of is kept as running there, so that its
        client's retry attaches to it instead of running it again."""
        for entry in running[:10_000]:
            if type(entry) is not dict:
                continue
            rid = entry.get("id")
            if type(rid) is not bytes or len(rid) != P.ID_BYTES:
                continue
            task = self.tasks.tasks.get(rid)
            if task is not None and task.state is not State.QUEUED:
                continue
            if task is None:
                kind, tenant = entry.get("kind"), entry.get("tenant")
                if kind == "session":
                    continue  # a session the tables lack: its open was never answered; it is the worker's to reclaim
                task = Task(id=rid, kind=kind if type(kind) is str else "job", need=None, body={}, frames=[], route=None,
                            created=self.now, deadline=self.now, tenant=tenant if type(tenant) is str else "default",
                            dispatched_at=float("inf"))  # not ours to dispatch again: we lack its content
                self.tasks.add(task)
                if self.journal is not None:
                    self._rep([R.TASK, R.task_to_wire(task, self.now)])
            else:
                self.queue.remove(task)
            task.state = State.RUNNING
            task.worker = worker.name
            task.dispatched_at = float("inf")  # it runs there already: never dispatched again
            worker.assigned[rid] = task
            if self.journal is not None:
                self._rep([R.RUN, rid, worker.name, None])
            log.info("after the failover: %s runs on %s (dispatched by the previous broker)", P.id_text(rid), worker.name)

    def _settled(self) -> None:
        """Settling is over: dispatch again what ran before the takeover (a worker that has it
        running or answered ignores or re-answers it; one that never got it runs it), then place."""
        self.settling_until = None
        self.settle_wait = set()
        self.hold = False
        again = 0
        for w in self.registry.by_identity.values():
            for task in list(w.assigned.values()):
                if isinstance(task, Task) and task.state is State.RUNNING and task.dispatched_at <= self.takeover_at:
                    self.send_worker(w.identity, self._dispatch_message(task))
                    again += 1
        log.info("settled: %d dispatch(es) repeated for the workers to confirm; placing the queue", again)
        self.place_queued()

    def beat_workers(self) -> None:
        """A HEARTBEAT to every worker now (our state changed: they must know at once)."""
        for worker in self.registry:
            self._beat(worker)

    def _beat(self, worker: WorkerRecord) -> None:
        seq = worker.liveness.sent(self.now)
        self.send_worker(worker.identity, [_WORKER_SIG, P.CMD_BYTES[Command.HEARTBEAT],
                                           _packb({"seq": seq, "active": self.active, "epoch": self.epoch, "acks": self.acking})])

    # ------------------------------------------------------------------ timers

    def tick(self, now: float) -> None:
        """Heartbeats out, dead workers out, expired queue entries and leases, old replies."""
        self.now = now
        for worker in self.registry:
            if worker.liveness.expired(now):
                self.worker_lost(worker, f"silent for {worker.liveness.silence(now):.1f}s")
            elif worker.liveness.beat_due(now):
                self._beat(worker)
        if self.settling_until is not None and now >= self.settling_until:
            log.warning("settling timed out; %d worker(s) did not answer at epoch %d: %s",
                        len(self.settle_wait), self.epoch, ", ".join(sorted(self.settle_wait)))
            self._settled()
        if len(self.lost_sessions) > 10_000:
            self.lost_sessions.clear()
        if not self.active:
            self.tasks.evict(now)
            return
        if self.sessions and now >= self._sweep_at:
            self._end_sessions_gone()
            self._sweep_at = now + SESSION_SWEEP_S
        for task in self.queue.expire(now):
            self._fail(task, Timeout("no GPU could take the request before its deadline"))
        lease = self.config.session_lease
        for s in list(self.sessions.values()):
            if not s.closing and now - s.last_seen > lease:
                self._expire_session(s)
        self.tasks.evict(now)

    def _expire_session(self, s: Session) -> None:
        worker = self.registry.by_name.get(s.worker)
        log.info("session %s: client silent past the %.0fs lease; reclaiming", P.id_text(s.id), self.config.session_lease)
        if worker is None:
            self.sessions.pop(s.id, None)
            return
        s.closing = True
        task = Task(
            id=P.new_id(), kind="call", need=None,
            body={"session": s.id, "op": "close", "args": {}}, frames=[], route=None,
            created=self.now, deadline=self.now, tenant=s.tenant, session=s.id,
        )
        self.tasks.add(task)
        self._send_dispatch(worker, task)

    def fail_queued(self, exc: GpudError) -> int:
        """Answer every queued request with ``exc`` (the broker is draining); returns how many."""
        queued = [t for t in self.queue.in_order(self.now) if t.state is State.QUEUED]
        for task in queued:
            self._fail(task, exc)
        return len(queued)

    def dispatched(self) -> int:
        """Requests and session operations sent to workers and not answered yet."""
        return sum([len(w.assigned) for w in self.registry.by_identity.values()])

    def shutdown(self) -> None:
        """Tell every worker goodbye (the broker is stopping)."""
        for worker in self.registry:
            self.send_worker(worker.identity, [_WORKER_SIG, P.CMD_BYTES[Command.DISCONNECT], _packb({"reason": "broker stopping"})])
