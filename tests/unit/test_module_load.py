"""The ``load`` session op on the SIMULATED GPU, and load entries in the session journal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gpud.errors import InvalidRequest, RemoteError
from gpud.protocol import BUILTIN_MODULE
from gpud_client.journal import ENTRY_COST, Journal
from gpud_worker.device import SimulatedDevice, SimulatedSession
from gpud_worker.gpu import simulated_gpus
from gpud_worker.kernels import CUDA_SOURCE
from gpud_worker.nvcc import find_nvcc

F32 = np.float32
G1 = (1, 1, 1)

MINE = r"""
// My own saxpy and vector_add: on the SIMULATED GPU, the built-ins of those names run.
extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] = alpha * x[i] + y[i];
}
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, int n) {}
"""


@pytest.fixture
def dev() -> SimulatedDevice:
    return SimulatedDevice(simulated_gpus(1, mem=1 << 20)[0])


@pytest.fixture
def sess(dev: SimulatedDevice) -> SimulatedSession:
    return dev.open_session(1 << 16)


def put(s: SimulatedSession, arr: np.ndarray) -> int:
    h = s.alloc(arr.nbytes)
    s.htod(h, 0, arr)
    return h


def test_a_module_of_builtin_kernels_runs_them(sess: SimulatedSession) -> None:
    loaded = sess.load("cuda", "mine", MINE.encode())
    assert (loaded["module"], loaded["functions"]) == ("mine", ["saxpy", "vector_add"])
    assert loaded["compiled"] is (find_nvcc() is not None)
    x = np.arange(4, dtype=F32)
    hx, hy = put(sess, x), put(sess, np.ones(4, F32))
    sess.launch("mine", "saxpy", G1, (4, 1, 1), [("f32", 2.0), ("ptr", hx), ("ptr", hy), ("i32", 4)])
    np.testing.assert_array_equal(np.frombuffer(sess.dtoh(hy, 0), F32), 2 * x + 1)
    with pytest.raises(InvalidRequest, match="unknown kernel 'sgemm' in module 'mine'"):
        sess.launch("mine", "sgemm", G1, G1, [])  # a built-in, but not in this module
    with pytest.raises(InvalidRequest, match="takes 4 arguments"):
        sess.launch("mine", "saxpy", G1, G1, [("f32", 2.0)])
    # The whole built-in library as a module: the same kernels.
    assert sess.load("cuda", "lib", CUDA_SOURCE.encode())["functions"] == ["reduce_sum", "saxpy", "sgemm", "vector_add"]


@pytest.mark.parametrize(("kind", "data", "match"), [
    ("cuda", b"__global__ void mykernel(float* x) {}", r"runs only the built-in kernels .*declares mykernel\(float\* x\)"),
    ("cuda", b"__global__ void saxpy(double alpha, const float* x, float* y, int n) {}", r"declares saxpy\(double alpha"),
    ("cuda", b"int main() { return 0; }", "declares no __global__ kernel"),
    ("ptx", b".version 8.0\n.target sm_90\n", "cannot load a ptx module"),
    ("cubin", b"\x7fELF", "cannot load a cubin module"),
])
def test_anything_else_is_a_remote_error(sess: SimulatedSession, kind: str, data: bytes, match: str) -> None:
    with pytest.raises(RemoteError, match=match):
        sess.load(kind, "m", data)
    sess.load("cuda", "m", MINE.encode())  # the name stayed free; the session goes on


def test_load_arguments_and_names(dev: SimulatedDevice, sess: SimulatedSession) -> None:
    with pytest.raises(InvalidRequest, match="reserved"):
        sess.load("cuda", BUILTIN_MODULE, MINE.encode())
    with pytest.raises(InvalidRequest, match="not allowed"):
        sess.load("cuda", "m", MINE.encode(), ["-I/etc"])
    with pytest.raises(InvalidRequest, match="#include"):
        sess.load("cuda", "m", b'#include "/etc/passwd"\n' + MINE.encode())
    sess.load("cuda", "m", MINE.encode(), ["-O3"])
    with pytest.raises(InvalidRequest, match="already loaded"):
        sess.load("cuda", "m", MINE.encode())
    with pytest.raises(InvalidRequest, match="module 'other' unknown"):
        sess.launch("other", "saxpy", G1, G1, [])
    other = dev.open_session(1 << 16)
    with pytest.raises(InvalidRequest, match="module 'm' unknown"):  # modules are per session
        other.launch("m", "saxpy", G1, G1, [("f32", 1.0), ("ptr", 1), ("ptr", 1), ("i32", 0)])


# --------------------------------------------------------------------------- the journal


def test_journal_keeps_loads_through_compaction() -> None:
    j = Journal(1 << 20)
    src = MINE.encode()
    j.load("cuda", "mine", ["-O3"], src)
    assert j.nbytes == ENTRY_COST + len(src)
    j.alloc(1, 16)
    j.htod(1, 0, b"\0" * 16)
    j.launch("mine", "saxpy", [1], [4], [["f32", 2.0], ["ptr", 1], ["ptr", 1], ["i32", 4]], 0)
    j.free(1)  # used by a launch: kept... and then compacted away (nothing is live)
    j.compact()
    entries = j.entries()
    assert [e.op for e in entries] == ["load"]  # the load stays: launches to come may name it
    assert entries[0].args == {"kind": "cuda", "name": "mine", "options": ["-O3"]}
    assert entries[0].data == src
    assert j.nbytes == ENTRY_COST + len(src)
    j.alloc(2, 16)
    j.launch("mine", "saxpy", [1], [4], [["f32", 2.0], ["ptr", 2], ["ptr", 2], ["i32", 4]], 0)
    j.compact()
    assert [e.op for e in j.entries()] == ["load", "alloc", "launch"]  # in order: load first


def test_journal_load_past_the_bound_overflows() -> None:
    j = Journal(ENTRY_COST + 10)
    j.load("cuda", "m", [], b"x" * 11)
    assert j.overflowed and not j.usable and "bound" in (j.reason or "")
    j2 = Journal(2 * ENTRY_COST + 9)
    j2.load("cuda", "m", [], b"x" * 10)
    assert j2.usable and len(j2) == 1
    j2.alloc(1, 4)  # one more entry: past the bound, and compaction cannot drop the load
    assert j2.overflowed


BROKEN = r"""
extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n)
{
    y[i] = alpha * x[i] + undeclared;  // i and undeclared: not declared anywhere
}
"""
"""The built-in saxpy's name and parameters, and code that compiles nowhere."""

LOAD_BROKEN = f"""
import json
from gpud.errors import RemoteError
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import simulated_gpus
sess = SimulatedDevice(simulated_gpus(1, mem=1 << 20)[0]).open_session(1 << 16)
try:
    print(json.dumps(sess.load("cuda", "broken", {BROKEN!r}.encode())))
except RemoteError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""


@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc here")
def test_where_nvcc_is_here_a_source_that_does_not_compile_is_refused(sess: SimulatedSession) -> None:
    with pytest.raises(RemoteError, match=r"(?s)compile error.*\"undeclared\" is undefined"):
        sess.load("cuda", "broken", BROKEN.encode())
    with pytest.raises(InvalidRequest, match="module 'broken' unknown"):  # nothing was loaded
        sess.launch("broken", "saxpy", G1, G1, [("f32", 1.0), ("ptr", 0), ("ptr", 0), ("i32", 0)])


def test_without_nvcc_the_load_result_says_it_was_not_compiled() -> None:
    """A worker host without nvcc: a PATH without it, no CUDA_HOME, and (where this host has the
    toolkit in the default place) an empty directory mounted over it, in a mount namespace."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", LOAD_BROKEN]
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("nvcc in /usr/local/cuda, and no mount namespace to hide it in (needs root)")
        cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /usr/local/cuda/bin && exec "$@"', "sh", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["compiled"] is False and "not compiled" in result["note"] and "no nvcc" in result["note"]
    assert result["functions"] == ["saxpy"]
