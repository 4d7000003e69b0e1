"""The broker pair's socket shell: the peer link, Binary Star events, and the replication stream.

Each broker binds a ROUTER (``peer_bind``) on which it hears its peer, and connects a DEALER to the
peer's (``peer``) on which it talks: STATE every ``heartbeat``, SYNC, SNAPSHOT and UPDATES
(PROTOCOL.md §9). The decisions are ``bstar.step``'s; the tables are the BrokerCore's; this module
moves messages between them and keeps the facts the decisions need (when the peer was last heard,
what it applied).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from gpud import protocol
from gpud.clock import Clock, SystemClock
from gpud.errors import ConflictError, GpudError, NotActive
from gpud.protocol import Command, Peer
from gpud.security import PEER_DOMAIN, CurveKeys, apply_client_keys, server_socket_options
from gpud.sockets import NOBLOCK, send_frames
from gpud_standby.bstar import PEER_EVENTS, Action, Event, Facts, State, step
from gpud_standby.paired import PairedBroker

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 0.25
DEFAULT_EXPIRY_S = 0.75
HANDOVER_BEATS = 8  # STATEs that carry ``handover`` after the operator's failover
UNSYNCED_WARN_EXPIRIES = 10  # an active broker says why nothing is durable after this many expiries
UNSYNCED_WARN_EVERY_S = 60.0  # and again at most this often
_REQ, _CALL, _PING, _PUT, _FETCH = (protocol.CMD_BYTES[c] for c in (Command.REQUEST, Command.CALL, Command.PING, Command.PUT,
                                                                  Command.FETCH))


@dataclass(frozen=True, slots=True)
class PairConfig:
    role: str  # "primary" or "backup"
    peer: str  # the peer's peer endpoint (we connect)
    bind: str  # our peer endpoint (the peer connects)
    heartbeat: float = DEFAULT_HEARTBEAT_S
    expiry: float = DEFAULT_EXPIRY_S
    settle: float = 2.0  # seconds at most a new active broker waits for its workers (§9.4)

    def __post_init__(self) -> None:
        if self.role not in ("primary", "backup"):
            raise ValueError(f"role must be primary or backup, not {self.role!r}")
        if not (0 < self.heartbeat < self.expiry):
            raise ValueError("the peer heartbeat must be positive and shorter than the expiry")


class Pair:
    """One broker's side of the pair. ``serve(frames, tenant)`` is the broker's normal client
    handler; ``set_serving(bool)`` switches the shell between it and ``on_client``. ``clock`` is
    what the pair reads when a message comes (the broker's loop passes ``now`` to ``tick``)."""

    def __init__(self, core: PairedBroker, cfg: PairConfig, ctx: zmq.Context[Any], keys: CurveKeys | None,
                 serve: Callable[[list[Any], str | None], None], set_serving: Callable[[bool], None],
                 send_client: Callable[[list[Any]], None], clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.core = core
        self.cfg = cfg
        self.serve = serve
        self.set_serving = set_serving
        self.send_client = send_client
        self.inbound: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self.inbound.setsockopt(zmq.LINGER, 0)
        self.inbound.setsockopt(zmq.RCVHWM, 0)
        self.outbound: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.outbound.setsockopt(zmq.LINGER, 0)
        self.outbound.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer that is not there
        self.outbound.setsockopt(zmq.SNDHWM, 100_000)
        self.outbound.setsockopt(zmq.HEARTBEAT_IVL, int(cfg.heartbeat * 1000))
        self.outbound.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.expiry * 1000))
        if keys is not None:  # the pair shares one key pair: each is the other's CURVE server
            server_socket_options(self.inbound, keys.secret, keys.public, PEER_DOMAIN)
            apply_client_keys(self.outbound, CurveKeys(keys.public, keys.secret, keys.public))
        self.inbound.bind(cfg.bind)
        self.bound = self.inbound.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbound.connect(cfg.peer)
        now = self.clock.monotonic()
        self.state = State.PRIMARY if cfg.role == "primary" else State.BACKUP
        self.peer_state: State | None = None
        self.peer_epoch = 0
        self.peer_applied = 0
        self.peer_streaming = False
        self.peer_heard = now  # silence counts from our start
        self.stall_credit = (0.0, 0.0)  # (given, longest stall) within the peer's current silence
        self.peer_active_epoch = 0  # the largest epoch the peer has been known active at (since it started)
        self.next_beat = 0.0
        self.applied = 0  # passive: seq of the last update applied
        self.synced = False  # passive: holds a snapshot and every update since
        self.sync_sent = 0.0  # passive: when SYNC went out (resent if unanswered)
        self.syncs_sent = 0  # passive: SYNCs sent (one sent while an event is handled is not sent again)
        self.snapshots = 0  # passive: snapshots loaded (more than one: it had to re-sync)
        self.streaming = False  # active: the peer has our snapshot and gets our updates
        self.handover_beats = 0
        self.unsynced_since: float | None = None  # active: since when a heard peer holds none of our updates
        self.unsynced_warn_at = 0.0  # and when it next says so
        self.held: list[tuple[list[Any], str | None, float]] = []
        self.state_due = False
        self.misconfigured = False  # the peer has the same role (logged once)
        core.join_pair()

    # ------------------------------------------------------------------ facts and events

    def facts(self, now: float) -> Facts:
        silence = now - self.peer_heard
        core = self.core
        return Facts(
            primary=self.cfg.role == "primary",
            peer_expired=silence > self.cfg.expiry,
            peer_silent=silence > 1.5 * self.cfg.heartbeat,
            witness=core.witness(self.cfg.expiry),
            epoch=core.epoch,
            peer_epoch=self.peer_epoch,
            peer_in_sync=self.streaming and self.peer_applied >= core.seq,
        )

    def event(self, event: Event, now: float) -> Action:
        before = self.state
        self.state, action = step(before, event, self.facts(now))
        if action is Action.TAKEOVER:
            self._take_over(now)
        elif action in (Action.STEP_DOWN, Action.HAND_OVER):
            self._step_down(now, handover=action is Action.HAND_OVER)
        elif action is Action.SYNC:
            self.core.become_passive()
            self._sync(now)
        elif action is Action.ERROR and not self.misconfigured:
            self.misconfigured = True  # said once: the peer repeats it every heartbeat
            log.error("pair: the peer was started as %s too; neither broker becomes active while they hear "
                      "each other (start one as primary, the other as backup)", self.cfg.role)
        if self.state is not before:
            (log.info if routine_change(before, self.state) else log.warning)(
                "pair: %s -> %s on %s (%s)", before.name, self.state.name, event.name, action.name)
            self.state_due = True
        return action

    def _take_over(self, now: float) -> None:
        core = self.core
        epoch = next_epoch(max(core.epoch, self.peer_epoch, core.max_epoch_seen), self.cfg.role == "primary")
        self.streaming = False
        core.take_over(epoch, self.cfg.settle, now)
        self.set_serving(True)
        held, self.held = self.held, []
        for frames, tenant, _ in held:
            self.serve(frames, tenant)

    def _step_down(self, now: float, handover: bool) -> None:
        self.core.step_down()
        self.set_serving(False)
        self.synced = False
        self.streaming = False
        self.handover_beats = HANDOVER_BEATS if handover else 0
        self._sync(now)

    def _sync(self, now: float) -> None:
        self.synced = False
        self.sync_sent = now
        self.syncs_sent += 1
        self._send(Command.SYNC, {})

    # ------------------------------------------------------------------ clients of a non-active broker

    def on_client(self, frames: list[Any], tenant: str | None = None) -> None:
        """A client message while this broker is not active: the vote (PROTOCOL.md §9.1)."""
        try:
            self._vote(frames, tenant)
        except Exception:  # never let one message stop the broker
            log.exception("bug while judging a client message on a non-active broker")

    def _vote(self, frames: list[Any], tenant: str | None) -> None:
        cmd = frames[2] if len(frames) > 2 else b""
        if cmd not in (_REQ, _CALL, _PING, _PUT, _FETCH):
            return  # CANCEL and the like: nothing of theirs is here
        now = self.clock.monotonic()
        action = self.event(Event.CLIENT, now)
        if action is Action.TAKEOVER:
            self.serve(frames, tenant)
        elif action is Action.HOLD:
            self.held.append((frames, tenant, now))
        else:
            self.reject(frames)

    def reject(self, frames: list[Any]) -> None:
        """Answer a client as a broker that is not active: PONG to a PING, NOT_ACTIVE to the rest."""
        ident = frames[0]
        if frames[2] == _PING:
            self.send_client([ident, *protocol.pong()])
            return
        rid = protocol.peek_id(frames[1:])
        if rid is not None:
            exc = NotActive(f"broker {self.core.name} is passive; its peer is active")
            self.send_client([ident, *protocol.error_reply(rid, exc)])

    # ------------------------------------------------------------------ the peer link

    def on_peer(self, frames: list[Any]) -> None:
        try:
            msg = protocol.decode(frames[1:], Peer.BROKER, protocol.DEFAULT_MAX_MESSAGE_BYTES)
        except GpudError as exc:
            log.warning("bad message on the peer link: %s %s", exc.code, exc.message)
            return
        now = self.clock.monotonic()
        self.peer_heard = now
        self.stall_credit = (0.0, 0.0)  # a new silence begins
        header = msg.header
        try:
            if msg.command is Command.STATE:
                self._on_state(header, now)
            elif msg.command is Command.SYNC:
                self._on_sync()
            elif msg.command is Command.SNAPSHOT:
                self._on_snapshot(header, msg.frames, now)
            elif msg.command is Command.UPDATES:
                self._on_updates(header, msg.frames, now)
        except Exception as exc:  # never trust the wire, not even the peer's: log, re-sync, serve on
            log.error("unusable %s from the peer (%s: %s); re-syncing", msg.command.name, exc.__class__.__name__, exc)
            if self.state is State.PASSIVE:
                self._sync(now)

    def _on_state(self, header: dict[str, Any], now: float) -> None:
        try:
            peer_state = State(header.get("state"))
        except ValueError:
            log.warning("peer STATE names no state: %r", header.get("state"))
            return
        epoch, applied = header.get("epoch"), header.get("applied")
        if peer_state in (State.PRIMARY, State.BACKUP):
            self.peer_active_epoch = 0  # the peer (re)started: its epochs begin again
        elif (peer_state is State.PASSIVE and self.state is State.PASSIVE and type(epoch) is int
              and epoch < self.peer_active_epoch):
            # Sent before the peer took over, and read after its news (it waited on an older
            # connection of the peer's, e.g. while this broker was frozen): as PRIMARY this broker
            # would take it for both being passive and take over beside the active peer.
            log.info("pair: a stale STATE (passive at epoch %d; the peer has been active at %d) ignored",
                     epoch, self.peer_active_epoch)
            return
        if peer_state is State.ACTIVE and type(epoch) is int:
            self.peer_active_epoch = max(self.peer_active_epoch, epoch)
        if type(epoch) is int:
            self.peer_epoch = epoch
            self.core.saw_epoch(epoch)
        if type(applied) is int and peer_state is State.PASSIVE:  # an active peer's seq numbers its own updates
            if self.state is State.ACTIVE:
                if "unheld" in header:  # before ``applied`` makes their chunks durable
                    self.core.peer_unheld(header["unheld"])
                self.core.peer_spool_room(header.get("room"))
            self.peer_applied = applied
        self.peer_streaming = header.get("streaming") is True
        became_active = peer_state is State.ACTIVE and self.peer_state is not State.ACTIVE
        self.peer_state = peer_state
        syncs = self.syncs_sent
        if header.get("handover") is True and peer_state is State.PASSIVE and self.state is State.PASSIVE and self.synced:
            self.event(Event.HANDOVER, now)
        elif self.handover_beats > 0 and peer_state is State.PASSIVE:
            pass  # we handed over; the peer's next STATE says it is active
        else:
            self.event(PEER_EVENTS[peer_state], now)
        if (self.state is State.PASSIVE and peer_state is State.ACTIVE
                and (not self.synced or not self.peer_streaming)
                and ((became_active and self.syncs_sent == syncs) or now - self.sync_sent > self.cfg.expiry)):
            # At once when the peer has just become active (a handover: its ACKs and GOs wait for
            # our snapshot, §9.3); else at most once an expiry (each SYNC costs it a snapshot).
            self._sync(now)

    def _on_sync(self) -> None:
        core = self.core
        if self.state is not State.ACTIVE:
            return
        snap = core.snapshot()
        ok = self._send(Command.SNAPSHOT, {"seq": core.seq, "epoch": core.epoch}, [protocol.packb(snap)])
        self.streaming = ok
        self.peer_applied = 0
        log.info("pair: snapshot of %d task(s), %d session(s) sent to the peer (seq %d)",
                 len(snap["tasks"]), len(snap["sessions"]), core.seq)

    def _on_snapshot(self, header: dict[str, Any], frames: list[Any], now: float) -> None:
        if self.state is not State.PASSIVE:
            return
        snap = protocol.unpackb(protocol.as_bytes(frames[0]))
        self.core.load(snap, now)
        self.applied = header["seq"]
        self.synced = True
        self.snapshots += 1
        self.state_due = True
        log.info("pair: snapshot loaded: %d task(s), %d session(s) at seq %d",
                 len(snap["tasks"]), len(snap["sessions"]), self.applied)

    def _on_updates(self, header: dict[str, Any], frames: list[Any], now: float) -> None:
        if self.state is not State.PASSIVE or not self.synced:
            return
        seq, count = header["seq"], header["count"]
        if seq + count - 1 <= self.applied:
            return  # seen already
        if seq != self.applied + 1:
            log.warning("pair: updates from seq %d, expected %d: re-syncing", seq, self.applied + 1)
            self._sync(now)
            return
        self.core.apply(protocol.unpackb(protocol.as_bytes(frames[0])), now)
        self.applied = seq + count - 1
        self.state_due = True

    def _send(self, cmd: Command, header: dict[str, Any], frames: list[Any] | None = None) -> bool:
        try:
            send_frames(self.outbound, protocol.encode(Peer.BROKER, cmd, header, frames or ()), NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _send_state(self) -> None:
        core = self.core
        applied = self.applied if self.state is State.PASSIVE else core.seq
        header: dict[str, Any] = {"state": self.state.value, "epoch": core.epoch, "applied": applied,
                                  "name": core.name, "streaming": self.streaming}
        if self.state is State.PASSIVE:
            if unheld := core.unheld():
                header["unheld"] = unheld
            if (room := core.spool_room()) is not None:
                header["room"] = room
        if self.handover_beats > 0:
            header["handover"] = True
            self.handover_beats -= 1
        self._send(Command.STATE, header)

    # ------------------------------------------------------------------ timers and flushing

    def stalled(self, gap: float) -> None:
        """The broker's own loop did not turn for ``gap`` seconds (a freeze, one long turn): it read
        nothing meanwhile, so that time is no silence of the peer's (PROTOCOL.md §9.1). Without
        the credit a broker woken from a freeze would count its peer gone before reading what the
        peer sent: active, it would then ACK and say GO alone, after the peer took over. Capped as
        for workers (§4.2): within one silence, at most its longest stall plus one expiry, so a
        broker whose every turn is slow still counts a peer that says nothing gone."""
        given, longest = self.stall_credit
        longest = max(longest, gap)
        credit = max(0.0, min(gap, longest + self.cfg.expiry - given))
        self.peer_heard = min(self.clock.monotonic(), self.peer_heard + credit)
        self.stall_credit = (given + credit, longest)

    def tick(self, now: float) -> None:
        core = self.core
        if core.fenced and self.state is State.ACTIVE:
            # A worker knows a later epoch than ours: that broker is active. The table decides.
            log.error("pair: a worker has seen epoch %d, later than ours (%d)", core.max_epoch_seen, core.epoch)
            self.peer_epoch = max(self.peer_epoch, core.max_epoch_seen)
            self.peer_active_epoch = max(self.peer_active_epoch, core.max_epoch_seen)
            self.event(Event.PEER_ACTIVE, now)
        if self.held:
            f = self.facts(now)
            if f.peer_expired or not f.peer_silent or f.witness:
                held, self.held = self.held, []
                for frames, tenant, _ in held:
                    if self.state is State.ACTIVE:
                        self.serve(frames, tenant)
                    elif f.peer_expired:
                        self.on_client(frames, tenant)  # the vote again: take over, or reject
                    else:
                        self.reject(frames)
        if self.state is State.ACTIVE and self.streaming and now - self.peer_heard > self.cfg.expiry:
            log.warning("pair: the passive peer is silent; results are acknowledged without it")
            self.streaming = False
        if now >= self.next_beat or self.state_due:
            self._send_state()
            self.state_due = False
            self.next_beat = now + self.cfg.heartbeat

    def flush(self) -> None:
        """Once per loop turn: send the journal as one UPDATES, and advance what is durable."""
        core = self.core
        updates = core.take_updates()
        if updates and self.streaming:
            first = core.seq - len(updates) + 1
            if not self._send(Command.UPDATES, {"seq": first, "count": len(updates)}, [protocol.packb(updates)]):
                log.warning("pair: the peer link is full; the passive peer will re-sync")
                self.streaming = False
        core.set_durable(self._durable())
        if self.state_due and self.state is State.PASSIVE:
            self._send_state()
            self.state_due = False

    def _durable(self) -> int:
        """The last update the passive peer holds (PROTOCOL.md §9.3, *Durable*). While the peer is
        heard but holds none of ours (not streaming: it has yet to SYNC, or re-syncs), nothing new
        is durable: it would take over knowing nothing of it. Only a peer gone (silent for the
        expiry) leaves this broker alone, every update durable once journalled."""
        core = self.core
        if self.streaming:
            self.unsynced_since = None
            return self.peer_applied
        now = self.clock.monotonic()
        if now - self.peer_heard > self.cfg.expiry:
            self.unsynced_since = None
            core.peer_spool_room(None)  # gone: what it held does not bound this broker's intake
            return core.seq
        if self.state is State.ACTIVE:
            self._warn_unsynced(now)
        return min(core.durable, core.seq)

    def _warn_unsynced(self, now: float) -> None:
        if self.unsynced_since is None:
            self.unsynced_since, self.unsynced_warn_at = now, now + UNSYNCED_WARN_EXPIRIES * self.cfg.expiry
        if now > self.unsynced_warn_at:
            self.unsynced_warn_at = now + UNSYNCED_WARN_EVERY_S
            log.warning("pair: the peer is heard (%s) but has held none of our updates for %.0f s: ACKs, GOs "
                        "and PUT replies wait for it (stop it to run alone)",
                        self.peer_state.name.lower() if self.peer_state else "silent", now - self.unsynced_since)

    def catching_up(self) -> bool:
        """Active, with a passive peer that streams and has yet to apply what was sent to it (under
        load it always lags by the last few milliseconds of updates)."""
        return self.state is State.ACTIVE and self.streaming and self.peer_applied < self.core.seq

    def failover(self) -> dict[str, Any]:
        """The operator's failover: hand the active role to the in-sync passive peer."""
        action = self.event(Event.FAILOVER, self.clock.monotonic())
        if action is not Action.HAND_OVER:
            raise ConflictError(f"cannot fail over from {self.state.name.lower()}: the active broker hands over, "
                                "and only to a passive peer that is connected and in sync")
        return {"state": self.state.value, "epoch": self.core.epoch}

    def handing_over(self, now: float) -> bool:
        """We handed the active role over (``failover``) and the peer, still heard, has not said
        yet that it took it: our STATEs still ask it to (for HANDOVER_BEATS heartbeats at most)."""
        return (self.handover_beats > 0 and self.peer_state is not State.ACTIVE
                and now - self.peer_heard <= self.cfg.expiry)

    def status(self, now: float) -> dict[str, Any]:
        return {
            "role": self.cfg.role, "state": self.state.value, "epoch": self.core.epoch,
            "peer": self.cfg.peer, "peer_state": self.peer_state.value if self.peer_state else None,
            "peer_silent_s": round(now - self.peer_heard, 3), "applied": self.applied if self.state is State.PASSIVE else self.core.seq,
            "peer_applied": self.peer_applied, "streaming": self.streaming, "synced": self.synced,
            "snapshots": self.snapshots,
            "settling": self.core.settling,
        }

    def close(self) -> None:
        self.inbound.close(0)
        self.outbound.close(0)


def routine_change(before: State, after: State) -> bool:
    """A state change of a normal start (logged at INFO): the primary leaving its start state,
    a backup becoming passive. A backup that takes over at start (no active peer) and any change
    between active and passive (a failover) are not."""
    return before is State.PRIMARY or (before is State.BACKUP and after is State.PASSIVE)


def next_epoch(seen: int, primary: bool) -> int:
    """The epoch of a takeover: above every epoch seen, even for the primary and odd for the
    backup, so that two brokers never hold the same epoch (workers then always tell which one is
    newer, even after a partition in which both took over)."""
    epoch = seen + 1
    if (epoch % 2 == 0) != primary:
        epoch += 1
    return epoch
