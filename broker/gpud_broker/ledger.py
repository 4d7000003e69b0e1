"""The grant ledger: what the broker has granted on each GPU and each worker, and its release.

Every grant and every release goes through ``grant()`` and ``release()``, so the numbers on the
registry's records always equal the sum of live grants. Pure.
"""

from __future__ import annotations

from gpud.resources import Grant, Need
from gpud_broker.registry import GpuRecord, WorkerRecord


class LedgerError(Exception):
    """A grant or release that would break the ledger's invariants (a bug, never user input)."""


def grant(worker: WorkerRecord, gpus: list[GpuRecord], need: Need, pool: bool = False) -> Grant:
    """Record a grant of ``need`` on ``gpus`` of ``worker`` and return it; with ``pool``, the work
    also holds one of the worker's pool users for ``need.tenant`` until it is released."""
    milli = need.milli_per_gpu
    for gpu in gpus:
        if gpu.worker is not worker:
            raise LedgerError(f"GPU {gpu.uuid} is not on worker {worker.name}")
        if gpu.free_milli < milli or gpu.free_mem < need.mem or gpu.exclusive:
            raise LedgerError(f"GPU {gpu.uuid} cannot take {milli} milli / {need.mem} bytes")
        if need.exclusive and gpu.tasks:
            raise LedgerError(f"GPU {gpu.uuid} is in use; no exclusive grant")
    if worker.free_cpu < need.cpu_milli or worker.free_host_mem < need.host_mem:
        raise LedgerError(f"worker {worker.name} lacks CPU or memory for the grant")
    made = Grant(
        worker=worker.name,
        gpus=tuple(gpu.uuid for gpu in gpus),
        gpu_milli=milli,
        mem=need.mem,
        cpu_milli=need.cpu_milli,
        host_mem=need.host_mem,
        exclusive=need.exclusive,
        pool_tenant=need.tenant if pool else "",
    )
    for gpu in gpus:
        gpu.milli_since_beat += milli
        gpu.mem_since_beat += need.mem
    restore(worker, gpus, made)
    return made


def _count_pool(worker: WorkerRecord, g: Grant, sign: int) -> None:
    """Count the pool user ``g`` holds (its ``pool_tenant``: callers call only for a grant with one)."""
    held = worker.pool_held.get(g.pool_tenant, 0) + sign
    if held > 0:
        worker.pool_held[g.pool_tenant] = held
    else:
        worker.pool_held.pop(g.pool_tenant, None)
    if worker.pool_index is not None:
        worker.pool_index.file(worker, g.pool_tenant)


def restore(worker: WorkerRecord, gpus: list[GpuRecord], g: Grant) -> None:
    """Record a grant made earlier (by the other broker of the pair, before a takeover) as it is:
    these are facts to account for, not requests to fit. ``grant()`` books its checked grants
    through it too."""
    for r in gpus:
        r.granted_milli += g.gpu_milli
        r.granted_mem += g.mem
        r.tasks += 1
        if g.exclusive:
            r.exclusive = True
    worker.granted_cpu += g.cpu_milli
    worker.granted_host_mem += g.host_mem
    worker.grants[id(g)] = g
    if g.pool_tenant:
        _count_pool(worker, g, 1)


def release(worker: WorkerRecord, gpus: list[GpuRecord], g: Grant) -> None:
    """Give back a grant made by ``grant()`` on the same records (exactly once)."""
    if worker.grants.pop(id(g), None) is not g:
        raise LedgerError(f"grant on {', '.join(g.gpus)} is not live on worker {worker.name}")
    if [rec.uuid for rec in gpus] != list(g.gpus):
        raise LedgerError(f"release names GPUs {[r.uuid for r in gpus]}, the grant {list(g.gpus)}")
    for rec in gpus:
        rec.granted_milli -= g.gpu_milli
        rec.granted_mem -= g.mem
        rec.tasks -= 1
        if g.exclusive:
            rec.exclusive = False
        if rec.granted_milli < 0 or rec.granted_mem < 0 or rec.tasks < 0:
            raise LedgerError(f"GPU {rec.uuid} released more than was granted")
    worker.granted_cpu -= g.cpu_milli
    worker.granted_host_mem -= g.host_mem
    if g.pool_tenant:
        _count_pool(worker, g, -1)


def clear(worker: WorkerRecord) -> None:
    """Forget every grant on ``worker``: its records and its GPUs' back to nothing granted."""
    worker.grants.clear()
    if worker.pool_index is not None:
        worker.pool_index.drop(worker)
    worker.pool_held.clear()
    worker.granted_cpu = worker.granted_host_mem = 0
    for g in worker.gpus:
        g.granted_milli = g.granted_mem = g.tasks = 0
        g.exclusive = False
