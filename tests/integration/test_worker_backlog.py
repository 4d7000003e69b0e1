"""A backlog in the broker's own input is not its workers' silence (PROTOCOL.md §4.2).

The broker reads at most a batch (256 messages) of worker messages per turn, one from each
connection in turn. With more workers than that, each of them heartbeating, and the broker frozen
past their liveness (SIGSTOP, SIGCONT), the first batch after the freeze reads a message of only
256 of them: the others' messages wait behind it. The broker reads what is waiting before it judges
any worker silent, so none is suspended or lost. Workers here speak the protocol by hand (many
sockets, one thread), heartbeat 200 ms x 3. What the broker did is read from its log (its status
of 320 workers is over an admin reply's header limit).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster

WORKERS = 320  # more than a batch


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=0, heartbeat_ms=200, rundir=tmp_path)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def beat(socks: list[zmq.Socket[bytes]], seq: int) -> None:
    for s in socks:
        s.send_multipart(P.encode(Peer.WORKER, Command.HEARTBEAT, {"seq": seq, "running": []}))


def test_workers_behind_a_backlog_are_not_judged_silent(broker: LocalCluster) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    try:
        for i in range(WORKERS):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(broker.backend)
            gpu = {"uuid": f"GPU-b{i}", "index": 0, "model": "SIM", "mem": 1 << 30, "cc": [8, 0], "simulated": True}
            s.send_multipart(P.encode(Peer.WORKER, Command.READY, {"name": f"b{i}", "gpus": [gpu], "slots": 1,
                                                                    "heartbeat_ms": 200, "liveness": 3}))
            socks.append(s)
        log = broker.rundir / "broker.log"  # type: ignore[operator]
        seq = 0
        deadline = time.monotonic() + 60
        while log.read_text().count(" ready: 1 GPU(s)") < WORKERS:
            seq += 1
            beat(socks, seq)
            time.sleep(0.1)
            assert time.monotonic() < deadline, broker.log_tail("broker")
        assert broker.broker is not None
        broker.broker.send_signal(signal.SIGSTOP)
        try:
            frozen_until = time.monotonic() + 1.5  # past the workers' liveness (0.6 s)
            while time.monotonic() < frozen_until:
                seq += 1
                beat(socks, seq)
                time.sleep(0.1)
        finally:
            broker.broker.send_signal(signal.SIGCONT)
        settled = time.monotonic() + 2.0
        while time.monotonic() < settled:
            seq += 1
            beat(socks, seq)
            time.sleep(0.1)
        text = log.read_text()
        assert text.count(" ready: 1 GPU(s)") == WORKERS
        assert " silent for " not in text and " lost (" not in text, broker.log_tail("broker")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
