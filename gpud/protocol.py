"""The wire protocol: the one implementation of docs/PROTOCOL.md.

Frames are ``[signature, command, header, *payload]``. This module owns the signatures, the command
table, the limits, ``encode``/``decode`` and the validation of every header field that crosses the
wire. It has no sockets: callers pass lists of frames in and out.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from gpud.errors import (
    GpudError,
    InvalidRequest,
    ProtocolError,
    TooLarge,
    UnknownCommand,
    VersionError,
)
from gpud.ids import new_id as new_id  # re-exported: ids are part of the wire protocol
from gpud.resources import GpuInfo, GpuState, Need

PROTOCOL_VERSION = 1
SIGNATURE_PREFIX = b"GPUD"

MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_FRAMES = 4096
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

# BATCH (PROTOCOL.md §2.1): at most this many messages in one; what ``batched`` combines.
BATCH_MAX_MESSAGES = 1024
BATCH_ITEM_PAYLOAD = 64 * 1024  # a message with more payload than this goes alone
BATCH_PAYLOAD = 1 << 20  # payload bytes in one BATCH at most
_BATCH_ITEM_OVERHEAD = 16  # msgpack bytes around one entry's header: array, command, bin and int prefixes


class Peer(bytes, enum.Enum):
    """Signature frame of each peer kind: ``GPUD`` + kind letter + version digit."""

    CLIENT = b"GPUDC1"
    WORKER = b"GPUDW1"
    ADMIN = b"GPUDA1"
    BROKER = b"GPUDB1"  # the other broker of a Binary Star pair (PROTOCOL.md §9)


class Command(enum.IntEnum):
    """One-byte commands (PROTOCOL.md §3). No command literal exists anywhere else."""

    REQUEST = 0x01
    REPLY = 0x02
    CANCEL = 0x03
    CALL = 0x04
    PING = 0x05
    PONG = 0x06
    PUT = 0x07
    READY = 0x10
    WELCOME = 0x11
    HEARTBEAT = 0x12
    DISPATCH = 0x13
    RESULT = 0x14
    DISCONNECT = 0x15
    ACK = 0x16
    START = 0x17
    GO = 0x18
    FETCH = 0x19
    CHUNK = 0x1A
    ADMIN = 0x20
    STATE = 0x30
    SYNC = 0x31
    SNAPSHOT = 0x32
    UPDATES = 0x33
    BATCH = 0x40
    ERROR = 0x7F


# What each peer kind may send to the broker. Anything else is UNKNOWN_COMMAND.
SENDABLE: dict[Peer, frozenset[Command]] = {
    Peer.CLIENT: frozenset({Command.REQUEST, Command.CANCEL, Command.CALL, Command.PING, Command.PUT, Command.FETCH}),
    Peer.WORKER: frozenset(
        {Command.READY, Command.HEARTBEAT, Command.RESULT, Command.START, Command.DISCONNECT, Command.BATCH,
         Command.FETCH, Command.CHUNK}
    ),
    Peer.ADMIN: frozenset({Command.ADMIN}),
    Peer.BROKER: frozenset({Command.STATE, Command.SYNC, Command.SNAPSHOT, Command.UPDATES}),
}

_PEER_BY_SIG: dict[bytes, Peer] = {p.value: p for p in Peer}
_CMD_BY_BYTE: dict[bytes, Command] = {bytes([c]): c for c in Command}
_CMD_BY_INT: dict[int, Command] = {int(c): c for c in Command}
CMD_BYTES: dict[Command, bytes] = {c: bytes([c]) for c in Command}
_BATCH = CMD_BYTES[Command.BATCH]

ID_BYTES = 16
KINDS = ("echo", "job", "session")
SESSION_OPS = ("alloc", "free", "htod", "dtoh", "load", "launch", "sync", "info", "close")
ARG_TYPES = ("ptr", "i32", "u32", "i64", "u64", "f32", "f64")
BUILTIN_MODULE = "builtin"

_packb: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack
_EMPTY_MAP = _packb({})


def packb(obj: Any) -> bytes:
    return _packb(obj)


_unpackb = msgpack.unpackb


def unpackb(data: bytes) -> Any:
    return _unpackb(data, raw=False, strict_map_key=True, use_list=True)


def id_text(rid: bytes) -> str:
    """Short printable form of an id for logs."""
    return rid.hex()[:12] if isinstance(rid, bytes) else repr(rid)


@dataclass(slots=True)
class Message:
    """A decoded message: who sent it, the command, the header map, the raw payload frames."""

    peer: Peer
    command: Command
    header: dict[str, Any]
    frames: list[Any] = field(default_factory=list)


# --------------------------------------------------------------------------- building messages
# Every message is built by ``encode`` or, for the ones each request sends, by a builder below
# whose ``[signature, command]`` frames are made once, here. ``frames`` (payload) are passed
# through untouched (no copies).

_CLIENT_SIG = Peer.CLIENT.value
_WORKER_SIG = Peer.WORKER.value
_REPLY = CMD_BYTES[Command.REPLY]
_DISPATCH = CMD_BYTES[Command.DISPATCH]
_PONG = CMD_BYTES[Command.PONG]


_PREFIXES: dict[tuple[Peer, Command], tuple[bytes, bytes]] = {(p, c): (p.value, CMD_BYTES[c]) for p in Peer for c in Command}


def encode(peer: Peer, command: Command, header: dict[str, Any], frames: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message."""
    sig, cmd = _PREFIXES[peer, command]
    return [sig, cmd, _packb(header), *frames]


def encode_raw(peer: Peer, command: Command, raw_header: bytes, frames: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message whose header is packed already."""
    sig, cmd = _PREFIXES[peer, command]
    return [sig, cmd, raw_header, *frames]


def reply(raw_header: bytes, frames: Sequence[Any] = ()) -> list[Any]:
    """A REPLY to a client whose header is packed already (a worker's RESULT header, as it came)."""
    return [_CLIENT_SIG, _REPLY, raw_header, *frames]


def error_reply(rid: bytes | None, exc: GpudError) -> list[Any]:
    """The REPLY that ends request ``rid`` with ``exc``."""
    return [_CLIENT_SIG, _REPLY, _packb(error_header(rid, exc))]


def pong() -> list[Any]:
    return [_CLIENT_SIG, _PONG, _EMPTY_MAP]


def dispatch(header: dict[str, Any], frames: Sequence[Any] = ()) -> list[Any]:
    """A DISPATCH to a worker."""
    return [_WORKER_SIG, _DISPATCH, _packb(header), *frames]


def decode(
    frames: Sequence[Any],
    expect: Peer | None = None,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Message:
    """Validate and unpack one message (frames after any ROUTER identity).

    Raises ProtocolError (or a subclass) on anything malformed; never trusts the input.
    ``frames`` may hold bytes or zmq.Frame objects (the payload is kept as given).
    """
    n = len(frames)
    if n < 3:
        raise ProtocolError(f"message has {n} frames; at least 3 are required")
    if n - 3 > MAX_PAYLOAD_FRAMES:
        raise TooLarge(f"message has {n - 3} payload frames; the limit is {MAX_PAYLOAD_FRAMES}")
    # Frames are bytes but for zmq.Frame payloads: the common case costs no call.
    sig = frames[0] if type(frames[0]) is bytes else as_bytes(frames[0])
    peer = _PEER_BY_SIG.get(sig)
    if peer is None:
        if len(sig) == 6 and sig[:4] == SIGNATURE_PREFIX and sig[4:5] in b"CWAB":
            raise VersionError(
                f"unsupported protocol version {sig[5:6]!r}; this peer speaks {PROTOCOL_VERSION}"
            )
        raise ProtocolError(f"bad signature frame {sig[:16]!r}")
    if expect is not None and peer is not expect:
        raise UnknownCommand(f"a {peer.name.lower()} peer may not talk to this socket")
    cmd = frames[1] if type(frames[1]) is bytes else as_bytes(frames[1])
    command = _CMD_BY_BYTE.get(cmd)
    if command is None:
        raise UnknownCommand(f"unknown command {cmd[:4]!r}")
    raw = frames[2] if type(frames[2]) is bytes else as_bytes(frames[2])
    if len(raw) > MAX_HEADER_BYTES:
        raise TooLarge(f"header is {len(raw)} bytes; the limit is {MAX_HEADER_BYTES}")
    total = len(raw)
    if n > 3:
        total += sum([len(f) if type(f) is bytes else _nbytes(f) for f in frames[3:]])
    if total > max_bytes:
        raise TooLarge(f"message is {total} bytes; the limit is {max_bytes}")
    return Message(peer, command, _header(raw), list(frames[3:]))


def _header(raw: bytes) -> dict[str, Any]:
    try:
        # raw=False, strict_map_key=True, use_list=True: msgpack 1.0's defaults, not passed on the
        # hot path (keyword arguments cost a C call about a third more).
        header = _unpackb(raw)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc.__class__.__name__}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a msgpack map")
    for key in header:
        if type(key) is not str:
            raise ProtocolError("header keys must be strings")
    return header


# --------------------------------------------------------------------------- batches (§2.1)


def batch(messages: Sequence[Sequence[Any]]) -> list[Any]:
    """One BATCH carrying ``messages`` (each the frames of one message of the same dialog,
    ``[signature, command, header, *payload]``, in the order they would have been sent). The caller
    keeps to the limits; ``batched`` does."""
    items = []
    payload: list[Any] = []
    for m in messages:
        items.append((m[1][0], m[2], len(m) - 3))
        if len(m) > 3:
            payload += m[3:]
    return [messages[0][0], _BATCH, _packb({"msgs": items}), *payload]


def batched(messages: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """What to send for ``messages`` (frames of messages to one peer, in order): runs of small
    messages as BATCHes, anything larger alone, the order kept."""
    if len(messages) == 1:
        return list(messages)
    runs: list[list[Sequence[Any]]] = []
    joinable = False  # whether the last run may take the next message
    head = frames = size = 0
    for m in messages:
        n = len(m) - 3
        mine = sum([_nbytes(f) for f in m[3:]]) if n else 0
        h = len(m[2]) + _BATCH_ITEM_OVERHEAD
        if (joinable and mine <= BATCH_ITEM_PAYLOAD and len(runs[-1]) < BATCH_MAX_MESSAGES
                and head + h <= MAX_HEADER_BYTES - 64 and frames + n <= MAX_PAYLOAD_FRAMES
                and size + mine <= BATCH_PAYLOAD):
            runs[-1].append(m)
            head, frames, size = head + h, frames + n, size + mine
        else:
            runs.append([m])
            joinable = mine <= BATCH_ITEM_PAYLOAD  # a large message goes alone
            head, frames, size = h, n, mine
    return [run[0] if len(run) == 1 else batch(run) for run in runs]


def unbatch(msg: Message) -> list[tuple[Message, bytes]]:
    """The messages a BATCH carries, in order, each with its raw header (as frame 2 of the message
    alone). The whole BATCH is checked first: ProtocolError (or a subclass) if any part of it is
    malformed, and then none of it is to be handled."""
    items = msg.header.get("msgs")
    if type(items) is not list or not 1 <= len(items) <= BATCH_MAX_MESSAGES:
        raise ProtocolError(f"BATCH needs 'msgs': a list of 1..{BATCH_MAX_MESSAGES} messages")
    frames = msg.frames
    total = len(frames)
    at = 0
    out = []
    for item in items:
        if type(item) is not list or len(item) != 3:
            raise ProtocolError("a BATCH entry must be [command, header, frames]")
        code, raw, count = item
        command = _CMD_BY_INT.get(code) if type(code) is int else None
        if command is None:
            raise UnknownCommand(f"unknown command {code!r} in a BATCH")
        if command is Command.BATCH:
            raise ProtocolError("a BATCH may not carry a BATCH")
        if type(raw) is not bytes:
            raise ProtocolError("a BATCH entry's header must be bin")
        if len(raw) > MAX_HEADER_BYTES:
            raise TooLarge(f"header is {len(raw)} bytes; the limit is {MAX_HEADER_BYTES}")
        if type(count) is not int or count < 0 or at + count > total:
            raise ProtocolError("a BATCH's frame counts do not match its payload frames")
        out.append((Message(msg.peer, command, _header(raw), frames[at:at + count]), raw))
        at += count
    if at != total:
        raise ProtocolError("a BATCH's frame counts do not match its payload frames")
    return out


def messages(msg: Message) -> list[Message]:
    """The messages a received message stands for: itself, or what a BATCH carries."""
    return [m for m, _ in unbatch(msg)] if msg.command is Command.BATCH else [msg]


def as_bytes(frame: Any) -> bytes:
    """A frame (bytes, zmq.Frame or any buffer) as bytes: the one conversion every component uses."""
    if type(frame) is bytes:
        return frame
    b = getattr(frame, "bytes", None)  # zmq.Frame
    if b is not None:
        return bytes(b)
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    raise ProtocolError(f"frame of type {type(frame).__name__} is not bytes")


def _nbytes(frame: Any) -> int:
    """Size in bytes of a payload frame: bytes, zmq.Frame, or any buffer."""
    try:
        return len(frame) if type(frame) is bytes or hasattr(frame, "more") else memoryview(frame).nbytes
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not bytes") from None


# --------------------------------------------------------------------------- field validation


def user_key(owner: str | None) -> str:
    """The Z85 public key of a client's ZAP User-Id ``TENANT KEY`` (``security.client_user``,
    ``parse_client_user``'s owner): the key a direct session admits; "" for none."""
    return owner.partition(" ")[2] if owner else ""


def get_id(header: dict[str, Any], key: str = "id") -> bytes:
    """The 16-byte id under ``key``; ProtocolError when missing or malformed."""
    rid = header.get(key)
    if type(rid) is not bytes or len(rid) != ID_BYTES:
        raise ProtocolError(f"header field {key!r} must be {ID_BYTES} bytes")
    return rid


def opt(header: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """An optional header field of a given type (bool is not an int here)."""
    value = header.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool and not (isinstance(kind, tuple) and bool in kind):
        raise InvalidRequest(f"field {key!r} must be {_type_name(kind)}, not a boolean")
    if not isinstance(value, kind):
        raise InvalidRequest(f"field {key!r} must be {_type_name(kind)}, not {type(value).__name__}")
    return value


def req(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise InvalidRequest(f"field {key!r} is required")
    return opt(header, key, kind)


def _type_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _int_in(value: int, key: str, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise InvalidRequest(f"field {key!r} must be in {lo}..{hi}, got {value}")
    return value


# Default needs per kind (PROTOCOL.md §5).
DEFAULT_NEED = {
    "echo": (1, 0),
    "job": (1000, 0),
    "session": (100, 256 << 20),
}
_TENANT_RE = re.compile(r"[A-Za-z0-9._@-]{1,64}\Z")

# A client's routing id: 16 random bytes it sets itself (PROTOCOL.md §2). The broker drops messages
# from any other (libzmq's automatic ids are 5 bytes beginning with a zero byte).
ROUTING_ID_BYTES = 16


def new_routing_id() -> bytes:
    """A fresh client routing id (set as ``zmq.ROUTING_ID`` before connecting)."""
    return os.urandom(ROUTING_ID_BYTES)


def parse_client_user(user: str) -> tuple[str, str]:
    """(tenant, owner) of a client's ZAP User-Id ``TENANT KEY`` (``security.client_user``); the
    owner is the whole User-Id: replies are bound to the tenant and the key."""
    return user.partition(" ")[0], user


MAX_MEM = 1 << 50


def parse_need(kind: str, raw: Any) -> Need:
    """Validate a REQUEST's ``need`` map for ``kind``; InvalidRequest on any bad field."""
    if raw is None:
        raw = {}
    if type(raw) is not dict:
        raise InvalidRequest("field 'need' must be a map")
    milli_default, mem_default = DEFAULT_NEED[kind]
    gpus = _int_in(opt(raw, "gpus", int, 0), "gpus", 0, 64)
    milli = opt(raw, "gpu_milli", int, None)
    if gpus:
        if milli not in (None, 0, 1000):
            raise InvalidRequest("with 'gpus' > 0, 'gpu_milli' must be 0 or 1000")
        milli = 1000
    else:
        milli = _int_in(milli_default if milli is None else milli, "gpu_milli", 1, 1000)
    if kind == "session" and gpus > 1:
        raise InvalidRequest("a session is pinned to one GPU; 'gpus' must be 0 or 1")
    mem = _int_in(opt(raw, "mem", int, mem_default), "mem", 0, MAX_MEM)
    cpu = _int_in(opt(raw, "cpu_milli", int, 0), "cpu_milli", 0, 1 << 30)
    host_mem = _int_in(opt(raw, "host_mem", int, 0), "host_mem", 0, MAX_MEM)
    models_raw = opt(raw, "models", list, None)
    models: frozenset[str] | None = None
    if models_raw is not None:
        if not models_raw or not all(type(m) is str and 0 < len(m) <= 64 for m in models_raw):
            raise InvalidRequest("field 'models' must be a non-empty list of model names")
        models = frozenset(models_raw)
    cc_raw = opt(raw, "min_cc", list, None)
    min_cc: tuple[int, int] | None = None
    if cc_raw is not None:
        if len(cc_raw) != 2 or not all(type(v) is int and 0 <= v < 100 for v in cc_raw):
            raise InvalidRequest("field 'min_cc' must be [major, minor]")
        min_cc = (cc_raw[0], cc_raw[1])
    exclusive = opt(raw, "exclusive", bool, False)
    priority = _int_in(opt(raw, "priority", int, 0), "priority", -100, 100)
    tenant = opt(raw, "tenant", str, "default")
    if not _TENANT_RE.match(tenant):
        raise InvalidRequest("field 'tenant' must be 1-64 of [A-Za-z0-9._@-]")
    return Need(
        gpu_milli=milli,
        gpus=gpus,
        mem=mem,
        cpu_milli=cpu,
        host_mem=host_mem,
        models=models,
        min_cc=min_cc,
        exclusive=exclusive,
        priority=priority,
        tenant=tenant,
    )


def need_to_wire(need: Need) -> dict[str, Any]:
    """The ``need`` map for a REQUEST (inverse of parse_need for explicit fields)."""
    out: dict[str, Any] = {"gpu_milli": need.gpu_milli, "gpus": need.gpus, "mem": need.mem}
    if need.cpu_milli:
        out["cpu_milli"] = need.cpu_milli
    if need.host_mem:
        out["host_mem"] = need.host_mem
    if need.models is not None:
        out["models"] = sorted(need.models)
    if need.min_cc is not None:
        out["min_cc"] = list(need.min_cc)
    if need.exclusive:
        out["exclusive"] = True
    if need.priority:
        out["priority"] = need.priority
    out["tenant"] = need.tenant
    return out


_FILE_RE = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_ENV_RE = re.compile(r"[A-Z_][A-Z0-9_]*\Z")


def check_file_name(name: Any) -> str:
    if type(name) is not str or not _FILE_RE.match(name) or name in (".", ".."):
        raise InvalidRequest(f"bad file name {name!r}: use 1-128 of [A-Za-z0-9._-]")
    return name


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A validated ``job`` request body (PROTOCOL.md §5.3)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    files: tuple[str, ...]
    outputs: tuple[str, ...]
    time_limit: float = 60.0
    output_cap: int = 1 << 20
    idempotent: bool = False
    staged: tuple[int, ...] | None = None  # the sizes of staged inputs (PROTOCOL.md §11); None: inline


MAX_TIME_LIMIT = 7 * 24 * 3600.0
MAX_OUTPUT_CAP = 256 << 20


def parse_job(header: dict[str, Any], nframes: int) -> JobSpec:
    argv = req(header, "argv", list)
    if not argv or len(argv) > 4096 or not all(type(a) is str and "\0" not in a for a in argv):
        raise InvalidRequest("field 'argv' must be a non-empty list of strings")
    env_raw = opt(header, "env", dict, {})
    env: dict[str, str] = {}
    for k, v in env_raw.items():
        if type(k) is not str or not _ENV_RE.match(k) or type(v) is not str or "\0" in v:
            raise InvalidRequest(f"bad environment entry {k!r}")
        env[k] = v
    files = tuple(check_file_name(f) for f in opt(header, "files", list, []))
    if len(set(files)) != len(files):
        raise InvalidRequest("field 'files' names a file twice")
    staged = header.get("staged")
    if staged is not None:
        staged = check_sizes(staged, "staged")
        if len(staged) != len(files) or nframes:
            raise InvalidRequest(f"'staged' must give the size of each of the {len(files)} files, and no payload may come")
    elif len(files) != nframes:
        raise InvalidRequest(f"'files' names {len(files)} files but {nframes} payload frames came")
    outputs = tuple(check_file_name(f) for f in opt(header, "outputs", list, []))
    limit = float(opt(header, "time_limit", (int, float), 60.0))
    if not 0 < limit <= MAX_TIME_LIMIT:
        raise InvalidRequest(f"field 'time_limit' must be in (0, {MAX_TIME_LIMIT:.0f}] seconds")
    cap = _int_in(opt(header, "output_cap", int, 1 << 20), "output_cap", 0, MAX_OUTPUT_CAP)
    return JobSpec(
        argv=tuple(argv),
        env=env,
        files=files,
        outputs=outputs,
        time_limit=limit,
        output_cap=cap,
        idempotent=opt(header, "idempotent", bool, False),
        staged=staged,
    )


MAX_STAGED_FILES = MAX_PAYLOAD_FRAMES
MAX_STAGED_FILE_BYTES = 1 << 50


def check_sizes(raw: Any, key: str) -> tuple[int, ...]:
    """A list of staged file sizes (PROTOCOL.md §11) checked; InvalidRequest otherwise."""
    if (type(raw) is not list or len(raw) > MAX_STAGED_FILES
            or not all(type(n) is int and 0 <= n <= MAX_STAGED_FILE_BYTES for n in raw)):
        raise InvalidRequest(f"field {key!r} must be a list of at most {MAX_STAGED_FILES} sizes (ints >= 0)")
    return tuple(raw)


@dataclass(frozen=True, slots=True)
class Put:
    """A checked PUT (PROTOCOL.md §11.1): an opening one (``sizes``) or a chunk (``file``, ``offset``)."""

    id: bytes
    job: bytes
    sizes: tuple[int, ...] | None
    file: int
    offset: int


def parse_put(header: dict[str, Any], nframes: int) -> Put:
    """The PUT ``header`` (with ``nframes`` payload frames) checked; its ``id`` is valid already."""
    rid = get_id(header)
    try:
        job = get_id(header, "job")
    except ProtocolError as exc:
        raise InvalidRequest(exc.message) from None
    if "sizes" in header:
        if nframes:
            raise InvalidRequest("an opening PUT carries no payload")
        return Put(rid, job, check_sizes(header["sizes"], "sizes"), -1, 0)
    if nframes != 1:
        raise InvalidRequest(f"a chunk PUT carries exactly one payload frame, not {nframes}")
    index = _int_in(req(header, "file", int), "file", 0, MAX_STAGED_FILES - 1)
    offset = _int_in(req(header, "offset", int), "offset", 0, MAX_STAGED_FILE_BYTES)
    return Put(rid, job, None, index, offset)


def job_to_wire(spec: JobSpec) -> dict[str, Any]:
    staged = {"staged": list(spec.staged)} if spec.staged is not None else {}
    return {
        **staged,
        "argv": list(spec.argv),
        "env": dict(spec.env),
        "files": list(spec.files),
        "outputs": list(spec.outputs),
        "time_limit": spec.time_limit,
        "output_cap": spec.output_cap,
        "idempotent": spec.idempotent,
    }


# --------------------------------------------------------------------------- typed requests
# What a handler needs of a client's REQUEST or CALL and of a worker's READY, checked in one pass:
# handlers get these objects, never raw header fields.

MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
MAX_SLOTS = 100_000


class NeedCache:
    """``parse_need``, memoized: clients send the same few need maps over and over."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._needs: dict[Any, Need] = {}

    def parse(self, kind: str, raw: Any) -> Need:
        try:
            # Types are part of the key: True == 1 and 1.0 == 1, but parse_need refuses them.
            key = (kind, tuple([(k, v.__class__, v) for k, v in raw.items()])) if type(raw) is dict else (kind, raw)
            need = self._needs.get(key)
        except TypeError:  # unhashable values (lists): parse every time
            return parse_need(kind, raw)
        if need is None:
            need = parse_need(kind, raw)
            if len(self._needs) >= self.size:
                self._needs.clear()
            self._needs[key] = need
        return need


@dataclass(slots=True)
class Request:
    """A checked REQUEST (PROTOCOL.md §4.1), past its id."""

    kind: str
    need: Need  # as declared: the broker may put the authenticated tenant in
    body: dict[str, Any]  # what DISPATCH forwards besides the grant (a job's spec)
    retryable: bool  # may run again after a worker loss (echo, session; a job only if idempotent)
    deadline_ms: int
    replaces: bytes | None  # a session: the id of the lost session it replaces


def parse_request(header: dict[str, Any], nframes: int, needs: NeedCache, default_deadline_ms: int) -> Request:
    """The REQUEST ``header`` (with ``nframes`` payload frames) checked; InvalidRequest on any bad
    field. Its id is the caller's to read first (``get_id``): a retry is judged by the id alone."""
    kind = header.get("kind")
    if kind not in KINDS:
        raise InvalidRequest(f"unknown request kind {kind!r}; known: {', '.join(KINDS)}")
    need = needs.parse(kind, header.get("need"))
    body: dict[str, Any]
    retryable = True
    if kind == "job":
        spec = parse_job(header, nframes)
        body = job_to_wire(spec)
        retryable = spec.idempotent
    else:
        body = {}
    deadline_ms = header.get("deadline_ms")
    if deadline_ms is None:
        deadline_ms = default_deadline_ms
    elif type(deadline_ms) is not int:
        deadline_ms = opt(header, "deadline_ms", int, default_deadline_ms)  # refused with the reason
    if not 0 <= deadline_ms <= MAX_DEADLINE_MS:
        raise InvalidRequest(f"field 'deadline_ms' must be in 0..{MAX_DEADLINE_MS}")
    replaces = header.get("replaces") if kind == "session" else None
    return Request(kind, need, body, retryable, deadline_ms, replaces if type(replaces) is bytes else None)


@dataclass(slots=True)
class Call:
    """A checked CALL on a session (PROTOCOL.md §5.4), past its id."""

    session: bytes
    op: str
    args: dict[str, Any]


def parse_call(header: dict[str, Any]) -> Call:
    """The CALL ``header`` checked; InvalidRequest on any bad field."""
    try:
        sid = get_id(header, "session")
    except ProtocolError as exc:
        raise InvalidRequest(exc.message) from None
    op = header.get("op")
    if op not in SESSION_OPS:
        raise InvalidRequest(f"unknown session op {op!r}; known: {', '.join(SESSION_OPS)}")
    return Call(sid, op, opt(header, "args", dict, {}))


@dataclass(frozen=True, slots=True)
class Ready:
    """A checked READY (PROTOCOL.md §4.2): what a worker announces."""

    name: str
    gpus: list[GpuInfo]
    cpu_milli: int
    host_mem: int
    slots: int
    heartbeat_ms: int  # 0: the broker's
    liveness: int  # 0: the broker's
    hostname: str
    instance_id: str
    replica_of: str
    simulated: bool
    isolation: tuple[str, str, int, frozenset[str]]  # parse_isolation: level, job network, pool users, kinds
    incarnation: bytes = b""  # its process's (16 random bytes made at its start; b"": not said)
    holds: frozenset[bytes] = frozenset()  # the ids it runs or keeps a RESULT of (§4.2)


MAX_HOLDS = 10_000  # ids a READY's ``holds`` may name


def parse_holds(value: Any) -> frozenset[bytes]:
    """A READY's ``holds``: at most MAX_HOLDS ids (InvalidRequest otherwise)."""
    if value is None:
        return frozenset()
    if type(value) is not list or len(value) > MAX_HOLDS or not all(type(i) is bytes and len(i) == ID_BYTES for i in value):
        raise InvalidRequest(f"field 'holds' must be a list of at most {MAX_HOLDS} ids")
    return frozenset(value)


def parse_ready(header: dict[str, Any]) -> Ready:
    """The READY ``header`` checked. A READY with any bad field is malformed (PROTOCOL.md §2):
    ProtocolError, whatever the check."""
    try:
        name = header.get("name")
        if type(name) is not str or not 0 < len(name) <= 128:
            raise ProtocolError("READY needs 'name' (1-128 characters)")
        raw_gpus = header.get("gpus")
        if type(raw_gpus) is not list or len(raw_gpus) > 64:
            raise ProtocolError("READY needs 'gpus', a list of at most 64 GPUs")
        gpus = [parse_gpu_info(g) for g in raw_gpus]
        if len({g.uuid for g in gpus}) != len(gpus):
            raise ProtocolError("READY names a GPU uuid twice")
        ready = Ready(
            name=name,
            gpus=gpus,
            cpu_milli=opt(header, "cpu_milli", int, 0),
            host_mem=opt(header, "host_mem", int, 0),
            slots=opt(header, "slots", int, 64),
            heartbeat_ms=opt(header, "heartbeat_ms", int, 0),
            liveness=opt(header, "liveness", int, 0),
            hostname=opt(header, "hostname", str, "")[:255],
            instance_id=opt(header, "instance_id", str, "")[:64],
            replica_of=opt(header, "replica_of", str, "")[:128],
            simulated=bool(header.get("simulated", False)),
            isolation=parse_isolation(header),
            incarnation=opt(header, "incarnation", bytes, b""),
            holds=parse_holds(header.get("holds")),
        )
    except InvalidRequest as exc:
        raise ProtocolError(exc.message) from None
    if ready.incarnation and len(ready.incarnation) != ID_BYTES:
        raise ProtocolError(f"READY 'incarnation' must be {ID_BYTES} bytes")
    if not (0 <= ready.cpu_milli and 0 <= ready.host_mem and 1 <= ready.slots <= MAX_SLOTS
            and 0 <= ready.heartbeat_ms <= 600_000 and 0 <= ready.liveness <= 100):
        raise ProtocolError("READY has a value out of range")
    return ready


def parse_dims(value: Any, key: str) -> tuple[int, int, int]:
    if type(value) is not list or not 1 <= len(value) <= 3:
        raise InvalidRequest(f"field {key!r} must be a list of 1 to 3 positive ints")
    dims = []
    for v in value:
        if type(v) is not int or not 1 <= v <= (1 << 31) - 1:
            raise InvalidRequest(f"field {key!r} must be a list of 1 to 3 positive ints")
        dims.append(v)
    while len(dims) < 3:
        dims.append(1)
    return (dims[0], dims[1], dims[2])


_INT_RANGES = {
    "i32": (-(1 << 31), (1 << 31) - 1),
    "u32": (0, (1 << 32) - 1),
    "i64": (-(1 << 63), (1 << 63) - 1),
    "u64": (0, (1 << 64) - 1),
    "ptr": (0, (1 << 63) - 1),
}


def parse_launch_args(value: Any) -> list[tuple[str, int | float]]:
    """Validate launch ``args``: a list of ``[type, value]`` pairs (PROTOCOL.md §5.4)."""
    if type(value) is not list or len(value) > 256:
        raise InvalidRequest("field 'args' must be a list of at most 256 [type, value] pairs")
    out: list[tuple[str, int | float]] = []
    for i, item in enumerate(value):
        if type(item) is not list or len(item) != 2 or item[0] not in ARG_TYPES:
            raise InvalidRequest(f"argument {i} must be [type, value] with type in {ARG_TYPES}")
        tag, v = item
        if tag in ("f32", "f64"):
            if type(v) not in (int, float):
                raise InvalidRequest(f"argument {i} ({tag}) must be a number")
            out.append((tag, float(v)))
        else:
            lo, hi = _INT_RANGES[tag]
            if type(v) is not int or not lo <= v <= hi:
                raise InvalidRequest(f"argument {i} ({tag}) must be an int in {lo}..{hi}")
            out.append((tag, v))
    return out


ISOLATION_LEVELS = ("namespaces", "rlimits only")
JOB_NETWORKS = ("none", "host")
POOL_KINDS = ("job", "session")


def parse_isolation(h: dict[str, Any]) -> tuple[str, str, int, frozenset[str]]:
    """READY's ``isolation``, ``job_network``, ``pool_users`` and ``pool_kinds`` (§4.2): unknown
    values of the first two read as "" (not said); InvalidRequest for a wrong type."""
    isolation = opt(h, "isolation", str, "")
    network = opt(h, "job_network", str, "")
    users = opt(h, "pool_users", int, 0)
    kinds = opt(h, "pool_kinds", list, [])
    if users < 0 or users > 1_000_000 or len(kinds) > len(POOL_KINDS) or any(k not in POOL_KINDS for k in kinds):
        raise InvalidRequest("READY: pool_users must be 0 to 1000000 and pool_kinds a list of 'job', 'session'")
    return (isolation if isolation in ISOLATION_LEVELS else "", network if network in JOB_NETWORKS else "",
            users, frozenset(kinds))


def parse_gpu_info(raw: Any) -> GpuInfo:
    if type(raw) is not dict:
        raise ProtocolError("each GPU in READY must be a map")
    cc = raw.get("cc", [0, 0])
    if type(cc) is not list or len(cc) != 2 or not all(type(v) is int for v in cc):
        raise ProtocolError("GPU field 'cc' must be [major, minor]")
    try:
        return GpuInfo(
            uuid=_str_field(raw, "uuid", 128),
            index=_int_field(raw, "index", 0, 1024),
            model=_str_field(raw, "model", 64),
            mem=_int_field(raw, "mem", 0, MAX_MEM),
            cc=(cc[0], cc[1]),
            simulated=bool(raw.get("simulated", False)),
        )
    except InvalidRequest as exc:
        raise ProtocolError(str(exc)) from None


def gpu_info_to_wire(g: GpuInfo) -> dict[str, Any]:
    return {
        "uuid": g.uuid,
        "index": g.index,
        "model": g.model,
        "mem": g.mem,
        "cc": list(g.cc),
        "simulated": g.simulated,
    }


HEALTH_STATES = ("ok", "degraded", "failed")
MAX_HEALTH_REASON = 200  # characters of a GPU state's health_reason kept
MAX_PROBATION_S = 7 * 86400.0  # a GPU state's probation_left_s is clamped to this


def parse_gpu_state(raw: Any) -> tuple[str, GpuState]:
    """One entry of a HEARTBEAT's ``gpus`` list -> (uuid, state). Values are clamped, not trusted."""
    if type(raw) is not dict:
        raise ProtocolError("each GPU state in HEARTBEAT must be a map")
    uuid_ = raw.get("uuid")
    if type(uuid_) is not str:
        raise ProtocolError("GPU state needs 'uuid'")
    health = raw.get("health", "ok")
    if health not in HEALTH_STATES:
        health = "failed"
    reason = raw.get("health_reason", "")
    if type(reason) is not str:
        reason = ""
    return uuid_, GpuState(
        util=_num(raw.get("util"), 0.0, 100.0),
        mem_used=int(_num(raw.get("mem_used"), 0, MAX_MEM)),
        temp=_num(raw.get("temp"), -50.0, 200.0, 0.0),
        power=_num(raw.get("power"), 0.0, 10000.0),
        health=health,
        health_reason=reason[:MAX_HEALTH_REASON],
        probation_left_s=_num(raw.get("probation_left_s"), 0.0, MAX_PROBATION_S),
    )


def gpu_state_to_wire(uuid_: str, s: GpuState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "uuid": uuid_,
        "util": s.util,
        "mem_used": s.mem_used,
        "temp": s.temp,
        "power": s.power,
        "health": s.health,
    }
    if s.health_reason:
        out["health_reason"] = s.health_reason
    if s.probation_left_s > 0:
        out["probation_left_s"] = s.probation_left_s
    return out


def _num(v: Any, lo: float, hi: float, default: float | None = None) -> float:
    """A measured number clamped to [lo, hi]; missing, non-numeric or NaN gives ``default`` (lo)."""
    if type(v) not in (int, float) or v != v:
        return lo if default is None else default
    return float(min(max(v, lo), hi))


def _str_field(raw: dict[str, Any], key: str, maxlen: int) -> str:
    v = raw.get(key)
    if type(v) is not str or not 0 < len(v) <= maxlen:
        raise InvalidRequest(f"field {key!r} must be a string of 1-{maxlen} characters")
    return v


def _int_field(raw: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = raw.get(key)
    if type(v) is not int or isinstance(v, bool):
        raise InvalidRequest(f"field {key!r} must be an int")
    return _int_in(v, key, lo, hi)


def peek_id(frames: Sequence[Any]) -> bytes | None:
    """The request id in the header of message ``frames`` (``[signature, command, header, ...]``)
    that was refused or could not be decoded, when the header is readable enough to have one."""
    if len(frames) < 3:
        return None
    try:
        raw = as_bytes(frames[2])
        if len(raw) > MAX_HEADER_BYTES:
            return None
        header = unpackb(raw)
    except Exception:  # garbage msgpack raises many types
        return None
    rid = header.get("id") if type(header) is dict else None
    return rid if type(rid) is bytes and len(rid) == ID_BYTES else None


def error_header(rid: bytes | None, exc: GpudError) -> dict[str, Any]:
    """REPLY/RESULT header for a failure."""
    return {"id": rid, "ok": False, "code": exc.code, "message": exc.message}
