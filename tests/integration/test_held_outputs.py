"""A worker holds its finished jobs' staged outputs on disk, not in its memory, until the broker
has them (PROTOCOL.md §11.5, ``gpud_worker.held_outputs``): concurrent jobs' large outputs leave
its peak resident memory where it was, every byte comes back right, and ``max_held_output_bytes``
bounds them together (a job whose outputs must wait for room gets it once others are fetched;
one over it alone ends TOO_LARGE, naming the key).

Real daemons (a broker and a worker with two simulated GPUs, labelled simulated) as subprocesses
on loopback, the real client, real jobs under restricted users.
"""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.errors import TooLarge
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

MiB = 1 << 20
JOBS = 3  # at once, each with OUT bytes of outputs
OUT = 150 * MiB
HELD_LIMIT = 400 * MiB  # the worker's max_held_output_bytes: one tenant's half holds one job's outputs, not two


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=2, rundir=tmp_path_factory.mktemp("held"),
                      worker_args=["--max-held-output-bytes", str(HELD_LIMIT)]) as c:
        yield c


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def expected(seed: int, nbytes: int) -> bytes:
    line = f"output-of-job-{seed}\n".encode()
    return (line * (nbytes // len(line) + 1))[:nbytes]


def submit(c: Client, seed: int, nbytes: int = OUT) -> Any:
    script = f"yes output-of-job-{seed} | head -c {nbytes} > out; echo done"
    return c.submit(["sh", "-c", script], outputs=["out"], gpu_milli=100, time_limit=120)


def outputs(job: Any) -> bytes:
    res = job.wait(timeout=180)
    assert res.exit_code == 0 and res.stdout == b"done\n", res.stderr
    return res.files["out"]


def make_outputs(c: Client, seed: int, nbytes: int = OUT) -> bytes:
    return outputs(submit(c, seed, nbytes))


def test_concurrent_jobs_large_outputs_stay_out_of_the_workers_memory(cluster: LocalCluster) -> None:
    """Three jobs finish together with 150 MiB of outputs each; their tenant's half of the
    worker's limit holds one at a time, so two wait until the broker has fetched the one before.
    Each comes back right, and the worker's peak RSS grows by far less than one job's outputs
    (read into memory, as they were, they take 450 MiB of it at once)."""
    worker = cluster.worker_procs["w0"].pid
    with Client(cluster.frontend, timeout=180) as c:
        make_outputs(c, 0, 10 * MiB)  # the worker's own warm-up (first job, first staged outputs)
        before = peak_rss(worker)
        jobs = [submit(c, i) for i in range(1, JOBS + 1)]
        outs = [outputs(job) for job in jobs]
        after = peak_rss(worker)
    for i, out in enumerate(outs, 1):
        assert hashlib.sha256(out).digest() == hashlib.sha256(expected(i, OUT)).digest(), f"job {i}"
    assert after - before < 64 * MiB, f"the worker's peak RSS grew by {(after - before) >> 20} MiB"
    log = cluster.log_tail("w0", 400)
    assert "wait for room" in log  # the limit held: two of the three waited for the one before


def test_outputs_over_a_tenants_half_of_max_held_output_bytes_are_too_large_naming_it(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=180) as c:
        with pytest.raises(TooLarge, match="max_held_output_bytes"):
            make_outputs(c, 9, HELD_LIMIT // 2 + MiB)
        assert make_outputs(c, 10, 20 * MiB) == expected(10, 20 * MiB)  # and the hold is empty again


def test_a_worker_stopped_while_outputs_wait_for_room_still_delivers_both_as_it_drains(
        cluster: LocalCluster) -> None:
    """SIGTERM while a job's outputs wait for room in the hold: the worker drains, the broker
    fetches the held outputs, and the waiting ones take the room that frees and come back too
    (the wait ends BUSY only by the drain's deadline, ``OutputHold.stop``). The broker is
    paused (SIGSTOP) while the jobs finish, so that nothing is fetched and the second must wait."""
    broker = cluster.brokers["broker"]
    worker = cluster.worker_procs["w0"]
    with Client(cluster.frontend, timeout=180) as c:
        script = f"sleep 1; yes output-of-job-{{}} | head -c {OUT} > out; echo done"
        jobs = [c.submit(["sh", "-c", script.format(i)], outputs=["out"], gpu_milli=100, time_limit=60)
                for i in (21, 22)]
        time.sleep(0.5)  # both running (placed at once: two GPUs), each a second from its outputs
        waits_before = cluster.log_tail("w0", 2000).count("wait for room")
        broker.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while cluster.log_tail("w0", 2000).count("wait for room") == waits_before:
                assert time.monotonic() < deadline, "no job's outputs waited for room"
                time.sleep(0.02)
            worker.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        finally:
            broker.send_signal(signal.SIGCONT)
        outs = [outputs(job) for job in jobs]
    assert worker.wait(timeout=60) == 0
    assert outs == [expected(21, OUT), expected(22, OUT)]
