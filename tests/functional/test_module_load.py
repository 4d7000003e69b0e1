"""``Session.module_load`` end to end on SIMULATED GPUs (a broker and two workers as subprocesses):
the ``load`` CALL, launches through the loaded module, the errors, and replay of a lost session
that loads its modules again before its launches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpud.errors import InvalidRequest, RemoteError
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

F32 = np.float32

MINE = r"""
extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] = alpha * x[i] + y[i];
}
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=2, gpus_per_worker=1, heartbeat_ms=200, liveness=3) as c:
        yield c


def test_module_load_and_launch(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30) as client, client.session(mem=1 << 20) as s:
        name = s.module_load(MINE)
        assert name == "module1" and s.modules == {"module1": ["saxpy"]}
        assert s.module_load(MINE, name="again") == "again"
        x = np.arange(100, dtype=F32)
        px, py = s.mem_alloc(x.nbytes), s.mem_alloc(x.nbytes)
        s.memcpy_htod(px, x)
        s.memcpy_htod(py, np.ones(100, F32))
        s.launch(name, "saxpy", 1, 128, [F32(3), px, py, np.int32(100)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(py), F32), 3 * x + 1)
        with pytest.raises(RemoteError, match="SIMULATED GPU runs only the built-in kernels"):
            s.module_load("__global__ void mine(float* x) {}", name="foreign")
        with pytest.raises(RemoteError, match="SIMULATED GPU runs only the built-in kernels"):
            s.module_load(b"\x7fELF", name="bin", kind="cubin")
        with pytest.raises(InvalidRequest, match="already loaded"):
            s.module_load(MINE, name="again")
        with pytest.raises(InvalidRequest, match="not allowed"):
            s.module_load(MINE, name="opts", options=["-ccbin=/bin/sh"])
        with pytest.raises(InvalidRequest, match="kind"):
            s.module_load(MINE, kind="fortran")
        with pytest.raises(InvalidRequest, match=r"argument 0 \(alpha\) must be f32, got 'f64'"):
            s.launch(name, "saxpy", 1, 128, [np.float64(3), px, py, np.int32(100)])
        # The session goes on after every refusal.
        s.launch(name, "saxpy", 1, 128, [F32(1), px, py, np.int32(100)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(py), F32), 4 * x + 1)
        assert s.modules == {"module1": ["saxpy"], "again": ["saxpy"]}


def test_a_replayed_session_loads_its_modules_again(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30) as client:
        s = client.session(gpu_milli=500, mem=1 << 20)
        first = s.worker
        mod = s.module_load(MINE, name="mine")
        x = np.arange(64, dtype=F32)
        px, py = s.mem_alloc(x.nbytes), s.mem_alloc(x.nbytes)
        s.memcpy_htod(px, x)
        s.memcpy_htod(py, np.zeros(64, F32))
        s.launch(mod, "saxpy", 1, 64, [F32(2), px, py, np.int32(64)])
        assert [e.op for e in s.journal.entries()][:1] == ["load"]
        cluster.kill_worker(first)
        # The next call replays load, allocs, copies and the launch on a new worker, then runs.
        s.launch(mod, "saxpy", 1, 64, [F32(1), px, py, np.int32(64)])
        assert s.worker != first and s.replays == 1
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(py), F32), 3 * x)
        s.close()
