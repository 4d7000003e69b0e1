"""fgd's decisions are those of its implementation before its hot path was made cheaper.

``_OldFGD`` and ``_OldMix`` hold the code as it was (commit a8e6db6), verbatim: the oracle. Over
seeded random clusters and request streams (shares, echoes, whole GPUs, exclusive shares, CPU-only
work, models, compute capability, GPU and host memory, avoided workers, live measurements, failed
and cordoned GPUs, draining workers, workers leaving and joining, grants released), every policy of
the fgd family must choose exactly the same worker and GPUs as the oracle at every step, and the
task mix must hold exactly the same numbers.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Collection, Sequence

import pytest

from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import MILLI_PER_GPU, GpuInfo, GpuState, Grant, Need
from gpud_broker import ledger
from gpud_broker.mix import _RESCALE_AT, NeedClass, TaskMix
from gpud_broker.policies import (
    _EPS,
    BEST_FIT_CPU_SCALE,
    BEST_FIT_GPU_SCALE,
    SAMPLE_K,
    FragmentationGradientDescent,
    Placement,
    _cpu_load,
    _groups,
    balanced_score,
    needs_gpu,
)
from gpud_broker.registry import GpuRecord, WorkerRecord, WorkerRegistry

GiB = 1 << 30


class _OldFGD(FragmentationGradientDescent):
    """The oracle: ``_decide`` as it was."""

    def _decide(self, need: Need, workers: Sequence[WorkerRecord], avoid: Collection[str]) -> Placement | None:
        t = self.tables()
        frag = t.frag
        levels = t.levels
        beta = self.shortfall_weight
        gamma = self.pressure_weight
        pressure = self.pressure
        stranded = t.stranded
        static = self._static
        gpu = needs_gpu(need)
        cpu = need.cpu_milli
        host_mem = need.host_mem
        count = need.gpu_count
        milli = MILLI_PER_GPU if need.exclusive else need.milli_per_gpu
        whole = need.gpus > 0 or need.exclusive
        typed = need.models is not None or need.min_cc is not None
        mem = need.mem
        exclusive = need.exclusive
        taken = (MILLI_PER_GPU * count if whole else milli) if gpu else 0
        # Equal states score equal, so the first of them wins anyway (unless live load decides).
        dedupe = need.mem == 0 and not self.balance
        seen: set[tuple[object, ...]] = set()
        best = math.inf
        near: list[tuple[float, float, WorkerRecord, list[int]]] = []  # as good as the best so far

        def offer(delta: float, left: float, w: WorkerRecord, option: list[int]) -> None:
            nonlocal best
            if delta <= best + _EPS:
                near.append((delta, left, w, option))
                if delta < best:
                    best = delta

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
            la = bisect_right(levels, free_cpu - cpu)
            if model is not None:
                # One model on the worker (the common case): no grouping, one pass over its GPUs.
                if gpu and typed and not need.fits_type(w.gpus[0].info):
                    continue
                free: list[int] = []
                fit: list[tuple[int, int]] = []  # (index, free share) of the GPUs the need may take
                i = -1
                for g in w.gpus:
                    i += 1
                    used = g.granted_milli
                    if used >= MILLI_PER_GPU or g.cordoned or g.exclusive or g.state.health == "failed":
                        continue
                    f = MILLI_PER_GPU - used
                    free.append(f)
                    if f < milli or (mem and g.info.mem - g.granted_mem < mem) or (exclusive and g.tasks):
                        continue
                    if typed and not need.fits_type(g.info):
                        continue
                    fit.append((i, f))
                if gpu and len(fit) < count:
                    continue
                free.sort()
                state = tuple(free)
                if dedupe:
                    key = (model, free_cpu, free_mem, state)
                    if key in seen:
                        continue
                    seen.add(key)
                total = sum(state)
                before = frag(model, lb, state)
                cost = 0.0
                if beta:
                    before += beta * stranded(total, free_cpu, free_mem)
                    cost = beta * stranded(total - taken, free_cpu - cpu, free_mem - host_mem)
                if gamma and gpu:
                    cost += gamma * pressure.get(model, 0.0) * taken
                cost -= before
                left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
                if not gpu:
                    delta = frag(model, la, state) + cost
                    if delta <= best + _EPS:
                        near.append((delta, left, w, []))
                        best = min(best, delta)
                    continue
                if whole:
                    after = list(state)
                    for _, f in fit[:count]:
                        after.remove(f)
                    delta = frag(model, la, tuple(after)) + cost
                    if delta <= best + _EPS:
                        near.append((delta, left, w, [gi for gi, _ in fit[:count]]))
                        best = min(best, delta)
                    continue
                tried: set[int] = set()
                for gi, f in fit:
                    if f in tried:
                        continue
                    tried.add(f)
                    after = list(state)
                    after.remove(f)
                    if f > milli:
                        after.append(f - milli)
                        after.sort()
                    delta = frag(model, la, tuple(after)) + cost
                    if delta <= best + _EPS:
                        near.append((delta, left, w, [gi]))
                        best = min(best, delta)
                continue
            # GPUs of several models on one worker: each model's GPUs are judged as one group.
            groups = _groups(w)
            total = sum(sum(f) for f in groups.values())
            before = sum(frag(m, lb, f) for m, f in groups.items())
            after_short = 0.0
            if beta:
                before += beta * stranded(total, free_cpu, free_mem)
                after_short = beta * stranded(total - taken, free_cpu - cpu, free_mem - host_mem)
            left = (free_cpu - cpu) / (2 * BEST_FIT_CPU_SCALE) + (total - taken) / (2 * BEST_FIT_GPU_SCALE)
            if not gpu:
                delta = sum(frag(m, la, f) for m, f in groups.items()) + after_short - before
                offer(delta, left, w, [])
                continue
            cand = self._candidates(need, w, milli, whole, count, typed)
            if cand is None:
                continue
            options = [cand] if whole else [[gi] for gi in cand]
            for option in options:
                after_groups = {m: list(f) for m, f in groups.items()}
                cost = after_short
                for gi in option:
                    g = w.gpus[gi]
                    f = MILLI_PER_GPU - g.granted_milli
                    lst = after_groups[g.info.model]
                    lst.remove(f)
                    if not whole and f > milli:
                        lst.append(f - milli)
                    if gamma:
                        cost += gamma * pressure.get(g.info.model, 0.0) * (MILLI_PER_GPU if whole else milli)
                delta = sum(frag(m, la, tuple(sorted(f))) for m, f in after_groups.items()) + cost - before
                offer(delta, left, w, option)
        if not near:
            return None
        limit = best + _EPS
        pool = [c for c in near if c[0] <= limit]
        if self.balance:
            # Equally good for packing: the least loaded by live state, then as Best-fit would.
            _, _, best_w, best_gpus = min(pool, key=lambda c: (_live_load(c[2], c[3], need), c[1]))
        else:
            _, _, best_w, best_gpus = min(pool, key=lambda c: c[1])
        chosen = [best_w.gpus[i] for i in best_gpus]
        self._supply_age += 1
        supply = self.supply
        for g in chosen:
            m = g.info.model
            if m in supply:
                supply[m] -= MILLI_PER_GPU if whole else milli
        return Placement(best_w, chosen)


def _live_load(w: WorkerRecord, option: list[int], need: Need) -> float:
    """Live load of a placement: the most loaded of its GPUs (``balanced_score``: ledger,
    measurements, grants the last heartbeat cannot show yet), or the worker's CPU for a need
    without GPU; plus the worker's dispatched requests not yet answered."""
    if not option:
        return _cpu_load(w) + 0.001 * w.inflight
    gpus = w.gpus
    return max(balanced_score(gpus[i], need) for i in option) + 0.001 * w.inflight


class _OldMix(TaskMix):
    """The oracle: ``observe`` as it was."""

    def observe(self, need: Need) -> NeedClass:
        """Count one arriving request; returns its class."""
        cls = NeedClass.of(need, self.cpu_step)
        w = self._weights
        inc = self._inc
        if cls in w:
            w[cls] += inc
        else:
            w[cls] = inc
            if len(w) > self.max_classes:
                # The lightest of the others goes (the newcomer would always be the lightest).
                lightest = min((k for k in w if k != cls), key=w.__getitem__)
                self._total -= w.pop(lightest)
        self._total += inc
        if cls.milli:
            self._gpu += inc * need.total_milli
            self._cpu += inc * need.cpu_milli
            self._mem += inc * need.host_mem
        self._inc = inc * self.growth
        if self._inc > _RESCALE_AT:
            scale = 1.0 / self._inc
            for k in w:
                w[k] *= scale
            self._total *= scale
            self._gpu *= scale
            self._cpu *= scale
            self._mem *= scale
            self._inc = 1.0
        self.observations += 1
        self._since_check += 1
        return cls


MODELS = {"A100": (8, 0), "T4": (7, 5), "V100": (7, 0)}


def _cluster(rng: random.Random, workers: int) -> WorkerRegistry:
    reg = WorkerRegistry()
    for i in range(workers):
        _join(reg, rng, f"w{i}")
    return reg


def _join(reg: WorkerRegistry, rng: random.Random, name: str) -> WorkerRecord:
    count = rng.choice([1, 2, 4, 4, 8])
    if rng.random() < 0.2:  # GPUs of several models on one worker
        models = [rng.choice(list(MODELS)) for _ in range(count)]
    else:
        models = [rng.choice(list(MODELS))] * count
    mems = [rng.choice([16, 40, 80]) * GiB] * count if rng.random() < 0.8 else [rng.choice([16, 80]) * GiB for _ in range(count)]
    gpus = [GpuInfo(f"{name}-{j}", j, m, mems[j], MODELS[m]) for j, m in enumerate(models)]
    return reg.add(name=name, identity=name.encode(), hostname=name, gpus=gpus,
                   cpu_milli=rng.choice([4000, 8000, 16000, 64000]), host_mem=rng.choice([32, 256]) * GiB,
                   slots=rng.choice([2, 8, 64]), policy=HeartbeatPolicy(), now=0.0)


def _need(rng: random.Random) -> Need:
    cpu = rng.choice([0, 0, 0, 500, 1000, 2000, 3500, 6000])
    host_mem = rng.choice([0, 0, GiB, 16 * GiB])
    kind = rng.choice(["echo", "echo", "share", "share", "share", "whole", "multi", "cpu", "exclusive"])
    if kind == "echo":
        return Need(gpu_milli=1)
    if kind == "cpu":
        return Need(gpu_milli=0, cpu_milli=cpu or 1000, host_mem=host_mem)
    typed = {
        "models": rng.choice([None, None, None, frozenset({"A100"}), frozenset({"T4", "V100"})]),
        "min_cc": rng.choice([None, None, None, (7, 5)]),
        "mem": rng.choice([0, 0, 0, 8 * GiB, 30 * GiB]),
    }
    if kind == "share":
        return Need(gpu_milli=rng.choice([1, 100, 250, 300, 500, 700, 1000]), cpu_milli=cpu, host_mem=host_mem, **typed)
    if kind == "exclusive":
        return Need(gpu_milli=rng.choice([100, 500]), exclusive=True, cpu_milli=cpu, **typed)
    return Need(gpus=1 if kind == "whole" else rng.choice([2, 3, 4]), cpu_milli=cpu, host_mem=host_mem, **typed)


def _shaken(reg: WorkerRegistry, rng: random.Random, live: list[tuple[WorkerRecord, list[GpuRecord], Grant]]) -> None:
    """What happens between two requests: grants end, heartbeats, cordons, drains, workers leave and join."""
    while live and (rng.random() < 0.3 or len(live) > 150):
        w, gpus, g = live.pop(rng.randrange(len(live)))
        if w.pos >= 0:
            ledger.release(w, gpus, g)
    workers = reg.workers
    r = rng.random()
    w = workers[rng.randrange(len(workers))]
    if r < 0.08:
        health = rng.choice(["ok"] * 12 + ["degraded", "failed"])
        reg.update_state(w, {g.uuid: GpuState(util=rng.choice([0.0, 0.0, 35.0, 90.0]), mem_used=rng.choice([0, 4 * GiB]),
                                              health=health if rng.random() < 0.3 else "ok") for g in w.gpus})
    elif r < 0.10:
        g = w.gpus[rng.randrange(len(w.gpus))]
        g.cordoned = not g.cordoned
    elif r < 0.12:
        w.draining = not w.draining
    elif r < 0.20:
        w.inflight = rng.randrange(w.slots + 1)
    elif r < 0.21:
        reg.remove(w)
        live[:] = [x for x in live if x[0] is not w]
        _join(reg, rng, f"{w.name}'")


POLICIES = {
    "fgd": {},
    "fgd-classic": {"shortfall_weight": 0.0, "pressure_weight": 0.0},
    "fgd-balanced": {"balance": True, "sample": SAMPLE_K},
}


@pytest.mark.parametrize(("policy", "workers", "steps"), [
    ("fgd", 12, 2500), ("fgd-classic", 12, 1500), ("fgd-balanced", 12, 2500), ("fgd-balanced", 90, 1500),
    ("fgd", 3, 1500), ("fgd-balanced", 1, 1500),
])
def test_fgd_decides_as_before(policy: str, workers: int, steps: int) -> None:
    rng = random.Random(f"{policy}/{workers}")
    reg = _cluster(rng, workers)
    mix = TaskMix()
    kw = POLICIES[policy]
    new = FragmentationGradientDescent(mix, seed=7, **kw)  # type: ignore[arg-type]
    old = _OldFGD(mix, seed=7, **kw)  # type: ignore[arg-type]
    needs = [_need(rng) for _ in range(40)]  # the broker sees the same few needs (NeedCache) ...
    live: list[tuple[WorkerRecord, list[GpuRecord], Grant]] = []
    placed = 0
    for step in range(steps):
        _shaken(reg, rng, live)
        need = rng.choice(needs) if rng.random() < 0.8 else _need(rng)  # ... and new ones
        mix.observe(need)
        avoid = set(rng.sample([w.name for w in reg.workers], min(2, len(reg.workers)))) if rng.random() < 0.1 else ()
        got = new(need, reg.by_identity.values(), avoid)
        want = old(need, reg.by_identity.values(), avoid)
        assert (got is None) == (want is None), step
        if got is None or want is None:
            continue
        assert got.worker is want.worker and [g.info.index for g in got.gpus] == [g.info.index for g in want.gpus], step
        assert new.supply == old.supply and new.pressure == old.pressure, step
        live.append((got.worker, got.gpus, ledger.grant(got.worker, got.gpus, need)))
        placed += 1
    assert placed > steps // 5  # the stream placed work, not only refusals


def test_mix_counts_as_before() -> None:
    """Few classes kept (the lightest forgotten), a short half-life (the weights rescaled often)."""
    rng = random.Random(3)
    needs = [_need(rng) for _ in range(30)]
    new, old = TaskMix(half_life=1, max_classes=6, check_every=3), _OldMix(half_life=1, max_classes=6, check_every=3)
    for _ in range(3000):
        need = rng.choice(needs) if rng.random() < 0.7 else _need(rng)
        assert new.observe(need) == old.observe(need)
        assert list(new.items()) == list(old.items())
        assert (new._total, new._gpu, new._cpu, new._mem, new._inc) == (old._total, old._gpu, old._cpu, old._mem, old._inc)
        assert new.snapshot() == old.snapshot()
    assert new.snapshot().version > 10 and math.isfinite(new._inc)
