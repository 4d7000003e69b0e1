"""An active broker whose peer is heard but holds none of its updates yet (PROTOCOL.md §9.3,
*Durable*): the peer has just started and not yet sent SYNC, or its snapshot is on its way. That
peer is the one that takes over if the active broker dies now, knowing nothing of what was said
meanwhile. A GO said then lets a job begin that the peer would place again as new on the client's
retry; an ACK said then makes the worker forget a RESULT neither broker would hold after the
failover. So nothing becomes durable until the peer holds the snapshot, or it is gone (silent past
the expiry): only then does the active broker stand alone.

Two real ``Pair`` shells over inproc sockets, each around a BrokerCore, on one FakeClock (the Side
harness of test_pair_clock): the test is the brokers' loop.
"""

from __future__ import annotations

import logging

import pytest

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.protocol import Command, Peer
from gpud_standby.bstar import State
from tests.unit import test_pair_clock
from tests.unit.test_broker_core import C1, W1, rid
from tests.unit.test_pair_clock import EXPIRY, HEARTBEAT, Side, settle, start

JOB = {"kind": "job", "argv": ["/bin/sh", "-c", "date >> ran"], "need": {"gpu_milli": 100}}
BEGUN, DONE = rid(1), rid(2)  # a job that asks START; one that finishes

clock, pair = test_pair_clock.clock, test_pair_clock.pair  # the fixtures: a FakeClock, and a and b around it


def said(s: Side) -> tuple[dict[bytes, list[bytes]], dict[bytes, list[bytes]]]:
    """What the broker's loop would send its workers now: (ACKed ids, ids told GO), by worker."""
    acks = s.h.core.take_acks()
    return acks, {ident: P.unpackb(msg[2])["ids"] for ident, msg in s.h.core.take_go().items()}


def a_takes_over_before_b_syncs(a: Side, b: Side) -> None:
    """b's first STATE (``backup``) reaches a, which takes over; nothing of a's has reached b yet.
    Then w1 joins a, runs DONE to its RESULT and asks START for BEGUN."""
    b.tick()
    assert a.pair.inbound.poll(20)
    a.deliver()
    assert a.state is State.ACTIVE and not a.pair.streaming
    a.h.ready(W1, "w1")
    a.tick()  # settling ends: no worker was connected at the takeover
    for r in (DONE, BEGUN):
        a.h.request(C1, r, **JOB)
    assert {m.header["id"] for _, m, _ in a.h.take_worker() if m.command is Command.DISPATCH} == {DONE, BEGUN}
    a.h.worker(W1, Command.START, {"ids": [DONE]})
    a.h.result(W1, DONE, exit_code=0)
    a.h.worker(W1, Command.START, {"ids": [BEGUN]})


def test_a_new_active_broker_says_go_and_acks_only_once_its_heard_peer_holds_the_snapshot(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    a_takes_over_before_b_syncs(a, b)
    for _ in range(3):  # turns go by within the expiry, b heard: nothing is durable yet
        a.tick()
        assert said(a) == ({}, {})
        clock.advance(0.1)
    settle(a, b)  # b hears a active, moves to PASSIVE, SYNCs, loads the snapshot and says so
    assert b.state is State.PASSIVE and b.pair.synced
    held = b.h.core.tasks.tasks
    assert held[BEGUN].started and held[DONE].reply is not None  # what a says next, b holds
    acks, go = said(a)
    assert acks == {W1: [DONE]} and go == {W1: [BEGUN]}


def test_an_active_broker_stands_alone_once_its_unsynced_peer_is_gone(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    a_takes_over_before_b_syncs(a, b)
    clock.advance(EXPIRY)  # b silent for the expiry exactly: not yet gone
    a.tick()
    assert said(a) == ({}, {})
    clock.advance(0.01)  # now gone: a stands alone, and what it journalled is durable at once
    a.tick()
    acks, go = said(a)
    assert acks == {W1: [DONE]} and go == {W1: [BEGUN]}


def test_a_peer_heard_again_after_it_was_gone_holds_what_comes_next(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    """Alone, a's updates were durable at once; once b speaks again (it restarted, say) nothing
    new is durable until b holds a's snapshot, and what was durable stays so."""
    a, b = pair
    a_takes_over_before_b_syncs(a, b)
    clock.advance(EXPIRY + 0.01)
    a.tick()
    assert said(a) != ({}, {})
    a.h.request(C1, rid(3), **JOB)
    assert [m.header["id"] for _, m, _ in a.h.take_worker() if m.command is Command.DISPATCH] == [rid(3)]
    b.tick()  # b is heard again
    assert a.pair.inbound.poll(20)
    a.deliver()
    durable = a.h.core.journal.durable
    a.h.worker(W1, Command.START, {"ids": [rid(3)]})
    a.tick()
    assert said(a) == ({}, {}) and a.h.core.journal.durable == durable
    settle(a, b)
    assert b.h.core.tasks.tasks[rid(3)].started
    assert said(a) == ({}, {W1: [rid(3)]})


def test_a_handover_holds_the_new_active_brokers_gos_only_for_one_snapshot(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    """The old active broker, now passive, sends SYNC as soon as it hears its peer active: it
    does not wait out the expiry between SYNCs. Without it the new active broker's GOs and ACKs
    would wait that long after every operator's failover."""
    a, b = pair
    start(a, b)
    for s in (a, b):
        s.h.ready(W1, "w1")
    assert a.pair.failover()["state"] == "passive"
    settle(a, b)  # no time passes
    assert (a.state, b.state) == (State.PASSIVE, State.ACTIVE)
    assert a.pair.synced and b.pair.streaming
    assert b.pair.peer_applied == b.h.core.seq


def test_an_active_broker_says_why_nothing_is_durable_when_its_heard_peer_never_syncs(
        pair: tuple[Side, Side], clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    """A peer that keeps speaking but never takes a snapshot (one direction of the peer link is
    cut, say) holds every GO and ACK: the operator is told why, once, then at most once a minute."""
    a, b = pair
    a_takes_over_before_b_syncs(a, b)
    with caplog.at_level(logging.WARNING, logger="gpud_standby.pair"):
        for _ in range(int(12 * EXPIRY / HEARTBEAT)):
            clock.advance(HEARTBEAT)
            a.pair.on_peer([b"b", *P.encode(Peer.BROKER, Command.STATE, {"state": "passive", "epoch": 0,
                                                                        "applied": 0, "name": "b"})])
            a.tick()
            assert said(a) == ({}, {})
    warned = [r.getMessage() for r in caplog.records if "held none of our updates" in r.getMessage()]
    assert len(warned) == 1, warned
