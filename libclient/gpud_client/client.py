"""The synchronous client: one DEALER socket to the broker, one deadline per call, failover.

This module owns the client's conversation with a broker pair: sending requests, matching replies to
them by id, the liveness check while waiting (lazy pirate: PING after ``ping_interval`` of silence,
then give the broker up after another one), the failover across the endpoint list with every
outstanding request re-sent under its original id (the client half of Binary Star, PROTOCOL.md §9:
a broker that answers NOT_ACTIVE is the passive one of its pair, and the client moves to the next
endpoint after a ``settle`` delay without the caller ever seeing that answer), the background
keepalive that renews the lease of open sessions, and session replay: a session lost with its
worker or GPU is opened again and rebuilt from its journal (:mod:`gpud_client.journal`) inside the
call that found it lost, so the caller sees only a delay.

A :class:`Client` is not thread-safe: use one Client per thread. The only thread it starts is the
session keepalive, which has a socket of its own and never touches the Client's socket.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import zmq

from gpud.errors import (
    Busy,
    ConfigError,
    GpudError,
    GpuFault,
    InternalError,
    InvalidRequest,
    ProtocolError,
    SessionLost,
    Timeout,
    WorkerLost,
)
from gpud.protocol import (
    Command,
    Message,
    Peer,
    decode,
    id_text,
    new_id,
    parse_dims,
    parse_need,
    unbatch,
)
from gpud.security import CurveKeys, apply_client_keys
from gpud.sockets import NOBLOCK, recv_frames, send_frames
from gpud_client import _request as rq
from gpud_client._request import DevicePtr, JobResult
from gpud_client.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW, plan, run_windowed
from gpud_client.journal import Entry, Journal

if TYPE_CHECKING:
    from gpud_client._request import BytesLike

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNK_WINDOW",
    "DEFAULT_JOURNAL_BYTES",
    "DEFAULT_KEEPALIVE_S",
    "DEFAULT_PING_INTERVAL_S",
    "DEFAULT_SESSION_REPLAYS",
    "DEFAULT_SETTLE_S",
    "DEFAULT_TIMEOUT_S",
    "Client",
    "Job",
    "Pending",
    "Session",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
"""Seconds a call may take, overall, unless a timeout is given."""
DEFAULT_PING_INTERVAL_S = 0.5
"""Seconds of broker silence, while waiting, before a PING; as long again and the broker is gone
(so a dead broker is left within about a second; the broker pair's peer expiry is 0.75 s)."""
DEFAULT_SETTLE_S = 0.25
"""Seconds to wait after a NOT_ACTIVE answer before sending to the next endpoint (the vote), so
that the passive broker has seen its peer expire by then."""
DEFAULT_JOURNAL_BYTES = 64 << 20
"""Bytes each session's journal may hold (copied buffers included) for session replay."""
DEFAULT_SESSION_REPLAYS = 3
"""Times one session may be opened again and replayed before its loss reaches the caller."""
DEFAULT_KEEPALIVE_S = 5.0
"""Seconds between the keepalive PINGs that renew open sessions' lease (the broker's is 30 s)."""
KEEPALIVE_MISSES = 3
"""Keepalive intervals without any answer from the client's broker before the keepalive PINGs the
other endpoints too (a vote there, PROTOCOL.md §9.1), until the client's broker answers again."""
TRANSFER_RATE_FLOOR = 10 << 20
"""Bytes per second a transfer to or from the broker is assumed to reach at least: while payloads
are in flight, the broker may look silent for as long as they take at this rate (a PING waits
behind them), on top of ``ping_interval``, before the client PINGs it or gives it up."""
KEEPALIVE_HWM = 4
"""PINGs a keepalive socket queues for a broker it is not connected to; more are not sent."""

T = TypeVar("T")
_Converter = Callable[[Message], T]


@dataclass(slots=True)
class _Outstanding:
    """A request sent and not yet collected: its frames (for re-sending) and, once here, its reply."""

    frames: list[Any]
    what: str
    nbytes: int = 0  # payload bytes sent, plus those expected back
    reply: Message | None = None


class Pending(Generic[T]):
    """A request that has been sent and whose result has not been collected yet.

    Returned by :meth:`Client.submit_echo` (``Pending[bytes]``); :class:`Job` is the one for jobs.
    Replies to other requests that arrive while one Pending waits are kept for their own Pending.
    Dropping a Pending without waiting forgets its request (a late reply is then discarded).
    """

    def __init__(
        self,
        client: Client,
        rid: bytes,
        convert: _Converter[T],
        default_timeout: float,
        what: str,
        cancellable: bool,
    ) -> None:
        self._client = client
        self._id = rid
        self._convert = convert
        self._default_timeout = default_timeout
        self._what = what
        self._cancellable = cancellable
        self._result: tuple[T] | None = None
        self._error: GpudError | None = None

    def __del__(self) -> None:
        # Dropped without waiting: forget the request (a late reply is then discarded).
        if getattr(self, "_result", 0) is None and getattr(self, "_error", 0) is None:
            self._client._forget(self._id)

    @property
    def id(self) -> bytes:
        """The request id (16 bytes), as sent to the broker."""
        return self._id

    def _settled(self) -> bool:
        return self._result is not None or self._error is not None

    def done(self) -> bool:
        """Whether the reply is here. Reads what has arrived, never blocks."""
        if self._settled():
            return True
        self._client._poll_replies()
        return self._client._has_reply(self._id)

    def wait(self, timeout: float | None = None) -> T:
        """Wait for the reply and return its result.

        Parameters
        ----------
        timeout:
            Seconds to wait from now; by default the timeout chosen when the request was made.

        Returns
        -------
        The result (the echoed bytes, a :class:`JobResult`...).

        Raises
        ------
        gpud.errors.Timeout
            No reply within ``timeout``; the request stays outstanding and may be waited for again.
        gpud.errors.GpudError
            The broker or worker answered with an error (the subclass matching its code).
        """
        if not self._settled():
            limit = self._default_timeout if timeout is None else timeout
            msg = self._client._await(self._id, limit, self._what)
            try:
                self._result = (self._convert(msg),)
            except GpudError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        if self._result is None:  # unreachable: settled above
            raise InternalError(f"{self._what}: no result recorded")
        return self._result[0]

    def cancel(self) -> None:
        """Ask the broker to drop the request if it is still queued.

        A queued request then ends with :class:`gpud.errors.Cancelled`; one already running runs on
        and :meth:`wait` returns its result.
        """
        if self._cancellable and not self._settled():
            self._client._send_cancel(self._id)

    def _abandon(self) -> None:
        """Forget the request after a timeout of a synchronous call (and cancel it if queued)."""
        if not self._settled():
            self.cancel()
            self._client._forget(self._id)


class Job(Pending[JobResult]):
    """A submitted job; :meth:`wait` returns its :class:`JobResult`.

    Its default wait is ``max(timeout, time_limit + timeout)`` with the client's timeout, so a job
    that uses its whole time limit is still waited for.
    """


class Client:
    """A connection to a gpud broker (or a Binary Star pair of them).

    Parameters
    ----------
    endpoints:
        Broker frontend endpoint(s), e.g. ``["tcp://primary:5555", "tcp://backup:5555"]`` or one
        string, comma-separated. The client fails over to the next one when the current one falls
        silent or answers NOT_ACTIVE (it is the passive broker of its pair).
    timeout:
        Default overall deadline of each call, in seconds.
    tenant:
        Tenant named in every request's ``need``.
    keepalive:
        Seconds between PINGs that keep open sessions' lease alive while the program is idle.
    ping_interval:
        Seconds of silence, while waiting for a reply, after which the client PINGs the broker;
        after as long again without an answer it fails over and re-sends what is outstanding.
    settle:
        Seconds to wait after a broker answered NOT_ACTIVE before re-sending what is outstanding,
        same ids, to the next endpoint. NOT_ACTIVE never reaches the caller: when every broker
        answers it, the client keeps alternating until the call's deadline (then Timeout).
    journal_bytes:
        Bytes each session's journal may hold for session replay (see :class:`Session`); 0 turns
        replay off, so that a session lost with its worker or GPU raises SessionLost at once.
    session_replays:
        Times one session may be opened again and replayed; its next loss raises SessionLost.
    chunk_bytes:
        Bytes of the largest session copy sent as one CALL (default 8 MiB). A larger
        ``memcpy_htod`` or ``memcpy_dtoh`` travels as CALLs of at most this many bytes on
        consecutive offsets (PROTOCOL.md §5.4); keep it well under the broker's maximum message
        size (1 GiB by default).
    chunk_window:
        Chunk CALLs of one copy outstanding at once (default 4): the broker and the worker hold at
        most ``chunk_window * chunk_bytes`` bytes of one copy.
    context:
        A zmq context to use; by default the client makes its own and terminates it on close.
    curve:
        CURVE keys: this client's pair and the broker's public key, e.g.
        ``CurveKeys.from_files("alice.key_secret", "broker.key")``. Needed when the broker runs
        with security ``curve`` (the default); the broker then takes the tenant from the key, and
        ``tenant`` is only a declaration it ignores. None: no encryption (security ``none``).

    Notes
    -----
    Not thread-safe: use one Client per thread.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float = DEFAULT_TIMEOUT_S,
        tenant: str = "default",
        keepalive: float = DEFAULT_KEEPALIVE_S,
        *,
        ping_interval: float = DEFAULT_PING_INTERVAL_S,
        settle: float = DEFAULT_SETTLE_S,
        journal_bytes: int = DEFAULT_JOURNAL_BYTES,
        session_replays: int = DEFAULT_SESSION_REPLAYS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        chunk_window: int = DEFAULT_CHUNK_WINDOW,
        context: zmq.Context[Any] | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self._endpoints = _endpoint_list(endpoints)
        if curve is not None and (not isinstance(curve, CurveKeys) or curve.server_public is None):
            raise ConfigError("curve must be CurveKeys with the broker's public key (server_public)")
        self._curve = curve
        for name, value in (
            ("timeout", timeout),
            ("keepalive", keepalive),
            ("ping_interval", ping_interval),
        ):
            if not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if not settle >= 0:
            raise ConfigError(f"settle must be a non-negative number of seconds, got {settle!r}")
        for name, count in (("journal_bytes", journal_bytes), ("session_replays", session_replays)):
            if type(count) is not int or count < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {count!r}")
        for name, count in (("chunk_bytes", chunk_bytes), ("chunk_window", chunk_window)):
            if type(count) is not int or count < 1:
                raise ConfigError(f"{name} must be a positive int, got {count!r}")
        self._chunk_bytes = chunk_bytes
        self._chunk_window = chunk_window
        self.timeout = float(timeout)
        try:
            parse_need("echo", {"tenant": tenant})
        except GpudError as exc:
            raise ConfigError(f"bad tenant {tenant!r}: {exc.message}") from None
        self.tenant = tenant
        self._keepalive = float(keepalive)
        self._ping_interval = float(ping_interval)
        self._settle = float(settle)
        self._journal_bytes = journal_bytes
        self._session_replays = session_replays
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._index = 0
        self._table: dict[bytes, _Outstanding] = {}
        self._awaiting = 0  # entries of _table still without a reply
        self._inflight = 0  # their payload bytes (sent and expected back)
        self._quiet_since = monotonic()  # last time the broker was heard, or we began to expect it
        self._ping_at: float | None = None  # when the unanswered PING went out
        self._last_dropped = ""  # why the last unusable message from the broker was dropped
        self._switch_at: float | None = None  # when to leave a broker that answered NOT_ACTIVE
        self._passive = ""  # the last endpoint that answered NOT_ACTIVE, for Timeout messages
        self._closed = False
        self._lock = threading.Lock()  # guards _sessions and _ka_thread against the keepalive
        self._sessions: weakref.WeakValueDictionary[bytes, Session] = weakref.WeakValueDictionary()
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        try:
            self._sock = self._connect(self._endpoints[0])
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
        except ConfigError:
            if self._own_context:
                self._ctx.term()
            raise

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """The broker endpoint currently in use."""
        return self._endpoints[self._index]

    @property
    def endpoints(self) -> list[str]:
        """All broker endpoints, in failover order."""
        return list(self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the largest session copy sent as one CALL; larger ones are chunked."""
        return self._chunk_bytes

    @property
    def chunk_window(self) -> int:
        """Chunk CALLs of one copy outstanding at once."""
        return self._chunk_window

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.endpoint
        return f"<gpud_client.Client {state} tenant={self.tenant!r}>"

    def close(self) -> None:
        """Close the client: stop the keepalive, close open sessions (without waiting), close the
        socket, and terminate the context when the client made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ka_stop.set()
        with self._lock:
            thread = self._ka_thread
            sessions = list(self._sessions.values())
            self._sessions.clear()
        linger = 0
        for session in sessions:
            if not session._closed:
                session._closed = True
                try:
                    frames = rq.call_frames(new_id(), session.id, "close", {})
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    linger = 200  # ms: give those close CALLs a moment to leave
                except zmq.ZMQError as exc:
                    log.debug("could not send close for session %s: %s", id_text(session.id), exc)
        if thread is not None:
            thread.join(timeout=5.0)
        self._sock.close(linger=linger)
        self._table.clear()
        self._awaiting = 0
        self._inflight = 0
        if self._own_context:
            if thread is not None and thread.is_alive():
                log.error("session keepalive thread did not stop; leaving the zmq context open")
            else:
                self._ctx.term()

    # ------------------------------------------------------------------ public API

    def echo(self, payload: BytesLike = b"", timeout: float | None = None) -> bytes:
        """Send ``payload`` through the broker to a worker and back.

        Parameters
        ----------
        payload:
            Any bytes-like object (bytes, bytearray, memoryview, a C-contiguous numpy array).
        timeout:
            Overall deadline in seconds; the client's timeout by default.

        Returns
        -------
        bytes
            The payload as the worker returned it.
        """
        return self._sync(self.submit_echo(payload, timeout=timeout), None)

    def submit_echo(
        self, payload: BytesLike = b"", *, timeout: float | None = None
    ) -> Pending[bytes]:
        """Send an echo request without waiting; ``Pending.wait()`` returns the payload."""
        limit = self.timeout if timeout is None else timeout
        rid = new_id()
        view = rq.as_view(payload, "payload")
        frames = rq.request_frames(rid, "echo", {"tenant": self.tenant}, _ms(limit), payload=[view])
        what = f"echo {id_text(rid)}"
        self._submit(rid, frames, what, nbytes=2 * view.nbytes)
        return Pending(self, rid, rq.parse_echo, limit, what, cancellable=True)

    def run(
        self,
        argv: Sequence[str],
        files: Mapping[str, BytesLike] | None = None,
        outputs: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        gpu_milli: int | None = None,
        gpus: int = 0,
        mem: int | None = None,
        models: Sequence[str] | None = None,
        min_cc: tuple[int, int] | None = None,
        exclusive: bool = False,
        priority: int = 0,
        time_limit: float = 60.0,
        output_cap: int = 1 << 20,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> JobResult:
        """Run a program on a GPU worker and wait for it. Arguments as for :meth:`submit`.

        Returns
        -------
        JobResult
            Exit code, output and returned files. A non-zero exit is a result, not an error.

        Raises
        ------
        gpud.errors.Timeout
            No result within the overall deadline (the request is then cancelled if still queued).
        gpud.errors.GpudError
            The subclass for the broker's or worker's error code (NoCapacity, Busy, RemoteError...).
        """
        job = self.submit(
            argv,
            files=files,
            outputs=outputs,
            env=env,
            gpu_milli=gpu_milli,
            gpus=gpus,
            mem=mem,
            models=models,
            min_cc=min_cc,
            exclusive=exclusive,
            priority=priority,
            time_limit=time_limit,
            output_cap=output_cap,
            idempotent=idempotent,
            timeout=timeout,
        )
        return self._sync(job, None)

    def submit(
        self,
        argv: Sequence[str],
        files: Mapping[str, BytesLike] | None = None,
        outputs: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        gpu_milli: int | None = None,
        gpus: int = 0,
        mem: int | None = None,
        models: Sequence[str] | None = None,
        min_cc: tuple[int, int] | None = None,
        exclusive: bool = False,
        priority: int = 0,
        time_limit: float = 60.0,
        output_cap: int = 1 << 20,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> Job:
        """Submit a job without waiting for it.

        Parameters
        ----------
        argv:
            Program and arguments, run in the job's private working directory.
        files:
            Input files to place in that directory, name -> bytes-like content. The buffers are
            sent without copying: do not change them until the job is done.
        outputs:
            Names of files to bring back after the program exits.
        env:
            Extra environment variables (names ``[A-Z_][A-Z0-9_]*``).
        gpu_milli, gpus, mem, models, min_cc, exclusive, priority:
            What the job needs (PROTOCOL.md §5.1); ``None`` leaves the broker's default for jobs
            (one whole GPU share, no memory reservation).
        time_limit:
            Seconds after which the job's whole process group is killed.
        output_cap:
            Bytes kept of stdout and of stderr each.
        idempotent:
            Whether the broker may run it again elsewhere after losing its worker.
        timeout:
            Overall seconds to wait for the result; ``max(timeout, time_limit + timeout)`` with
            the client's timeout by default.

        Returns
        -------
        Job
            ``Job.wait()`` returns the :class:`JobResult`.
        """
        body, payload = rq.job_body(argv, files, outputs, env, time_limit, output_cap, idempotent)
        need = rq.build_need(
            tenant=self.tenant,
            gpu_milli=gpu_milli,
            gpus=gpus,
            mem=mem,
            models=models,
            min_cc=min_cc,
            exclusive=exclusive,
            priority=priority,
        )
        rq.check_need("job", need)
        if timeout is None:
            overall = max(self.timeout, float(time_limit) + self.timeout)
            queue_wait = self.timeout
        else:
            overall = queue_wait = timeout
        rid = new_id()
        frames = rq.request_frames(rid, "job", need, _ms(queue_wait), body, payload)
        what = f"job {id_text(rid)}"
        self._submit(rid, frames, what)
        return Job(self, rid, rq.parse_job_result, overall, what, cancellable=True)

    def session(
        self,
        gpu_milli: int | None = None,
        mem: int | None = None,
        model: str | None = None,
        models: Sequence[str] | None = None,
        min_cc: tuple[int, int] | None = None,
        exclusive: bool = False,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Session:
        """Open a device session pinned to one GPU (the C-like API).

        Parameters
        ----------
        gpu_milli:
            Share of the GPU in thousandths (broker default 100).
        mem:
            Device memory to reserve, in bytes (broker default 256 MiB); allocations past it fail
            with OutOfMemory.
        model, models:
            Allowed GPU model name(s).
        min_cc:
            Minimum CUDA compute capability, ``(major, minor)``.
        exclusive:
            Nothing else may be granted on the GPU while the session is open.
        priority:
            -100..100; higher is placed first.
        timeout:
            Seconds to wait for placement; the client's timeout by default.

        Returns
        -------
        Session
            A context manager; leaving it closes the session. Its journal holds up to the client's
            ``journal_bytes``, so that it survives the loss of its worker or GPU (see Session).
        """
        need = rq.build_need(
            tenant=self.tenant,
            gpu_milli=gpu_milli,
            mem=mem,
            model=model,
            models=models,
            min_cc=min_cc,
            exclusive=exclusive,
            priority=priority,
        )
        rq.check_need("session", need)
        limit = self.timeout if timeout is None else timeout
        sid, worker, gpu = self._open_session(need, limit)
        session = Session(self, sid, worker, gpu, need=need, journal=Journal(self._journal_bytes))
        self._register_session(session)
        return session

    def _open_session(
        self, need: dict[str, Any], limit: float, replaces: bytes | None = None
    ) -> tuple[bytes, str, dict[str, Any]]:
        """Send a session REQUEST and wait for it: ``(session id, worker, gpu)``. ``replaces``
        names a lost session that this one replaces (the broker prefers the lost worker's
        replica for it, PROTOCOL.md §9.4)."""
        rid = new_id()
        body = {"replaces": replaces} if replaces is not None else None
        frames = rq.request_frames(rid, "session", need, _ms(limit), body)

        def convert(msg: Message) -> tuple[bytes, str, dict[str, Any]]:
            return rq.parse_session_open(msg, rid)

        what = f"session request {id_text(rid)}"
        self._submit(rid, frames, what)
        pending = Pending(self, rid, convert, limit, what, cancellable=True)
        return self._sync(pending, None)

    # ------------------------------------------------------------------ request table

    def _submit(self, rid: bytes, frames: list[Any], what: str, expect: int = 0, nbytes: int | None = None) -> None:
        """Send a REQUEST or CALL and record it for matching and re-sending (the caller then
        makes its Pending). ``expect``: payload bytes the reply is known to carry; ``nbytes``:
        those sent plus those expected, when the caller knows them."""
        if self._closed:
            raise GpudError("the client is closed")
        if not self._awaiting:
            # Nothing was expected from the broker until now: its silence counts from here.
            self._quiet_since = monotonic()
            self._ping_at = None
        self._send(frames)
        if nbytes is None:
            nbytes = _payload_bytes(frames) + expect
        self._table[rid] = _Outstanding(frames, what, nbytes)
        self._awaiting += 1
        self._inflight += nbytes

    def _sync(self, pending: Pending[T], timeout: float | None) -> T:
        """Wait for a Pending of a synchronous call; on Timeout forget it (and cancel it)."""
        try:
            return pending.wait(timeout)
        except Timeout:
            if not pending._settled():
                pending._abandon()
            raise

    def _forget(self, rid: bytes) -> None:
        entry = self._table.pop(rid, None)
        if entry is not None and entry.reply is None:
            self._awaiting -= 1
            self._inflight -= entry.nbytes

    def _has_reply(self, rid: bytes) -> bool:
        entry = self._table.get(rid)
        return entry is not None and entry.reply is not None

    def _send(self, frames: Sequence[Any]) -> None:
        try:
            send_frames(self._sock, frames, NOBLOCK)
        except zmq.Again:
            raise Busy("the client's send queue is full; the broker is not reading") from None

    def _send_cancel(self, rid: bytes) -> None:
        if not self._closed:
            try:
                self._send(rq.cancel_frames(rid))
            except Busy:  # no connection (e.g. a refused CURVE handshake): nothing to cancel there
                log.debug("no connection to send CANCEL %s on", id_text(rid))

    def _await(self, rid: bytes, timeout: float, what: str) -> Message:
        """Wait for the reply to ``rid`` until ``timeout`` seconds from now, keeping the broker
        under watch (PING, failover). Returns the reply and forgets the request."""
        if self._closed:
            raise GpudError("the client is closed")
        entry = self._table.get(rid)
        if entry is None:
            raise GpudError(f"{what}: not outstanding (already collected or forgotten)")
        deadline = monotonic() + max(0.0, timeout)
        while entry.reply is None:
            now = monotonic()
            wake = self._watch_broker(now)
            self._pump(min(deadline, wake) - now, entry)
            if entry.reply is None and monotonic() >= deadline:
                hint = f"; last dropped message: {self._last_dropped}" if self._last_dropped else ""
                if self._passive:
                    hint += f"; {self._passive} answered NOT_ACTIVE (the passive broker)"
                raise Timeout(f"{what}: no reply within {timeout:g}s from {self.endpoint}{hint}")
        del self._table[rid]
        return entry.reply

    # ------------------------------------------------------------------ broker liveness

    def _watch_broker(self, now: float) -> float:
        """PING a silent broker, give up on one that stays silent, leave a passive one once the
        settle delay has passed. Returns when to look again.

        Silence is ``ping_interval`` plus the time the payloads in flight take at
        TRANSFER_RATE_FLOOR: a broker busy receiving or sending a large buffer is not silent."""
        if self._switch_at is not None:
            if now < self._switch_at:
                return self._switch_at  # it answers: no PING while the settle delay runs
            self._failover(now, f"broker {self.endpoint} is passive (NOT_ACTIVE)")
            return now + self._ping_interval
        interval = self._ping_interval + self._inflight / TRANSFER_RATE_FLOOR
        if self._ping_at is not None:
            if now - self._ping_at < interval:
                return self._ping_at + interval
            self._failover(now, f"broker {self.endpoint} silent for {now - self._quiet_since:.1f}s")
            return now + interval
        if now - self._quiet_since < interval:
            return self._quiet_since + interval
        log.debug(
            "broker %s silent for %.1fs; sending PING", self.endpoint, now - self._quiet_since
        )
        try:
            self._send(rq.ping_frames(self._session_ids()))
        except Busy:
            # With unbounded queues this means no connection at all (a refused CURVE handshake
            # drops it): as good as a PING that goes unanswered.
            log.debug("broker %s: no connection to send a PING on", self.endpoint)
        self._ping_at = now
        return now + interval

    def _failover(self, now: float, why: str) -> None:
        """Drop the socket, connect to the next endpoint, re-send what is outstanding (same ids).
        Logged once per switch: a WARNING for a silent broker, INFO for a passive one (which is
        how a broker pair normally tells its clients where to go)."""
        passive = self._switch_at is not None
        old = self.endpoint
        count = len(self._endpoints)
        for step in range(1, count + 1):
            index = (self._index + step) % count
            try:
                sock = self._connect(self._endpoints[index])
            except ConfigError as exc:
                if step == count:
                    raise
                log.error("%s; trying the next endpoint", exc)
                continue
            break
        self._sock.close(linger=0)
        self._sock, self._index = sock, index
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        resend = [e for e in list(self._table.values()) if e.reply is None]
        log.log(
            logging.INFO if passive else logging.WARNING,
            "%s; %s %s and re-sending %d request(s)",
            why,
            "reconnecting to" if self.endpoint == old else "failing over to",
            self.endpoint,
            len(resend),
        )
        for entry in resend:
            self._send(entry.frames)
        self._quiet_since = now
        self._ping_at = None
        self._switch_at = None

    def _connect(self, endpoint: str, sndhwm: int = 0) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Unbounded queues: outstanding requests are bounded by the caller, and a reply dropped at
        # a high-water mark would only come back as a spurious failover.
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            apply_client_keys(sock, self._curve)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"cannot connect to {endpoint!r}: {exc}") from None
        return sock

    # ------------------------------------------------------------------ receiving

    def _poll_replies(self) -> None:
        if not self._closed:
            self._pump(0.0)
            if self._switch_at is not None and monotonic() >= self._switch_at:
                self._watch_broker(monotonic())

    def _pump(self, timeout: float, entry: _Outstanding | None = None) -> None:
        """Handle the messages that are queued, waiting up to ``timeout`` seconds for the first;
        return early once ``entry`` has its reply.

        Reads first and polls only when nothing is there: a poll, getsockopt(EVENTS) and a
        failed read each cost about a system call, the dearest thing on this path."""
        sock = self._sock
        handled = False
        while True:
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=3)
            except zmq.Again:
                if handled or timeout <= 0:
                    return
                if not self._poller.poll(max(0, math.ceil(timeout * 1000))):
                    return
                handled = True  # readable now: one more read, then return on an empty queue
                continue
            self._handle(frames)
            handled = True
            if entry is not None and (entry.reply is not None or self._switch_at is not None):
                return  # its reply is here, or a passive broker answered: time to plan a switch

    def _handle(self, frames: list[Any]) -> None:
        # Anything at all from the broker shows that it is alive.
        self._quiet_since = monotonic()
        self._ping_at = None
        try:
            msg = decode(frames, expect=Peer.CLIENT)
            # Several messages in one (PROTOCOL.md §2.1), all checked before any is taken.
            batch = unbatch(msg) if msg.command is Command.BATCH else None
        except GpudError as exc:
            self._drop(f"malformed message ({exc.code}: {exc.message})")
            return
        if batch is None:
            self._take(msg)
        else:
            for one, _ in batch:
                self._take(one)

    def _take(self, msg: Message) -> None:
        """One message from the broker, alone or out of a BATCH."""
        command = msg.command
        if command is Command.PONG:
            return
        if command not in (Command.REPLY, Command.ERROR):
            self._drop(f"unexpected {command.name} from the broker")
            return
        rid = msg.header.get("id")
        if type(rid) is not bytes or len(rid) != 16:
            if command is Command.ERROR:
                code, text = msg.header.get("code"), msg.header.get("message")
                self._drop(f"broker ERROR without request id: {code!r}: {text!r}")
            else:
                self._drop("REPLY without a valid 16-byte 'id'")
            return
        entry = self._table.get(rid)
        if entry is None:
            log.debug("dropped a stale %s for unknown request %s", command.name, id_text(rid))
            return
        if entry.reply is not None:
            log.debug("dropped a duplicate %s for %s", command.name, entry.what)
            return
        if msg.header.get("code") == "NOT_ACTIVE" and msg.header.get("ok") is not True:
            # The passive broker of a pair (PROTOCOL.md §9.1): it kept nothing. Never the caller's
            # answer: leave it after the settle delay and re-send everything outstanding there.
            if self._switch_at is None:
                self._switch_at = monotonic() + self._settle
                self._passive = self.endpoint
                log.debug("broker %s answered NOT_ACTIVE for %s", self.endpoint, entry.what)
            return
        entry.reply = msg
        self._awaiting -= 1
        self._inflight -= entry.nbytes
        self._passive = ""

    def _drop(self, why: str) -> None:
        log.warning("from broker %s: dropped %s", self.endpoint, why)
        self._last_dropped = why

    # ------------------------------------------------------------------ sessions and keepalive

    def _session_ids(self) -> list[bytes]:
        with self._lock:
            return list(self._sessions.keys())

    def _register_session(self, session: Session) -> None:
        with self._lock:
            self._sessions[session.id] = session
            if self._ka_thread is None and not self._ka_stop.is_set():
                thread = threading.Thread(
                    target=self._keepalive_loop, name="gpud-client-keepalive", daemon=True
                )
                self._ka_thread = thread
                thread.start()

    def _unregister_session(self, sid: bytes) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def _keepalive_loop(self) -> None:
        """Background thread: PING {"sessions": [...]} every ``keepalive`` seconds, on sockets of
        its own, while any session is open.

        The PING goes to the endpoint the client uses now (``_index``, read afresh each time), so
        the lease is renewed where the sessions are: after a failover, on the broker the client
        moved to. A passive broker answers PING too (PONG) but renews nothing, so answers from
        another endpoint never keep the PINGs away from the client's one. When the client's broker
        has not answered for KEEPALIVE_MISSES intervals (an idle program whose active broker
        died), the keepalive PINGs every other endpoint too: that is the vote the passive broker
        needs to take over (PROTOCOL.md §9.1), after which it renews the replicated sessions."""
        socks: dict[int, zmq.Socket[Any]] = {}
        heard: dict[int, float] = {}
        followed = -1
        try:
            while not self._ka_stop.wait(self._keepalive):
                with self._lock:
                    ids = list(self._sessions.keys())
                    if not ids:
                        self._ka_thread = None
                        return
                now = monotonic()
                for index, sock in socks.items():
                    if _drain(sock):
                        heard[index] = now
                current = self._index
                if current != followed:  # the client moved: give that broker its full grace
                    followed = current
                    heard[current] = now
                targets = [current]
                if now - heard.get(current, now) > KEEPALIVE_MISSES * self._keepalive:
                    targets += [i for i in range(len(self._endpoints)) if i != current]
                    log.debug(
                        "keepalive: %s silent; PINGing the other endpoints too",
                        self._endpoints[current],
                    )
                frames = rq.ping_frames(ids)
                for index in targets:
                    if index not in socks:
                        socks[index] = self._connect(self._endpoints[index], KEEPALIVE_HWM)
                        heard.setdefault(index, now)
                    try:
                        socks[index].send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        log.debug(
                            "keepalive: PING to %s not sent, queue full", self._endpoints[index]
                        )
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("session keepalive stopped by an unexpected error")
        finally:
            for sock in socks.values():
                sock.close(linger=0)
            with self._lock:  # after an error: let the next session start a new keepalive
                if self._ka_thread is threading.current_thread():
                    self._ka_thread = None


class Session:
    """A device session pinned to one GPU: allocate, copy, launch, synchronize (the C-like API).

    Made by :meth:`Client.session`; use it as a context manager, or call :meth:`close`. Each method
    takes an optional keyword ``timeout`` (seconds; the client's timeout by default).

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
        client: Client,
        sid: bytes,
        worker: str,
        gpu: dict[str, Any],
        *,
        need: dict[str, Any] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self._client = client
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

    @property
    def replays(self) -> int:
        """How many times the session has been opened again and replayed."""
        return self._replays

    # ------------------------------------------------------------------ calls and replay

    def _call(
        self,
        op: str,
        args: Mapping[str, Any],
        convert: _Converter[T],
        timeout: float | None,
        payload: Sequence[Any] = (),
        expect: int = 0,
    ) -> T:
        """One CALL, ``args`` with the caller's handles; replays the session when it was lost.
        ``expect``: payload bytes the reply carries."""
        if self._closed:
            raise SessionLost(f"session {id_text(self.id)} is closed")
        limit = self._client.timeout if timeout is None else timeout
        while True:
            wire = self._wire(op, args, self._handles)
            try:
                return self._send(op, wire, convert, limit, payload, expect)
            except (SessionLost, GpuFault) as exc:
                if op == "close" or self._closed:
                    raise
                self._recover(exc, limit)

    def _send(
        self,
        op: str,
        args: Mapping[str, Any],
        convert: _Converter[T],
        limit: float,
        payload: Sequence[Any] = (),
        expect: int = 0,
    ) -> T:
        """One CALL on the current session, as it is (``args`` with its real handles)."""
        client = self._client
        rid = new_id()
        frames = rq.call_frames(rid, self.id, op, args, payload)
        what = f"session {id_text(self.id)} {op} {id_text(rid)}"
        client._submit(rid, frames, what, expect)
        pending = Pending(client, rid, convert, limit, what, cancellable=False)
        return client._sync(pending, None)

    def _copy(self, op: str, args: Mapping[str, Any], buf: memoryview, timeout: float | None) -> None:
        """A chunked copy (``args``: handle and offset, the caller's handle): ``htod`` sends
        ``buf``, ``dtoh`` fills it. Replays the session when it was lost, then copies again from
        the start (what had reached the lost session is gone with it)."""
        if self._closed:
            raise SessionLost(f"session {id_text(self.id)} is closed")
        limit = self._client.timeout if timeout is None else timeout
        while True:
            wire = self._wire(op, args, self._handles)
            try:
                self._send_chunks(op, wire, buf, limit)
                return
            except (SessionLost, GpuFault) as exc:
                if self._closed:
                    raise
                self._recover(exc, limit)

    def _send_chunks(self, op: str, args: Mapping[str, Any], buf: memoryview, limit: float) -> None:
        """One copy on the current session (``args`` with its real handle) as chunk CALLs of at
        most ``chunk_bytes``, ``chunk_window`` of them outstanding; each waits at most ``limit``
        seconds once it is the oldest. The first chunk that fails fails the copy."""
        client = self._client
        base = args["offset"]
        sid = self.id

        def submit(span: tuple[int, int]) -> Pending[None]:
            start, size = span
            wire = dict(args, offset=base + start)
            part = buf[start : start + size]
            if op == "htod":
                payload: Sequence[Any] = (part,)
                expect = 0
                convert: _Converter[None] = rq.parse_empty
            else:
                wire["nbytes"] = size
                payload, expect = (), size

                def convert(msg: Message) -> None:
                    part[:] = rq.parse_dtoh(msg, size)

            rid = new_id()
            what = f"session {id_text(sid)} {op} {id_text(rid)} (bytes {start}..{start + size})"
            client._submit(rid, rq.call_frames(rid, sid, op, wire, payload), what, expect)
            return Pending(client, rid, convert, limit, what, cancellable=False)

        run_windowed(
            plan(buf.nbytes, client._chunk_bytes),
            client._chunk_window,
            submit,
            lambda pending: client._sync(pending, None),
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
            allowed = self._client._session_replays
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
        client = self._client
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
        sid, worker, gpu = client._open_session(self._need, limit, replaces=old)
        client._unregister_session(old)
        self.id, self.worker, self.gpu = sid, worker, gpu
        client._register_session(self)  # the keepalive renews the new one from now on
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
            handles[entry.handle] = self._send("alloc", wire, rq.parse_handle, limit)
        elif entry.op == "htod":
            data = memoryview(entry.data)
            if data.nbytes > self._client._chunk_bytes:  # chunked as it was sent the first time
                self._send_chunks("htod", wire, data, limit)
            else:
                self._send("htod", wire, rq.parse_empty, limit, payload=[data])
        elif entry.op == "load":
            self._send("load", wire, rq.parse_empty, limit, payload=[entry.data])
        else:
            self._send(entry.op, wire, rq.parse_empty, limit)
            if entry.op == "free":
                del handles[entry.handle]

    def _abandon(self) -> None:
        """Close the current session without waiting (its rebuild failed)."""
        client = self._client
        client._unregister_session(self.id)
        try:
            client._send(rq.call_frames(new_id(), self.id, "close", {}))
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
        real = self._call("alloc", {"nbytes": nbytes}, rq.parse_handle, timeout)
        handle = self._adopt(real)
        self._journal.alloc(handle, nbytes)
        return DevicePtr(handle, nbytes, self._key)

    def mem_free(self, ptr: DevicePtr | int, *, timeout: float | None = None) -> None:
        """Free an allocation."""
        handle = self._handle_of(ptr)
        self._call("free", {"handle": handle}, rq.parse_empty, timeout)
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
        view = rq.as_view(buffer, "buffer")
        _check_range(ptr, offset, view.nbytes)
        args = {"handle": handle, "offset": offset}
        if view.nbytes > self._client._chunk_bytes:
            self._copy("htod", args, view, timeout)
        else:
            self._call("htod", args, rq.parse_empty, timeout, payload=[view])
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
            target = rq.as_view(out, "out")
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
        if size > self._client._chunk_bytes:
            dest = target if target is not None else memoryview(bytearray(size))
            self._copy("dtoh", {"handle": handle, "offset": offset}, dest, timeout)
            return out if target is not None else bytes(dest)
        args = {"handle": handle, "offset": offset, "nbytes": size}
        data = self._call("dtoh", args, lambda m: rq.parse_dtoh(m, size), timeout, expect=size)
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
        wire_args = [rq.encode_launch_arg(i, a, self._key) for i, a in enumerate(args)]
        body = {
            "module": module,
            "name": name,
            "grid": grid_l,
            "block": block_l,
            "args": wire_args,
            "shared_mem": shared_mem,
        }
        self._call("launch", body, rq.parse_empty, timeout)
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
        data = source.encode("utf-8") if isinstance(source, str) else bytes(rq.as_view(source, "source"))
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
        self._call("sync", {}, rq.parse_empty, timeout)

    def device_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The session's GPU and memory: ``gpu``, ``mem_granted``, ``mem_used``, ``simulated``;
        ``process`` (``pid``, ``uid``) where the worker runs the session in a process of its own."""
        return self._call("info", {}, rq.parse_info, timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """End the session and release its grant. Idempotent; a session the broker already ended
        (SessionLost), or whose GPU failed (GpuFault), counts as closed; it is not replayed."""
        if self._closed:
            return
        self._client._unregister_session(self.id)
        try:
            self._call("close", {}, rq.parse_empty, timeout)
        except (SessionLost, GpuFault):
            pass
        finally:
            self._closed = True
            self._journal.disable("the session is closed")
            self._handles.clear()


# --------------------------------------------------------------------------- helpers


def _parse_load(msg: Message) -> list[str]:
    """The kernel names of a ``load`` CALL's REPLY (empty when the worker does not know them)."""
    header = rq.check_reply(msg)
    functions = header.get("functions", [])
    if type(functions) is not list or not all(type(f) is str for f in functions):
        raise ProtocolError("load reply field 'functions' must be a list of strings")
    if header.get("compiled") is False:  # a SIMULATED GPU without nvcc: errors in the source stay hidden
        log.warning("module loaded but %s", str(header.get("note") or "not compiled")[:500])
    return functions


def _endpoint_list(endpoints: str | Sequence[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip() for e in items if isinstance(e, str) and e.strip()]
    if not out or not all(isinstance(e, str) for e in items):
        raise ConfigError(f"endpoints must be one or more endpoint strings, got {endpoints!r}")
    return out


def _real_handle(handles: Mapping[int, int], handle: Any) -> int:
    """The current session's handle for the caller's ``handle``; InvalidRequest when it names no
    open allocation (as the worker answers for an unknown handle)."""
    real = handles.get(handle) if type(handle) is int else None
    if real is None:
        raise InvalidRequest(f"unknown handle {handle!r} (freed, or never allocated here)")
    return real


def _payload_bytes(frames: Sequence[Any]) -> int:
    """Bytes of a message's payload frames (those after signature, command and header)."""
    return sum([f.nbytes if type(f) is memoryview else len(f) for f in frames[3:]])


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _check_range(ptr: DevicePtr | int, offset: int, nbytes: int) -> None:
    if type(offset) is not int or offset < 0:
        raise InvalidRequest("offset must be a non-negative int")
    if isinstance(ptr, DevicePtr) and offset + nbytes > ptr.nbytes:
        raise InvalidRequest(
            f"{nbytes} bytes at offset {offset} do not fit the {ptr.nbytes}-byte allocation"
        )


def _drain(sock: zmq.Socket[Any]) -> bool:
    """Read and discard every queued message; whether there was any."""
    got = False
    while True:
        try:
            sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return got
        got = True
