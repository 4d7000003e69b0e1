"""A broker's turns in the pair (PROTOCOL.md §9.4): taking over with the replicated tables,
settling until its workers have answered at the new epoch, and stepping down. Pure: no sockets.

``Takeover`` works on the BrokerCore it belongs to: the core owns the tables and the role
(``active``, ``epoch``, ``hold``, ``fenced``); this owns what happens to them when the role changes,
and the settling that follows a takeover.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpud import protocol
from gpud.errors import Busy, NotActive, SessionLost, WorkerLost
from gpud_broker.registry import WorkerRecord
from gpud_broker.replication import NULL_JOURNAL, Journal
from gpud_broker.starts import Loss, on_loss
from gpud_broker.tasks import State, Task

if TYPE_CHECKING:
    from gpud_broker.core import BrokerCore

log = logging.getLogger(__name__)

MAX_RUNNING = 10_000  # entries of a worker's running list looked at


class Takeover:
    """Settling after a takeover: which workers have not yet answered at the new epoch, and until
    when they are waited for."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self.settling_until: float | None = None
        self.waiting: set[str] = set()  # workers not yet heard at the new epoch
        self.unheard: set[str] = set()  # of those, the ones settling stopped waiting for
        self.at = 0.0  # when this broker last took over

    def take_over(self, epoch: int, settle: float, now: float) -> None:
        """Become the active broker at ``epoch`` with the replicated tables (and a new replication
        journal): rebuild the ledger from the running work and sessions on connected workers,
        queue what was queued, tell every worker, and settle (place nothing) until each has
        answered at the new epoch or ``settle`` seconds pass."""
        core = self.core
        core.now = now
        core.active = True
        core.epoch = epoch
        core.journal = Journal()  # a new stream: the peer syncs from a snapshot
        core.staging.new_stream()
        core.max_epoch_seen = max(core.max_epoch_seen, epoch)
        core.fenced = False
        self.at = now
        core.counters["takeovers"] += 1
        registry, accounts, leases = core.registry, core.accounts, core.leases
        for sid, session in list(leases.sessions.items()):
            worker = registry.by_name.get(session.worker)
            if worker is None or not accounts.restore(worker, session.grant, session.tenant, True, now):
                del leases.sessions[sid]
                leases.lost[sid] = session.worker
                continue
            session.last_seen = now
        lost: list[Task] = []
        queued: list[Task] = []
        for task in core.tasks.tasks.values():
            if task.state is not State.DONE:
                core.stats.take_over(task.kind)  # accepted by the other broker: answered by this one
            if task.state is State.QUEUED:
                queued.append(task)
            elif task.state is State.RUNNING:
                worker = registry.by_name.get(task.worker or "")
                if worker is None:
                    lost.append(task)
                    continue
                worker.assigned[task.id] = task
                grant = task.grant
                if grant is not None and accounts.restore(worker, grant, task.tenant, task.kind == "session", now):
                    worker.inflight += 1
        for task in sorted(queued, key=lambda t: t.created):
            if not core.queue.push(task):
                core.fail(task, Busy("the queue is full"))
        core.dispatcher.open_workers = core.dispatcher.count_open_workers()
        core.hold = True
        self.waiting = {w.name for w in registry.by_identity.values()}
        self.unheard = set()
        self.settling_until = now + settle
        log.warning("broker %s is active at epoch %d: %d queued, %d running, %d session(s); settling with %d worker(s)",
                    core.config.name, epoch, len(queued), sum(len(w.assigned) for w in registry.by_identity.values()),
                    len(leases.sessions), len(self.waiting))
        core.workers.beat_all()
        for task in lost:
            name = task.worker or "?"
            loss = on_loss(core.starts, task)
            if loss is Loss.SESSION_LOST:
                core.fail(task, SessionLost(f"the session's worker {name} is gone"))
            elif loss is Loss.REPLACE:
                core.dispatcher.place_again(task, name, "not connected after the failover")
            else:
                core.fail(task, WorkerLost(f"worker {name} was lost during a broker failover while running it"))
        core.staging.lost_in_takeover(core)
        if not self.waiting:
            self._settled()

    def heard(self, worker: WorkerRecord, epoch: Any, running: Any) -> None:
        """A heartbeat of ``worker`` showing ``epoch`` and listing ``running`` (unchecked): its
        first at our new epoch ends its part of the settling (or, heard only after settling
        ended, is read as it would have been)."""
        if type(epoch) is not int or epoch < self.core.epoch:
            return
        if self.settling_until is not None and worker.name in self.waiting:
            self.waiting.discard(worker.name)
            if type(running) is list:
                self._reconcile(worker, running)
            if not self.waiting:
                self._settled()
        elif worker.name in self.unheard:
            self.unheard.discard(worker.name)
            if type(running) is list:
                self._reconcile(worker, running)

    def worker_gone(self, name: str) -> None:
        self.waiting.discard(name)
        self.unheard.discard(name)

    def tick(self, now: float) -> None:
        if self.settling_until is not None and now >= self.settling_until:
            log.warning("settling timed out; %d worker(s) did not answer at epoch %d: %s",
                        len(self.waiting), self.core.epoch, ", ".join(sorted(self.waiting)))
            self._settled()

    def _reconcile(self, worker: WorkerRecord, running: list[Any]) -> None:
        """A worker's first heartbeat at our new epoch lists what it runs: work our tables had
        queued is running there; work we never heard of is kept as running there, so that its
        client's retry attaches to it instead of running it again; a job that began there and
        that it no longer holds was lost there."""
        core = self.core
        now = core.now
        listed: set[bytes] = set()
        for entry in running[:MAX_RUNNING]:
            if type(entry) is not dict:
                continue
            rid = entry.get("id")
            if type(rid) is not bytes or len(rid) != protocol.ID_BYTES:
                continue
            listed.add(rid)
            task = core.tasks.tasks.get(rid)
            if task is not None and task.state is not State.QUEUED:
                continue
            if task is None:
                kind, tenant = entry.get("kind"), entry.get("tenant")
                if kind == "session":
                    continue  # a session the tables lack: its open was never answered; it is the worker's to reclaim
                task = Task(id=rid, kind=kind if type(kind) is str else "job", need=None, body={}, frames=[], route=None,
                            created=now, deadline=now, tenant=tenant if type(tenant) is str else "default",
                            dispatched_at=float("inf"))  # not ours to dispatch again: we lack its content
                core.tasks.add(task)
                core.journal.task(task, now)
            else:
                core.queue.remove(task)
            task.state = State.RUNNING
            task.worker = worker.name
            task.dispatched_at = float("inf")  # it runs there already: never dispatched again
            worker.assigned[rid] = task
            core.journal.run(rid, worker.name, None)
            log.info("after the failover: %s runs on %s (dispatched by the previous broker)", protocol.id_text(rid), worker.name)
        if len(running) <= MAX_RUNNING:  # a list cut short names not all it holds
            self._take_off_lost(worker, listed)

    def _take_off_lost(self, worker: WorkerRecord, listed: set[bytes]) -> None:
        """The jobs marked started before the takeover that ``worker`` does not list: it asked
        START for each, so it had them, and it holds none of them now, neither running nor as a
        RESULT (it sends those again before this heartbeat, PROTOCOL.md §9.4): it lost them (it
        restarted, or forgot them). Dispatched again, each would begin a second time; each is
        taken off it as its loss would (§4.3): placed again elsewhere if idempotent, else
        WORKER_LOST."""
        gone = [task for task in worker.assigned.values()
                if task.kind == "job" and task.state is State.RUNNING and task.id not in listed
                and task.dispatched_at <= self.at and self.core.starts.may_have_begun(task)]
        for task in gone:
            log.warning("after the failover: job %s began on %s, which no longer holds it: lost there",
                        protocol.id_text(task.id), worker.name)
            self.core.workers.take_off(worker, task, "its worker no longer holds it after the failover")

    def _settled(self) -> None:
        """Settling is over: dispatch again what ran before the takeover (a worker that has it
        running or answered ignores or re-answers it; one that never got it runs it), then place.
        A job that may have begun is not dispatched again to a worker not heard at the new epoch
        yet: its first heartbeat there says whether it still holds it."""
        core = self.core
        self.settling_until = None
        self.unheard, self.waiting = self.waiting, set()
        core.hold = False
        again = 0
        for worker in core.registry.by_identity.values():
            unheard = worker.name in self.unheard
            for task in list(worker.assigned.values()):
                if unheard and task.kind == "job" and core.starts.may_have_begun(task):
                    continue
                if task.state is State.RUNNING and task.dispatched_at <= self.at:
                    core.send_worker(worker.identity, core.dispatcher.message(task))
                    again += 1
        log.info("settled: %d dispatch(es) repeated for the workers to confirm; placing the queue", again)
        core.dispatcher.place_queued()

    def step_down(self) -> int:
        """Stop being active (another broker is): clients of unfinished work are told NOT_ACTIVE
        so they send it, same ids, to the other broker; the tables are dropped. Returns how many
        clients were told."""
        core = self.core
        told = 0
        exc = NotActive(f"broker {core.config.name} is no longer the active one; use its peer")
        for task in core.tasks.tasks.values():
            if task.state is not State.DONE:
                core.reply_to(task, protocol.error_reply(task.id, exc))
                told += 1
        core.active = False
        core.hold = True
        core.fenced = False
        self.settling_until = None
        self.waiting = set()
        self.unheard = set()
        core.journal = NULL_JOURNAL
        core.clear_work()
        core.workers.beat_all()
        log.warning("broker %s stepped down to passive; %d client(s) sent to the peer", core.config.name, told)
        return told
