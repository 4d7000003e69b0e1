"""A FAKE ``pycuda.driver`` for unit tests on machines without a GPU. Nothing here talks to CUDA.

FAKE: it models only what ``gpud_worker.cuda`` relies on, with pycuda's rules where they matter:

- contexts: ``Device(i).make_context()`` makes one and pushes it on the calling thread's context
  stack; ``ctx.push()``, ``Context.pop()`` and ``Context.synchronize()`` act on that stack. Every
  memory, module or launch call needs a current context. ``ctx.detach()`` and ``free()`` must run
  in the thread that made the context (pycuda refuses clean-ups from other threads): breaking
  that raises ``AssertionError``, so a test sees the design mistake;
- errors: classes ``Error`` (base), ``MemoryError``, ``LogicError``, ``LaunchError``,
  ``RuntimeError``, with pycuda's messages (``"cuXxx failed: <cuGetErrorString text>"``);
- memory: host bytearrays at fake 64-bit addresses; a device has ``total`` bytes;
- modules: an image is ``FAKE_CUBIN_MAGIC`` + CUDA C source (what ``FakeCompiler`` "compiles") or
  PTX text; its kernels are the ``__global__``/``.entry`` names that have a Python implementation
  in ``IMPLS``: the built-ins (``kernels.BUILTINS``' numpy code) and a few test kernels, among
  them ``wild_write``, which "writes" out of bounds: like CUDA, the launch succeeds, the next
  synchronize fails with an illegal address, and so does every later call on that context.
"""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from gpud.errors import RemoteError
from gpud_worker.kernels import BUILTINS

FAKE_CUBIN_MAGIC = b"FAKECUBIN\n"
ILLEGAL = "an illegal memory access was encountered"


class Error(Exception):
    pass


class MemoryError(Error):  # noqa: A001 - pycuda's name
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class RuntimeError(Error):  # noqa: A001 - pycuda's name
    pass


_tls = threading.local()
_lock = threading.Lock()
_next_address = [0x7F00_0000_0000]
CONTEXTS: list[Context] = []  # every context ever made, for the tests' checks


def _stack() -> list[Context]:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack  # type: ignore[no-any-return]


def _current(routine: str) -> Context:
    stack = _stack()
    if not stack:
        raise LogicError(f"{routine} failed: invalid device context")
    ctx = stack[-1]
    if ctx.sticky:
        raise LogicError(f"{routine} failed: {ctx.sticky}")
    return ctx


class Allocation:
    def __init__(self, ctx: Context, nbytes: int) -> None:
        with _lock:
            self.address = _next_address[0]
            _next_address[0] += (nbytes + 0xFFFF) & ~0xFFFF
        self.ctx = ctx
        self.buf = bytearray(nbytes)
        self.freed = False

    def __int__(self) -> int:
        return self.address

    def free(self) -> None:
        assert threading.get_ident() == self.ctx.thread, "FAKE pycuda: free() from another thread"
        if self.freed:
            return
        _current("cuMemFree")
        self.freed = True
        self.ctx.device.used -= len(self.buf)
        del self.ctx.allocs[self.address]


class Context:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.thread = threading.get_ident()
        self.valid = True
        self.sticky = ""
        self.allocs: dict[int, Allocation] = {}
        self.pending_fault = False
        CONTEXTS.append(self)

    def push(self) -> None:
        if not self.valid:
            raise LogicError("cuCtxPushCurrent failed: invalid device context")
        _stack().append(self)

    @staticmethod
    def pop() -> None:
        stack = _stack()
        if not stack:
            raise LogicError("context::pop failed: invalid device context - cannot pop non-current context")
        stack.pop()

    @staticmethod
    def synchronize() -> None:
        ctx = _current("cuCtxSynchronize")
        if ctx.pending_fault:
            ctx.pending_fault = False
            ctx.sticky = ILLEGAL
            raise LogicError(f"cuCtxSynchronize failed: {ILLEGAL}")

    def detach(self) -> None:
        assert threading.get_ident() == self.thread, "FAKE pycuda: detach() from another thread"
        if not self.valid:
            raise LogicError("context::detach failed: invalid device context - cannot detach from invalid context")
        self.valid = False
        for a in list(self.allocs.values()):
            self.device.used -= len(a.buf)
            a.freed = True
        self.allocs.clear()
        stack = _stack()
        while self in stack:
            stack.remove(self)


class Device:
    devices: dict[int, Device] = {}
    bus_ids: list[str] = ["0000:3B:00.0", "0000:AF:00.0"]
    total = 1 << 20

    def __new__(cls, ordinal: int) -> Device:
        with _lock:
            dev = cls.devices.get(ordinal)
            if dev is None:
                dev = super().__new__(cls)
                dev.ordinal = ordinal
                dev.used = 0
                cls.devices[ordinal] = dev
            return dev

    ordinal: int
    used: int

    @staticmethod
    def count() -> int:
        return len(Device.bus_ids)

    def pci_bus_id(self) -> str:
        return self.bus_ids[self.ordinal]

    def make_context(self, flags: int = 0) -> Context:
        ctx = Context(self)
        _stack().append(ctx)
        return ctx


def init(flags: int = 0) -> None:
    pass


def mem_alloc(nbytes: int) -> Allocation:
    ctx = _current("cuMemAlloc")
    if ctx.device.used + nbytes > ctx.device.total:
        raise MemoryError("cuMemAlloc failed: out of memory")
    a = Allocation(ctx, nbytes)
    ctx.allocs[a.address] = a
    ctx.device.used += nbytes
    return a


def _resolve(ctx: Context, address: int, nbytes: int, routine: str) -> tuple[Allocation, int]:
    for a in ctx.allocs.values():
        if a.address <= address and address + nbytes <= a.address + len(a.buf):
            return a, address - a.address
    raise LogicError(f"{routine} failed: invalid argument")


def memcpy_htod(dest: int, src: Any) -> None:
    ctx = _current("cuMemcpyHtoD")
    view = memoryview(src).cast("B")
    a, off = _resolve(ctx, dest, len(view), "cuMemcpyHtoD")
    a.buf[off : off + len(view)] = view


def memcpy_dtoh(dest: Any, src: int) -> None:
    ctx = _current("cuMemcpyDtoH")
    view = memoryview(dest).cast("B")
    a, off = _resolve(ctx, src, len(view), "cuMemcpyDtoH")
    view[:] = a.buf[off : off + len(view)]


# ----------------------------------------------------------------------------- kernels

Impl = Callable[..., None]
CALLS: list[tuple[str, tuple[Any, ...]]] = []  # every kernel run, for the tests' checks


def _f32(ctx: Context, address: int) -> np.ndarray:
    a, off = _resolve(ctx, address, 0, "kernel")
    return np.frombuffer(a.buf, np.float32, offset=off, count=(len(a.buf) - off) // 4)


def _builtin(name: str) -> Impl:
    sig = BUILTINS[name]

    def run(ctx: Context, *values: Any) -> None:
        resolved = [_f32(ctx, v) if t == "ptr" else v for t, v in zip(sig.params, values, strict=True)]
        sig.run(*resolved)

    return run


def _scale(ctx: Context, x: int, a: float, n: int) -> None:
    v = _f32(ctx, x)
    v[:n] *= np.float32(a)


def _wild_write(ctx: Context, x: int) -> None:
    ctx.pending_fault = True  # as CUDA: the launch succeeds, the next synchronize fails


IMPLS: dict[str, Impl] = {**{n: _builtin(n) for n in BUILTINS}, "scale": _scale, "wild_write": _wild_write}


class Function:
    def __init__(self, ctx: Context, name: str) -> None:
        self.ctx = ctx
        self.name = name
        self.arg_format = ""

    def prepare(self, arg_types: str) -> Function:
        self.arg_format = arg_types
        return self

    def prepared_call(self, grid: tuple[int, ...], block: tuple[int, ...], *args: Any, shared_size: int = 0) -> None:
        ctx = _current("cuLaunchKernel")
        assert ctx is self.ctx, "FAKE pycuda: a kernel launched in another context"
        buf = struct.pack(self.arg_format, *args)  # as pycuda packs them
        values = struct.unpack(self.arg_format, buf)
        CALLS.append((self.name, values))
        IMPLS[self.name](ctx, *values)


class Module:
    def __init__(self, ctx: Context, names: set[str]) -> None:
        self.ctx = ctx
        self.names = names

    def get_function(self, name: str) -> Function:
        _current("cuModuleGetFunction")
        if name not in self.names or name not in IMPLS:
            raise LogicError("cuModuleGetFunction failed: named symbol not found")
        return Function(self.ctx, name)


def module_from_buffer(image: Any, options: Any = None, message_handler: Any = None) -> Module:
    ctx = _current("cuModuleLoadDataEx")
    data = bytes(image)
    if data.startswith(FAKE_CUBIN_MAGIC):
        text = data[len(FAKE_CUBIN_MAGIC):].decode()
        return Module(ctx, set(re.findall(r"__global__\s+void\s+(\w+)", text)))
    if data.startswith(b"//") or data.startswith(b".version"):
        text = data.rstrip(b"\0").decode()
        if ".target" not in text:
            raise LogicError("cuModuleLoadDataEx failed: a PTX JIT compilation failed - ptxas fatal: missing .target")
        return Module(ctx, set(re.findall(r"\.entry\s+(\w+)", text)))
    raise LogicError("cuModuleLoadDataEx failed: device kernel image is invalid")


class FakeCompiler:
    """FAKE nvcc: "compiles" to ``FAKE_CUBIN_MAGIC`` + the source; a source containing
    ``syntax error`` fails as nvcc would, with a message naming the line."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, str, tuple[str, ...]]] = []

    def version(self) -> str:
        return "FAKE nvcc 0.0"

    def compile(self, source: str, arch: str, options: Any) -> bytes:
        self.compiled.append((source, arch, tuple(options)))
        lineno = 0
        for line in source.splitlines():
            lineno += 1
            directive = re.match(r"#line (\d+)", line)
            if directive:  # as nvcc: the next line is that line of the file
                lineno = int(directive.group(1)) - 1
            elif "syntax error" in line:
                raise RemoteError(f"compile error (nvcc exited with 2):\nkernel.cu({lineno}): error: expected a \";\"")
        return FAKE_CUBIN_MAGIC + source.encode()


def reset() -> None:
    """Forget every fake device, context and call (between tests)."""
    Device.devices.clear()
    CONTEXTS.clear()
    CALLS.clear()
