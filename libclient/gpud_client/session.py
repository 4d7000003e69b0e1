"""Device sessions: the C-like API on one GPU (allocate, copy, launch, synchronize) and session
replay.

This module owns :class:`Session` and what keeps it alive through the loss of its worker or GPU: a
lost session is opened again and rebuilt from its journal (:mod:`gpud_client.journal`) inside the
call that found it lost, so the caller sees only a delay. A Session talks to the broker through the
public methods of its :class:`~gpud_client.connection.Connection` (submit a CALL, wait for it,
keep a session's lease alive) and reads its limits from the client's :class:`SessionSettings`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from gpud.errors import (
    GpudError,
    GpuFault,
    InternalError,
    InvalidRequest,
    ProtocolError,
    SessionLost,
    WorkerLost,
)
from gpud.protocol import Message, id_text, new_id, parse_dims
from gpud_client import _request
from gpud_client._request import DevicePtr
from gpud_client.chunks import plan, run_windowed
from gpud_client.connection import Connection, Converter, Pending, collect
from gpud_client.direct import PROBE_S, DataLink, parse_offer
from gpud_client.journal import Entry, Journal

if TYPE_CHECKING:
    from gpud_client._request import BytesLike

__all__ = [
    "DEFAULT_JOURNAL_BYTES",
    "DEFAULT_SESSION_REPLAYS",
    "Session",
    "SessionSettings",
    "open_session",
]

log = logging.getLogger(__name__)

DEFAULT_JOURNAL_BYTES = 64 << 20
"""Bytes each session's journal may hold (copied buffers included) for session replay."""
DEFAULT_SESSION_REPLAYS = 3
"""Times one session may be opened again and replayed before its loss reaches the caller."""

T = TypeVar("T")


@dataclass(slots=True)
class SessionSettings:
    """The client's settings that its sessions read at each call (the client may change
    ``timeout`` at any time): see :class:`~gpud_client.client.Client` for each."""

    timeout: float
    journal_bytes: int
    session_replays: int
    chunk_bytes: int
    chunk_window: int
    data_path: str = "auto"  # auto | direct | broker (PROTOCOL.md §10.1)
    fallbacks: int = 0  # sessions of this client that fell back to the broker (logged once)


def open_session(
    conn: Connection, need: dict[str, Any], limit: float, replaces: bytes | None = None
) -> tuple[bytes, str, dict[str, Any], Any]:
    """Send a session REQUEST and wait for it: ``(session id, worker, gpu, data)`` (``data``:
    the direct path's offer, or None). ``replaces``
    names a lost session that this one replaces (the broker prefers the lost worker's
    replica for it, PROTOCOL.md §9.4)."""
    rid = new_id()
    body = {"replaces": replaces} if replaces is not None else None
    frames = _request.request_frames(rid, "session", need, _request.timeout_ms(limit), body)

    def convert(msg: Message) -> tuple[bytes, str, dict[str, Any], Any]:
        return _request.parse_session_open(msg, rid)

    what = f"session request {id_text(rid)}"
    conn.submit(rid, frames, what)
    return collect(Pending(conn, rid, convert, limit, what, cancellable=True))


class Session:
    """A device session pinned to one GPU: allocate, copy, launch, synchronize (the C-like API).

    Made by :meth:`~gpud_client.client.Client.session`; use it as a context manager, or call
    :meth:`close`. Each method takes an optional keyword ``timeout`` (seconds; the client's
    timeout by default).

    Session replay: the session journals its allocations, frees, copies to the device and launches
    (:class:`~gpud_client.journal.Journal`, bounded by the client's ``journal_bytes``). When a call
    fails with SESSION_LOST or GPU_FAULT (the session's worker or GPU was lost), the session opens a
    new one with the same need (its REQUEST names the lost one in ``replaces``, so the broker tries
    the lost worker's replica first), replays the journal there, and sends the failed call again,
    all inside that call: the caller sees only a delay. The pointers the caller holds stay valid
    (the session maps them to the new session's handles), :attr:`id`, :attr:`worker` and
    :attr:`gpu` then describe the new session. A failed call is not in the journal (only ops that
    succeeded are), so a launch that was in flight runs once on the new session, not twice. The
    loss reaches the caller (SessionLost, or the GpuFault as it came) when the journal is off or
    went past its bound, after the client's ``session_replays`` replays of this session, or when
    the new session cannot be opened or rebuilt (no capacity, less memory...).

    Attributes
    ----------
    id:
        The session id (16 bytes); a new one after a replay.
    worker:
        Name of the worker that holds it now.
    gpu:
        The GPU it is pinned to now: uuid, index, model, mem, cc, simulated.
    """

    def __init__(
        self,
        conn: Connection,
        settings: SessionSettings,
        sid: bytes,
        worker: str,
        gpu: dict[str, Any],
        *,
        need: dict[str, Any] | None = None,
        journal: Journal | None = None,
        data: Any = None,
    ) -> None:
        self._conn = conn
        self._settings = settings
        self.id = sid
        self.worker = worker
        self.gpu = gpu
        self._closed = False
        self._key = sid  # what this session's DevicePtrs carry, whatever ``id`` becomes
        self._need = need  # None: it cannot be opened again
        self._journal = journal if journal is not None else Journal(0)
        self._handles: dict[int, int] = {}  # the caller's handle -> the current session's
        self._top = 0  # the largest handle handed to the caller: never hand out one twice
        self._replays = 0
        self._modules: dict[str, list[str]] = {}  # modules loaded (module_load) -> their kernels
        self._link: Connection | DataLink = conn  # where CALLs go: the broker, or the worker (§10)
        self._cap: bytes | None = None  # the capability of the direct path
        self._path_why = ""  # why the CALLs are relayed through the broker
        self._take_path(data)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"on {self.worker}"
        return f"<gpud_client.Session {id_text(self.id)} {state}>"

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except GpudError as close_exc:  # do not hide the error that is propagating
            log.warning("closing session %s failed: %s", id_text(self.id), close_exc)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def journal(self) -> Journal:
        """The session's journal (read it, do not record into it)."""
        return self._journal

    def _take_path(self, data: Any) -> None:
        """Choose the path of the current session's CALLs from its REPLY's ``data`` and the
        client's ``data_path``: direct when offered and the worker answers the probe, else
        relayed (``auto``; logged once per client) or an error (``direct``)."""
        old = self._link
        if isinstance(old, DataLink):
            old.close()
        self._link, self._cap = self._conn, None
        settings = self._settings
        offer = parse_offer(data)
        if settings.data_path == "broker":
            self._path_why = "the client's data_path is broker"
            if offer is not None and not offer.relay:
                self._abandon()
                raise GpudError(f"session {id_text(self.id)}: the client's data_path is broker, and the "
                                "broker's is direct: it relays no session CALL")
            return
        why = ""
        if offer is None:
            why = "the broker offered no direct path (worker without data_bind, or broker data_path broker)"
        else:
            link = self._conn.data_link(offer, self.id)
            silent = link.probe(PROBE_S)
            if not silent:
                self._link, self._cap, self._path_why = link, offer.cap, ""
                log.debug("session %s calls worker %s directly at %s", id_text(self.id), self.worker, offer.endpoint)
                return
            link.close()
            why = f"the worker's data endpoint {' and '.join(silent)} did not answer"
        self._path_why = why
        if settings.data_path == "direct" or (offer is not None and not offer.relay):
            self._abandon()
            whose = "the client's" if settings.data_path == "direct" else "the broker's"
            raise GpudError(f"session {id_text(self.id)}: no direct path ({why}) and {whose} data_path is direct")
        settings.fallbacks += 1
        log.log(logging.WARNING if settings.fallbacks == 1 else logging.DEBUG,
                "session %s: %s; its calls are relayed through the broker", id_text(self.id), why)

    def info(self) -> dict[str, Any]:
        """Where the session is and how its CALLs travel: ``id``, ``worker``, ``gpu``, ``path``
        (``direct``: straight to the worker; ``broker``: relayed), ``endpoint`` (the worker's
        data endpoint, on the direct path) or ``why`` (why they are relayed), ``replays``."""
        link = self._link
        out: dict[str, Any] = {"id": self.id, "worker": self.worker, "gpu": dict(self.gpu), "replays": self._replays}
        if isinstance(link, DataLink):
            out["path"], out["endpoint"] = "direct", link.endpoint
        else:
            out["path"], out["why"] = "broker", self._path_why
        return out

    @property
    def replays(self) -> int:
        """How many times the session has been opened again and replayed."""
        return self._replays

    # ------------------------------------------------------------------ calls and replay

    def _call(
        self,
        op: str,
        args: Mapping[str, Any],
        convert: Converter[T],
        timeout: float | None,
        payload: Sequence[Any] = (),
        expect: int = 0,
    ) -> T:
        """One CALL, ``args`` with the caller's handles; replays the session when it was lost.
        ``expect``: payload bytes the reply carries."""

        def send(wire: Mapping[str, Any], limit: float) -> T:
            return self._send(op, wire, convert, limit, payload, expect)

        return self._replaying(op, args, timeout, send)

    def _replaying(
        self,
        op: str,
        args: Mapping[str, Any],
        timeout: float | None,
        send: Callable[[Mapping[str, Any], float], T],
    ) -> T:
        """``send(args with the session's handles, limit)`` on the current session; when that
        finds the session lost, replay it on a new one and send again (a close is not replayed)."""
        if self._closed:
            raise SessionLost(f"session {id_text(self.id)} is closed")
        limit = self._settings.timeout if timeout is None else timeout
        while True:
            wire = self._wire(op, args, self._handles)
            try:
                return send(wire, limit)
            except (SessionLost, GpuFault) as exc:
                if op == "close" or self._closed:
                    raise
                self._recover(exc, limit)

    def _send(
        self,
        op: str,
        args: Mapping[str, Any],
        convert: Converter[T],
        limit: float,
        payload: Sequence[Any] = (),
        expect: int = 0,
    ) -> T:
        """One CALL on the current session, as it is (``args`` with its real handles); ``close``
        always through the broker, which ends the session (PROTOCOL.md §10.3)."""
        conn = self._conn if op == "close" else self._link
        rid = new_id()
        frames = _request.call_frames(rid, self.id, op, args, payload, None if op == "close" else self._cap)
        if isinstance(conn, DataLink):  # straight to the worker: one call alone, the short way
            sid = self.id
            return convert(conn.call(rid, frames, limit, lambda: f"session {id_text(sid)} {op} {id_text(rid)}", expect))
        what = f"session {id_text(self.id)} {op} {id_text(rid)}"
        conn.submit(rid, frames, what, expect)
        pending = Pending(conn, rid, convert, limit, what, cancellable=False)
        return collect(pending)

    def _copy(
        self, op: str, args: Mapping[str, Any], buf: memoryview, timeout: float | None
    ) -> None:
        """A chunked copy (``args``: handle and offset, the caller's handle): ``htod`` sends
        ``buf``, ``dtoh`` fills it. Replays the session when it was lost, then copies again from
        the start (what had reached the lost session is gone with it)."""

        def send(wire: Mapping[str, Any], limit: float) -> None:
            self._send_chunks(op, wire, buf, limit)

        self._replaying(op, args, timeout, send)

    def _send_chunks(self, op: str, args: Mapping[str, Any], buf: memoryview, limit: float) -> None:
        """One copy on the current session (``args`` with its real handle) as chunk CALLs of at
        most ``chunk_bytes``, ``chunk_window`` of them outstanding; each waits at most ``limit``
        seconds once it is the oldest. The first chunk that fails fails the copy."""
        conn = self._link
        cap = self._cap
        base = args["offset"]
        sid = self.id

        def submit(span: tuple[int, int]) -> Pending[None]:
            start, size = span
            wire = dict(args, offset=base + start)
            part = buf[start : start + size]
            if op == "htod":
                payload: Sequence[Any] = (part,)
                expect = 0
                convert: Converter[None] = _request.parse_empty
            else:
                wire["nbytes"] = size
                payload, expect = (), size

                def convert(msg: Message) -> None:
                    part[:] = _request.parse_dtoh(msg, size)

            rid = new_id()
            what = f"session {id_text(sid)} {op} {id_text(rid)} (bytes {start}..{start + size})"
            conn.submit(rid, _request.call_frames(rid, sid, op, wire, payload, cap), what, expect)
            return Pending(conn, rid, convert, limit, what, cancellable=False)

        run_windowed(
            plan(buf.nbytes, self._settings.chunk_bytes),
            self._settings.chunk_window,
            submit,
            collect,
            lambda pending: pending._abandon(),
        )

    def _wire(self, op: str, args: Mapping[str, Any], handles: Mapping[int, int]) -> dict[str, Any]:
        """``args`` with the caller's handles replaced by the session's (``handles``)."""
        out = dict(args)
        if op in ("free", "htod", "dtoh"):
            out["handle"] = _real_handle(handles, args["handle"])
        elif op == "launch":
            out["args"] = [
                ["ptr", _real_handle(handles, value)] if tag == "ptr" else [tag, value]
                for tag, value in args["args"]
            ]
        return out

    def _recover(self, exc: SessionLost | GpuFault, limit: float) -> None:
        """The session was lost (``exc``): open a new one and replay the journal there, or raise
        the loss when that is not possible."""
        journal = self._journal
        if not journal.usable or self._need is None:
            why = journal.reason or "the session cannot be opened again"
            log.info("session %s lost (%s); not replayed: %s", id_text(self.id), exc, why)
            raise type(exc)(f"{exc.message} (not replayed: {why})") from exc
        cause: GpudError = exc
        while True:
            allowed = self._settings.session_replays
            if self._replays >= allowed:
                journal.disable(f"the session was lost more than {allowed} time(s)")
                raise SessionLost(
                    f"session {id_text(self.id)} lost ({cause.code}: {cause.message}); "
                    f"not replayed again after {allowed} replay(s)"
                ) from cause
            self._replays += 1
            try:
                self._replace(cause, limit)
                return
            except (SessionLost, GpuFault, WorkerLost) as again:
                cause = again  # the new session went the same way: try once more
            except GpudError as fail:
                journal.disable(f"the session could not be rebuilt ({fail.code}: {fail.message})")
                raise SessionLost(
                    f"session {id_text(self.id)} lost ({cause.code}: {cause.message}) and could "
                    f"not be rebuilt: {fail.code}: {fail.message}"
                ) from fail

    def _replace(self, cause: GpudError, limit: float) -> None:
        """Open a session replacing the current one and replay the journal on it, in order."""
        conn = self._conn
        old, old_worker = self.id, self.worker
        entries = self._journal.entries()
        log.warning(
            "session %s on %s lost (%s: %s); opening a replacement and replaying %d op(s)",
            id_text(old),
            old_worker,
            cause.code,
            cause.message,
            len(entries),
        )
        assert self._need is not None  # checked by _recover
        if isinstance(self._link, DataLink):
            # Found silent on the direct path: the worker may live on with only its data endpoint
            # out of reach, so end the old session through the broker (unanswered if it is gone).
            self._abandon()
        sid, worker, gpu, data = open_session(conn, self._need, limit, replaces=old)
        conn.remove_session(old)
        self.id, self.worker, self.gpu = sid, worker, gpu
        self._take_path(data)
        conn.add_session(sid, self)  # the keepalive renews the new one from now on
        handles: dict[int, int] = {}
        try:
            for entry in entries:
                self._replay(entry, handles, limit)
        except GpudError as exc:
            if not isinstance(exc, (SessionLost, GpuFault, WorkerLost)):
                self._abandon()
            raise
        missing = set(self._handles) - set(handles)
        if missing:  # a bug of the journal: those pointers would name nothing
            self._abandon()
            raise InternalError(f"the journal did not rebuild handle(s) {sorted(missing)}")
        self._handles = handles
        log.warning(
            "session %s replaced by %s on %s (%d op(s) replayed)",
            id_text(old),
            id_text(sid),
            worker,
            len(entries),
        )

    def _replay(self, entry: Entry, handles: dict[int, int], limit: float) -> None:
        """Send one journal entry to the current session; ``handles`` maps as it goes."""
        wire = self._wire(entry.op, entry.args, handles)
        if entry.op == "alloc":
            handles[entry.handle] = self._send("alloc", wire, _request.parse_handle, limit)
        elif entry.op == "htod":
            data = memoryview(entry.data)
            if data.nbytes > self._settings.chunk_bytes:  # chunked as it was sent the first time
                self._send_chunks("htod", wire, data, limit)
            else:
                self._send("htod", wire, _request.parse_empty, limit, payload=[data])
        elif entry.op == "load":
            self._send("load", wire, _request.parse_empty, limit, payload=[entry.data])
        else:
            self._send(entry.op, wire, _request.parse_empty, limit)
            if entry.op == "free":
                del handles[entry.handle]

    def _abandon(self) -> None:
        """Close the current session without waiting (its rebuild failed, or it went silent)."""
        self._drop_link()
        conn = self._conn
        conn.remove_session(self.id)
        try:
            conn.send(_request.call_frames(new_id(), self.id, "close", {}))
        except GpudError as exc:
            log.debug("could not send close for session %s: %s", id_text(self.id), exc)

    # ------------------------------------------------------------------ handles

    def _handle_of(self, ptr: DevicePtr | int) -> int:
        """The caller's handle of ``ptr``."""
        if isinstance(ptr, DevicePtr):
            if ptr.session != self._key:
                raise InvalidRequest("the pointer belongs to another session")
            return ptr.handle
        if type(ptr) is not int or ptr < 0:
            raise InvalidRequest(f"expected a DevicePtr from mem_alloc, not {type(ptr).__name__}")
        return ptr

    def _adopt(self, real: int) -> int:
        """The caller's handle for a new allocation whose real handle is ``real``: the same
        number until a replay; then one larger than any handed out before, when ``real`` is not."""
        handle = real if real > self._top else self._top + 1
        self._top = handle
        self._handles[handle] = real
        return handle

    # ------------------------------------------------------------------ the C-like API

    def mem_alloc(self, nbytes: int, *, timeout: float | None = None) -> DevicePtr:
        """Allocate ``nbytes`` of device memory.

        Raises
        ------
        gpud.errors.OutOfMemory
            Past the session's memory grant or the device's memory.
        """
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidRequest("nbytes must be a non-negative int")
        real = self._call("alloc", {"nbytes": nbytes}, _request.parse_handle, timeout)
        handle = self._adopt(real)
        self._journal.alloc(handle, nbytes)
        return DevicePtr(handle, nbytes, self._key)

    def mem_free(self, ptr: DevicePtr | int, *, timeout: float | None = None) -> None:
        """Free an allocation."""
        handle = self._handle_of(ptr)
        self._call("free", {"handle": handle}, _request.parse_empty, timeout)
        self._handles.pop(handle, None)
        self._journal.free(handle)

    def memcpy_htod(
        self,
        ptr: DevicePtr | int,
        buffer: BytesLike,
        offset: int = 0,
        *,
        timeout: float | None = None,
    ) -> None:
        """Copy a host buffer (bytes-like, C-contiguous numpy array...) to device memory at
        ``ptr + offset``. The buffer is sent without copying (do not change it until the call
        returns); the session journal keeps a copy of it (up to the client's ``journal_bytes``;
        a larger copy turns replay off without being copied).

        A copy larger than the client's ``chunk_bytes`` travels as chunks, ``chunk_window`` at a
        time (PROTOCOL.md §5.4); ``timeout`` then bounds the wait for each chunk, not the whole
        copy. If a chunk fails, the copy raises that chunk's error and the device range is
        partly written."""
        handle = self._handle_of(ptr)
        view = _request.as_view(buffer, "buffer")
        _check_range(ptr, offset, view.nbytes)
        args = {"handle": handle, "offset": offset}
        if view.nbytes > self._settings.chunk_bytes:
            self._copy("htod", args, view, timeout)
        else:
            self._call("htod", args, _request.parse_empty, timeout, payload=[view])
        if self._journal.usable:
            self._journal.htod(handle, offset, view)  # copied there only if it fits

    def memcpy_dtoh(
        self,
        ptr: DevicePtr | int,
        nbytes: int | None = None,
        offset: int = 0,
        out: Any = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Copy device memory at ``ptr + offset`` back to the host.

        Parameters
        ----------
        ptr:
            The allocation.
        nbytes:
            Bytes to copy; by default the size of ``out``, or the rest of the allocation.
        offset:
            Byte offset into the allocation.
        out:
            A writable C-contiguous buffer (bytearray, numpy array, memoryview...) to fill; its
            size must be ``nbytes``. The bytes are copied into it straight from the received
            frames, with no other copy: the way to copy large buffers.

        Returns
        -------
        bytes, or ``out`` when given.

        A copy larger than the client's ``chunk_bytes`` travels as chunks, ``chunk_window`` at a
        time (PROTOCOL.md §5.4), each landing in its place in ``out``; ``timeout`` then bounds the
        wait for each chunk, not the whole copy. Without ``out`` such a copy is gathered in a
        bytearray and returned as bytes, which takes a second copy of it for a moment. If a chunk
        fails, the copy raises that chunk's error and ``out`` is partly written.
        """
        handle = self._handle_of(ptr)
        target: memoryview | None = None
        if out is not None:
            target = _request.as_view(out, "out")
            if target.readonly:
                raise InvalidRequest("out must be a writable buffer")
            if nbytes is None:
                nbytes = target.nbytes
            elif nbytes != target.nbytes:
                raise InvalidRequest(f"out holds {target.nbytes} bytes but nbytes is {nbytes}")
        if nbytes is None:
            if not isinstance(ptr, DevicePtr):
                raise InvalidRequest("nbytes is required with a plain handle")
            nbytes = ptr.nbytes - offset
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidRequest("nbytes must be a non-negative int")
        _check_range(ptr, offset, nbytes)
        size = nbytes
        if size > self._settings.chunk_bytes:
            dest = target if target is not None else memoryview(bytearray(size))
            self._copy("dtoh", {"handle": handle, "offset": offset}, dest, timeout)
            return out if target is not None else bytes(dest)
        args = {"handle": handle, "offset": offset, "nbytes": size}
        data = self._call("dtoh", args, lambda m: _request.parse_dtoh(m, size), timeout, expect=size)
        if target is None:
            return bytes(data)
        target[:] = data
        return out

    def launch(
        self,
        module: str,
        name: str,
        grid: int | Sequence[int] = (1,),
        block: int | Sequence[int] = (1,),
        args: Sequence[Any] = (),
        shared_mem: int = 0,
        *,
        timeout: float | None = None,
    ) -> None:
        """Launch kernel ``name`` of ``module`` (:data:`BUILTIN` for the built-in library).

        ``args`` are device pointers (from :meth:`mem_alloc`) and numbers with the kernel's exact
        parameter types: ``(type, number)`` pairs such as ``("i32", n)`` or ``("f32", a)`` (types
        f32, f64, i32, u32, i64, u64; no numpy needed), or numpy scalars (``numpy.int32(n)``...).
        A plain Python number is refused with InvalidRequest: its C type cannot be guessed.
        """
        if type(module) is not str or type(name) is not str or not module or not name:
            raise InvalidRequest("module and name must be non-empty strings")
        grid_l = [grid] if isinstance(grid, int) else list(grid)
        block_l = [block] if isinstance(block, int) else list(block)
        parse_dims(grid_l, "grid")
        parse_dims(block_l, "block")
        if type(shared_mem) is not int or shared_mem < 0:
            raise InvalidRequest("shared_mem must be a non-negative int")
        wire_args = [_request.encode_launch_arg(i, a, self._key) for i, a in enumerate(args)]
        body = {
            "module": module,
            "name": name,
            "grid": grid_l,
            "block": block_l,
            "args": wire_args,
            "shared_mem": shared_mem,
        }
        self._call("launch", body, _request.parse_empty, timeout)
        self._journal.launch(module, name, grid_l, block_l, wire_args, shared_mem)

    def module_load(
        self,
        source: str | BytesLike,
        *,
        name: str | None = None,
        kind: str = "cuda",
        options: Sequence[str] = (),
        timeout: float | None = None,
    ) -> str:
        """Load a module into the session (as ``cuModuleLoadData``) and return its name, for
        :meth:`launch`.

        Parameters
        ----------
        source:
            ``kind`` "cuda": CUDA C source (str, or UTF-8 bytes); kernels are found by their plain
            names, so the worker wraps a source in ``extern "C" {...}`` unless it says
            ``extern "C"`` itself. "ptx": PTX text. "cubin": a cubin for the session's GPU (bytes).
        name:
            The module's name in this session (1 to 64 of letters, digits, ``_.-``); by default
            ``module1``, ``module2``...
        options:
            nvcc options (kind "cuda" only), from the worker's allowed list: macros, -O0..-O3,
            --use_fast_math, -lineinfo... (PROTOCOL.md §5.4). The worker picks the architecture.

        Raises
        ------
        gpud.errors.RemoteError
            The source does not compile (the message is the compiler's), the module does not load,
            or the session's GPU cannot run it (a SIMULATED GPU runs only the built-in kernels).
        gpud.errors.InvalidRequest
            A bad name or kind, a name already loaded, an option or ``#include`` the worker refuses.

        The session journal keeps the module (its bytes count against ``journal_bytes``), so a
        replayed session loads it again before the launches that use it.
        """
        if kind not in ("cuda", "ptx", "cubin"):
            raise InvalidRequest(f"kind must be 'cuda', 'ptx' or 'cubin', got {kind!r}")
        if isinstance(options, str) or not all(type(o) is str for o in options):
            raise InvalidRequest("options must be a sequence of strings")
        if name is None:
            n = len(self._modules) + 1
            while f"module{n}" in self._modules:
                n += 1
            name = f"module{n}"
        if type(name) is not str or not name:
            raise InvalidRequest("name must be a non-empty string")
        data = source.encode("utf-8") if isinstance(source, str) else bytes(_request.as_view(source, "source"))
        args = {"kind": kind, "name": name, "options": list(options)}
        functions = self._call("load", args, _parse_load, timeout, payload=[data])
        self._modules[name] = functions
        self._journal.load(kind, name, list(options), data)
        return name

    @property
    def modules(self) -> dict[str, list[str]]:
        """The modules loaded with :meth:`module_load`, with their kernels where the worker
        knows them (not for a cubin)."""
        return {k: list(v) for k, v in self._modules.items()}

    def synchronize(self, *, timeout: float | None = None) -> None:
        """Wait until every launch of this session has finished (errors of kernels surface here
        or at the launch, as RemoteError)."""
        self._call("sync", {}, _request.parse_empty, timeout)

    def device_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The session's GPU and memory: ``gpu``, ``mem_granted``, ``mem_used``, ``simulated``;
        ``process`` (``pid``, ``uid``) where the worker runs the session in a process of its own."""
        return self._call("info", {}, _request.parse_info, timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """End the session and release its grant. Idempotent; a session the broker already ended
        (SessionLost), or whose GPU failed (GpuFault), counts as closed; it is not replayed."""
        if self._closed:
            return
        self._conn.remove_session(self.id)
        try:
            self._call("close", {}, _request.parse_empty, timeout)
        except (SessionLost, GpuFault):
            pass
        finally:
            self._closed = True
            self._journal.disable("the session is closed")
            self._handles.clear()
            self._drop_link()

    def _drop_link(self) -> None:
        """Close the direct path, if any: later CALLs go nowhere but the broker."""
        link = self._link
        if isinstance(link, DataLink):
            link.close()
        self._link, self._cap = self._conn, None

    def _detach(self) -> list[Any] | None:
        """The client is closing: mark the session closed and return its close CALL, to be sent
        without waiting (None when it is closed already)."""
        if self._closed:
            return None
        self._closed = True
        self._drop_link()
        return _request.call_frames(new_id(), self.id, "close", {})


# --------------------------------------------------------------------------- helpers


def _parse_load(msg: Message) -> list[str]:
    """The kernel names of a ``load`` CALL's REPLY (empty when the worker does not know them)."""
    header = _request.check_reply(msg)
    functions = header.get("functions", [])
    if type(functions) is not list or not all(type(f) is str for f in functions):
        raise ProtocolError("load reply field 'functions' must be a list of strings")
    if header.get("compiled") is False:  # a SIMULATED GPU without nvcc: errors in the source stay hidden
        log.warning("module loaded but %s", str(header.get("note") or "not compiled")[:500])
    return functions


def _real_handle(handles: Mapping[int, int], handle: Any) -> int:
    """The current session's handle for the caller's ``handle``; InvalidRequest when it names no
    open allocation (as the worker answers for an unknown handle)."""
    real = handles.get(handle) if type(handle) is int else None
    if real is None:
        raise InvalidRequest(f"unknown handle {handle!r} (freed, or never allocated here)")
    return real


def _check_range(ptr: DevicePtr | int, offset: int, nbytes: int) -> None:
    if type(offset) is not int or offset < 0:
        raise InvalidRequest("offset must be a non-negative int")
    if isinstance(ptr, DevicePtr) and offset + nbytes > ptr.nbytes:
        raise InvalidRequest(
            f"{nbytes} bytes at offset {offset} do not fit the {ptr.nbytes}-byte allocation"
        )
