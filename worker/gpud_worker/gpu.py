"""GPU discovery and live GPU state for the worker.

This module owns what the worker announces on READY (``GpuProbe.inventory``) and the per-GPU state
its heartbeats carry (``GpuProbe.states``): ``NvmlProbe`` asks the NVIDIA driver through NVML
(package ``nvidia-ml-py``, imported lazily so that machines without it still run), and
``SimulatedProbe`` models the state of ``SimulatedDevice`` GPUs from the work running on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from gpud.errors import ConfigError
from gpud.resources import GpuInfo, GpuState
from gpud_worker.device import SimulatedDevice

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class GpuProbe(Protocol):
    """Where the worker learns which GPUs it has and what they are doing."""

    simulated: bool

    def inventory(self) -> list[GpuInfo]:
        """The GPUs, in index order. Static for the life of the probe."""
        ...

    def states(self) -> dict[str, GpuState]:
        """Current state of each GPU, by uuid."""
        ...

    def close(self) -> None:
        """Release the probe's resources. Idempotent."""
        ...


class NvmlProbe:
    """GPUs seen through NVML.

    Parameters
    ----------
    nvml:
        The NVML binding module; ``pynvml`` by default (given for tests).

    Raises
    ------
    ConfigError
        NVML cannot be loaded or initialized (no NVIDIA driver); see ``available()``.
    """

    simulated = False

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise ConfigError(f"NVML unavailable: {exc} (install nvidia-ml-py)") from None
            nvml = pynvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise ConfigError(f"NVML unavailable (no NVIDIA driver?): {exc}") from None
        self._open = True
        self._handles: dict[str, Any] | None = None
        self._lost: set[str] = set()

    @staticmethod
    def available() -> bool:
        """Whether NVML loads and initializes here. Never raises."""
        try:
            import pynvml
        except ImportError:
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            log.debug("NVML not available: %s", exc)
            return False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("NVML shutdown failed: %s", exc)
        return True

    def inventory(self) -> list[GpuInfo]:
        gpus, self._handles = self._discover()
        return gpus

    def _discover(self) -> tuple[list[GpuInfo], dict[str, Any]]:
        nv = self._nvml
        gpus: list[GpuInfo] = []
        handles: dict[str, Any] = {}
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
                model = _text(nv.nvmlDeviceGetName(handle))
                mem = int(nv.nvmlDeviceGetMemoryInfo(handle).total)
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
            except nv.NVMLError as exc:
                log.warning("GPU %d left out: NVML error %s", index, exc)
                continue
            handles[uuid] = handle
            gpus.append(GpuInfo(uuid, index, model, mem, (int(major), int(minor))))
        return gpus, handles

    def states(self) -> dict[str, GpuState]:
        if self._handles is None:
            self.inventory()
        handles = self._handles if self._handles is not None else {}
        return {uuid: self._state(uuid, h) for uuid, h in handles.items()}

    def _state(self, uuid: str, handle: Any) -> GpuState:
        nv = self._nvml
        lost = False

        def field(read: Callable[[], _T], default: _T) -> _T:
            nonlocal lost
            try:
                return read()
            except nv.NVMLError_GpuIsLost:
                lost = True
            except nv.NVMLError as exc:
                log.debug("GPU %s: NVML error %s", uuid, exc)
            return default

        util = field(lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu), 0.0)
        mem_used = field(lambda: int(nv.nvmlDeviceGetMemoryInfo(handle).used), 0)
        temp = field(
            lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)), 0.0
        )
        power = field(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0, 0.0)
        if lost and uuid not in self._lost:
            log.error("GPU %s is lost (NVML: GPU is lost)", uuid)
            self._lost.add(uuid)
        return GpuState(util, mem_used, temp, power, "failed" if lost else "ok")

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)


class SimulatedProbe:
    """State of simulated GPUs, modelled from the work running on each ``SimulatedDevice``.

    Utilization is the device's busy fraction; temperature and power rise linearly with it.
    """

    simulated = True

    def __init__(self, devices: Sequence[SimulatedDevice]) -> None:
        self.devices = list(devices)

    def inventory(self) -> list[GpuInfo]:
        return [d.gpu for d in self.devices]

    def states(self) -> dict[str, GpuState]:
        out: dict[str, GpuState] = {}
        for d in self.devices:
            busy = d.busy_fraction(d.clock.monotonic())
            out[d.gpu.uuid] = GpuState(
                util=100.0 * busy,
                mem_used=d.mem_used(),
                temp=30.0 + 50.0 * busy,
                power=50.0 + 250.0 * busy,
                health="ok",
            )
        return out

    def close(self) -> None:
        pass


def simulated_gpus(
    n: int,
    model: str = "SIM-GPU",
    mem: int = 16 << 30,
    cc: tuple[int, int] = (8, 0),
    worker_name: str = "w",
) -> list[GpuInfo]:
    """``n`` simulated GPUs with uuids ``SIM-<worker_name>-<index>``, unique per worker."""
    return [GpuInfo(f"SIM-{worker_name}-{i}", i, model, mem, cc, simulated=True) for i in range(n)]


def _text(v: str | bytes) -> str:
    """NVML strings are bytes in older bindings, str in newer ones."""
    return v.decode() if isinstance(v, bytes) else v
