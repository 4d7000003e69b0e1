"""The broker pair's peer link under hostile input: random and mutated STATE, SYNC, SNAPSHOT and
UPDATES (malformed snapshots and updates included) sent to both brokers' peer sockets. Neither
broker may crash, the pair must still serve clients afterwards, and memory stays bounded.

(Under CURVE only the pair's own key reaches these sockets; with security none, anything on
loopback does, which is what this plays.)"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.integration.test_fuzz_live import mutate

ROUNDS = 800  # messages per broker


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, pair=True, heartbeat_ms=250, log_level="WARNING",
                      rundir=tmp_path_factory.mktemp("fuzzpeer")) as c:
        c.wait_active()
        yield c


def peer_messages(rng: random.Random) -> list[list[bytes]]:
    rid = P.new_id()
    junk_updates: list[Any] = [[], ["task"], ["task", [1, 2]], ["run", rid], ["done", rid, "x"], ["queue", 7, None],
                               ["end", None], ["marks", 1, 2], ["nope", rid], 42, {"a": 1}]
    task = [rid, "echo", {}, {}, [b"x"], 0.0, 30.0, "default", True, 0, [], None, "queued", None, None, None]
    return [
        P.encode(Peer.BROKER, Command.STATE, {"state": rng.choice(["primary", "backup", "passive", "bogus"]),
                                              "epoch": rng.randrange(-3, 3), "applied": rng.randrange(-5, 5)}),
        P.encode(Peer.BROKER, Command.SYNC, {}),
        P.encode(Peer.BROKER, Command.SNAPSHOT, {"seq": rng.randrange(10), "epoch": 1},
                 [P.packb(rng.choice([{"tasks": [task], "sessions": []}, {"tasks": [[1]]}, [], "x", {"sessions": [[1]]}]))]),
        P.encode(Peer.BROKER, Command.UPDATES, {"seq": rng.randrange(1, 5), "count": rng.randrange(1, 3)},
                 [P.packb(rng.sample(junk_updates, 3) + [["task", task]])]),
        P.encode(Peer.BROKER, Command.UPDATES, {"seq": "x", "count": None}, [b"\xc1"]),
    ]


def blast(ctx: zmq.Context[Any], endpoint: str, rng: random.Random) -> int:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for _ in range(ROUNDS):
            frames = rng.choice(peer_messages(rng))
            if rng.random() < 0.5:
                frames = mutate(rng, frames)
            sock.send_multipart(frames)
        time.sleep(0.5)
    finally:
        sock.close()
    return ROUNDS


def test_peer_link_fuzz_crashes_nobody_and_the_pair_still_serves(pair: LocalCluster) -> None:
    procs = {role: psutil.Process(pair.brokers[role].pid) for role in pair.roles}
    rss0 = {role: p.memory_info().rss for role, p in procs.items()}
    ctx = zmq.Context()
    rng = random.Random(4321)
    try:
        for role in pair.roles:
            blast(ctx, str(pair.broker_endpoints[role]["peer"]), rng)
    finally:
        ctx.term()
    for role in pair.roles:
        assert pair.brokers[role].poll() is None, f"{role} died:\n" + pair.log_tail(role)
        assert procs[role].memory_info().rss - rss0[role] < 64 << 20
    pair.wait_active()
    with Client(pair.frontends, timeout=20) as c:
        for i in range(20):
            assert c.echo(b"%d" % i) == b"%d" % i
    logs = pair.log_tail("primary", 400) + pair.log_tail("backup", 400)
    assert "bad message on the peer link" in logs or "unusable" in logs
