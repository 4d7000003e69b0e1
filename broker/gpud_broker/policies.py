"""Placement: filter then score. Policies are pure functions in an explicit name -> function table.

``worker_can_take`` (the worker's slots, CPU and memory) and ``feasible_gpus`` (health, cordon, type,
free share and memory, exclusivity) are the one filter every policy uses. A policy ranks what
passes and returns a ``Placement`` or None.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from gpud.resources import Need
from gpud_broker.registry import GpuRecord, WorkerRecord


@dataclass(frozen=True, slots=True)
class Placement:
    worker: WorkerRecord
    gpus: list[GpuRecord]


Policy = Callable[[Need, Iterable[WorkerRecord], Collection[str]], Placement | None]


def worker_can_take(need: Need, w: WorkerRecord) -> bool:
    return w.has_slot and w.free_cpu >= need.cpu_milli and w.free_host_mem >= need.host_mem


def feasible_gpus(need: Need, w: WorkerRecord) -> list[GpuRecord]:
    """GPUs of ``w`` that can take ``need`` now (for whole-GPU needs: fully free GPUs)."""
    milli = need.milli_per_gpu
    out = []
    for g in w.gpus:
        if not g.placeable or g.free_milli < milli or g.free_mem < need.mem:
            continue
        if need.exclusive and g.tasks:
            continue
        if need.models is not None or need.min_cc is not None:
            if not need.fits_type(g.info):
                continue
        out.append(g)
    return out


def could_ever_fit(need: Need, workers: Iterable[WorkerRecord]) -> bool:
    """Whether some connected worker could take ``need`` if it were idle."""
    for w in workers:
        if w.cpu_milli < need.cpu_milli or w.host_mem < need.host_mem:
            continue
        fitting = sum(1 for g in w.gpus if need.fits_type(g.info) and g.state.health != "failed")
        if fitting >= need.gpu_count:
            return True
    return False


def _place(
    need: Need,
    workers: Iterable[WorkerRecord],
    avoid: Collection[str],
    key: Callable[[GpuRecord, Need], float],
) -> Placement | None:
    """Pick the best-scoring (lowest ``key``) placement; ties go to the first seen."""
    best: Placement | None = None
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
        if count == 1:
            g = min(gpus, key=lambda r: key(r, need))
            score = key(g, need)
            chosen = [g]
        else:
            chosen = sorted(gpus, key=lambda r: key(r, need))[:count]
            score = sum(key(g, need) for g in chosen) / count
        if best is None or score < best_score:
            best, best_score = Placement(w, chosen), score
    return best


def balanced_score(g: GpuRecord, need: Need) -> float:
    """Load of a GPU as the ledger and the measurements see it, counting grants the last
    heartbeat could not yet show (so a burst does not herd onto the GPU that looked idlest)."""
    s = g.state
    ledger = g.granted_milli / 1000.0
    measured = s.util / 100.0 + g.milli_since_beat / 1000.0
    mem = g.info.mem or 1
    mem_frac = max(g.granted_mem, s.mem_used + g.mem_since_beat) / mem
    return max(ledger, measured, mem_frac) + 0.001 * g.tasks


def balanced(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Default: the least-loaded feasible GPU by ledger and live state."""
    return _place(need, workers, avoid, balanced_score)


def _left_after(g: GpuRecord, need: Need) -> float:
    return float(g.free_milli - need.milli_per_gpu) + g.free_mem / max(g.info.mem, 1) * 1e-3


def best_fit(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Pack: the feasible GPU with the least free share left after placement."""
    return _place(need, workers, avoid, _left_after)


def spread(need: Need, workers: Iterable[WorkerRecord], avoid: Collection[str] = ()) -> Placement | None:
    """Spread: the feasible GPU with the most free share (ledger only)."""
    return _place(need, workers, avoid, lambda g, n: -_left_after(g, n))


POLICIES: dict[str, Policy] = {
    "balanced": balanced,
    "best-fit": best_fit,
    "spread": spread,
}
