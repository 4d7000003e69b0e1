"""Placing requests: choosing a GPU for each and dispatching it there. Pure: no sockets.

``Dispatcher`` owns the policy (and the task mix the fragmentation-aware ones judge against), the
count of workers with a free slot, and the caches that keep a decision cheap. Each decision (the
policy call) is timed into ``placement_times`` (admin ``status`` shows its p50/p99). With the ``balanced``
policy and more than ``SAMPLE_ABOVE`` workers, the policy is first offered ``SAMPLE_K`` workers
drawn at random from the registry (power-of-k-choices: the least-loaded GPU of the sample, not of
the cluster), and the whole cluster only when none of the sample can take the request; so one
decision costs about the same with 1,000 workers as with 16, and a request that only a few workers
can take still finds them. The default, ``fgd-balanced``, samples inside the policy
(``policies``: random workers plus the ones it chose last); ``fgd`` and the packing policies always
see every worker. ``open_workers`` counts the workers with a free slot (not draining, fewer requests
in flight than slots), kept at every dispatch, result, worker arrival and loss, and drain change:
while it is 0 nothing can be placed, and placing returns at once instead of asking the policy to
scan every worker.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Set
from dataclasses import replace
from time import perf_counter
from typing import Any, Protocol

from gpud import protocol
from gpud.errors import GpudError, WorkerLost
from gpud.resources import Need
from gpud_broker.accounts import Accounts
from gpud_broker.config import BrokerConfig
from gpud_broker.mix import TaskMix
from gpud_broker.policies import (
    SAMPLE_ABOVE,
    SAMPLE_K,
    Policy,
    could_ever_fit,
    make_policy,
    pool_blocked,
    reserve_worker,
)
from gpud_broker.queue import PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import Journal
from gpud_broker.stats import PlacementTimes, RequestStats
from gpud_broker.tasks import State, Task

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], object]  # the shell's send function to one socket: (routing id, frames)


class DispatchCore(Protocol):
    """What the dispatcher reads of the broker it places for (``BrokerCore``): the time, the role and
    the tables a pair's takeover or a reload replaces, and how a task that cannot be placed ends."""

    now: float
    hold: bool  # place nothing (passive, or settling after a takeover)
    epoch: int
    config: BrokerConfig
    journal: Journal
    queue: PendingQueue[Task]

    def fail(self, task: Task, exc: GpudError) -> None: ...


class Dispatcher:
    """Where each request runs: the policy's choice among the registry's workers, charged to the
    accounts, and the DISPATCH that sends it there. ``rng`` draws the placement samples (seeded:
    the same events place the same way)."""

    def __init__(self, broker: DispatchCore, registry: WorkerRegistry, accounts: Accounts, stats: RequestStats,
                 send_worker: Send, rng: random.Random) -> None:
        self.broker = broker
        self.registry = registry
        self.accounts = accounts
        self.stats = stats
        self.send_worker = send_worker
        self.rng = rng
        # The running mix of requests the fragmentation-aware policies judge against: fed with
        # every accepted request's need, only when such a policy is configured.
        self.mix = TaskMix()
        self.policy: Policy
        self.observe: Callable[[Need], object] | None
        self.set_policy(broker.config.policy)
        self.placement_times = PlacementTimes()  # seconds per placement decision (admin status)
        self.open_workers = 0  # registered workers with a free slot (see the module docstring)
        self._fits: dict[Need, bool] = {}  # could_ever_fit by need; cleared when workers change
        self._tenant_needs: dict[tuple[Need, str], Need] = {}

    def set_policy(self, name: str) -> None:
        """Place by policy ``name`` from now on (a reload); the task mix is kept, and its random
        choices are seeded from ``rng``."""
        self.policy = make_policy(name, seed=self.rng.getrandbits(32), mix=self.mix)
        self.observe = self.mix.observe if name.startswith("fgd") else None

    # ------------------------------------------------------------------ placing

    def try_dispatch(self, task: Task, excluded: Set[str] = frozenset()) -> bool:
        """Place and dispatch ``task`` now if some GPU can take it (never on ``excluded`` workers)."""
        need = task.need
        assert need is not None  # only placed kinds reach here
        broker = self.broker
        if self.open_workers <= 0 or broker.hold:
            return False  # no worker has a free slot (or placing is held): nothing can be placed
        accounts = self.accounts
        if accounts.limits and not accounts.within_limits(task.tenant, need, task.kind == "session"):
            return False  # it waits until its tenant holds less
        avoid = task.avoid | excluded if excluded else task.avoid
        registry = self.registry
        if task.kind in ("job", "session"):  # work that holds a pool user on its worker
            blocked = pool_blocked(task.kind, task.tenant, registry.pool_index.candidates(task.tenant),
                                   broker.config.tenant_pool_share)
            if blocked:
                avoid = avoid | blocked
        t0 = perf_counter()
        # Sampling keeps the intent of a load-spreading policy only (the policy may change on reload).
        if len(registry.workers) > SAMPLE_ABOVE and broker.config.policy == "balanced":
            placement = self.policy(need, registry.sample(SAMPLE_K, self.rng), avoid)
            if placement is None:  # none of the sample can take it: ask the whole cluster
                placement = self.policy(need, registry.by_identity.values(), avoid)
        else:
            placement = self.policy(need, registry.by_identity.values(), avoid)
        self.placement_times.record(perf_counter() - t0)
        if placement is None:
            return False
        worker = placement.worker
        task.grant = accounts.charge(worker, placement.gpus, need, task.tenant, task.kind == "session", broker.now,
                                     pool=task.kind in worker.pool_kinds)
        task.attempts += 1
        self.send(worker, task)
        return True

    def send(self, worker: WorkerRecord, task: Task) -> None:
        """Dispatch ``task`` to ``worker``: it runs there from now on (as far as the tables know)."""
        now = self.broker.now
        if not task.dispatched_at:
            self.stats.dispatched(task.kind, now - task.created)
        task.state = State.RUNNING
        task.worker = worker.name
        task.dispatched_at = now
        worker.assigned[task.id] = task
        self.broker.journal.run(task.id, worker.name, task.grant)
        if task.grant is not None:
            had = worker.has_slot
            worker.inflight += 1
            if had and not worker.has_slot:
                self.open_changed(worker, had)
        self.send_worker(worker.identity, self.message(task))

    def message(self, task: Task) -> list[Any]:
        """The DISPATCH of ``task`` (PROTOCOL.md §4.3): the grant the worker sets its limits from."""
        header: dict[str, Any] = {"id": task.id, "kind": task.kind, "tenant": task.tenant, "epoch": self.broker.epoch}
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
        broker = self.broker
        if task.attempts >= broker.config.max_attempts:
            broker.fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) after {task.attempts} attempts"))
        elif self.try_replica(task, worker_name) or self.try_dispatch(task):
            return
        elif broker.queue.push(task, front=True):
            broker.journal.queued(task)
        else:
            broker.fail(task, WorkerLost(f"worker {worker_name} failed it ({why}) and the queue is full"))

    def try_replica(self, task: Task, lost: str) -> bool:
        """Dispatch ``task`` on a replica of worker ``lost`` (``--replica-of``) if one can take it."""
        replicas = {w.name for w in self.registry.by_identity.values() if w.replica_of == lost}
        if not replicas:
            return False
        others = frozenset(w.name for w in self.registry.by_identity.values() if w.name not in replicas)
        return self.try_dispatch(task, others)

    def place_queued(self) -> int:
        """Place what the queue holds, in its order, while workers have free slots; returns how many."""
        broker = self.broker
        if not len(broker.queue) or self.open_workers <= 0 or broker.hold:
            return 0
        return broker.queue.place(self.try_dispatch, broker.now, self._reserve)

    def _reserve(self, task: Task, reserved: Set[str]) -> str | None:
        """The worker a long-waiting request reserves (``policies.reserve_worker``), unless its
        tenant's limit is what holds it back."""
        need = task.need
        assert need is not None
        if self.accounts.limits and not self.accounts.within_limits(task.tenant, need, task.kind == "session"):
            return None  # its tenant's limit holds it back, not a lack of GPUs: reserve nothing
        best = reserve_worker(need, self.registry.by_identity.values(), reserved, task.avoid)
        if best is not None:
            log.info("request %s waited %.0fs; reserving worker %s for it", protocol.id_text(task.id),
                     self.broker.now - task.created, best)
        return best

    # ------------------------------------------------------------------ what could fit

    def could_ever_fit(self, need: Need) -> bool:
        """``policies.could_ever_fit``, remembered until the set of workers changes."""
        fits = self._fits.get(need)
        if fits is None:
            fits = self._fits[need] = could_ever_fit(need, self.registry.by_identity.values())
        return fits

    def workers_changed(self) -> None:
        """A worker came, went or changed its GPUs: what could fit is judged afresh."""
        self._fits.clear()

    def as_tenant(self, need: Need, tenant: str) -> Need:
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

    # ------------------------------------------------------------------ free slots

    def open_changed(self, worker: WorkerRecord, had: bool) -> None:
        """Keep ``open_workers`` after ``worker``'s inflight or draining changed (``had``: whether
        it had a free slot before). Workers no longer registered do not count."""
        has = worker.has_slot
        if has is not had and worker.pos >= 0:
            self.open_workers += 1 if has else -1

    def freed(self, worker: WorkerRecord) -> None:
        """One of ``worker``'s slots is free again (its work ended or left it)."""
        had = worker.has_slot
        worker.inflight -= 1
        if not had:
            self.open_changed(worker, had)

    def set_draining(self, worker: WorkerRecord, draining: bool) -> None:
        """Mark ``worker`` draining (no new work) or not; the one way to change ``draining``."""
        had = worker.has_slot
        worker.draining = draining
        self.open_changed(worker, had)

    def count_open_workers(self) -> int:
        """``open_workers`` recomputed from scratch (tests check that the two agree)."""
        return sum(1 for w in self.registry.workers if w.has_slot)
