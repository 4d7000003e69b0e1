"""The pycuda device backend: sessions on real NVIDIA GPUs (extra ``cuda``).

``CudaDevice`` and ``CudaSession`` implement the device interface of ``gpud_worker.device`` on a
real GPU through pycuda, so that the broker and the client see no difference but ``simulated``
false. pycuda is imported only when a ``CudaDevice`` is made (``load_driver``), never when this or
any other gpud module is imported: machines without it (and the simulated GPU) never load it.

A session:

- has one CUDA context of its own on its GPU, made, used and destroyed by one thread of its own
  (pycuda binds a context to the thread that made it); the context is pushed before each operation
  and popped after it. Sessions on one GPU are isolated: a handle is a small int scoped to its
  session (mapped there to its ``DeviceAllocation``), device addresses never leave the worker, and
  modules are per session;
- enforces its memory grant on the bytes it allocates (the GPU itself may refuse first:
  OUT_OF_MEMORY either way); a context's own overhead is not counted against the grant;
- compiles CUDA C with nvcc (``load`` kind "cuda"), with an on-disk cache of cubins
  (``gpud_worker.modules.ModuleCache``, key: the source, the options, the GPU's architecture and
  nvcc's version); PTX and cubins are loaded as they are (``module_from_buffer``). The built-in
  kernels are ``kernels.CUDA_SOURCE``, compiled the same way;
- checks a launch's typed arguments against the kernel's parameters before launching (built-ins:
  ``kernels.BUILTINS``, with the same "illegal address" check of buffer sizes as the simulated GPU;
  loaded modules: the parameters read from the source or the PTX); launches are synchronous: a
  launch returns when the kernel has finished, so its errors are its own;
- maps CUDA errors to REMOTE_ERROR naming the CUDA error (``CUDA_ERROR_...``). After an error that
  CUDA makes sticky (an illegal address, a kernel's assert or trap...: the context can run nothing
  more), the failing call says so, the context is destroyed and its memory freed at once, and every
  later call gets SESSION_LOST (the broker then ends the session; the client library replays its
  journal onto a new one where it can).

The worker runs each such session in a process of its own (``gpud_worker.session_host``): a sticky
error poisons CUDA for the whole process, not only the faulting context (seen on an H200), and
there it ends one session's process only. That process also applies the grant's MPS limits (CUDA
reads them at ``cuInit``), and the worker can kill it when a kernel never ends. Run in the worker's
own process (``session_processes = "off"``), a kernel that never ends blocks its session and MPS
limits are only recorded in ``info``.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from gpud.clock import Clock
from gpud.errors import GpudError, InvalidRequest, OutOfMemory, RemoteError, SessionLost
from gpud.protocol import BUILTIN_MODULE
from gpud.resources import GpuInfo
from gpud_worker.device import (
    BUSY_WINDOW_S,
    Dims,
    _BaseDevice,
    _BaseSession,
    _byte_view,
    _check_footprint,
    _check_grant,
    _check_kernel,
    _check_launch_shape,
    _out_view,
)
from gpud_worker.kernels import BUILTINS, CUDA_SOURCE, Arg, check_args, lookup
from gpud_worker.modules import (
    MAX_MESSAGE_CHARS,
    MAX_MODULE_BYTES,
    ModuleCache,
    Param,
    Signature,
    arch_of,
    cache_key,
    check_cuda_source,
    check_launch_args,
    check_load_args,
    cuda_signatures,
    decode_text,
    default_cache_dir,
    pack_format,
    ptx_signatures,
    wrap_extern_c,
)
from gpud_worker.nvcc import NvccCompiler

if TYPE_CHECKING:
    from gpud_worker.jobs import JobGrant

log = logging.getLogger(__name__)

T = TypeVar("T")

_MEMORY_IMAGES = 64  # compiled modules kept in memory per device (besides the disk cache)

# --------------------------------------------------------------------------- pycuda, lazily

_driver_lock = threading.Lock()
_driver: Any = None


def load_driver() -> Any:
    """``pycuda.driver``, imported and initialized (``cuInit``) on the first call.

    Raises
    ------
    ImportError
        pycuda is not installed (extra ``cuda``).
    pycuda.driver.Error
        The CUDA driver cannot be initialized.
    """
    global _driver
    with _driver_lock:
        if _driver is None:
            import pycuda.driver as drv

            drv.init()
            _driver = drv
        return _driver


# --------------------------------------------------------------------------- CUDA errors

# CUDA's errors after which a context can run nothing more ("sticky"): cuda.h says of each that
# "any further CUDA work will return the same error".
STICKY_ERRORS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
})

# pycuda's messages carry cuGetErrorString's description, not the error's name. The names come
# from the driver itself where it is loaded (``driver_error_names``); this table, from the
# descriptions of cuda.h (CUDA 12 and 13), is the fallback.
FALLBACK_ERROR_NAMES: dict[str, str] = {
    "invalid argument": "CUDA_ERROR_INVALID_VALUE",
    "out of memory": "CUDA_ERROR_OUT_OF_MEMORY",
    "initialization error": "CUDA_ERROR_NOT_INITIALIZED",
    "driver shutting down": "CUDA_ERROR_DEINITIALIZED",
    "no CUDA-capable device is detected": "CUDA_ERROR_NO_DEVICE",
    "invalid device ordinal": "CUDA_ERROR_INVALID_DEVICE",
    "device kernel image is invalid": "CUDA_ERROR_INVALID_IMAGE",
    "invalid device context": "CUDA_ERROR_INVALID_CONTEXT",
    "no kernel image is available for execution on the device": "CUDA_ERROR_NO_BINARY_FOR_GPU",
    "a PTX JIT compilation failed": "CUDA_ERROR_INVALID_PTX",
    "the provided PTX was compiled with an unsupported toolchain.": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    "invalid resource handle": "CUDA_ERROR_INVALID_HANDLE",
    "named symbol not found": "CUDA_ERROR_NOT_FOUND",
    "an illegal memory access was encountered": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "too many resources requested for launch": "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    "the launch timed out and was terminated": "CUDA_ERROR_LAUNCH_TIMEOUT",
    "device-side assert triggered": "CUDA_ERROR_ASSERT",
    "an illegal instruction was encountered": "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "misaligned address": "CUDA_ERROR_MISALIGNED_ADDRESS",
    "operation not supported on global/shared address space": "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "invalid program counter": "CUDA_ERROR_INVALID_PC",
    "unspecified launch failure": "CUDA_ERROR_LAUNCH_FAILED",
    "hardware stack error": "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "uncorrectable ECC error encountered": "CUDA_ERROR_ECC_UNCORRECTABLE",
    "context is destroyed": "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    "unknown error": "CUDA_ERROR_UNKNOWN",
}

_MESSAGE_RE = re.compile(r"^(?P<routine>\w+) failed: (?P<desc>.*?)(?: - (?P<detail>.*))?$", re.DOTALL)


def driver_error_names(lib: Any = None) -> dict[str, str]:
    """Description -> name of every CUDA error the loaded driver knows (``cuGetErrorString`` and
    ``cuGetErrorName`` of codes 0..999), merged over ``FALLBACK_ERROR_NAMES``. Never raises:
    without libcuda, the fallback alone."""
    names = dict(FALLBACK_ERROR_NAMES)
    try:
        cuda = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        for code in range(1, 1000):
            desc, name = ctypes.c_char_p(), ctypes.c_char_p()
            if cuda.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
                continue
            if cuda.cuGetErrorString(code, ctypes.byref(desc)) != 0 or not desc.value:
                continue
            names[desc.value.decode(errors="replace")] = name.value.decode(errors="replace")
    except (OSError, AttributeError) as exc:
        log.debug("CUDA error names from the fallback table only: %s", exc)
    return names


@dataclass(frozen=True, slots=True)
class CudaFailure:
    """A CUDA error as the session reports it.

    Attributes
    ----------
    error:
        What the call raises (REMOTE_ERROR, or OUT_OF_MEMORY for CUDA's out of memory).
    name:
        The CUDA error's name (``CUDA_ERROR_ILLEGAL_ADDRESS``...), ``CUDA_ERROR_UNKNOWN_TEXT``
        when the message matched no known error.
    sticky:
        Whether the context is unusable after it (``STICKY_ERRORS``).
    """

    error: GpudError
    name: str
    sticky: bool


def map_cuda_error(exc: BaseException, what: str, names: Mapping[str, str] | None = None) -> CudaFailure:
    """The failure a pycuda error (``pycuda.driver.Error`` or a subclass) stands for; ``what``
    says which operation failed (``"kernel 'k' of module 'm'"``, ``"alloc"``...)."""
    table = FALLBACK_ERROR_NAMES if names is None else names
    text = str(exc).strip()
    m = _MESSAGE_RE.match(text)
    routine, desc, detail = (m.group("routine"), m.group("desc").strip(), m.group("detail")) if m else ("", text, None)
    name = table.get(desc, "CUDA_ERROR_UNKNOWN_TEXT")
    where = f"{what}, {routine}" if routine else what
    extra = f": {detail.strip()[:MAX_MESSAGE_CHARS]}" if detail and detail.strip() else ""
    message = f"{name}: {desc} ({where}){extra}"
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return CudaFailure(OutOfMemory(f"{message}: the GPU has no memory left for it"), name, False)
    sticky = name in STICKY_ERRORS
    if sticky:
        message += ("; CUDA leaves the context unusable after this error: the session's memory and "
                    "modules are gone and its next call gets SESSION_LOST")
    return CudaFailure(RemoteError(message), name, sticky)


# --------------------------------------------------------------------------- the device


def _builtin_signatures() -> dict[str, Signature]:
    return {n: tuple(Param(p, t, (t,)) for p, t in zip(s.names, s.params, strict=True)) for n, s in BUILTINS.items()}


class CudaDevice(_BaseDevice):
    """One real GPU that sessions are opened on, through pycuda.

    Parameters
    ----------
    gpu:
        What NVML says of it (``simulated`` must be false).
    ordinal:
        Its CUDA device ordinal in this process (``cuda_devices`` matches them by PCI bus id).
    driver:
        ``pycuda.driver`` (``load_driver()`` by default; tests give a fake).
    compiler:
        What compiles CUDA C (``NvccCompiler()`` by default).
    cache:
        The on-disk module cache (``ModuleCache(default_cache_dir())`` by default).
    builtin:
        The built-in kernels' cubin, compiled already (by default compiled on first use).
    inline:
        Run each session's calls in the thread that makes them, which must then be one thread for
        the session's whole life (a session process: ``gpud_worker.session_host``), instead of a
        thread of the session's own: one thread hand-off less per call.
    """

    simulated = False

    def __init__(
        self,
        gpu: GpuInfo,
        ordinal: int,
        *,
        driver: Any = None,
        compiler: NvccCompiler | None = None,
        cache: ModuleCache | None = None,
        clock: Clock | None = None,
        busy_window: float = BUSY_WINDOW_S,
        builtin: bytes | None = None,
        inline: bool = False,
    ) -> None:
        if gpu.simulated:
            raise ValueError("CudaDevice serves real GPUs; SimulatedDevice serves simulated ones")
        self.gpu = gpu
        self.ordinal = ordinal
        self.driver = driver if driver is not None else load_driver()
        self.compiler = compiler if compiler is not None else NvccCompiler()
        self.cache = cache if cache is not None else ModuleCache(default_cache_dir())
        self.arch = arch_of(gpu.cc)
        super().__init__(clock, busy_window)
        self._compile_lock = threading.Lock()
        self._images: dict[str, bytes] = {}  # cache key -> cubin, the most recent ones
        self._error_names: dict[str, str] | None = None
        self._builtin = builtin
        self.inline = inline

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None, tenant: str = "default",
                     grant: JobGrant | None = None) -> CudaSession:
        _check_grant(mem_grant)
        return CudaSession(self, mem_grant, mps)

    def error_names(self) -> Mapping[str, str]:
        """CUDA error descriptions -> names (``driver_error_names``), read once."""
        if self._error_names is None:
            self._error_names = driver_error_names()
        return self._error_names

    def compile(self, source: str, options: Sequence[str]) -> bytes:
        """The cubin of a checked CUDA C source: from memory, from the disk cache, or nvcc."""
        wrapped = wrap_extern_c(source)
        key = cache_key("cuda", wrapped.encode(), options, self.gpu.cc, self.compiler.version())
        with self._lock:
            image = self._images.get(key)
        if image is not None:
            return image
        with self._compile_lock:  # one nvcc at a time; a source asked for twice is compiled once
            with self._lock:
                image = self._images.get(key)
            if image is None:
                image = self.cache.get(key)
            if image is None:
                image = self.compiler.compile(wrapped, self.arch, options)
                try:
                    self.cache.put(key, image)
                except OSError as exc:
                    log.warning("module cache %s not written: %s", self.cache.root, exc)
            with self._lock:
                if len(self._images) >= _MEMORY_IMAGES:
                    self._images.pop(next(iter(self._images)))
                self._images[key] = image
        return image

    def builtin_image(self) -> bytes:
        """The cubin of the built-in kernels (``kernels.CUDA_SOURCE``) for this GPU (the one given
        at construction, if any)."""
        if self._builtin is None:
            self._builtin = self.compile(CUDA_SOURCE, ())
        return self._builtin


class _SessionThread:
    """The one thread of a session that makes, uses and destroys its CUDA context. A daemon: a
    kernel that never ends must not keep the worker from exiting."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            del item, fn, future  # nothing of the call outlives it here

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((fn, future))
        return future

    def shutdown(self, wait: bool = True) -> None:
        self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


class _Inline:
    """``_SessionThread``'s interface, running each call at once in the calling thread."""

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


@dataclass(slots=True)
class _Module:
    module: Any  # pycuda Module
    sigs: dict[str, Signature] | None  # None: unknown (a cubin)
    functions: list[str]  # kernels found in it (cubin: the ones launched so far)
    handles: dict[str, Any] = field(default_factory=dict)  # name -> pycuda Function


class _Lost(Exception):
    """Raised in the session's thread after a sticky CUDA error (carries the failure)."""

    def __init__(self, failure: CudaFailure) -> None:
        super().__init__(failure.error.message)
        self.failure = failure


class CudaSession(_BaseSession[tuple[Any, int]]):
    """A session on a ``CudaDevice``: one CUDA context, used by one thread of its own.

    Thread-safe: calls run one at a time, each in the session's thread with its context current.
    Its handle table maps a handle to ``(DeviceAllocation, bytes)``.
    """

    _device: CudaDevice
    _modules: dict[str, _Module]

    def __init__(self, device: CudaDevice, mem_grant: int, mps: Mapping[str, str] | None = None) -> None:
        super().__init__(device, mem_grant, mps)
        self._drv = device.driver
        self._next_handle = 0
        self._modules = {}
        self._lost: str | None = None  # why the context is gone (a sticky error)
        self._ctx: Any = None
        self._thread: _SessionThread | _Inline = (
            _Inline() if device.inline else _SessionThread(f"cuda{device.gpu.index}-session"))
        # The context is made in the session's thread, without waiting here (it takes a fraction of
        # a second, and sessions are opened from the worker's main loop): the first call waits for
        # it, as calls run in order in that thread. If it cannot be made, calls get SESSION_LOST.
        self._thread.submit(self._make_context)
        log.debug("%s: CUDA session opened with a grant of %d bytes", device.gpu.uuid, mem_grant)

    # ---------------------------------------------------------------- the session's thread

    def _make_context(self) -> None:
        drv = self._drv
        try:
            self._ctx = drv.Device(self._device.ordinal).make_context()
            drv.Context.pop()
        except drv.Error as exc:
            failure = map_cuda_error(exc, "creating the session's CUDA context", self._device.error_names())
            self._lost = f"its CUDA context could not be created: {failure.error.message}"
            log.error("%s: %s", self._device.gpu.uuid, self._lost)
        except Exception as exc:
            self._lost = f"its CUDA context could not be created: {type(exc).__name__}: {exc}"
            log.exception("%s: creating a CUDA context failed", self._device.gpu.uuid)

    def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the session's thread and return its result or raise its error. The error
        comes back without its traceback, so that no pycuda object of this session is freed from
        another thread (pycuda refuses that)."""
        def run() -> tuple[bool, Any]:
            try:
                return True, fn()
            except BaseException as exc:
                exc.__traceback__ = None
                exc.__context__ = None
                exc.__cause__ = None
                return False, exc
        ok, value = self._thread.submit(run).result()
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def _op(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with the session's context current, in its thread. CUDA errors become
        ``CudaFailure`` errors; a sticky one also loses the session (``_lose``)."""
        def run() -> T:
            drv = self._drv
            if self._ctx is None:  # it could not be made (the first call may get here before
                raise SessionLost(f"the session's CUDA context is gone ({self._lost})")  # _lost shows)
            try:
                self._ctx.push()
            except drv.Error as exc:
                raise map_cuda_error(exc, what, self._device.error_names()).error from None
            failure: CudaFailure | None = None
            try:
                return fn()
            except drv.Error as exc:
                failure = map_cuda_error(exc, what, self._device.error_names())
                raise _Lost(failure) if failure.sticky else failure.error from None
            finally:
                try:
                    drv.Context.pop()
                except drv.Error as exc:
                    log.warning("%s: popping a CUDA context failed: %s", self._device.gpu.uuid, exc)
                if failure is not None and failure.sticky:
                    self._lose(failure)
        try:
            return self._in_thread(run)
        except _Lost as lost:
            raise lost.failure.error from None

    def _lose(self, failure: CudaFailure) -> None:
        """In the session's thread: destroy the context after a sticky error, drop what it held."""
        self._lost = f"lost after {failure.name} earlier in this session"
        log.error("%s: session lost its CUDA context: %s", self._device.gpu.uuid, failure.error.message)
        self._destroy()

    def _destroy(self) -> None:
        """In the session's thread: destroy the context (which frees its memory and modules), then
        drop the pycuda objects (their clean-up then finds a dead context and does nothing)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            try:
                ctx.detach()
            except self._drv.Error as exc:
                log.warning("%s: destroying a CUDA context failed: %s", self._device.gpu.uuid, exc)
        self._allocs.clear()
        self._modules.clear()
        self._device._release(self._used)
        self._used = 0

    # ---------------------------------------------------------------- the device interface

    def _allocate(self, nbytes: int) -> tuple[int, tuple[Any, int]]:
        mem = self._op("alloc", lambda: self._drv.mem_alloc(nbytes))
        self._device._count(nbytes)
        self._next_handle += 1
        return self._next_handle, (mem, nbytes)

    def _free(self, handle: int, alloc: tuple[Any, int]) -> int:
        mem, nbytes = alloc

        def free() -> None:
            mem.free()
            del self._allocs[handle]  # in the session's thread, as pycuda wants

        self._op("free", free)
        return nbytes

    def _size(self, alloc: tuple[Any, int]) -> int:
        return alloc[1]

    def htod(self, handle: int, offset: int, data: Any) -> None:
        view = _byte_view(data)
        with self._lock:
            self._check_open()
            (mem, _), _ = self._span(handle, offset, len(view))
            if not len(view):
                return
            with self._device._working():
                self._op("htod", lambda: self._drv.memcpy_htod(int(mem) + offset, view))

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None, out: Any = None) -> memoryview:
        with self._lock:
            self._check_open()
            (mem, _), end = self._span(handle, offset, nbytes)
            dest = memoryview(bytearray(end - offset)) if out is None else _out_view(out, end - offset)
            if len(dest):
                with self._device._working():
                    self._op("dtoh", lambda: self._drv.memcpy_dtoh(dest, int(mem) + offset))
            return dest

    def load(self, kind: str, name: str, data: Any, options: Sequence[str] = (), image: bytes | None = None) -> dict[str, Any]:
        """As ``DeviceSession.load``; ``image``: for CUDA C, its cubin compiled already (by the
        worker, for a session in a process of its own: ``gpud_worker.session_host``)."""
        kind, name, opts = check_load_args(kind, name, list(options))
        sigs: dict[str, Signature] | None
        if kind == "cubin":
            image = bytes(data)
            if len(image) > MAX_MODULE_BYTES:
                raise InvalidRequest(f"a module is at most {MAX_MODULE_BYTES} bytes, got {len(image)}")
            sigs = None
        elif kind == "ptx":
            text = decode_text(data, kind)
            image = text.encode() + b"\0"
            sigs = ptx_signatures(text)
        else:
            text = decode_text(data, kind)
            sigs = cuda_signatures(check_cuda_source(text))
            if image is None:
                with self._lock:
                    self._check_open()
                image = self._device.compile(text, opts)  # outside the lock: it may take seconds
        with self._lock:
            self._check_loadable(name)

            def load() -> list[str]:
                mod = self._drv.module_from_buffer(image)
                handles = {n: f for n in sorted(sigs or ()) if (f := self._find(mod, n)) is not None}
                self._modules[name] = _Module(mod, sigs, list(handles), handles)
                return list(handles)

            functions = self._op(f"loading module {name!r}", load)
        return {"module": name, "functions": functions[:1024]}

    def _find(self, mod: Any, name: str) -> Any:
        """The kernel ``name`` of a pycuda module, or None (session thread, context current)."""
        try:
            return mod.get_function(name)
        except self._drv.Error:
            return None

    def launch(
        self,
        module: str,
        name: str,
        grid: Dims,
        block: Dims,
        args: Sequence[Arg],
        shared_mem: int = 0,
    ) -> None:
        if type(module) is not str or type(name) is not str:
            raise InvalidRequest("module and name must be strings")
        builtin = module == BUILTIN_MODULE
        sig: Signature | None = None
        if builtin:
            lookup(module, name)
            check_args(name, args)
        _check_launch_shape(grid, block, shared_mem)
        what = f"kernel {name!r} of module {module!r}"
        with self._lock:
            self._check_open()
            if builtin:
                entry = self._builtin()
            else:
                got = self._modules.get(module)
                if got is None:
                    raise self._unknown_module(module)
                entry = got
                if entry.sigs is not None:
                    _check_kernel(module, name, entry.functions)
                    sig = entry.sigs[name]
                check_launch_args(module, name, sig, args)
            ptrs = self._ptr_allocs(args, lambda i: f"{what} argument {i}")
            if builtin:
                _check_footprint(name, BUILTINS[name], [v for _, v in args], {i: n for i, (_, n) in ptrs.items()})
            values = [int(ptrs[i][0]) if i in ptrs else value for i, (_, value) in enumerate(args)]
            fmt = pack_format(args)

            def run() -> None:
                func = entry.handles.get(name)
                if func is None:
                    func = self._find(entry.module, name)
                    if func is None:
                        raise InvalidRequest(f"unknown kernel {name!r} in module {module!r}")
                    entry.handles[name] = func
                    if name not in entry.functions:
                        entry.functions.append(name)
                func.prepare(fmt)
                func.prepared_call(grid, block, *values, shared_size=shared_mem)
                self._drv.Context.synchronize()

            with self._device._working():
                self._op(what, run)

    def _builtin(self) -> _Module:
        """The built-in module, loaded into this session's context on first use (lock held)."""
        entry = self._modules.get(BUILTIN_MODULE)
        if entry is None:
            image = self._device.builtin_image()
            sigs = _builtin_signatures()

            def load() -> _Module:
                return _Module(self._drv.module_from_buffer(image), sigs, sorted(sigs))

            entry = self._modules[BUILTIN_MODULE] = self._op("loading the built-in kernels", load)
        return entry

    def sync(self) -> None:
        with self._lock:
            self._check_open()
            self._op("sync", lambda: self._drv.Context.synchronize())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._in_thread(self._destroy)
            finally:
                self._thread.shutdown(wait=True)
            log.debug("%s: CUDA session closed", self._device.gpu.uuid)

    def _check_open(self) -> None:
        super()._check_open()
        if self._lost is not None:
            raise SessionLost(f"the session's CUDA context is gone ({self._lost})")


# --------------------------------------------------------------------------- discovery


def normalize_bus_id(bus_id: str | bytes) -> str:
    """A PCI bus id as ``dddd:bb:dd.f`` in lower case (NVML writes an 8-digit domain, CUDA 4)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    m = re.fullmatch(r"\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", text.rstrip("\0"))
    if m is None:
        raise ValueError(f"bad PCI bus id {bus_id!r}")
    domain, bus, dev, fn = (int(g, 16) if g else 0 for g in m.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def cuda_devices(gpus: Sequence[GpuInfo], nvml: Any = None, driver: Any = None,
                 compile_user: tuple[int, int] | None = None) -> tuple[dict[str, CudaDevice], str]:
    """A ``CudaDevice`` for each GPU of NVML's inventory that CUDA sees, matched by PCI bus id;
    ``compile_user``: ``(uid, gid)`` its nvcc runs as (``NvccCompiler``).

    Returns the devices by uuid and, when some or all GPUs get none, why (empty otherwise). Never
    raises: a worker without pycuda still runs jobs; its sessions are refused.
    """
    if not gpus:
        return {}, ""
    try:
        drv = driver if driver is not None else load_driver()
    except ImportError as exc:
        return {}, f"pycuda is not installed ({exc}): install the extra 'cuda' (pip install 'gpud[cuda]')"
    except Exception as exc:  # pycuda.driver.Error: no usable driver
        return {}, f"pycuda cannot initialize CUDA: {exc}"
    if nvml is None:
        import pynvml as nvml_module

        nvml = nvml_module
    ordinals: dict[str, int] = {}
    try:
        for i in range(drv.Device.count()):
            ordinals[normalize_bus_id(drv.Device(i).pci_bus_id())] = i
    except Exception as exc:
        return {}, f"CUDA cannot list its devices: {exc}"
    devices: dict[str, CudaDevice] = {}
    missing: list[str] = []
    nvml.nvmlInit()
    try:
        for g in gpus:
            try:
                bus = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByUUID(g.uuid)).busId)
            except (nvml.NVMLError, ValueError) as exc:
                missing.append(f"{g.uuid} (no PCI bus id: {exc})")
                continue
            if bus not in ordinals:
                missing.append(f"{g.uuid} (CUDA does not see {bus}: CUDA_VISIBLE_DEVICES?)")
                continue
            devices[g.uuid] = CudaDevice(g, ordinals[bus], driver=drv, compiler=NvccCompiler(user=compile_user))
    finally:
        nvml.nvmlShutdown()
    why = f"no CUDA device for GPU(s) {', '.join(missing)}" if missing else ""
    return devices, why
