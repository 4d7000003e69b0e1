"""FAKE GPU for the daemons of tests/functional/test_cuda_worker.py. Nothing here talks to a GPU.

A process started with this directory on PYTHONPATH and ``GPUD_TEST_FAKE_GPU=1`` gets, before its
main module runs, a FAKE ``pynvml`` (one "GPU", FAKE-H200, 1 GiB) and a FAKE ``pycuda.driver``
(tests/fake_pycuda.py), so that ``gpud worker`` without ``--simulate`` takes the real-GPU path: NVML
inventory, ``gpud_worker.cuda`` devices, sessions through the pycuda backend. The compiler is the
FAKE nvcc beside this file (``GPUD_NVCC``). Without ``GPUD_TEST_FAKE_GPU`` it does nothing.
"""

from __future__ import annotations

import os
import sys
import types


def _fake_pycuda() -> types.ModuleType | None:
    """tests/fake_pycuda.py, where this process can import gpud (not in the FAKE nvcc's)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        import fake_pycuda
    except ImportError:
        return None
    return fake_pycuda


fake_pycuda = _fake_pycuda() if os.environ.get("GPUD_TEST_FAKE_GPU") == "1" else None
if fake_pycuda is not None:

    fake_pycuda.Device.bus_ids = ["0000:3B:00.0"]
    fake_pycuda.Device.total = 1 << 30

    pycuda = types.ModuleType("pycuda")
    pycuda.VERSION_TEXT = "FAKE"  # type: ignore[attr-defined]
    pycuda.driver = fake_pycuda  # type: ignore[attr-defined]
    sys.modules["pycuda"] = pycuda
    sys.modules["pycuda.driver"] = fake_pycuda

    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 - pynvml's name
        pass

    class _Info:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    UUID = "GPU-fa4e0000-0000-0000-0000-000000000001"
    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.NVMLError_GpuIsLost = NVMLError_GpuIsLost  # type: ignore[attr-defined]
    nvml.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: 0  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByUUID = lambda u: 0  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUUID = lambda h: UUID  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: "FAKE-H200"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: _Info(total=1 << 30, used=fake_pycuda.Device(0).used)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: _Info(gpu=0)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 40  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetPowerUsage = lambda h: 100_000  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetPciInfo = lambda h: _Info(busId="00000000:3B:00.0")  # type: ignore[attr-defined]
    sys.modules["pynvml"] = nvml
