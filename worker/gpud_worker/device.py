"""The device interface behind session CALLs, and the simulated GPU.

This module owns what a session does to a GPU (docs/PROTOCOL.md §5.4): ``Device`` and
``DeviceSession`` are the interface the worker's session code calls; ``SimulatedDevice`` implements
it for machines without a GPU (DESIGN.md §5): device memory is host memory, the built-in kernels of
``gpud_worker.kernels`` run on the CPU with numpy, and utilization is modelled from the time spent
running kernels and copies. It is always labelled simulated and never claims to be a real GPU.
``_BaseDevice`` and ``_BaseSession`` hold what the simulated GPU and the pycuda backend
(``gpud_worker.cuda``) share: memory accounting, busy time, the handle table, the memory grant and
the checks of a call's arguments.

A direct ``dtoh`` is answered from the simulated GPU's memory itself, without a copy
(``dtoh_lent``): the bytes stay as they were read until zmq is done sending them, since a write of
that memory waits for the send's tracker (``hold``). Memory that is not host memory (a real GPU,
a session's own process) is copied, as for every relayed ``dtoh`` (the worker keeps those replies
for a resend).
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

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
    KernelSig,
    Resolved,
    check_args,
    lookup,
)
from gpud_worker.modules import (
    MAX_MODULES,
    cache_key,
    check_cuda_source,
    check_load_args,
    cuda_signatures,
    decode_text,
    describe,
    wrap_extern_c,
)
from gpud_worker.nvcc import NvccCompiler

if TYPE_CHECKING:
    from gpud_worker.jobs import JobGrant

log = logging.getLogger(__name__)

SIMULATED_CC = (8, 0)  # the architecture a SIMULATED GPU compiles loaded modules for (to show their errors)
_COMPILED_KEPT = 256  # sources a simulated device remembers as compiling, so a reload compiles nothing

BUSY_WINDOW_S = 1.0  # seconds of history behind busy_fraction()
MAX_SHARED_MEM = 48 * 1024  # bytes of dynamic shared memory per block, CUDA's default limit
_MAX_BUSY_INTERVALS = 4096  # past this, the oldest busy intervals are merged (over-counts a little)

LEND_WAIT_S = 30.0  # how long a write waits for the wire to let go of lent device memory
MAX_LENT = 64  # lent views of one session not yet let go of; past it, dtoh_lent copies

Dims = tuple[int, int, int]
A = TypeVar("A")  # what a session's handle table maps a handle to (its allocation)


class Tracker(Protocol):
    """What tells that the wire is done with a buffer it sends without a copy
    (``zmq.MessageTracker``)."""

    @property
    def done(self) -> bool: ...


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

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None, out: Any = None) -> bytes | memoryview:
        """Copy ``nbytes`` from the allocation at ``offset`` (None: to its end); bounds checked.
        With ``out`` (a writable buffer of at least that many bytes) the bytes go there and a view
        of them is returned."""
        ...

    def dtoh_lent(self, handle: int, offset: int, nbytes: int | None = None) -> bytes | memoryview:
        """``dtoh`` for a reply sent without a copy: device memory itself where it is host
        memory (the simulated GPU: a read-only view of it, lent until ``hold``'s tracker is done),
        else a copy as ``dtoh`` makes. Whoever sends a lent view passes it and the tracker of its
        send to ``hold``: until then the view must not outlive the next call."""
        ...

    def hold(self, view: memoryview, tracker: Tracker) -> None:
        """``view`` (from ``dtoh_lent``) is being sent: writes to its memory (``htod``, a launch)
        wait until ``tracker`` is done, so the bytes sent are the bytes read. A view that is a
        copy needs nothing."""
        ...

    def extent(self, handle: int, offset: int, nbytes: int | None = None) -> int:
        """The bytes a copy of ``nbytes`` at ``offset`` covers (None: to the allocation's end);
        InvalidRequest for an unknown handle or a range outside the allocation."""
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

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None, tenant: str = "default",
                     grant: JobGrant | None = None) -> DeviceSession:
        """A new session that may hold at most ``mem_grant`` bytes at once; ``mps``: its CUDA MPS
        client variables (active thread percentage, pinned memory limit) where MPS runs;
        ``tenant``: whom it is for (a device that runs sessions as pool users picks one by it);
        ``grant``: the DISPATCH's (a device that runs sessions in processes of their own limits
        each process by its host memory and CPU)."""
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


class _BaseDevice:
    """What ``SimulatedDevice`` and ``gpud_worker.cuda.CudaDevice`` share: the bytes their
    sessions hold (``_count``; the simulated GPU's ``_reserve`` also checks its capacity) and the
    busy time behind ``busy_fraction``."""

    gpu: GpuInfo
    simulated: bool

    def __init__(self, clock: Clock | None, busy_window: float) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._lock = threading.Lock()
        self._mem_used = 0
        self._busy = BusyTracker(busy_window)

    def mem_used(self) -> int:
        """Bytes allocated by all sessions now (on a real GPU: not its contexts' own overhead)."""
        with self._lock:
            return self._mem_used

    def busy_fraction(self, now: float) -> float:
        return self._busy.fraction(now)

    def _count(self, delta: int) -> None:
        """Count ``delta`` more bytes (less, when negative) held by sessions."""
        with self._lock:
            self._mem_used += delta

    def _release(self, nbytes: int) -> None:
        self._count(-nbytes)

    @contextmanager
    def _working(self) -> Iterator[None]:
        """Count the enclosed work (a kernel or a copy) as device busy time."""
        token = self._busy.begin(self.clock.monotonic())
        try:
            yield
        finally:
            self._busy.end(token, self.clock.monotonic())


class SimulatedDevice(_BaseDevice):
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
        self, gpu: GpuInfo, clock: Clock | None = None, busy_window: float = BUSY_WINDOW_S,
        compiler: NvccCompiler | None = None,
    ) -> None:
        self.gpu = gpu if gpu.simulated else replace(gpu, simulated=True)
        super().__init__(clock, busy_window)
        self._next_handle = 0
        self.compiler = compiler if compiler is not None else NvccCompiler()
        self._compiled: collections.OrderedDict[str, None] = collections.OrderedDict()

    def compile_check(self, source: str, options: Sequence[str]) -> bool:
        """Compile a loaded module's CUDA C ``source`` with nvcc, where this host has it, only so
        that its errors surface as they would on a real GPU (RemoteError, nvcc's message); the
        cubin is thrown away. False: no nvcc here, nothing was compiled."""
        if self.compiler.nvcc is None:
            return False
        key = cache_key("cuda", source.encode(), options, SIMULATED_CC, self.compiler.nvcc)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return True
        self.compiler.compile(wrap_extern_c(source), f"sm_{SIMULATED_CC[0]}{SIMULATED_CC[1]}", options)
        with self._lock:
            self._compiled[key] = None
            while len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return True

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None, tenant: str = "default",
                     grant: JobGrant | None = None) -> SimulatedSession:
        _check_grant(mem_grant)
        log.debug("%s: session opened with a grant of %d bytes", self.gpu.uuid, mem_grant)
        return SimulatedSession(self, mem_grant, mps)

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


class _BaseSession(abc.ABC, Generic[A]):
    """What ``SimulatedSession`` and ``gpud_worker.cuda.CudaSession`` share: the handle table
    (handle -> allocation ``A``) and its checks, the memory grant's accounting, the closed check,
    ``info``, and the checks of a call's arguments. How memory is allocated and copied and how
    kernels run is each subclass's own (``_allocate``, ``_free``, ``_size``). Methods and hooks
    marked "lock held" run under ``_lock``; calls on one session run one at a time.
    """

    _device: _BaseDevice
    _modules: Mapping[str, object]  # loaded module name -> what the subclass keeps of it

    def __init__(self, device: _BaseDevice, mem_grant: int, mps: Mapping[str, str] | None) -> None:
        self._device = device
        self._grant = mem_grant
        self._mps = dict(mps) if mps else None
        self._lock = threading.Lock()
        self._allocs: dict[int, A] = {}  # handle -> allocation
        self._used = 0  # bytes allocated, against the grant
        self._closed = False

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
            handle, alloc = self._allocate(nbytes)
            self._allocs[handle] = alloc
            self._used += nbytes
            return handle

    def free(self, handle: int) -> None:
        with self._lock:
            self._check_open()
            nbytes = self._free(handle, self._alloc_of(handle))
            self._used -= nbytes
            self._device._release(nbytes)

    @property
    def used(self) -> int:
        """Bytes the session holds now, against its grant."""
        return self._used

    def info(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            info: dict[str, Any] = {
                "gpu": gpu_info_to_wire(self._device.gpu),
                "mem_granted": self._grant,
                "mem_used": self._used,
                "simulated": self._device.simulated,
            }
            if self._mps is not None:
                info["mps"] = dict(self._mps)
            return info

    def extent(self, handle: int, offset: int, nbytes: int | None = None) -> int:
        with self._lock:
            self._check_open()
            _, end = self._span(handle, offset, nbytes)
            return end - offset

    @abc.abstractmethod
    def dtoh(self, handle: int, offset: int, nbytes: int | None = None, out: Any = None) -> bytes | memoryview:
        """As ``DeviceSession.dtoh``."""

    def dtoh_lent(self, handle: int, offset: int, nbytes: int | None = None) -> bytes | memoryview:
        """A copy, as ``dtoh`` (device memory that is not host memory cannot be lent)."""
        return self.dtoh(handle, offset, nbytes)

    def hold(self, view: memoryview, tracker: Tracker) -> None:
        """Nothing to hold: ``dtoh_lent`` copies."""

    # ---------------------------------------------------------------- each backend's own

    @abc.abstractmethod
    def _allocate(self, nbytes: int) -> tuple[int, A]:
        """(Lock held, grant checked) Allocate ``nbytes`` and take them from the device
        (``_reserve``); returns the new handle and the allocation to keep under it."""

    @abc.abstractmethod
    def _free(self, handle: int, alloc: A) -> int:
        """(Lock held) Free ``alloc`` and drop ``handle`` from ``_allocs``; returns its bytes."""

    @abc.abstractmethod
    def _size(self, alloc: A) -> int:
        """The bytes of an allocation."""

    # ---------------------------------------------------------------- shared checks

    def _check_open(self) -> None:
        if self._closed:
            raise SessionLost("session closed")

    def _alloc_of(self, handle: Any) -> A:
        found = self._allocs.get(handle) if type(handle) is int else None
        if found is None:
            raise InvalidRequest(f"unknown handle {handle!r}")
        return found

    def _span(self, handle: Any, offset: Any, nbytes: Any) -> tuple[A, int]:
        """(Lock held) The allocation of ``handle`` and the end of the copy of ``nbytes`` at
        ``offset`` in it (``nbytes`` None: to its end); InvalidRequest for an unknown handle or a
        range outside the allocation."""
        alloc = self._alloc_of(handle)
        size = self._size(alloc)
        if nbytes is None and type(offset) is int:
            nbytes = max(size - offset, 0)
        return alloc, _check_range(handle, size, offset, nbytes)

    def _ptr_allocs(self, args: Sequence[Arg], where: Callable[[int], str]) -> dict[int, A]:
        """(Lock held) The allocation of each pointer argument of a launch, by its index;
        InvalidRequest ``"{where(i)}: unknown handle ..."`` for a handle not in the table."""
        found: dict[int, A] = {}
        for i, (tag, value) in enumerate(args):
            if tag == "ptr":
                alloc = self._allocs.get(int(value))
                if alloc is None:
                    raise InvalidRequest(f"{where(i)}: unknown handle {value}")
                found[i] = alloc
        return found

    def _check_loadable(self, name: str) -> None:
        """(Lock held) The session is open and has room for a new module ``name``."""
        self._check_open()
        if name in self._modules:
            raise InvalidRequest(f"module {name!r} is already loaded in this session")
        if len(self._modules) >= MAX_MODULES:
            raise InvalidRequest(f"a session holds at most {MAX_MODULES} modules")

    def _unknown_module(self, module: str) -> InvalidRequest:
        """(Lock held) The error for a launch in a module that is not loaded."""
        loaded = ", ".join(sorted([BUILTIN_MODULE, *self._modules]))
        return InvalidRequest(f"module {module!r} unknown (loaded: {loaded})")


class SimulatedSession(_BaseSession[bytearray]):
    """A session on a ``SimulatedDevice``. Thread-safe; calls on one session run one at a time."""

    _device: SimulatedDevice
    _modules: dict[str, tuple[str, ...]]

    def __init__(
        self, device: SimulatedDevice, mem_grant: int, mps: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(device, mem_grant, mps)  # mps is recorded only: a simulated GPU has no MPS
        self._modules = {}  # loaded module -> its (built-in) kernels
        # Allocations lent to the wire (dtoh_lent): id of the buffer -> it, and the trackers of
        # the sends that still read it. Writes to a buffer wait for its trackers (_settle).
        self._lent: dict[int, tuple[bytearray, list[Tracker]]] = {}

    def _allocate(self, nbytes: int) -> tuple[int, bytearray]:
        handle = self._device._reserve(nbytes)
        try:
            buf = bytearray(nbytes)
        except MemoryError:
            self._device._release(nbytes)
            raise OutOfMemory(f"host memory exhausted allocating {nbytes} bytes") from None
        return handle, buf

    def _free(self, handle: int, alloc: bytearray) -> int:
        del self._allocs[handle]
        self._lent.pop(id(alloc), None)  # nothing writes it any more: what is sent stays as it is
        return len(alloc)

    def _size(self, alloc: bytearray) -> int:
        return len(alloc)

    def htod(self, handle: int, offset: int, data: Any) -> None:
        view = _byte_view(data)
        with self._lock:
            self._check_open()
            buf, end = self._span(handle, offset, len(view))
            self._settle(buf)
            with self._device._working():
                # Through a memoryview: one memcpy. ``buf[a:b] = view`` would first copy ``view``
                # into a temporary bytearray of its size (CPython does that for any non-bytearray).
                memoryview(buf)[offset:end] = view

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None, out: Any = None) -> bytes | memoryview:
        with self._lock:
            self._check_open()
            buf, end = self._span(handle, offset, nbytes)
            with self._device._working():
                if out is not None:
                    dest = _out_view(out, end - offset)
                    dest[:] = memoryview(buf)[offset:end]
                    return dest
                # The one copy (a real GPU's device-to-host transfer): the worker sends these
                # bytes as they are, and they must not change while zmq sends or re-sends them.
                return bytes(memoryview(buf)[offset:end])

    def dtoh_lent(self, handle: int, offset: int, nbytes: int | None = None) -> bytes | memoryview:
        """The device memory itself, read-only, without a copy (the bytes a real GPU's transfer
        would have put in host memory are here already); a copy (``dtoh``) while MAX_LENT views
        are still being sent (a client that does not read its replies pins no more than that)."""
        with self._lock:
            self._check_open()
            buf, end = self._span(handle, offset, nbytes)
            if self._lent_count() < MAX_LENT:
                return memoryview(buf)[offset:end].toreadonly()
        return self.dtoh(handle, offset, nbytes)

    def hold(self, view: memoryview, tracker: Tracker) -> None:
        buf = view.obj
        with self._lock:
            if type(buf) is not bytearray:
                return  # a copy (dtoh_lent past MAX_LENT): nothing writes it
            entry = self._lent.get(id(buf))
            if entry is None:
                self._lent[id(buf)] = (buf, [tracker])
            else:
                entry[1].append(tracker)

    def _lent_count(self) -> int:
        """(Lock held) Lent views not let go of yet, forgetting those that were."""
        n = 0
        for key, (_, trackers) in list(self._lent.items()):
            trackers[:] = [t for t in trackers if not t.done]
            if trackers:
                n += len(trackers)
            else:
                del self._lent[key]
        return n

    def _settle(self, buf: bytearray) -> None:
        """(Lock held) Wait until the wire no longer reads views of ``buf`` lent by
        ``dtoh_lent``, so a write leaves the bytes of replies still being sent as they were read;
        RemoteError after LEND_WAIT_S (their client does not read them), the memory unwritten."""
        entry = self._lent.pop(id(buf), None)
        if entry is None:
            return
        trackers = entry[1]
        deadline = time.monotonic() + LEND_WAIT_S
        pause = 1e-4
        while True:
            trackers[:] = [t for t in trackers if not t.done]
            if not trackers:
                return
            if time.monotonic() >= deadline:
                self._lent[id(buf)] = entry
                raise RemoteError(f"earlier dtoh replies of this memory were not sent within {LEND_WAIT_S:g} s "
                                  "(their client does not read them): it is not written until they are")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

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
        _check_launch_shape(grid, block, shared_mem)
        values = [value for _, value in args]
        with self._lock:
            self._check_open()
            bufs = self._ptr_allocs(args, lambda i: f"kernel {name!r} argument {i} ({sig.names[i]})")
            _check_footprint(name, sig, values, {i: len(buf) for i, buf in bufs.items()})
            for buf in bufs.values():  # a kernel may write any buffer it is given
                self._settle(buf)
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
        """The SIMULATED GPU runs no loaded code: it accepts a CUDA C module only when every
        kernel in it has the name and the parameter types of a built-in kernel, and then runs the
        built-in (numpy) kernel of that name, whatever the module's code says. Anything else,
        PTX and cubins included, is a RemoteError. Where nvcc is here, the source is compiled
        anyway, so that one that would not compile on a real GPU fails here too
        (``compile_check``); the result's ``compiled`` says whether it was."""
        kind, name, options = check_load_args(kind, name, list(options))
        if kind != "cuda":
            raise RemoteError(
                f"the SIMULATED GPU runs only the built-in kernels: it cannot load a {kind} "
                "module (a worker on a real GPU can)"
            )
        source = decode_text(data, kind)
        sigs = cuda_signatures(check_cuda_source(source))
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
            self._check_loadable(name)  # before a compilation that would be wasted
        compiled = self._device.compile_check(source, options)
        with self._lock:
            self._check_loadable(name)
            self._modules[name] = tuple(sorted(sigs))
        result: dict[str, Any] = {"module": name, "functions": sorted(sigs), "compiled": compiled}
        if not compiled:
            result["note"] = ("not compiled: this worker has no nvcc, so errors in the source do not show "
                              "here; the SIMULATED GPU runs its built-in kernels of these names")
        return result

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
                raise self._unknown_module(module)
        _check_kernel(module, name, kernels)  # kernels is never empty: load refuses that
        return name

    def sync(self) -> None:
        with self._lock:  # kernels and copies run synchronously: holding the lock is the wait
            self._check_open()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._allocs.clear()
            self._lent.clear()
            self._device._release(self._used)
            log.debug("%s: session closed, %d bytes freed", self._device.gpu.uuid, self._used)
            self._used = 0


def _check_grant(mem_grant: Any) -> None:
    """A session's memory grant is an int >= 0."""
    if type(mem_grant) is not int or mem_grant < 0:
        raise InvalidRequest(f"memory grant must be an int >= 0, got {mem_grant!r}")


def _byte_view(data: Any) -> memoryview:
    """htod's ``data`` as a flat view of bytes; InvalidRequest unless a contiguous buffer."""
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidRequest("htod data must be a bytes-like object") from None
    if not view.c_contiguous:
        raise InvalidRequest("htod data must be contiguous")
    return view.cast("B")


def _out_view(out: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` of the writable buffer ``out``, as bytes."""
    view = _byte_view(out)
    if view.readonly or len(view) < nbytes:
        raise InvalidRequest(f"dtoh needs a writable buffer of at least {nbytes} bytes")
    return view[:nbytes]


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


def _check_launch_shape(grid: Any, block: Any, shared_mem: Any) -> None:
    """A launch's grid, block (at most ``MAX_THREADS_PER_BLOCK`` threads) and dynamic shared
    memory (at most ``MAX_SHARED_MEM`` bytes)."""
    _check_dims("grid", grid)
    _check_dims("block", block)
    threads = block[0] * block[1] * block[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise InvalidRequest(f"block of {threads} threads, at most {MAX_THREADS_PER_BLOCK} per block")
    if type(shared_mem) is not int or not 0 <= shared_mem <= MAX_SHARED_MEM:
        raise InvalidRequest(f"shared_mem must be an int in 0..{MAX_SHARED_MEM}")


def _check_kernel(module: str, name: str, known: Sequence[str]) -> None:
    """InvalidRequest unless ``name`` is one of ``known``, the kernels of ``module``."""
    if name not in known:
        raise InvalidRequest(
            f"unknown kernel {name!r} in module {module!r} (known: {', '.join(known) or 'none'})"
        )


def _check_footprint(
    name: str, sig: KernelSig, values: Sequence[Any], sizes: Mapping[int, int]
) -> None:
    """A built-in kernel's buffers (``sizes``: bytes by argument index) hold what it reaches with
    ``values`` (``KernelSig.footprint``); else RemoteError "illegal address", before it runs."""
    for i, elems in sig.footprint(values).items():
        if elems * F32_BYTES > sizes[i]:
            raise RemoteError(
                f"illegal address: kernel {name!r} argument {i} ({sig.names[i]}) "
                f"reaches {elems * F32_BYTES} bytes, allocation {values[i]} holds {sizes[i]}"
            )
