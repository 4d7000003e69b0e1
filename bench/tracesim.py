"""Trace replay through the broker's own scheduling objects: a research simulator, not a daemon part.

Run it as ``python bench/tracesim.py TRACE.csv [--policy fgd] [--seeds 42..51]`` (``--help``);
``bench/replay.py`` builds the tables and plots of BENCHMARKS.md from it.

A replay builds a ``WorkerRegistry`` with one simulated worker per node of the trace, asks the
policies of ``policies.py`` for every placement and records every grant with ``ledger.grant`` (and
``ledger.release``): the same objects and functions the daemon's core uses, not a copy.

Traces are the Alibaba ``cluster-trace-gpu-v2023`` CSV files (``/work/shared/traces/README.md``)
used by Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC '23.

Static mode (the paper's published method)
    Tasks in a seeded random order, then tasks redrawn at random (with replacement) and appended
    while the submitted GPU requests stay within 130% of the cluster's GPUs; each task is placed or
    rejected at once and never finishes. After every task (CPU-only and rejected ones included) a
    sample is taken: arrived = submitted GPU requests / capacity, allocation = granted milli-GPU /
    capacity. The figure is the unallocated share, 100 - the mean allocation over the samples whose
    arrived percentage rounds to 100.

Dynamic mode (tasks arrive and leave)
    Tasks arrive at their ``creation_time`` and run for ``deletion_time - scheduled_time`` (or
    ``- creation_time`` when they were never scheduled) of simulated time. A task that does not fit
    waits in the broker's ``PendingQueue`` (backfill; after ``reserve_after`` seconds it reserves a
    worker) and is offered again whenever a task leaves. The cluster is the first N nodes of the node
    list reordered so that every prefix has one node of every kind and then the kinds in proportion
    (``proportional_order``); tasks no node of the whole list could take are left out. The smallest
    N with no task waiting longer than ``max_wait`` is found by galloping and bisection, for gpud's
    GPU sharing and for exclusive passthrough (each GPU task takes whole GPUs: a VM of its own).
    Reported: GPUs needed, mean GPU allocation over the trace, and the wait-time percentiles.

Trace conversion: ``num_gpu > 1`` -> ``Need(gpus=N)``; ``num_gpu == 1`` -> a share of ``gpu_milli``
(``Need(gpus=1)`` when it is 1000); ``num_gpu == 0`` -> a need without GPU (``gpu_milli=0``) that
only takes the worker's CPU and memory; ``gpu_spec`` -> ``Need.models``; memory MiB -> bytes. The
trace gives no GPU memory, so every simulated GPU has ``GPU_MEM`` bytes and tasks ask for none.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import GpuInfo, Grant, Need
from gpud_broker import ledger
from gpud_broker.mix import TaskMix
from gpud_broker.policies import FACTORIES, Policy, could_ever_fit, make_policy, reserve_worker
from gpud_broker.queue import DEFAULT_RESERVE_AFTER_S, PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry

MiB = 1 << 20
GPU_MEM = 1 << 40  # bytes per simulated GPU: the trace gives no GPU memory, so it never binds
SLOTS = 1 << 30  # the replay dispatches nothing, so slots never bind either
INFLATE = 1.30  # submitted GPU requests stop at this share of capacity (the published method)
DEFAULT_SEED = 42
DEFAULT_MAX_WAIT_S = 60.0
NODE_FILE = "openb_node_list_gpu_node.csv"


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TraceTask:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] | None = None
    creation: int | None = None
    deletion: int | None = None
    scheduled: int | None = None
    need: Need = field(default_factory=Need, compare=False)

    @property
    def gpu_request(self) -> int:
        """Milli-GPU this task asks for in all (what "arrived" counts)."""
        return self.num_gpu * self.gpu_milli

    @property
    def duration(self) -> int | None:
        """Seconds it ran in the trace: deletion - scheduled (or - creation if never scheduled)."""
        if self.deletion is None or self.creation is None:
            return None
        start = self.scheduled if self.scheduled is not None else self.creation
        return max(0, self.deletion - start)


def task_need(num_gpu: int, gpu_milli: int, cpu_milli: int, memory_mib: int, models: frozenset[str] | None) -> Need:
    """The gpud ``Need`` of one trace task (see the module docstring)."""
    host_mem = memory_mib * MiB
    if num_gpu <= 0:
        return Need(gpu_milli=0, gpus=0, cpu_milli=cpu_milli, host_mem=host_mem, models=None)
    if num_gpu == 1 and gpu_milli < 1000:
        return Need(gpu_milli=gpu_milli, cpu_milli=cpu_milli, host_mem=host_mem, models=models)
    return Need(gpus=num_gpu, cpu_milli=cpu_milli, host_mem=host_mem, models=models)


def _int(row: dict[str, str | None], key: str, default: int | None = None) -> int | None:
    raw = row.get(key)
    if raw is None or raw.strip() == "":
        return default
    return int(float(raw))


def load_nodes(path: str | Path) -> list[TraceNode]:
    """Read a node list (``sn, cpu_milli, memory_mib, gpu, model``)."""
    out: list[TraceNode] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out.append(
                TraceNode(
                    name=row["sn"],
                    cpu_milli=_int(row, "cpu_milli", 0) or 0,
                    memory_mib=_int(row, "memory_mib", 0) or 0,
                    gpus=_int(row, "gpu", 0) or 0,
                    model=(row.get("model") or "").strip(),
                )
            )
    return out


def load_tasks(path: str | Path) -> list[TraceTask]:
    """Read a task list. Columns after ``gpu_milli`` (``gpu_spec`` and the times) are optional."""
    out: list[TraceTask] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            num_gpu = _int(row, "num_gpu", 0) or 0
            gpu_milli = _int(row, "gpu_milli", 0) or 0
            if num_gpu > 1:
                gpu_milli = 1000
            cpu = _int(row, "cpu_milli", 0) or 0
            mem = _int(row, "memory_mib", 0) or 0
            spec = (row.get("gpu_spec") or "").strip()
            models = frozenset(m.strip() for m in spec.split("|") if m.strip()) or None
            out.append(
                TraceTask(
                    name=row.get("name") or f"task-{len(out)}",
                    cpu_milli=cpu,
                    memory_mib=mem,
                    num_gpu=num_gpu,
                    gpu_milli=gpu_milli if num_gpu else 0,
                    models=models,
                    creation=_int(row, "creation_time"),
                    deletion=_int(row, "deletion_time"),
                    scheduled=_int(row, "scheduled_time"),
                    need=task_need(num_gpu, gpu_milli, cpu, mem, models),
                )
            )
    return out


def build_registry(nodes: Sequence[TraceNode], now: float = 0.0) -> WorkerRegistry:
    """One simulated worker per GPU node, registered as the broker registers a READY worker."""
    reg = WorkerRegistry()
    beat = HeartbeatPolicy()
    for node in nodes:
        if node.gpus <= 0:
            continue
        gpus = [
            GpuInfo(uuid=f"{node.name}-gpu{i}", index=i, model=node.model, mem=GPU_MEM, cc=(0, 0), simulated=True)
            for i in range(node.gpus)
        ]
        reg.add(
            name=node.name,
            identity=node.name.encode(),
            hostname=node.name,
            gpus=gpus,
            cpu_milli=node.cpu_milli,
            host_mem=node.memory_mib * MiB,
            slots=SLOTS,
            policy=beat,
            now=now,
            simulated=True,
        )
    return reg


def capacity_milli(reg: WorkerRegistry) -> int:
    return 1000 * len(reg.gpus)


def granted_milli(reg: WorkerRegistry) -> int:
    """Milli-GPU granted now, summed from the ledger's numbers on the records."""
    return sum(g.granted_milli for g in reg.gpus.values())


def _policy(name: str, seed: int, mix: TaskMix) -> Policy:
    # The policy's random stream is its own: it must not shift the order of the tasks.
    return make_policy(name, seed=seed * 1_000_003 + 17, mix=mix)


# --------------------------------------------------------------------------- static mode


@dataclass(slots=True)
class StaticResult:
    """One seed of the static replay. Percentages are of the cluster's GPU capacity."""

    policy: str
    seed: int
    nodes: int
    gpus: int
    submitted: int  # tasks
    placed: int
    rejected: int
    unallocated_at_100: float
    curve: list[tuple[int, float]]  # (arrived %, unallocated %), one point per whole percent
    seconds: float
    arrived: list[float] = field(default_factory=list, repr=False)  # per task
    allocated: list[float] = field(default_factory=list, repr=False)  # per task


def submission_order(tasks: Sequence[TraceTask], capacity: int, seed: int, inflate: float = INFLATE) -> Iterator[TraceTask]:
    """The published order: the tasks shuffled by ``seed``, then tasks drawn at random with
    replacement; stops at the first task that would take the submitted GPU requests past
    ``inflate`` x capacity."""
    rng = random.Random(seed)
    order = list(tasks)
    rng.shuffle(order)
    limit = inflate * capacity
    submitted = 0

    def stream() -> Iterator[TraceTask]:
        yield from order
        if not any(t.gpu_request > 0 for t in order):
            return  # nothing would ever reach the limit
        while True:
            yield order[rng.randrange(len(order))]

    for t in stream():
        if submitted + t.gpu_request > limit:
            return
        submitted += t.gpu_request
        yield t


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def curve_of(arrived: Sequence[float], allocated: Sequence[float]) -> list[tuple[int, float]]:
    """Mean unallocated % per whole arrived percent (the samples whose arrived % rounds to it)."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for a, al in zip(arrived, allocated, strict=True):
        k = round_half_up(a)
        sums[k] = sums.get(k, 0.0) + al
        counts[k] = counts.get(k, 0) + 1
    return [(k, 100.0 - sums[k] / counts[k]) for k in sorted(sums)]


def unallocated_at(arrived: Sequence[float], allocated: Sequence[float], percent: int = 100) -> float:
    """100 - the mean allocation over the samples whose arrived % rounds to ``percent``; where none
    does (a small trace jumps over it), the allocation interpolated between the samples either side;
    NaN when the replay never got there."""
    vals = [al for a, al in zip(arrived, allocated, strict=True) if round_half_up(a) == percent]
    if vals:
        return 100.0 - sum(vals) / len(vals)
    below = [(a, al) for a, al in zip(arrived, allocated, strict=True) if a < percent]
    above = [(a, al) for a, al in zip(arrived, allocated, strict=True) if a > percent]
    if not above:
        return math.nan
    a1, al1 = above[0]
    if not below:
        return 100.0 - al1
    a0, al0 = below[-1]
    return 100.0 - (al0 + (al1 - al0) * (percent - a0) / (a1 - a0))


def replay_static(
    nodes: Sequence[TraceNode],
    tasks: Sequence[TraceTask],
    policy: str,
    seed: int = DEFAULT_SEED,
    *,
    inflate: float = INFLATE,
    keep_samples: bool = False,
) -> StaticResult:
    """Replay ``tasks`` on ``nodes`` with the published method (see the module docstring)."""
    started = time.perf_counter()
    reg = build_registry(nodes)
    workers = list(reg.by_identity.values())
    cap = capacity_milli(reg)
    if cap == 0:
        raise ValueError("the node list has no GPU")
    mix = TaskMix()
    place = _policy(policy, seed, mix)
    grant = ledger.grant
    arrived: list[float] = []
    allocated: list[float] = []
    submitted = granted = placed = rejected = 0
    scale = 100.0 / cap
    for t in submission_order(tasks, cap, seed, inflate):
        need = t.need
        submitted += t.gpu_request
        mix.observe(need)
        p = place(need, workers, ())
        if p is None:
            rejected += 1
        else:
            grant(p.worker, p.gpus, need)
            granted += t.gpu_request
            placed += 1
        arrived.append(submitted * scale)
        allocated.append(granted * scale)
    return StaticResult(
        policy=policy,
        seed=seed,
        nodes=len(workers),
        gpus=cap // 1000,
        submitted=placed + rejected,
        placed=placed,
        rejected=rejected,
        unallocated_at_100=unallocated_at(arrived, allocated),
        curve=curve_of(arrived, allocated),
        seconds=time.perf_counter() - started,
        arrived=arrived if keep_samples else [],
        allocated=allocated if keep_samples else [],
    )


def _static_job(job: tuple[str, str, str, int]) -> StaticResult:
    nodes_path, tasks_path, policy, seed = job
    return replay_static(load_nodes(nodes_path), load_tasks(tasks_path), policy, seed)


def replay_static_seeds(
    nodes_path: str | Path, tasks_path: str | Path, policy: str, seeds: Sequence[int], jobs: int = 1
) -> list[StaticResult]:
    """The static replay for each seed, in ``jobs`` processes."""
    work = [(str(nodes_path), str(tasks_path), policy, s) for s in seeds]
    if jobs <= 1 or len(work) <= 1:
        return [_static_job(w) for w in work]
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(work))) as pool:
        return pool.map(_static_job, work)


def summarize_static(results: Sequence[StaticResult]) -> dict[str, Any]:
    """Mean and sample standard deviation over seeds, and the mean curve."""
    figs = [r.unallocated_at_100 for r in results if not math.isnan(r.unallocated_at_100)]
    by_point: dict[int, list[float]] = {}
    for r in results:
        for a, u in r.curve:
            by_point.setdefault(a, []).append(u)
    curve = [(a, sum(v) / len(v)) for a, v in sorted(by_point.items()) if len(v) == len(results)]
    return {
        "policy": results[0].policy if results else None,
        "seeds": [r.seed for r in results],
        "unallocated_at_100": statistics.fmean(figs) if figs else None,
        "unallocated_at_100_std": statistics.stdev(figs) if len(figs) > 1 else 0.0,
        "per_seed": {str(r.seed): None if math.isnan(r.unallocated_at_100) else r.unallocated_at_100 for r in results},
        "seconds_per_seed": statistics.fmean(r.seconds for r in results) if results else 0.0,
        "curve": [[a, round(u, 4)] for a, u in curve],
    }


# --------------------------------------------------------------------------- dynamic mode


@dataclass(slots=True, eq=False)
class _Waiting:
    """A queued task, as the broker's ``PendingQueue`` wants its entries."""

    task: TraceTask
    need: Need
    created: float
    priority: int = 0
    tenant: str = "replay"
    deadline: float = math.inf
    queued: bool = False
    reserved: str | None = None
    done: bool = False


@dataclass(slots=True)
class DynamicRun:
    """One dynamic replay on one cluster size."""

    mode: str  # "sharing" or "passthrough"
    policy: str
    nodes: int
    gpus: int
    ok: bool  # every task started within max_wait
    why: str
    tasks: int = 0
    mean_allocation: float = 0.0  # % of the cluster's GPUs granted, averaged over the trace's time
    mean_requested: float = 0.0  # % of the cluster's GPUs the running tasks asked for
    waits: list[float] = field(default_factory=list, repr=False)
    seconds: float = 0.0

    def percentiles(self) -> dict[str, float]:
        return wait_percentiles(self.waits)


def wait_percentiles(waits: Sequence[float]) -> dict[str, float]:
    if not waits:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = sorted(waits)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": s[-1]}


def passthrough_need(t: TraceTask) -> Need:
    """Exclusive passthrough: a GPU task takes whole GPUs (a GPU VM of its own)."""
    n = t.need
    if t.num_gpu <= 0:
        return n
    return Need(gpus=max(1, t.num_gpu), cpu_milli=n.cpu_milli, host_mem=n.host_mem, models=n.models)


def run_dynamic(
    nodes: Sequence[TraceNode],
    tasks: Sequence[TraceTask],
    policy: str,
    *,
    passthrough: bool = False,
    max_wait: float = DEFAULT_MAX_WAIT_S,
    seed: int = DEFAULT_SEED,
    reserve_after: float | None = None,
) -> DynamicRun:
    """Run the trace in simulated time on ``nodes``; stops early once a task waits past
    ``max_wait`` (the run is then not ``ok``)."""
    started = time.perf_counter()
    reg = build_registry(nodes)
    workers = list(reg.by_identity.values())
    cap = capacity_milli(reg)
    mode = "passthrough" if passthrough else "sharing"
    run = DynamicRun(mode=mode, policy=policy, nodes=len(workers), gpus=cap // 1000, ok=False, why="")
    timed = [t for t in tasks if t.creation is not None and t.duration is not None]
    if len(timed) < len(tasks):
        raise ValueError("the dynamic replay needs creation_time and deletion_time for every task")
    if cap == 0:
        run.why = "no GPU"
        return run
    arrivals = sorted(timed, key=lambda t: t.creation or 0)
    mix = TaskMix()
    place = _policy(policy, seed, mix)
    queue: PendingQueue[_Waiting] = PendingQueue(
        max_len=len(arrivals) + 1,
        reserve_after=DEFAULT_RESERVE_AFTER_S if reserve_after is None else reserve_after,
    )
    fifo: deque[_Waiting] = deque()  # queued entries by arrival: the head is the longest waiting
    departures: list[tuple[float, int, WorkerRecord, list[Any], Grant, int, int]] = []
    seq = 0
    now = float(arrivals[0].creation or 0) if arrivals else 0.0
    t0 = now
    granted = requested = 0
    area_granted = area_requested = 0.0
    waits = run.waits

    def advance(to: float) -> None:
        nonlocal now, area_granted, area_requested
        if to > now:
            area_granted += granted * (to - now)
            area_requested += requested * (to - now)
            now = to

    def try_place(entry: _Waiting, reserved: Set[str]) -> bool:
        nonlocal granted, requested, seq
        need = entry.need
        p = place(need, workers, reserved)
        if p is None:
            return False
        g = ledger.grant(p.worker, p.gpus, need)
        granted += g.gpu_milli * len(g.gpus)
        requested += entry.task.gpu_request
        seq += 1
        heapq.heappush(
            departures,
            (now + (entry.task.duration or 0), seq, p.worker, p.gpus, g, g.gpu_milli * len(g.gpus), entry.task.gpu_request),
        )
        waits.append(now - entry.created)
        entry.done = True
        return True

    def reserve(entry: _Waiting, reserved: Set[str]) -> str | None:
        return reserve_worker(entry.need, workers, reserved)

    i = 0
    n = len(arrivals)
    while i < n or departures:
        next_arrival = float(arrivals[i].creation or 0) if i < n else math.inf
        next_departure = departures[0][0] if departures else math.inf
        at = min(next_arrival, next_departure)
        while fifo and fifo[0].done:
            fifo.popleft()
        if fifo and at - fifo[0].created > max_wait:
            run.why = f"{fifo[0].task.name} waited more than {max_wait:g}s"
            break
        advance(at)
        if next_departure <= next_arrival:
            _, _, w, gpus, g, gm, rq = heapq.heappop(departures)
            ledger.release(w, gpus, g)
            granted -= gm
            requested -= rq
            if len(queue):
                queue.place(try_place, now, reserve)
            continue
        t = arrivals[i]
        i += 1
        need = passthrough_need(t) if passthrough else t.need
        mix.observe(need)
        entry = _Waiting(task=t, need=need, created=now)
        run.tasks += 1
        if try_place(entry, frozenset(queue.reservations)):
            continue
        if not could_ever_fit(need, workers):
            run.why = f"{t.name} fits no node of this cluster"
            break
        queue.push(entry)
        fifo.append(entry)
    else:
        run.ok = True
    span = now - t0
    if span > 0:
        run.mean_allocation = 100.0 * area_granted / span / cap
        run.mean_requested = 100.0 * area_requested / span / cap
    run.seconds = time.perf_counter() - started
    return run


@dataclass(slots=True)
class DynamicResult:
    """The smallest cluster (a prefix of ``proportional_order``) that runs the trace within
    ``max_wait``, and the run on it."""

    mode: str
    policy: str
    max_wait: float
    gpus_needed: int | None
    nodes_needed: int | None
    run: DynamicRun | None
    tried: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        r = self.run
        return {
            "mode": self.mode,
            "policy": self.policy,
            "max_wait_s": self.max_wait,
            "gpus_needed": self.gpus_needed,
            "nodes_needed": self.nodes_needed,
            "mean_allocation": None if r is None else round(r.mean_allocation, 3),
            "mean_requested": None if r is None else round(r.mean_requested, 3),
            "wait_s": None if r is None else r.percentiles(),
            "tasks": None if r is None else r.tasks,
            "runs": self.tried,
            "seconds": round(self.seconds, 2),
        }


def proportional_order(nodes: Sequence[TraceNode]) -> list[TraceNode]:
    """The GPU nodes in the order a cluster grows: one node of every kind first (the most common
    kinds first), then each next node of the kind furthest behind its share of the list. Every
    prefix past the first round has every kind, in proportion. A kind is (model, GPUs, CPU,
    memory); within a kind the list order is kept."""
    kinds: dict[tuple[str, int, int, int], list[TraceNode]] = {}
    for n in nodes:
        if n.gpus > 0:
            kinds.setdefault((n.model, n.gpus, n.cpu_milli, n.memory_mib), []).append(n)
    total = sum(len(v) for v in kinds.values())
    order = sorted(kinds, key=lambda k: -len(kinds[k]))
    out = [kinds[k][0] for k in order]
    taken = dict.fromkeys(kinds, 1)
    for i in range(len(out) + 1, total + 1):
        kind = max(order, key=lambda k: len(kinds[k]) * i / total - taken[k])
        out.append(kinds[kind][taken[kind]])
        taken[kind] += 1
    return out


def gpus_needed(
    nodes: Sequence[TraceNode],
    tasks: Sequence[TraceTask],
    policy: str,
    *,
    passthrough: bool = False,
    max_wait: float = DEFAULT_MAX_WAIT_S,
    seed: int = DEFAULT_SEED,
) -> DynamicResult:
    """Bisect over the cluster size for the smallest prefix of ``proportional_order(nodes)`` on
    which every task starts within ``max_wait``."""
    started = time.perf_counter()
    order = proportional_order(nodes)
    runs: dict[int, DynamicRun] = {}

    def attempt(k: int) -> DynamicRun:
        if k not in runs:
            runs[k] = run_dynamic(order[:k], tasks, policy, passthrough=passthrough, max_wait=max_wait, seed=seed)
        return runs[k]

    mode = "passthrough" if passthrough else "sharing"
    n = len(order)
    if n == 0:
        return DynamicResult(mode, policy, max_wait, None, None, None, 0, time.perf_counter() - started)
    # Gallop up from one node (small clusters fail fast), then bisect.
    lo, hi = 0, 1  # attempt(lo) fails (or lo == 0)
    while not attempt(hi).ok:
        if hi == n:
            return DynamicResult(mode, policy, max_wait, None, None, None, len(runs), time.perf_counter() - started)
        lo, hi = hi, min(n, hi * 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid).ok:
            hi = mid
        else:
            lo = mid
    best = runs[hi]
    return DynamicResult(mode, policy, max_wait, best.gpus, best.nodes, best, len(runs), time.perf_counter() - started)


def peak_demand(tasks: Sequence[TraceTask], passthrough: bool = False) -> float:
    """The most GPUs the trace's tasks hold at once at their own times (a lower bound on the GPUs
    needed): shares as they are, or as whole GPUs with ``passthrough``."""
    events: list[tuple[int, int, int]] = []
    for t in tasks:
        if t.creation is None or t.duration is None or t.num_gpu <= 0:
            continue
        milli = 1000 * t.num_gpu if passthrough else t.gpu_request
        events.append((t.creation, 1, milli))
        events.append((t.creation + t.duration, 0, -milli))  # departures first at equal times
    now = peak = 0
    for _, _, milli in sorted(events):
        now += milli
        peak = max(peak, now)
    return peak / 1000.0


def split_unfit(nodes: Sequence[TraceNode], tasks: Sequence[TraceTask]) -> tuple[list[TraceTask], list[TraceTask]]:
    """(tasks some node of the list could take if idle, tasks none could: those never run)."""
    workers = list(build_registry(nodes).by_identity.values())
    fit: list[TraceTask] = []
    unfit: list[TraceTask] = []
    shapes: dict[Need, bool] = {}
    for t in tasks:
        ok = shapes.get(t.need)
        if ok is None:
            ok = shapes[t.need] = could_ever_fit(t.need, workers)
        (fit if ok else unfit).append(t)
    return fit, unfit


def compare_dynamic(
    nodes: Sequence[TraceNode],
    tasks: Sequence[TraceTask],
    policy: str = "fgd",
    passthrough_policy: str = "best-fit",
    *,
    max_wait: float = DEFAULT_MAX_WAIT_S,
    seed: int = DEFAULT_SEED,
) -> dict[str, Any]:
    """gpud's sharing against exclusive passthrough: GPUs needed within ``max_wait`` for each, and
    both on the smaller of the two clusters with no wait limit (the waits the other one sees).
    Tasks that no node of the whole list could take are left out (``never_fit``)."""
    tasks, unfit = split_unfit(nodes, tasks)
    rows = [
        gpus_needed(nodes, tasks, policy, max_wait=max_wait, seed=seed),
        gpus_needed(nodes, tasks, passthrough_policy, passthrough=True, max_wait=max_wait, seed=seed),
    ]
    same: dict[str, Any] = {}
    sizes = [r.nodes_needed for r in rows if r.nodes_needed]
    if sizes:
        k = min(sizes)
        cluster = proportional_order(nodes)[:k]
        same = {"nodes": k, "gpus": sum(n.gpus for n in cluster), "rows": []}
        for pol, passthrough in ((policy, False), (passthrough_policy, True)):
            r = run_dynamic(cluster, tasks, pol, passthrough=passthrough, max_wait=math.inf, seed=seed)
            same["rows"].append({
                "mode": r.mode,
                "policy": r.policy,
                "ok": r.ok,
                "mean_allocation": round(r.mean_allocation, 3),
                "mean_requested": round(r.mean_requested, 3),
                "wait_s": r.percentiles(),
                "waited": sum(1 for w in r.waits if w > 0),
                "tasks": r.tasks,
            })
    return {
        "max_wait_s": max_wait,
        "seed": seed,
        "tasks": len(tasks),
        "never_fit": [t.name for t in unfit],
        "peak_gpus": {"sharing": peak_demand(tasks), "passthrough": peak_demand(tasks, passthrough=True)},
        "rows": [r.as_dict() for r in rows],
        "same_cluster": same,
    }


def format_compare(result: dict[str, Any]) -> str:
    peak = result["peak_gpus"]
    lines = []
    if result.get("never_fit"):
        lines.append(f"  left out, no node could ever take them: {', '.join(result['never_fit'])}")
    lines += [
        f"  GPUs the tasks hold at the busiest moment: {peak['sharing']:.1f} shared, {peak['passthrough']:.0f} as whole GPUs",
        f"  smallest cluster with no task waiting more than {result['max_wait_s']:g}s:",
        format_dynamic(result["rows"]),
    ]
    same = result["same_cluster"]
    if same:
        lines.append(f"  both on the smaller cluster ({same['gpus']} GPUs, {same['nodes']} nodes), no wait limit:")
        lines.append(f"  {'mode':<12} {'policy':<9} {'alloc%':>7} {'asked%':>7} {'waited':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>9}")
        for r in same["rows"]:
            w = r["wait_s"]
            lines.append(
                f"  {r['mode']:<12} {r['policy']:<9} {r['mean_allocation']:>7.2f} {r['mean_requested']:>7.2f} {r['waited']:>7} "
                f"{w['p50']:>7.0f} {w['p90']:>7.0f} {w['p99']:>7.0f} {w['max']:>9.0f}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def parse_seeds(text: str) -> list[int]:
    """``42``, ``42..51`` (inclusive) or ``42,45,50``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            a, _, b = part.partition("..")
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"empty seed range {part!r}")
            out.extend(range(lo, hi + 1))
        elif part:
            out.append(int(part))
    if not out:
        raise ValueError("no seed given")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="task CSV (openb_pod_list_*.csv)")
    p.add_argument("--nodes", default=None, help=f"node CSV (default: {NODE_FILE} next to the trace)")
    p.add_argument("--policy", default="fgd", choices=sorted(FACTORIES), help="placement policy (default %(default)s)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the order and the policy (default %(default)s)")
    p.add_argument("--seeds", default=None, help="several seeds, e.g. 42..51: report mean and standard deviation")
    p.add_argument("--mode", choices=("static", "dynamic"), default="static",
                   help="static: the published method; dynamic: creation/deletion times (default %(default)s)")
    p.add_argument("--max-wait", type=float, default=DEFAULT_MAX_WAIT_S,
                   help="dynamic: longest wait allowed when sizing the cluster, seconds (default %(default)s)")
    p.add_argument("--passthrough-policy", default="best-fit", choices=sorted(FACTORIES),
                   help="dynamic: policy for the exclusive passthrough baseline (default %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="processes for several seeds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")


def _resolve(args: argparse.Namespace) -> tuple[Path, Path]:
    trace = Path(args.trace)
    nodes = Path(args.nodes) if args.nodes else trace.with_name(NODE_FILE)
    for path in (trace, nodes):
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
    return trace, nodes


def _trace_name(path: Path) -> str:
    stem = path.stem
    return stem.removeprefix("openb_pod_list_")


def format_curve(curve: Sequence[Sequence[float]], per_line: int = 10) -> str:
    cells = [f"{int(a):3d}%:{u:6.2f}" for a, u in curve]
    return "\n".join("  " + "  ".join(cells[i : i + per_line]) for i in range(0, len(cells), per_line))


def _run_static(args: argparse.Namespace, trace: Path, nodes_path: Path, out: Callable[[str], None]) -> dict[str, Any]:
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    results = replay_static_seeds(nodes_path, trace, args.policy, seeds, args.jobs)
    first = results[0]
    out(f"static replay of {_trace_name(trace)}: {first.nodes} nodes, {first.gpus} GPUs, policy {args.policy}")
    for r in results:
        out(f"  seed {r.seed}: {r.submitted} tasks ({r.placed} placed, {r.rejected} rejected); "
            f"unallocated at 100% arrived {r.unallocated_at_100:.2f}%  ({r.seconds:.1f}s)")
    summary = summarize_static(results)
    figure = summary["unallocated_at_100"]
    if figure is None:
        out("unallocated GPU share at 100% arrived: - (the submitted requests never reached 100%)")
    elif len(results) > 1:
        out(f"unallocated GPU share at 100% arrived: {figure:.2f} "
            f"± {summary['unallocated_at_100_std']:.2f}% (mean ± std of {len(results)} seeds)")
    else:
        out(f"unallocated GPU share at 100% arrived: {figure:.2f}%")
    out("unallocated GPU % by arrived GPU requests % (mean over seeds):")
    out(format_curve(summary["curve"]))
    summary["trace"] = _trace_name(trace)
    summary["mode"] = "static"
    summary["nodes"] = first.nodes
    summary["gpus"] = first.gpus
    summary["tasks_per_seed"] = [r.submitted for r in results]
    return summary


def _run_dynamic(args: argparse.Namespace, trace: Path, nodes_path: Path, out: Callable[[str], None]) -> dict[str, Any]:
    nodes = load_nodes(nodes_path)
    tasks = load_tasks(trace)
    result = compare_dynamic(nodes, tasks, args.policy, args.passthrough_policy, max_wait=args.max_wait, seed=args.seed)
    out(f"dynamic replay of {_trace_name(trace)}: {len(tasks)} tasks at their own times, seed {args.seed}")
    out(format_compare(result))
    return {"trace": _trace_name(trace), "mode": "dynamic", **result}


def format_dynamic(rows: Sequence[dict[str, Any]]) -> str:
    head = f"  {'mode':<12} {'policy':<9} {'GPUs':>5} {'nodes':>5} {'alloc%':>7} {'asked%':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>7}"
    lines = [head]
    for r in rows:
        w = r["wait_s"] or {}
        if r["gpus_needed"] is None:
            lines.append(f"  {r['mode']:<12} {r['policy']:<9} {'-':>5}  (the whole cluster does not meet the wait limit)")
            continue
        lines.append(
            f"  {r['mode']:<12} {r['policy']:<9} {r['gpus_needed']:>5} {r['nodes_needed']:>5} "
            f"{r['mean_allocation']:>7.2f} {r['mean_requested']:>7.2f} {w['p50']:>7.0f} {w['p90']:>7.0f} {w['p99']:>7.0f} {w['max']:>7.0f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def out(line: str) -> None:
        print(line, flush=True)

    try:
        trace, nodes_path = _resolve(args)
        if args.mode == "static":
            summary = _run_static(args, trace, nodes_path, out)
        else:
            summary = _run_dynamic(args, trace, nodes_path, out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"tracesim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, separators=(",", ":")))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/tracesim.py", description="Replay a GPU trace through gpud's scheduler.")
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = [
    "DynamicResult",
    "DynamicRun",
    "StaticResult",
    "TraceNode",
    "TraceTask",
    "build_registry",
    "gpus_needed",
    "load_nodes",
    "load_tasks",
    "replay_static",
    "run_dynamic",
    "summarize_static",
    "task_need",
]

if __name__ == "__main__":
    sys.exit(main())
