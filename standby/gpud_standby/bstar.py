"""The Binary Star state machine: which broker of a pair accepts work. Pure: no sockets, no clock.

The table is docs/PROTOCOL.md §9.1 (``tests/unit/test_bstar.py`` checks every (state, event) pair
against it). ``step`` takes the current state, one event and the facts the event is judged by, and
returns the next state and what the caller must do about the event. The caller owns the facts:
when the peer was last heard, whether a worker still hears an active broker, the epochs.

Three rules keep two brokers from both accepting work: the passive one takes over only when its
peer is silent *and* a client turns to it (Binary Star's vote), and not while a worker still hears
an active broker (the witness rule); and when two active brokers hear each other, the one with the
lower epoch (on a tie, the backup) steps down at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.Enum):
    PRIMARY = "primary"  # started as primary, waiting to hear from the peer
    BACKUP = "backup"  # started as backup, waiting to hear from the peer
    ACTIVE = "active"  # accepts work
    PASSIVE = "passive"  # holds a replica of the active one's tables; accepts no work


class Event(enum.Enum):
    PEER_PRIMARY = "peer_primary"
    PEER_BACKUP = "peer_backup"
    PEER_ACTIVE = "peer_active"
    PEER_PASSIVE = "peer_passive"
    CLIENT = "client"  # a REQUEST, CALL or PING reached this broker
    HANDOVER = "handover"  # the active peer stepped down for us (operator's failover)
    FAILOVER = "failover"  # the operator asks this broker to hand over to its peer


class Action(enum.Enum):
    NONE = "none"  # nothing beyond the state change
    ACCEPT = "accept"  # serve the client's message
    REJECT = "reject"  # answer NOT_ACTIVE (a PING: PONG); keep nothing
    HOLD = "hold"  # keep the client's message; judge it again on the peer's expiry or news
    TAKEOVER = "takeover"  # become active: new epoch, rebuild the ledger, settle, then serve
    STEP_DOWN = "step_down"  # stop accepting: answer what is held NOT_ACTIVE, resync as passive
    HAND_OVER = "hand_over"  # as STEP_DOWN, and ask the peer to take over (STATE handover)
    REFUSE = "refuse"  # the operator's failover cannot be done now
    SYNC = "sync"  # became passive: ask the active peer for a snapshot


PEER_EVENTS = {
    State.PRIMARY: Event.PEER_PRIMARY,
    State.BACKUP: Event.PEER_BACKUP,
    State.ACTIVE: Event.PEER_ACTIVE,
    State.PASSIVE: Event.PEER_PASSIVE,
}


@dataclass(frozen=True, slots=True)
class Facts:
    """What an event is judged by (the caller measures these)."""

    primary: bool  # this broker's role is primary (tie-breaks favour it)
    peer_expired: bool = False  # the peer has been silent for the expiry
    peer_silent: bool = False  # the peer missed at least one heartbeat (may be dying)
    witness: bool = False  # a connected worker heard another active broker within the expiry
    epoch: int = 0  # this broker's epoch
    peer_epoch: int = 0  # the epoch in the peer's last STATE
    peer_in_sync: bool = False  # (active) the passive peer applied everything sent to it


def _vote(f: Facts, held_ok: bool) -> Action:
    """A client turned to a broker that is not active: take over, hold, or reject."""
    if f.peer_expired and not f.witness:
        return Action.TAKEOVER
    if held_ok and f.peer_silent and not f.witness:
        return Action.HOLD
    return Action.REJECT


def step(state: State, event: Event, f: Facts) -> tuple[State, Action]:
    """The next state and the action for ``event`` in ``state`` (PROTOCOL.md §9.1)."""
    if state is State.PRIMARY or state is State.BACKUP:
        if event is Event.PEER_ACTIVE:
            return State.PASSIVE, Action.SYNC
        if event is Event.PEER_BACKUP and state is State.PRIMARY:
            return State.ACTIVE, Action.TAKEOVER
        if event is Event.CLIENT:
            action = _vote(f, held_ok=False)
            return (State.ACTIVE, action) if action is Action.TAKEOVER else (state, action)
        if event is Event.FAILOVER:
            return state, Action.REFUSE
        return state, Action.NONE
    if state is State.ACTIVE:
        if event is Event.CLIENT:
            return state, Action.ACCEPT
        if event is Event.PEER_ACTIVE:
            lower = f.epoch < f.peer_epoch or (f.epoch == f.peer_epoch and not f.primary)
            return (State.PASSIVE, Action.STEP_DOWN) if lower else (state, Action.NONE)
        if event is Event.FAILOVER:
            if f.peer_in_sync and not f.peer_expired:
                return State.PASSIVE, Action.HAND_OVER
            return state, Action.REFUSE
        return state, Action.NONE
    # PASSIVE
    if event is Event.PEER_PRIMARY or event is Event.PEER_BACKUP or event is Event.HANDOVER:
        return State.ACTIVE, Action.TAKEOVER
    if event is Event.PEER_PASSIVE:
        return (State.ACTIVE, Action.TAKEOVER) if f.primary else (state, Action.NONE)
    if event is Event.CLIENT:
        action = _vote(f, held_ok=True)
        return (State.ACTIVE, action) if action is Action.TAKEOVER else (state, action)
    if event is Event.FAILOVER:
        return state, Action.REFUSE
    return state, Action.NONE
