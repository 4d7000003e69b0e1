"""The worker's data socket: session CALLs straight from clients (docs/PROTOCOL.md §10).

This module owns the socket the worker binds for clients (``[worker] data_bind``) and who may use
it: each direct session's capability (16 random bytes) and, under CURVE, the client key the broker
named for it; the ZAP handler of the socket's own context (domain ``gpud-data``), which admits at
the handshake only keys some open direct session was granted for; and the checks of every message
(signature, command, capability, key) before a CALL reaches the session's code. What comes in is
handed to the worker as ``(routing id, header, frames)``; replies go out as the client dialog's
REPLY. Nothing here touches the broker links or the sessions themselves.

The socket is served by a thread of its own, which blocks in a zmq poll whenever it has nothing to
do, so that a direct CALL waits for no turn of the worker's loop: it is handed to the session's
thread at once, and the session's thread sends the REPLY back through an inproc PUSH socket of its
own (``send_from_thread``), which wakes this thread to forward it (zmq sockets are never shared
between threads).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.z85

from gpud import protocol as P
from gpud.errors import GpudError, InvalidRequest, SessionLost, UnknownCommand
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, server_socket_options
from gpud.sockets import NOBLOCK, recv_frames, recv_frames_user, send_frames

log = logging.getLogger(__name__)

DATA_DOMAIN = "gpud-data"
CAP_BYTES = 16  # 128 bits (PROTOCOL.md §10.2)
MAX_MESSAGE_BYTES = 1 << 30
BATCH = 256  # messages read from the socket before the worker's loop looks at the rest
REFUSED = "the session is unknown or has ended"  # the same for every refusal (§10.3)
LOG_INTERVAL_S = 10.0  # at most one line per this many seconds about bad messages

_SIG = Peer.CLIENT.value
_REPLY = P.CMD_BYTES[Command.REPLY]
_PONG = [_SIG, P.CMD_BYTES[Command.PONG], P.packb({})]
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_REPLIES = "inproc://gpud-data-replies"
POLL_MS = 100  # how often the serving thread looks at its stop flag

CallHandler = Callable[[bytes, dict[str, Any], list[Any]], None]


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


class DataSocket:
    """The ROUTER clients send their direct CALLs to, with its admission table.

    It has a zmq context of its own: its ZAP handler is that context's, and its I/O thread moves
    the copies' bytes apart from the broker links'."""

    def __init__(self, bind: str, advertise: str = "", curve: CurveKeys | None = None) -> None:
        self.curve = curve
        self.ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.zap: zmq.Socket[bytes] | None = None
        self.sessions: dict[bytes, Admission] = {}
        self.keys: dict[str, int] = {}  # Z85 key -> how many open sessions were granted for it
        self.refused = 0  # CALLs refused (wrong session, capability or key), for tests and logs
        self._log_at = 0.0
        self._held = 0
        self._local = threading.local()  # each session thread's PUSH socket
        self._pushes: dict[int, zmq.Socket[bytes]] = {}  # by thread ident, closed with their thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.pull: zmq.Socket[bytes] = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.bind(_REPLIES)
            if curve is not None:
                self.zap = self.ctx.socket(zmq.REP)
                self.zap.setsockopt(zmq.LINGER, 0)
                self.zap.bind(_ZAP_ENDPOINT)
            sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if curve is not None:
                server_socket_options(sock, curve.secret, curve.public, DATA_DOMAIN)
            sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise GpudError(f"cannot bind the data socket {bind!r}: {exc}") from None
        self.sock = sock
        actual = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = advertise or advertised(bind, actual)
        log.info("data socket bound at %s, advertised as %s (%s)", actual, self.endpoint,
                 "CURVE" if curve is not None else "capabilities only, no CURVE")

    def start(self, on_call: CallHandler) -> None:
        """Serve the socket in a thread of its own until ``close``."""
        self._thread = threading.Thread(target=self._serve, args=(on_call,), name="data-socket", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every socket (the session threads' included)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            pushes = list(self._pushes.values())
            self._pushes.clear()
        for s in (getattr(self, "sock", None), self.zap, getattr(self, "pull", None), *pushes):
            if s is not None:
                s.close(0)
        self.ctx.term()

    def _serve(self, on_call: CallHandler) -> None:
        poller = zmq.Poller()
        for s in (self.sock, self.pull, self.zap):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        pull, sock = self.pull, self.sock
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if not ready:
                    continue
                if self.zap is not None and self.zap in ready:
                    self.serve_zap()
                if pull in ready:
                    for _ in range(BATCH):
                        try:
                            frames = pull.recv_multipart(NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            sock.send_multipart(frames, NOBLOCK, copy=False)
                        except zmq.ZMQError as exc:
                            self._note(f"a reply on the data socket was not sent: {exc}")
                if sock in ready:
                    self.drain(on_call)
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("the data socket's thread stopped on a bug; direct calls are no longer served")

    def send_from_thread(self, ident: bytes, frames: list[Any]) -> None:
        """Send a REPLY to client ``ident`` from any thread but the serving one (a session's):
        through that thread's own PUSH socket to the serving thread."""
        push: zmq.Socket[bytes] | None = getattr(self._local, "push", None)
        if push is None:
            if self._stop.is_set():
                return
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(_REPLIES)
            self._local.push = push
            with self._lock:
                self._pushes[threading.get_ident()] = push
        try:
            push.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError as exc:  # the worker is stopping: the socket or its context is closed
            log.debug("a direct reply was not sent: %s", exc)

    def thread_done(self) -> None:
        """The calling thread (a session's) ends: close its PUSH socket."""
        push = getattr(self._local, "push", None)
        if push is not None:
            self._local.push = None
            with self._lock:
                self._pushes.pop(threading.get_ident(), None)
            push.close(0)

    # ------------------------------------------------------------------ admission table

    def offer(self, sid: bytes, client_key: str, relay: bool = True) -> dict[str, Any]:
        """Admit direct CALLs on session ``sid`` (with the key ``client_key`` under CURVE); the
        ``data`` map of its opening RESULT (``relay``: whether the broker relays its CALLs too)."""
        cap = os.urandom(CAP_BYTES)
        self.sessions[sid] = Admission(cap, client_key)
        if client_key:
            self.keys[client_key] = self.keys.get(client_key, 0) + 1
        out: dict[str, Any] = {"endpoint": self.endpoint, "cap": cap}
        if self.curve is not None:
            out["key"] = self.curve.public.decode("ascii")
        if not relay:
            out["relay"] = False
        return out

    def revoke(self, sid: bytes) -> None:
        """The session ended: its capability and key admit nothing more. Idempotent."""
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
        """Answer the pending ZAP requests (handshakes): a CURVE key that an open direct session
        was granted for is admitted, as its Z85 text; anything else is refused."""
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
        if domain != DATA_DOMAIN.encode() or mechanism != b"CURVE" or not key or key not in self.keys:
            self._note(f"refused a data connection (key {key[:8] or '-'}): no open session was granted for it")
            return [b"1.0", request_id, b"400", b"key not admitted", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key.encode("ascii"), b""]

    # ------------------------------------------------------------------ the dialog

    def drain(self, on_call: CallHandler) -> int:
        """Handle up to BATCH queued messages; CALLs that pass admission go to ``on_call``.
        Returns how many there were."""
        sock = self.sock
        curve = self.curve is not None
        for n in range(BATCH):
            try:
                if curve:
                    frames, user = recv_frames_user(sock, NOBLOCK, copy_first=4)
                else:
                    frames, user = recv_frames(sock, NOBLOCK, copy_first=4), None
            except zmq.Again:
                return n
            ident = frames[0]
            try:
                self._one(ident, frames, user, on_call)
            except GpudError as exc:
                self._note(f"bad message on the data socket: {exc.code} {exc.message}")
                self.send(ident, P.encode(Peer.CLIENT, Command.ERROR, P.error_header(None, exc)))
            except Exception:
                log.exception("bug while handling a data socket message")
        return BATCH

    def _one(self, ident: bytes, frames: list[Any], user: str | None, on_call: CallHandler) -> None:
        msg = P.decode(frames[1:], Peer.CLIENT, MAX_MESSAGE_BYTES)
        if msg.command is Command.PING:
            self.send(ident, _PONG)
            return
        if msg.command is not Command.CALL:
            raise UnknownCommand(f"{msg.command.name} is not valid on a worker's data socket")
        h = msg.header
        rid = P.get_id(h)
        if not self.admits(h.get("session"), h.get("cap"), user):
            self.refused += 1
            self._note(f"refused a direct CALL {P.id_text(rid)}: unknown session, wrong capability or key")
            self.reply(ident, P.error_header(rid, SessionLost(REFUSED)))
            return
        if h.get("op") == "close":
            self.reply(ident, P.error_header(rid, InvalidRequest("close a session through the broker (PROTOCOL.md §10.3)")))
            return
        on_call(ident, h, msg.frames)

    def reply(self, ident: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        self.send(ident, [_SIG, _REPLY, P.packb(header), *frames])

    def send(self, ident: bytes, frames: list[Any]) -> None:
        """Send to the client ``ident`` (from the serving thread); one that is gone (or whose
        queue is full) loses it."""
        try:
            send_frames(self.sock, [ident, *frames], NOBLOCK)
        except zmq.ZMQError as exc:
            self._note(f"a reply on the data socket was not sent: {exc}")

    def _note(self, what: str) -> None:
        """Log ``what`` at most once per LOG_INTERVAL_S, with how many were held back."""
        now = time.monotonic()
        if now < self._log_at:
            self._held += 1
            return
        held, self._held = self._held, 0
        self._log_at = now + LOG_INTERVAL_S
        log.warning("%s%s", what, f" ({held} more since the last report)" if held else "")

