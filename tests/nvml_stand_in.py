"""SIMULATED NVML for the probe's tests: a stand-in for the ``pynvml`` module (no GPU, no driver)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class NvmlStandIn:
    """Two GPUs, handles 0 and 1, named ``GPU-0`` and ``GPU-1``; a GPU in ``lost`` fails its calls
    as lost. Its figures are the class attributes; a test's subclass adds what that test needs."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    name: str | bytes = "NVIDIA H200"
    mem = (141 << 30, 1 << 30)  # total, used
    cc = (9, 0)
    util = 42
    power_mw = 123_500

    def __init__(self) -> None:
        self.lost: set[int] = set()
        self.temp = [55, 55]

    def _check(self, h: int) -> None:
        if h in self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str | bytes:
        return f"GPU-{h}"

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check(h)
        total, used = self.mem
        return SimpleNamespace(total=total, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self.cc

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._check(h)
        return SimpleNamespace(gpu=self.util)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._check(h)
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.temp[h]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._check(h)
        return self.power_mw
