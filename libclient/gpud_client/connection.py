"""The client's connection to a broker pair: one DEALER socket, the table of outstanding requests,
the broker's liveness, failover, and the session keepalive.

This module owns the conversation on the wire: sending requests, matching replies to them by id,
the liveness check while waiting (lazy pirate: PING after ``ping_interval`` of silence, then give
the broker up after another one), the failover across the endpoint list with every outstanding
request re-sent under its original id (the client half of Binary Star, PROTOCOL.md §9: a broker
that answers NOT_ACTIVE is the passive one of its pair, and the connection moves to the next
endpoint after a ``settle`` delay without the caller ever seeing that answer), and the background
keepalive that renews the lease of open sessions. :class:`Pending` is a request in its table.

What is sent is built by :mod:`gpud_client._request`; the public calls are
:class:`gpud_client.client.Client`'s, and sessions (:mod:`gpud_client.session`) use the
connection through its methods, never its fields. A Connection is not thread-safe; the only
thread it starts is the keepalive, which has sockets of its own and never touches the
connection's socket.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any, Generic, TypeVar

import zmq

from gpud.errors import Busy, ConfigError, GpudError, InternalError, Timeout
from gpud.protocol import Command, Message, Peer, decode, id_text, new_routing_id, unbatch
from gpud.security import HANDSHAKE_FAILURES, CurveKeys, apply_client_keys
from gpud.sockets import NOBLOCK, recv_frames, send_frames
from gpud_client import _request
from gpud_client._request import JobResult
from gpud_client.direct import DataLink, DataOffer

__all__ = [
    "DEFAULT_KEEPALIVE_S",
    "DEFAULT_PING_INTERVAL_S",
    "DEFAULT_SETTLE_S",
    "Connection",
    "Job",
    "Pending",
    "collect",
]

log = logging.getLogger(__name__)

DEFAULT_PING_INTERVAL_S = 0.5
"""Seconds of broker silence, while waiting, before a PING; as long again and the broker is gone
(so a dead broker is left within about a second; the broker pair's peer expiry is 0.75 s)."""
DEFAULT_SETTLE_S = 0.25
"""Seconds to wait after a NOT_ACTIVE answer before sending to the next endpoint (the vote), so
that the passive broker has seen its peer expire by then."""
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
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILURES
"""What the connection's socket monitor reports: how each ZMTP (CURVE) handshake ended."""
KEY_REFUSED = (
    "the broker did not accept our key (wrong broker key, or this client's key is not in the "
    "broker's allow-list)"
)
"""Why a broker that refuses the CURVE handshake never answers (said instead of a bare Timeout)."""

T = TypeVar("T")
Converter = Callable[[Message], T]


@dataclass(slots=True)
class _Outstanding:
    """A request sent and not yet collected: its frames (for re-sending) and, once here, its reply."""

    frames: list[Any]
    what: str
    nbytes: int = 0  # payload bytes sent, plus those expected back
    reply: Message | None = None


class Pending(Generic[T]):
    """A request that has been sent and whose result has not been collected yet.

    Returned by :meth:`~gpud_client.client.Client.submit_echo` (``Pending[bytes]``); :class:`Job`
    is the one for jobs.
    Replies to other requests that arrive while one Pending waits are kept for their own Pending.
    Dropping a Pending without waiting forgets its request (a late reply is then discarded).
    """

    def __init__(
        self,
        conn: Connection | DataLink,
        rid: bytes,
        convert: Converter[T],
        default_timeout: float,
        what: str,
        cancellable: bool,
    ) -> None:
        self._conn = conn
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
            self._conn.forget(self._id)

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
        self._conn.poll()
        return self._conn.has_reply(self._id)

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
            msg = self._conn.wait(self._id, limit, self._what)
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
            self._conn.cancel(self._id)

    def _abandon(self) -> None:
        """Forget the request after a timeout of a synchronous call (and cancel it if queued)."""
        if not self._settled():
            self.cancel()
            self._conn.forget(self._id)


class Job(Pending[JobResult]):
    """A submitted job; :meth:`wait` returns its :class:`JobResult`.

    Its default wait is ``max(timeout, time_limit + timeout)`` with the client's timeout, so a job
    that uses its whole time limit is still waited for.
    """


def collect(pending: Pending[T]) -> T:
    """Wait for the Pending of a synchronous call; on Timeout forget it (and cancel it)."""
    try:
        return pending.wait(None)
    except Timeout:
        if not pending._settled():
            pending._abandon()
        raise


class Connection:
    """The socket to the broker in use, the requests outstanding on it, and the keepalive.

    Parameters are those of :class:`~gpud_client.client.Client` of the same names (checked there);
    ``endpoints`` is the list in failover order.
    """

    def __init__(
        self,
        endpoints: list[str],
        *,
        curve: CurveKeys | None,
        keepalive: float,
        ping_interval: float,
        settle: float,
        context: zmq.Context[Any] | None,
    ) -> None:
        self._endpoints = endpoints
        self._curve = curve
        self._keepalive = keepalive
        self._ping_interval = ping_interval
        self._settle = settle
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
        # Endpoint -> why its last handshake failed (cleared by one that succeeds), for Timeouts.
        self._refused: dict[str, str] = {}
        self._closed = False
        # Held by the thread inside a call (the socket is not thread-safe).
        self._busy = threading.Lock()
        self._lock = threading.Lock()  # guards _sessions and _ka_thread against the keepalive
        self._sessions: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()
        # Sessions' direct sockets on this context: closed with it, even a dropped session's.
        self._links: weakref.WeakSet[DataLink] = weakref.WeakSet()
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        try:
            self._sock, self._monitor = self._connect(self._endpoints[0], watch=True)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
        except ConfigError:
            if self._own_context:
                self._ctx.term()
            raise

    @property
    def endpoint(self) -> str:
        """The broker endpoint in use."""
        return self._endpoints[self._index]

    @property
    def endpoints(self) -> list[str]:
        """All broker endpoints, in failover order."""
        return list(self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, farewell: Callable[[Any], list[Any] | None] | None = None) -> None:
        """Stop the keepalive, send the ``farewell`` of each open session (a message that needs no
        answer, such as its close CALL; None: nothing) without waiting, close the socket, and
        terminate the context when the connection made it. Idempotent."""
        self._enter()
        try:
            self._close(farewell)
        finally:
            self._leave()

    def _close(self, farewell: Callable[[Any], list[Any] | None] | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._ka_stop.set()
        with self._lock:
            thread = self._ka_thread
            sessions = list(self._sessions.values())
            self._sessions.clear()
        linger = 0
        goodbyes = [] if farewell is None else [farewell(session) for session in sessions]
        for frames in goodbyes:
            if frames is None:
                continue
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                linger = 200  # ms: give those messages a moment to leave
            except zmq.ZMQError as exc:
                log.debug("could not send a message on closing: %s", exc)
        if thread is not None:
            thread.join(timeout=5.0)
        for link in list(self._links):
            link.close()
        self._close_monitor()
        self._sock.close(linger=linger)
        self._table.clear()
        self._awaiting = 0
        self._inflight = 0
        if self._own_context:
            if thread is not None and thread.is_alive():
                log.error("session keepalive thread did not stop; leaving the zmq context open")
            else:
                self._ctx.term()

    def _enter(self) -> None:
        """Begin a call; GpudError when another thread is inside one.

        Two threads on one socket take each other's replies (an echo was seen to return another
        thread's request bytes), so a call while another thread's is under way is refused at
        once, and that other call goes on unharmed. One thread after another is fine."""
        if not self._busy.acquire(blocking=False):
            raise GpudError(self._in_use())

    def _leave(self) -> None:
        self._busy.release()

    def _in_use(self) -> str:
        return (
            f"the client is in use by another thread (this call is from thread "
            f"{threading.current_thread().name!r}): a Client is not thread-safe, use one per thread"
        )

    # ------------------------------------------------------------------ request table

    def submit(
        self, rid: bytes, frames: list[Any], what: str, expect: int = 0, nbytes: int | None = None
    ) -> None:
        """Send a REQUEST or CALL and record it for matching and re-sending (the caller then
        makes its Pending). ``expect``: payload bytes the reply is known to carry; ``nbytes``:
        those sent plus those expected, when the caller knows them."""
        if not self._busy.acquire(blocking=False):  # inline: the hot path
            raise GpudError(self._in_use())
        try:
            if self._closed:
                raise GpudError("the client is closed")
            if not self._awaiting:
                # Nothing was expected from the broker until now: its silence counts from here.
                self._quiet_since = monotonic()
                self._ping_at = None
            self.send(frames)
            if nbytes is None:
                nbytes = _payload_bytes(frames) + expect
            self._table[rid] = _Outstanding(frames, what, nbytes)
            self._awaiting += 1
            self._inflight += nbytes
        finally:
            self._busy.release()

    def forget(self, rid: bytes) -> None:
        """Forget a request (its reply, if any comes, is then dropped)."""
        entry = self._table.pop(rid, None)
        if entry is not None and entry.reply is None:
            self._awaiting -= 1
            self._inflight -= entry.nbytes

    def has_reply(self, rid: bytes) -> bool:
        """Whether the reply to ``rid`` is here (read by :meth:`poll` or a wait)."""
        entry = self._table.get(rid)
        return entry is not None and entry.reply is not None

    def send(self, frames: Sequence[Any]) -> None:
        """Send a message that is not recorded (a CANCEL, a PING, a close CALL not waited for)."""
        try:
            send_frames(self._sock, frames, NOBLOCK)
        except zmq.Again:
            raise Busy("the client's send queue is full; the broker is not reading") from None

    def cancel(self, rid: bytes) -> None:
        """Send a CANCEL of request ``rid`` (nothing when there is no connection to send it on)."""
        self._enter()
        try:
            if not self._closed:
                self.send(_request.cancel_frames(rid))
        except Busy:  # no connection (e.g. a refused CURVE handshake): nothing to cancel there
            log.debug("no connection to send CANCEL %s on", id_text(rid))
        finally:
            self._leave()

    def wait(self, rid: bytes, timeout: float, what: str) -> Message:
        """Wait for the reply to ``rid`` until ``timeout`` seconds from now, keeping the broker
        under watch (PING, failover). Returns the reply and forgets the request."""
        if not self._busy.acquire(blocking=False):  # inline: the hot path
            raise GpudError(self._in_use())
        try:
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
                    raise self._timeout(what, timeout)
            del self._table[rid]
            return entry.reply
        finally:
            self._busy.release()

    def _timeout(self, what: str, timeout: float) -> Timeout:
        """The Timeout of a wait, with what the connection knows of why nothing came."""
        hint = f"; last dropped message: {self._last_dropped}" if self._last_dropped else ""
        if self._passive:
            hint += f"; {self._passive} answered NOT_ACTIVE (the passive broker)"
        self._read_handshakes()
        if self._refused:  # the current endpoint's reason first
            why = self._refused.get(self.endpoint) or next(iter(self._refused.values()))
            hint = f": {why}{hint}"
        return Timeout(f"{what}: no reply within {timeout:g}s from {self.endpoint}{hint}")

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
        self._read_handshakes()  # now and then, so that the monitor's queue never fills
        try:
            self.send(_request.ping_frames(self._session_ids()))
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
                sock, monitor = self._connect(self._endpoints[index], watch=True)
            except ConfigError as exc:
                if step == count:
                    raise
                log.error("%s; trying the next endpoint", exc)
                continue
            break
        self._read_handshakes()  # the old socket's, under the old endpoint
        self._close_monitor()
        self._sock.close(linger=0)
        self._sock, self._monitor, self._index = sock, monitor, index
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
            self.send(entry.frames)
        self._quiet_since = now
        self._ping_at = None
        self._switch_at = None

    def _connect(
        self, endpoint: str, sndhwm: int = 0, watch: bool = False
    ) -> tuple[zmq.Socket[Any], zmq.Socket[Any] | None]:
        """A DEALER connected to ``endpoint``; with ``watch``, and the monitor of its handshakes."""
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # 16 random bytes, fresh per connection: the broker serves no other (PROTOCOL.md §2).
        sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
        # Unbounded queues: outstanding requests are bounded by the caller, and a reply dropped at
        # a high-water mark would only come back as a spurious failover.
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            apply_client_keys(sock, self._curve)
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS) if watch else None
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise ConfigError(f"cannot connect to {endpoint!r}: {exc}") from None
        return sock, monitor

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _read_handshakes(self) -> None:
        """Note how the current socket's handshakes ended: a refusal (by reason) or a success
        (which clears the endpoint's refusal). Read only when the broker is silent or at a
        Timeout, never on the path of a reply."""
        monitor = self._monitor
        if monitor is None:
            return
        endpoint = self.endpoint
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 1 or len(frames[0]) != 6:
                continue  # not a monitor event (libzmq writes 6 bytes: event, value)
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused.pop(endpoint, None)
                continue
            why = self._refusal(event, value)
            if why is not None and not (
                event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and endpoint in self._refused
            ):  # a reset says less than the refusal it follows
                if self._refused.get(endpoint) != why:
                    log.warning("broker %s: %s", endpoint, why)
                self._refused[endpoint] = why

    def _refusal(self, event: int, value: int) -> str | None:
        """Why a failed handshake failed, as the caller should read it."""
        if not event & HANDSHAKE_FAILURES:
            return None
        if self._curve is None:
            # A plaintext broker never fails a client's NULL handshake: whether the mechanism
            # mismatch or the reset that follows it is read first, the cause is the same.
            return (
                "the broker did not accept our connection: it uses CURVE and this client has "
                "no keys (Client(..., curve=CurveKeys.from_files(secret, broker_public)))"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == getattr(
            zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002
        ):
            return "the broker did not accept our connection: it does not use CURVE, and we do"
        return KEY_REFUSED

    # ------------------------------------------------------------------ receiving

    def poll(self) -> None:
        """Read the replies that have arrived, without blocking."""
        self._enter()
        try:
            if not self._closed:
                self._pump(0.0)
                if self._switch_at is not None and monotonic() >= self._switch_at:
                    self._watch_broker(monotonic())
        finally:
            self._leave()

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

    def data_link(self, offer: DataOffer, session: bytes) -> DataLink:
        """The direct sockets to session ``session``'s worker (PROTOCOL.md §10), on this
        connection's context and keys; the caller probes and closes them."""
        link = DataLink(self._ctx, offer, self._curve, self._ping_interval, session)
        self._links.add(link)
        return link

    def add_session(self, sid: bytes, session: Any) -> None:
        """Keep session ``sid`` alive (its lease renewed) while ``session`` is referenced and
        until :meth:`remove_session`."""
        with self._lock:
            self._sessions[sid] = session
            if self._ka_thread is None and not self._ka_stop.is_set():
                thread = threading.Thread(
                    target=self._keepalive_loop, name="gpud-client-keepalive", daemon=True
                )
                self._ka_thread = thread
                thread.start()

    def remove_session(self, sid: bytes) -> None:
        """Stop renewing session ``sid``."""
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
                frames = _request.ping_frames(ids)
                for index in targets:
                    if index not in socks:
                        socks[index], _ = self._connect(self._endpoints[index], KEEPALIVE_HWM)
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


# --------------------------------------------------------------------------- helpers


def _payload_bytes(frames: Sequence[Any]) -> int:
    """Bytes of a message's payload frames (those after signature, command and header)."""
    return sum([f.nbytes if type(f) is memoryview else len(f) for f in frames[3:]])


def _drain(sock: zmq.Socket[Any]) -> bool:
    """Read and discard every queued message; whether there was any."""
    got = False
    while True:
        try:
            sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return got
        got = True
