"""A job's held staged outputs (``gpud_worker.held_outputs``) go as soon as no RESULT will name
them: a job stopped by the broker or killed for its GPU's fault after it ran lets its outputs'
room in the hold go at once, not at UNACKED_TTL (a hold that leaks fills, and then every tenant's
finished jobs wait and end BUSY). Real files and a real hold; the job's run is its outcome alone
(the worker's bookkeeping after ``JobRunner.run`` is what is tested)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import SimulatedProbe, simulated_gpus
from gpud_worker.held_outputs import OutputHold
from gpud_worker.jobs import JobOutcome, JobRunner
from gpud_worker.worker import Worker, WorkerConfig

MiB = 1 << 20


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[Worker, OutputHold, Path]]:
    device = SimulatedDevice(simulated_gpus(1, mem=1 << 20, worker_name="wh")[0])
    ctx: zmq.Context[Any] = zmq.Context()
    hold = OutputHold(tmp_path, limit=64 * MiB)
    w = Worker(WorkerConfig(name="wh", brokers=("tcp://127.0.0.1:9",)), SimulatedProbe([device]),
               {device.gpu.uuid: device}, JobRunner(tmp_path / "jobs", hold=hold), ctx)
    out = tmp_path / "out"
    out.write_bytes(b"o" * (12 * MiB))
    try:
        yield w, hold, out
    finally:
        w.jobs.shutdown(wait=True)
        w.close_wake_pipe()
        ctx.term()


def ran(w: Worker, hold: OutputHold, out: Path, rid: bytes) -> None:
    """``rid`` ran, and its outputs were taken into the hold; the worker now reports it."""
    fd = os.open(out, os.O_RDONLY)
    try:
        held = hold.take(rid.hex(), "acme", ["out"], [(fd, out.stat().st_size)])
    finally:
        os.close(fd)
    outcome = JobOutcome(exit_code=0, timed_out=False, stdout=b"", stderr=b"", stdout_truncated=False,
                         stderr_truncated=False, files=[], user="u", held=held)
    w.runner.run = lambda *a, **k: outcome  # type: ignore[method-assign]
    assert hold.held == 12 * MiB
    w._run_job(0, rid, {"argv": ["x"], "outputs": ["out"]}, [], [next(iter(w.devices))], "acme")


def test_a_job_the_broker_stopped_after_it_ran_lets_its_held_outputs_go(
        worker: tuple[Worker, OutputHold, Path]) -> None:
    w, hold, out = worker
    rid = b"\x01" * 8
    w._stopped.add(rid)
    ran(w, hold, out, rid)
    assert hold.held == 0 and rid not in w.staged_out


def test_a_job_killed_for_its_gpus_fault_lets_its_held_outputs_go(worker: tuple[Worker, OutputHold, Path]) -> None:
    w, hold, out = worker
    rid = b"\x02" * 8
    w._job_cancels[rid] = threading.Event()
    w._job_cancels[rid].set()  # its GPU failed while it ran
    ran(w, hold, out, rid)
    assert hold.held == 0 and rid not in w.staged_out
    _, _, frames = w.results.get_nowait()
    assert b"GPU_FAULT" in b"".join(bytes(f) for f in frames)  # its RESULT says why, without outputs


def test_a_job_that_ran_keeps_its_held_outputs_until_the_ack(worker: tuple[Worker, OutputHold, Path]) -> None:
    w, hold, out = worker
    rid = b"\x03" * 8
    ran(w, hold, out, rid)
    assert hold.held == 12 * MiB and rid in w.staged_out
    w._drop_outputs(rid)  # what an ACK does
    assert hold.held == 0


def test_the_heartbeat_says_how_many_output_bytes_the_worker_holds(worker: tuple[Worker, OutputHold, Path]) -> None:
    from gpud import protocol
    from gpud.protocol import Peer

    w, hold, out = worker
    link = w.links[0]
    link.sock = object()  # type: ignore[assignment]  # taken for connected: HEARTBEATs are queued, not sent
    link.flush = lambda: None  # type: ignore[method-assign]

    def beat() -> Any:
        w._beat(link, 1.0)
        return protocol.decode(link.out.pop(), Peer.WORKER).header["held_outputs"]

    try:
        assert beat() == 0
        ran(w, hold, out, b"\x04" * 8)
        assert beat() == 12 * MiB
        w._drop_outputs(b"\x04" * 8)  # fetched and ACKed
        assert beat() == 0
    finally:
        link.sock = None
