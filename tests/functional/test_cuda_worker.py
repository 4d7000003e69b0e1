"""A worker on a FAKE real GPU: ``gpud worker`` without ``--simulate`` takes the real-GPU path
(NVML inventory, ``gpud_worker.cuda`` devices, sessions through the pycuda backend), with FAKE
``pynvml``, ``pycuda.driver`` and nvcc put in its process by tests/functional/fake_gpu (nothing
talks to a GPU). This checks the wiring that tests/gpu checks on a real GPU: the worker choosing
the backend, the ``load`` CALL, the loss of a session after a sticky CUDA error as the broker and
the client library see it, the idle reclaim."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpud.errors import InvalidRequest, RemoteError, SessionLost
from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client
from tests.waiting import wait_for

F32 = np.float32
FAKE = Path(__file__).resolve().parent / "fake_gpu"

USER = """
__global__ void scale(float* x, float a, int n) {}
__global__ void wild_write(float* x) {}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {
        "GPUD_TEST_FAKE_GPU": "1",
        "PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]),
        "GPUD_NVCC": str(FAKE / "nvcc"),
        "GPUD_MODULE_CACHE": str(tmp_path_factory.mktemp("modules")),
    }
    with LocalCluster(workers=1, simulate=False, env=env, heartbeat_ms=200, liveness=5,
                      worker_args=["--session-idle", "1.5"]) as c:
        yield c


def test_the_worker_serves_the_gpu_through_pycuda(cluster: LocalCluster) -> None:
    gpu = cluster.status()["gpus"][0]
    assert gpu["model"] == "FAKE-H200" and gpu["simulated"] is False
    with Client(cluster.frontend, timeout=30) as client, client.session(mem=1 << 20) as s:
        assert s.device_info()["simulated"] is False
        x = np.arange(64, dtype=F32)
        px, py = s.mem_alloc(x.nbytes), s.mem_alloc(x.nbytes)
        s.memcpy_htod(px, x)
        s.memcpy_htod(py, np.ones(64, F32))
        s.launch(BUILTIN, "saxpy", 1, 64, [F32(2), px, py, np.int32(64)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(py), F32), 2 * x + 1)
        mod = s.module_load(USER)
        assert s.modules[mod] == ["scale", "wild_write"]
        s.launch(mod, "scale", 1, 64, [px, F32(3), np.int32(64)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(px), F32), 3 * x)
        with pytest.raises(InvalidRequest, match=r"argument 1 \(float a\) must be f32, got f64"):
            s.launch(mod, "scale", 1, 64, [px, np.float64(3), np.int32(64)])
        with pytest.raises(RemoteError, match=r"compile error.*\n.*kernel.cu\(2\): error"):
            s.module_load("__global__ void k(float* x)\n{ syntax error }\n", name="bad")
        with pytest.raises(RemoteError, match="illegal address"):  # a built-in's buffer too small
            s.launch(BUILTIN, "saxpy", 1, 64, [F32(2), px, py, np.int32(65)])
        assert s.replays == 0


def test_a_sticky_error_loses_the_session_and_the_client_replays_it(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30) as client, client.session(mem=1 << 20) as s, \
            client.session(mem=1 << 20) as other:
        x = np.arange(16, dtype=F32)
        p, q = s.mem_alloc(x.nbytes), other.mem_alloc(x.nbytes)
        s.memcpy_htod(p, x)
        other.memcpy_htod(q, x)
        mod = s.module_load(USER, name="user")
        first = s.id
        with pytest.raises(RemoteError, match="CUDA_ERROR_ILLEGAL_ADDRESS.*SESSION_LOST"):
            s.launch(mod, "wild_write", 1, 1, [p])
        # The next call gets SESSION_LOST; the client opens a new session, loads the module again,
        # copies the data again, and goes on.
        s.launch(mod, "scale", 1, 16, [p, F32(2), np.int32(16)])
        assert s.replays == 1 and s.id != first
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(p), F32), 2 * x)
        np.testing.assert_array_equal(np.frombuffer(other.memcpy_dtoh(q), F32), x)  # untouched
        assert other.replays == 0
        assert cluster.status()["counts"]["sessions"] == 2  # the lost one was ended by the broker
    with Client(cluster.frontend, timeout=30, journal_bytes=0) as client, client.session(mem=1 << 20) as s:
        p = s.mem_alloc(64)
        s.module_load(USER, name="user")
        with pytest.raises(RemoteError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            s.launch("user", "wild_write", 1, 1, [p])
        with pytest.raises(SessionLost, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            s.memcpy_dtoh(p)


def test_an_idle_session_is_reclaimed(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30, journal_bytes=0) as client:
        s = client.session(mem=1 << 20)
        p = s.mem_alloc(1 << 20)
        # Left idle past --session-idle 1.5: the broker ends it (its status shows none), untouched.
        wait_for(lambda: cluster.status()["counts"]["sessions"] == 0, what="the idle session reclaimed", timeout=3)
        with pytest.raises(SessionLost):
            s.memcpy_dtoh(p, 16)
        s.close()
