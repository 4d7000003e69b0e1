"""A worker of a broker pair lets go of a RESULT only on an ACK of the broker it regards as active,
at the largest epoch it has seen (PROTOCOL.md §9.4): an ACK from a passive broker, or from an old
active one at a lower epoch (woken from a freeze), proves nothing reached the active broker, and
honouring it would lose the result. The RESULT stays kept, and is sent again to the active broker.

A real Worker (one simulated GPU) in a thread on real ZeroMQ sockets on loopback; the test speaks
both brokers' side of the wire protocol, each on its own ROUTER.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import SimulatedProbe, simulated_gpus
from gpud_worker.jobs import JobRunner
from gpud_worker.worker import Worker, WorkerConfig
from tests.integration.test_result_acks_worker import FakeBroker, echo

QUIET = 60_000  # heartbeat_ms told the worker: its only HEARTBEATs are those a WELCOME asks for
POLICY = HeartbeatPolicy(1.0, 10)  # the worker's own (a fresh one holds DISPATCHes one expiry at most)


@contextmanager
def worker_of_a_pair(runner: JobRunner, heartbeat: HeartbeatPolicy = POLICY
                     ) -> Iterator[tuple[Worker, FakeBroker, FakeBroker]]:
    """A running Worker (one simulated GPU, jobs run by ``runner``, ``heartbeat`` its policy) of
    two fake brokers, a and b."""
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = FakeBroker(ctx), FakeBroker(ctx)
    device = SimulatedDevice(simulated_gpus(1, mem=1 << 30, worker_name="wp")[0])
    worker = Worker(WorkerConfig(name="wp", brokers=(a.endpoint, b.endpoint), heartbeat=heartbeat,
                                 reconnect_min=0.05, drain_timeout=1.0),
                    SimulatedProbe([device]), {device.gpu.uuid: device}, runner, ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker, a, b
    finally:
        worker.stop()
        thread.join(timeout=15)
        assert not thread.is_alive()
        a.sock.close(0)
        b.sock.close(0)
        ctx.term()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Worker, FakeBroker, FakeBroker]]:
    with worker_of_a_pair(JobRunner(tmp_path, None)) as running:
        yield running


def beat(broker: FakeBroker, ident: bytes, active: bool, epoch: int) -> None:
    broker.send(ident, Command.HEARTBEAT, {"active": active, "epoch": epoch, "acks": True})


def welcomed(broker: FakeBroker, ident: bytes, active: bool, epoch: int) -> None:
    """A WELCOME (again), and the HEARTBEAT the worker answers it with: everything sent before it
    on this connection has been handled."""
    broker.welcome(ident, active=active, epoch=epoch, heartbeat_ms=QUIET)
    who, _ = broker.next(Command.HEARTBEAT)
    assert who == ident


def resent(broker: FakeBroker) -> tuple[bytes, bytes]:
    """The RESULT a worker sends again to the broker it follows now, and the HEARTBEAT after it:
    returns the connection it came on and its id."""
    who, result = broker.next(Command.RESULT)
    after, _ = broker.next(Command.HEARTBEAT)
    assert after == who
    rid: bytes = result.header["id"]
    return who, rid


def b_takes_over(b: FakeBroker, at_b: bytes, rid: bytes) -> None:
    """b says it is active at epoch 2: the worker follows it, and sends it the kept RESULT."""
    beat(b, at_b, True, 2)
    assert resent(b) == (at_b, rid)


def ignored_ack(worker: Worker, broker: FakeBroker, ident: bytes, active: bool, epoch: int, rid: bytes) -> None:
    """``broker`` (not the active one at the largest epoch) ACKs ``rid``: the worker keeps it."""
    broker.send(ident, Command.ACK, {"ids": [rid]})
    welcomed(broker, ident, active, epoch)
    assert rid in worker.unacked


def let_go_on_the_active_ones_ack(worker: Worker, active: FakeBroker, ident: bytes, epoch: int, rid: bytes) -> None:
    """The active broker welcomes the worker again: it gets the RESULT still kept, ACKs it, and
    the worker lets go of it."""
    active.welcome(ident, epoch=epoch, heartbeat_ms=QUIET)
    assert resent(active) == (ident, rid)
    active.send(ident, Command.ACK, {"ids": [rid]})
    welcomed(active, ident, True, epoch)
    assert rid not in worker.unacked


def a_active_b_passive(a: FakeBroker, b: FakeBroker) -> tuple[bytes, bytes, bytes]:
    """Both welcomed, a active at epoch 1; one echo answered to a, not ACKed. Returns a's and b's
    connections and the echo's id."""
    at_a, _ = a.next(Command.READY)
    at_b, _ = b.next(Command.READY)
    welcomed(a, at_a, True, 1)
    welcomed(b, at_b, False, 1)
    return at_a, at_b, echo(a, at_a)


def test_an_ack_from_the_passive_broker_does_not_let_go_of_a_result(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    at_a, at_b, rid = a_active_b_passive(a, b)
    ignored_ack(worker, b, at_b, False, 1, rid)  # the passive never took it
    let_go_on_the_active_ones_ack(worker, a, at_a, 1, rid)


def test_an_ack_from_an_old_active_broker_after_a_takeover_does_not_let_go_of_a_result(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    at_a, at_b, rid = a_active_b_passive(a, b)
    b_takes_over(b, at_b, rid)
    # a wakes from a freeze still saying active at epoch 1, and ACKs what the worker sent it.
    ignored_ack(worker, a, at_a, True, 1, rid)
    let_go_on_the_active_ones_ack(worker, b, at_b, 2, rid)


def test_an_active_broker_below_the_largest_epoch_seen_cannot_ack_a_result_away(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    at_a, at_b, rid = a_active_b_passive(a, b)
    b_takes_over(b, at_b, rid)
    # b's connection breaks: the worker, reconnecting there, has only a (epoch 1) saying active,
    # which is no active broker: a gets nothing, and its ACK lets go of nothing.
    b.send(at_b, Command.DISCONNECT, {"reason": "unknown worker"})
    again, ready = b.next(Command.READY)
    assert ready.header["holds"] == [rid]
    a.send(at_a, Command.ACK, {"ids": [rid]})
    welcomed(a, at_a, True, 1)  # welcomed again by a: no RESULT to it before its HEARTBEAT
    assert rid in worker.unacked and worker.active_idx is None
    b.welcome(again, epoch=2, heartbeat_ms=QUIET)  # b is back: the RESULT goes to it
    assert resent(b) == (again, rid)
