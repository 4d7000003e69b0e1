"""Chaos: a worker killed with SIGKILL under load, and a GPU fault injected mid-session.

Three workers of SIMULATED GPUs: w1 is w0's replica (``--replica-of w0``), w2 is not. Work w0 was
running goes to w1 when it may be retried; the rest gets WORKER_LOST; nothing runs twice that is
not idempotent; a session on a faulted GPU goes on, replayed, with correct numbers.
"""

from __future__ import annotations

import json
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpud.errors import GpudError
from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client
from tests.integration.chaos import executions


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[LocalCluster]:
    faults = tmp_path / "faults.json"
    faults.write_text("[]")
    # One tenant here: it may hold all of a worker's pool users (the default share is half), so that
    # a replica has room for all of the lost worker's jobs.
    c = LocalCluster(workers=0, gpus_per_worker=1, heartbeat_ms=200, rundir=tmp_path,
                     worker_args=["--log-level", "DEBUG", "--fault-file", str(faults), "--probation", "600"],
                     env={"GPUD_BROKER_TENANT_POOL_SHARE": "1"})
    c.start()
    try:
        c.add_worker("w0")
        c.add_worker("w1", extra=["--replica-of", "w0"])
        c.add_worker("w2")
        c.wait_workers(3)
        yield c
    finally:
        c.stop()


JOBS = 12


def test_worker_killed_under_load(trio: LocalCluster) -> None:
    results: dict[str, list[object]] = {"echo": [], "idem": [], "once": []}
    errors: dict[str, list[str]] = {"echo": [], "idem": [], "once": []}
    started = threading.Event()

    def load() -> None:
        with Client(trio.frontend, timeout=60) as c:
            pend = []
            # JOBS of each kind: the replica w1 must have a pool user (16 per worker) for each of
            # its own jobs and each of w0's idempotent ones when w0 dies.
            for i in range(JOBS):
                pend.append(("idem", f"i{i}", c.submit(["sh", "-c", f"sleep 1; echo i{i}"], gpu_milli=20, idempotent=True)))
                pend.append(("once", f"o{i}", c.submit(["sh", "-c", f"sleep 1; echo o{i}"], gpu_milli=20)))
            for i in range(300):
                pend.append(("echo", f"e{i}".encode(), c.submit_echo(f"e{i}".encode())))
            started.set()
            for kind, expect, p in pend:
                try:
                    got = p.wait()
                except GpudError as exc:
                    errors[kind].append(f"{p.id.hex()[:12]} {exc.code}")
                    continue
                if kind == "echo":
                    assert got == expect
                else:
                    assert got.exit_code == 0 and got.stdout.decode().strip() == expect, got
                results[kind].append((p.id.hex()[:12], getattr(got, "worker", None)))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    assert started.wait(30)
    time.sleep(0.5)  # jobs are running on every worker now
    trio.kill_worker("w0")
    t.join(120)
    assert not t.is_alive()

    _, job_runs = executions([trio.rundir / f"{w}.log" for w in ("w0", "w1", "w2")])  # type: ignore[operator]
    print({k: len(v) for k, v in results.items()}, {k: len(v) for k, v in errors.items()})
    # Retryable work always ends with its result: echoes, and idempotent jobs run again.
    assert not errors["echo"] and len(results["echo"]) == 300
    assert not errors["idem"] and len(results["idem"]) == JOBS
    # Work that may not run twice either finished or says WORKER_LOST, and ran at most once.
    assert len(results["once"]) + len(errors["once"]) == JOBS
    assert all(e.endswith("WORKER_LOST") for e in errors["once"]), errors["once"]
    assert errors["once"], "w0 was running some jobs when it was killed"
    once_ids = [i for i, _ in results["once"]] + [e.split()[0] for e in errors["once"]]
    assert all(job_runs[i] <= 1 for i in once_ids)
    # w0's idempotent jobs ran again on its replica w1 (it has room for them all), never on w2.
    rerun = [(i, w) for i, w in results["idem"] if job_runs[i] > 1]
    assert rerun, "some idempotent job was running on w0 when it died"
    assert all(w == "w1" for _, w in rerun), rerun


def test_gpu_fault_mid_session_replays_with_correct_numbers(trio: LocalCluster) -> None:
    n = 256
    xs = [float(i) for i in range(n)]
    ys = [float(2 * i + 1) for i in range(n)]
    with Client(trio.frontend, timeout=30) as c:
        s = _session_on(c, "w0")
        x, y = s.mem_alloc(4 * n), s.mem_alloc(4 * n)
        s.memcpy_htod(x, struct.pack(f"{n}f", *xs))
        s.memcpy_htod(y, struct.pack(f"{n}f", *ys))
        s.launch(BUILTIN, "saxpy", grid=(4,), block=(64,), args=[np.float32(2.0), x, y, np.int32(n)])
        first = s.worker
        # SIMULATED fault: XID 79 (fallen off the bus) on the session's GPU.
        (trio.rundir / "faults.json").write_text(json.dumps([{"gpu": 0, "fault": "xid", "xid": 79}]))  # type: ignore[operator]
        trio.worker_procs[first].send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        s.launch(BUILTIN, "saxpy", grid=(4,), block=(64,), args=[np.float32(1.0), x, y, np.int32(n)])
        got = struct.unpack(f"{n}f", s.memcpy_dtoh(y, 4 * n))
        assert got == tuple(3.0 * a + b for a, b in zip(xs, ys, strict=True))
        assert (first, s.worker, s.replays) == ("w0", "w1", 1)  # replayed once, on w0's replica
        s.close()


def _session_on(c: Client, worker: str):  # type: ignore[no-untyped-def]
    """A session on ``worker``: open sessions until the policy puts one there, close the others."""
    others = []
    for _ in range(12):
        s = c.session(mem=1 << 20)
        if s.worker == worker:
            for o in others:
                o.close()
            return s
        others.append(s)
    raise AssertionError(f"no session landed on {worker}")
