"""An active broker that hangs (SIGSTOP, a freeze) while its peer takes over, then wakes up with its
old epoch, its old tables and a socket full of STARTs and RESULTs its workers sent meanwhile
(PROTOCOL.md §4.4, §9.1, §9.4). Its own freeze is no silence of its peer: until the peer is heard
again (and it steps down) or has been silent past the expiry on a clock that excludes the freeze,
it must not count the peer gone. Counting it gone lets every START mark and RESULT look durable at
once: a GO that the new active broker never hears of (so it places the job again, or a worker's
loss there does) and an ACK that makes the worker forget a result the new broker lacks (so its
settling dispatches the job again to a worker that no longer knows it). Either way the job runs
twice.

Two real ``Pair`` shells over inproc sockets, each around a BrokerCore, on one FakeClock (the Side
harness of test_pair_clock): the test is the brokers' loop, the hung one's included.
"""

from __future__ import annotations

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.protocol import Command, Peer
from gpud_standby.bstar import State
from tests.unit import test_pair_clock
from tests.unit.test_broker_core import C1, W1, rid
from tests.unit.test_pair_clock import EXPIRY, Side, settle, start

JOB = {"kind": "job", "argv": ["/bin/sh", "-c", "date >> ran"], "need": {"gpu_milli": 100}}
DONE, WAITS = rid(1), rid(2)  # a job told GO before the freeze and finished during it; one asked during it
FREEZE = 5.0  # seconds the active broker's loop stood still

clock, pair = test_pair_clock.clock, test_pair_clock.pair  # the fixtures: a FakeClock, and a and b around it


def gos_and_acks(s: Side) -> tuple[dict[bytes, list[bytes]], dict[bytes, list[bytes]]]:
    """What the broker's loop would send its workers now: (ACKed ids, ids told GO), by worker."""
    acks = s.h.core.take_acks()
    return acks, {ident: P.unpackb(msg[2])["ids"] for ident, msg in s.h.core.take_go().items()}


def frozen_mid_load(a: Side, b: Side, clock: FakeClock) -> None:
    """a active, b passive in sync, both knowing w1; w1 runs DONE (told GO, durably) and WAITS
    (dispatched). Then a's loop stands still for FREEZE seconds: b alone takes over on a client's
    vote, and w1's RESULT of DONE and its START of WAITS wait in a's sockets."""
    start(a, b)
    for s in (a, b):
        s.h.ready(W1, "w1")
    a.h.request(C1, DONE, **JOB)
    a.h.request(C1, WAITS, **JOB)
    assert [m.header["id"] for _, m, _ in a.h.take_worker() if m.command is Command.DISPATCH] == [DONE, WAITS]
    a.h.worker(W1, Command.START, {"ids": [DONE]})
    settle(a, b)  # the mark is held by the peer: the GO goes out
    assert list(a.h.core.take_go()) == [W1]
    assert b.h.core.tasks.tasks[DONE].started and not b.h.core.tasks.tasks[WAITS].started
    clock.advance(EXPIRY + 0.05)  # a is frozen from here: it neither reads nor ticks
    b.tick()
    b.client(rid(9))  # a client turns to b: the vote takes over (no worker heard a meanwhile)
    assert b.state is State.ACTIVE and b.h.core.epoch > a.h.core.epoch
    clock.advance(FREEZE - EXPIRY - 0.05)


def wake(a: Side) -> None:
    """a's first loop turn after the freeze, as the shell runs it: the stall is noticed, then what
    w1 sent meanwhile is read (before anything of the peer's: worker messages are read first),
    then the pair flushes and ticks."""
    now = a.clock.monotonic()
    a.pair.stalled(now - a.h.core.now)
    a.h.core.workers.stalled(now - a.h.core.now, now)
    a.h.result(W1, DONE, exit_code=0)
    a.h.worker(W1, Command.START, {"ids": [WAITS]})
    a.tick()


def test_a_woken_active_broker_neither_acks_nor_says_go_before_hearing_its_peer(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    frozen_mid_load(a, b, clock)
    wake(a)
    assert a.pair.streaming  # the freeze was a's own: its peer is not known to be gone
    assert gos_and_acks(a) == ({}, {})
    for _ in range(3):  # turns go by (less than an expiry): still nothing of a's is durable
        clock.advance(0.1)
        a.tick()
        assert gos_and_acks(a) == ({}, {})
    b.tick()  # the new active broker's STATE (its epoch is above a's): a steps down
    assert a.pair.inbound.poll(20)
    a.deliver()
    assert a.state is State.PASSIVE
    a.tick()
    assert gos_and_acks(a) == ({}, {})


def test_a_woken_active_broker_whose_peer_stays_silent_counts_it_gone_one_expiry_later(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    """The credit is the freeze's, not more: a peer that is really gone (b never speaks again)
    counts as gone once it has been silent for the expiry after the freeze, and a's results and
    GOs are then acknowledged without it, as for any lost peer."""
    a, b = pair
    frozen_mid_load(a, b, clock)
    wake(a)
    assert gos_and_acks(a) == ({}, {})
    clock.advance(EXPIRY + 0.01)
    a.tick()
    a.tick()  # the first turn stops streaming; the next one's flush takes every update as durable
    assert not a.pair.streaming
    acks, go = gos_and_acks(a)
    assert acks == {W1: [DONE]} and go == {W1: [WAITS]}


def test_a_broker_whose_every_turn_is_slow_still_counts_a_silent_peer_gone(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    """Credit is capped per silence of the peer (as for workers, PROTOCOL.md §4.2): at most the
    longest stall plus one expiry. Turns of 0.3 s each, all stalls, still expire a silent peer."""
    a, b = pair
    start(a, b)
    silent_for = 0.0
    while a.pair.streaming:
        clock.advance(0.3)
        silent_for += 0.3
        a.pair.stalled(0.3)
        a.tick()
        assert silent_for < 0.3 + 2 * EXPIRY + 0.31, "a silent peer was never counted gone"
    assert silent_for > EXPIRY


def test_a_stale_passive_state_read_after_the_new_epoch_is_no_reason_to_take_over(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    """The peer's STATEs sent while it was still passive can wait on an older connection of its
    and come after its news as the active broker (the woken one reads both at once). As PRIMARY,
    passive beside a passive peer, the woken broker would take over: two active brokers, the new
    one with empty tables. A passive STATE below an epoch the peer has been active at is stale."""
    a, b = pair
    frozen_mid_load(a, b, clock)
    stale = P.encode(Peer.BROKER, Command.STATE, {"state": "passive", "epoch": 1, "applied": 3, "name": "backup",
                                                  "streaming": False})
    wake(a)
    b.tick()
    assert a.pair.inbound.poll(20)
    a.deliver()  # b's STATE as the active broker: a steps down
    assert a.state is State.PASSIVE
    a.pair.on_peer([b"an-older-connection", *stale])
    assert a.state is State.PASSIVE and not a.serving
    a.tick()
    assert a.state is State.PASSIVE and a.h.core.epoch < b.h.core.epoch
