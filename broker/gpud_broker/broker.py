"""The broker daemon's socket shell: one thread, one zmq.Poller over the frontend (clients), the
backend (workers) and the admin socket. It only moves frames: decode, hand to ``BrokerCore``, send
what the core answers. Each ready socket is drained in a batch before polling again (the
frontend's batch cut short when one sender fills it). New frontend connections pass the
connection gate (``gate.ConnectionGate``) as libzmq's monitor reports them; a sender's messages
wait behind its echoes in flight past its share or its rate (``intake.EchoShare``). A sender's bad
messages are answered up to an allowance a second, and past a bound its connection is closed
(``_bad``, ``_cut``).
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any, cast

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from gpud import notify, protocol
from gpud.errors import Busy, ConfigError, GpudError, InternalError, ShuttingDown, UnknownCommand
from gpud.protocol import Command, Peer
from gpud.ratelog import OTHERS, RateLimit, WindowCount
from gpud.security import (
    ADMIN_DOMAIN,
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    HANDSHAKE_FAILURES,
    HANDSHAKE_IVL_MS,
    ZAP_ENDPOINT,
    CurveKeys,
    HandshakeLog,
    SecuritySettings,
    ZapHandler,
    check_bind,
    server_socket_options,
)
from gpud.sockets import (
    NOBLOCK,
    SNDMORE,
    recv_frames,
    recv_frames_user_if,
    recv_from,
    send_frames,
)
from gpud_broker import synfilter
from gpud_broker.commands import ADMIN
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.gate import ConnectionGate, default_limits, source_of
from gpud_broker.intake import EchoShare
from gpud_standby.pair import Pair, PairConfig

log = logging.getLogger(__name__)

BATCH = 256  # messages drained from one socket before looking at the others
CATCH_UP = 64  # batches of worker messages read, at most, before workers' silence is judged
STALL_S = 0.25  # a loop turn this long after the last: the broker itself stalled (no worker's silence)
TICK_S = 0.05  # how often timers run (heartbeats, expiries)
DROP_LOG_S = 10.0  # at most one log line per this many seconds for dropped client messages
FD_RESERVE = 64  # descriptors kept free: nearer the limit the frontend stops accepting connections
FD_CHECK_S = 0.5  # how often descriptors in use are counted
BAD_LOG_SOURCES = 20  # sources whose bad messages are logged in full per bad_log_s (the rest: counted as others)
GATE_CHECK_S = 5.0  # at most this often, a refusal by the gate first checks the connections counted against their descriptors
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED  # what the frontend's monitor reports besides failed handshakes
PASS_MESSAGES = 32  # messages of one sender read from the frontend in one pass at most (then the others' turn)
PASS_BYTES = 1 << 20  # payload bytes read from the frontend in one pass at most (then the workers' turn)
PASS_BAD = 8  # bad messages answered in one frontend pass at most (each costs an ERROR: then the others' turn)
BAD_ANSWERED = 1000  # per sender, bad messages answered per BAD_WINDOW_S at most (the rest: counted, PROTOCOL.md §7)
BAD_CUT = 4000  # per sender, from this many bad messages in a BAD_WINDOW_S on, its connections are closed (PROTOCOL.md §7)
BAD_WINDOW_S = 1.0
BAD_HOLD_OFF_S = 10.0  # under CURVE, a closed connection's key is refused this long
SIDE_BATCH = 64  # ZAP requests, and events of each monitor, handled per tick at most (a catch-up while the loop is busy)
SIDE_STEP = 8  # the same, per round of the loop that polled them readable (then the sockets' turn, and a poll again)
WAITING_SHARES = 16  # a sender's messages waiting behind its echoes in flight: this many shares of bytes at most
_NEW_WORK = (protocol.CMD_BYTES[Command.REQUEST], protocol.CMD_BYTES[Command.CALL], protocol.CMD_BYTES[Command.PUT])
# Worker messages read with their key's name: READY, and a FETCH or CHUNK (or a BATCH of them) on a
# data connection, which the broker binds to a worker by that name (PROTOCOL.md §11.3, §11.5).
_WHO_WORKER = frozenset(protocol.CMD_BYTES[c] for c in (Command.READY, Command.BATCH, Command.FETCH, Command.CHUNK))
Decoded = protocol.Message | GpudError | None  # a client message as the handlers get it: decoded, why it could not be, or not yet


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
    openstack: Any = None  # its OpenStack Controller when [openstack] is enabled (serve)

    def __init__(self, config: BrokerConfig, endpoints: Endpoints, ctx: zmq.Context[Any] | None = None,
                 security: SecuritySettings | None = None, pair: PairConfig | None = None) -> None:
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        # Without a SecuritySettings (tests, embedding): no CURVE, and loopback binds only.
        self.security = security or SecuritySettings(mode="none")
        self.zap: zmq.Socket[bytes] | None = None
        self.zap_handler: ZapHandler | None = None
        self.reloader: Callable[[], BrokerConfig] | None = None  # re-reads the configuration
        self._monitors: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes], HandshakeLog]] = []
        self._route_log_at = 0.0
        self._bad_in_pass = 0  # bad messages in the frontend pass under way (PASS_BAD)
        self._fd_check_at = 0.0
        self._gate_check_at = 0.0
        self._bad_log = RateLimit(config.bad_log_s, time.monotonic, max_new=BAD_LOG_SOURCES)
        self._bad_count = WindowCount(BAD_WINDOW_S, time.monotonic)
        self._first: list[Any] = [None]  # the first frame of the client message being handled (its connection)
        self._cut_at: dict[bytes, tuple[int, float]] = {}  # routing id -> (descriptor, when) of its connection closed last
        self.gate = ConnectionGate(config.connection_limits or default_limits(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        share = config.echo_bytes_in_flight or config.max_echo_bytes
        self.intake = EchoShare(share, WAITING_SHARES * share, rate=config.echo_bytes_per_s)
        self._accepting = True  # the frontend is bound (it is unbound while descriptors run short)
        _seed_routing_ids()
        keys: CurveKeys | None = None
        admin_tcp = bool(endpoints.admin) and not str(endpoints.admin).startswith(("ipc://", "inproc://"))
        if self.security.curve:
            keys = self.security.broker_keys()
            store = self.security.keystore()
            store.refresh()
            self.zap_handler = ZapHandler(store, peer_key=zmq.utils.z85.decode(keys.public), gate=self.gate)
            # The ZAP handler must be bound before any CURVE socket binds: without one, libzmq
            # lets every CURVE client in.
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            try:
                self.zap.bind(ZAP_ENDPOINT)
            except zmq.ZMQError as exc:
                self.zap.close(0)
                raise ConfigError(f"cannot bind the ZAP handler ({exc}): another one runs in this zmq context") from None
        else:
            for what, ep in (("frontend", endpoints.frontend), ("backend", endpoints.backend)):
                check_bind(ep, self.security, what)
            if admin_tcp:
                raise ConfigError(f"the admin endpoint {endpoints.admin} is TCP: that needs security 'curve' "
                                  "(or use an ipc:// admin socket, protected by its file permissions)")
        self.frontend = self._router(FRONTEND_DOMAIN, keys, CONNECTION_EVENTS)
        self.backend = self._router(BACKEND_DOMAIN, keys)
        self.admin: zmq.Socket[bytes] | None = None
        front, back = self.frontend, self.backend
        # What the core sends waits here, per peer, until a batch of messages has been read
        # (``_flush``). Then each peer's messages go out together, runs of small ones as one BATCH
        # (PROTOCOL.md §2.1): one send, one wake-up of the socket's I/O thread and of the peer,
        # rather than one per message. Measured: the wait alone, about 1.2x the echo throughput.
        self._to_workers: dict[bytes, list[list[Any]]] = {}
        self._to_clients: dict[bytes, list[list[Any]]] = {}
        self._outboxes = ((back, self._to_workers), (front, self._to_clients))
        to_client = _queue_in(self._to_clients)
        self.core = BrokerCore(config, time.monotonic(), send_client=to_client, send_worker=_queue_in(self._to_workers))
        self.core.worker_names_bound = self.security.curve
        self.endpoints = Endpoints(
            frontend=bind(self.frontend, endpoints.frontend),
            backend=bind(self.backend, endpoints.backend),
            admin=None,
        )
        self._frontend_port = _tcp_port(self.endpoints.frontend)
        # The listener's filter of held-off sources (``synfilter``): its descriptor, what it holds.
        self._syn_fd = synfilter.listening_fd(self._frontend_port) if self._frontend_port else None
        self._syn_filtered: list[int] = []
        self._syn_ever = False  # a filter was attached once: accepted connections may carry it
        self._syn_changes = 0
        if endpoints.admin:
            self.admin = self._router(ADMIN_DOMAIN, keys if admin_tcp else None)
            self.endpoints = Endpoints(self.endpoints.frontend, self.endpoints.backend, bind(self.admin, endpoints.admin))
        self._stop = threading.Event()
        self._draining = False  # drain() was called (SIGTERM)
        self._refusing = False  # the drain has begun: new work is refused (``_start_drain``)
        self._handed_over = False  # the drain began by handing the active role to the peer
        self._reload_requested = False
        self.pair: Pair | None = None
        if pair is not None:
            if not self.security.curve:
                check_bind(pair.bind, self.security, "peer")
            self.pair = Pair(self.core, pair, self.ctx, keys, serve=self._serve_as_active,
                             set_serving=self._set_serving, send_client=lambda frames: to_client(frames[0], frames[1:]))
        self._set_serving(pair is None)

    # ------------------------------------------------------------------ the client handler

    def _set_serving(self, serving: bool) -> None:
        """Serve clients (standalone, or the active broker of a pair) or hand them to the pair."""
        self._serving = serving
        self._choose_client_handler()

    def _choose_client_handler(self) -> None:
        """``_on_client``, what both frontend paths (plain and CURVE) call for each message, from
        one table by (serving, draining): chosen when either changes, never tested per message."""
        self._on_client = MethodType(self._CLIENT_HANDLERS[(self._serving, self._refusing)], self)

    def _serve_client(self, frames: list[bytes], tenant: str | None = None, msg: Decoded = None) -> None:
        """Serving: the message goes to the core (``msg``: decoded already by ``_take``, or why it
        could not be: it is not decoded again)."""
        ident = frames[0]
        try:
            if msg is None:
                msg = protocol.decode(frames[1:], Peer.CLIENT, self.config.max_message_bytes)
            elif isinstance(msg, GpudError):
                raise msg
            self.core.on_client(ident, msg, tenant)
        except GpudError as exc:
            self._bad(self.frontend, Peer.CLIENT, ident, frames, exc, tenant.partition(" ")[0] if tenant else None, tenant)
        except Exception:
            log.exception("bug while handling a client message")
            self._bad(self.frontend, Peer.CLIENT, ident, frames, InternalError("internal error in the broker"))

    def _serve_client_draining(self, frames: list[bytes], tenant: str | None = None,
                               msg: Decoded = None) -> None:
        """Serving while draining: new requests and session calls are answered SHUTTING_DOWN (the
        client may go to the other broker); retries of known ids, pings and cancels are served."""
        if not self._refused_as_new_work(frames):
            self._serve_client(frames, tenant, msg)

    def _vote_client(self, frames: list[bytes], tenant: str | None = None, msg: Decoded = None) -> None:
        """Not serving (the passive broker of a pair): the pair's vote decides."""
        assert self.pair is not None
        self.pair.on_client(frames, tenant)

    def _vote_client_draining(self, frames: list[bytes], tenant: str | None = None,
                              msg: Decoded = None) -> None:
        """Not serving while draining: new work is answered SHUTTING_DOWN, the rest is sent to the
        peer as a passive broker's answer is (a stopping broker never takes over on a vote). Once
        it has handed its work to the peer, everything is sent there."""
        assert self.pair is not None
        if self._handed_over or not self._refused_as_new_work(frames):
            self.pair.reject(frames)  # handed over: everything goes to the peer, which holds the work

    _CLIENT_HANDLERS: dict[tuple[bool, bool], Callable[..., None]] = {
        (True, False): _serve_client,
        (True, True): _serve_client_draining,
        (False, False): _vote_client,
        (False, True): _vote_client_draining,
    }

    def _serve_as_active(self, frames: list[Any], tenant: str | None) -> None:
        """What the pair hands over once this broker is active (a vote's message, held ones)."""
        self._CLIENT_HANDLERS[(True, self._refusing)](self, frames, tenant)

    def _refused_as_new_work(self, frames: list[bytes]) -> bool:
        """While draining: answer a new REQUEST or CALL SHUTTING_DOWN; False for anything else."""
        if len(frames) > 3 and frames[2] in _NEW_WORK:
            rid = protocol.peek_id(frames[1:])
            if rid is not None and rid not in self.core.tasks.tasks:
                exc = ShuttingDown(f"broker {self.config.name} is stopping and takes no new work")
                self.intake.answered(rid)
                self.core.counters["errors"] += 1
                self.core.stats.error(exc.code)
                send_frames(self.frontend, [frames[0], *protocol.error_reply(rid, exc)])
                return True
        return False

    def failover(self) -> dict[str, Any]:
        """``gpudctl failover``: hand the active role to the passive peer.

        Under load the peer always has the last few milliseconds of updates still to apply, and a
        handover needs it in sync: first this loop stops taking work and lets it catch up (for at
        most the peer expiry), reading only the peer's socket."""
        pair = self.pair
        if pair is None:
            raise ConfigError("this broker has no peer (standalone)")
        deadline = time.monotonic() + pair.cfg.expiry
        pair.flush()
        while pair.catching_up() and time.monotonic() < deadline:
            if pair.inbound.poll(10):
                self._drain(pair.inbound, pair.on_peer)
            pair.flush()
        return pair.failover()

    def _router(self, domain: str = "", keys: CurveKeys | None = None, events: int = 0) -> zmq.Socket[bytes]:
        """A ROUTER; with ``keys`` a CURVE server of ``domain``. Its monitor reports ``events``
        (the frontend's: connections accepted and gone, for the gate) and, under CURVE, failed
        handshakes: those ZAP never sees (a peer without CURVE, a wrong server key) are logged."""
        s: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)  # a silent connection does not hold a descriptor long
        if keys is not None:
            server_socket_options(s, keys.secret, keys.public, domain)
            events |= HANDSHAKE_FAILURES
        if events:
            # Our end of the monitor has no high-water mark: an event dropped (a disconnect not
            # seen) would leave a connection counted (``_check_gate`` finds those too).
            address = f"inproc://monitor.{id(s):x}"
            s.monitor(address, events)
            monitor: zmq.Socket[bytes] = self.ctx.socket(zmq.PAIR)
            monitor.setsockopt(zmq.RCVHWM, 0)
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.connect(address)
            self._monitors.append((s, monitor, HandshakeLog(domain.removeprefix("gpud-"))))
        return s

    def _serve_monitors(self, ready: set[Any] | None = None, most: int = SIDE_BATCH) -> None:
        """Read the sockets' monitors (those in ``ready``; None: all): the frontend's connections
        go through the gate, failed handshakes are logged."""
        for sock, monitor, handshakes in self._monitors:
            if ready is not None and monitor not in ready:
                continue
            front = sock is self.frontend
            for _ in range(most):
                try:
                    msg = monitor.recv_multipart(NOBLOCK)
                except zmq.Again:
                    break
                try:
                    ev = parse_monitor_message(msg)
                    event, value = int(ev["event"]), int(ev["value"])
                except Exception:  # a malformed monitor message is no reason to stop serving
                    continue
                if event == zmq.EVENT_ACCEPTED:
                    if front:
                        self._on_accepted(value)
                elif event == zmq.EVENT_DISCONNECTED:
                    if front:
                        self.gate.closed(value)
                else:
                    endpoint = ev["endpoint"]
                    handshakes.event(event, value, endpoint.decode("utf-8", "replace")
                                     if isinstance(endpoint, bytes) else str(endpoint))

    def _filter_held_off(self, now: float) -> None:
        """Give the frontend listener's filter the IPv4 sources held off now: their SYNs are
        dropped by the kernel (all but one in ``synfilter.KEEP_ONE_IN``), so that their handshakes
        cost libzmq's I/O threads nothing (``synfilter``)."""
        assert self._syn_fd is not None
        held = synfilter.ipv4_sources(self.gate.held_now(now))
        self._syn_changes = self.gate.held_changes
        if held == self._syn_filtered:
            return
        try:
            synfilter.attach(self._syn_fd, synfilter.program(held) if held else None)
        except OSError as exc:
            log.warning("frontend: cannot filter held-off sources at the listener (%s); the gate alone holds them off",
                        exc)
            self._syn_fd = None
            return
        log.info("frontend: %d held-off source address(es) filtered at the listener", len(held))
        self._syn_filtered = held
        self._syn_ever = True

    def _detach_filter(self, fd: int) -> None:
        """A connection accepted while the listener had a filter shares it (the kernel copies the
        listener's filter to each connection it accepts): one that got through the filter (a
        known key of a held-off address, on a SYN it let by) would lose most of its segments for
        its whole life. Admitted connections keep no filter."""
        try:
            synfilter.attach(fd, None)
        except OSError:
            pass  # gone meanwhile

    def _on_accepted(self, fd: int) -> None:
        """A frontend connection accepted on descriptor ``fd``: counted by the gate, or shut down
        (``shutdown(2)``: libzmq keeps the descriptor and closes it as for a peer that left)."""
        peer = _peer_of(fd, self._frontend_port)
        if peer is None:  # gone already, or the descriptor is another socket's by now
            return
        why = self.gate.accept(fd, peer, self.core.now)
        if why is not None and self.core.now >= self._gate_check_at:
            # Before refusing, forget what is counted but gone (a disconnect not seen: the
            # monitor's pipe has no bound, so this should find nothing), at most once a while.
            self._gate_check_at = self.core.now + GATE_CHECK_S
            if self._check_gate():
                why = self.gate.accept(fd, peer, self.core.now)
        if why is None:
            if self._syn_ever:  # it holds the listener's filter of that moment: not its own to keep
                self._detach_filter(fd)
            return
        self.core.counters["refused_connections"] += 1
        held = self._bad_log(("connection", peer))
        if held is not None:
            log.warning("refused a frontend connection from %s: %s%s", peer, why,
                        f"; {held} more refused since the last report" if held else "")
        _shut_down(fd, self._frontend_port)

    def _check_gate(self) -> int:
        """Forget connections counted whose descriptor is no longer theirs (a disconnect event
        not seen); returns how many."""
        gone = [fd for fd, source in self.gate.by_fd.items()
                if (peer := _peer_of(fd, self._frontend_port)) is None or source_of(peer) != source]
        for fd in gone:
            self.gate.closed(fd)
        if gone:
            log.warning("%d frontend connection(s) counted were gone (their disconnect events were not seen)", len(gone))
        return len(gone)

    def _serve_security(self, ready: set[Any] | None = None, most: int = SIDE_BATCH) -> None:
        """Answer pending ZAP requests (handshakes of new connections) and read the monitors.

        ZAP is answered here, in the broker's loop, and is cheap: per handshake an inproc round
        trip, a dictionary look-up and, unless the source is held off, a check of the key
        directories' times (``KeyStore.refresh``). The CURVE cryptography of a handshake runs on
        libzmq's I/O threads, never here. A burst of handshakes (an outsider's spam) is served
        a few at a time (``most``: SIDE_STEP after a poll, SIDE_BATCH at a tick), the clients' and
        workers' messages between: a burst of 20 refused handshakes costs the loop about 2 ms."""
        zap, handler = self.zap, self.zap_handler
        if zap is not None and handler is not None and (ready is None or zap in ready):
            for _ in range(most):
                try:
                    frames = zap.recv_multipart(NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = handler.handle(frames)
                except Exception:
                    log.exception("bug in the ZAP handler; refusing the connection")
                    reply = [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"internal error", b"", b""]
                zap.send_multipart(reply)
        self._serve_monitors(ready, most)

    def _drain_clients(self, sock: zmq.Socket[bytes]) -> int:
        """``_drain`` for the frontend: under CURVE each message with its sender's ZAP User-Id
        (tenant and key). A message whose routing id is not a client's (16 bytes, PROTOCOL.md §2)
        is dropped: such a peer may hold one of libzmq's own automatic ids.

        A pass ends early, for the workers' socket and the replies to be served before more is
        read, once one sender (key, else routing id) had PASS_MESSAGES of its messages read or
        PASS_BYTES of payload came in, or PASS_BAD bad messages were answered: a flood of one
        sender's messages, big, small or malformed, delays another's by a short pass at most (the
        ROUTER reads its peers in turn)."""
        curve = self.zap is not None
        intake = self.intake
        self._bad_in_pass = 0
        per_sender: dict[Any, int] = {}
        nbytes = 0
        for n in range(BATCH):
            try:
                frames, user = recv_from(sock, curve, NOBLOCK, copy_first=4, first=self._first)
            except zmq.Again:
                return n
            if len(frames[0]) != protocol.ROUTING_ID_BYTES:
                self._dropped_route()
                continue
            if curve and not user:  # cannot happen with our ZAP handler; never serve a message without one
                log.warning("dropped a client message without a tenant (User-Id)")
                continue
            if len(frames) > 4 or intake.waiting:  # a payload, or someone's messages wait: the share decides
                self._take(frames, user)
            else:
                self._on_client(frames, user)
            sender = user or frames[0]
            seen = per_sender[sender] = per_sender.get(sender, 0) + 1
            if len(frames) > 4:
                nbytes += sum([len(f) for f in frames[4:]])
            if seen >= PASS_MESSAGES or nbytes >= PASS_BYTES or self._bad_in_pass >= PASS_BAD:
                return n + 1
        return BATCH

    def _take(self, frames: list[Any], user: str | None) -> None:
        """A client message through the echo share (``intake.EchoShare``): to the core now, kept
        waiting behind its sender's echoes in flight, or answered BUSY when too much waits. It is
        decoded here, once (a malformed one goes on with why: its handler answers the error)."""
        sender = user.partition(" ")[0] if user else frames[0]  # a tenant (CURVE), else a routing id
        msg: Decoded = None
        echo = None
        try:
            try:
                msg = protocol.decode(frames[1:], Peer.CLIENT, self.config.max_message_bytes)
            except GpudError as exc:
                msg = exc
            else:
                if msg.command is Command.REQUEST and msg.frames and msg.header.get("kind") == "echo":
                    rid = msg.header.get("id")
                    if type(rid) is bytes and len(rid) == protocol.ID_BYTES:
                        echo = rid, sum([len(f) for f in msg.frames])
            took = self.intake.take(sender, frames, user, echo, self.core.now, msg)
        except Exception:  # a bug here must cost the share, never the broker
            log.exception("bug in the echo share; the message goes to the core unshared")
            took = True
        if took:
            self._on_client(frames, user, msg)
        elif took is None:
            rid = protocol.peek_id(frames[1:])
            shown = f"tenant {sender}" if isinstance(sender, str) else "this client"
            busy = Busy(f"{shown} has too many messages waiting behind its echoes (tenant_echo_bytes_in_flight "
                        f"{self.intake.share}, tenant_echo_bytes_per_s {self.intake.rate:g}); try later")
            held = self._bad_log(("intake", shown))
            if held is not None:
                log.warning("refused a message of %s: %s%s", shown, busy.message,
                            f" ({held} more since its last line)" if held else "")
            if rid is not None:
                send_frames(self.frontend, [frames[0], *protocol.error_reply(rid, busy)])

    def _let_waiting_go(self) -> None:
        """Hand the core the waiting messages whose turn it is (their sender's echoes answered)."""
        for w in self.intake.ready(self.core.now):
            self._on_client(w.frames, w.user, w.msg)

    def _dropped_route(self) -> None:
        """Count a message dropped for its routing id; log at most once per DROP_LOG_S. The id is
        not shown: an automatic one would tell a peer what libzmq hands out next."""
        self.core.counters["bad_routes"] += 1
        now = time.monotonic()
        if now >= self._route_log_at:
            log.warning("dropped client message(s) whose routing id is not 16 random bytes (%d so far): "
                        "an old client or not a gpud client", self.core.counters["bad_routes"])
            self._route_log_at = now + DROP_LOG_S

    def stop(self) -> None:
        """Stop at once (dispatched work is abandoned); see ``drain`` for the graceful way."""
        self._stop.set()

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Begin a graceful stop (SIGTERM): at its next tick the loop answers queued and new
        requests SHUTTING_DOWN, waits up to ``config.drain_timeout`` for dispatched work to be
        answered, then tells the workers goodbye and returns. Safe from a signal handler."""
        if not self._draining:
            self._draining = True
            notify.stopping()

    def request_reload(self) -> None:
        """Have the loop call ``reload()`` at its next tick (SIGHUP). Safe from a signal handler."""
        self._reload_requested = True

    def reload(self) -> dict[str, Any]:
        """Re-read the configuration (SIGHUP, ``gpudctl reload``), in the broker's thread between
        two rounds of the loop: the file and GPUD_* variables again, flags still winning. What can
        change live is applied (``BrokerCore.apply_config``); the rest is named as needing a
        restart; a bad file raises ConfigError and changes nothing. Key directories are re-read
        too. Tells systemd RELOADING=1, then READY=1."""
        notify.reloading()
        try:
            if self.reloader is None:
                log.info("reload requested: this broker was started without a configuration to re-read")
                return {"changed": [], "restart_needed": []}
            try:
                new = self.reloader()
            except GpudError as exc:
                log.error("reload refused, the running configuration stays: %s", exc.message)
                raise
            applied, kept = self.core.apply_config(new)
            if self.zap_handler is not None:
                self.zap_handler.keys.refresh()
            (log.warning if applied or kept else log.info)(
                "configuration re-read: applied %s%s", ", ".join(applied) or "no changes",
                f"; needs a restart: {', '.join(kept)}" if kept else "")
            return {"changed": applied, "restart_needed": kept}
        finally:
            notify.ready()

    def close(self) -> None:
        for sock, monitor, _ in self._monitors:
            sock.disable_monitor()
            monitor.close(0)
        self._monitors.clear()
        if self.pair is not None:
            self.pair.close()
        self.core.staging.spool.close()
        for s in (self.frontend, self.backend, self.admin, self.zap):
            if s is not None:
                s.close(0)

    def run(self) -> None:
        """Serve until ``stop()`` (or SIGTERM/SIGINT when installed by ``main``)."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        if self.admin is not None:
            poller.register(self.admin, zmq.POLLIN)
        # CURVE: the ZAP handler and the handshake monitors share the loop (new connections only).
        side = [s for s in (self.zap, *(m for _, m, _ in self._monitors)) if s is not None]
        for s in side:
            poller.register(s, zmq.POLLIN)
        pair = self.pair
        if pair is not None:
            poller.register(pair.inbound, zmq.POLLIN)
        core = self.core
        spool_io = core.staging.spool.io  # its writes done wake the loop: PUT REPLYs wait for them
        poller.register(spool_io.fd, zmq.POLLIN)
        front, back, admin = self.frontend, self.backend, self.admin
        to_workers, to_clients = self._to_workers, self._to_clients
        intake = self.intake
        monotonic = time.monotonic
        next_tick = 0.0
        timeout_ms = int(TICK_S * 1000)
        busy = False
        watchdog = notify.watchdog_interval()
        ping_every = watchdog / 2 if watchdog else None  # systemd's advice: half the timeout
        next_ping = 0.0
        drain_until: float | None = None
        ready: set[Any] = set()
        while not self._stop.is_set():
            # Poll only after a round that found nothing: while messages keep coming, reading
            # until empty is cheaper than a poll per round (each is about a system call). After a
            # poll, only the sockets it found readable are read: a read that finds nothing costs
            # about 4 us (pyzmq raises Again), as much as a small message.
            if not busy:
                ready = {s for s, _ in poller.poll(timeout_ms)}
                if side and ready:
                    self._serve_security(ready, SIDE_STEP)
            now = monotonic()
            if now - core.now > STALL_S:  # frozen, or a long turn: it heard nobody meanwhile
                core.workers.stalled(now - core.now, now)
                if pair is not None:
                    pair.stalled(now - core.now)
            core.now = now
            # Sent after each socket's batch: what results freed is dispatched before the clients'
            # new requests are read (a worker must not idle through a batch of them).
            got = self._drain_workers(back) if busy or back in ready else 0
            backlog = got == BATCH  # more waits: a worker behind it is not silent
            if to_workers or to_clients:
                self._flush()
            if intake.waiting:
                self._let_waiting_go()
            if busy or front in ready:
                got += self._drain_clients(front)
            if pair is not None and (busy or pair.inbound in ready):
                got += self._drain(pair.inbound, pair.on_peer)
            if admin is not None and admin in ready:  # at once, not at the next tick
                self._drain(admin, self._on_admin)
                ready.discard(admin)
            busy = bool(got)
            staging = core.staging
            if spool_io.fd in ready:
                ready.discard(spool_io.fd)
                spool_io.take_signal()
                staging.after_io(core)  # reads done go out, failed writes fail their uploads
            if pair is not None:
                if staging.backfilling:
                    staging.backfill(core)
                pair.flush()
            if staging.waiting:  # PUTs whose chunks are durable now
                for route, reply in staging.take_replies(core.journal.durable):
                    send_frames(front, [route, *reply])
            if staging.pulls:  # outputs: the next chunks once the last ones are durable
                staging.settle_pulls(core, core.journal.durable)
            if to_workers or to_clients:
                self._flush()
            if core.unacked:
                for ident, ids in core.take_acks().items():
                    send_frames(back, [ident, *protocol.encode(Peer.WORKER, Command.ACK, {"ids": ids})])
            if core.starts.pending:
                for ident, go in core.take_go().items():
                    send_frames(back, [ident, *go])
            if now >= next_tick:
                if side:
                    self._serve_security()
                if admin is not None:
                    self._drain(admin, self._on_admin)
                caught_up = not backlog or self._catch_up_workers(back)
                now = monotonic()
                core.tick(now, caught_up)
                if self._syn_fd is not None and (self._syn_changes != self.gate.held_changes or (
                        self._syn_filtered and now >= self._fd_check_at)):
                    self._filter_held_off(now)
                if now >= self._fd_check_at:
                    self._guard_descriptors()
                    self._fd_check_at = now + FD_CHECK_S
                    self._report_held_back()
                    if intake.in_flight:
                        intake.forget_old(now)
                if self.openstack is not None:  # OpenStack: results in, decisions out; never waits
                    self.openstack.on_tick(core, now)
                if pair is not None:
                    pair.tick(now)
                next_tick = now + TICK_S
                if to_workers or to_clients:
                    self._flush()
                # The shell's own timers, once per tick. The watchdog ping is sent from here
                # only: a loop that stops turning stops pinging, and systemd restarts it.
                if ping_every is not None and now >= next_ping:
                    notify.watchdog()
                    next_ping = now + ping_every
                if self._reload_requested:
                    self._reload_requested = False
                    try:
                        self.reload()
                    except GpudError:
                        pass  # logged by reload(); the running configuration stays
                if self._draining:
                    if drain_until is None:
                        drain_until = now + self.config.drain_timeout
                        self._start_drain()
                    elif len(core.queue) or core.staging.parked:  # work queued again meanwhile
                        core.fail_queued(ShuttingDown(f"broker {self.config.name} is stopping"))
                    left = core.dispatched()
                    if not left and not (pair is not None and pair.handing_over(now)):
                        bound = sum(len(w.assigned) for w in core.registry if w.suspended_at)
                        if bound:
                            log.info("stopping: %d request(s) bound to silent worker(s) not waited for (their "
                                     "workers keep the results for the next broker)", bound)
                        break
                    if now >= drain_until:
                        log.warning("stopping: %d dispatched request(s) still unanswered after %gs; leaving them",
                                    left, self.config.drain_timeout)
                        break
        core.shutdown()
        self._flush()

    def _guard_descriptors(self) -> None:
        """Keep FD_RESERVE descriptors free, so that running out never aborts libzmq and the admin
        socket keeps answering: near the limit the frontend stops accepting new connections (the
        ones made stay and are served), and accepts again once under the limit by twice as much.
        Connections that never finish their handshake go after HANDSHAKE_IVL_MS."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # read each time: prlimit may change it
        if limit == resource.RLIM_INFINITY or limit <= 4 * FD_RESERVE:
            return
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:
            return
        endpoint = self.endpoints.frontend
        if self._accepting and used >= limit - FD_RESERVE:
            self.frontend.unbind(endpoint)
            self._accepting = False
            self.core.counters["fd_pauses"] += 1
            log.error("%d of %d descriptors in use: the frontend stops accepting connections until under %d "
                      "(those made are served; raise LimitNOFILE if this is real load)", used, limit, limit - 2 * FD_RESERVE)
        elif not self._accepting and used < limit - 2 * FD_RESERVE:
            try:
                self.frontend.bind(endpoint)
            except zmq.ZMQError as exc:
                log.error("cannot bind the frontend %s again (%s); retrying", endpoint, exc)
                return
            self._accepting = True
            log.warning("%d of %d descriptors in use: the frontend accepts connections again", used, limit)

    def _report_held_back(self) -> None:
        """The counts of bad messages and refused connections not logged one by one."""
        every = self._bad_log.interval
        for source, n in self._bad_log.due():
            if source == OTHERS:
                log.warning("%d more bad message(s) or refused connection(s) from other senders in the last %gs "
                            "(each sender's first is logged, %d senders at most per %gs)", n, every, BAD_LOG_SOURCES, every)
                continue
            what, who = cast(tuple[str, "str | bytes"], source)
            if what == "connection":
                log.warning("refused %d more frontend connection(s) from %s in the last %gs", n, who, every)
            else:  # a peer's bad messages (its sender unformatted), or the intake's and cuts' lines
                log.warning("%d more bad message(s) from %s %s in the last %gs (logged: the first of each sender)",
                            n, what, _who(who) if what in _PEER_NAMES.values() else who, every)

    def _flush(self) -> None:
        """Send what the core queued: each peer's messages in order, runs of small ones as BATCHes.
        Replies to echoes in flight let their bytes go (``intake.EchoShare``): only the replies to
        routing ids with echoes in flight are looked into."""
        routes = self.intake.routes
        if routes and self._to_clients:
            answered = self.intake.answered
            for ident, msgs in self._to_clients.items():
                if ident in routes:
                    for frames in msgs:
                        rid = protocol.peek_id(frames)
                        if rid is not None:
                            answered(rid)
        for sock, box in self._outboxes:
            for ident, msgs in box.items():
                for out in protocol.batched(msgs):
                    sock.send(ident, SNDMORE)
                    send_frames(sock, out)
            box.clear()

    def _start_drain(self) -> None:
        """The active broker of a pair hands its role to an in-sync passive peer, which holds every
        accepted request: its clients are told NOT_ACTIVE and go there, its workers' results
        follow the new epoch. Otherwise (standalone, or no peer to take the work): answer the
        queue SHUTTING_DOWN. Either way, from now on refuse new work."""
        core = self.core
        if self.pair is not None and core.active:
            try:
                self.failover()
                self._handed_over = True
            except GpudError as exc:
                log.warning("stopping: cannot hand the work to the peer (%s)", exc.message)
        failed = core.fail_queued(ShuttingDown(f"broker {self.config.name} is stopping"))
        self._refusing = True
        self._choose_client_handler()
        if self._handed_over:
            log.info("stopping: the active role and the work it holds handed to the peer")
        else:
            log.info("stopping: %d queued request(s) answered SHUTTING_DOWN; waiting up to %gs for %d dispatched",
                     failed, self.config.drain_timeout, core.dispatched())

    def _drain(self, sock: zmq.Socket[bytes], handle: Any) -> int:
        """Handle up to BATCH queued messages of ``sock``; returns how many there were."""
        for n in range(BATCH):
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=4)
            except zmq.Again:
                return n
            handle(frames)
        return BATCH

    def _drain_workers(self, sock: zmq.Socket[bytes]) -> int:
        """``_drain`` for the backend: a READY, a FETCH (or a BATCH) with its worker's key name under CURVE."""
        if self.zap is None:
            return self._drain(sock, self._on_worker)
        for n in range(BATCH):
            try:
                frames, user = recv_frames_user_if(sock, _WHO_WORKER, NOBLOCK, copy_first=4)
            except zmq.Again:
                return n
            self._on_worker(frames, user)
        return BATCH

    def _catch_up_workers(self, sock: zmq.Socket[bytes]) -> bool:
        """Read what waits on the backend (CATCH_UP batches at most) before workers' silence is
        judged: a backlog in the broker's input is not a worker's silence. Returns whether it
        was all read."""
        for _ in range(CATCH_UP):
            self.core.now = time.monotonic()
            got = self._drain_workers(sock)
            if self._to_workers or self._to_clients:
                self._flush()
            if got < BATCH:
                return True
        return False

    def _on_worker(self, frames: list[bytes], user: str | None = None) -> None:
        ident = frames[0]
        try:
            msg = protocol.decode(frames[1:], Peer.WORKER, self.config.max_message_bytes)
            if msg.command is Command.BATCH:
                inner = protocol.unbatch(msg)  # all of it checked before any of it is handled
        except GpudError as exc:
            self._bad(self.backend, Peer.WORKER, ident, frames, exc)
            return
        except Exception:
            log.exception("bug while decoding a worker message")
            self._bad(self.backend, Peer.WORKER, ident, frames, InternalError("internal error in the broker"))
            return
        if msg.command is not Command.BATCH:
            self._from_worker(ident, msg, frames[3], frames, user)
            return
        for one, raw in inner:
            self._from_worker(ident, one, raw, None, user)

    def _from_worker(self, ident: bytes, msg: protocol.Message, raw: bytes, frames: list[bytes] | None,
                     user: str | None = None) -> None:
        """One message of a worker, alone or out of a BATCH (``frames`` None: rebuilt when needed).
        ``user``: its key's name (CURVE; read for READY, FETCH and BATCH only)."""
        try:
            self.core.on_worker(ident, msg, raw, user)
        except Exception as exc:
            if frames is None:
                frames = [ident, *protocol.encode_raw(Peer.WORKER, msg.command, raw)]
            if isinstance(exc, GpudError):
                self._bad(self.backend, Peer.WORKER, ident, frames, exc)
            else:
                log.exception("bug while handling a worker message")
                self._bad(self.backend, Peer.WORKER, ident, frames, InternalError("internal error in the broker"))

    def _on_admin(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            msg = protocol.decode(frames[1:], Peer.ADMIN, self.config.max_message_bytes)
            if msg.command is not Command.ADMIN:
                raise UnknownCommand(f"command {msg.command.name} is not valid on the admin socket")
            rid = protocol.get_id(msg.header)
        except GpudError as exc:
            assert self.admin is not None
            self._bad(self.admin, Peer.ADMIN, ident, frames, exc)
            return
        try:
            # The target is this Broker: commands reach the core as ``.core`` and hooks such as
            # ``reload`` on the shell. ``who`` is what gpudctl declares (user, pid): the admin
            # socket's file permissions (0600 IPC) decide who may ask at all.
            result = ADMIN.dispatch(self, msg.header.get("cmd"), msg.header.get("args"), who=_admin_who(msg.header))
            header = {"id": rid, "ok": True, "result": result}
        except GpudError as exc:
            log.info("admin request refused: %s %s", exc.code, exc.message)
            header = protocol.error_header(rid, exc)
        except Exception:
            log.exception("bug in an admin command")
            header = protocol.error_header(rid, InternalError("internal error in the broker"))
        assert self.admin is not None
        self.admin.send_multipart([ident, *protocol.encode(Peer.ADMIN, Command.REPLY, header)])

    def _bad(self, sock: zmq.Socket[bytes], peer: Peer, ident: bytes, frames: list[bytes], exc: GpudError,
             tenant: str | None = None, user: str | None = None) -> None:
        """Log a message we could not use and answer it where the sender can be addressed. Per
        sender (a client's tenant under CURVE, else its routing id) the log is rate-limited, its
        first bad message of each ``bad_log_s`` in full, the rest counted (``_report_held_back``), and
        so are the answers: past BAD_ANSWERED in a BAD_WINDOW_S, the rest of the window's bad
        messages are counted (``bad_unanswered``) and not answered (PROTOCOL.md §7), so that a
        flood of them costs no replies; at BAD_CUT, a client's connection is closed (``_cut``).
        ``user``: a client's ZAP User-Id (CURVE)."""
        counters = self.core.counters
        counters["bad_messages"] += 1
        # Counted first, and nothing formatted unless a line is logged or a connection closed:
        # past the allowance, a flood's message costs two look-ups and a counter.
        source = (_PEER_NAMES[peer], tenant if tenant is not None else ident)
        held = self._bad_log(source)
        if held is not None:
            log.warning("bad message from %s %s: %s %s%s", source[0], _who(source[1]), exc.code, exc.message,
                        f" ({held} more bad message(s) from it since its last line)" if held else "")
        n = self._bad_count(source)
        if n >= BAD_CUT and sock is self.frontend:
            self._cut(ident, _who(source[1]), user)
        answer = n <= BAD_ANSWERED
        rid = protocol.peek_id(frames[1:]) if answer or ident in self.intake.routes else None
        if rid is not None and self.intake.in_flight:
            self.intake.answered(rid)
        if not answer:
            counters["bad_unanswered"] += 1
            return
        self._bad_in_pass += 1
        header: dict[str, Any] = {"code": exc.code, "message": exc.message}
        if rid is not None:
            header["id"] = rid
        send_frames(sock, [ident, *protocol.encode(peer, Command.ERROR, header)])

    def _cut(self, ident: bytes, who: str, user: str | None) -> None:
        """Close the frontend connection of routing id ``ident``, whose sender ``who`` (a tenant
        under CURVE: each of its connections) sent BAD_CUT bad messages or more within a
        BAD_WINDOW_S (PROTOCOL.md §7), and under CURVE refuse its key's handshakes for
        BAD_HOLD_OFF_S: reading the messages of a flood costs the broker's loop and libzmq's I/O
        threads CPU that answering none of them does not save. The connection is that of the
        message being handled, as its first frame tells (``_first``); the messages it had sent
        before it was closed still come, and close it once only. The sender's work accepted so far
        stays (replies are kept for retries)."""
        first = self._first[0]
        if first is None or first.bytes != ident:
            return  # not the message just read (one that waited): its connection is not known
        try:
            fd = int(first.get(zmq.SRCFD))
            came_from = str(first.get("Peer-Address"))
        except (zmq.ZMQError, TypeError, ValueError):
            return
        now = self.core.now
        last = self._cut_at.get(ident)
        if last is not None and last[0] == fd and now - last[1] < BAD_WINDOW_S:
            return
        if len(self._cut_at) >= 4096:
            self._cut_at.clear()
        self._cut_at[ident] = (fd, now)
        peer = _shut_down(fd, self._frontend_port, came_from)
        if peer is None:
            return
        self.core.counters["cut_connections"] += 1
        held_off = False
        if user is not None and self.zap_handler is not None:
            try:
                self.zap_handler.hold_off(zmq.utils.z85.decode(user.partition(" ")[2]), BAD_HOLD_OFF_S)
                held_off = True
            except ValueError:
                pass
        held = self._bad_log(("cut", peer))
        if held is not None:
            log.warning("closed the frontend connection of client %s from %s: %d bad messages within %gs%s%s", who, peer,
                        BAD_CUT, BAD_WINDOW_S, f"; its key is refused for {BAD_HOLD_OFF_S:g}s" if held_off else "",
                        f" ({held} more closed since the last report)" if held else "")


_PEER_NAMES = {peer: peer.name.lower() for peer in Peer}


def _who(sender: str | bytes) -> str:
    """A bad message's sender as its log line names it: a tenant, else its routing id (hex)."""
    return f"tenant {sender}" if isinstance(sender, str) else sender.hex()[:16]


def _tcp_port(endpoint: str) -> int | None:
    """The port of a ``tcp://HOST:PORT`` endpoint (None for ipc:// and the like)."""
    if not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rpartition(":")[2])
    except ValueError:
        return None


def _peer(conn: socket.socket, port: int | None) -> str | None:
    """The peer address of ``conn`` (``ipc`` for a local socket) if it is a connection to local
    ``port`` (None: any); None when it is not (closed, or another socket's)."""
    try:
        if conn.family == socket.AF_UNIX:
            return "ipc" if port is None else None
        if port is not None and conn.getsockname()[1] != port:
            return None
        return str(conn.getpeername()[0])
    except OSError:
        return None


def _peer_of(fd: int, port: int | None) -> str | None:
    """``_peer`` of the connection on descriptor ``fd``, which stays open."""
    try:
        conn = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return _peer(conn, port)
    finally:
        conn.detach()


def _shut_down(fd: int, port: int | None, came_from: str | None = None) -> str | None:
    """Shut down (``shutdown(2)``, never ``close``: the descriptor stays libzmq's, which then sees
    the end of the stream and closes it as for a peer that left) the connection on ``fd`` if it is
    one to local ``port`` from the address ``came_from`` (the message's ``Peer-Address``; None:
    any); its peer's address, or None when it was not (gone, another socket's, or another host's).
    The address check is there because the descriptor may have been closed and reused for a new
    connection since the message was read: a flooder's connection must never cut someone else's."""
    try:
        conn = socket.socket(fileno=fd)  # takes the descriptor over: ``detach`` gives it back unclosed
    except OSError:
        return None
    try:
        peer = _peer(conn, port)
        if peer is not None and came_from is not None and peer != came_from:
            return None
        if peer is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return peer
    finally:
        conn.detach()


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (systemd's default soft limit is 1024: far too
    few for a broker with a connection per client). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, exc)
    return soft


def _seed_routing_ids() -> None:
    """Seed the C library's ``rand()``, from which libzmq draws the first automatic routing id of
    each ROUTER it creates: unseeded, that id is the same in every process, and a peer that claims
    the next one before libzmq hands it out aborts libzmq (an assertion). Clients set their own
    16-byte ids (PROTOCOL.md §2); this keeps the automatic ones unguessable."""
    try:
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "big"))
    except (OSError, AttributeError):
        log.warning("cannot seed rand(): libzmq's automatic routing ids stay predictable")


def _queue_in(box: dict[bytes, list[list[Any]]]) -> Callable[[bytes, list[Any]], None]:
    """The core's send function for one socket: queue ``frames`` for ``ident`` until ``_flush``."""
    def send(ident: bytes, frames: list[Any]) -> None:
        queued = box.get(ident)
        if queued is None:
            box[ident] = [frames]
        else:
            queued.append(frames)
    return send


def _admin_who(header: dict[str, Any]) -> str:
    """``user pid N`` as an ADMIN header declares them (``?`` for what is missing or odd)."""
    user, pid = header.get("user"), header.get("pid")
    shown = user if type(user) is str and 0 < len(user) <= 64 and user.isprintable() and " " not in user else "?"
    return f"{shown} pid {pid if type(pid) is int else '?'}"


def _on_stop_signal(broker: Broker) -> None:
    """SIGTERM/SIGINT: the first drains (STOPPING=1), a second one stops at once."""
    if broker.draining:
        broker.stop()
    else:
        broker.drain()


def serve(config: BrokerConfig, endpoints: Endpoints, ready_file: str | None = None,
          security: SecuritySettings | None = None, metrics: str | None = None,
          reloader: Callable[[], BrokerConfig] | None = None, pair: PairConfig | None = None,
          openstack: Any = None) -> int:
    """Run a broker in this process until SIGTERM/SIGINT (which drain; a second one stops).

    SIGHUP calls ``Broker.reload``. Under systemd (``$NOTIFY_SOCKET``) it sends READY=1 once its
    sockets are bound, WATCHDOG=1 from its loop and STOPPING=1 on SIGTERM. ``metrics``: serve
    Prometheus metrics on this ``HOST:PORT`` (port 0 picks one; the ready file says which).
    """
    if metrics:
        try:
            from gpud_broker.metrics import parse_listen
            from gpud_broker.metrics import start as start_metrics
        except ImportError:
            raise ConfigError("[metrics] listen (--metrics) needs prometheus-client: pip install 'gpud[metrics]'") from None
        parse_listen(metrics)  # a bad address is refused before anything is bound
    nofile = raise_descriptor_limit()
    # Its own context, with I/O threads sized from the CPUs: a connection's bytes (CURVE included)
    # are moved by one of them, and libzmq spreads connections over them by load, so one peer's
    # big messages do not hold up everyone's. At least two, even on two cores: measured with one
    # tenant's 8 MiB echoes, another's echo p50 was 700 ms with one I/O thread, 1 ms with two.
    io_threads = config.io_threads or max(2, min(4, (os.cpu_count() or 2) // 2))
    broker = Broker(config, endpoints, ctx=zmq.Context(io_threads=io_threads), security=security, pair=pair)
    broker.reloader = reloader
    metrics_server = None
    if metrics:
        try:
            metrics_server = start_metrics(broker.core, metrics, role=pair.role if pair is not None else "standalone")
        except BaseException:
            broker.close()
            raise
    if broker.security.curve:
        log.info("security curve: CURVE on the frontend and backend; workers and clients by key")
    else:
        log.warning("security none: no encryption and no authentication; every client's declared "
                    "tenant is believed. Use only on a trusted host or network.")
    # The hot path allocates a few small objects per message and makes no reference cycles of
    # note: collect the young generation 100x less often (measured: ~5 us per request otherwise).
    gc.freeze()
    gc.set_threshold(70_000, 20, 20)
    signal.signal(signal.SIGTERM, lambda *_: _on_stop_signal(broker))
    signal.signal(signal.SIGINT, lambda *_: _on_stop_signal(broker))
    signal.signal(signal.SIGHUP, lambda *_: broker.request_reload())
    ep = broker.endpoints
    metrics_url = metrics_server.url if metrics_server is not None else None
    limits = broker.gate.limits
    log.info("broker %s ready: frontend %s, backend %s, admin %s, policy %s, metrics %s, %d descriptors, "
             "%d I/O thread(s), connections at most %d (%d per source)", config.name, ep.frontend, ep.backend,
             ep.admin or "-", config.policy, metrics_url or "-", nofile, io_threads, limits.total, limits.per_source)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"frontend": ep.frontend, "backend": ep.backend, "admin": ep.admin, "pid": os.getpid(),
                       "metrics": metrics_url, "peer": broker.pair.bound if broker.pair else None}, f)
        os.replace(tmp, ready_file)
    notify.ready(f"serving: frontend {ep.frontend}, backend {ep.backend}")
    # With [openstack] enabled, a controller whose threads make the Nova calls
    # (imported only then: a broker without OpenStack never loads novaclient).
    if openstack is not None and getattr(openstack, "enabled", False):
        from gpud_broker.openstack.controller import start as start_openstack
        broker.openstack = start_openstack(broker, openstack)
    try:
        broker.run()
    finally:
        if metrics_server is not None:
            metrics_server.close()
        if broker.openstack is not None:
            broker.openstack.stop()
        broker.close()
        log.info("broker %s stopped", config.name)
    return 0
