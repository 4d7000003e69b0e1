"""A worker's data connection (PROTOCOL.md §11.3) with a real CURVE broker: a staged job's chunks
come on it and its input is right, and neither a client key nor another worker's key on a
connection of its own gets a byte of a job placed on a worker.

Real broker and worker daemons (simulated GPUs, labelled so) as subprocesses on loopback, the real
client library; the worker whose job is probed is played by the test over real CURVE sockets with
its own allow-listed key, so that the probes may name its true incarnation.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, apply_client_keys
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

MiB = 1 << 20


def counters(c: LocalCluster) -> dict[str, int]:
    got: dict[str, int] = admin_call(c.admin, "status")["counters"]
    return got


def test_a_staged_jobs_chunks_come_on_the_data_connection_and_its_input_is_right(tmp_path: Path) -> None:
    with LocalCluster(workers=1, rundir=tmp_path, security="curve") as c:
        c.wait_workers(1)
        data = os.urandom(3 * MiB) * 7  # 21 MiB: staged (over the client's 8 MiB chunk size)
        with Client([c.frontend], timeout=60, curve=c.client_keys("acme")) as client:
            out = client.run(["md5sum", "a"], files={"a": data}, gpu_milli=100, time_limit=60, timeout=60)
        assert out.exit_code == 0, out.stderr
        assert out.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
        seen = counters(c)
        assert seen["fetches_on_data"] >= 21 and seen["fetches_on_control"] == 0, seen
        assert seen["bad_messages"] == 0, seen


def dealer(ctx: zmq.Context[Any], endpoint: str, keys: CurveKeys) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    apply_client_keys(s, keys)
    s.connect(endpoint)
    return s


def recv(s: zmq.Socket[bytes], timeout_s: float, skip: tuple[Command, ...] = ()) -> P.Message | None:
    """The next message on ``s`` that is not one of ``skip``, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not s.poll(int(left * 1000) + 1):
            return None
        msg = P.decode(s.recv_multipart(), Peer.WORKER)
        if msg.command is Command.BATCH:
            for one, _ in P.unbatch(msg):
                if one.command not in skip:
                    return one
        elif msg.command not in skip:
            return msg
    return None


class FakeWorker:
    """Worker ``name`` played over a real CURVE control connection: READY, then heartbeats."""

    def __init__(self, c: LocalCluster, ctx: zmq.Context[Any], name: str) -> None:
        self.name = name
        self.incarnation = os.urandom(16)
        self.keys = CurveKeys.from_files(c._pair(name, c.keys / "workers"), c.keys / "broker.key")
        self.sock = dealer(ctx, c.backend, self.keys)
        gpu = {"uuid": f"GPU-{name}", "index": 0, "model": "SIM", "mem": 1 << 30, "cc": [8, 0], "simulated": True}
        self.sock.send_multipart(P.encode(Peer.WORKER, Command.READY, {
            "name": name, "gpus": [gpu], "slots": 1, "heartbeat_ms": 500, "liveness": 20, "simulated": True,
            "incarnation": self.incarnation}))
        welcome = recv(self.sock, 10)
        assert welcome is not None and welcome.command is Command.WELCOME, welcome
        self.seq = 0

    def beat(self) -> None:
        self.seq += 1
        self.sock.send_multipart(P.encode(Peer.WORKER, Command.HEARTBEAT, {"seq": self.seq, "running": []}))


def fetch(s: zmq.Socket[bytes], job: bytes, worker: str, incarnation: bytes) -> None:
    s.send_multipart(P.encode(Peer.WORKER, Command.FETCH, {
        "id": job, "file": 0, "offset": 0, "nbytes": MiB, "worker": worker, "incarnation": incarnation}))


@pytest.fixture
def lone_broker(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=0, rundir=tmp_path, security="curve", heartbeat_ms=500, liveness=20) as c:
        yield c


def test_neither_a_client_key_nor_another_workers_key_fetches_a_jobs_bytes(lone_broker: LocalCluster) -> None:
    c = lone_broker
    ctx: zmq.Context[Any] = zmq.Context()
    probed = threading.Event()  # set once the test has probed: till then the job's client stays
    try:
        victim = FakeWorker(c, ctx, "victim")
        data = os.urandom(MiB) * 9  # staged
        submitted: dict[str, Any] = {}

        def submit() -> None:
            with Client([c.frontend], timeout=30, curve=c.client_keys("acme")) as client:
                submitted["job"] = client.submit(["md5sum", "a"], files={"a": data}, gpu_milli=100)
                probed.wait(30)

        thread = threading.Thread(target=submit)
        thread.start()
        dispatch = recv(victim.sock, 30, skip=(Command.HEARTBEAT,))
        assert dispatch is not None and dispatch.command is Command.DISPATCH, dispatch
        job = dispatch.header["id"]
        assert dispatch.header["staged"] == [len(data)]
        bad_before = counters(c)["bad_messages"]

        # Another worker's key (allow-listed, connected: it said READY), naming the victim truly.
        thief = FakeWorker(c, ctx, "thief")
        stolen = dealer(ctx, c.backend, thief.keys)
        fetch(stolen, job, victim.name, victim.incarnation)
        answer = recv(stolen, 10)
        assert answer is not None and answer.command is Command.ERROR and answer.frames == [], answer
        assert answer.header["code"] == "INVALID_REQUEST" and answer.header.get("id") == job
        # A client key does not pass the backend's handshake: no answer at all.
        as_client = dealer(ctx, c.backend, c.client_keys("acme"))
        fetch(as_client, job, victim.name, victim.incarnation)
        assert recv(as_client, 2) is None
        victim.beat()
        thief.beat()
        assert counters(c)["bad_messages"] == bad_before + 1
        # The victim's own key on its data connection gets the bytes, there.
        own = dealer(ctx, c.backend, victim.keys)
        fetch(own, job, victim.name, victim.incarnation)
        chunk = recv(own, 10)
        assert chunk is not None and chunk.command is Command.CHUNK, chunk
        assert P.as_bytes(chunk.frames[0]) == data[:MiB]
        assert recv(victim.sock, 0.5, skip=(Command.HEARTBEAT,)) is None  # nothing of it on the control connection
        probed.set()
        thread.join(timeout=30)
        assert "job" in submitted
        # The test is over: the broker's close would wait for the job it holds on the victim,
        # a fake worker that never answers, until its drain timeout.
        c.kill_broker("broker")
    finally:
        probed.set()  # a failed probe does not keep the client's thread waiting
        ctx.destroy(0)
