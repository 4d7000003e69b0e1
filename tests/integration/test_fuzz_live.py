"""A bounded fuzz run against a live broker: random and mutated valid messages on the frontend,
the backend and the admin socket, replayed ids, a client posing as a worker. Afterwards the broker
still serves, its memory has not grown without bound, and it logged the bad input."""

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
from gpud.security import CurveKeys, apply_client_keys
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.waiting import wait_for

ROUNDS = 1500  # messages per socket


@pytest.fixture(scope="module", params=["none", "curve"])
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """Without security, and with CURVE: then the fuzzer holds an allowed key on each socket."""
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, log_level="WARNING", security=request.param) as c:
        yield c


def keys_for(cluster: LocalCluster, endpoint: str) -> CurveKeys | None:
    """The fuzzer's keys on ``endpoint`` under CURVE: a client's, or an allowed worker key (named
    fz-key: its READYs under other names are refused); None for the IPC admin socket."""
    if cluster.security != "curve" or endpoint == cluster.admin:
        return None
    if endpoint == cluster.frontend:
        return cluster.client_keys("fuzz")
    secret = cluster._pair("fz-key", cluster.keys / "workers")
    return CurveKeys.from_files(secret, cluster.keys / "broker.key")


def valid_messages(rng: random.Random) -> list[list[bytes]]:
    rid = P.new_id()
    return [
        P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": "echo", "need": {"tenant": "fuzz"}}, [b"x"]),
        P.encode(Peer.CLIENT, Command.CALL, {"id": rid, "session": P.new_id(), "op": "alloc", "args": {"nbytes": 8}}),
        P.encode(Peer.CLIENT, Command.CANCEL, {"id": rid}),
        P.encode(Peer.CLIENT, Command.PING, {"sessions": [rid]}),
        P.encode(Peer.WORKER, Command.HEARTBEAT, {"seq": 1, "gpus": []}),
        P.encode(Peer.WORKER, Command.RESULT, {"id": rid, "ok": True}),
        P.encode(Peer.WORKER, Command.READY, {"name": f"fz{rng.randrange(9)}", "gpus": []}),
        P.encode(Peer.ADMIN, Command.ADMIN, {"id": rid, "cmd": "status", "args": {}}),
    ]


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(6)
    i = rng.randrange(len(frames))
    if op == 0 and frames[i]:  # flip a byte
        b = bytearray(frames[i])
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    elif op == 1:  # truncate a frame
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op == 2:  # drop a frame
        del frames[i]
    elif op == 3:  # duplicate a frame
        frames.insert(i, frames[i])
    elif op == 4:  # random extra payload
        frames.append(rng.randbytes(rng.randrange(64)))
    return frames or [b""]


def blast(ctx: zmq.Context[Any], endpoint: str, rng: random.Random, keys: CurveKeys | None = None) -> int:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    if keys is not None:
        apply_client_keys(sock, keys)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    sent = 0
    try:
        for _ in range(ROUNDS):
            msgs = valid_messages(rng)
            frames = rng.choice(msgs)
            if rng.random() < 0.8:
                frames = mutate(rng, frames)
            sock.send_multipart(frames)
            sent += 1
            while sock.poll(0):
                sock.recv_multipart()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and sock.poll(200):
            sock.recv_multipart()
    finally:
        sock.close()
    return sent


def test_live_fuzz_keeps_serving_with_bounded_memory(cluster: LocalCluster) -> None:
    assert cluster.broker is not None
    proc = psutil.Process(cluster.broker.pid)
    ctx = zmq.Context()
    rng = random.Random(1234)
    try:
        honest = cluster.client_keys("honest") if cluster.security == "curve" else None
        # Warm up, then measure memory around the fuzz run.
        with Client(cluster.frontend, timeout=10, curve=honest) as c:
            for _ in range(200):
                c.echo(b"warm")
        rss0 = proc.memory_info().rss
        tried = 0
        for endpoint in (cluster.frontend, cluster.backend, cluster.admin):
            tried += blast(ctx, endpoint, rng, keys_for(cluster, endpoint))
            with Client(cluster.frontend, timeout=10, curve=honest) as c:
                assert c.echo(b"still serving") == b"still serving"
            assert cluster.broker.poll() is None
        rss1 = proc.memory_info().rss
    finally:
        ctx.term()
    print(f"live fuzz: {tried} messages tried; broker RSS {rss0 >> 20} -> {rss1 >> 20} MiB")
    assert tried == 3 * ROUNDS
    assert rss1 - rss0 < 64 << 20, (rss0, rss1)
    st = cluster.status()
    assert st["counters"]["bad_messages"] > ROUNDS // 2
    # The fuzzed READYs did not displace the real worker. A well-formed one registers a worker of
    # its own until that falls silent (3 x 200 ms): the fuzzing connection is closed by now.
    assert "w0" in {w["name"] for w in st["workers"]}, st["workers"]
    assert all(w["name"] == "w0" or w["name"].startswith("fz") for w in st["workers"]), st["workers"]
    assert wait_for(lambda: [w["name"] for w in cluster.status()["workers"]] == ["w0"])
    assert "bad message from" in cluster.log_tail("broker", 200)
