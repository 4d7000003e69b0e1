"""The worker registry: the one authoritative record of every connected worker and its GPUs.

Holds what each worker announced (GPUs, CPU, memory, slots), what its heartbeats last measured, what
the broker has granted on each GPU (the ledger's numbers live on these records), and liveness. Pure:
no sockets, the caller passes the time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpud.heartbeat import HeartbeatPolicy, Liveness
from gpud.resources import GpuInfo, GpuState, Grant
from gpud_broker.tasks import Task


@dataclass(slots=True, eq=False)
class GpuRecord:
    """One GPU: static info, last measured state, the ledger's grants, and recent dispatches."""

    info: GpuInfo
    worker: WorkerRecord
    state: GpuState = field(default_factory=GpuState)
    granted_milli: int = 0
    granted_mem: int = 0
    tasks: int = 0  # grants currently held (work running, sessions open)
    exclusive: bool = False  # an exclusive grant holds it
    cordoned: bool = False
    # Grants made since the last heartbeat: the measured state does not show them yet.
    milli_since_beat: int = 0
    mem_since_beat: int = 0

    @property
    def uuid(self) -> str:
        return self.info.uuid

    @property
    def free_milli(self) -> int:
        return 1000 - self.granted_milli

    @property
    def free_mem(self) -> int:
        return self.info.mem - self.granted_mem

    @property
    def placeable(self) -> bool:
        return not self.cordoned and not self.exclusive and self.state.health != "failed"


@dataclass(slots=True, eq=False)
class WorkerRecord:
    """One connected worker (one GPU VM)."""

    name: str
    identity: bytes  # ROUTER routing id of its connection
    hostname: str
    gpus: list[GpuRecord]
    cpu_milli: int
    host_mem: int
    slots: int
    liveness: Liveness
    simulated: bool = False
    instance_id: str = ""  # its Nova server id, as it reported in READY ("" if unknown)
    replica_of: str = ""  # the worker whose work it takes first when that one is lost (READY)
    other_active_at: float = float("-inf")  # when it last heard another broker say it was active
    granted_cpu: int = 0
    granted_host_mem: int = 0
    inflight: int = 0  # dispatched requests not yet answered (counts against slots)
    draining: bool = False
    held_outputs: int = 0  # bytes of finished jobs' staged outputs it holds for a broker to fetch (HEARTBEAT)
    running: list[dict[str, Any]] = field(default_factory=list)  # as its last heartbeat said
    running_at: float = 0.0  # when that heartbeat came (0: none yet, or its list was cut short)
    assigned: dict[bytes, Task] = field(default_factory=dict)  # task id -> task dispatched to it
    grants: dict[int, Grant] = field(default_factory=dict)  # id(grant) -> live grant (the ledger's)
    connected_at: float = 0.0
    isolation: str = ""  # "namespaces" or "rlimits only", as READY said ("": not said)
    job_network: str = ""  # "none" or "host", as READY said
    pool_users: int = 0  # its pool users (READY); 0: work there holds none, not limited
    pool_kinds: frozenset[str] = frozenset()  # request kinds whose work holds a pool user
    pool_held: dict[str, int] = field(default_factory=dict)  # tenant -> pool users its live grants hold
    pool_index: PoolIndex | None = None  # its registry's, which the ledger keeps as it counts pool_held
    pos: int = -1  # index in WorkerRegistry.workers while registered (O(1) removal)
    incarnation: bytes = b""  # its process's, as READY said (b"": not said: it never resumes)
    suspended_at: float = 0.0  # when it was suspended, silent past its liveness (0: live)
    draining_before: bool = False  # its draining mark before that (restored when it resumes)
    taken_off: set[bytes] = field(default_factory=set)  # its jobs placed again while suspended

    @property
    def free_cpu(self) -> int:
        return self.cpu_milli - self.granted_cpu

    @property
    def free_host_mem(self) -> int:
        return self.host_mem - self.granted_host_mem

    @property
    def has_slot(self) -> bool:
        return self.inflight < self.slots and not self.draining


class PoolIndex:
    """The workers that may refuse work holding a pool user (``policies.pool_blocked``), kept by
    the ledger on each grant and release that holds one (``file``): ``full``, those whose every
    pool user is held, and ``holding[tenant]``, those where ``tenant`` holds one or more. Any other
    worker has a pool user free and ``tenant`` holds none there, below its share (at least one):
    it refuses nobody. So a placement looks at these workers only, not at every one."""

    def __init__(self) -> None:
        self.full: set[WorkerRecord] = set()
        self.holding: dict[str, set[WorkerRecord]] = {}

    def file(self, worker: WorkerRecord, tenant: str = "") -> None:
        """Re-file ``worker`` after its pool users, or what ``tenant`` holds there, changed."""
        if 0 < worker.pool_users <= sum(worker.pool_held.values()):
            self.full.add(worker)
        else:
            self.full.discard(worker)
        if not tenant:
            return
        if worker.pool_held.get(tenant, 0) > 0:
            self.holding.setdefault(tenant, set()).add(worker)
        elif tenant in self.holding:
            self.holding[tenant].discard(worker)
            if not self.holding[tenant]:
                del self.holding[tenant]

    def drop(self, worker: WorkerRecord) -> None:
        """Forget ``worker`` (unregistered; its grants die with it, uncounted)."""
        self.full.discard(worker)
        for tenant in list(worker.pool_held):
            held = self.holding.get(tenant)
            if held is not None:
                held.discard(worker)
                if not held:
                    del self.holding[tenant]

    def candidates(self, tenant: str) -> list[WorkerRecord]:
        """Every worker that might refuse ``tenant``'s work (see the class's doc), some twice."""
        return [*self.full, *self.holding.get(tenant, ())]


class WorkerRegistry:
    """Workers by connection identity and by name; GPUs by uuid."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, WorkerRecord] = {}
        self.by_name: dict[str, WorkerRecord] = {}
        self.gpus: dict[str, GpuRecord] = {}
        # Every registered worker once, in no particular order: what ``sample`` draws from
        # (kept by add/remove with swap-removal, so neither copies nor scans it).
        self.workers: list[WorkerRecord] = []
        # Operator decisions (admin drain/cordon) by worker name and GPU uuid: they outlast a
        # reconnection, so a worker that comes back is still drained and its GPUs still cordoned.
        self.drained: set[str] = set()
        self.cordoned: set[str] = set()
        self.pool_index = PoolIndex()

    def __len__(self) -> int:
        return len(self.by_identity)

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self.by_identity.values()))

    def get(self, identity: bytes) -> WorkerRecord | None:
        return self.by_identity.get(identity)

    def add(
        self,
        *,
        name: str,
        identity: bytes,
        hostname: str,
        gpus: list[GpuInfo],
        cpu_milli: int,
        host_mem: int,
        slots: int,
        policy: HeartbeatPolicy,
        now: float,
        simulated: bool = False,
        instance_id: str = "",
        replica_of: str = "",
        incarnation: bytes = b"",
    ) -> WorkerRecord:
        """Register a worker. The caller removes any earlier worker of the same name first."""
        worker = WorkerRecord(
            name=name,
            identity=identity,
            hostname=hostname,
            gpus=[],
            cpu_milli=cpu_milli,
            host_mem=host_mem,
            slots=slots,
            liveness=Liveness(policy, now),
            simulated=simulated,
            instance_id=instance_id,
            replica_of=replica_of,
            incarnation=incarnation,
            connected_at=now,
            draining=name in self.drained,
            pool_index=self.pool_index,
        )
        worker.gpus = [GpuRecord(info=gpu, worker=worker, cordoned=gpu.uuid in self.cordoned) for gpu in gpus]
        stale = self.by_identity.get(identity)
        if stale is not None:  # a caller that did not remove it: its list entry goes too
            self._unlist(stale)
            self.pool_index.drop(stale)
        self.by_identity[identity] = worker
        self.by_name[name] = worker
        worker.pos = len(self.workers)
        self.workers.append(worker)
        for gpu in worker.gpus:
            self.gpus[gpu.uuid] = gpu
        return worker

    def rebind(self, worker: WorkerRecord, identity: bytes) -> None:
        """``worker`` is reached at a new connection, ``identity``, from now on (it resumed)."""
        if self.by_identity.get(worker.identity) is worker:
            del self.by_identity[worker.identity]
        stale = self.by_identity.get(identity)
        if stale is not None and stale is not worker:  # a caller that did not remove it first
            self.remove(stale)
        worker.identity = identity
        self.by_identity[identity] = worker

    def remove(self, worker: WorkerRecord) -> None:
        if self.by_identity.get(worker.identity) is worker:
            del self.by_identity[worker.identity]
        self.pool_index.drop(worker)
        self._unlist(worker)
        if self.by_name.get(worker.name) is worker:
            del self.by_name[worker.name]
        for g in worker.gpus:
            if self.gpus.get(g.uuid) is g:
                del self.gpus[g.uuid]

    def _unlist(self, worker: WorkerRecord) -> None:
        """Take ``worker`` out of ``workers`` in O(1): the last entry moves into its place."""
        pos = worker.pos
        workers = self.workers
        if 0 <= pos < len(workers) and workers[pos] is worker:
            last = workers.pop()
            if last is not worker:
                workers[pos] = last
                last.pos = pos
        worker.pos = -1

    def sample(self, k: int, rng: random.Random) -> list[WorkerRecord]:
        """``k`` distinct workers drawn uniformly at random by ``rng`` (all of them when there are
        no more than ``k``); O(k), the registry is not copied."""
        workers = self.workers
        if len(workers) <= k:
            return list(workers)
        return rng.sample(workers, k)

    def update_state(self, worker: WorkerRecord, states: dict[str, GpuState]) -> bool:
        """Apply a heartbeat's measurements; grants since the previous beat are now visible.
        Returns whether some GPU's health changed."""
        changed = False
        for g in worker.gpus:
            s = states.get(g.uuid)
            if s is not None:
                changed = changed or s.health != g.state.health
                g.state = s
            g.milli_since_beat = 0
            g.mem_since_beat = 0
        return changed

    def expired(self, now: float) -> list[WorkerRecord]:
        return [w for w in self.by_identity.values() if w.liveness.expired(now)]
