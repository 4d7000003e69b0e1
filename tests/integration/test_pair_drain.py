"""A broker of a pair that is stopping (SIGTERM: draining) takes no new work, whatever its role
does meanwhile: a passive one that takes over while draining still answers new requests
SHUTTING_DOWN (its clients go to the peer), and serves only what it already holds.

A real Broker object with real ZeroMQ sockets on loopback, in this process, its loop driven by
hand (a draining loop with nothing dispatched would stop at its next tick). No peer answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.sockets import recv_frames
from gpud_broker.broker import Broker, Endpoints
from gpud_broker.core import BrokerConfig
from gpud_standby.bstar import Action, Event
from gpud_standby.pair import PairConfig

NOWHERE = "tcp://127.0.0.1:9"  # the discard port: nothing answers there


@pytest.fixture
def backup() -> Iterator[tuple[Broker, zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    b = Broker(BrokerConfig(name="backup"), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"), ctx=ctx,
               pair=PairConfig(role="backup", peer=NOWHERE, bind="tcp://127.0.0.1:*"))
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(b.endpoints.frontend)
    yield b, client
    client.close(0)
    b.close()
    ctx.term()


def _ask(b: Broker, client: zmq.Socket[bytes], cmd: Command, header: dict[str, object]) -> P.Message:
    """Send one client message, let the broker handle it as its loop does, return the answer."""
    client.send_multipart(P.encode(Peer.CLIENT, cmd, header, [b"x"] if cmd is Command.REQUEST else []))
    assert b.frontend.poll(5000), "the message did not reach the broker"
    b._on_client(recv_frames(b.frontend, 0, copy_first=4), None)
    b._flush()
    assert client.poll(2000), f"no answer to {cmd.name}"
    return P.decode(client.recv_multipart(), Peer.CLIENT)


def test_a_draining_passive_broker_that_takes_over_takes_no_new_work(backup: tuple[Broker, zmq.Socket[bytes]]) -> None:
    b, client = backup
    b.drain()
    b._start_drain()  # what the loop does at its first tick after SIGTERM
    before = _ask(b, client, Command.REQUEST, {"id": P.new_id(), "kind": "echo"}).header
    assert before["code"] == "SHUTTING_DOWN"

    # The peer has been silent past its expiry, and a client turns to us: the vote takes over.
    assert b.pair is not None
    b.pair.peer_heard -= 10 * b.pair.cfg.expiry
    assert b.pair.event(Event.CLIENT, time.monotonic()) is Action.TAKEOVER
    assert b.core.active

    rid = P.new_id()
    after = _ask(b, client, Command.REQUEST, {"id": rid, "kind": "echo"}).header
    assert after["code"] == "SHUTTING_DOWN" and after["id"] == rid
    assert rid not in b.core.tasks.tasks  # not accepted: nothing was queued for it
    assert _ask(b, client, Command.PING, {}).command is Command.PONG  # pings are still answered
