"""The device interface behind session CALLs, and the simulated GPU.

This module owns what a session does to a GPU (docs/PROTOCOL.md §5.4): ``Device`` and
``DeviceSession`` are the interface the worker's session code calls; ``SimulatedDevice`` implements
it for machines without a GPU (DESIGN.md §5): device memory is host memory, the built-in kernels of
``gpud_worker.kernels`` run on the CPU with numpy, and utilization is modelled from the time spent
running kernels and copies. It is always labelled simulated and never claims to be a real GPU.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from gpud.clock import Clock, SystemClock
from gpud.errors import InvalidRequest, OutOfMemory, RemoteError, SessionLost
from gpud.protocol import BUILTIN_MODULE, gpu_info_to_wire
from gpud.resources import GpuInfo
from gpud_worker.kernels import (
    BUILTINS,
    F32_BYTES,
    MAX_THREADS_PER_BLOCK,
    Arg,
    Resolved,
    check_args,
    lookup,
)
from gpud_worker.modules import (
    MAX_MODULES,
    check_cuda_source,
    check_load_args,
    cuda_signatures,
    decode_text,
    describe,
)

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 1.0  # seconds of history behind busy_fraction()
MAX_SHARED_MEM = 48 * 1024  # bytes of dynamic shared memory per block, CUDA's default limit
_MAX_BUSY_INTERVALS = 4096  # past this, the oldest busy intervals are merged (over-counts a little)

Dims = tuple[int, int, int]


class DeviceSession(Protocol):
    """One client's session on one GPU: its allocations, copies and launches.

    Handles are opaque ints scoped to the session: a handle of another session is unknown here.
    Every method raises ``SessionLost`` once the session is closed (except ``close``).
    """

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (>= 1) of device memory; OutOfMemory past the grant or the device."""
        ...

    def free(self, handle: int) -> None:
        """Free an allocation; InvalidRequest for an unknown handle."""
        ...

    def htod(self, handle: int, offset: int, data: Any) -> None:
        """Copy ``data`` (any contiguous buffer) to the allocation at ``offset``; bounds checked."""
        ...

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None) -> bytes | memoryview:
        """Copy ``nbytes`` from the allocation at ``offset`` (None: to its end); bounds checked."""
        ...

    def launch(
        self,
        module: str,
        name: str,
        grid: Dims,
        block: Dims,
        args: Sequence[Arg],
        shared_mem: int = 0,
    ) -> None:
        """Run kernel ``name`` of ``module``.

        InvalidRequest for an unknown module or kernel, bad arguments or launch shape, or an
        unknown handle; RemoteError ("illegal address") when a buffer is too small for the sizes
        passed. The session stays usable after either.
        """
        ...

    def load(self, kind: str, name: str, data: Any, options: Sequence[str] = ()) -> dict[str, Any]:
        """Load module ``name`` from ``data`` (``kind`` "cuda": CUDA C source, "ptx", "cubin";
        ``gpud_worker.modules``) for later launches; returns ``{"module": name, "functions":
        [kernel names, where known]}``. InvalidRequest for bad arguments, a name already loaded or
        a source the worker refuses to compile; RemoteError when it does not compile or load (the
        compiler's message), or when this device cannot run it."""
        ...

    def sync(self) -> None:
        """Wait until all work of the session has finished."""
        ...

    def info(self) -> dict[str, Any]:
        """``{"gpu": wire map, "mem_granted": int, "mem_used": int, "simulated": bool}``, and
        ``"mps"`` (the session's CUDA MPS variables) where the worker runs MPS."""
        ...

    def close(self) -> None:
        """Free everything the session holds. Idempotent."""
        ...


class Device(Protocol):
    """One GPU that sessions are opened on."""

    gpu: GpuInfo
    simulated: bool

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None) -> DeviceSession:
        """A new session that may hold at most ``mem_grant`` bytes at once; ``mps``: its CUDA MPS
        client variables (active thread percentage, pinned memory limit) where MPS runs."""
        ...

    def mem_used(self) -> int:
        """Bytes allocated by all sessions now."""
        ...

    def busy_fraction(self, now: float) -> float:
        """Fraction (0..1) of the last ~1 s before ``now`` spent running kernels or copies."""
        ...


class BusyTracker:
    """Busy intervals of one device, for a utilization figure over a sliding window.

    Work that is still running counts as busy up to ``now``. Overlapping work (several sessions at
    once) counts once. Thread-safe.
    """

    def __init__(self, window: float = BUSY_WINDOW_S) -> None:
        if window <= 0:
            raise ValueError("busy window must be positive")
        self.window = window
        self._lock = threading.Lock()
        self._done: collections.deque[tuple[float, float]] = collections.deque()
        self._running: dict[int, float] = {}
        self._next_token = 0

    def begin(self, t: float) -> int:
        """Mark work starting at ``t``; returns the token to pass to ``end``."""
        with self._lock:
            self._next_token += 1
            self._running[self._next_token] = t
            return self._next_token

    def end(self, token: int, t: float) -> None:
        """Mark the work of ``token`` finished at ``t``."""
        with self._lock:
            start = self._running.pop(token)
            done = self._done
            if done and start <= done[-1][1]:
                last_start, last_end = done[-1]
                done[-1] = (min(start, last_start), max(t, last_end))
            else:
                done.append((start, t))
            while done and done[0][1] < t - self.window:
                done.popleft()
            if len(done) > _MAX_BUSY_INTERVALS:
                (s0, _), (_, e1) = done.popleft(), done.popleft()
                done.appendleft((s0, e1))

    def fraction(self, now: float) -> float:
        """Busy fraction of ``[now - window, now]``."""
        lo = now - self.window
        with self._lock:
            spans = [(s, e) for s, e in self._done if e > lo and s < now]
            spans += [(s, now) for s in self._running.values() if s < now]
        busy = 0.0
        cur_s, cur_e = lo, lo
        for s, e in sorted((max(s, lo), min(e, now)) for s, e in spans):
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        return min(max(busy / self.window, 0.0), 1.0)


class SimulatedDevice:
    """A GPU simulated on the host: memory is host memory, kernels run on the CPU with numpy.

    Parameters
    ----------
    gpu:
        What the device announces; it is always labelled ``simulated``.
    clock:
        Monotonic clock for the busy intervals (the system clock by default).
    busy_window:
        Seconds of history behind ``busy_fraction``.
    """

    simulated: bool = True

    def __init__(
        self, gpu: GpuInfo, clock: Clock | None = None, busy_window: float = BUSY_WINDOW_S
    ) -> None:
        self.gpu = gpu if gpu.simulated else replace(gpu, simulated=True)
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._lock = threading.Lock()
        self._mem_used = 0
        self._next_handle = 0
        self._busy = BusyTracker(busy_window)

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None) -> SimulatedSession:
        if type(mem_grant) is not int or mem_grant < 0:
            raise InvalidRequest(f"memory grant must be an int >= 0, got {mem_grant!r}")
        log.debug("%s: session opened with a grant of %d bytes", self.gpu.uuid, mem_grant)
        return SimulatedSession(self, mem_grant, mps)

    def mem_used(self) -> int:
        with self._lock:
            return self._mem_used

    def busy_fraction(self, now: float) -> float:
        return self._busy.fraction(now)

    def _reserve(self, nbytes: int) -> int:
        """Take ``nbytes`` of device memory and return a device-wide unique handle."""
        with self._lock:
            free = self.gpu.mem - self._mem_used
            if nbytes > free:
                raise OutOfMemory(
                    f"allocation of {nbytes} bytes exceeds the device's free memory "
                    f"({free} of {self.gpu.mem} bytes free)"
                )
            self._mem_used += nbytes
            self._next_handle += 1
            return self._next_handle

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._mem_used -= nbytes

    @contextmanager
    def _working(self) -> Iterator[None]:
        """Count the enclosed work (a kernel or a copy) as device busy time."""
        token = self._busy.begin(self.clock.monotonic())
        try:
            yield
        finally:
            self._busy.end(token, self.clock.monotonic())


class SimulatedSession:
    """A session on a ``SimulatedDevice``. Thread-safe; calls on one session run one at a time."""

    def __init__(
        self, device: SimulatedDevice, mem_grant: int, mps: Mapping[str, str] | None = None
    ) -> None:
        self._device = device
        self._grant = mem_grant
        self._mps = dict(mps) if mps else None  # recorded only: a simulated GPU has no MPS
        self._lock = threading.Lock()
        self._bufs: dict[int, bytearray] = {}
        self._used = 0
        self._closed = False
        self._modules: dict[str, tuple[str, ...]] = {}  # loaded module -> its (built-in) kernels

    def alloc(self, nbytes: int) -> int:
        if type(nbytes) is not int or nbytes < 1:
            raise InvalidRequest(f"nbytes must be an int >= 1, got {nbytes!r}")
        with self._lock:
            self._check_open()
            if self._used + nbytes > self._grant:
                raise OutOfMemory(
                    f"allocation of {nbytes} bytes exceeds the session's memory grant "
                    f"({self._used} of {self._grant} bytes in use)"
                )
            handle = self._device._reserve(nbytes)
            try:
                buf = bytearray(nbytes)
            except MemoryError:
                self._device._release(nbytes)
                raise OutOfMemory(f"host memory exhausted allocating {nbytes} bytes") from None
            self._bufs[handle] = buf
            self._used += nbytes
            return handle

    def free(self, handle: int) -> None:
        with self._lock:
            self._check_open()
            buf = self._buf(handle)
            del self._bufs[handle]
            self._used -= len(buf)
            self._device._release(len(buf))

    def htod(self, handle: int, offset: int, data: Any) -> None:
        try:
            view = memoryview(data)
        except TypeError:
            raise InvalidRequest("htod data must be a bytes-like object") from None
        if not view.c_contiguous:
            raise InvalidRequest("htod data must be contiguous")
        view = view.cast("B")
        with self._lock:
            self._check_open()
            buf = self._buf(handle)
            end = _check_range(handle, len(buf), offset, len(view))
            with self._device._working():
                # Through a memoryview: one memcpy. ``buf[a:b] = view`` would first copy ``view``
                # into a temporary bytearray of its size (CPython does that for any non-bytearray).
                memoryview(buf)[offset:end] = view

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None) -> bytes:
        with self._lock:
            self._check_open()
            buf = self._buf(handle)
            if nbytes is None and type(offset) is int:
                nbytes = max(len(buf) - offset, 0)
            end = _check_range(handle, len(buf), offset, nbytes)
            with self._device._working():
                # The one copy (a real GPU's device-to-host transfer): the worker sends these
                # bytes as they are, and they must not change while zmq sends or re-sends them.
                return bytes(memoryview(buf)[offset:end])

    def launch(
        self,
        module: str,
        name: str,
        grid: Dims,
        block: Dims,
        args: Sequence[Arg],
        shared_mem: int = 0,
    ) -> None:
        sig = lookup(BUILTIN_MODULE, self._builtin_of(module, name))
        check_args(name, args)
        _check_dims("grid", grid)
        _check_dims("block", block)
        threads = block[0] * block[1] * block[2]
        if threads > MAX_THREADS_PER_BLOCK:
            raise InvalidRequest(
                f"block of {threads} threads, at most {MAX_THREADS_PER_BLOCK} per block"
            )
        if type(shared_mem) is not int or not 0 <= shared_mem <= MAX_SHARED_MEM:
            raise InvalidRequest(f"shared_mem must be an int in 0..{MAX_SHARED_MEM}")
        values = [value for _, value in args]
        with self._lock:
            self._check_open()
            bufs: dict[int, bytearray] = {}
            for i, (tag, value) in enumerate(args):
                if tag == "ptr":
                    buf = self._bufs.get(int(value))
                    if buf is None:
                        raise InvalidRequest(
                            f"kernel {name!r} argument {i} ({sig.names[i]}): unknown handle {value}"
                        )
                    bufs[i] = buf
            for i, elems in sig.footprint(values).items():
                if elems * F32_BYTES > len(bufs[i]):
                    raise RemoteError(
                        f"illegal address: kernel {name!r} argument {i} ({sig.names[i]}) "
                        f"reaches {elems * F32_BYTES} bytes, allocation {values[i]} "
                        f"holds {len(bufs[i])}"
                    )
            resolved: list[Resolved] = [
                np.frombuffer(bufs[i], dtype=np.float32, count=len(bufs[i]) // F32_BYTES)
                if i in bufs
                else value
                for i, value in enumerate(values)
            ]
            with self._device._working():
                try:
                    sig.run(*resolved)
                except MemoryError:
                    raise RemoteError(f"kernel {name!r} failed: host memory exhausted") from None

    def load(self, kind: str, name: str, data: Any, options: Sequence[str] = ()) -> dict[str, Any]:
        """The SIMULATED GPU compiles nothing: it accepts a CUDA C module only when every kernel
        in it has the name and the parameter types of a built-in kernel, and then runs the
        built-in (numpy) kernel of that name, whatever the module's code says. Anything else,
        PTX and cubins included, is a RemoteError."""
        kind, name, _ = check_load_args(kind, name, list(options))
        if kind != "cuda":
            raise RemoteError(
                f"the SIMULATED GPU runs only the built-in kernels: it cannot load a {kind} "
                "module (a worker on a real GPU can)"
            )
        sigs = cuda_signatures(check_cuda_source(decode_text(data, kind)))
        builtin = {n: tuple((t,) for t in s.params) for n, s in BUILTINS.items()}
        foreign = [describe(n, s) for n, s in sigs.items() if builtin.get(n) != tuple(p.accepts for p in s)]
        if foreign or not sigs:
            raise RemoteError(
                "the SIMULATED GPU runs only the built-in kernels ("
                + ", ".join(s.signature() for s in BUILTINS.values())
                + "), by name and parameter types; this module declares "
                + (", ".join(foreign) if foreign else "no __global__ kernel")
            )
        with self._lock:
            self._check_open()
            if name in self._modules:
                raise InvalidRequest(f"module {name!r} is already loaded in this session")
            if len(self._modules) >= MAX_MODULES:
                raise InvalidRequest(f"a session holds at most {MAX_MODULES} modules")
            self._modules[name] = tuple(sorted(sigs))
        return {"module": name, "functions": sorted(sigs)}

    def _builtin_of(self, module: str, name: str) -> str:
        """The built-in kernel that ``name`` of ``module`` runs (modules loaded by ``load`` map
        their kernels to the built-ins of the same names)."""
        if module == BUILTIN_MODULE:
            return name
        if type(module) is not str:
            raise InvalidRequest(f"module must be a string, got {module!r}")
        with self._lock:
            kernels = self._modules.get(module)
            if kernels is None:
                loaded = ", ".join(sorted([BUILTIN_MODULE, *self._modules]))
                raise InvalidRequest(f"module {module!r} unknown (loaded: {loaded})")
        if name not in kernels:
            raise InvalidRequest(
                f"unknown kernel {name!r} in module {module!r} (known: {', '.join(kernels)})"
            )
        return name

    def sync(self) -> None:
        with self._lock:  # kernels and copies run synchronously: holding the lock is the wait
            self._check_open()

    def info(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            info: dict[str, Any] = {
                "gpu": gpu_info_to_wire(self._device.gpu),
                "mem_granted": self._grant,
                "mem_used": self._used,
                "simulated": True,
            }
            if self._mps is not None:
                info["mps"] = dict(self._mps)
            return info

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._bufs.clear()
            self._device._release(self._used)
            log.debug("%s: session closed, %d bytes freed", self._device.gpu.uuid, self._used)
            self._used = 0

    def _check_open(self) -> None:
        if self._closed:
            raise SessionLost("session closed")

    def _buf(self, handle: int) -> bytearray:
        buf = self._bufs.get(handle) if type(handle) is int else None
        if buf is None:
            raise InvalidRequest(f"unknown handle {handle!r}")
        return buf


def _check_range(handle: int, size: int, offset: Any, nbytes: Any) -> int:
    """Check ``[offset, offset + nbytes)`` lies in an allocation of ``size`` bytes; returns the end."""
    if type(offset) is not int or offset < 0:
        raise InvalidRequest(f"offset must be an int >= 0, got {offset!r}")
    if type(nbytes) is not int or nbytes < 0:
        raise InvalidRequest(f"nbytes must be an int >= 0, got {nbytes!r}")
    end = offset + nbytes
    if end > size:
        raise InvalidRequest(
            f"range {offset}..{end} is outside allocation {handle} of {size} bytes"
        )
    return end


def _check_dims(what: str, dims: Any) -> None:
    if (
        not isinstance(dims, tuple | list)
        or len(dims) != 3
        or not all(type(d) is int and d >= 1 for d in dims)
    ):
        raise InvalidRequest(f"{what} must be three positive ints, got {dims!r}")
