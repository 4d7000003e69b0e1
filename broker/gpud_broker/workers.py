"""The broker's side of a worker's membership: its READY (admitted, refused, or resuming a
suspended worker of the same process), its heartbeats (GPU state, what it runs, the epochs it has
seen), the broker's heartbeats to it, its silence (suspended, then lost), its loss, and the
operator's drain marks. Pure: no sockets.

What a worker reports about the work it was given (RESULT, START) is ``results``'; placing that
work is the ``dispatcher``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from gpud import protocol
from gpud.errors import GpudError, ProtocolError, SessionLost, WorkerLost
from gpud.heartbeat import Liveness
from gpud.protocol import Command, Peer, Ready
from gpud_broker.accounts import Accounts
from gpud_broker.config import BrokerConfig
from gpud_broker.direct import renew_leases
from gpud_broker.dispatcher import Dispatcher, Send
from gpud_broker.leases import SessionLeases
from gpud_broker.queue import PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import Journal
from gpud_broker.sessions import SessionEnds
from gpud_broker.starts import Loss, StartGate, on_loss
from gpud_broker.tasks import State, Task, TaskTable

log = logging.getLogger(__name__)

Settle = Callable[[WorkerRecord, Any, Any], None]  # a heartbeat's worker, epoch and running list (unchecked)

MAX_RUNNING_KEPT = 1000  # entries of a heartbeat's running list kept (more: it may be cut short)
MAX_GPU_STATES = 64  # entries of a heartbeat's GPU list looked at
HEARD_SINCE_S = 1e-6  # a stall's credit leaves a worker's last_heard this far before the stall's end at most


class WorkerCore(Protocol):
    """What the worker dialog reads of the broker's core (``BrokerCore``): the time, its role in a
    pair, the tables a takeover or a reload replaces, how work ends, and who else tracks workers."""

    now: float
    active: bool
    hold: bool
    epoch: int
    fenced: bool
    max_epoch_seen: int
    worker_names_bound: bool  # CURVE: a worker's name must be its key's name
    config: BrokerConfig
    journal: Journal
    queue: PendingQueue[Task]
    tasks: TaskTable
    counters: dict[str, int]

    def fail(self, task: Task, exc: GpudError) -> None: ...
    def worker_gone(self, name: str) -> None: ...


class WorkerDialog:
    """Which workers are connected and alive, as the broker learns it from their messages."""

    def __init__(self, core: WorkerCore, registry: WorkerRegistry, accounts: Accounts, leases: SessionLeases,
                 session_ends: SessionEnds, dispatcher: Dispatcher, settle: Settle, starts: StartGate,
                 send_worker: Send) -> None:
        self.core = core
        self.registry = registry
        self.accounts = accounts
        self.leases = leases
        self.session_ends = session_ends
        self.dispatcher = dispatcher
        self.settle = settle  # the takeover's (``Takeover.heard``): a heartbeat may end its settling
        self.starts = starts
        self.send_worker = send_worker
        self._credits: dict[str, tuple[float, float, float]] = {}  # name -> (last_heard as credited, credit given in its silence, its longest stall)

    # ------------------------------------------------------------------ READY

    def on_ready(self, identity: bytes, current: WorkerRecord | None, header: dict[str, Any],
                 user: str | None = None) -> None:
        """A worker's READY. Under CURVE (``worker_names_bound``) ``user`` is its key's name (the
        ZAP User-Id): the allow-list file ``workers/NAME.key`` admits worker NAME and no other."""
        try:
            ready = protocol.parse_ready(header)
        except ProtocolError as exc:
            self.core.counters["bad_messages"] += 1
            log.warning("bad message from worker %s: %s bad READY: %s", identity.hex()[:16], exc.code, exc.message)
            self.send_worker(identity, protocol.encode(Peer.WORKER, Command.ERROR, {"code": exc.code, "message": exc.message}))
            return
        # Refuse before tearing anything down: a refused READY must not cost a live worker.
        previous = self.registry.by_name.get(ready.name)
        why = self._refusal(ready, current, previous, user)
        if why is not None:
            self.refuse(identity, ready.name, why)
            return
        if previous is not None and previous is not current and self._same_process(ready, previous):
            if current is not None:
                self.lost(current, "sent READY again")
            self._resume_on(identity, previous, ready)
            return
        if current is not None:
            self.lost(current, "sent READY again")
        if previous is not None and previous is not current:
            # Silent past its liveness (else refused above), suspended or not yet: the READY is
            # another process's where it names its incarnation (the same one resumed above).
            self.lost(previous, "silent past its liveness, and a new connection of the same name came"
                      + (" from another process" if ready.incarnation else ""))
        self._admit(identity, ready)

    def _refusal(self, ready: Ready, current: WorkerRecord | None, previous: WorkerRecord | None,
                 user: str | None) -> str | None:
        """Why ``ready`` is refused (None: it is admitted). ``previous``: the worker of its name."""
        name, now = ready.name, self.core.now
        if self.core.worker_names_bound and user != name:
            return (f"refused: this worker's key is workers/{user}.key, which admits "
                    f"worker {user} only, not {name}: start it with --name {user}")
        if (previous is not None and previous is not current and not previous.liveness.expired(now)
                and not self._same_process(ready, previous)):
            return (f"refused: worker {name} is already connected from host {previous.hostname} (for "
                    f"{now - previous.connected_at:.0f}s); give each worker a name of its own (--name)")
        replaced = {w.name for w in (current, previous) if w is not None}
        for gpu in ready.gpus:
            holder = self.registry.gpus.get(gpu.uuid)
            if holder is not None and holder.worker.name not in replaced:
                return f"refused: GPU {gpu.uuid} is already registered by worker {holder.worker.name}"
        return None

    @staticmethod
    def _same_process(ready: Ready, worker: WorkerRecord) -> bool:
        """``ready`` comes from the process of ``worker``, on another connection (its incarnation)."""
        return bool(ready.incarnation) and ready.incarnation == worker.incarnation

    def _admit(self, identity: bytes, ready: Ready) -> None:
        """Register the worker ``ready`` describes, welcome it, and place what waits."""
        core = self.core
        policy = core.config.heartbeat.negotiate(ready.heartbeat_ms / 1000.0, ready.liveness)
        worker = self.registry.add(
            name=ready.name, identity=identity, hostname=ready.hostname, gpus=ready.gpus,
            cpu_milli=ready.cpu_milli, host_mem=ready.host_mem, slots=ready.slots, policy=policy,
            now=core.now, simulated=ready.simulated, instance_id=ready.instance_id, replica_of=ready.replica_of,
            incarnation=ready.incarnation,
        )
        worker.isolation, worker.job_network, worker.pool_users, worker.pool_kinds = ready.isolation
        self.registry.pool_index.file(worker)
        if worker.has_slot:
            self.dispatcher.open_workers += 1
        self.dispatcher.workers_changed()
        log.info(
            "worker %s ready: %d GPU(s)%s, %d slots, heartbeat %.3fs x %d", ready.name, len(ready.gpus),
            " (simulated)" if worker.simulated else "", ready.slots, policy.interval, policy.liveness,
        )
        self._welcome(identity, policy.interval, policy.liveness)
        self.dispatcher.place_queued()

    def _welcome(self, identity: bytes, interval: float, liveness: int, resumed: dict[str, Any] | None = None) -> None:
        core = self.core
        self.send_worker(identity, protocol.encode(Peer.WORKER, Command.WELCOME, {
            "heartbeat_ms": round(interval * 1000), "liveness": liveness, "broker": core.config.name,
            "active": core.active, "epoch": core.epoch, "acks": True,
            "max_message_bytes": core.config.max_message_bytes, **(resumed or {})}))

    def _resume_on(self, identity: bytes, worker: WorkerRecord, ready: Ready) -> None:
        """The process of ``worker`` (suspended, or its old connection cut) is on a new one (``identity``): its
        record is rebound to it and reconciled with what its READY ``holds`` (PROTOCOL.md §4.2):
        bound work it no longer holds ends there, work it holds that the broker took off it (placed
        again, or ended) is named in the WELCOME's ``stop``."""
        core = self.core
        policy = core.config.heartbeat.negotiate(ready.heartbeat_ms / 1000.0, ready.liveness)
        self.registry.rebind(worker, identity)
        worker.liveness = Liveness(policy, core.now)
        gone: list[Task] = []
        stop: list[bytes] = []
        if core.active and not core.hold:  # a passive or settling broker decides nothing (§9.4)
            holds = ready.holds
            gone = [t for t in worker.assigned.values() if t.id not in holds]
            for task in gone:
                self.take_off(worker, task, "its worker came back without it")
            for sid in self.leases.on_worker(worker.name):
                if sid not in holds:
                    self.session_ends.lost(sid, worker.name)
            tasks = core.tasks.tasks
            for rid in holds:
                t = tasks.get(rid)
                if rid not in worker.assigned and t is not None and t.kind in ("job", "echo"):
                    stop.append(rid)
        if worker.suspended_at:
            self._resume(worker, "on a new connection, the same process")
        log.info("worker %s resumed: %d task(s) kept, %d ended, %d to stop there",
                 worker.name, len(worker.assigned), len(gone), len(stop))
        self._welcome(identity, policy.interval, policy.liveness, {"resumed": True, "stop": sorted(stop)})
        self.dispatcher.place_queued()

    def refuse(self, identity: bytes, name: str, reason: str) -> None:
        """Refuse a READY: logged here, and the worker is told why (DISCONNECT: it retries later)."""
        self.core.counters["refused_workers"] += 1
        log.error("worker %s %s", name, reason)
        self.send_worker(identity, protocol.encode(Peer.WORKER, Command.DISCONNECT, {"reason": reason}))

    # ------------------------------------------------------------------ HEARTBEAT

    def on_heartbeat(self, worker: WorkerRecord, header: dict[str, Any]) -> None:
        """A worker's HEARTBEAT (every field unchecked until read here)."""
        seq = header.get("seq")
        if type(seq) is int:
            worker.liveness.seq_heard = max(worker.liveness.seq_heard, seq)
        gpus = header.get("gpus")
        if type(gpus) is list:
            self._gpu_states(worker, gpus)
        running = header.get("running")
        if type(running) is list:
            self._running(worker, running)
        if header.get("draining") is True and not worker.draining:
            log.info("worker %s is draining: no new work goes to it", worker.name)
            self.dispatcher.set_draining(worker, True)
        held = header.get("held_outputs")
        if type(held) is int and held >= 0:
            worker.held_outputs = held
        age = header.get("active_age_ms")
        if type(age) is int and age >= 0:
            worker.other_active_at = self.core.now - age / 1000.0
        epoch = header.get("epoch")
        if type(epoch) is int:
            self._saw_epoch(worker, epoch)
        self.settle(worker, epoch, running)

    def _gpu_states(self, worker: WorkerRecord, gpus: list[Any]) -> None:
        states = {}
        for raw in gpus[:MAX_GPU_STATES]:
            try:
                uuid, state = protocol.parse_gpu_state(raw)
            except ProtocolError:
                continue
            states[uuid] = state
        if self.registry.update_state(worker, states):
            self.dispatcher.workers_changed()

    def _running(self, worker: WorkerRecord, running: list[Any]) -> None:
        """The work ``worker`` says it runs: its sessions' leases renewed, sessions it should not
        hold closed there."""
        core = self.core
        worker.running = [r for r in running[:MAX_RUNNING_KEPT] if type(r) is dict]
        worker.running_at = core.now if len(running) < MAX_RUNNING_KEPT else 0.0  # a full list: maybe cut short
        if self.leases.sessions:
            renew_leases(self.leases.sessions, worker.name, worker.running, core.now)
        if core.active and not core.hold:
            for sid, tenant in self.leases.strays(worker.name, worker.running, core.tasks.tasks):
                self.session_ends.close_stray(worker, sid, tenant)

    def _saw_epoch(self, worker: WorkerRecord, epoch: int) -> None:
        core = self.core
        if epoch > core.max_epoch_seen:
            core.max_epoch_seen = epoch
            if core.active and epoch > core.epoch:
                log.error("worker %s has seen epoch %d, later than ours (%d): another broker is active",
                          worker.name, epoch, core.epoch)
                core.fenced = True

    def beat_all(self) -> None:
        """A HEARTBEAT to every worker now (our state changed: they must know at once)."""
        for worker in self.registry:
            self.beat(worker)

    def beat(self, worker: WorkerRecord) -> None:
        core = self.core
        seq = worker.liveness.sent(core.now)
        self.send_worker(worker.identity, protocol.encode(Peer.WORKER, Command.HEARTBEAT, {
            "seq": seq, "active": core.active, "epoch": core.epoch, "acks": True}))

    # ------------------------------------------------------------------ silence

    def check_liveness(self, now: float, caught_up: bool = True) -> None:
        """Once per tick: a worker silent past its liveness is suspended (an active broker with a
        grace window) or lost; one suspended past its grace window is lost; the others are sent
        their heartbeat when due (a suspended one too: a stalled process that wakes hears us).
        ``caught_up`` False: worker messages still wait to be read, so none is judged silent now."""
        for worker in self.registry:
            if caught_up and self._lost_to_silence(worker, now):
                continue
            if worker.liveness.beat_due(now):
                self.beat(worker)

    def stalled(self, gap: float, now: float) -> None:
        """The broker's own loop did not turn for ``gap`` seconds (a stall, a freeze, one long
        turn): it read nothing meanwhile, so that time is no worker's silence, nor its grace. The
        credit is capped (PROTOCOL.md §4.2): within one silence of a worker (until it is heard
        again), at most its longest stall plus one liveness expiry, so that a broker whose every
        turn is slow still judges a worker that sends nothing silent, and lost, in bounded time."""
        credits: dict[str, tuple[float, float, float]] = {}
        for worker in self.registry:
            live = worker.liveness
            marker, given, longest = self._credits.get(worker.name, (live.last_heard, 0.0, 0.0))
            if marker != live.last_heard:  # heard since its last credit: a new silence
                given = longest = 0.0
            longest = max(longest, gap)
            credit = max(0.0, min(gap, longest + live.policy.expiry - given))
            # Just short of ``now``: a message read at ``now`` then tells that it was heard since.
            live.last_heard = max(live.last_heard, min(now - HEARD_SINCE_S, live.last_heard + credit))
            if worker.suspended_at:
                worker.suspended_at = min(now, worker.suspended_at + credit)
            credits[worker.name] = (live.last_heard, given + credit, longest)
        self._credits = credits  # the workers gone since are forgotten

    def _lost_to_silence(self, worker: WorkerRecord, now: float) -> bool:
        """Judge ``worker``'s silence: suspended, or lost (returns whether it was lost)."""
        live, periods = worker.liveness, self.core.config.worker_resume_periods
        if worker.suspended_at:
            if now - worker.suspended_at <= periods * live.policy.expiry:
                return False
            self.lost(worker, f"silent for {live.silence(now):.1f}s, not back in its grace window")
            return True
        if not live.expired(now):
            return False
        if periods <= 0 or not self.core.active:
            self.lost(worker, f"silent for {live.silence(now):.1f}s")
            return True
        self._suspend(worker, now)
        return False

    def _suspend(self, worker: WorkerRecord, now: float) -> None:
        """``worker`` is silent past its liveness: nothing new goes to it, and its work that may
        be placed again is, now; what may have begun stays bound to it (PROTOCOL.md §4.2)."""
        core = self.core
        core.counters["worker_suspensions"] += 1
        worker.suspended_at = now
        worker.draining_before = worker.draining
        self.dispatcher.set_draining(worker, True)
        core.queue.drop_reservations_on(worker.name)
        again = [t for t in worker.assigned.values() if t.state is State.RUNNING and t.kind != "call"
                 and t.need is not None and (t.retryable or not self.starts.may_have_begun(t))]
        log.warning("worker %s silent for %.1fs: suspended for %d liveness period(s); %d task(s) placed again, "
                    "%d kept for it", worker.name, worker.liveness.silence(now), core.config.worker_resume_periods,
                    len(again), len(worker.assigned) - len(again))
        worker.taken_off = {t.id for t in again if t.kind == "job"}
        for task in again:
            self.take_off(worker, task, "its worker went silent")

    def resume(self, worker: WorkerRecord) -> None:
        """A message came on suspended ``worker``'s connection: it is live again. The jobs placed
        again meanwhile are named in a WELCOME's ``stop``: its copies must not run on."""
        stop = sorted(worker.taken_off)
        self._resume(worker, "it was heard again")
        if stop:
            policy = worker.liveness.policy
            self._welcome(worker.identity, policy.interval, policy.liveness, {"resumed": True, "stop": stop})
        self.dispatcher.place_queued()

    def _resume(self, worker: WorkerRecord, why: str) -> None:
        self.core.counters["worker_resumes"] += 1
        log.warning("worker %s is back after %.1fs suspended (%s); its work stays on it",
                    worker.name, self.core.now - worker.suspended_at, why)
        worker.suspended_at = 0.0
        worker.taken_off = set()
        self.dispatcher.set_draining(worker, worker.draining_before or worker.name in self.registry.drained)

    def take_off(self, worker: WorkerRecord, task: Task, why: str) -> None:
        """Take ``task`` off live ``worker`` (its slot freed, its grant refunded) and place it
        again or fail it, as its worker's loss would (PROTOCOL.md §4.3; a CALL: WORKER_LOST)."""
        core = self.core
        worker.assigned.pop(task.id, None)
        if task.state is not State.RUNNING:
            return
        if task.grant is not None:
            self.dispatcher.freed(worker)
            self.accounts.refund(task.grant, task.tenant, task.kind == "session", core.now, worker)
        loss = on_loss(self.starts, task)
        if loss is Loss.REPLACE:
            self.dispatcher.place_again(task, worker.name, why)
        else:
            core.fail(task, WorkerLost(f"worker {worker.name} lost it ({why})"))

    # ------------------------------------------------------------------ loss

    def lost(self, worker: WorkerRecord, why: str, graceful: bool = False) -> None:
        """Remove a worker; place its retryable work again, fail the rest (PROTOCOL.md §4.3).
        ``graceful``: it said goodbye (not counted in ``counters["worker_losses"]``)."""
        core = self.core
        if not graceful:
            core.counters["worker_losses"] += 1
        (log.info if graceful else log.warning)(
            "worker %s lost (%s): %d task(s) were on it", worker.name, why, len(worker.assigned))
        if worker.pos >= 0 and worker.has_slot:
            self.dispatcher.open_workers -= 1
        self.registry.remove(worker)
        self.dispatcher.workers_changed()
        core.worker_gone(worker.name)
        if not core.active:  # the passive broker keeps the tables as replicated; the active one decides
            return
        core.queue.drop_reservations_on(worker.name)
        for sid in self.leases.on_worker(worker.name):
            self.session_ends.lost(sid, worker.name)  # its ledger went with the worker's record
        retry: list[Task] = []
        for task in worker.assigned.values():
            if task.state is State.RUNNING and self._may_place_again(task, worker, why):
                retry.append(task)
        worker.assigned.clear()
        for task in retry:
            self.dispatcher.place_again(task, worker.name, why)

    def _may_place_again(self, task: Task, worker: WorkerRecord, why: str) -> bool:
        """``task`` ran on ``worker``, which is lost: its grant is refunded, and it is failed
        unless it may be placed again (returns whether it may)."""
        if task.grant is not None:  # its ledger went with the worker's record
            self.accounts.refund(task.grant, task.tenant, task.kind == "session", self.core.now, None)
        loss = on_loss(self.starts, task)
        if loss is Loss.REPLACE:
            return True
        if loss is Loss.SESSION_LOST:
            self.core.fail(task, SessionLost(f"the session's worker {worker.name} was lost ({why})"))
        else:
            self.core.fail(task, WorkerLost(f"worker {worker.name} was lost ({why}) while running it"))
        return False

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
        if w is not None:
            self._mark(w, drained)
        self.marks_changed()

    def _mark(self, worker: WorkerRecord, drained: bool) -> None:
        """The operator's drain mark on ``worker``; a suspended one takes it when it resumes."""
        if worker.suspended_at:
            worker.draining_before = drained
        elif worker.draining != drained:
            self.dispatcher.set_draining(worker, drained)

    def marks_changed(self) -> None:
        """The operator drained or cordoned something (or undid it): replicate the marks."""
        self.core.journal.marks(self.registry.drained, self.registry.cordoned)

    def set_marks(self, drained: list[str], cordoned: list[str]) -> None:
        """Take the operator's marks as replicated (drained workers, cordoned GPUs)."""
        registry = self.registry
        registry.drained, registry.cordoned = set(drained), set(cordoned)
        for w in registry.by_identity.values():
            self._mark(w, w.name in registry.drained)
            for gpu in w.gpus:
                gpu.cordoned = gpu.uuid in registry.cordoned
