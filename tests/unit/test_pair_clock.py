"""The pair shell's timing on a FakeClock: when the peer counts as silent and as expired, when a held
client message is judged again, when a heartbeat falls due, when the operator's failover is refused.

Two real ``Pair`` shells talk over real inproc sockets, each around a BrokerCore (the Harness of
test_broker_core); every time they read comes from one FakeClock, which only the test moves. The
broker's loop is this test: it delivers what each pair's inbound socket holds and calls ``tick``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.errors import ConflictError
from gpud.protocol import Command, Peer
from gpud_standby.bstar import State
from gpud_standby.pair import Pair, PairConfig
from tests.unit.test_broker_core import C1, Harness, rid

HEARTBEAT, EXPIRY = 0.25, 0.75  # silent after 1.5 heartbeats (0.375 s), expired after 0.75 s


class Side:
    """One broker of the pair: its core, its Pair, and what the Pair handed the broker."""

    def __init__(self, ctx: zmq.Context[Any], clock: FakeClock, role: str, bind: str, peer: str,
                 **config: Any) -> None:
        self.clock = clock
        self.h = Harness(name=role, **config)
        self.h.clock = clock
        self.served: list[list[Any]] = []  # client messages the pair let the broker serve
        self.to_client: list[list[Any]] = []  # what the pair itself answered (a non-active broker)
        self.serving = False
        self.heard: list[tuple[Command, dict[str, Any]]] = []  # every peer message delivered, with its header
        self.updates: list[list[Any]] = []  # every update of the UPDATES delivered
        self.pair = Pair(self.h.core, PairConfig(role=role, peer=peer, bind=bind, heartbeat=HEARTBEAT, expiry=EXPIRY),
                         ctx, None, serve=self._serve, set_serving=self._set_serving,
                         send_client=self.to_client.append, clock=clock)

    def _serve(self, frames: list[Any], tenant: str | None) -> None:
        self.served.append(frames)
        self.h.core.now = self.clock.monotonic()
        self.h.core.on_client(frames[0], P.decode(frames[1:], Peer.CLIENT), tenant)

    def _set_serving(self, on: bool) -> None:
        self.serving = on

    def client(self, r: bytes) -> None:
        """A client's REQUEST reaching this broker's frontend."""
        frames = [C1, *P.encode(Peer.CLIENT, Command.REQUEST, {"id": r, "kind": "echo"})]
        if self.serving:
            self._serve(frames, None)
        else:
            self.pair.on_client(frames)

    def deliver(self) -> list[Command]:
        """Hand every message waiting on the peer socket to the pair; their commands, in order."""
        got = []
        while self.pair.inbound.poll(0):
            frames = self.pair.inbound.recv_multipart()
            got.append(Command(frames[2][0]))
            self.heard.append((got[-1], P.unpackb(frames[3])))
            if got[-1] is Command.UPDATES:
                self.updates += P.unpackb(frames[4])
            self.h.core.now = self.clock.monotonic()
            self.pair.on_peer(frames)
        return got

    def tick(self) -> None:
        self.pair.tick(self.clock.monotonic())
        self.pair.flush()

    @property
    def state(self) -> State:
        return self.pair.state

    def not_active_replies(self) -> int:
        return sum(1 for f in self.to_client if P.unpackb(f[3]).get("code") == "NOT_ACTIVE")


def settle(*sides: Side, rounds: int = 20) -> None:
    """Tick, flush and deliver without moving the clock until nothing more is said."""
    for _ in range(rounds):
        for s in sides:
            s.tick()
        # inproc delivers at once; the short poll only lets each socket take in its peer's pipe
        if not any(s.pair.inbound.poll(20) for s in sides):
            return
        for s in sides:
            s.deliver()
    raise AssertionError("the pair kept talking")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def pair(ctx: zmq.Context[Any], clock: FakeClock) -> Iterator[tuple[Side, Side]]:
    a = Side(ctx, clock, "primary", "inproc://pair-a", "inproc://pair-b")
    b = Side(ctx, clock, "backup", "inproc://pair-b", "inproc://pair-a")
    yield a, b
    a.pair.close()
    b.pair.close()


def start(a: Side, b: Side) -> None:
    settle(a, b)
    assert (a.state, b.state) == (State.ACTIVE, State.PASSIVE)
    assert b.pair.synced and a.pair.streaming


def test_a_backup_alone_takes_over_only_once_its_peer_has_expired_on_the_pairs_clock(
        ctx: zmq.Context[Any], clock: FakeClock) -> None:
    b = Side(ctx, clock, "backup", "inproc://lone-b", "inproc://nobody")
    try:
        clock.advance(EXPIRY - 0.01)  # silent, not expired: a BACKUP holds nothing, it rejects
        b.client(rid(1))
        assert b.state is State.BACKUP and b.served == [] and b.not_active_replies() == 1
        assert b.pair.status(clock.monotonic())["peer_silent_s"] == pytest.approx(EXPIRY - 0.01)
        clock.advance(0.02)  # now the peer has expired: the vote takes over and serves the client
        b.client(rid(2))
        assert b.state is State.ACTIVE and b.serving
        assert [P.unpackb(f[3])["id"] for f in b.served] == [rid(2)]
        assert b.h.core.epoch == 3  # the first odd epoch above the one it started with (1)
    finally:
        b.pair.close()


def test_heartbeats_fall_due_every_heartbeat_on_the_clock(pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    start(a, b)
    for step, expected in ((0.1, []), (HEARTBEAT - 0.1, [Command.STATE]), (0.1, []), (HEARTBEAT - 0.1, [Command.STATE])):
        clock.advance(step)
        a.tick()
        assert bool(b.pair.inbound.poll(20 if expected else 0)) == bool(expected)
        assert b.deliver() == expected, step
    assert b.pair.status(clock.monotonic())["peer_silent_s"] == 0.0


def test_a_silent_peer_holds_then_an_expired_one_hands_the_held_request_to_the_takeover(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    start(a, b)
    a_epoch = a.h.core.epoch
    # From here the active broker is gone: nothing of a's reaches b, and a is never ticked.
    clock.advance(0.5)  # silent (over 1.5 heartbeats) but not expired: the passive holds the client
    b.client(rid(7))
    assert b.state is State.PASSIVE and len(b.pair.held) == 1 and b.served == [] and b.to_client == []
    clock.advance(0.2)  # 0.7 s: still not expired; the held request waits on
    b.tick()
    assert b.state is State.PASSIVE and len(b.pair.held) == 1
    clock.advance(0.1)  # 0.8 s: expired; the held request is judged again, and the vote takes over
    b.tick()
    assert b.state is State.ACTIVE and b.pair.held == []
    assert [P.unpackb(f[3])["id"] for f in b.served] == [rid(7)]
    assert b.h.core.epoch == a_epoch + 1 and b.h.core.epoch % 2 == 1


def test_a_silent_peer_that_speaks_again_releases_what_was_held_as_not_active(
        pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    start(a, b)
    clock.advance(0.5)
    b.client(rid(8))
    assert len(b.pair.held) == 1
    a.tick()  # the active one was only slow: its STATE comes before the expiry
    assert b.pair.inbound.poll(20)
    b.deliver()
    b.tick()
    assert b.state is State.PASSIVE and b.pair.held == [] and b.served == []
    assert b.not_active_replies() == 1


def test_the_active_stops_counting_on_a_passive_that_has_expired(pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    start(a, b)
    clock.advance(EXPIRY)  # silent for exactly the expiry: not yet expired
    a.tick()
    assert a.pair.streaming
    clock.advance(0.01)
    a.tick()
    assert not a.pair.streaming and a.state is State.ACTIVE


def test_the_operators_failover_reads_the_pairs_clock(pair: tuple[Side, Side], clock: FakeClock) -> None:
    a, b = pair
    start(a, b)
    clock.advance(EXPIRY + 0.01)  # the passive has been silent past the expiry, on the pair's clock
    with pytest.raises(ConflictError):
        a.pair.failover()
    assert a.state is State.ACTIVE
    b.tick()  # b speaks: in sync and heard again, the failover now hands over
    assert a.pair.inbound.poll(20)
    a.deliver()
    assert a.pair.failover() == {"state": "passive", "epoch": a.h.core.epoch}
    settle(a, b)
    assert (a.state, b.state) == (State.PASSIVE, State.ACTIVE)


def test_two_primaries_log_the_misconfiguration_once_and_stay_primary(
        ctx: zmq.Context[Any], clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    a = Side(ctx, clock, "primary", "inproc://twin-a", "inproc://twin-b")
    b = Side(ctx, clock, "primary", "inproc://twin-b", "inproc://twin-a")
    try:
        with caplog.at_level(logging.ERROR, logger="gpud_standby.pair"):
            for _ in range(4):
                settle(a, b)
                clock.advance(HEARTBEAT)
        assert (a.state, b.state) == (State.PRIMARY, State.PRIMARY)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and all("started as primary too" in r.getMessage() for r in errors)
    finally:
        a.pair.close()
        b.pair.close()
