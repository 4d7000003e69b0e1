"""The resource model: what a GPU is, what it is doing, what a request needs, what was granted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MILLI_PER_GPU = 1000


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A GPU as its worker announces it on READY. Static for the life of the connection."""

    uuid: str
    index: int
    model: str
    mem: int  # bytes
    cc: tuple[int, int]  # CUDA compute capability
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class GpuState:
    """A GPU's measured state, as the last heartbeat carried it."""

    util: float = 0.0  # percent, 0..100
    mem_used: int = 0  # bytes
    temp: float = 0.0  # degrees C
    power: float = 0.0  # watts
    health: str = "ok"  # ok | degraded | failed
    health_reason: str = ""  # why it is failed (its last fault: "xid 79", "lost"); empty when ok
    probation_left_s: float = 0.0  # failed but passing its checks again: seconds until it serves


@dataclass(frozen=True, slots=True)
class Need:
    """What one request asks for. ``gpus`` > 0 means whole GPUs; otherwise a share of one GPU."""

    gpu_milli: int = 1000
    gpus: int = 0
    mem: int = 0  # device bytes, per GPU
    cpu_milli: int = 0
    host_mem: int = 0
    models: frozenset[str] | None = None
    min_cc: tuple[int, int] | None = None
    exclusive: bool = False
    priority: int = 0
    tenant: str = "default"

    @property
    def gpu_count(self) -> int:
        return self.gpus if self.gpus else 1

    @property
    def milli_per_gpu(self) -> int:
        return MILLI_PER_GPU if self.gpus else self.gpu_milli

    @property
    def total_milli(self) -> int:
        return self.gpu_count * self.milli_per_gpu

    def fits_type(self, gpu: GpuInfo) -> bool:
        """Model and compute-capability filter (static properties only)."""
        if self.models is not None and gpu.model not in self.models:
            return False
        if self.min_cc is not None and gpu.cc < self.min_cc:
            return False
        return self.mem <= gpu.mem


class Grant(NamedTuple):
    """What the broker granted one request: GPUs on one worker and the share of each.

    Immutable, like the other records here; a NamedTuple rather than a frozen dataclass because
    one is made for every request the broker places (about 0.3 us against 1.1 us)."""

    worker: str
    gpus: tuple[str, ...]  # uuids
    gpu_milli: int  # per GPU
    mem: int  # device bytes per GPU
    cpu_milli: int = 0
    host_mem: int = 0
    exclusive: bool = False
    pool_tenant: str = ""  # the tenant whose work holds one of the worker's pool users; "": none


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may hold at once (None: no limit). Granted-resource limits make its
    requests wait in the queue; ``max_queued`` makes further requests BUSY."""

    max_milli: int | None = None  # milli-GPU granted at once, summed over its requests and sessions
    max_mem: int | None = None  # device bytes granted at once, summed over GPUs
    max_sessions: int | None = None  # open device sessions (including ones being opened)
    max_queued: int | None = None  # requests waiting in the queue

    def __post_init__(self) -> None:
        for name in ("max_milli", "max_mem", "max_sessions", "max_queued"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"tenant limit {name} must be an int >= 0, got {value!r}")

    def could_ever_admit(self, need: Need, session: bool) -> bool:
        """False when ``need`` alone is over a limit: it could never be granted to this tenant."""
        if self.max_milli is not None and need.total_milli > self.max_milli:
            return False
        if self.max_mem is not None and need.mem * need.gpu_count > self.max_mem:
            return False
        return not (session and self.max_sessions == 0)
