"""Placement: filter then score. Policies live in explicit name -> function tables.

``worker_can_take`` (the worker's slots, CPU and memory) and ``feasible_gpus`` (health, cordon, type,
free share and memory, exclusivity) are the one filter every policy applies. A policy ranks what
passes and returns a ``Placement`` or None. Its signature is ``(need, workers, avoid)``; it reads the
registry's records and changes nothing (the caller grants through ``ledger.grant``).

Policies:

``balanced`` (the default)
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
    least expected fragmentation, judged against the running mix of requests (``mix.TaskMix``),
    plus the GPU share that the worker's CPU and memory could no longer feed (see the class).
``fgd-classic``
    The paper's measure alone (no CPU/memory shortfall term), for comparison.

Everywhere: a request for whole GPUs (``Need.gpus``) takes fully free GPUs of one worker only (the
lowest-index ones with ``best-fit``, ``random`` and ``fgd``; the best-scoring ones with ``balanced``
and ``spread``); the model, compute-capability and memory filters are hard; the worker's CPU and
memory are hard limits. A need with no GPU at all (``gpus == 0`` and
``gpu_milli == 0``, as CPU-only tasks of a replayed trace) is placed on a worker with its CPU and
memory and an empty GPU list.

``POLICIES`` holds the stateless policies, plain functions. ``FACTORIES`` holds every policy by
name; ``make_policy(name, seed=..., mix=...)`` builds one, with its own random generator or task mix
where it has state.
"""

from __future__ import annotations

import random as _random
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from gpud.resources import MILLI_PER_GPU, Need
from gpud_broker.mix import MixSnapshot, TaskMix
from gpud_broker.registry import GpuRecord, WorkerRecord


@dataclass(frozen=True, slots=True)
class Placement:
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
    ``pool_allows`` refuses."""
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
            for g in gpus:
                score = key(g, need)
                if best is None or score < best_score:
                    best, best_gpus, best_score = w, [g], score
            continue
        scored = sorted([(key(g, need), i) for i, g in enumerate(gpus)])[:count]
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

DEFAULT_SHORTFALL_WEIGHT = 3.0


class _Tables:
    """What FGD needs from one published mix, prepared once per version.

    GPU classes are grouped by (share per GPU, GPU count); ``levels`` are the distinct CPU requests
    of the classes, and a worker's CPU level is how many of them its free CPU covers. Classes without
    GPU are left out: whatever a placement does, they count every free GPU share as fragment on
    every worker, so they add the same amount to every candidate's score.
    """

    def __init__(self, snap: MixSnapshot) -> None:
        self.version = snap.version
        self.gpu_classes = [(c, p) for c, p in snap.classes if c.needs_gpu and p > 0]
        norm = sum(p for _, p in self.gpu_classes)
        if norm > 0:
            self.gpu_classes = [(c, p / norm) for c, p in self.gpu_classes]
        self.levels = sorted({c.cpu_milli for c, _ in self.gpu_classes})
        self.cpu_per_milli = snap.cpu_per_milli
        self.mem_per_milli = snap.mem_per_milli
        self._by_model: dict[str, tuple[float, list[tuple[int, int, float, list[float]]]]] = {}
        self.memo: dict[tuple[str, int, tuple[int, ...]], float] = {}

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
        self.memo[key] = out
        return out

    def shortfall(self, free_milli: int, free_cpu: int, free_mem: int) -> float:
        """GPU share (milli) the worker's free CPU and host memory cannot feed at the mix's ratios."""
        out = 0.0
        if self.cpu_per_milli > 0:
            out += max(0.0, free_milli - free_cpu / self.cpu_per_milli)
        if self.mem_per_milli > 0:
            out += max(0.0, free_milli - free_mem / self.mem_per_milli)
        return out


_EPS = 1e-9


class FragmentationGradientDescent:
    """FGD: place where the expected fragmentation grows least.

    The fragment a worker offers a request class (Weng et al., ATC '23, section 4): all of its free
    GPU share when the class cannot run there (GPU model, CPU, or not enough GPUs with the share it
    needs), else the free share of the GPUs too small for it. The expected fragment weighs the
    classes by the task mix (``mix.TaskMix``, the requests actually seen, not a fixed table).

    gpud adds one term the paper does not have: the *shortfall*, the free GPU share a worker's free
    CPU and host memory cannot feed at the ratios the mix asks for (``free GPU - free CPU / CPU per
    milli-GPU``, and the same for memory, when positive), weighted by ``shortfall_weight``. The
    paper's measure only sees CPU through the next request; the shortfall sees GPUs that will be
    stranded once the CPU is spent, whatever comes next. On the published trace it is worth about
    one point of unallocated GPU share (BENCHMARKS.md). ``shortfall_weight=0`` is the paper's
    measure alone (``fgd-classic``).

    FGD takes the feasible (worker, GPUs) whose placement increases the score least; ties go to
    the worker Best-fit would take, then to the first seen; inside a worker to the lowest index.
    Whole GPUs are the lowest-index free GPUs, as everywhere.

    With ``mix=None`` the policy keeps its own mix and counts each request it is asked to place (a
    caller that retries a request counts it again; the broker feeds a shared mix instead).
    """

    name = "fgd"

    def __init__(self, mix: TaskMix | None = None, shortfall_weight: float = DEFAULT_SHORTFALL_WEIGHT) -> None:
        self.feeds = mix is None
        self.mix = mix if mix is not None else TaskMix()
        self.shortfall_weight = shortfall_weight
        self._tables: _Tables | None = None
        self._static: dict[int, tuple[WorkerRecord, str | None]] = {}

    def tables(self) -> _Tables:
        snap = self.mix.snapshot()
        t = self._tables
        if t is None or t.version != snap.version:
            t = self._tables = _Tables(snap)
        return t

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
        """The worker's score as it stands: expected fragment plus weighted shortfall (milli-GPU)."""
        t = self.tables()
        groups = _groups(w)
        level = t.level(w.free_cpu)
        free = sum(sum(f) for f in groups.values())
        frag = sum(t.frag(m, level, f) for m, f in groups.items())
        return frag + self.shortfall_weight * t.shortfall(free, w.free_cpu, w.free_host_mem)

    def __call__(self, need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
        if self.feeds:
            self.mix.observe(need)
        t = self.tables()
        frag = t.frag
        level_of = t.level
        beta = self.shortfall_weight
        short = t.shortfall
        gpu = needs_gpu(need)
        cpu = need.cpu_milli
        host_mem = need.host_mem
        count = need.gpu_count
        milli = MILLI_PER_GPU if need.exclusive else need.milli_per_gpu
        whole = need.gpus > 0 or need.exclusive
        typed = need.models is not None or need.min_cc is not None
        taken = (MILLI_PER_GPU * count if whole else milli) if gpu else 0
        dedupe = need.mem == 0  # equal states score equal: the first of them wins anyway
        seen: set[tuple[object, ...]] = set()
        best_w: WorkerRecord | None = None
        best_gpus: list[int] = []
        best = best_fit_left = 0.0

        def better(delta: float, left: float) -> bool:
            if best_w is None or delta < best - _EPS:
                return True
            return delta <= best + _EPS and left < best_fit_left

        for w in workers:
            free_cpu = w.cpu_milli - w.granted_cpu
            free_mem = w.host_mem - w.granted_host_mem
            if free_cpu < cpu or free_mem < host_mem:
                continue
            if not w.has_slot or (avoid and w.name in avoid):
                continue
            lb = level_of(free_cpu)
            la = level_of(free_cpu - cpu)
            model = self._single_model(w)
            if model is not None:
                # One model on the worker (the common case): no grouping needed.
                if gpu and typed and not need.fits_type(w.gpus[0].info):
                    continue
                free: list[int] = []
                for g in w.gpus:
                    used = g.granted_milli
                    if used < MILLI_PER_GPU and not (g.cordoned or g.exclusive or g.state.health == "failed"):
                        free.append(MILLI_PER_GPU - used)
                free.sort()
                state = tuple(free)
                if dedupe:
                    key = (model, free_cpu, free_mem, state)
                    if key in seen:
                        continue
                    seen.add(key)
                total = sum(state)
                before = frag(model, lb, state)
                after_short = 0.0
                if beta:
                    before += beta * short(total, free_cpu, free_mem)
                    after_short = beta * short(total - taken, free_cpu - cpu, free_mem - host_mem)
                left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
                if not gpu:
                    delta = frag(model, la, state) + after_short - before
                    if better(delta, left):
                        best_w, best_gpus, best, best_fit_left = w, [], delta, left
                    continue
                cand = self._candidates(need, w, milli, whole, count, typed)
                if cand is None:
                    continue
                if whole:
                    after = list(state)
                    for gi in cand:
                        after.remove(MILLI_PER_GPU - w.gpus[gi].granted_milli)
                    delta = frag(model, la, tuple(after)) + after_short - before
                    if better(delta, left):
                        best_w, best_gpus, best, best_fit_left = w, cand, delta, left
                    continue
                tried: set[int] = set()
                for gi in cand:
                    f = MILLI_PER_GPU - w.gpus[gi].granted_milli
                    if f in tried:
                        continue
                    tried.add(f)
                    after = list(state)
                    after.remove(f)
                    if f > milli:
                        after.append(f - milli)
                        after.sort()
                    delta = frag(model, la, tuple(after)) + after_short - before
                    if better(delta, left):
                        best_w, best_gpus, best, best_fit_left = w, [gi], delta, left
                continue
            # GPUs of several models on one worker: each model's GPUs are judged as one group.
            groups = _groups(w)
            total = sum(sum(f) for f in groups.values())
            before = sum(frag(m, lb, f) for m, f in groups.items())
            after_short = 0.0
            if beta:
                before += beta * short(total, free_cpu, free_mem)
                after_short = beta * short(total - taken, free_cpu - cpu, free_mem - host_mem)
            left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
            if not gpu:
                delta = sum(frag(m, la, f) for m, f in groups.items()) + after_short - before
                if better(delta, left):
                    best_w, best_gpus, best, best_fit_left = w, [], delta, left
                continue
            cand = self._candidates(need, w, milli, whole, count, typed)
            if cand is None:
                continue
            options = [cand] if whole else [[gi] for gi in cand]
            for option in options:
                after_groups = {m: list(f) for m, f in groups.items()}
                for gi in option:
                    g = w.gpus[gi]
                    f = MILLI_PER_GPU - g.granted_milli
                    lst = after_groups[g.info.model]
                    lst.remove(f)
                    if not whole and f > milli:
                        lst.append(f - milli)
                delta = sum(frag(m, la, tuple(sorted(f))) for m, f in after_groups.items()) + after_short - before
                if better(delta, left):
                    best_w, best_gpus, best, best_fit_left = w, option, delta, left
        if best_w is None:
            return None
        return Placement(best_w, [best_w.gpus[i] for i in best_gpus])

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
    "fgd-classic": lambda seed, mix: FragmentationGradientDescent(mix, shortfall_weight=0.0),
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
    "DEFAULT_SHORTFALL_WEIGHT",
    "FACTORIES",
    "POLICIES",
    "FragmentationGradientDescent",
    "Placement",
    "Policy",
    "PolicyFactory",
    "RandomFit",
    "balanced",
    "balanced_score",
    "best_fit",
    "could_ever_fit",
    "feasible_gpus",
    "make_policy",
    "needs_gpu",
    "spread",
    "worker_can_take",
]
