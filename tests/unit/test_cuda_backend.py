"""The pycuda device backend (gpud_worker.cuda) without a GPU.

Here no GPU and no pycuda exist, so ``CudaDevice`` runs on a FAKE ``pycuda.driver``
(tests/fake_pycuda.py: host memory, Python kernels, pycuda's context and clean-up rules, pycuda's
error classes and messages) and a FAKE nvcc. That checks the backend's own logic: handles, the
memory grant, isolation between sessions, the module cache, argument checks, error mapping, the
loss of a session after a sticky CUDA error, one thread per context. What only a GPU can show
(nvcc, pycuda and CUDA themselves) is in tests/gpu/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpud.errors import InvalidRequest, OutOfMemory, RemoteError, SessionLost
from gpud.protocol import BUILTIN_MODULE
from gpud.resources import GpuInfo
from gpud_worker import cuda as C
from gpud_worker.modules import ModuleCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_pycuda as fake  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
F32 = np.float32
G1 = (1, 1, 1)
B256 = (256, 1, 1)
GPU = GpuInfo("GPU-00000000-1111-2222-3333-444444444444", 0, "FAKE H200", 1 << 20, (9, 0))

try:  # the real exception classes where pycuda imports (a GPU host), else the FAKE ones
    import pycuda.driver as _real_driver  # type: ignore[import-not-found]

    ERRORS: Any = _real_driver
except Exception:  # no pycuda, or no CUDA driver for it: FAKE classes, same names and messages
    ERRORS = fake


@pytest.fixture
def compiler() -> fake.FakeCompiler:
    return fake.FakeCompiler()


@pytest.fixture
def dev(tmp_path: Path, compiler: fake.FakeCompiler) -> Iterator[C.CudaDevice]:
    fake.reset()
    fake.Device.total = 1 << 20
    yield C.CudaDevice(GPU, 0, driver=fake, compiler=compiler, cache=ModuleCache(tmp_path / "cache"))  # type: ignore[arg-type]
    fake.reset()


@pytest.fixture
def sess(dev: C.CudaDevice) -> Iterator[C.CudaSession]:
    s = dev.open_session(1 << 16)
    yield s
    s.close()


def put(s: C.CudaSession, arr: np.ndarray) -> int:
    h = s.alloc(max(arr.nbytes, 1))
    s.htod(h, 0, arr)
    return h


def get(s: C.CudaSession, h: int, n: int) -> np.ndarray:
    return np.frombuffer(bytes(s.dtoh(h, 0, 4 * n)), F32)


# --------------------------------------------------------------------------- no pycuda on import


def test_importing_the_worker_never_imports_pycuda() -> None:
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'pycuda': raise ImportError('pycuda imported at import time')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import gpud_worker.cuda, gpud_worker.device, gpud_worker.modules, gpud_worker.kernels\n"
        "import gpud_worker.worker, gpud_worker.gpu, gpud_worker.__main__, gpud_cli.main\n"
        "assert not [m for m in sys.modules if m.startswith('pycuda')]\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in (".", "cli", "broker", "worker", "standby", "libclient")))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_pycuda_no_device_and_a_clear_reason() -> None:
    try:
        import pycuda.driver  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("pycuda imports here: this test is for hosts without it")
    devices, why = C.cuda_devices([GPU])
    assert devices == {} and ("pycuda is not installed" in why or "cannot initialize" in why)
    assert C.cuda_devices([]) == ({}, "")


# --------------------------------------------------------------------------- error mapping


@pytest.mark.parametrize(("cls", "text", "name", "sticky", "kind"), [
    ("LogicError", "cuCtxSynchronize failed: an illegal memory access was encountered", "CUDA_ERROR_ILLEGAL_ADDRESS", True, RemoteError),
    ("LaunchError", "cuCtxSynchronize failed: unspecified launch failure", "CUDA_ERROR_LAUNCH_FAILED", True, RemoteError),
    ("LogicError", "cuCtxSynchronize failed: device-side assert triggered", "CUDA_ERROR_ASSERT", True, RemoteError),
    ("LaunchError", "cuLaunchKernel failed: too many resources requested for launch", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", False, RemoteError),
    ("LogicError", "cuLaunchKernel failed: invalid argument", "CUDA_ERROR_INVALID_VALUE", False, RemoteError),
    ("MemoryError", "cuMemAlloc failed: out of memory", "CUDA_ERROR_OUT_OF_MEMORY", False, OutOfMemory),
    ("LogicError", "cuModuleLoadDataEx failed: device kernel image is invalid", "CUDA_ERROR_INVALID_IMAGE", False, RemoteError),
    ("Error", "cuSomething failed: a message nobody knows", "CUDA_ERROR_UNKNOWN_TEXT", False, RemoteError),
])
def test_map_cuda_error(cls: str, text: str, name: str, sticky: bool, kind: type) -> None:
    f = C.map_cuda_error(getattr(ERRORS, cls)(text), "kernel 'k' of module 'm'")
    assert f.name == name and f.sticky is sticky and type(f.error) is kind
    assert f.error.message.startswith(f"{name}: ")
    assert "kernel 'k' of module 'm'" in f.error.message
    assert ("SESSION_LOST" in f.error.message) is sticky


def test_map_cuda_error_keeps_the_jit_log() -> None:
    exc = ERRORS.LogicError("cuModuleLoadDataEx failed: a PTX JIT compilation failed - ptxas application ptx input, line 3; error   : Unknown symbol 'x'")
    f = C.map_cuda_error(exc, "loading module 'p'")
    assert f.name == "CUDA_ERROR_INVALID_PTX" and "Unknown symbol 'x'" in f.error.message


def test_driver_error_names_fall_back_without_libcuda() -> None:
    class NoLib:
        pass  # no cuGetErrorName: AttributeError, as a libcuda too old to have it

    names = C.driver_error_names(NoLib())
    assert names["an illegal memory access was encountered"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert names == C.FALLBACK_ERROR_NAMES


def test_sticky_errors_are_cuda_names() -> None:
    assert C.STICKY_ERRORS <= set(C.FALLBACK_ERROR_NAMES.values())


# --------------------------------------------------------------------------- memory


def test_copies_round_trip(sess: C.CudaSession) -> None:
    x = np.arange(100, dtype=F32)
    h = put(sess, x)
    np.testing.assert_array_equal(get(sess, h, 100), x)
    sess.htod(h, 8, np.array([7, 8], F32))
    assert list(get(sess, h, 4)) == [0, 1, 7, 8]
    assert bytes(sess.dtoh(h, 396)) == np.array([99], F32).tobytes()  # to the end
    assert bytes(sess.dtoh(h, 400, 0)) == b""
    sess.htod(h, 400, b"")
    with pytest.raises(InvalidRequest, match="outside"):
        sess.htod(h, 396, b"12345")
    with pytest.raises(InvalidRequest, match="outside"):
        sess.dtoh(h, 0, 401)


def test_memory_grant_enforced_on_real_allocations(dev: C.CudaDevice) -> None:
    s = dev.open_session(1000)
    try:
        a = s.alloc(600)
        with pytest.raises(OutOfMemory, match="grant"):
            s.alloc(401)
        assert fake.Device(0).used == 600  # the refused one never reached CUDA
        s.alloc(400)
        assert s.info()["mem_used"] == 1000 and dev.mem_used() == 1000
        s.free(a)
        assert s.info()["mem_used"] == 400 and fake.Device(0).used == 400
        with pytest.raises(InvalidRequest, match="unknown handle"):
            s.free(a)
    finally:
        s.close()
    assert dev.mem_used() == 0 and fake.Device(0).used == 0


def test_the_gpu_running_out_is_out_of_memory(dev: C.CudaDevice) -> None:
    fake.Device.total = 1000
    s = dev.open_session(1 << 20)
    try:
        s.alloc(900)
        with pytest.raises(OutOfMemory, match="CUDA_ERROR_OUT_OF_MEMORY"):
            s.alloc(200)
        s.alloc(100)  # the session goes on
    finally:
        s.close()


def test_sessions_are_isolated(dev: C.CudaDevice, compiler: fake.FakeCompiler) -> None:
    a, b = dev.open_session(1 << 16), dev.open_session(1 << 16)
    try:
        ha = put(a, np.ones(4, F32))
        assert ha == 1
        with pytest.raises(InvalidRequest, match="unknown handle"):
            b.dtoh(ha, 0, 4)  # b has no handle 1: a's allocation cannot be named from b
        hb = put(b, np.full(4, 2, F32))
        assert hb == 1  # handles are per session: b's 1 is b's own allocation
        assert list(get(a, ha, 4)) == [1] * 4 and list(get(b, hb, 4)) == [2] * 4
        a.load("cuda", "mine", b"__global__ void scale(float* x, float a, int n) {}")
        with pytest.raises(InvalidRequest, match="module 'mine' unknown"):
            b.launch("mine", "scale", G1, G1, [("ptr", hb), ("f32", 2.0), ("i32", 4)])
        assert len({id(c) for c in fake.CONTEXTS}) == 2  # one context per session
    finally:
        a.close()
        b.close()


def test_closed_session(dev: C.CudaDevice) -> None:
    s = dev.open_session(1 << 16)
    put(s, np.ones(4, F32))
    ctx = fake.CONTEXTS[-1]
    s.close()
    s.close()  # idempotent
    assert not ctx.valid and fake.Device(0).used == 0
    for call in (lambda: s.alloc(4), lambda: s.info(), lambda: s.sync(), lambda: s.dtoh(1, 0, 4)):
        with pytest.raises(SessionLost):
            call()


def test_each_context_lives_in_one_thread_of_its_own(dev: C.CudaDevice) -> None:
    """The context is made, used and destroyed by the session's own thread, whatever thread calls;
    no context stays current in any thread between calls (the FAKE asserts pycuda's rules)."""
    s = dev.open_session(1 << 16)
    s.sync()  # the context exists once a call has run
    ctx = fake.CONTEXTS[-1]
    assert ctx.thread != threading.get_ident()
    errors: list[BaseException] = []

    def use() -> None:
        try:
            h = put(s, np.arange(8, dtype=F32))
            s.launch(BUILTIN_MODULE, "saxpy", G1, B256, [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 8)])
            assert list(get(s, h, 2)) == [0, 2]
            assert not fake._stack()  # nothing pushed in the calling thread
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s.close()
    assert not ctx.valid


# --------------------------------------------------------------------------- built-in kernels


def test_builtins_match_numpy(sess: C.CudaSession) -> None:
    rng = np.random.default_rng(3)
    n = 1000
    a, b, y = (rng.standard_normal(n).astype(F32) for _ in range(3))
    ha, hb, hy, hout = put(sess, a), put(sess, b), put(sess, y), sess.alloc(4 * n)
    sess.launch(BUILTIN_MODULE, "vector_add", (4, 1, 1), B256, [("ptr", ha), ("ptr", hb), ("ptr", hout), ("i32", n)])
    np.testing.assert_array_equal(get(sess, hout, n), a + b)
    sess.launch(BUILTIN_MODULE, "saxpy", (4, 1, 1), B256, [("f32", 2.5), ("ptr", ha), ("ptr", hy), ("i32", n)])
    np.testing.assert_array_equal(get(sess, hy, n), F32(2.5) * a + y)
    m, k, nn = 5, 7, 3
    A, B = rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, nn)).astype(F32)
    hA, hB, hC = put(sess, A), put(sess, B), sess.alloc(4 * m * nn)
    sess.launch(BUILTIN_MODULE, "sgemm", (2, 1, 1), (64, 1, 1), [("ptr", hA), ("ptr", hB), ("ptr", hC), ("i32", m), ("i32", nn), ("i32", k)])
    np.testing.assert_allclose(get(sess, hC, m * nn).reshape(m, nn), A @ B, rtol=1e-5)
    hs = sess.alloc(4)
    sess.launch(BUILTIN_MODULE, "reduce_sum", G1, B256, [("ptr", ha), ("ptr", hs), ("i32", n)])
    np.testing.assert_allclose(get(sess, hs, 1)[0], a.astype(np.float64).sum(), rtol=1e-5)
    sess.sync()


def test_builtin_checks_before_launch(sess: C.CudaSession) -> None:
    h = put(sess, np.ones(8, F32))
    runs = len(fake.CALLS)
    with pytest.raises(InvalidRequest, match="takes 4 arguments"):
        sess.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", h), ("ptr", h)])
    with pytest.raises(InvalidRequest, match="must be i32"):
        sess.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", h), ("ptr", h), ("i64", 8)])
    with pytest.raises(InvalidRequest, match="unknown handle 9"):
        sess.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", h), ("ptr", 9), ("i32", 8)])
    with pytest.raises(InvalidRequest, match="unknown kernel"):
        sess.launch(BUILTIN_MODULE, "nope", G1, G1, [])
    with pytest.raises(InvalidRequest, match="threads"):
        sess.launch(BUILTIN_MODULE, "saxpy", G1, (1025, 1, 1), [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 8)])
    # A buffer too small for the sizes passed: "illegal address" before anything runs, as on the
    # simulated GPU, and the session goes on.
    with pytest.raises(RemoteError, match="illegal address"):
        sess.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 9)])
    assert len(fake.CALLS) == runs  # none of them launched
    sess.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 8)])
    assert list(get(sess, h, 8)) == [2] * 8


# --------------------------------------------------------------------------- modules


USER = r"""
// scale x[0..n) by a
__global__ void scale(float* x, float a, int n) { /* ... */ }
__global__ void wild_write(float* x) { x[1 << 30] = 1; }
"""


def test_user_module_load_and_launch(sess: C.CudaSession, compiler: fake.FakeCompiler) -> None:
    out = sess.load("cuda", "user", USER.encode(), ["-O3"])
    assert out == {"module": "user", "functions": ["scale", "wild_write"]}
    source, arch, options = compiler.compiled[-1]
    assert arch == "sm_90" and options == ("-O3",)
    assert source.startswith('extern "C" {')  # plain names, as pycuda's SourceModule
    h = put(sess, np.arange(4, dtype=F32))
    sess.launch("user", "scale", G1, (4, 1, 1), [("ptr", h), ("f32", 3.0), ("i32", 4)])
    assert list(get(sess, h, 4)) == [0, 3, 6, 9]
    runs = len(fake.CALLS)
    with pytest.raises(InvalidRequest, match="takes 3 arguments, got 2"):
        sess.launch("user", "scale", G1, G1, [("ptr", h), ("f32", 3.0)])
    with pytest.raises(InvalidRequest, match=r"argument 1 \(float a\) must be f32, got f64"):
        sess.launch("user", "scale", G1, G1, [("ptr", h), ("f64", 3.0), ("i32", 4)])
    with pytest.raises(InvalidRequest, match="unknown kernel 'other'"):
        sess.launch("user", "other", G1, G1, [])
    with pytest.raises(InvalidRequest, match="already loaded"):
        sess.load("cuda", "user", USER.encode())
    assert len(fake.CALLS) == runs


def test_compile_error_comes_back_and_the_session_goes_on(sess: C.CudaSession) -> None:
    with pytest.raises(RemoteError, match=r"kernel.cu\(3\): error"):
        sess.load("cuda", "bad", b"__global__ void k(float* x)\n{\n  syntax error\n}\n")
    with pytest.raises(InvalidRequest, match="#include"):
        sess.load("cuda", "bad", b'#include "/etc/passwd"\n')
    with pytest.raises(InvalidRequest, match="not allowed"):
        sess.load("cuda", "bad", b"__global__ void k() {}", ["-I/etc"])
    h = put(sess, np.ones(2, F32))
    assert list(get(sess, h, 2)) == [1, 1]
    sess.load("cuda", "bad", USER.encode())  # the name is free: the failed loads left nothing


def test_compiled_modules_are_cached(tmp_path: Path, compiler: fake.FakeCompiler) -> None:
    fake.reset()
    cache = ModuleCache(tmp_path / "cache")
    dev = C.CudaDevice(GPU, 0, driver=fake, compiler=compiler, cache=cache)  # type: ignore[arg-type]
    a, b = dev.open_session(1 << 16), dev.open_session(1 << 16)
    a.load("cuda", "m", USER.encode())
    b.load("cuda", "m", USER.encode())
    assert len(compiler.compiled) == 1  # memory
    files = list((tmp_path / "cache").glob("*/*.cubin"))
    assert len(files) == 1
    dev2 = C.CudaDevice(GPU, 0, driver=fake, compiler=compiler, cache=cache)  # type: ignore[arg-type]
    c = dev2.open_session(1 << 16)
    c.load("cuda", "m", USER.encode())
    assert len(compiler.compiled) == 1  # disk
    c.load("cuda", "m2", USER.encode(), ["-O2"])
    assert len(compiler.compiled) == 2  # other options, other key
    hopper_key = files[0].name
    dev3 = C.CudaDevice(GpuInfo("GPU-x", 1, "FAKE A100", 1 << 20, (8, 0)), 1, driver=fake, compiler=compiler, cache=cache)  # type: ignore[arg-type]
    d = dev3.open_session(1 << 16)
    d.load("cuda", "m", USER.encode())
    assert compiler.compiled[-1][1] == "sm_80" and len(compiler.compiled) == 3  # other GPU, other key
    assert hopper_key in {p.name for p in (tmp_path / "cache").glob("*/*.cubin")}
    for s in (a, b, c, d):
        s.close()


def test_ptx_and_cubin(sess: C.CudaSession) -> None:
    ptx = (".version 8.0\n.target sm_90\n.address_size 64\n"
           ".visible .entry scale(.param .u64 p0, .param .f32 p1, .param .u32 p2) { ret; }\n")
    assert sess.load("ptx", "p", ptx.encode()) == {"module": "p", "functions": ["scale"]}
    h = put(sess, np.ones(2, F32))
    sess.launch("p", "scale", G1, G1, [("ptr", h), ("f32", 4.0), ("i32", 2)])
    assert list(get(sess, h, 2)) == [4, 4]
    with pytest.raises(InvalidRequest, match="must be f32"):
        sess.launch("p", "scale", G1, G1, [("ptr", h), ("i32", 4), ("i32", 2)])
    with pytest.raises(RemoteError, match="CUDA_ERROR_INVALID_PTX.*missing .target"):
        sess.load("ptx", "q", b".version 8.0\n.entry k() { ret; }\n")
    with pytest.raises(RemoteError, match="CUDA_ERROR_INVALID_IMAGE"):
        sess.load("cubin", "c", b"\x7fELF not really")
    cubin = fake.FAKE_CUBIN_MAGIC + b"__global__ void scale(float* x, float a, int n) {}"
    assert sess.load("cubin", "c", cubin) == {"module": "c", "functions": []}  # names unknown
    sess.launch("c", "scale", G1, G1, [("ptr", h), ("f32", 0.5), ("i32", 2)])  # typed args as given
    assert list(get(sess, h, 2)) == [2, 2]
    with pytest.raises(InvalidRequest, match="unknown kernel 'nope'"):
        sess.launch("c", "nope", G1, G1, [])


# --------------------------------------------------------------------------- sticky errors


def test_illegal_address_loses_the_session_and_frees_it(dev: C.CudaDevice) -> None:
    s, other = dev.open_session(1 << 16), dev.open_session(1 << 16)
    ho = put(other, np.ones(4, F32))
    h = put(s, np.ones(4, F32))
    s.load("cuda", "user", USER.encode())
    assert dev.mem_used() == 32
    with pytest.raises(RemoteError, match="CUDA_ERROR_ILLEGAL_ADDRESS.*SESSION_LOST"):
        s.launch("user", "wild_write", G1, G1, [("ptr", h)])
    assert dev.mem_used() == 16 and fake.Device(0).used == 16  # its memory is freed at once
    with pytest.raises(SessionLost, match="lost after CUDA_ERROR_ILLEGAL_ADDRESS earlier"):
        s.dtoh(h, 0, 16)
    with pytest.raises(SessionLost):
        s.alloc(4)
    s.close()
    # The other session on the same GPU is untouched.
    other.launch(BUILTIN_MODULE, "saxpy", G1, G1, [("f32", 1.0), ("ptr", ho), ("ptr", ho), ("i32", 4)])
    assert list(get(other, ho, 4)) == [2] * 4
    other.close()
    assert dev.mem_used() == 0


def test_context_creation_failure_is_mapped(dev: C.CudaDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any, flags: int = 0) -> Any:
        raise fake.MemoryError("cuCtxCreate failed: out of memory")

    monkeypatch.setattr(fake.Device, "make_context", refuse)
    s = dev.open_session(100)  # returns at once: the context is made in the session's thread
    with pytest.raises(SessionLost, match="could not be created: CUDA_ERROR_OUT_OF_MEMORY.*creating the session's CUDA context"):
        s.alloc(4)
    s.close()


# --------------------------------------------------------------------------- discovery


def test_normalize_bus_id() -> None:
    assert C.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert C.normalize_bus_id(b"0000:af:00.0\0") == "0000:af:00.0"
    assert C.normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    with pytest.raises(ValueError):
        C.normalize_bus_id("GPU-1234")


class FakeNvml:
    """FAKE NVML: two GPUs, the second on the first CUDA ordinal's bus (CUDA orders them otherwise)."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.buses = {"GPU-a": "00000000:AF:00.0", "GPU-b": "00000000:3B:00.0", "GPU-c": "00000000:01:00.0"}
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetPciInfo(self, h: str) -> Any:
        return type("Pci", (), {"busId": self.buses[h]})()


def test_cuda_devices_match_by_pci_bus_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.reset()
    monkeypatch.setenv("GPUD_MODULE_CACHE", str(tmp_path))
    nvml = FakeNvml()
    gpus = [GpuInfo(u, i, "FAKE", 1 << 20, (9, 0)) for i, u in enumerate(["GPU-a", "GPU-b", "GPU-c"])]
    devices, why = C.cuda_devices(gpus, nvml=nvml, driver=fake)
    assert {u: d.ordinal for u, d in devices.items()} == {"GPU-a": 1, "GPU-b": 0}
    assert "GPU-c" in why and "0000:01:00.0" in why
    assert nvml.inits == 0


def test_an_inline_session_runs_in_the_calling_thread(tmp_path: Path, compiler: fake.FakeCompiler) -> None:
    """inline=True (a session process, whose one thread makes every call): the context is made,
    used and destroyed by the calling thread itself, and left current nowhere between calls."""
    fake.reset()
    fake.Device.total = 1 << 20
    dev = C.CudaDevice(GPU, 0, driver=fake, compiler=compiler, cache=ModuleCache(tmp_path / "cache"), inline=True)  # type: ignore[arg-type]
    before = threading.active_count()
    s = dev.open_session(1 << 16)
    assert threading.active_count() == before  # no thread of its own
    ctx = fake.CONTEXTS[-1]
    assert ctx.thread == threading.get_ident()
    h = put(s, np.arange(8, dtype=F32))
    s.launch(BUILTIN_MODULE, "saxpy", G1, B256, [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 8)])
    assert list(get(s, h, 3)) == [0, 2, 4]
    assert not fake._stack()
    with pytest.raises(InvalidRequest):
        s.free(h + 1)
    s.close()
    assert not ctx.valid
    fake.reset()
