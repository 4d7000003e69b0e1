"""A worker regards as active only a broker that says so at the largest epoch it has seen
(PROTOCOL.md §9.4): while the connection to that broker is down, an old active broker at a lower
epoch (woken from a freeze, not yet told of the takeover) is no active one. It gets no START, and
its GO is ignored: a GO from a broker that lost its activity is a way for a job to begin twice
(the new active broker may have placed it again). The job waits for the new active broker's GO.

A real Worker (one simulated GPU, jobs as pool users of a dynamic uid block) in a thread on real
ZeroMQ sockets on loopback; the test speaks both brokers' side of the wire protocol.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.protocol import Command
from gpud_cli.uid_ranges import UidBlocks
from gpud_worker.jobs import JobRunner, UserPool
from gpud_worker.worker import Worker
from tests.integration.test_result_acks_pair import (
    QUIET,
    a_active_b_passive,
    b_takes_over,
    beat,
    resent,
    welcomed,
    worker_of_a_pair,
)
from tests.integration.test_result_acks_worker import FakeBroker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as pool users: root")

UID_BASE = 64000  # as test_isolation: above the blocks older gpud clusters use unlocked


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Worker, FakeBroker, FakeBroker]]:
    blocks = UidBlocks(UID_BASE)
    os.chmod(tmp_path, 0o711)
    try:
        with worker_of_a_pair(JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", blocks.take()[:1]))) as running:
            yield running
    finally:
        blocks.close()


def ready_again(broker: FakeBroker, old: bytes) -> bytes:
    """The worker's READY on its new connection to ``broker``; returns that connection. A START
    sent twice on the old one (asked again while the first was queued: the broker answers each)
    is passed over."""
    deadline = time.monotonic() + 10
    while not any(m.command is Command.READY for _, m in broker.pending):
        assert time.monotonic() < deadline, "no READY again within 10s"
        broker.collect(0.05)
        broker.pending = [(i, m) for i, m in broker.pending if not (i == old and m.command is Command.START)]
    again, _ = broker.next(Command.READY)
    return again


def test_an_old_active_broker_at_a_lower_epoch_gets_no_start_and_its_go_starts_nothing(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    worker, a, b = pair
    at_a, _ = a.next(Command.READY)
    at_b, _ = b.next(Command.READY)
    welcomed(a, at_a, True, 1)
    welcomed(b, at_b, False, 1)
    beat(b, at_b, True, 2)  # b takes over
    b.next(Command.HEARTBEAT)  # the worker follows it
    rid = os.urandom(16)
    b.send(at_b, Command.DISPATCH, {"id": rid, "kind": "job", "epoch": 2, "tenant": "t", "argv": ["true"],
                                     "grant": {"gpus": [b.gpu]}})
    _, start = b.next(Command.START)
    assert start.header["ids"] == [rid]
    # b's connection breaks before its GO: the worker reconnects there. a, frozen through the
    # takeover, still says it is active at epoch 1, and says GO for the job (a START it kept).
    b.send(at_b, Command.DISCONNECT, {"reason": "unknown worker"})
    again = ready_again(b, at_b)
    a.send(at_a, Command.GO, {"ids": [rid]})
    welcomed(a, at_a, True, 1)  # everything a sent is handled
    assert not {Command.START, Command.RESULT} & set(a.collect(0.3))
    assert worker.start_waits.keys() == {rid}  # the job still waits for its GO
    # b welcomes the worker again at epoch 2: the job's START goes to it, and its GO starts it.
    b.welcome(again, epoch=2, heartbeat_ms=QUIET)
    _, start = b.next(Command.START)
    assert start.header["ids"] == [rid]
    b.send(again, Command.GO, {"ids": [rid]})
    who, result = b.next(Command.RESULT)
    assert who == again and result.header["id"] == rid and result.header["exit_code"] == 0, result.header


def test_a_broker_active_below_the_largest_epoch_is_shown_it_and_followed_once_it_takes_over_above(
        pair: tuple[Worker, FakeBroker, FakeBroker]) -> None:
    """Not stuck: the lower broker is shown the largest epoch (a real one steps down on it, §9.1),
    and once it takes over above it, the worker follows it."""
    worker, a, b = pair
    at_a, at_b, rid = a_active_b_passive(a, b)
    b_takes_over(b, at_b, rid)
    b.send(at_b, Command.DISCONNECT, {"reason": "unknown worker"})  # b's connection breaks
    b.next(Command.READY)
    a.welcome(at_a, epoch=1, heartbeat_ms=QUIET)  # a says it is active at epoch 1 (restarted, or frozen)
    _, shown = a.next(Command.HEARTBEAT)  # no RESULT before it: a is not followed
    assert shown.header["epoch"] == 2 and worker.active_idx is None
    beat(a, at_a, True, 4)  # a took over above every epoch it has seen
    assert resent(a) == (at_a, rid)
    a.send(at_a, Command.ACK, {"ids": [rid]})
    welcomed(a, at_a, True, 4)
    assert rid not in worker.unacked
