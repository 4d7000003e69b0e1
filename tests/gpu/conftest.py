"""The GPU checks: every test here is marked ``gpu`` and skipped, with the reason, unless NVML finds
an NVIDIA GPU and pycuda imports (``make gpu-check`` installs it; docs/OPERATIONS.md, GPU check).

Fixtures start real daemons (gpud_cli.cluster.LocalCluster with ``simulate=False``): a broker and one
worker that serves the machine's real GPUs through pycuda.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _why_not() -> str | None:
    """Why the GPU checks cannot run here; None when they can."""
    try:
        import pynvml
    except ImportError as exc:
        return f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA driver: NVML cannot initialize ({exc})"
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return "NVML finds no GPU"
    finally:
        pynvml.nvmlShutdown()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pycuda.driver as drv

            drv.init()
    except Exception as exc:  # ImportError, or pycuda's own error when CUDA cannot start
        return f"pycuda is not importable or cannot start CUDA ({type(exc).__name__}: {exc}); `make gpu-check` installs it"
    return None


WHY_NOT = _why_not()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            # Third-party deprecations (NVML's and pycuda's bindings) must not fail a one-shot check.
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"))
            if WHY_NOT is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU check: {WHY_NOT}"))


@pytest.fixture(scope="session")
def gpus() -> list[Any]:
    """NVML's inventory of this machine (gpud_worker.gpu.NvmlProbe)."""
    from gpud_worker.gpu import NvmlProbe

    probe = NvmlProbe()
    try:
        return probe.inventory()
    finally:
        probe.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A broker and a worker on this machine's real GPUs."""
    from gpu_cluster import start_cluster

    c = start_cluster(tmp_path_factory.mktemp("gpu-cluster"), "--session-idle", "120")
    try:
        yield c
    finally:
        c.stop()
