"""The worker's wake pipe: threads (job threads, session threads, a signal handler) write a byte
to it to wake the loop; the loop closes it on stop. A wake racing the close must never write
into whatever descriptor reuses the closed one's number, nor fail."""

from __future__ import annotations

import os
import threading
from typing import Any

import zmq

from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import SimulatedProbe, simulated_gpus
from gpud_worker.jobs import JobRunner
from gpud_worker.worker import Worker, WorkerConfig


def test_a_wake_racing_the_close_writes_nowhere_else(tmp_path: Any) -> None:
    """Threads wake the loop as fast as they can while it closes the pipe and at once opens pipes
    that take the freed numbers: none of those gets a byte, and no wake raises."""
    leaked = errors = 0
    for _ in range(60):
        device = SimulatedDevice(simulated_gpus(1, mem=1 << 20, worker_name="ww")[0])
        ctx: zmq.Context[Any] = zmq.Context()
        worker = Worker(WorkerConfig(name="ww", brokers=("tcp://127.0.0.1:9",)), SimulatedProbe([device]),
                        {device.gpu.uuid: device}, JobRunner(tmp_path / "jobs"), ctx)
        stop = threading.Event()
        failures: list[BaseException] = []

        def hammer(worker: Worker = worker, stop: threading.Event = stop, failures: list[BaseException] = failures) -> None:
            while not stop.is_set():
                try:
                    worker._wake()
                except BaseException as exc:  # what the test counts
                    failures.append(exc)
                    return

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        worker.close_wake_pipe()
        reused = [os.pipe() for _ in range(4)]  # the lowest free numbers: the pipe's, just closed
        for r, _ in reused:
            os.set_blocking(r, False)
        stop.set()
        for t in threads:
            t.join()
        for r, w in reused:
            try:
                leaked += len(os.read(r, 65536))
            except BlockingIOError:
                pass
            os.close(r)
            os.close(w)
        errors += len(failures)
        worker.jobs.shutdown(wait=True)
        ctx.term()
    assert (leaked, errors) == (0, 0)
