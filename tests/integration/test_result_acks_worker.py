"""A worker keeps every RESULT until a broker ACKs it (PROTOCOL.md §9.4): it names the RESULTs it
keeps in its READY's ``holds``, sends them again after every WELCOME (a reconnect to the same
broker too), then a HEARTBEAT, and lets go of each once ACKed; a broker that says ``acks: false``
(an older one) gets today's behaviour: nothing kept.

A real Worker (one simulated GPU) in a thread on real ZeroMQ sockets on loopback; the test speaks
the broker's side of the wire protocol on a ROUTER.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud.sockets import recv_frames, send_frames
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import SimulatedProbe, simulated_gpus
from gpud_worker.jobs import JobRunner
from gpud_worker.worker import Worker, WorkerConfig


class FakeBroker:
    """The broker's side of the worker dialog, on a ROUTER bound to loopback: every message the
    worker sends, BATCHes unpacked, with the routing id it came from."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.pending: list[tuple[bytes, Message]] = []
        self.gpu = ""  # the worker's GPU (its READY's), which a DISPATCH's grant names

    def next(self, command: Command, timeout: float = 10.0) -> tuple[bytes, Message]:
        """The next message of ``command`` (HEARTBEATs skipped unless asked for), and its sender."""
        deadline = time.monotonic() + timeout
        while True:
            while self.pending:
                ident, msg = self.pending.pop(0)
                if msg.command is Command.READY:
                    self.gpu = msg.header["gpus"][0]["uuid"]
                if msg.command is command:
                    return ident, msg
                assert msg.command is Command.HEARTBEAT, f"{msg.command.name} before {command.name}: {msg.header} {ident!r}"
            left = deadline - time.monotonic()
            assert left > 0, f"no {command.name} from the worker within {timeout}s"
            if self.sock.poll(int(left * 1000)):
                self._take()

    def collect(self, seconds: float) -> list[Command]:
        """Take in what the worker sends for ``seconds``; returns the commands that came."""
        before = len(self.pending)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                self._take()
        return [m.command for _, m in self.pending[before:]]

    def _take(self) -> None:
        ident, *frames = recv_frames(self.sock)
        msg = P.decode(frames, Peer.WORKER)
        if msg.command is Command.BATCH:
            self.pending += [(ident, one) for one, _ in P.unbatch(msg)]
        else:
            self.pending.append((ident, msg))

    def send(self, ident: bytes, command: Command, header: dict[str, Any]) -> None:
        send_frames(self.sock, [ident, *P.encode(Peer.WORKER, command, header)])

    def welcome(self, ident: bytes, acks: bool = True, **extra: Any) -> None:
        self.send(ident, Command.WELCOME, {"heartbeat_ms": 1000, "liveness": 10, "broker": "fake", "active": True,
                                           "epoch": 1, "acks": acks, **extra})


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Worker, FakeBroker]]:
    ctx: zmq.Context[Any] = zmq.Context()
    broker = FakeBroker(ctx)
    device = SimulatedDevice(simulated_gpus(1, mem=1 << 30, worker_name="wa")[0])
    worker = Worker(WorkerConfig(name="wa", brokers=(broker.endpoint,), heartbeat=HeartbeatPolicy(1.0, 10),
                                 reconnect_min=0.05, drain_timeout=5.0),
                    SimulatedProbe([device]), {device.gpu.uuid: device}, JobRunner(tmp_path, None), ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker, broker
    finally:
        worker.stop()
        thread.join(timeout=15)
        assert not thread.is_alive()
        broker.sock.close(0)
        ctx.term()


def echo(broker: FakeBroker, ident: bytes) -> bytes:
    """DISPATCH an echo to the worker; returns its id, once its RESULT came."""
    rid = os.urandom(16)
    broker.send(ident, Command.DISPATCH, {"id": rid, "kind": "echo", "epoch": 1, "tenant": "t",
                                          "grant": {"gpus": [broker.gpu]}})
    _, result = broker.next(Command.RESULT)
    assert result.header["id"] == rid and result.header["ok"] is True, result.header
    return rid


def test_an_unacked_result_is_held_in_ready_and_sent_again_after_the_welcome_then_let_go_once_acked(
        setup: tuple[Worker, FakeBroker]) -> None:
    worker, broker = setup
    first, ready = broker.next(Command.READY)
    assert ready.header["holds"] == []
    broker.welcome(first)
    rid = echo(broker, first)
    # The broker's side of the connection is gone (a reconnect libzmq made by itself): it answers
    # DISCONNECT. The worker comes back on a new connection holding the RESULT nobody ACKed.
    broker.send(first, Command.DISCONNECT, {"reason": "unknown worker"})
    second, ready = broker.next(Command.READY)
    assert second != first and ready.header["holds"] == [rid]
    broker.welcome(second)
    who, resent = broker.next(Command.RESULT)
    assert who == second and resent.header["id"] == rid
    who, _ = broker.next(Command.HEARTBEAT)  # then a HEARTBEAT
    assert who == second
    broker.send(second, Command.ACK, {"ids": [rid]})
    broker.send(second, Command.DISCONNECT, {"reason": "unknown worker"})
    _, ready = broker.next(Command.READY)
    assert ready.header["holds"] == []  # ACKed: let go


def test_a_welcome_again_on_the_same_connection_sends_the_unacked_results_again(
        setup: tuple[Worker, FakeBroker]) -> None:
    _, broker = setup
    ident, _ = broker.next(Command.READY)
    broker.welcome(ident)
    rid = echo(broker, ident)
    broker.welcome(ident, resumed=True, stop=[])  # a broker that resumed this worker (PROTOCOL.md §4.2)
    who, resent = broker.next(Command.RESULT)
    assert who == ident and resent.header["id"] == rid


def test_a_result_named_in_stop_is_let_go_and_not_sent_again(setup: tuple[Worker, FakeBroker]) -> None:
    _, broker = setup
    first, _ = broker.next(Command.READY)
    broker.welcome(first)
    taken, kept = echo(broker, first), echo(broker, first)
    broker.send(first, Command.DISCONNECT, {"reason": "unknown worker"})
    second, ready = broker.next(Command.READY)
    assert sorted(ready.header["holds"]) == sorted([taken, kept])
    broker.welcome(second, resumed=True, stop=[taken])  # the broker has taken ``taken`` already
    _, resent = broker.next(Command.RESULT)
    assert resent.header["id"] == kept
    assert Command.RESULT not in broker.collect(0.5)


def test_a_broker_that_says_it_does_not_ack_gets_nothing_kept(setup: tuple[Worker, FakeBroker]) -> None:
    _, broker = setup
    first, _ = broker.next(Command.READY)
    broker.welcome(first, acks=False)
    echo(broker, first)
    broker.send(first, Command.DISCONNECT, {"reason": "unknown worker"})
    _, ready = broker.next(Command.READY)
    assert ready.header["holds"] == []


def test_a_stopping_worker_waits_for_the_ack_of_its_last_result(setup: tuple[Worker, FakeBroker]) -> None:
    worker, broker = setup
    ident, _ = broker.next(Command.READY)
    broker.welcome(ident)
    rid = echo(broker, ident)
    worker.stop()
    came = broker.collect(1.0)  # draining: its RESULT is not ACKed yet, so no goodbye
    assert Command.HEARTBEAT in came and Command.DISCONNECT not in came, came
    assert rid in worker.unacked
    broker.send(ident, Command.ACK, {"ids": [rid]})
    _, bye = broker.next(Command.DISCONNECT)
    assert bye.header["reason"] == "worker stopping"
