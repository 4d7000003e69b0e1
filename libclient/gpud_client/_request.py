"""Request building and reply parsing for the client dialog, shared by every client flavour.

This module owns what a client puts on the wire (REQUEST, CALL, CANCEL, PING and ADMIN frames, the
``need`` map, launch-argument tags) and how it reads what comes back: a REPLY or ERROR becomes a
result value or the matching exception from :mod:`gpud.errors`. It has no sockets, so the sync client
and any later asyncio client build requests the same way (STYLE.md point 10).

Replies are never trusted: a field of the wrong type raises :class:`~gpud.errors.ProtocolError`.
numpy is never imported here; numpy scalars are recognised by duck typing, and ``(type, number)``
pairs such as ``("f32", 2.0)`` give a kernel its scalars without numpy.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud import protocol
from gpud.errors import GpudError, InvalidRequest, ProtocolError, error_for
from gpud.protocol import Command, Message, Peer
from gpud.transfer import read_capped

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Buffer

    # Anything with the buffer protocol. numpy's stubs declare ndarray.__buffer__ only for
    # Python >= 3.12, so Any lets arrays through when type-checking for 3.11.
    BytesLike: TypeAlias = Buffer | Any

__all__ = [
    "BUILTIN",
    "SCALAR_TYPES",
    "DevicePtr",
    "JobResult",
    "admin_frames",
    "as_bytes",
    "as_view",
    "Need",
    "call_frames",
    "cancel_frames",
    "check_reply",
    "encode_launch_arg",
    "error_from",
    "job_body",
    "need_of",
    "parse_echo",
    "parse_job_result",
    "parse_session_open",
    "ping_frames",
    "request_frames",
    "timeout_ms",
]

BUILTIN = protocol.BUILTIN_MODULE
"""Module name of the worker's built-in kernel library (PROTOCOL.md §5.4)."""

# numpy dtype name -> launch argument tag (PROTOCOL.md §5.4).
_SCALAR_TAGS: dict[str, str] = {
    "float32": "f32",
    "float64": "f64",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
}
SCALAR_TYPES = tuple(_SCALAR_TAGS.values())
"""The types of a ``(type, number)`` launch argument: f32, f64, i32, u32, i64, u64."""


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class DevicePtr:
    """A device allocation of one session, as returned by :meth:`Session.mem_alloc`.

    Attributes
    ----------
    handle:
        The allocation's handle as the caller knows it: the one the worker chose (scoped to its
        session), which stays valid when the session is replayed on another worker (the
        :class:`~gpud_client.session.Session` then maps it to the new session's handle).
    nbytes:
        Size of the allocation in bytes.
    session:
        Id the session that owns it had when it was opened (``Session.id`` may change on replay).
    """

    handle: int
    nbytes: int
    session: bytes = field(repr=False)

    def __int__(self) -> int:
        return self.handle


@dataclass(frozen=True, slots=True)
class JobResult:
    """The outcome of a job (PROTOCOL.md §5.3).

    Attributes
    ----------
    exit_code:
        The program's exit status; negative when it was killed by that signal.
    stdout, stderr:
        What the program wrote, at most ``output_cap`` bytes each.
    stdout_truncated, stderr_truncated:
        Whether the output was cut at ``output_cap``.
    timed_out:
        Whether the job was killed at its ``time_limit``.
    files:
        Requested output files that existed after exit, by name (empty with ``outputs_to``).
    paths:
        With ``outputs_to``: where each of those files was written, by name.
    worker:
        Name of the worker that ran it.
    gpus:
        UUIDs of the GPUs it was granted.
    user:
        The Unix user it ran as.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    worker: str = ""
    gpus: list[str] = field(default_factory=list)
    user: str = ""
    paths: dict[str, Path] = field(default_factory=dict)


# --------------------------------------------------------------------------- buffers


def as_view(obj: BytesLike, what: str = "buffer") -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, numpy array...); no copy."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidRequest(
            f"{what} must support the buffer protocol, not {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidRequest(f"{what} must be C-contiguous (numpy: use numpy.ascontiguousarray)")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def input_view(obj: BytesLike | os.PathLike[str], what: str) -> memoryview:
    """A job input's bytes: a buffer as ``as_view``, or a file on disk (``os.PathLike``, e.g.
    ``pathlib.Path``) mapped read-only: sent from the page cache, never read into the client's
    own memory. The file must not change until the job is done (a file cut shorter meanwhile
    ends the client with SIGBUS, as any mapping of it would)."""
    if isinstance(obj, str):
        raise InvalidRequest(f"{what}: give its content as bytes, or a path as pathlib.Path, not a str")
    if not isinstance(obj, os.PathLike):
        return as_view(obj, what)
    path = os.fspath(obj)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidRequest(f"{what}: cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"{what}: {path} is not a regular file")
        if st.st_size == 0:  # empty, or a file that does not tell its size (/proc, /sys): read it
            data = read_capped(fd, UNSIZED_MAX)
            if data is None:
                raise InvalidRequest(f"{what}: {path} says it is empty but holds more than {UNSIZED_MAX} bytes; "
                                     "copy it into a regular file first")
            return memoryview(data)
        mapped = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    except OSError as exc:
        raise InvalidRequest(f"{what}: cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    mapped.madvise(mmap.MADV_SEQUENTIAL)  # read once, in order: read ahead, and let go behind
    return memoryview(mapped)  # keeps the mapping; unmapped once the last view of it goes


UNSIZED_MAX = 16 << 20  # bytes read, at most, of a file whose size its file system does not say


def as_bytes(frame: Any) -> bytes:
    """The bytes of a received frame (``bytes`` or ``zmq.Frame``)."""
    if type(frame) is bytes:
        return frame
    data = getattr(frame, "bytes", None)
    if type(data) is bytes:
        return data
    return bytes(frame)


def _frame_view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    if isinstance(buf, memoryview):
        return buf
    return memoryview(as_bytes(frame))


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Need:
    """What a job or a session needs of its GPU (PROTOCOL.md §5.1), as one value.

    ``Client.run``, ``submit`` and ``session`` take these fields as keywords, or one Need as
    ``need=``. A field left ``None`` (or 0, False) is not sent, so the broker's default for the kind
    of request applies (a job: one whole GPU share; a session: 100 milli and 256 MiB). It is what a
    caller asks for; :class:`gpud.protocol.Need` is what the broker makes of it, defaults filled in.

    Attributes
    ----------
    gpu_milli:
        Share of one GPU in thousandths.
    gpus:
        Whole GPUs (jobs only; 0: a share of one, ``gpu_milli``).
    mem:
        Device memory to reserve, in bytes.
    models:
        Allowed GPU model names.
    min_cc:
        Minimum CUDA compute capability, ``(major, minor)``.
    exclusive:
        Nothing else may be granted on the GPU meanwhile.
    priority:
        -100..100; higher is placed first.
    cpu_milli:
        Host CPU in thousandths of a core (0: none asked; the worker then sets no CPU limit).
    host_mem:
        Host memory in bytes (0: none asked; the worker's ``job_memory`` then limits it). The
        worker makes it the job's or session process's cgroup memory limit.
    """

    gpu_milli: int | None = None
    gpus: int = 0
    mem: int | None = None
    models: Sequence[str] | None = None
    min_cc: tuple[int, int] | Sequence[int] | None = None
    exclusive: bool = False
    priority: int = 0
    cpu_milli: int = 0
    host_mem: int = 0

    def wire(self, kind: str, tenant: str) -> dict[str, Any]:
        """The ``need`` map of a REQUEST of ``kind``, checked by the broker's own parser so that a
        bad field fails before anything is sent."""
        need: dict[str, Any] = {"tenant": tenant}
        if self.gpu_milli is not None:
            need["gpu_milli"] = self.gpu_milli
        if self.gpus:
            need["gpus"] = self.gpus
        if self.mem is not None:
            need["mem"] = self.mem
        if self.models is not None:
            if isinstance(self.models, str):
                raise InvalidRequest("'models' must be a list of model names, not one string")
            need["models"] = sorted(set(self.models))
        if self.min_cc is not None:
            need["min_cc"] = list(self.min_cc)
        if self.exclusive:
            need["exclusive"] = True
        if self.priority:
            need["priority"] = self.priority
        if self.cpu_milli:
            need["cpu_milli"] = self.cpu_milli
        if self.host_mem:
            need["host_mem"] = self.host_mem
        protocol.parse_need(kind, need)
        return need


def need_of(need: Need | None, given: Need) -> Need:
    """``need`` (a call's ``need=``) or, without one, ``given`` (the call's keywords); both at
    once are refused, as one would silently override the other."""
    if need is None:
        return given
    if not isinstance(need, Need):
        raise InvalidRequest(f"need must be a gpud_client.Need, not {type(need).__name__}")
    if given != _NO_NEED:
        raise InvalidRequest("give what is needed as need=Need(...) or as keywords, not both")
    return need


_NO_NEED = Need()


def timeout_ms(seconds: float) -> int:
    """A timeout in whole milliseconds, at least 1 (a REQUEST's ``deadline_ms``, a poll)."""
    return max(1, math.ceil(seconds * 1000))


def job_body(
    argv: Sequence[str],
    files: Mapping[str, BytesLike | os.PathLike[str]] | None,
    outputs: Sequence[str],
    env: Mapping[str, str] | None,
    time_limit: float,
    output_cap: int,
    idempotent: bool,
) -> tuple[dict[str, Any], list[memoryview]]:
    """The kind-specific REQUEST fields of a job and its payload frames (one per input file).

    Raises InvalidRequest when the job would be refused by the broker.
    """
    if isinstance(argv, (str, bytes)):
        raise InvalidRequest("'argv' must be a list of strings, e.g. ['python3', 'prog.py']")
    if isinstance(outputs, (str, bytes)):
        raise InvalidRequest("'outputs' must be a list of file names, not one string")
    names = list(files or {})
    frames = [input_view(files[n], f"file {n!r}") for n in names] if files else []
    body: dict[str, Any] = {
        "argv": list(argv),
        "env": dict(env or {}),
        "files": names,
        "outputs": list(outputs),
        "time_limit": float(time_limit),
        "output_cap": output_cap,
        "idempotent": bool(idempotent),
    }
    protocol.parse_job(body, len(frames))  # the broker's own validation, run here first
    return body, frames


def request_frames(
    rid: bytes,
    kind: str,
    need: dict[str, Any],
    deadline_ms: int,
    body: Mapping[str, Any] | None = None,
    payload: Sequence[Any] = (),
) -> list[Any]:
    """A REQUEST (PROTOCOL.md §3, §5)."""
    header: dict[str, Any] = {"id": rid, "kind": kind, "need": need, "deadline_ms": deadline_ms}
    if body:
        header.update(body)
    return protocol.encode(Peer.CLIENT, Command.REQUEST, header, payload)


def call_frames(
    rid: bytes,
    session: bytes,
    op: str,
    args: Mapping[str, Any],
    payload: Sequence[Any] = (),
    cap: bytes | None = None,
) -> list[Any]:
    """A CALL on an open session (PROTOCOL.md §5.4); ``args`` holds the op's named arguments;
    ``cap``: the session's capability, on the direct path (§10)."""
    header: dict[str, Any] = {"id": rid, "session": session, "op": op, "args": dict(args)}
    if cap is not None:
        header["cap"] = cap
    return protocol.encode(Peer.CLIENT, Command.CALL, header, payload)


def cancel_frames(rid: bytes) -> list[Any]:
    """A CANCEL of a queued REQUEST."""
    return protocol.encode(Peer.CLIENT, Command.CANCEL, {"id": rid})


def ping_frames(sessions: Sequence[bytes] = ()) -> list[Any]:
    """A PING naming the open sessions, so that their lease is renewed."""
    return protocol.encode(Peer.CLIENT, Command.PING, {"sessions": list(sessions)})


def admin_frames(
    rid: bytes, cmd: str, args: Mapping[str, Any] | None = None, who: Mapping[str, Any] | None = None
) -> list[Any]:
    """An ADMIN command (signed as the admin peer); ``who`` adds the asker's ``user`` and ``pid``."""
    header = {"id": rid, "cmd": cmd, "args": dict(args or {}), **(who or {})}
    return protocol.encode(Peer.ADMIN, Command.ADMIN, header)


def encode_launch_arg(index: int, value: Any, session: bytes) -> list[Any]:
    """One launch argument as its ``[type, value]`` wire pair.

    Device pointers become ``["ptr", handle]``. A number is given with its kernel parameter's exact
    C type, which Python cannot guess: as a ``(type, number)`` pair such as ``("f32", 2.0)`` or
    ``("i32", n)`` (the types of :data:`SCALAR_TYPES`; no numpy needed), or as a numpy scalar,
    tagged by its dtype (``numpy.float32(2.0)``). A plain Python number is refused.
    """
    if isinstance(value, DevicePtr):
        if value.session != session:
            raise InvalidRequest(f"argument {index}: the pointer belongs to another session")
        return ["ptr", value.handle]
    if type(value) is tuple and len(value) == 2 and type(value[0]) is str:
        tag, number = value
        if tag not in SCALAR_TYPES:
            raise InvalidRequest(
                f"argument {index}: type {tag!r} is not a kernel argument type; use one of "
                f"{', '.join(SCALAR_TYPES)}"
            )
        try:
            ((_, checked),) = protocol.parse_launch_args([[tag, number]])
        except InvalidRequest:
            kind = "a number" if tag in ("f32", "f64") else f"an int that fits {tag}"
            raise InvalidRequest(
                f"argument {index}: ({tag!r}, {number!r}): {tag} takes {kind}"
            ) from None
        return [tag, checked]
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        if getattr(value, "ndim", 0) != 0:
            raise InvalidRequest(
                f"argument {index}: arrays cannot be passed by value; copy them to device "
                "memory (mem_alloc + memcpy_htod) and pass the pointer"
            )
        tag = _SCALAR_TAGS.get(str(value.dtype))
        if tag is None:
            raise InvalidRequest(
                f"argument {index}: numpy {value.dtype} is not a kernel argument type; use one "
                f"of {', '.join('numpy.' + name for name in _SCALAR_TAGS)}"
            )
        item = value.item()
        return [tag, float(item) if tag in ("f32", "f64") else int(item)]
    if isinstance(value, (bool, int, float)):
        raise InvalidRequest(
            f"argument {index}: give a number with its exact C type, e.g. ('i32', 5), "
            "('f32', 2.0) or numpy.int32(5)"
        )
    raise InvalidRequest(
        f"argument {index}: cannot pass {type(value).__name__} to a kernel; use a device "
        "pointer, a (type, number) pair such as ('f32', 2.0), or a numpy scalar"
    )


# --------------------------------------------------------------------------- replies


def check_reply(msg: Message) -> dict[str, Any]:
    """The header of a successful REPLY; raises the matching GpudError for a failure.

    ERROR messages and REPLYs with ``ok: false`` become ``error_for(code, message)``; a header whose
    fields have the wrong types raises ProtocolError.
    """
    header = msg.header
    if msg.command is Command.ERROR:
        raise error_from(header)
    if msg.command is not Command.REPLY:
        raise ProtocolError(f"expected a REPLY, got {msg.command.name}")
    ok = header.get("ok")
    if type(ok) is not bool:
        raise ProtocolError("reply field 'ok' must be a boolean")
    if not ok:
        raise error_from(header)
    return header


def error_from(header: dict[str, Any]) -> GpudError:
    """The exception an error header (ERROR, or REPLY with ``ok: false``) stands for."""
    code = header.get("code")
    message = header.get("message")
    if type(code) is not str or type(message) is not str:
        return ProtocolError("error reply without a string 'code' and 'message'")
    return error_for(code, message)


def _field(header: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """An optional reply field of an exact type; ProtocolError when present with another type."""
    value = header.get(key)
    if value is None:
        return default
    if type(value) is not kind:
        raise ProtocolError(f"reply field {key!r} must be {kind.__name__}")
    return value


def _str_list(header: dict[str, Any], key: str) -> list[str]:
    value = _field(header, key, list, [])
    if not all(type(v) is str for v in value):
        raise ProtocolError(f"reply field {key!r} must be a list of strings")
    return list(value)


def parse_echo(msg: Message) -> bytes:
    """The payload an echo request got back."""
    header = check_reply(msg)
    _field(header, "worker", str, "")
    _str_list(header, "gpus")
    frames = msg.frames
    return as_bytes(frames[0]) if len(frames) == 1 else b"".join([as_bytes(f) for f in frames])


def parse_job_result(msg: Message) -> JobResult:
    """A job's REPLY as a JobResult."""
    header = check_reply(msg)
    code = header.get("exit_code")
    if type(code) is not int:
        raise ProtocolError("job reply field 'exit_code' must be an int")
    names = _str_list(header, "files")
    if len(msg.frames) != 2 + len(names):
        raise ProtocolError(
            f"job reply has {len(msg.frames)} payload frames; expected stdout, stderr and "
            f"{len(names)} files"
        )
    data = [as_bytes(f) for f in msg.frames]
    return JobResult(
        exit_code=code,
        stdout=data[0],
        stderr=data[1],
        stdout_truncated=_field(header, "stdout_truncated", bool, False),
        stderr_truncated=_field(header, "stderr_truncated", bool, False),
        timed_out=_field(header, "timed_out", bool, False),
        files=dict(zip(names, data[2:], strict=True)),
        worker=_field(header, "worker", str, ""),
        gpus=_str_list(header, "gpus"),
        user=_field(header, "user", str, ""),
    )


def parse_session_open(msg: Message, rid: bytes) -> tuple[bytes, str, dict[str, Any], Any]:
    """``(session id, worker, gpu, data)`` from the REPLY to a session REQUEST; ``data``: the
    direct path's offer as it came (None: none, PROTOCOL.md §10.2)."""
    header = check_reply(msg)
    sid = header.get("session", rid)
    if type(sid) is not bytes or len(sid) != protocol.ID_BYTES:
        raise ProtocolError("session reply field 'session' must be 16 bytes")
    worker = _field(header, "worker", str, "")
    gpu = _field(header, "gpu", dict, {})
    return sid, worker, dict(gpu), header.get("data")


def parse_handle(msg: Message) -> int:
    """The allocation handle from an ``alloc`` CALL's REPLY."""
    header = check_reply(msg)
    handle = header.get("handle")
    if type(handle) is not int or handle < 0:
        raise ProtocolError("alloc reply field 'handle' must be a non-negative int")
    return handle


def parse_dtoh(msg: Message, nbytes: int) -> memoryview:
    """The one payload frame of a ``dtoh`` CALL's REPLY, checked against the size asked for."""
    check_reply(msg)
    if len(msg.frames) != 1:
        raise ProtocolError(f"dtoh reply has {len(msg.frames)} payload frames; expected 1")
    view = _frame_view(msg.frames[0])
    if view.nbytes != nbytes:
        raise ProtocolError(f"dtoh reply holds {view.nbytes} bytes; {nbytes} were asked for")
    return view


def parse_info(msg: Message) -> dict[str, Any]:
    """The result fields of an ``info`` CALL."""
    header = check_reply(msg)
    out: dict[str, Any] = {
        "gpu": _field(header, "gpu", dict, {}),
        "mem_granted": _field(header, "mem_granted", int, 0),
        "mem_used": _field(header, "mem_used", int, 0),
        "simulated": _field(header, "simulated", bool, False),
    }
    if "worker" in header:
        out["worker"] = _field(header, "worker", str, "")
    if "process" in header:  # the session runs in a process of its own (its pid and uid)
        out["process"] = _field(header, "process", dict, {})
    return out


def parse_empty(msg: Message) -> None:
    """A REPLY that carries nothing but success."""
    check_reply(msg)
