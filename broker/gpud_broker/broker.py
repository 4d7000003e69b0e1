"""The broker daemon's socket shell: one thread, one zmq.Poller over the frontend (clients), the
backend (workers) and the admin socket. It only moves frames: decode, hand to ``BrokerCore``, send
what the core answers. Each ready socket is drained in a batch before polling again.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from gpud import protocol as P
from gpud.errors import GpudError, InternalError, UnknownCommand
from gpud.protocol import Command, Peer
from gpud.sockets import NOBLOCK, recv_frames, send_frames
from gpud_broker.commands import ADMIN
from gpud_broker.core import BrokerConfig, BrokerCore

log = logging.getLogger(__name__)

BATCH = 256  # messages drained from one socket before looking at the others
TICK_S = 0.05  # how often timers run (heartbeats, expiries)


@dataclass(frozen=True, slots=True)
class Endpoints:
    frontend: str
    backend: str
    admin: str | None = None


def bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the real endpoint (``tcp://127.0.0.1:*`` gets its port). IPC files are 0600."""
    sock.bind(endpoint)
    real = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if real.startswith("ipc://"):
        os.chmod(real[len("ipc://"):], 0o600)
    return real


class Broker:
    def __init__(self, config: BrokerConfig, endpoints: Endpoints, ctx: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.frontend = self._router()
        self.backend = self._router()
        self.admin: zmq.Socket[bytes] | None = None
        front, back = self.frontend, self.backend
        self.core = BrokerCore(
            config,
            time.monotonic(),
            send_client=lambda ident, frames: send_frames(front, [ident, *frames]),
            send_worker=lambda ident, frames: send_frames(back, [ident, *frames]),
        )
        self.endpoints = Endpoints(
            frontend=bind(self.frontend, endpoints.frontend),
            backend=bind(self.backend, endpoints.backend),
            admin=None,
        )
        if endpoints.admin:
            self.admin = self._router()
            self.endpoints = Endpoints(self.endpoints.frontend, self.endpoints.backend, bind(self.admin, endpoints.admin))
        self._stop = threading.Event()

    def _router(self) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        return s

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        for s in (self.frontend, self.backend, self.admin):
            if s is not None:
                s.close(0)

    def run(self) -> None:
        """Serve until ``stop()`` (or SIGTERM/SIGINT when installed by ``main``)."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        if self.admin is not None:
            poller.register(self.admin, zmq.POLLIN)
        core = self.core
        front, back, admin = self.frontend, self.backend, self.admin
        monotonic = time.monotonic
        next_tick = 0.0
        timeout_ms = int(TICK_S * 1000)
        busy = False
        while not self._stop.is_set():
            # Poll only after a round that found nothing: while messages keep coming, reading
            # until empty is cheaper than a poll per round (each is about a system call).
            if not busy:
                poller.poll(timeout_ms)
            now = monotonic()
            core.now = now
            busy = bool(self._drain(back, self._on_worker) + self._drain(front, self._on_client))
            if now >= next_tick:
                if admin is not None:
                    self._drain(admin, self._on_admin)
                core.tick(now)
                next_tick = now + TICK_S
        core.shutdown()

    def _drain(self, sock: zmq.Socket[bytes], handle: Any) -> int:
        """Handle up to BATCH queued messages of ``sock``; returns how many there were."""
        for n in range(BATCH):
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=4)
            except zmq.Again:
                return n
            handle(frames)
        return BATCH

    def _on_client(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            msg = P.decode(frames[1:], Peer.CLIENT, self.config.max_message_bytes)
            self.core.on_client(ident, msg)
        except GpudError as exc:
            self._bad(self.frontend, Peer.CLIENT, ident, frames, exc)
        except Exception:
            log.exception("bug while handling a client message")
            self._bad(self.frontend, Peer.CLIENT, ident, frames, InternalError("internal error in the broker"))

    def _on_worker(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            msg = P.decode(frames[1:], Peer.WORKER, self.config.max_message_bytes)
            self.core.on_worker(ident, msg, frames[3])
        except GpudError as exc:
            self._bad(self.backend, Peer.WORKER, ident, frames, exc)
        except Exception:
            log.exception("bug while handling a worker message")
            self._bad(self.backend, Peer.WORKER, ident, frames, InternalError("internal error in the broker"))

    def _on_admin(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            msg = P.decode(frames[1:], Peer.ADMIN, self.config.max_message_bytes)
            if msg.command is not Command.ADMIN:
                raise UnknownCommand(f"command {msg.command.name} is not valid on the admin socket")
            rid = P.get_id(msg.header)
        except GpudError as exc:
            assert self.admin is not None
            self._bad(self.admin, Peer.ADMIN, ident, frames, exc)
            return
        try:
            result = ADMIN.dispatch(self.core, msg.header.get("cmd"), msg.header.get("args"))
            header = {"id": rid, "ok": True, "result": result}
        except GpudError as exc:
            log.info("admin request refused: %s %s", exc.code, exc.message)
            header = P.error_header(rid, exc)
        except Exception:
            log.exception("bug in an admin command")
            header = P.error_header(rid, InternalError("internal error in the broker"))
        assert self.admin is not None
        self.admin.send_multipart([ident, Peer.ADMIN.value, P.CMD_BYTES[Command.REPLY], P.packb(header)])

    def _bad(self, sock: zmq.Socket[bytes], peer: Peer, ident: bytes, frames: list[bytes], exc: GpudError) -> None:
        """Log a message we could not use and answer it where the sender can be addressed."""
        self.core.counters["bad_messages"] += 1
        log.warning("bad message from %s %s: %s %s", peer.name.lower(), ident.hex()[:16], exc.code, exc.message)
        header: dict[str, Any] = {"code": exc.code, "message": exc.message}
        rid = _peek_id(frames)
        if rid is not None:
            header["id"] = rid
        sock.send_multipart([ident, peer.value, P.CMD_BYTES[Command.ERROR], P.packb(header)])


def _peek_id(frames: list[bytes]) -> bytes | None:
    """The request id of a rejected message, when its header is readable enough to have one."""
    if len(frames) < 4 or len(frames[3]) > P.MAX_HEADER_BYTES:
        return None
    try:
        h = P.unpackb(frames[3])
        rid = h.get("id") if type(h) is dict else None
    except Exception:
        return None
    return rid if type(rid) is bytes and len(rid) == P.ID_BYTES else None


def serve(config: BrokerConfig, endpoints: Endpoints, ready_file: str | None = None) -> int:
    """Run a broker in this process until SIGTERM/SIGINT."""
    broker = Broker(config, endpoints)
    # The hot path allocates a few small objects per message and makes no reference cycles of
    # note: collect the young generation 100x less often (measured: ~5 us per request otherwise).
    gc.freeze()
    gc.set_threshold(70_000, 20, 20)
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    ep = broker.endpoints
    log.info("broker %s ready: frontend %s, backend %s, admin %s, policy %s",
             config.name, ep.frontend, ep.backend, ep.admin or "-", config.policy)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"frontend": ep.frontend, "backend": ep.backend, "admin": ep.admin, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    try:
        broker.run()
    finally:
        broker.close()
        log.info("broker %s stopped", config.name)
    return 0
