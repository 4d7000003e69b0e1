"""A worker that has just started knows no epoch (PROTOCOL.md §9.4, learning the epoch): the first
broker that says it is active may be an old active one, woken from a freeze, whose peer took over
while the worker was down. Were it followed, its DISPATCH of a task the new active broker also
holds (and places too) would run that task twice. So a fresh worker holds every DISPATCH until
each of its brokers has told it its state, or one expiry of its heartbeat policy has passed; then
it handles them at the largest epoch it has seen.

A real Worker (one simulated GPU) in a thread on real ZeroMQ sockets on loopback; the test speaks
both brokers' side of the wire protocol, each on its own ROUTER.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command
from gpud_worker.jobs import JobRunner
from gpud_worker.worker import Worker
from tests.integration.test_result_acks_pair import welcomed, worker_of_a_pair
from tests.integration.test_result_acks_worker import FakeBroker

POLICY = HeartbeatPolicy(1.0, 3)  # a fresh worker holds DISPATCHes for at most 3 s


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Worker, FakeBroker, FakeBroker]]:
    with worker_of_a_pair(JobRunner(tmp_path, None), POLICY) as running:
        yield running


def dispatch_echo(broker: FakeBroker, ident: bytes, epoch: int) -> bytes:
    rid = os.urandom(16)
    broker.send(ident, Command.DISPATCH, {"id": rid, "kind": "echo", "epoch": epoch, "tenant": "t",
                                          "grant": {"gpus": [broker.gpu]}})
    return rid


def held(worker: Worker, a: FakeBroker) -> tuple[bytes, bytes]:
    """a says it is active at epoch 1 and DISPATCHes an echo before b has told anything: a gets
    no answer, the worker holds it. Returns a's connection and the echo's id."""
    at_a, _ = a.next(Command.READY)
    welcomed(a, at_a, True, 1)
    rid = dispatch_echo(a, at_a, 1)
    welcomed(a, at_a, True, 1)  # everything a sent before is handled
    assert Command.RESULT not in a.collect(0.3)
    assert [h[2].header["id"] for h in worker._held] == [rid]
    return at_a, rid


def test_an_old_active_brokers_dispatch_to_a_fresh_worker_waits_for_the_other_broker_and_is_refused(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    # a, frozen through b's takeover at epoch 2, wakes saying it is active at epoch 1, and places
    # on this worker (restarted meanwhile) an echo b holds too.
    at_a, rid = held(worker, a)
    at_b, _ = b.next(Command.READY)
    welcomed(b, at_b, True, 2)  # b tells its state: active at epoch 2
    who, result = a.next(Command.RESULT)
    assert who == at_a and result.header["id"] == rid and result.header["code"] == "NOT_ACTIVE", result.header
    assert not worker._held
    # The worker follows b, and b's DISPATCH of the same echo runs.
    assert worker.links[worker.active_idx] is worker.links[1]  # type: ignore[index]
    b.send(at_b, Command.DISPATCH, {"id": rid, "kind": "echo", "epoch": 2, "tenant": "t", "grant": {"gpus": [b.gpu]}})
    _, answer = b.next(Command.RESULT)
    assert answer.header["id"] == rid and answer.header["ok"] is True, answer.header


def test_a_held_dispatch_runs_once_the_other_broker_says_it_is_passive_at_the_same_epoch(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    at_a, rid = held(worker, a)
    at_b, _ = b.next(Command.READY)
    welcomed(b, at_b, False, 1)
    who, result = a.next(Command.RESULT)
    assert who == at_a and result.header["id"] == rid and result.header["ok"] is True, result.header
    assert Command.RESULT not in b.collect(0.2)


def test_a_held_dispatch_runs_after_one_expiry_when_the_other_broker_never_answers(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    """A broker that is down does not keep a fresh worker from working: it delays it one expiry."""
    worker, a, b = pair
    b.sock.close(0)  # b is down: nothing answers the worker there
    at_a, rid = held(worker, a)
    _, result = a.next(Command.RESULT, timeout=POLICY.expiry + 10)
    assert result.header["id"] == rid and result.header["ok"] is True, result.header
    assert not worker._held and worker._learn_until is None
