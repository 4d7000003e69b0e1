"""The worker's data sockets: session CALLs straight from clients (docs/PROTOCOL.md §10).

This module owns the sockets the worker binds for clients and who may use them:

- ``DataSocket``, the worker's data socket (``[worker] data_bind``): the endpoint clients PING to
  know the worker alive while a call of theirs runs, served by a thread of its own that also
  answers the handshakes (the ZAP handler of the sockets' context: on the data socket, domain
  ``gpud-data``, only keys some open direct session was granted for; on a session's socket, only
  that session's key). It holds the admission table: each
  direct session's capability (16 random bytes) and, under CURVE, the client key the broker named
  for it.
- ``SessionSocket``, one direct session's own socket, bound on the data socket's host (a port of
  ``data_ports``) and used by that session's thread alone: a CALL is received, run and answered
  in that one thread, with no hand-over to another (each costs a thread wake-up, the dearest
  thing on a call's path). A long kernel then delays no one else: other sessions have their own
  sockets and threads, PINGs go to the data socket.

Every message is checked (signature, command, session, capability, key) before a CALL reaches
the session's code; what is refused is answered the same way whatever the reason, and logged at
most once per LOG_INTERVAL_S. Nothing here touches the broker links or the sessions' devices.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.z85

from gpud import protocol
from gpud.errors import GpudError, InvalidRequest, SessionLost, UnknownCommand
from gpud.protocol import Command, Peer
from gpud.ratelog import RateLimit
from gpud.security import CurveKeys, server_socket_options
from gpud.sockets import NOBLOCK, SNDMORE, ZERO_COPY_BYTES, recv_from, send_frames

log = logging.getLogger(__name__)

DATA_DOMAIN = "gpud-data"
CAP_BYTES = 16  # 128 bits (PROTOCOL.md §10.2)
MAX_MESSAGE_BYTES = 1 << 30
BATCH = 256  # messages read from one socket before the others are looked at
REFUSED = "the session is unknown or has ended"  # the same for every refusal (§10.3)
LOG_INTERVAL_S = 10.0  # at most one line per this many seconds about bad messages
POLL_MS = 100  # how often the data socket's thread looks at its stop flag
HWM = 100_000

_PONG = protocol.encode(Peer.CLIENT, Command.PONG, {})
_PONG_ENDED = protocol.encode(Peer.CLIENT, Command.PONG, {"ended": True})
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_DATA_DOMAIN = DATA_DOMAIN.encode()
_SESSION_DOMAIN = f"{DATA_DOMAIN}/".encode()
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


@dataclass(frozen=True, slots=True)
class Admission:
    """What a direct session's CALLs must come with: its capability and, under CURVE, the Z85
    client key the broker named for it."""

    cap: bytes
    key: str


def advertised(bind: str, actual: str) -> str:
    """Where clients connect: ``actual`` (the bound endpoint, a port 0 resolved) with a wildcard
    host replaced by this host's name."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if actual.startswith(wildcard) or bind.startswith(wildcard):
            port = actual.rsplit(":", 1)[1]
            return f"tcp://{socket.gethostname()}:{port}"
    return actual


def session_domain(sid: bytes) -> str:
    """The ZAP domain of session ``sid``'s own socket: only the key it was granted for passes."""
    return f"{DATA_DOMAIN}/{sid.hex()}"


def _session_of(domain: bytes) -> bytes | None:
    """The session a ZAP domain names (``session_domain``), or None."""
    if not domain.startswith(_SESSION_DOMAIN) or len(domain) != len(_SESSION_DOMAIN) + 2 * protocol.ID_BYTES:
        return None
    try:
        return bytes.fromhex(domain[len(_SESSION_DOMAIN):].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def parse_ports(text: str) -> tuple[int, int] | None:
    """``data_ports`` ("LOW-HIGH") as the range pyzmq binds in; None for "" (any free port)."""
    if not text:
        return None
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise GpudError(f"data_ports must be LOW-HIGH (e.g. 5560-5659), got {text!r}") from None
    if not 1 <= lo <= hi <= 65535:
        raise GpudError(f"data_ports must be LOW-HIGH within 1..65535, got {text!r}")
    return lo, hi + 1


class _Notes:
    """Log a line about a bad message at most once per LOG_INTERVAL_S (``gpud.ratelog``), with
    how many were held back; shared by every thread that serves a data socket."""

    def __init__(self) -> None:
        self._limit = RateLimit(LOG_INTERVAL_S, time.monotonic)

    def note(self, what: str) -> None:
        held = self._limit("data")
        if held is not None:
            log.warning("%s%s", what, f" ({held} more since the last report)" if held else "")


class DataSocket:
    """The worker's data socket, with the admission table of its direct sessions.

    It has a zmq context of its own: its ZAP handler is that context's, and its I/O thread moves
    the copies' bytes apart from the broker links'."""

    def __init__(self, bind: str, advertise: str = "", curve: CurveKeys | None = None, ports: str = "") -> None:
        self.curve = curve
        self.ports = parse_ports(ports)
        self.ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.zap: zmq.Socket[bytes] | None = None
        self.sessions: dict[bytes, Admission] = {}
        self.keys: dict[str, int] = {}  # Z85 key -> how many open sessions were granted for it
        self.refused = 0  # CALLs refused (wrong session, capability or key), for tests and logs
        self.notes = _Notes()
        self.open_sockets = 0  # session sockets not closed yet
        self._lock = threading.Lock()  # the admission table: session threads and the loop change it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            if curve is not None:
                self.zap = self.ctx.socket(zmq.REP)
                self.zap.setsockopt(zmq.LINGER, 0)
                self.zap.bind(_ZAP_ENDPOINT)
            sock = self._socket()
            sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise GpudError(f"cannot bind the data socket {bind!r}: {exc}") from None
        self.sock = sock
        actual = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = advertise or advertised(bind, actual)
        self._bind_host = actual.rsplit(":", 1)[0]  # where session sockets bind
        self._advertise_host = self.endpoint.rsplit(":", 1)[0]  # and how clients reach them
        log.info("data socket bound at %s, advertised as %s (%s)", actual, self.endpoint,
                 "CURVE" if curve is not None else "capabilities only, no CURVE")

    def _socket(self, domain: str = DATA_DOMAIN) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is not None:
            server_socket_options(sock, self.curve.secret, self.curve.public, domain)
        return sock

    def start(self) -> None:
        """Serve the data socket and the handshakes in a thread of their own until ``close``."""
        self._thread = threading.Thread(target=self._serve, name="data-socket", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the data socket; the context too once every session socket is
        closed (a session thread stuck in a kernel at exit keeps its own: the process ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for s in (getattr(self, "sock", None), self.zap):
            if s is not None:
                s.close(0)
        if self.open_sockets == 0:
            self.ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in (self.sock, self.zap):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self.zap is not None and self.zap in ready:
                    self.serve_zap()
                if self.sock in ready:
                    self.drain()
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("the data socket's thread stopped on a bug; direct calls lose their liveness checks")

    # ------------------------------------------------------------------ admission table

    def open_session(self, sid: bytes, client_key: str, relay: bool = True) -> tuple[SessionSocket, dict[str, Any]]:
        """(Session thread) A socket of its own for direct session ``sid``, which admits its
        capability (with the key ``client_key`` under CURVE), and the ``data`` map of its opening
        RESULT (``relay``: whether the broker relays its CALLs too). GpudError when no port of
        ``data_ports`` is free."""
        sock = self._socket(session_domain(sid))
        try:
            if self.ports is None:
                sock.bind(f"{self._bind_host}:*")
                port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            else:
                port = sock.bind_to_random_port(self._bind_host, *self.ports, max_tries=200)
        except (zmq.ZMQError, zmq.ZMQBindError) as exc:
            sock.close(0)
            raise GpudError(f"no port free for a session socket on {self._bind_host} (data_ports "
                            f"{self.ports or 'any'}): {exc}") from None
        cap = os.urandom(CAP_BYTES)
        with self._lock:
            self.sessions[sid] = Admission(cap, client_key)
            if client_key:
                self.keys[client_key] = self.keys.get(client_key, 0) + 1
            self.open_sockets += 1
        endpoint = f"{self._advertise_host}:{port}"
        out: dict[str, Any] = {"endpoint": endpoint, "ping": self.endpoint, "cap": cap}
        if self.curve is not None:
            out["key"] = self.curve.public.decode("ascii")
        if not relay:
            out["relay"] = False
        return SessionSocket(self, sock, sid, endpoint), out

    def revoke(self, sid: bytes) -> None:
        """The session ended: its capability and key admit nothing more. Idempotent; any thread."""
        with self._lock:
            adm = self.sessions.pop(sid, None)
            if adm is not None and adm.key:
                left = self.keys.get(adm.key, 0) - 1
                if left > 0:
                    self.keys[adm.key] = left
                else:
                    self.keys.pop(adm.key, None)

    def admits(self, sid: Any, cap: Any, user: str | None) -> bool:
        """Whether a CALL naming session ``sid`` with capability ``cap``, on a connection
        authenticated as ``user`` (the ZAP User-Id: a Z85 key; None without CURVE), may run."""
        adm = self.sessions.get(sid) if type(sid) is bytes else None
        if adm is None or type(cap) is not bytes:
            return False
        if not hmac.compare_digest(adm.cap, cap):
            return False
        if self.curve is not None:
            return user is not None and hmac.compare_digest(adm.key.encode(), user.encode())
        return True

    def serve_zap(self) -> None:
        """Answer the pending ZAP requests (handshakes on every data socket), admitting a CURVE
        key, as its Z85 text, on the data socket when some open direct session was granted for it,
        on a session's socket (domain ``session_domain``) when that session was; refusing anything
        else."""
        zap = self.zap
        if zap is None:
            return
        for _ in range(BATCH):
            try:
                frames = zap.recv_multipart(NOBLOCK)
            except zmq.Again:
                return
            zap.send_multipart(self._zap_reply(frames))

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed request", b"", b""]
        request_id, domain, mechanism = frames[1], frames[2], frames[5]
        creds = frames[6:]
        key = zmq.utils.z85.encode(creds[0]).decode("ascii") if len(creds) == 1 and len(creds[0]) == 32 else ""
        if domain == _DATA_DOMAIN:
            admitted = key in self.keys
        else:
            sid = _session_of(domain)
            adm = self.sessions.get(sid) if sid is not None else None
            admitted = adm is not None and hmac.compare_digest(adm.key.encode(), key.encode())
        if mechanism != b"CURVE" or not key or not admitted:
            self.notes.note(f"refused a data connection (key {key[:8] or '-'}): no open session was granted for it")
            return [b"1.0", request_id, b"400", b"key not admitted", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key.encode("ascii"), b""]

    # ------------------------------------------------------------------ the data socket's dialog

    def drain(self) -> int:
        """Answer up to BATCH queued messages on the data socket: PING with PONG (``ended`` when
        it names a session, with its capability, that is not open: the client's calls on it will
        never be answered), a CALL with INVALID_REQUEST (it goes to its session's endpoint),
        anything else with ERROR."""
        sock, notes = self.sock, self.notes
        n = 0
        for ident, msg, user in received(sock, self.curve is not None, notes, "the data socket"):
            n += 1
            try:
                if msg.command is Command.PING:
                    header = msg.header
                    named = "session" in header and not self.admits(header.get("session"), header.get("cap"), user)
                    send(sock, ident, _PONG_ENDED if named else _PONG, notes)
                elif msg.command is Command.CALL:
                    rid = protocol.get_id(msg.header)
                    send(sock, ident, reply_frames(protocol.error_header(rid, InvalidRequest(
                        "send a session's CALLs to its own endpoint (the 'endpoint' of its offer, PROTOCOL.md §10.2)"))),
                        notes)
                else:
                    raise UnknownCommand(f"{msg.command.name} is not valid on a worker's data socket")
            except GpudError as exc:
                refuse(sock, ident, exc, notes, "the data socket")
            if n == BATCH:
                break
        return n


class SessionSocket:
    """One direct session's own ROUTER: its CALLs come here and are answered from here, by the
    session's thread alone (zmq sockets are never shared between threads)."""

    def __init__(self, data: DataSocket, sock: zmq.Socket[bytes], sid: bytes, endpoint: str) -> None:
        self.data = data
        self.sock = sock
        self.sid = sid
        self.endpoint = endpoint
        self._curve = data.curve is not None
        self.closed = False

    def take(self) -> tuple[bytes, dict[str, Any], list[Any]] | None:
        """The next CALL that passes admission, as (client routing id, header, payload frames);
        None when nothing more is queued. What does not pass is answered here: PING with PONG,
        a refused CALL with SESSION_LOST (the same whatever the reason), a malformed message with
        ERROR; a ``close`` with INVALID_REQUEST (it goes through the broker, §10.3)."""
        sock, data = self.sock, self.data
        for ident, msg, user in received(sock, self._curve, data.notes, "a session socket"):
            try:
                if msg.command is Command.PING:
                    send(sock, ident, _PONG, data.notes)
                    continue
                if msg.command is not Command.CALL:
                    raise UnknownCommand(f"{msg.command.name} is not valid on a worker's data socket")
                header = msg.header
                rid = protocol.get_id(header)
                sid = header.get("session")
                if sid != self.sid or not data.admits(sid, header.get("cap"), user):
                    data.refused += 1
                    data.notes.note(f"refused a direct CALL {protocol.id_text(rid)}: unknown session, wrong capability or key")
                    self.reply(ident, protocol.error_header(rid, SessionLost(REFUSED)))
                    continue
                if header.get("op") == "close":
                    self.reply(ident, protocol.error_header(rid, InvalidRequest("close a session through the broker (PROTOCOL.md §10.3)")))
                    continue
                return ident, header, msg.frames
            except GpudError as exc:
                refuse(sock, ident, exc, data.notes, "a session socket")
        return None

    def reply(self, ident: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = (),
              hold: Callable[[memoryview, Any], None] | None = None) -> None:
        """Answer a CALL. ``hold``: the payload may be lent device memory (``dtoh_lent``): a
        large one is sent without a copy and ``hold(view, tracker)`` told when zmq is done."""
        out = reply_frames(header, frames)
        lent = out[-1] if hold is not None and frames else None
        if hold is None or type(lent) is not memoryview or lent.nbytes < ZERO_COPY_BYTES:
            send(self.sock, ident, out, self.data.notes)
            return
        try:
            send_frames(self.sock, [ident, *out[:-1]], NOBLOCK | SNDMORE)
            tracker = self.sock.send(lent, NOBLOCK, copy=False, track=True)
        except zmq.ZMQError as exc:
            self.data.notes.note(f"a reply on a data socket was not sent: {exc}")
            return
        hold(lent, tracker)

    def close(self) -> None:
        """(Its thread) The session ended: it admits nothing more and the socket goes."""
        if not self.closed:
            self.closed = True
            self.data.revoke(self.sid)
            self.sock.close(0)
            with self.data._lock:
                self.data.open_sockets -= 1


def received(sock: zmq.Socket[bytes], curve: bool, notes: _Notes, where: str) -> Iterator[tuple[bytes, protocol.Message, str | None]]:
    """The messages queued on ``sock`` that decode, each with its sender's routing id and ZAP
    User-Id (None without CURVE); one that does not is answered ERROR and logged (at most once
    per LOG_INTERVAL_S), as is a bug while decoding (then the message is dropped)."""
    while int(sock.getsockopt(_EVENTS)) & _POLLIN:
        try:
            frames, user = recv_from(sock, curve, NOBLOCK, copy_first=4)
        except zmq.Again:
            return
        ident = frames[0]
        try:
            msg = protocol.decode(frames[1:], Peer.CLIENT, MAX_MESSAGE_BYTES)
        except GpudError as exc:
            refuse(sock, ident, exc, notes, where)
            continue
        except Exception:
            log.exception("bug while decoding a message on %s", where)
            continue
        yield ident, msg, user


def refuse(sock: zmq.Socket[bytes], ident: bytes, exc: GpudError, notes: _Notes, where: str) -> None:
    """Answer a bad message with ERROR, and log it (rate-limited)."""
    notes.note(f"bad message on {where}: {exc.code} {exc.message}")
    send(sock, ident, protocol.encode(Peer.CLIENT, Command.ERROR, protocol.error_header(None, exc)), notes)


def reply_frames(header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> list[Any]:
    return protocol.encode(Peer.CLIENT, Command.REPLY, header, frames)


def send(sock: zmq.Socket[bytes], ident: bytes, frames: list[Any], notes: _Notes) -> None:
    """Send to the client ``ident``; one that is gone (or whose queue is full) loses it."""
    try:
        send_frames(sock, [ident, *frames], NOBLOCK)
    except zmq.ZMQError as exc:
        notes.note(f"a reply on a data socket was not sent: {exc}")
