"""The Binary Star table: every (state, event) pair, under every fact that can change its outcome,
answers as the nested ifs it replaced did, and the rules that keep two brokers from both being active
hold. (That the table and PROTOCOL.md §9.1 agree, cell by cell and under every fact, is
test_spec_sync.py's.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from gpud_standby.bstar import TRANSITIONS, Action, Event, Facts, State, step

# What step() answered for every (state, event) under every combination of facts, recorded by
# running the nested-if step() that the table replaced (at 8515ff1): the table answers the same,
# but where CHANGED says.
ORACLE = json.loads(Path(__file__).with_name("bstar_oracle.json").read_text())
S, E, A = State, Event, Action

ALL_FACTS = [Facts(**dict(zip(ORACLE["fields"], row, strict=True))) for row in ORACLE["facts"]]
# Where the table answers otherwise on purpose: PROTOCOL.md §9.1 said two brokers of one role log
# an error, and the nested ifs did nothing.
CHANGED = {(S.PRIMARY, E.PEER_PRIMARY): "PRIMARY ERROR", (S.BACKUP, E.PEER_BACKUP): "BACKUP ERROR"}


def test_the_table_has_a_row_for_every_state_and_event_each_ending_in_its_default() -> None:
    assert set(TRANSITIONS) == set(itertools.product(State, Event))
    for pair, outcomes in TRANSITIONS.items():
        *guarded, default = outcomes
        assert not default.when and not default.unless, f"{pair}: the last outcome must apply always"
        assert all(t.when or t.unless for t in guarded), f"{pair}: an outcome before the last never lets it apply"


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)), ids=lambda v: v.name)
def test_step_answers_as_the_recorded_nested_ifs(state: State, event: Event) -> None:
    recorded = CHANGED.get((state, event), ORACLE["outcomes"][f"{state.name} {event.name}"])
    if isinstance(recorded, str):  # the same outcome under every fact
        recorded = [recorded] * len(ALL_FACTS)
    assert len(recorded) == len(ALL_FACTS) == 96
    for f, outcome in zip(ALL_FACTS, recorded, strict=True):
        next_state, action = step(state, event, f)
        assert f"{next_state.name} {action.name}" == outcome, f


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
