"""A session's direct path to its worker (docs/PROTOCOL.md §10): a DEALER on the session's own
socket there, one on the worker's data socket for PINGs, the CALLs outstanding, and the worker's
liveness while one waits.

This module owns that conversation: the probe that decides whether the path is usable (a PING on
each socket answered by a PONG), sending CALLs with the session's capability, matching their
REPLYs by id, and the lazy-pirate watch of the worker (PING its data socket after
``ping_interval`` of silence: the session's own socket answers nothing while a call runs, however
long; the worker is taken as lost when that PING goes unanswered for ``WORKER_GRACE_S``, which the
session handles as SESSION_LOST: it replays through the broker). A DataLink offers the methods of
a :class:`~gpud_client.connection.Connection` that a :class:`~gpud_client.connection.Pending`
uses, so a session's chunked copies are the same code on either path; :meth:`DataLink.call` is
the short way of one call alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

import zmq
from zmq import zmq_poll

from gpud.errors import GpudError, SessionLost, Timeout
from gpud.protocol import Command, Message, Peer, decode, encode, id_text, unbatch
from gpud.security import CurveKeys, client_socket_options
from gpud.sockets import NOBLOCK, recv_frames, send_frames

__all__ = ["DataLink", "DataOffer", "parse_offer"]

log = logging.getLogger(__name__)

WORKER_GRACE_S = 3.0
"""Seconds a PING to a silent worker may go unanswered before the worker counts as lost: what a
broker allows a worker by default (3 heartbeats of 1 s), since a false loss costs a replay."""
PROBE_S = 2.0
"""Seconds a new direct path has to answer its probe before the session falls back to the relay."""
TRANSFER_RATE_FLOOR = 10 << 20
"""Bytes per second a copy to or from the worker is assumed to reach at least: while payloads are
in flight, the worker may look silent for as long as they take at this rate, on top of
``ping_interval``."""

_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_RCVTIMEO = int(zmq.RCVTIMEO)


class DataOffer:
    """What a session's REPLY says about its direct path: the session's endpoint, the worker's
    data socket (PINGs), capability, worker key, and whether the broker relays the session's
    CALLs too (not when its ``data_path`` is direct)."""

    __slots__ = ("endpoint", "ping", "cap", "key", "relay")

    def __init__(self, endpoint: str, cap: bytes, key: str, relay: bool = True, ping: str = "") -> None:
        self.endpoint = endpoint
        self.ping = ping or endpoint
        self.cap = cap
        self.key = key
        self.relay = relay


def parse_offer(data: Any) -> DataOffer | None:
    """The ``data`` field of a session's REPLY (None when absent or malformed: no direct path)."""
    if type(data) is not dict:
        return None
    endpoint, cap, key, relay = data.get("endpoint"), data.get("cap"), data.get("key", ""), data.get("relay", True)
    ping = data.get("ping", "")
    if (type(endpoint) is not str or not endpoint or type(cap) is not bytes or len(cap) < 16 or type(key) is not str
            or type(relay) is not bool or type(ping) is not str):
        log.warning("ignored a malformed direct path offer from the broker")
        return None
    return DataOffer(endpoint, cap, key, relay, ping)


class DataLink:
    """The direct sockets of one session (not thread-safe: used by the session's caller only)."""

    def __init__(self, ctx: zmq.Context[Any], offer: DataOffer, curve: CurveKeys | None, ping_interval: float,
                 session: bytes) -> None:
        self.offer = offer
        self.endpoint = offer.endpoint
        self._ping_interval = ping_interval
        if curve is not None and not offer.key:
            raise GpudError("the worker offered a direct path without its CURVE key")
        self._sock = self._connect(ctx, offer.endpoint, curve, offer.key)
        try:
            self._pinger = self._connect(ctx, offer.ping, curve, offer.key) if offer.ping != offer.endpoint else self._sock
        except GpudError:
            self._sock.close(0)
            raise
        self._socks = [self._sock] if self._pinger is self._sock else [self._sock, self._pinger]
        self._items = [(sock, _POLLIN) for sock in self._socks]  # for zmq_poll, without a Poller's upkeep
        self._table: dict[bytes, Message | None] = {}
        self._sizes: dict[bytes, int] = {}
        self._awaiting = 0  # entries of _table still without a reply
        self._inflight = 0
        self._quiet_since = monotonic()
        self._ping_at: float | None = None
        self._pongs = [0] * len(self._socks)  # PONGs seen on each socket (the probe counts them)
        # The PING of the data socket names the session: a worker that no longer holds it says so.
        self._ping = encode(Peer.CLIENT, Command.PING, {"session": session, "cap": offer.cap})
        self._ended = False  # the worker said it no longer holds the session
        self.closed = False

    @staticmethod
    def _connect(ctx: zmq.Context[Any], endpoint: str, curve: CurveKeys | None, key: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            client_socket_options(sock, curve.secret, curve.public, key.encode("ascii"))
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise GpudError(f"cannot connect to the worker's data endpoint {endpoint!r}: {exc}") from None
        return sock

    def __del__(self) -> None:
        # A session dropped without close: its sockets go with it, quietly.
        if not getattr(self, "closed", True):
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for sock in self._socks:
                sock.close(0)
            self._table.clear()
            self._sizes.clear()
            self._awaiting = self._inflight = 0

    def probe(self, limit: float) -> list[str]:
        """PING each socket: the endpoints that do not answer within ``limit`` seconds (none: the
        path works, the session's own socket and the data socket its liveness is watched on)."""
        want = [n + 1 for n in self._pongs]
        for sock in self._socks:
            send_frames(sock, self._ping, NOBLOCK)
        deadline = monotonic() + limit
        while True:
            silent = [i for i, n in enumerate(want) if self._pongs[i] < n]
            left = deadline - monotonic()
            if not silent or left <= 0:
                return [self.endpoint if i == 0 else self.offer.ping for i in silent]
            self._pump(left, None)

    # ------------------------------------------------------------------ calls

    def call(self, rid: bytes, frames: list[Any], timeout: float, what: Callable[[], str], expect: int = 0) -> Message:
        """Send one CALL and wait for its REPLY (``submit`` then ``wait``): the way of a call
        alone, with nothing made that it does not need."""
        self.submit(rid, frames, "", expect)
        try:
            return self.wait(rid, timeout, what)
        except Timeout:
            self.forget(rid)
            raise

    def submit(self, rid: bytes, frames: list[Any], what: str, expect: int = 0, nbytes: int | None = None) -> None:
        if self.closed:
            raise SessionLost("the session's direct path is closed")
        if not self._awaiting:  # nothing was expected until now: the worker's silence counts from here
            self._quiet_since = monotonic()
            self._ping_at = None
        send_frames(self._sock, frames, NOBLOCK)
        if nbytes is None:
            nbytes = expect
            for f in frames[3:]:
                nbytes += f.nbytes if type(f) is memoryview else len(f)
        self._table[rid] = None
        self._sizes[rid] = nbytes
        self._awaiting += 1
        self._inflight += nbytes

    def send(self, frames: Sequence[Any]) -> None:
        send_frames(self._sock, frames, NOBLOCK)

    def forget(self, rid: bytes) -> None:
        if rid in self._table:
            if self._table.pop(rid) is None:
                self._awaiting -= 1
                self._inflight -= self._sizes.pop(rid, 0)

    def has_reply(self, rid: bytes) -> bool:
        return self._table.get(rid) is not None

    def poll(self) -> None:
        if not self.closed:
            self._pump(0.0, None)

    def cancel(self, rid: bytes) -> None:
        """A session CALL cannot be cancelled."""

    def wait(self, rid: bytes, timeout: float, what: str | Callable[[], str]) -> Message:
        """The REPLY to ``rid`` within ``timeout`` seconds; SessionLost when the worker stops
        answering (no REPLY and no PONG for ``WORKER_GRACE_S`` after a PING): the session then
        replays."""
        table = self._table
        if rid not in table:
            raise GpudError(f"{_text(what)}: not outstanding (already collected or forgotten)")
        deadline = monotonic() + max(0.0, timeout)
        while True:
            msg = table.get(rid)
            if msg is not None:
                del table[rid]
                return msg
            if self._ended:
                self.close()
                raise SessionLost(f"{_text(what)}: the worker at {self.endpoint} no longer holds the session")
            now = monotonic()
            if now >= deadline:
                raise Timeout(f"{_text(what)}: no reply within {timeout:g}s from the worker at {self.endpoint}")
            wake = self._watch(now, what)
            if self._ping_at is None:  # nothing awaited from the data socket: the reply alone
                self._receive(min(deadline, wake) - now)
            else:
                self._pump(min(deadline, wake) - now, rid)

    # ------------------------------------------------------------------ internals

    def _watch(self, now: float, what: str | Callable[[], str]) -> float:
        """PING a silent worker; SessionLost once it stays silent. Returns when to look again."""
        transfer = self._inflight / TRANSFER_RATE_FLOOR
        interval = self._ping_interval + transfer
        if self._ping_at is not None:
            grace = WORKER_GRACE_S + transfer
            if now - self._ping_at < grace:
                return self._ping_at + grace
            self.close()
            raise SessionLost(f"{_text(what)}: the worker at {self.endpoint} stopped answering "
                              f"(silent for {now - self._quiet_since:.1f}s on the direct path)")
        if now - self._quiet_since < interval:
            return self._quiet_since + interval
        send_frames(self._pinger, self._ping, NOBLOCK)
        self._ping_at = now
        return now + interval

    def _receive(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for one message on the session's socket and handle it:
        a blocking receive (RCVTIMEO), the fewest system calls a reply can cost (a poll first
        asks the socket's events before and after it waits)."""
        sock = self._sock
        sock.setsockopt(_RCVTIMEO, max(0, math.ceil(timeout * 1000)))
        try:
            frames = recv_frames(sock, 0, copy_first=3)
        except zmq.Again:
            return
        self._handle(frames, 0)

    def _pump(self, timeout: float, rid: bytes | None) -> None:
        """Wait up to ``timeout`` seconds for a message, then handle every one queued on either
        socket (``rid``: stop once its reply is here). Polls first: a reply is never there the
        moment its call went out, and a read that finds nothing costs an exception."""
        ready = zmq_poll(self._items, max(0, math.ceil(timeout * 1000)))
        if not ready:
            return
        table, socks = self._table, self._socks
        for sock, _ in ready:
            src = socks.index(sock)
            while int(sock.getsockopt(_EVENTS)) & _POLLIN:
                self._handle(recv_frames(sock, NOBLOCK, copy_first=3), src)
                if rid is not None and table.get(rid) is not None:
                    return

    def _handle(self, frames: list[Any], src: int) -> None:
        self._quiet_since = monotonic()
        self._ping_at = None
        try:
            msg = decode(frames, expect=Peer.CLIENT)
            batch = [m for m, _ in unbatch(msg)] if msg.command is Command.BATCH else [msg]
        except GpudError as exc:
            log.warning("from worker %s: dropped a malformed message (%s: %s)", self.endpoint, exc.code, exc.message)
            return
        for one in batch:
            if one.command is Command.PONG:
                self._pongs[src] += 1
                if one.header.get("ended") is True:
                    self._ended = True
                continue
            rid = one.header.get("id")
            if one.command not in (Command.REPLY, Command.ERROR) or type(rid) is not bytes:
                log.warning("from worker %s: dropped an unexpected %s", self.endpoint, one.command.name)
                continue
            if rid in self._table and self._table[rid] is None:
                self._table[rid] = one
                self._awaiting -= 1
                self._inflight -= self._sizes.pop(rid, 0)
            else:
                log.debug("dropped a stale reply for %s", id_text(rid))


def _text(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
