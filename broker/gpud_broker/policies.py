"""Placement: filter then score. Policies live in explicit name -> function tables.

``worker_can_take`` (the worker's slots, CPU and memory) and ``feasible_gpus`` (health, cordon, type,
free share and memory, exclusivity) are the one filter every policy applies. A policy ranks what
passes and returns a ``Placement`` or None. Its signature is ``(need, workers, avoid)``; it reads the
registry's records and changes nothing (the caller grants through ``ledger.grant``).
``reserve_worker`` is the worker a long-waiting request reserves, for the broker and the trace
simulator alike.

Policies:

``fgd-balanced`` (the default)
    ``fgd``'s packing, with live-load balancing among the placements that pack equally well: of
    those, the least loaded by ledger, measurements and work dispatched since the last heartbeat
    (``balanced_score``) and requests not yet answered. Above ``SAMPLE_ABOVE`` workers it judges
    ``SAMPLE_K`` workers drawn at random and the ``SAMPLE_K`` it chose last while they are still
    registered (power of k choices with memory: its packing goes on where it left off), and all the
    workers it is given only when none of them can take the request.
``balanced``
    The least-loaded feasible GPU by ledger and live measurements.
``best-fit``
    Pack, with the node-level Best-fit of Weng et al. (USENIX ATC '23): the feasible worker with the
    smallest leftover ``0.5 * (free CPU - need CPU) / 128,000 + 0.5 * (free GPU milli - need GPU
    milli) / 8,000``, then on it the GPU with the least free share that still fits. On one worker this
    is the GPU-level best fit; across workers it also packs CPU.
``spread``
    The feasible GPU with the most free share.
``random``
    Random-fit: a feasible worker uniformly at random, then a random GPU that fits (seeded).
``fgd``
    Fragmentation gradient descent (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
    Workloads with Fragmentation Gradient Descent", USENIX ATC '23): the placement that adds the
    least expected waste, judged against the running mix of requests (``mix.TaskMix``): the paper's
    fragment, plus the GPU share the worker's CPU and memory could no longer feed and the models
    that tasks naming models need (see the class). Looks at every worker.
``fgd-classic``
    The paper's measure alone, for comparison.

Everywhere: a request for whole GPUs (``Need.gpus``) takes fully free GPUs of one worker only (the
lowest-index ones with ``best-fit``, ``random`` and the ``fgd`` family; the best-scoring ones with
``balanced`` and ``spread``); the model, compute-capability and memory filters are hard; the
worker's CPU and memory are hard limits. A need with no GPU at all (``gpus == 0`` and
``gpu_milli == 0``, as CPU-only tasks of a replayed trace) is placed on a worker with its CPU and
memory and an empty GPU list.

``POLICIES`` holds the stateless policies, plain functions. ``FACTORIES`` holds every policy by
name; ``make_policy(name, seed=..., mix=...)`` builds one, with its own random generator or task mix
where it has state.
"""

from __future__ import annotations

import math
import random as _random
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import accumulate
from typing import NamedTuple

from gpud.resources import MILLI_PER_GPU, Need
from gpud_broker.mix import MixSnapshot, TaskMix
from gpud_broker.registry import GpuRecord, WorkerRecord


class Placement(NamedTuple):
    """A policy's choice: ``gpus`` of ``worker`` (none for a need without GPU). A NamedTuple, as
    ``Grant`` is: one is made for every request placed (about 0.3 us against 1 us for a frozen
    dataclass)."""

    worker: WorkerRecord
    gpus: list[GpuRecord]


Policy = Callable[[Need, Iterable[WorkerRecord], Collection[str]], Placement | None]

# The Best-fit normalisers: the largest node of the published trace (128 cores, 8 GPUs).
BEST_FIT_CPU_SCALE = 128_000  # milli-CPU
BEST_FIT_GPU_SCALE = 8_000  # milli-GPU


def pool_allows(w: WorkerRecord, tenant: str, share: float) -> bool:
    """Whether work of ``tenant`` that holds a pool user may go to worker ``w``: it has a pool user
    left, and ``tenant`` holds fewer than ``share`` of them (at least one). A worker without a
    pool (``pool_users`` 0) is not limited (PROTOCOL.md §4.2)."""
    if w.pool_users <= 0:
        return True
    if sum(w.pool_held.values()) >= w.pool_users:
        return False
    return w.pool_held.get(tenant, 0) < max(1, int(share * w.pool_users + 1e-9))


def pool_blocked(kind: str, tenant: str, workers: Iterable[WorkerRecord], share: float) -> set[str]:
    """The names of ``workers`` where work of ``kind`` for ``tenant`` would need a pool user that
    ``pool_allows`` refuses (the broker passes only those that may: ``PoolIndex.candidates``)."""
    return {w.name for w in workers if kind in w.pool_kinds and not pool_allows(w, tenant, share)}


def needs_gpu(need: Need) -> bool:
    """False for a need with no GPU at all (``gpus == 0`` and ``gpu_milli == 0``)."""
    return need.gpus > 0 or need.gpu_milli > 0


def worker_can_take(need: Need, w: WorkerRecord) -> bool:
    return w.has_slot and w.free_cpu >= need.cpu_milli and w.free_host_mem >= need.host_mem


def feasible_gpus(need: Need, w: WorkerRecord) -> list[GpuRecord]:
    """GPUs of ``w`` that can take ``need`` now (for whole-GPU needs: fully free GPUs), in index order."""
    milli = need.milli_per_gpu
    typed = need.models is not None or need.min_cc is not None
    out = []
    for g in w.gpus:
        if g.granted_milli > MILLI_PER_GPU - milli or not g.placeable or g.free_mem < need.mem:
            continue
        if need.exclusive and g.tasks:
            continue
        if typed and not need.fits_type(g.info):
            continue
        out.append(g)
    return out


def could_ever_fit(need: Need, workers: Iterable[WorkerRecord]) -> bool:
    """Whether some connected worker could take ``need`` if it were idle."""
    gpu = needs_gpu(need)
    for w in workers:
        if w.cpu_milli < need.cpu_milli or w.host_mem < need.host_mem:
            continue
        if not gpu:
            return True
        fitting = sum(1 for g in w.gpus if need.fits_type(g.info) and g.state.health != "failed")
        if fitting >= need.gpu_count:
            return True
    return False


def _cpu_only(
    need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str], key: Callable[[WorkerRecord], float]
) -> Placement | None:
    """A need without GPU: the worker with the lowest ``key`` that has the CPU and memory."""
    best: WorkerRecord | None = None
    best_score = 0.0
    for w in workers:
        if (avoid and w.name in avoid) or not worker_can_take(need, w):
            continue
        score = key(w)
        if best is None or score < best_score:
            best, best_score = w, score
    return None if best is None else Placement(best, [])


def _place(
    need: Need,
    workers: Iterable[WorkerRecord],
    avoid: Collection[str],
    key: Callable[[GpuRecord, Need], float],
) -> Placement | None:
    """Pick the best-scoring (lowest ``key``) placement; ties go to the first seen."""
    best: WorkerRecord | None = None
    best_gpus: list[GpuRecord] = []
    best_score = 0.0
    count = need.gpu_count
    for w in workers:
        if avoid and w.name in avoid:
            continue
        if not worker_can_take(need, w):
            continue
        gpus = feasible_gpus(need, w)
        if len(gpus) < count:
            continue
        if count == 1:  # the common case, on the broker's hot path: each GPU scored once
            for gpu in gpus:
                score = key(gpu, need)
                if best is None or score < best_score:
                    best, best_gpus, best_score = w, [gpu], score
            continue
        scored = sorted([(key(gpu, need), i) for i, gpu in enumerate(gpus)])[:count]
        score = sum(s for s, _ in scored) / count
        if best is None or score < best_score:
            best, best_gpus, best_score = w, [gpus[i] for _, i in scored], score
    return None if best is None else Placement(best, best_gpus)


def balanced_score(g: GpuRecord, need: Need) -> float:
    """Load of a GPU as the ledger and the measurements see it, counting grants the last
    heartbeat could not yet show (so a burst does not herd onto the GPU that looked idlest)."""
    s = g.state
    ledger = g.granted_milli / 1000.0
    measured = s.util / 100.0 + g.milli_since_beat / 1000.0
    mem = g.info.mem or 1
    mem_frac = max(g.granted_mem, s.mem_used + g.mem_since_beat) / mem
    return max(ledger, measured, mem_frac) + 0.001 * g.tasks


def _cpu_load(w: WorkerRecord) -> float:
    return w.granted_cpu / w.cpu_milli if w.cpu_milli else 0.0


def balanced(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Default: the least-loaded feasible GPU by ledger and live state."""
    if not needs_gpu(need):
        return _cpu_only(need, workers, avoid, _cpu_load)
    return _place(need, workers, avoid, balanced_score)


def _left_after(g: GpuRecord, need: Need) -> float:
    return float(g.free_milli - need.milli_per_gpu) + g.free_mem / max(g.info.mem, 1) * 1e-3


def spread(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Spread: the feasible GPU with the most free share (ledger only)."""
    if not needs_gpu(need):
        return _cpu_only(need, workers, avoid, lambda w: -w.free_cpu)
    return _place(need, workers, avoid, lambda g, n: -_left_after(g, n))


def reserve_worker(
    need: Need, workers: Iterable[WorkerRecord], reserved: Collection[str], avoid: Collection[str] = ()
) -> str | None:
    """The worker a long-waiting request reserves (``queue.PendingQueue``): of those not reserved
    yet, not avoided and able to take ``need`` when idle, the one with the most free share on
    fitting GPUs (it frees up soonest, on average); the first of them on ties. None: no such worker."""
    best, best_free = None, -1
    for w in workers:
        if w.name in reserved or w.name in avoid or not could_ever_fit(need, (w,)):
            continue
        free = sum(g.free_milli for g in w.gpus if need.fits_type(g.info))
        if free > best_free:
            best, best_free = w.name, free
    return best


# --------------------------------------------------------------------------- node-level scans


def _fit_scan(need: Need, w: WorkerRecord) -> tuple[int, int]:
    """One pass over ``w``'s GPUs: (GPUs that fit ``need``, free milli of its placeable GPUs).

    The caller has checked the worker (slots, CPU, memory). Equivalent to
    ``len(feasible_gpus(need, w))`` and the free share, without building lists.
    """
    milli = need.milli_per_gpu
    limit = MILLI_PER_GPU - milli
    typed = need.models is not None or need.min_cc is not None
    mem = need.mem
    exclusive = need.exclusive
    fit = 0
    free = 0
    for g in w.gpus:
        used = g.granted_milli
        if used >= MILLI_PER_GPU or g.cordoned or g.exclusive or g.state.health == "failed":
            continue
        free += MILLI_PER_GPU - used
        if used > limit or (mem and g.info.mem - g.granted_mem < mem) or (exclusive and g.tasks):
            continue
        if typed and not need.fits_type(g.info):
            continue
        fit += 1
    return fit, free


def _choose_gpus(need: Need, gpus: list[GpuRecord]) -> list[GpuRecord]:
    """Best fit inside a worker: whole GPUs (and exclusive shares) take the lowest-index free
    GPUs; a share takes the GPU with the least free share that still fits (lowest index on ties)."""
    if need.gpus or need.exclusive:
        return gpus[: need.gpu_count]
    return [max(gpus, key=lambda g: g.granted_milli)]


def best_fit(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Pack: the worker with the least CPU and GPU left over (README formula), then the GPU with
    the least free share that still fits."""
    cpu = need.cpu_milli
    host_mem = need.host_mem
    gpu = needs_gpu(need)
    total = need.total_milli if gpu else 0
    count = need.gpu_count
    best: WorkerRecord | None = None
    best_score = 0.0
    for w in workers:
        free_cpu = w.cpu_milli - w.granted_cpu
        if free_cpu < cpu or w.host_mem - w.granted_host_mem < host_mem:
            continue
        if not w.has_slot or (avoid and w.name in avoid):
            continue
        if gpu:
            fit, free = _fit_scan(need, w)
            if fit < count:
                continue
        else:
            free = sum(g.free_milli for g in w.gpus if g.placeable)
        score = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (free - total) / (2 * BEST_FIT_GPU_SCALE)
        if best is None or score < best_score:
            best, best_score = w, score
    if best is None:
        return None
    if not gpu:
        return Placement(best, [])
    return Placement(best, _choose_gpus(need, feasible_gpus(need, best)))


# --------------------------------------------------------------------------- random-fit


class RandomFit:
    """Random-fit: a feasible worker uniformly at random, then a random GPU that fits.

    Whole GPUs are the lowest-index free ones. Workers are drawn at random and the first feasible
    one is taken, which is uniform over the feasible workers; after ``tries`` misses the policy
    lists them all and draws from the list (also uniform).
    """

    name = "random"

    def __init__(self, seed: int | None = None, tries: int = 32) -> None:
        self.rng = _random.Random(seed)
        self.tries = tries

    def _ok(self, need: Need, w: WorkerRecord, avoid: Collection[str], gpu: bool) -> bool:
        if not worker_can_take(need, w) or (avoid and w.name in avoid):
            return False
        return not gpu or _fit_scan(need, w)[0] >= need.gpu_count

    def __call__(self, need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
        pool: Sequence[WorkerRecord] = workers if isinstance(workers, (list, tuple)) else list(workers)
        if not pool:
            return None
        gpu = needs_gpu(need)
        rng = self.rng
        chosen: WorkerRecord | None = None
        for _ in range(self.tries):
            w = pool[rng.randrange(len(pool))]
            if self._ok(need, w, avoid, gpu):
                chosen = w
                break
        else:
            ok = [w for w in pool if self._ok(need, w, avoid, gpu)]
            if not ok:
                return None
            chosen = ok[rng.randrange(len(ok))]
        if not gpu:
            return Placement(chosen, [])
        gpus = feasible_gpus(need, chosen)
        if need.gpus or need.exclusive:
            return Placement(chosen, gpus[: need.gpu_count])
        return Placement(chosen, [gpus[rng.randrange(len(gpus))]])


# --------------------------------------------------------------------------- fragmentation gradient descent

DEFAULT_SHORTFALL_WEIGHT = 1.0
DEFAULT_PRESSURE_WEIGHT = 1.0
SUPPLY_EVERY = 256  # placements between two full counts of the free share of each GPU model
SAMPLE_ABOVE = 64  # workers: above this many, a sampling policy looks at a sample first
SAMPLE_K = 16  # workers drawn at random for that sample (and as many it chose last)
MEMO_SIZE = 1 << 15  # entries of each memo of ``_Tables`` (it starts again past it)

_ViewKey = tuple[str, int, int, tuple[bool, int, int, bool], tuple[int, ...]]
_View = tuple[tuple[int, ...], int, float, list[tuple[float, list[int]]]]


class _Tables:
    """What FGD needs from one published mix, prepared once per version.

    GPU classes are grouped by (share per GPU, GPU count); ``levels`` are the distinct CPU requests
    of the classes, and a worker's CPU level is how many of them its free CPU covers. Classes without
    GPU are left out of the fragment: whatever a placement does, they count every free GPU share as
    fragment on every worker, so they add the same amount to every candidate's score.

    ``demand`` is each GPU class's share of the GPU demand (probability x milli-GPU it asks);
    ``ratios`` the CPU each class asks per milli-GPU, ascending, with the suffix sums ``stranded``
    needs.

    ``frag`` and ``view`` remember what they worked out (up to ``MEMO_SIZE`` entries each): most
    workers' GPUs look the same from one decision to the next.
    """

    def __init__(self, snap: MixSnapshot) -> None:
        self.version = snap.version
        self.gpu_classes = [(c, p) for c, p in snap.classes if c.needs_gpu and p > 0]
        norm = sum(p for _, p in self.gpu_classes)
        if norm > 0:
            self.gpu_classes = [(c, p / norm) for c, p in self.gpu_classes]
        self.levels = sorted({c.cpu_milli for c, _ in self.gpu_classes})
        volume = sum(p * c.milli * c.gpus for c, p in self.gpu_classes)
        self.demand = [(c, p * c.milli * c.gpus / volume) for c, p in self.gpu_classes] if volume > 0 else []
        by_ratio = sorted((c.cpu_milli / (c.milli * c.gpus), d) for c, d in self.demand if c.cpu_milli > 0)
        self.ratios = [r for r, _ in by_ratio]
        self.tail_demand = list(accumulate((d for _, d in reversed(by_ratio)), initial=0.0))[::-1]
        self.tail_per_cpu = list(accumulate((d / r for r, d in reversed(by_ratio)), initial=0.0))[::-1]
        self.mem_per_milli = snap.mem_per_milli
        # Whether ``stranded`` can be anything but 0: some GPU class asks CPU, or the mix host memory.
        self.strands = bool(self.ratios) or self.mem_per_milli > 0
        self._by_model: dict[str, tuple[float, list[tuple[int, int, float, list[float]]]]] = {}
        self.memo: dict[tuple[str, int, tuple[int, ...]], float] = {}
        self.views: dict[_ViewKey, _View] = {}

    def level(self, free_cpu: int) -> int:
        return bisect_right(self.levels, free_cpu)

    def model(self, model: str) -> tuple[float, list[tuple[int, int, float, list[float]]]]:
        """(probability of the classes that cannot use ``model``, [(share, count, probability,
        probability by CPU level)] for the classes that can, by share ascending)."""
        got = self._by_model.get(model)
        if got is not None:
            return got
        n = len(self.levels)
        no_access = 0.0
        totals: dict[tuple[int, int], float] = {}
        steps: dict[tuple[int, int], list[float]] = {}
        for c, p in self.gpu_classes:
            if c.models is not None and model not in c.models:
                no_access += p
                continue
            key = (c.milli, c.gpus)
            totals[key] = totals.get(key, 0.0) + p
            # Satisfied on CPU from the level that covers the class's own request upwards.
            steps.setdefault(key, [0.0] * (n + 1))[bisect_right(self.levels, c.cpu_milli)] += p
        table = [(key[0], key[1], totals[key], list(accumulate(steps[key]))) for key in sorted(totals)]
        got = (no_access, table)
        self._by_model[model] = got
        return got

    def frag(self, model: str, level: int, free: tuple[int, ...]) -> float:
        """Expected fragment (milli-GPU) of a group of ``model`` GPUs with free shares ``free``
        (ascending, zeros left out) on a worker at CPU level ``level``."""
        key = (model, level, free)
        got = self.memo.get(key)
        if got is not None:
            return got
        no_access, table = self.model(model)
        total = sum(free)
        n = len(free)
        out = total * no_access
        i = 0
        below = 0  # free share of the GPUs too small for the current class
        for milli, count, p, cum in table:
            while i < n and free[i] < milli:
                below += free[i]
                i += 1
            if n - i >= count:
                ok = cum[level]
                out += below * ok + total * (p - ok)
            else:
                out += total * p
        if len(self.memo) >= MEMO_SIZE:
            self.memo.clear()
        self.memo[key] = out
        return out

    def view(self, key: _ViewKey) -> _View:
        """The placements a need of one shape has on the GPUs of one worker of one model,
        remembered by ``key``: (model, CPU level before, CPU level after, the need's shape (has
        GPU, share per GPU, GPU count, whole GPUs), the GPUs as ``_codes`` writes them).

        Returns (the free shares in ``frag``'s form, their sum, their fragment before, [(the
        fragment after, GPU indexes)]), one option per placement to judge, in index order: the
        lowest-index GPUs that fit for whole GPUs; every GPU that fits for a share, but only the
        first of each free share (the others score the same); the worker itself for a need
        without GPU; none when the need does not fit.
        """
        model, lb, la, (gpu, milli, count, whole), codes = key
        free = []
        fit: list[tuple[int, int]] = []  # (index, free share) of the GPUs the need may take
        for i, code in enumerate(codes):
            used = code if code >= 0 else -2 - code
            if code == -1 or used >= MILLI_PER_GPU:
                continue
            f = MILLI_PER_GPU - used
            free.append(f)
            if code >= 0 and f >= milli:
                fit.append((i, f))
        free.sort()
        state = tuple(free)
        frag = self.frag
        options: list[tuple[float, list[int]]] = []
        if not gpu:
            options.append((frag(model, la, state), []))
        elif len(fit) < count:
            pass
        elif whole:
            rest = list(state)
            for _, f in fit[:count]:
                rest.remove(f)
            options.append((frag(model, la, tuple(rest)), [gi for gi, _ in fit[:count]]))
        else:
            tried: set[int] = set()
            for gi, f in fit:
                if f in tried:
                    continue
                tried.add(f)
                rest = list(state)
                rest.remove(f)
                if f > milli:
                    rest.append(f - milli)
                    rest.sort()
                options.append((frag(model, la, tuple(rest)), [gi]))
        got = (state, sum(state), frag(model, lb, state), options)
        if len(self.views) >= MEMO_SIZE:
            self.views.clear()
        self.views[key] = got
        return got

    def stranded(self, free_milli: int, free_cpu: int, free_mem: int) -> float:
        """Expected free GPU share (milli) that the worker's free CPU and host memory cannot feed.

        CPU: for each GPU class, filling the worker's free share with tasks of that class needs
        ``ratio x free_milli`` milli-CPU; what the free CPU cannot feed (``free_milli - free_cpu /
        ratio`` when positive) is stranded for that class. Weighted by the classes' share of the
        GPU demand: ``free_milli x D - free_cpu x Q`` over the classes whose ratio is above
        ``free_cpu / free_milli`` (suffix sums, one bisection). Memory: the same at the mix's mean
        host memory per milli-GPU.
        """
        if free_milli <= 0:
            return 0.0
        k = bisect_right(self.ratios, free_cpu / free_milli)
        out = free_milli * self.tail_demand[k] - free_cpu * self.tail_per_cpu[k]
        if self.mem_per_milli > 0:
            out += max(0.0, free_milli - free_mem / self.mem_per_milli)
        return max(0.0, out)

    def pressure(self, supply: dict[str, int]) -> dict[str, float]:
        """Demand per free share that each GPU model must absorb from the classes that name models.

        Each class that names its models spreads its share of the GPU demand over the free share of
        those models in proportion to it, so model ``m`` receives ``sum(demand / free share of the
        class's models)`` (shares as fractions of the cluster's free share) over the classes that
        may use it. Classes that take any model add the same to every model and are left out. A
        model above 1 is wanted, by the tasks that can run nowhere else, more than it has free.
        """
        total = sum(supply.values())
        out = dict.fromkeys(supply, 0.0)
        if total <= 0:
            return out
        for c, d in self.demand:
            if c.models is None:
                continue
            allowed = [m for m in c.models if supply.get(m, 0) > 0]
            share = sum(supply[m] for m in allowed) / total
            if share <= 0:
                continue
            for m in allowed:
                out[m] += d / share
        return out


_EPS = 1e-9
_NOTHING_SEEN: set[tuple[object, ...]] = set()  # ``_decide``'s seen states when it does not dedupe (never added to)


_NeedPlan = tuple[Need, bool, int, int, int, int, bool, bool, int, int, tuple[bool, int, int, bool], bool]


def _plan(need: Need) -> _NeedPlan:
    """What ``FragmentationGradientDescent._decide`` reads of ``need``: (need, has GPU, CPU, host
    memory, GPU count, share per GPU (all of it if exclusive), whole GPUs, typed, GPU memory,
    milli-GPU taken, its shape for ``_Tables.view``, plain: no filter on a GPU but its free share)."""
    gpu = needs_gpu(need)
    count = need.gpu_count
    milli = MILLI_PER_GPU if need.exclusive else need.milli_per_gpu
    whole = need.gpus > 0 or need.exclusive
    typed = need.models is not None or need.min_cc is not None
    taken = (MILLI_PER_GPU * count if whole else milli) if gpu else 0
    plain = not gpu or not (typed or need.mem or need.exclusive)
    return need, gpu, need.cpu_milli, need.host_mem, count, milli, whole, typed, need.mem, taken, (gpu, milli, count, whole), plain


def _codes(need: Need, w: WorkerRecord, typed: bool) -> tuple[int, ...]:
    """``w``'s GPUs as ``_Tables.view`` reads them: -1 for a GPU that takes nothing (cordoned,
    held exclusively, failed); its granted share for one ``need`` may take if its free share
    allows; ``-2 - granted`` for one that its memory, its tasks (for an exclusive need) or its type
    rule out. (``_decide`` writes the first two itself for a need without those filters.)"""
    mem = need.mem
    exclusive = need.exclusive
    out = []
    for g in w.gpus:
        used = g.granted_milli
        if g.cordoned or g.exclusive or g.state.health == "failed":
            out.append(-1)
        elif (mem and g.info.mem - g.granted_mem < mem) or (exclusive and g.tasks) or (typed and not need.fits_type(g.info)):
            out.append(-2 - used)
        else:
            out.append(used)
    return tuple(out)


class FragmentationGradientDescent:
    """FGD: place where the expected waste of GPU share grows least.

    A worker's score (milli-GPU) has three terms, all judged against the task mix (``mix.TaskMix``,
    the requests actually seen, not a fixed table):

    - *fragment* (Weng et al., ATC '23, section 4): the free GPU share a request class cannot use
      there (all of it when the class cannot run on the worker: GPU model, CPU, or not enough GPUs
      with the share it needs; else the free share of the GPUs too small for it), expected over the
      classes;
    - *stranded* (``shortfall_weight``): the free GPU share the worker's free CPU and host memory
      cannot feed, expected over the classes' CPU per milli-GPU (``_Tables.stranded``). The fragment
      sees CPU only through the next request; this sees GPUs that will be stranded once the CPU is
      spent, whatever comes next, so CPU-only work goes where CPU is plentiful for the GPUs;
    - *model pressure* (``pressure_weight``): minus the free share of each model weighted by the
      demand for that model from the tasks that name models, per free share of what they may use
      (``_Tables.pressure``, from the cluster's free share by model, counted every
      ``SUPPLY_EVERY`` placements and kept up by the policy's own placements in between). A task
      that may run anywhere so leaves the models in short supply to the tasks that need them.

    ``shortfall_weight=0, pressure_weight=0`` is the paper's measure alone (``fgd-classic``).

    FGD takes the feasible (worker, GPUs) whose placement increases the score least; ties go to
    the worker Best-fit would take, then to the first seen; inside a worker to the lowest index.
    Whole GPUs are the lowest-index free GPUs, as everywhere. With ``balance`` (``fgd-balanced``)
    ties go first to the least live load (``_live_load``). With ``sample`` > 0 and more than
    ``sample_above`` workers, a decision judges ``sample`` workers drawn at random (``seed``) and the
    ``sample`` it chose last, and every worker only when none of those can take the request.

    With ``mix=None`` the policy keeps its own mix and counts each request it is asked to place (a
    caller that retries a request counts it again; the broker feeds a shared mix instead).
    """

    name = "fgd"

    def __init__(
        self,
        mix: TaskMix | None = None,
        shortfall_weight: float = DEFAULT_SHORTFALL_WEIGHT,
        pressure_weight: float = DEFAULT_PRESSURE_WEIGHT,
        *,
        balance: bool = False,
        sample: int = 0,
        sample_above: int = SAMPLE_ABOVE,
        seed: int | None = None,
    ) -> None:
        if not (math.isfinite(shortfall_weight) and math.isfinite(pressure_weight)):
            raise ValueError("fgd: shortfall_weight and pressure_weight must be finite")
        self.balance = balance
        self.sample = sample
        self.sample_above = sample_above
        self.rng = _random.Random(seed)
        self._recent: deque[WorkerRecord] = deque(maxlen=sample or 1)
        self.feeds = mix is None
        self.mix = mix if mix is not None else TaskMix()
        self.shortfall_weight = shortfall_weight
        self.pressure_weight = pressure_weight
        self._tables: _Tables | None = None
        self._static: dict[int, tuple[WorkerRecord, str | None]] = {}
        self.supply: dict[str, int] = {}  # free milli-GPU by model, as last counted and kept up
        self.pressure: dict[str, float] = {}
        self._supply_age = 0  # placements since the last count (SUPPLY_EVERY: count again)
        self._plan = _plan(Need())  # of the need decided last

    def tables(self) -> _Tables:
        snap = self.mix.snapshot()
        t = self._tables
        if t is None or t.version != snap.version:
            t = self._tables = _Tables(snap)
            self._supply_age = SUPPLY_EVERY  # new demand: weigh the models again
        return t

    def count_supply(self, workers: Iterable[WorkerRecord]) -> None:
        """Count the free share of every GPU model over ``workers`` and weigh the models again."""
        supply: dict[str, int] = {}
        for w in workers:
            for g in w.gpus:
                used = g.granted_milli
                if used < MILLI_PER_GPU and not (g.cordoned or g.exclusive or g.state.health == "failed"):
                    m = g.info.model
                    supply[m] = supply.get(m, 0) + MILLI_PER_GPU - used
        self.supply = supply
        self.pressure = self.tables().pressure(supply) if self.pressure_weight else {}
        self._supply_age = 0

    def _single_model(self, w: WorkerRecord) -> str | None:
        """The model of all of ``w``'s GPUs, or None when they differ (or there are none)."""
        got = self._static.get(id(w))
        if got is None or got[0] is not w:
            if len(self._static) > 65536:
                self._static.clear()
            models = {g.info.model for g in w.gpus}
            got = (w, models.pop() if len(models) == 1 else None)
            self._static[id(w)] = got
        return got[1]

    def score(self, w: WorkerRecord) -> float:
        """The worker's score as it stands (milli-GPU): fragment, plus weighted stranded share,
        less the pressure-weighted free share (with the model weights as last counted)."""
        t = self.tables()
        groups = _groups(w)
        level = t.level(w.free_cpu)
        free = sum(sum(f) for f in groups.values())
        out = sum(t.frag(m, level, f) for m, f in groups.items())
        out += self.shortfall_weight * t.stranded(free, w.free_cpu, w.free_host_mem)
        pressure = self.pressure
        out -= self.pressure_weight * sum(pressure.get(m, 0.0) * sum(f) for m, f in groups.items())
        return out

    def __call__(self, need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
        if self.feeds:
            self.mix.observe(need)
        pool: Sequence[WorkerRecord] = workers if isinstance(workers, (list, tuple)) else list(workers)
        if self._supply_age >= SUPPLY_EVERY:
            self.count_supply(pool)
        if not self.sample or len(pool) <= self.sample_above:
            placement = self._decide(need, pool, avoid)
        else:
            # Power of k choices with memory: k workers at random and the workers it chose last
            # (where its packing goes on) while they are registered, the whole cluster only when
            # none of them can take it.
            offered = self.rng.sample(pool, self.sample)
            drawn = {id(w) for w in offered}
            offered += [w for w in self._recent if w.pos >= 0 and id(w) not in drawn]
            placement = self._decide(need, offered, avoid)
            if placement is None:
                placement = self._decide(need, pool, avoid)
        if placement is not None and self.sample:
            recent = self._recent
            w = placement.worker
            if not recent or recent[-1] is not w:  # (already last: nothing moves)
                if w in recent:
                    recent.remove(w)
                recent.append(w)
        return placement

    def _decide(self, need: Need, workers: Sequence[WorkerRecord], avoid: Collection[str]) -> Placement | None:
        t = self.tables()
        plan = self._plan
        if plan[0] is not need:
            plan = self._plan = _plan(need)
        _, gpu, cpu, host_mem, count, milli, whole, typed, mem, taken, shape, plain = plan
        views = t.views
        levels = t.levels
        beta = self.shortfall_weight if t.strands else 0.0  # a mix that asks no CPU nor memory strands nothing
        gamma = self.pressure_weight
        pressure = self.pressure
        stranded = t.stranded
        static = self._static
        # Equal states score equal, so the first of them wins anyway (unless live load decides).
        dedupe = mem == 0 and not self.balance
        seen: set[tuple[object, ...]] = set() if dedupe else _NOTHING_SEEN
        best = math.inf
        near: list[tuple[float, float, WorkerRecord, list[int]]] = []  # as good as the best so far
        for w in workers:
            free_cpu = w.cpu_milli - w.granted_cpu
            free_mem = w.host_mem - w.granted_host_mem
            if free_cpu < cpu or free_mem < host_mem:
                continue
            if w.inflight >= w.slots or w.draining or (avoid and w.name in avoid):
                continue
            got = static.get(id(w))
            model = got[1] if got is not None and got[0] is w else self._single_model(w)
            lb = bisect_right(levels, free_cpu)
            la = bisect_right(levels, free_cpu - cpu) if cpu else lb
            if model is None:
                best = self._offer_groups(t, plan, w, free_cpu, free_mem, lb, la, beta, best, near)
                continue
            # One model on the worker (the common case): its GPUs as one group, judged once per
            # state of theirs (``_Tables.view``).
            if plain:  # (a full GPU takes nothing whatever else holds: no need to look further)
                gpus = w.gpus
                if len(gpus) == 1:  # (the same, without a comprehension's call: one GPU per worker is common)
                    device = gpus[0]
                    used = device.granted_milli
                    codes: tuple[int, ...] = (used if used >= MILLI_PER_GPU
                                              or not (device.cordoned or device.exclusive or device.state.health == "failed") else -1,)
                else:
                    codes = tuple([used if (used := device.granted_milli) >= MILLI_PER_GPU
                                   or not (device.cordoned or device.exclusive or device.state.health == "failed") else -1
                                   for device in gpus])
            elif typed and not need.fits_type(w.gpus[0].info):
                continue
            else:
                codes = _codes(need, w, typed)
            key = (model, lb, la, shape, codes)
            view = views.get(key)
            if view is None:
                view = t.view(key)
            state, total, before, options = view
            if not options:
                continue
            if dedupe:
                seen_key = (model, free_cpu, free_mem, state)
                if seen_key in seen:
                    continue
                seen.add(seen_key)
            cost = 0.0
            if beta:
                before += beta * stranded(total, free_cpu, free_mem)
                cost = beta * stranded(total - taken, free_cpu - cpu, free_mem - host_mem)
            if gamma and gpu:
                cost += gamma * pressure.get(model, 0.0) * taken
            cost -= before
            left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
            for after, option in options:
                delta = after + cost
                if delta <= best + _EPS:
                    near.append((delta, left, w, option))
                    if delta < best:
                        best = delta
        if not near:
            return None
        # As good as the best: all of them when the best has not moved since the first was offered.
        pool = near if near[0][0] == best else [c for c in near if c[0] <= best + _EPS]
        if len(pool) == 1:
            _, _, best_w, best_gpus = pool[0]
        elif self.balance:
            # Equally good for packing: the least loaded by live state, then as Best-fit would
            # (the first of equals, as min() takes it).
            pick = pool[0]
            pick_key: tuple[float, float] | None = None
            for c in pool:
                _, left, cw, option = c
                if len(option) == 1:  # _live_load of one GPU
                    k = (balanced_score(cw.gpus[option[0]], need) + 0.001 * cw.inflight, left)
                else:
                    k = (_live_load(cw, option, need), left)
                if pick_key is None or k < pick_key:
                    pick, pick_key = c, k
            _, _, best_w, best_gpus = pick
        else:
            _, _, best_w, best_gpus = min(pool, key=lambda c: c[1])
        chosen = [best_w.gpus[best_gpus[0]]] if len(best_gpus) == 1 else [best_w.gpus[i] for i in best_gpus]
        self._supply_age += 1
        supply = self.supply
        for device in chosen:
            m = device.info.model
            if m in supply:
                supply[m] -= MILLI_PER_GPU if whole else milli
        return Placement(best_w, chosen)

    def _offer_groups(
        self,
        t: _Tables,
        plan: _NeedPlan,
        w: WorkerRecord,
        free_cpu: int,
        free_mem: int,
        lb: int,
        la: int,
        beta: float,
        best: float,
        near: list[tuple[float, float, WorkerRecord, list[int]]],
    ) -> float:
        """``_decide`` for a worker with GPUs of several models: each model's GPUs are judged as
        one group. Appends the placements on ``w`` as good as ``best`` to ``near``; returns the
        best score now."""
        need, gpu, cpu, host_mem, count, milli, whole, typed, _, taken, _, _ = plan
        frag = t.frag
        gamma = self.pressure_weight
        pressure = self.pressure
        groups = _groups(w)
        total = sum(sum(f) for f in groups.values())
        before = sum(frag(m, lb, f) for m, f in groups.items())
        after_short = 0.0
        if beta:
            before += beta * t.stranded(total, free_cpu, free_mem)
            after_short = beta * t.stranded(total - taken, free_cpu - cpu, free_mem - host_mem)
        left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
        if not gpu:
            delta = sum(frag(m, la, f) for m, f in groups.items()) + after_short - before
            if delta <= best + _EPS:
                near.append((delta, left, w, []))
                best = min(best, delta)
            return best
        cand = self._candidates(need, w, milli, whole, count, typed)
        if cand is None:
            return best
        options = [cand] if whole else [[gi] for gi in cand]
        for option in options:
            after_groups = {m: list(f) for m, f in groups.items()}
            cost = after_short
            for gi in option:
                device = w.gpus[gi]
                f = MILLI_PER_GPU - device.granted_milli
                lst = after_groups[device.info.model]
                lst.remove(f)
                if not whole and f > milli:
                    lst.append(f - milli)
                if gamma:
                    cost += gamma * pressure.get(device.info.model, 0.0) * (MILLI_PER_GPU if whole else milli)
            delta = sum(frag(m, la, tuple(sorted(f))) for m, f in after_groups.items()) + cost - before
            if delta <= best + _EPS:
                near.append((delta, left, w, option))
                best = min(best, delta)
        return best

    @staticmethod
    def _candidates(
        need: Need, w: WorkerRecord, milli: int, whole: bool, count: int, typed: bool
    ) -> list[int] | None:
        """Indexes of the GPUs ``need`` may take on ``w``: for whole GPUs the lowest-index ``count``
        free ones, for a share every GPU it fits; None when it does not fit."""
        limit = MILLI_PER_GPU - milli
        mem = need.mem
        out = []
        for i, g in enumerate(w.gpus):
            if g.granted_milli > limit or g.cordoned or g.exclusive or g.state.health == "failed":
                continue
            if (mem and g.info.mem - g.granted_mem < mem) or (need.exclusive and g.tasks):
                continue
            if typed and not need.fits_type(g.info):
                continue
            out.append(i)
            if whole and len(out) == count:
                return out
        if whole or not out:
            return None
        return out


def _live_load(w: WorkerRecord, option: list[int], need: Need) -> float:
    """Live load of a placement: the most loaded of its GPUs (``balanced_score``: ledger,
    measurements, grants the last heartbeat cannot show yet), or the worker's CPU for a need
    without GPU; plus the worker's dispatched requests not yet answered."""
    if not option:
        return _cpu_load(w) + 0.001 * w.inflight
    gpus = w.gpus
    return max(balanced_score(gpus[i], need) for i in option) + 0.001 * w.inflight


def _groups(w: WorkerRecord) -> dict[str, tuple[int, ...]]:
    """Free shares of ``w``'s placeable GPUs by model (ascending, zeros left out)."""
    groups: dict[str, list[int]] = {}
    for g in w.gpus:
        lst = groups.setdefault(g.info.model, [])
        used = g.granted_milli
        if used < MILLI_PER_GPU and not (g.cordoned or g.exclusive or g.state.health == "failed"):
            lst.append(MILLI_PER_GPU - used)
    return {m: tuple(sorted(f)) for m, f in groups.items()}


# --------------------------------------------------------------------------- tables

POLICIES: dict[str, Policy] = {
    "balanced": balanced,
    "best-fit": best_fit,
    "spread": spread,
}
"""The stateless policies (plain functions): what a broker configuration can name directly."""

PolicyFactory = Callable[[int | None, TaskMix | None], Policy]


def _stateless(policy: Policy) -> PolicyFactory:
    return lambda seed, mix: policy


FACTORIES: dict[str, PolicyFactory] = {
    "balanced": _stateless(balanced),
    "best-fit": _stateless(best_fit),
    "spread": _stateless(spread),
    "random": lambda seed, mix: RandomFit(seed),
    "fgd": lambda seed, mix: FragmentationGradientDescent(mix),
    "fgd-classic": lambda seed, mix: FragmentationGradientDescent(mix, shortfall_weight=0.0, pressure_weight=0.0),
    "fgd-balanced": lambda seed, mix: FragmentationGradientDescent(
        mix, balance=True, sample=SAMPLE_K, seed=seed
    ),
}
"""Every policy by name, as a factory ``(seed, mix) -> Policy``."""


def make_policy(name: str, *, seed: int | None = None, mix: TaskMix | None = None) -> Policy:
    """Build the policy ``name``: ``seed`` seeds its random choices, ``mix`` is the task mix it
    judges against (``fgd``; the caller feeds it with ``mix.observe(need)`` for each request)."""
    factory = FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(FACTORIES)}")
    return factory(seed, mix)


__all__ = [
    "BEST_FIT_CPU_SCALE",
    "BEST_FIT_GPU_SCALE",
    "DEFAULT_PRESSURE_WEIGHT",
    "DEFAULT_SHORTFALL_WEIGHT",
    "FACTORIES",
    "POLICIES",
    "FragmentationGradientDescent",
    "Placement",
    "Policy",
    "PolicyFactory",
    "SAMPLE_ABOVE",
    "SAMPLE_K",
    "SUPPLY_EVERY",
    "RandomFit",
    "balanced",
    "balanced_score",
    "best_fit",
    "could_ever_fit",
    "feasible_gpus",
    "make_policy",
    "needs_gpu",
    "reserve_worker",
    "spread",
    "worker_can_take",
]
