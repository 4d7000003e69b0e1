"""The synchronous client: :class:`Client`, the library's public entry point.

This module owns the public calls (echo, jobs, sessions) and the checks of their arguments; what
they put on the wire is built by :mod:`gpud_client._request`, the conversation with the broker
pair (request table, liveness, failover, keepalive) is :mod:`gpud_client.connection`'s, and
sessions and their replay are :mod:`gpud_client.session`'s.

A :class:`Client` is not thread-safe: a call while another thread's call is under way raises
GpudError (and the other call goes on unharmed). Use one Client per thread.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import zmq

from gpud.errors import ConfigError, GpudError, InvalidRequest
from gpud.protocol import id_text, new_id, parse_need
from gpud.security import CurveKeys
from gpud_client import _request
from gpud_client._request import JobResult, Need, need_of
from gpud_client.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW
from gpud_client.connection import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_PING_INTERVAL_S,
    DEFAULT_SETTLE_S,
    Connection,
    Job,
    Pending,
    collect,
)
from gpud_client.journal import Journal
from gpud_client.session import (
    DEFAULT_JOURNAL_BYTES,
    DEFAULT_SESSION_REPLAYS,
    Session,
    SessionSettings,
    open_session,
)
from gpud_client.staging import job_result, stage

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
    "Need",
    "Pending",
    "Session",
]

DEFAULT_TIMEOUT_S = 30.0
"""Seconds a call may take, overall, unless a timeout is given."""

P = ParamSpec("P")
R = TypeVar("R")


def _parameters_of(model: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Declare that the decorated function takes ``model``'s parameters and passes them on: type
    checkers, :func:`inspect.signature` and ``help()`` show them, its own return type kept."""

    def declare(fn: Callable[..., R]) -> Callable[P, R]:
        returns = inspect.signature(fn).return_annotation
        fn.__signature__ = inspect.signature(model).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return fn

    return declare


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
    data_path:
        How sessions' CALLs travel (PROTOCOL.md §10): ``auto`` (default) straight to the session's
        worker when the broker offers it and the worker answers, else relayed through the broker
        (logged once, said in :meth:`Session.info`); ``direct``: straight or the session fails;
        ``broker``: always relayed. A broker whose own ``data_path`` is ``direct`` relays no
        session CALL: a session that cannot go straight then fails to open whatever this says.

    Notes
    -----
    Not thread-safe: a call made while another thread is inside a call of the same Client raises
    :class:`~gpud.errors.GpudError` at once, and the other call goes on unharmed. Use one Client
    per thread (handing one from a thread to another, one at a time, is fine).
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
        data_path: str = "auto",
    ) -> None:
        endpoint_list = _endpoint_list(endpoints)
        if data_path not in ("auto", "direct", "broker"):
            raise ConfigError(f"data_path must be 'auto', 'direct' or 'broker', got {data_path!r}")
        if curve is not None and (not isinstance(curve, CurveKeys) or curve.server_public is None):
            raise ConfigError("curve must be CurveKeys with the broker's public key (server_public)")
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
        try:
            parse_need("echo", {"tenant": tenant})
        except GpudError as exc:
            raise ConfigError(f"bad tenant {tenant!r}: {exc.message}") from None
        self.tenant = tenant
        self._settings = SessionSettings(
            float(timeout),
            journal_bytes,
            session_replays,
            chunk_bytes,
            chunk_window,
            data_path,
        )
        self._conn = Connection(
            endpoint_list,
            curve=curve,
            keepalive=float(keepalive),
            ping_interval=float(ping_interval),
            settle=float(settle),
            context=context,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def timeout(self) -> float:
        """Default overall deadline of each call, in seconds (may be changed)."""
        return self._settings.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {value!r}")
        self._settings.timeout = float(value)

    @property
    def endpoint(self) -> str:
        """The broker endpoint currently in use."""
        return self._conn.endpoint

    @property
    def endpoints(self) -> list[str]:
        """All broker endpoints, in failover order."""
        return self._conn.endpoints

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the largest session copy sent as one CALL; larger ones are chunked."""
        return self._settings.chunk_bytes

    @property
    def chunk_window(self) -> int:
        """Chunk CALLs of one copy outstanding at once."""
        return self._settings.chunk_window

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.endpoint
        return f"<gpud_client.Client {state} tenant={self.tenant!r}>"

    def close(self) -> None:
        """Close the client: stop the keepalive, close open sessions (without waiting), close the
        socket, and terminate the context when the client made it. Idempotent."""
        self._conn.close(Session._detach)

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
        return collect(self.submit_echo(payload, timeout=timeout))

    def submit_echo(
        self, payload: BytesLike = b"", *, timeout: float | None = None
    ) -> Pending[bytes]:
        """Send an echo request without waiting; ``Pending.wait()`` returns the payload."""
        limit = self._settings.timeout if timeout is None else timeout
        rid = new_id()
        view = _request.as_view(payload, "payload")
        frames = _request.request_frames(
            rid, "echo", {"tenant": self.tenant}, _request.timeout_ms(limit), payload=[view]
        )
        what = f"echo {id_text(rid)}"
        self._conn.submit(rid, frames, what, nbytes=2 * view.nbytes)
        return Pending(self._conn, rid, _request.parse_echo, limit, what, cancellable=True)

    def submit(
        self,
        argv: Sequence[str],
        files: Mapping[str, BytesLike | os.PathLike[str]] | None = None,
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
        *,
        cpu_milli: int = 0,
        host_mem: int = 0,
        need: Need | None = None,
        outputs_to: str | os.PathLike[str] | None = None,
    ) -> Job:
        """Submit a job without waiting for it.

        Parameters
        ----------
        argv:
            Program and arguments, run in the job's private working directory.
        files:
            Input files to place in that directory, name -> bytes-like content, or a
            ``pathlib.Path`` of a file on disk (mapped, not read into memory: a dataset or a model
            of any size up to the limit). Buffers and files are sent without copying: do not
            change them until the job is done. Files larger
            together than the client's ``chunk_bytes`` are staged first (PROTOCOL.md §11): sent
            in chunks, a few at a time, before this call returns; past the broker's
            ``max_job_input_bytes`` (default 4 GiB) TooLarge is raised before any byte is sent.
        outputs:
            Names of files to bring back after the program exits.
        outputs_to:
            A directory to write those files into (as they come, never whole in memory; each
            appears under its name once all are written) instead of :attr:`JobResult.files`;
            :attr:`JobResult.paths` then says where they are. An existing file of the same name
            is replaced.
        env:
            Extra environment variables (names ``[A-Z_][A-Z0-9_]*``).
        gpu_milli, gpus, mem, models, min_cc, exclusive, priority, cpu_milli, host_mem:
            What the job needs (the fields of :class:`Need`, PROTOCOL.md §5.1); ``None`` leaves
            the broker's default for jobs (one whole GPU share, no memory reservation).
            ``host_mem`` (bytes) and ``cpu_milli`` are host memory and CPU: placed on, and the
            job's cgroup limits on the worker.
        time_limit:
            Seconds after which the job's whole process group is killed.
        output_cap:
            Bytes kept of stdout and of stderr each.
        idempotent:
            Whether the broker may run it again elsewhere after losing its worker.
        timeout:
            Overall seconds to wait for the result; ``max(timeout, time_limit + timeout)`` with
            the client's timeout by default.
        need:
            What the job needs as one :class:`Need`, instead of the keywords above.

        Returns
        -------
        Job
            ``Job.wait()`` returns the :class:`JobResult`.
        """
        body, payload = _request.job_body(argv, files, outputs, env, time_limit, output_cap, idempotent)
        into = None if outputs_to is None else Path(outputs_to)
        if into is not None and not into.is_dir():
            raise InvalidRequest(f"outputs_to: {into} is not a directory")
        given = Need(gpu_milli, gpus, mem, models, min_cc, exclusive, priority, cpu_milli, host_mem)
        wire_need = need_of(need, given).wire("job", self.tenant)
        if timeout is None:
            overall = max(self.timeout, float(time_limit) + self.timeout)
            queue_wait = self.timeout
        else:
            overall = queue_wait = timeout
        rid = new_id()
        settings = self._settings
        what = f"job {id_text(rid)}"
        if sum([v.nbytes for v in payload]) > settings.chunk_bytes:
            # Large inputs go in chunks, the REQUEST right after their upload opens (PROTOCOL.md §11).
            body["staged"] = [v.nbytes for v in payload]
            frames = _request.request_frames(rid, "job", wire_need, _request.timeout_ms(queue_wait), body, [])
            stage(self._conn, rid, payload, self.tenant, settings.timeout, lambda: self._conn.submit(rid, frames, what))
        else:
            self._conn.submit(rid, _request.request_frames(rid, "job", wire_need, _request.timeout_ms(queue_wait), body, payload),
                              what)
        convert = job_result(self._conn, self.tenant, settings.timeout, outputs_to=into, requested=body["outputs"])
        return Job(self._conn, rid, convert, overall, what, cancellable=True)

    @_parameters_of(submit)
    def run(self, *args: Any, **kwargs: Any) -> JobResult:
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
        return collect(self.submit(*args, **kwargs))

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
        *,
        cpu_milli: int = 0,
        host_mem: int = 0,
        need: Need | None = None,
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
        cpu_milli, host_mem:
            Host CPU (thousandths of a core) and memory (bytes) of the session's process on the
            worker: placed on, and that process's cgroup limits.
        need:
            What the session needs as one :class:`Need`, instead of the keywords above (``model``
            is ``Need(models=[model])``).

        Returns
        -------
        Session
            A context manager; leaving it closes the session. Its journal holds up to the client's
            ``journal_bytes``, so that it survives the loss of its worker or GPU (see Session).
        """
        if model is not None:
            if isinstance(models, str):
                raise InvalidRequest("'models' must be a list of model names, not one string")
            models = [model, *(models or ())]
        given = Need(gpu_milli, 0, mem, models, min_cc, exclusive, priority, cpu_milli, host_mem)
        wire_need = need_of(need, given).wire("session", self.tenant)
        limit = self.timeout if timeout is None else timeout
        conn, settings = self._conn, self._settings
        sid, worker, gpu, data = open_session(conn, wire_need, limit)
        journal = Journal(settings.journal_bytes)
        session = Session(conn, settings, sid, worker, gpu, need=wire_need, journal=journal, data=data)
        conn.add_session(sid, session)
        return session


# --------------------------------------------------------------------------- helpers


def _endpoint_list(endpoints: str | Sequence[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip() for e in items if isinstance(e, str) and e.strip()]
    if not out or not all(isinstance(e, str) for e in items):
        raise ConfigError(f"endpoints must be one or more endpoint strings, got {endpoints!r}")
    return out
