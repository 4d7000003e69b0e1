"""The Binary Star table: every (state, event) pair, under every fact that can change its outcome."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from gpud_standby.bstar import Action, Event, Facts, State, step

DOC = Path(__file__).parents[2] / "docs" / "PROTOCOL.md"
# What step() answered for every (state, event) under every combination of facts, recorded by
# running the nested-if step() that the table replaced (at 8515ff1): the table must not change it.
ORACLE = json.loads(Path(__file__).with_name("bstar_oracle.json").read_text())
S, E, A = State, Event, Action

# (state, event) -> function of the facts giving the expected (state, action): the table of
# PROTOCOL.md §9.1 written out once more, independently of the code.
def _vote(state: State, hold: bool):  # noqa: ANN202
    def judge(f: Facts) -> tuple[State, Action]:
        if f.peer_expired and not f.witness:
            return S.ACTIVE, A.TAKEOVER
        if hold and f.peer_silent and not f.witness:
            return state, A.HOLD
        return state, A.REJECT
    return judge


def _const(state: State, action: Action):  # noqa: ANN202
    return lambda f: (state, action)


EXPECTED = {
    (S.PRIMARY, E.PEER_PRIMARY): _const(S.PRIMARY, A.NONE),
    (S.PRIMARY, E.PEER_BACKUP): _const(S.ACTIVE, A.TAKEOVER),
    (S.PRIMARY, E.PEER_ACTIVE): _const(S.PASSIVE, A.SYNC),
    (S.PRIMARY, E.PEER_PASSIVE): _const(S.PRIMARY, A.NONE),
    (S.PRIMARY, E.CLIENT): _vote(S.PRIMARY, hold=False),
    (S.PRIMARY, E.HANDOVER): _const(S.PRIMARY, A.NONE),
    (S.PRIMARY, E.FAILOVER): _const(S.PRIMARY, A.REFUSE),
    (S.BACKUP, E.PEER_PRIMARY): _const(S.BACKUP, A.NONE),
    (S.BACKUP, E.PEER_BACKUP): _const(S.BACKUP, A.NONE),
    (S.BACKUP, E.PEER_ACTIVE): _const(S.PASSIVE, A.SYNC),
    (S.BACKUP, E.PEER_PASSIVE): _const(S.BACKUP, A.NONE),
    (S.BACKUP, E.CLIENT): _vote(S.BACKUP, hold=False),
    (S.BACKUP, E.HANDOVER): _const(S.BACKUP, A.NONE),
    (S.BACKUP, E.FAILOVER): _const(S.BACKUP, A.REFUSE),
    (S.ACTIVE, E.PEER_PRIMARY): _const(S.ACTIVE, A.NONE),
    (S.ACTIVE, E.PEER_BACKUP): _const(S.ACTIVE, A.NONE),
    (S.ACTIVE, E.PEER_ACTIVE): lambda f: (
        (S.PASSIVE, A.STEP_DOWN)
        if f.epoch < f.peer_epoch or (f.epoch == f.peer_epoch and not f.primary)
        else (S.ACTIVE, A.NONE)
    ),
    (S.ACTIVE, E.PEER_PASSIVE): _const(S.ACTIVE, A.NONE),
    (S.ACTIVE, E.CLIENT): _const(S.ACTIVE, A.ACCEPT),
    (S.ACTIVE, E.HANDOVER): _const(S.ACTIVE, A.NONE),
    (S.ACTIVE, E.FAILOVER): lambda f: (
        (S.PASSIVE, A.HAND_OVER) if f.peer_in_sync and not f.peer_expired else (S.ACTIVE, A.REFUSE)
    ),
    (S.PASSIVE, E.PEER_PRIMARY): _const(S.ACTIVE, A.TAKEOVER),
    (S.PASSIVE, E.PEER_BACKUP): _const(S.ACTIVE, A.TAKEOVER),
    (S.PASSIVE, E.PEER_ACTIVE): _const(S.PASSIVE, A.NONE),
    (S.PASSIVE, E.PEER_PASSIVE): lambda f: (S.ACTIVE, A.TAKEOVER) if f.primary else (S.PASSIVE, A.NONE),
    (S.PASSIVE, E.CLIENT): _vote(S.PASSIVE, hold=True),
    (S.PASSIVE, E.HANDOVER): _const(S.ACTIVE, A.TAKEOVER),
    (S.PASSIVE, E.FAILOVER): _const(S.PASSIVE, A.REFUSE),
}

ALL_FACTS = [
    Facts(primary=p, peer_expired=x, peer_silent=s or x, witness=w, epoch=e, peer_epoch=pe, peer_in_sync=y)
    for p, x, s, w, (e, pe), y in itertools.product(
        (True, False), (True, False), (True, False), (True, False), ((1, 1), (1, 2), (3, 2)), (True, False)
    )
]


def test_the_table_covers_every_state_and_event() -> None:
    assert set(EXPECTED) == set(itertools.product(State, Event))


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)), ids=lambda v: v.name)
def test_every_pair_under_every_fact(state: State, event: Event) -> None:
    for f in ALL_FACTS:
        assert step(state, event, f) == EXPECTED[(state, event)](f), f


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)), ids=lambda v: v.name)
def test_step_answers_as_the_recorded_nested_ifs(state: State, event: Event) -> None:
    recorded = ORACLE["outcomes"][f"{state.name} {event.name}"]
    facts = [Facts(**dict(zip(ORACLE["fields"], row, strict=True))) for row in ORACLE["facts"]]
    if isinstance(recorded, str):  # the same outcome under every fact
        recorded = [recorded] * len(facts)
    assert len(recorded) == len(facts) == 96
    for f, outcome in zip(facts, recorded, strict=True):
        next_state, action = step(state, event, f)
        assert f"{next_state.name} {action.name}" == outcome, f


def test_the_spec_table_names_every_state_and_event() -> None:
    lines = DOC.read_text().splitlines()
    at = lines.index("<!-- spec-sync: bstar -->") + 1
    head = [c.strip() for c in lines[at].strip("|").split("|")]
    assert head[0] == "state"
    columns = [re.sub(r" \(.*\)", "", c) for c in head[1:]]
    assert columns == [e.name if e is not Event.CLIENT else "CLIENT" for e in Event]
    rows = [ln.strip("|").split("|")[0].strip() for ln in lines[at + 2 : at + 2 + len(State)]]
    assert rows == [s.name for s in State]


def test_never_two_actives_after_any_one_event() -> None:
    """Whatever one broker does on one event, two brokers that heard each other do not both stay
    active: an active broker hearing an active peer steps down exactly when the peer does not."""
    for f in ALL_FACTS:
        mine = step(S.ACTIVE, E.PEER_ACTIVE, f)[0]
        peer_facts = Facts(primary=not f.primary, epoch=f.peer_epoch, peer_epoch=f.epoch)
        theirs = step(S.ACTIVE, E.PEER_ACTIVE, peer_facts)[0]
        assert (mine, theirs).count(S.ACTIVE) == 1, f


def test_a_live_peer_or_a_witness_keeps_the_passive_passive() -> None:
    for f in ALL_FACTS:
        if not f.peer_expired or f.witness:
            assert step(S.PASSIVE, E.CLIENT, f)[0] is S.PASSIVE


def test_takeover_epochs_are_unique_to_each_role_and_grow() -> None:
    from gpud_standby.pair import next_epoch

    for seen in range(0, 20):
        p, b = next_epoch(seen, True), next_epoch(seen, False)
        assert p > seen and b > seen and p != b
        assert p % 2 == 0 and b % 2 == 1
        assert min(p, b) == seen + 1  # nothing is skipped needlessly
