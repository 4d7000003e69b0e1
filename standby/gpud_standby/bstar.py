"""The Binary Star state machine: which broker of a pair accepts work. Pure: no sockets, no clock.

``TRANSITIONS`` is the table, one row for every (state, event) pair; docs/PROTOCOL.md §9.1 is its
normative copy (``tests/unit/test_spec_sync.py`` checks both ways, ``tests/unit/test_bstar.py``
every pair under every fact). ``step`` takes the current state, one event and the facts the event
is judged by, and returns the next state and what the caller must do about the event. The caller
owns the facts: when the peer was last heard, whether a worker still hears an active broker, the
epochs.

Three rules keep two brokers from both accepting work: the passive one takes over only when its
peer is silent *and* a client turns to it (Binary Star's vote), and not while a worker still hears
an active broker (the witness rule); and when two active brokers hear each other, the one with the
lower epoch (on a tie, the backup) steps down at once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
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
    ERROR = "error"  # both brokers were started with the same role: log it; nothing else


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


class Condition(enum.Enum):
    """What an outcome of an event may depend on (PROTOCOL.md §9.1), each a test of the facts."""

    EXPIRED = "expired"  # the peer has been silent for the expiry
    SILENT = "silent"  # the peer missed at least one heartbeat
    WITNESS = "witness"  # a worker still hears another active broker
    PRIMARY = "primary"  # this broker's role is primary
    LOWER = "lower"  # this broker's epoch is below the peer's (on a tie: this one is the backup)
    IN_SYNC = "in_sync"  # (active) the passive peer applied everything sent to it


HOLDS: dict[Condition, Callable[[Facts], bool]] = {
    Condition.EXPIRED: lambda f: f.peer_expired,
    Condition.SILENT: lambda f: f.peer_silent,
    Condition.WITNESS: lambda f: f.witness,
    Condition.PRIMARY: lambda f: f.primary,
    Condition.LOWER: lambda f: f.epoch < f.peer_epoch or (f.epoch == f.peer_epoch and not f.primary),
    Condition.IN_SYNC: lambda f: f.peer_in_sync,
}


@dataclass(frozen=True, slots=True)
class Transition:
    """One outcome of an event: the next state and the action, taken when every condition of
    ``when`` holds and none of ``unless`` does."""

    next: State
    action: Action = Action.NONE
    when: tuple[Condition, ...] = ()
    unless: tuple[Condition, ...] = ()

    def applies(self, f: Facts) -> bool:
        return all(HOLDS[c](f) for c in self.when) and not any(HOLDS[c](f) for c in self.unless)


def _vote(state: State, hold: bool) -> tuple[Transition, ...]:
    """A client turned to a broker that is not active: take over, (passive only) hold, or reject."""
    take = Transition(State.ACTIVE, Action.TAKEOVER, when=(Condition.EXPIRED,), unless=(Condition.WITNESS,))
    held = (Transition(state, Action.HOLD, when=(Condition.SILENT,), unless=(Condition.WITNESS,)),) if hold else ()
    return (take, *held, Transition(state, Action.REJECT))


def _always(state: State, action: Action = Action.NONE) -> tuple[Transition, ...]:
    """A row of one outcome, whatever the facts."""
    return (Transition(state, action),)


# (state, event) -> its outcomes, the first that applies taken; the last applies always (the row's
# default). Every pair has a row. This is PROTOCOL.md §9.1's table, cell by cell.
TRANSITIONS: dict[tuple[State, Event], tuple[Transition, ...]] = {
    (State.PRIMARY, Event.PEER_PRIMARY): _always(State.PRIMARY, Action.ERROR),  # both started as primary
    (State.PRIMARY, Event.PEER_BACKUP): _always(State.ACTIVE, Action.TAKEOVER),
    (State.PRIMARY, Event.PEER_ACTIVE): _always(State.PASSIVE, Action.SYNC),
    (State.PRIMARY, Event.PEER_PASSIVE): _always(State.PRIMARY),
    (State.PRIMARY, Event.CLIENT): _vote(State.PRIMARY, hold=False),
    (State.PRIMARY, Event.HANDOVER): _always(State.PRIMARY),
    (State.PRIMARY, Event.FAILOVER): _always(State.PRIMARY, Action.REFUSE),

    (State.BACKUP, Event.PEER_PRIMARY): _always(State.BACKUP),
    (State.BACKUP, Event.PEER_BACKUP): _always(State.BACKUP, Action.ERROR),  # both started as backup
    (State.BACKUP, Event.PEER_ACTIVE): _always(State.PASSIVE, Action.SYNC),
    (State.BACKUP, Event.PEER_PASSIVE): _always(State.BACKUP),
    (State.BACKUP, Event.CLIENT): _vote(State.BACKUP, hold=False),
    (State.BACKUP, Event.HANDOVER): _always(State.BACKUP),
    (State.BACKUP, Event.FAILOVER): _always(State.BACKUP, Action.REFUSE),

    (State.ACTIVE, Event.PEER_PRIMARY): _always(State.ACTIVE),
    (State.ACTIVE, Event.PEER_BACKUP): _always(State.ACTIVE),
    (State.ACTIVE, Event.PEER_ACTIVE): (
        Transition(State.PASSIVE, Action.STEP_DOWN, when=(Condition.LOWER,)),
        Transition(State.ACTIVE),
    ),
    (State.ACTIVE, Event.PEER_PASSIVE): _always(State.ACTIVE),
    (State.ACTIVE, Event.CLIENT): _always(State.ACTIVE, Action.ACCEPT),
    (State.ACTIVE, Event.HANDOVER): _always(State.ACTIVE),
    (State.ACTIVE, Event.FAILOVER): (
        Transition(State.PASSIVE, Action.HAND_OVER, when=(Condition.IN_SYNC,), unless=(Condition.EXPIRED,)),
        Transition(State.ACTIVE, Action.REFUSE),
    ),

    (State.PASSIVE, Event.PEER_PRIMARY): _always(State.ACTIVE, Action.TAKEOVER),
    (State.PASSIVE, Event.PEER_BACKUP): _always(State.ACTIVE, Action.TAKEOVER),
    (State.PASSIVE, Event.PEER_ACTIVE): _always(State.PASSIVE),
    (State.PASSIVE, Event.PEER_PASSIVE): (
        Transition(State.ACTIVE, Action.TAKEOVER, when=(Condition.PRIMARY,)),
        Transition(State.PASSIVE),
    ),
    (State.PASSIVE, Event.CLIENT): _vote(State.PASSIVE, hold=True),
    (State.PASSIVE, Event.HANDOVER): _always(State.ACTIVE, Action.TAKEOVER),
    (State.PASSIVE, Event.FAILOVER): _always(State.PASSIVE, Action.REFUSE),
}


def step(state: State, event: Event, f: Facts) -> tuple[State, Action]:
    """The next state and the action for ``event`` in ``state`` (PROTOCOL.md §9.1)."""
    *guarded, default = TRANSITIONS[(state, event)]
    t = next((t for t in guarded if t.applies(f)), default)
    return t.next, t.action
