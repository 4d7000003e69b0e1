"""BATCH on the wire (PROTOCOL.md §2.1) between a real broker, the real client library and a worker
that speaks the protocol by hand, so that what travels can be seen: work placed in one turn reaches
its worker as one BATCH, a BATCH of RESULTs reaches every client, each result its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.waiting import wait_for

GPU = {"uuid": "GPU-batch-0", "index": 0, "model": "SIM", "mem": 1 << 30, "cc": [8, 0], "simulated": True}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=0, rundir=tmp_path)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def receive(sock: zmq.Socket[bytes], timeout_ms: int = 10_000) -> tuple[P.Message, list[P.Message]]:
    """One zmq message from the broker: as decoded, and the messages it stands for."""
    assert sock.poll(timeout_ms), "the broker sent nothing"
    msg = P.decode(sock.recv_multipart(), Peer.WORKER)
    return msg, P.messages(msg)


def test_queued_work_goes_out_as_one_batch_and_a_batch_of_results_comes_back(
    broker: LocalCluster, tmp_path: Path
) -> None:
    n = 12
    payloads = [os.urandom(16 + i) for i in range(n)]
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with Client(broker.frontend, timeout=20) as client, Client(broker.frontend, timeout=20) as other:
            # No worker yet: the requests of two clients wait in the broker's queue.
            pending = [(client if i % 2 else other).submit_echo(p) for i, p in enumerate(payloads)]
            assert wait_for(lambda: broker.status()["counts"]["queued"] == n)
            sock.connect(broker.backend)
            ready = {"name": "by-hand", "gpus": [GPU], "slots": 64, "heartbeat_ms": 60_000, "liveness": 100}
            sock.send_multipart(P.encode(Peer.WORKER, Command.READY, ready))
            first, welcome = receive(sock)
            assert [m.command for m in welcome][0] is Command.WELCOME
            # Placed in the turn the worker arrived in: all n DISPATCHes in one BATCH, in order
            # (with the WELCOME when the broker answered READY in that same turn).
            dispatches = [m for m in welcome if m.command is Command.DISPATCH]
            if not dispatches:
                batch, dispatches = receive(sock)
                assert batch.command is Command.BATCH
            else:
                assert first.command is Command.BATCH
            assert len(dispatches) == n
            assert {bytes(m.frames[0]) for m in dispatches} == set(payloads)
            # All the results in one BATCH; each client gets exactly its own.
            results = [P.encode(Peer.WORKER, Command.RESULT,
                                {"id": m.header["id"], "ok": True, "worker": "by-hand", "gpus": [GPU["uuid"]]},
                                m.frames) for m in reversed(dispatches)]
            sock.send_multipart(P.batch(results))
            assert [p.wait() for p in pending] == payloads
            assert broker.status()["counts"]["done"] == n
    finally:
        sock.close(0)
        ctx.term()
