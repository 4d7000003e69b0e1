"""Two brokers that each think they are active (both took over while they could not hear each
other, and no worker witnessed either): when they hear each other again, the one with the lower
epoch steps down at once and tells its clients NOT_ACTIVE, so they re-send to the other.

Real Broker objects with real ZeroMQ sockets on loopback, in this process (no workers: nothing
to witness, which is what lets both take over).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_broker.broker import Broker, Endpoints
from gpud_broker.core import BrokerConfig
from gpud_standby.pair import PairConfig
from tests.waiting import wait_for

NOWHERE = "tcp://127.0.0.1:9"  # the discard port: nothing answers there


@pytest.fixture
def brokers() -> Iterator[dict[str, Broker]]:
    ctx = zmq.Context()
    made: dict[str, Broker] = {}
    threads = []
    for role in ("primary", "backup"):
        b = Broker(BrokerConfig(name=role), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"), ctx=ctx,
                   pair=PairConfig(role=role, peer=NOWHERE, bind="tcp://127.0.0.1:*"))
        made[role] = b
        t = threading.Thread(target=b.run, daemon=True)
        t.start()
        threads.append(t)
    yield made
    for b in made.values():
        b.stop()
    for t in threads:
        t.join(5)
    for b in made.values():
        b.close()
    ctx.term()


def _request(ctx: zmq.Context, endpoint: str, kind: str = "echo") -> tuple[zmq.Socket, bytes]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    rid = P.new_id()
    s.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": kind}, [b"x"]))
    return s, rid


def _answer(s: zmq.Socket, timeout: float = 5.0) -> dict:
    assert s.poll(int(timeout * 1000)), "no answer"
    return P.decode(s.recv_multipart(), Peer.CLIENT).header


def test_two_actives_that_hear_each_other_leave_one(brokers: dict[str, Broker]) -> None:
    ctx = zmq.Context.instance()
    time.sleep(1.0)  # past the peer expiry: each broker's peer is silent
    held = {}
    for role, b in brokers.items():
        # A client turns to each; no worker is there to witness: both take over. The request
        # waits in the queue (no worker can take it).
        held[role] = _request(ctx, b.endpoints.frontend)
    wait_for(lambda: all(b.pair.state.value == "active" for b in brokers.values()), what="both to take over")
    epochs = {role: b.core.epoch for role, b in brokers.items()}
    assert epochs["primary"] != epochs["backup"]  # never the same epoch
    lower = min(epochs, key=epochs.__getitem__)
    higher = "backup" if lower == "primary" else "primary"

    # The link heals: each connects to the other's peer socket.
    brokers["primary"].pair.outbound.connect(brokers["backup"].pair.bound)
    brokers["backup"].pair.outbound.connect(brokers["primary"].pair.bound)
    wait_for(lambda: brokers[lower].pair.state.value == "passive", what=f"{lower} (epoch {epochs[lower]}) to step down", timeout=10)
    assert brokers[higher].pair.state.value == "active"
    # The client of the one that stepped down is told to go to the other; the other keeps its own.
    sock, rid = held[lower]
    h = _answer(sock)
    assert (h["id"], h["ok"], h["code"]) == (rid, False, "NOT_ACTIVE")
    sock2, rid2 = held[higher]
    assert not sock2.poll(300)  # still queued there, not refused
    # The one that stepped down syncs from the other and holds its queued request too.
    wait_for(lambda: brokers[lower].pair.synced and rid2 in brokers[lower].core.tasks.tasks, what="the re-sync")
    for s, _ in held.values():
        s.close(0)


@pytest.fixture
def linked(brokers: dict[str, Broker]) -> dict[str, Broker]:
    """The pair linked from the start: primary active, backup passive and in sync."""
    brokers["primary"].pair.outbound.connect(brokers["backup"].pair.bound)
    brokers["backup"].pair.outbound.connect(brokers["primary"].pair.bound)
    wait_for(lambda: brokers["primary"].pair.state.value == "active" and brokers["backup"].pair.synced,
             what="primary active, backup in sync")
    return brokers


def test_a_passive_broker_that_sees_a_gap_resyncs(linked: dict[str, Broker]) -> None:
    ctx = zmq.Context.instance()
    primary, backup = linked["primary"], linked["backup"]
    s, rid = _request(ctx, primary.endpoints.frontend)  # queued on the primary (no workers)
    wait_for(lambda: rid in backup.core.tasks.tasks, what="the request replicated")
    # A batch that skips ahead (as if updates were lost on the way): the backup must notice.
    inj = ctx.socket(zmq.DEALER)
    inj.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    inj.setsockopt(zmq.LINGER, 0)
    inj.connect(backup.pair.bound)
    snapshots = backup.pair.snapshots
    inj.send_multipart(P.encode(Peer.BROKER, Command.UPDATES, {"seq": backup.pair.applied + 5, "count": 1},
                                [P.packb([["forget", rid]])]))
    # It re-syncs from the active broker's snapshot: the forged update was not applied.
    wait_for(lambda: backup.pair.snapshots > snapshots and backup.pair.synced, what="the re-sync")
    assert rid in backup.core.tasks.tasks
    s2, rid2 = _request(ctx, primary.endpoints.frontend)
    wait_for(lambda: rid2 in backup.core.tasks.tasks, what="updates flowing again after the re-sync")
    for sock in (s, s2, inj):
        sock.close(0)


def test_a_worker_that_knows_a_later_epoch_makes_the_active_broker_step_down(brokers: dict[str, Broker]) -> None:
    """Fencing through a worker: two brokers that cannot hear each other both took over; a
    worker that has seen the later epoch tells the other one, which steps down at once."""
    ctx = zmq.Context.instance()
    time.sleep(1.0)
    held = [_request(ctx, b.endpoints.frontend) for b in brokers.values()]
    wait_for(lambda: all(b.pair.state.value == "active" for b in brokers.values()), what="both to take over")
    lower, higher = sorted(brokers.values(), key=lambda b: b.core.epoch)
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(lower.endpoints.backend)
    worker.send_multipart(P.encode(Peer.WORKER, Command.READY, {"name": "w", "gpus": []}))
    worker.send_multipart(P.encode(Peer.WORKER, Command.HEARTBEAT, {"seq": 1, "epoch": higher.core.epoch}))
    wait_for(lambda: lower.pair.state.value == "passive", what="the fenced broker to step down")
    assert higher.pair.state.value == "active"
    sock, rid = held[0] if lower is brokers["primary"] else held[1]
    h = _answer(sock)
    assert (h["id"], h["code"]) == (rid, "NOT_ACTIVE")
    for s in (worker, *(s for s, _ in held)):
        s.close(0)
