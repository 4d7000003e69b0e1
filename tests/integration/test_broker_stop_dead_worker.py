"""A stopping broker (SIGTERM: draining) waits, up to its drain timeout, for the work its live
workers run, and no longer for work bound to a worker gone silent (suspended, PROTOCOL.md §4.2):
that worker keeps the job's RESULT until a broker ACKs it (§9.4) and sends it again to the next
broker it is welcomed by, so stopping at once loses nothing that waiting could have saved.

A real Broker in a thread on real ZeroMQ sockets on loopback; the test speaks a worker's side of
the wire protocol on a DEALER, and a client's on another."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud_broker.broker import Broker, Endpoints
from gpud_broker.core import BrokerConfig

GiB = 1 << 30
DRAIN_S = 10.0


class Side:
    """A DEALER speaking one side of the wire protocol to the broker."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, peer: Peer) -> None:
        self.peer = peer
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, cmd: Command, header: dict[str, Any]) -> None:
        self.sock.send_multipart(P.encode(self.peer, cmd, header))

    def next(self, cmd: Command, timeout: float = 10.0) -> Message:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                msg = P.decode(self.sock.recv_multipart(), self.peer)
                for one in [m for m, _ in P.unbatch(msg)] if msg.command is Command.BATCH else [msg]:
                    if one.command is cmd:
                        return one
        raise AssertionError(f"no {cmd.name} within {timeout}s")


@pytest.fixture
def running() -> Iterator[tuple[Broker, threading.Thread, Side, Side, bytes]]:
    """A broker (heartbeat 0.2 s, liveness 3; a silent worker suspended for 100 periods) in a
    thread, one worker, and a job of its client's running there, marked started (GO)."""
    ctx: zmq.Context[Any] = zmq.Context()
    b = Broker(BrokerConfig(name="b", heartbeat=HeartbeatPolicy(0.2, 3), worker_resume_periods=100,
                            drain_timeout=DRAIN_S),
               Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"), ctx=ctx)
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    worker = Side(ctx, b.endpoints.backend, Peer.WORKER)
    client = Side(ctx, b.endpoints.frontend, Peer.CLIENT)
    try:
        worker.send(Command.READY, {"name": "wd", "cpu_milli": 8000, "host_mem": 64 * GiB, "slots": 4, "gpus": [
            {"uuid": "GPU-wd-0", "index": 0, "model": "A100", "mem": 16 * GiB, "cc": [8, 0]}]})
        worker.next(Command.WELCOME)
        rid = P.new_id()
        client.send(Command.REQUEST, {"id": rid, "kind": "job", "argv": ["sleep", "1000"], "need": {"gpu_milli": 100}})
        assert worker.next(Command.DISPATCH).header["id"] == rid
        worker.send(Command.START, {"ids": [rid]})
        assert worker.next(Command.GO).header["ids"] == [rid]  # it may have begun: bound to its worker
        yield b, thread, worker, client, rid
    finally:
        b.stop()
        thread.join(timeout=DRAIN_S + 5)
        worker.sock.close(0)
        client.sock.close(0)
        b.close()
        ctx.term()


def _stopped_within(thread: threading.Thread, seconds: float) -> bool:
    thread.join(timeout=seconds)
    return not thread.is_alive()


def test_a_stopping_broker_does_not_wait_for_work_bound_to_a_silent_worker(
        running: tuple[Broker, threading.Thread, Side, Side, bytes]) -> None:
    b, thread, _, _, rid = running
    deadline = time.monotonic() + 10.0
    while not b.core.registry.by_name["wd"].suspended_at:  # silent past its liveness (0.6 s)
        assert time.monotonic() < deadline, "the silent worker was never suspended"
        time.sleep(0.05)
    assert rid in b.core.registry.by_name["wd"].assigned  # begun: kept bound to it, not placed again
    b.drain()
    assert _stopped_within(thread, DRAIN_S / 2), "the broker waited its drain timeout for a silent worker"


def test_a_stopping_broker_still_waits_for_the_work_of_a_live_worker(
        running: tuple[Broker, threading.Thread, Side, Side, bytes]) -> None:
    _, thread, worker, client, rid = running
    b = running[0]
    b.drain()
    for seq in range(10):  # 2 s of heartbeats: live, its job running
        worker.send(Command.HEARTBEAT, {"seq": seq, "running": [{"id": rid, "kind": "job", "tenant": "default"}]})
        time.sleep(0.2)
    assert thread.is_alive()  # still draining: its job may finish yet
    worker.send(Command.RESULT, {"id": rid, "ok": True, "exit_code": 0, "tenant": "default"})
    assert client.next(Command.REPLY).header["id"] == rid
    assert _stopped_within(thread, DRAIN_S / 2)  # once answered, it stops
