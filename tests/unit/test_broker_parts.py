"""The broker core's parts on their own (``admission``, ``dispatcher``, ``workers``, ``results``,
``sessions``): each built from real tables (registry, accounts, leases, staging) around a small
stand-in for the core they call back into, with plain lists as sockets and a time set by hand."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpud import protocol as P
from gpud.errors import (
    Busy,
    GpudError,
    GpuFault,
    NoCapacity,
    NotActive,
    ProtocolError,
    TooLarge,
    WorkerLost,
)
from gpud.protocol import Command, Message, Peer
from gpud.resources import Need, TenantLimits
from gpud_broker.accounts import Accounts, Budgets, TenantBudget
from gpud_broker.admission import Admission
from gpud_broker.config import BrokerConfig
from gpud_broker.dispatcher import Dispatcher
from gpud_broker.leases import SessionLeases
from gpud_broker.queue import PendingQueue
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.replication import MARKS, Journal
from gpud_broker.results import Results
from gpud_broker.sessions import SessionEnds
from gpud_broker.spool import Spool
from gpud_broker.staging import Staging
from gpud_broker.stats import RequestStats
from gpud_broker.tasks import Session, State, Task, TaskTable
from gpud_broker.workers import WorkerDialog

GiB = 1 << 30
W1, W2 = b"conn-w1", b"conn-w2"


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


@dataclass
class Core:
    """What the parts read of ``BrokerCore`` and call back into (their ``*Core`` protocols): the
    role and tables as plain fields, and the ends of work recorded instead of answered."""

    config: BrokerConfig = field(default_factory=BrokerConfig)
    now: float = 1000.0
    active: bool = True
    hold: bool = False
    epoch: int = 3
    acking: bool = False
    fenced: bool = False
    max_epoch_seen: int = 3
    worker_names_bound: bool = False
    journal: Journal = field(default_factory=Journal)
    queue: PendingQueue[Task] = field(default_factory=lambda: PendingQueue(100))
    tasks: TaskTable = field(default_factory=lambda: TaskTable(60.0, 1 << 20))
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("bad_messages", "refused_workers", "worker_losses", "job_timeouts"), 0))
    failed: list[tuple[Task, GpudError]] = field(default_factory=list)
    finished: list[tuple[Task, Message]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)

    def fail(self, task: Task, exc: GpudError) -> None:
        task.state = State.DONE
        self.failed.append((task, exc))

    def finish(self, task: Task, reply: list[Any]) -> None:
        task.state = State.DONE
        self.finished.append((task, P.decode(reply, Peer.CLIENT)))

    def worker_gone(self, name: str) -> None:
        self.gone.append(name)

    def pull_outputs(self, worker: WorkerRecord, task: Task, raw_header: bytes, frames: list[Any], staged: Any) -> bool:
        raise AssertionError("no staged outputs in these tests")


class Parts:
    """The parts wired as ``BrokerCore._parts`` wires them, around a ``Core`` stand-in."""

    def __init__(self, spool_dir: Path, seed: int = 0, **config: Any) -> None:
        self.core = Core(config=BrokerConfig(**config))
        self.sent: list[tuple[bytes, Message]] = []
        self.heard_epochs: list[Any] = []
        self.registry = WorkerRegistry()
        self.accounts = Accounts(self.registry, {}, self.core.config.tenant_limits,
                                 Budgets(default=TenantBudget(max_queued=2, max_deadline_ms=60_000)))
        self.leases = SessionLeases(30.0)
        self.staging = Staging(Spool(str(spool_dir), 1 << 20), 1 << 20, 60.0)
        self.stats = RequestStats()
        self.admission = Admission(self.accounts, self.staging, self.leases)
        self.dispatcher = Dispatcher(self.core, self.registry, self.accounts, self.stats, self.send, random.Random(seed))
        self.session_ends = SessionEnds(self.core, self.leases, self.accounts, self.registry, self.dispatcher)
        self.results = Results(self.core, self.registry, self.accounts, self.leases, self.session_ends,
                               self.dispatcher, self.staging, self.stats, self.send)
        self.workers = WorkerDialog(self.core, self.registry, self.accounts, self.leases, self.session_ends,
                                    self.dispatcher, self.heard, self.results.starts, self.send)

    def heard(self, worker: WorkerRecord, epoch: Any, running: Any) -> None:
        """The takeover's settling, told of each heartbeat (this broker never took over)."""
        self.heard_epochs.append(epoch)

    def send(self, ident: bytes, frames: list[Any]) -> None:
        self.sent.append((ident, P.decode(frames, Peer.WORKER)))

    def take(self) -> list[tuple[bytes, Message]]:
        out, self.sent = self.sent, []
        return [(i, m) for i, m in out if m.command is not Command.HEARTBEAT]

    def ready(self, ident: bytes, name: str, uuid: str | None = None, slots: int = 4) -> WorkerRecord:
        header = {"name": name, "gpus": [{"uuid": uuid or f"GPU-{name}", "index": 0, "model": "A100", "mem": 16 * GiB,
                                          "cc": [8, 0]}], "cpu_milli": 8000, "host_mem": 64 * GiB, "slots": slots}
        self.workers.on_ready(ident, self.registry.by_identity.get(ident), header)
        worker = self.registry.by_identity[ident]
        return worker

    def task(self, n: int, kind: str = "echo", retryable: bool = True, **need: Any) -> Task:
        task = Task(id=rid(n), kind=kind, need=Need(**need), body={}, frames=[], route=b"client", created=self.core.now,
                    deadline=self.core.now + 30, retryable=retryable)
        self.core.tasks.add(task)
        return task

    def result(self, worker: WorkerRecord, header: dict[str, Any]) -> None:
        enc = P.encode(Peer.WORKER, Command.RESULT, header)
        self.results.on_result(worker, P.decode(enc, Peer.WORKER), enc[2])


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    p = Parts(tmp_path)
    yield p
    p.staging.spool.close()


# --------------------------------------------------------------------------- admission


def _request(kind: str = "echo", **fields: Any) -> P.Request:
    return P.parse_request({"id": rid(1), "kind": kind, **fields}, 0, P.NeedCache(), 30_000)


def test_admission_refuses_by_deadline_payload_and_limits_and_takes_the_rest(tmp_path: Path) -> None:
    p = Parts(tmp_path, max_echo_bytes=100, tenant_limits={"alice": TenantLimits(max_milli=500)})
    cfg, adm = p.core.config, p.admission
    assert adm.refusal(rid(1), _request(), Need(), 100, None, cfg) is None
    long = adm.refusal(rid(1), _request(deadline_ms=60_001), Need(), 0, None, cfg)
    assert isinstance(long, TooLarge) and "max_deadline_ms (60000)" in long.message
    big = adm.refusal(rid(1), _request(), Need(), 101, None, cfg)
    assert isinstance(big, TooLarge) and "max_echo_bytes (100)" in big.message
    over = adm.refusal(rid(1), _request(), Need(gpu_milli=600, tenant="alice"), 0, None, cfg)
    assert isinstance(over, NoCapacity) and "alice" in over.message
    assert adm.refusal(rid(1), _request(), Need(gpu_milli=400, tenant="alice"), 0, None, cfg) is None
    p.staging.spool.close()


def test_admission_lets_a_tenant_queue_up_to_its_budget(parts: Parts) -> None:
    assert parts.admission.queue_refusal("bob", 1) is None
    full = parts.admission.queue_refusal("bob", 2)
    assert isinstance(full, Busy) and "max_queued" in full.message


# --------------------------------------------------------------------------- dispatcher


def test_the_dispatcher_charges_the_grant_and_dispatches_it_at_the_epoch(parts: Parts) -> None:
    worker = parts.ready(W1, "w1", slots=1)
    parts.take()
    assert parts.dispatcher.open_workers == 1
    task = parts.task(1, gpu_milli=250, mem=GiB)
    assert parts.dispatcher.try_dispatch(task)
    [(ident, msg)] = parts.take()
    assert ident == W1 and msg.command is Command.DISPATCH
    assert msg.header["epoch"] == 3 and msg.header["grant"]["gpu_milli"] == 250 and msg.header["grant"]["mem"] == GiB
    assert task.state is State.RUNNING and worker.assigned == {rid(1): task}
    assert worker.gpus[0].granted_milli == 250
    # Its one slot is taken: nothing more is placed, and the count agrees with a recount.
    assert parts.dispatcher.open_workers == 0 == parts.dispatcher.count_open_workers()
    assert not parts.dispatcher.try_dispatch(parts.task(2))
    parts.dispatcher.freed(worker)
    assert parts.dispatcher.open_workers == 1 == parts.dispatcher.count_open_workers()


def test_the_dispatcher_places_nothing_while_held(parts: Parts) -> None:
    parts.ready(W1, "w1")
    parts.take()
    parts.core.hold = True
    assert not parts.dispatcher.try_dispatch(parts.task(1)) and parts.take() == []
    assert parts.dispatcher.place_queued() == 0


def test_placed_again_it_avoids_the_worker_that_failed_it_and_fails_after_its_attempts(parts: Parts) -> None:
    parts.ready(W1, "w1")
    parts.ready(W2, "w2")
    parts.take()
    task = parts.task(1)
    task.attempts = 1
    parts.dispatcher.place_again(task, "w1", "test")
    [(ident, _)] = parts.take()
    assert ident == W2 and task.avoid == {"w1"} and task.attempts == 2
    task.attempts = parts.core.config.max_attempts
    parts.dispatcher.place_again(task, "w2", "test")
    [(failed, exc)] = parts.core.failed
    assert failed is task and isinstance(exc, WorkerLost) and "after 3 attempts" in exc.message


@pytest.mark.parametrize("policy", ["random", "fgd-balanced"])
def test_the_dispatcher_seeds_its_policy_so_the_same_events_place_the_same_way(tmp_path: Path, policy: str) -> None:
    def placements(seed: int) -> list[str | None]:
        p = Parts(tmp_path / f"{seed}", seed=seed, policy=policy)
        for n in range(80):
            p.ready(b"conn-%d" % n, f"w{n}", slots=1)
        tasks = [p.task(n) for n in range(60)]
        for task in tasks:
            assert p.dispatcher.try_dispatch(task)
        p.staging.spool.close()
        return [task.worker for task in tasks]

    first = placements(1)
    assert placements(1) == first
    if policy == "random":
        assert placements(2) != first


# --------------------------------------------------------------------------- workers


def test_a_ready_worker_is_welcomed_and_a_gpu_registered_twice_is_refused(parts: Parts) -> None:
    parts.ready(W1, "w1", uuid="GPU-x")
    [(ident, welcome)] = parts.take()
    assert ident == W1 and welcome.command is Command.WELCOME
    assert (welcome.header["epoch"], welcome.header["active"], welcome.header["acks"]) == (3, True, True)
    header = {"name": "w2", "gpus": [{"uuid": "GPU-x", "index": 0, "model": "A100", "mem": GiB, "cc": [8, 0]}]}
    parts.workers.on_ready(W2, None, header)
    [(ident, refusal)] = parts.take()
    assert ident == W2 and refusal.command is Command.DISCONNECT
    assert "GPU GPU-x is already registered by worker w1" in refusal.header["reason"]
    assert parts.core.counters["refused_workers"] == 1 and W2 not in parts.registry.by_identity


def test_a_heartbeat_showing_a_later_epoch_fences_an_active_broker(parts: Parts) -> None:
    worker = parts.ready(W1, "w1")
    parts.workers.on_heartbeat(worker, {"seq": 1, "epoch": 3})
    assert not parts.core.fenced
    parts.workers.on_heartbeat(worker, {"seq": 2, "epoch": 4})
    assert parts.core.fenced and parts.core.max_epoch_seen == 4 and parts.heard_epochs == [3, 4]


def test_a_lost_worker_s_retryable_work_goes_elsewhere_and_the_rest_fails(parts: Parts) -> None:
    w1 = parts.ready(W1, "w1")
    parts.ready(W2, "w2")
    echo, job = parts.task(1), parts.task(2, kind="job", retryable=False)
    for task in (echo, job):
        parts.dispatcher.send(w1, task)
    job.started = True  # told GO: it may have begun, and may not run twice
    parts.take()
    parts.workers.lost(w1, "test")
    assert parts.core.gone == ["w1"] and parts.core.counters["worker_losses"] == 1
    [(ident, msg)] = parts.take()
    assert ident == W2 and msg.header["id"] == rid(1)
    [(failed, exc)] = parts.core.failed
    assert failed is job and isinstance(exc, WorkerLost)
    assert parts.dispatcher.open_workers == 1 == parts.dispatcher.count_open_workers()


def test_a_drain_mark_closes_the_worker_to_new_work_and_is_replicated(parts: Parts) -> None:
    parts.ready(W1, "w1")
    parts.core.journal.take()
    parts.workers.mark_drained("w1", True)
    assert parts.registry.by_name["w1"].draining and parts.dispatcher.open_workers == 0
    assert parts.core.journal.take() == [[MARKS, ["w1"], []]]
    parts.workers.mark_drained("w1", False)
    assert parts.dispatcher.open_workers == 1


# --------------------------------------------------------------------------- results


def test_a_result_answers_the_client_and_frees_the_slot_and_grant(parts: Parts) -> None:
    worker = parts.ready(W1, "w1", slots=1)
    task = parts.task(1, gpu_milli=500)
    parts.dispatcher.try_dispatch(task)
    parts.take()
    parts.result(worker, {"id": rid(1), "ok": True})
    [(done, reply)] = parts.core.finished
    assert done is task and reply.command is Command.REPLY and reply.header["ok"] is True
    assert worker.assigned == {} and worker.gpus[0].granted_milli == 0 and parts.dispatcher.open_workers == 1


def test_a_gpu_fault_places_it_again_and_not_active_fences_and_keeps_it(parts: Parts) -> None:
    w1, w2 = parts.ready(W1, "w1"), parts.ready(W2, "w2")
    task = parts.task(1)
    parts.dispatcher.send(w1, task)
    parts.take()
    parts.result(w1, {"id": rid(1), "ok": False, "code": GpuFault.code, "message": "Xid 79"})
    [(ident, _)] = parts.take()
    assert ident == W2 and "w1" in task.avoid and parts.core.finished == []
    parts.result(w2, {"id": rid(1), "ok": False, "code": NotActive.code, "message": "epoch 9 is later"})
    assert parts.core.fenced and w2.assigned == {rid(1): task} and parts.core.finished == []


def test_a_malformed_result_answers_a_protocol_error(parts: Parts) -> None:
    worker = parts.ready(W1, "w1")
    parts.dispatcher.send(worker, parts.task(1))
    parts.result(worker, {"id": rid(1), "ok": "yes"})
    [(_, reply)] = parts.core.finished
    assert reply.header["ok"] is False and reply.header["code"] == ProtocolError.code


def test_in_a_pair_a_result_is_acked_once_durable_and_a_start_waits_for_its_mark(parts: Parts) -> None:
    parts.core.acking = True
    worker = parts.ready(W1, "w1")
    parts.dispatcher.send(worker, parts.task(1))
    job = parts.task(2, kind="job", retryable=False)
    parts.dispatcher.send(worker, job)
    parts.take()
    parts.result(worker, {"id": rid(1), "ok": True})
    assert parts.results.take_acks() == {}
    parts.results.on_start(worker, {"ids": [rid(2)]})
    assert parts.take() == [] and job.started and parts.results.take_go() == {}
    parts.core.journal.durable = parts.core.journal.seq
    assert parts.results.take_acks() == {W1: [rid(1)]}
    [go] = parts.results.take_go().values()
    assert P.decode(go, Peer.WORKER).header["ids"] == [rid(2)]


# --------------------------------------------------------------------------- sessions


def _open_session(parts: Parts, worker: WorkerRecord, n: int) -> Session:
    task = parts.task(n, kind="session")
    parts.dispatcher.try_dispatch(task)
    parts.take()
    parts.result(worker, {"id": rid(n), "ok": True})
    return parts.leases.sessions[rid(n)]


def test_a_lapsed_session_is_closed_on_its_worker_and_its_end_refunds_it(parts: Parts) -> None:
    worker = parts.ready(W1, "w1")
    s = _open_session(parts, worker, 1)
    assert worker.gpus[0].granted_milli == 1000
    parts.core.now += 31
    parts.session_ends.expire_lapsed(parts.core.now)
    [(ident, close)] = parts.take()
    assert ident == W1 and close.header["op"] == "close" and close.header["session"] == s.id and s.closing
    parts.session_ends.end(s.id)
    assert s.id not in parts.leases.sessions and worker.gpus[0].granted_milli == 0


def test_a_stray_session_gets_one_close_at_a_time(parts: Parts) -> None:
    worker = parts.ready(W1, "w1")
    parts.take()
    parts.session_ends.close_stray(worker, rid(7), "bob")
    [(_, close)] = parts.take()
    assert close.header["session"] == rid(7) and close.header["tenant"] == "bob"
    parts.session_ends.close_stray(worker, rid(7), "bob")
    assert parts.take() == []  # the first close is unanswered
