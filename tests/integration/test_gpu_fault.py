"""GPU health end to end: SIMULATED faults injected into a live worker's simulated GPU (its fault
file, then SIGUSR2) take the GPU out of placement, fail the work on it, show in gpudctl, and the
GPU serves again after its probation once the fault is cleared."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.errors import GpuFault
from gpud_cli.cluster import LocalCluster
from gpud_client import Client, SessionLost
from tests.waiting import wait_for

PROBATION_S = 1.0
GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "faults.json"
    path.write_text("[]")
    return path


@pytest.fixture(scope="module")
def cluster(job_user_prefix: str | None, fault_file: Path) -> Iterator[LocalCluster]:
    # Two workers of one SIMULATED GPU each: SIM-w0-0 and SIM-w1-0.
    with LocalCluster(workers=2, gpus_per_worker=1, heartbeat_ms=200, job_user_prefix=job_user_prefix,
                      worker_args=["--fault-file", str(fault_file), "--probation", str(PROBATION_S)]) as c:
        yield c


@pytest.fixture()
def client(cluster: LocalCluster, fault_file: Path) -> Iterator[Client]:
    """A client (session replay off: a lost session reaches the caller); afterwards every fault is
    cleared and every GPU serves again, for the next test."""
    with Client(cluster.frontend, timeout=30, journal_bytes=0) as c:
        yield c
    inject(cluster, fault_file, [], "w0", "w1")
    wait_for(lambda: all(g["health"] == "ok" for g in cluster.status()["gpus"]), what="every GPU back in service")


def inject(c: LocalCluster, fault_file: Path, faults: list[dict[str, Any]], *workers: str) -> None:
    """SIMULATED: write the fault file, then have ``workers`` read it (SIGUSR2)."""
    fault_file.write_text(json.dumps(faults))
    for name in workers:
        c.worker_procs[name].send_signal(signal.SIGUSR2)


def gpu(c: LocalCluster, uuid: str) -> dict[str, Any]:
    return next(g for g in c.status()["gpus"] if g["uuid"] == uuid)


def whole_gpu_jobs(client: Client, n: int) -> list[str]:
    """Run ``n`` whole-GPU jobs at once; the workers they ran on, sorted."""
    jobs = [client.submit(["sleep", "0.3"], gpu_milli=1000, time_limit=30) for _ in range(n)]
    results = [j.wait(timeout=30) for j in jobs]
    assert all(r.exit_code == 0 for r in results)
    return sorted(r.worker for r in results)


def test_xid_79_takes_the_gpu_out_until_its_probation_ends(cluster: LocalCluster, client: Client,
                                                          fault_file: Path) -> None:
    c = cluster
    inject(c, fault_file, [{"gpu": 0, "fault": "xid", "xid": 79}], "w0")
    failed = wait_for(lambda: (g := gpu(c, "SIM-w0-0"))["health"] == "failed" and g, timeout=5,
                      what="SIM-w0-0 failed in the broker's status")
    assert failed["health_reason"] == "xid 79" and failed["probation_left_s"] == 0.0
    assert gpu(c, "SIM-w1-0")["health"] == "ok"
    for cmd in ("status", "gpus"):
        out = subprocess.run([*GPUDCTL, "--admin", c.admin, cmd], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "w0/0 failed: xid 79" in out.stdout, out.stdout

    # Nothing new goes to the failed GPU: whole-GPU jobs queue for the healthy one instead.
    assert whole_gpu_jobs(client, 4) == ["w1"] * 4
    # The fault still stands (every check finds it): no probation, however long it has been.
    assert gpu(c, "SIM-w0-0")["health"] == "failed" and gpu(c, "SIM-w0-0")["probation_left_s"] == 0.0

    cleared_at = time.monotonic()
    inject(c, fault_file, [], "w0")
    wait_for(lambda: gpu(c, "SIM-w0-0")["health"] == "ok", what="SIM-w0-0 back in service")
    assert time.monotonic() - cleared_at >= PROBATION_S  # not before its probation was over
    assert gpu(c, "SIM-w0-0")["health_reason"] == ""
    # Back in placement: two whole-GPU jobs at once take both GPUs.
    assert whole_gpu_jobs(client, 2) == ["w0", "w1"]


def test_application_xid_changes_nothing(cluster: LocalCluster, client: Client, fault_file: Path) -> None:
    c = cluster
    log = c.rundir / "w0.log" if c.rundir is not None else None
    assert log is not None
    inject(c, fault_file, [{"gpu": 0, "fault": "xid", "xid": 13}], "w0")
    wait_for(lambda: "xid 13 (an application XID: ignored)" in log.read_text(errors="replace"),
             what="w0 reading the fault file")
    # Heartbeats since then said ok; the GPU still takes work.
    assert whole_gpu_jobs(client, 2) == ["w0", "w1"]
    g = gpu(c, "SIM-w0-0")
    assert g["health"] == "ok" and g["health_reason"] == ""


def test_work_on_a_failed_gpu_fails(cluster: LocalCluster, client: Client, fault_file: Path) -> None:
    c = cluster
    job = client.submit(["sleep", "30"], gpu_milli=1000, time_limit=60)  # not idempotent: not placed again
    wait_for(lambda: c.status()["counts"]["running"] == 1, what="the job running")
    session = client.session(gpu_milli=1000, mem=1 << 20)  # whole GPUs: on the other worker
    session.mem_alloc(4096)
    inject(c, fault_file, [{"gpu": 0, "fault": "ecc_dbe"}], "w0", "w1")
    wait_for(lambda: all(g["health"] == "failed" for g in c.status()["gpus"]), timeout=5, what="both GPUs failed")
    with pytest.raises(GpuFault, match="ecc_dbe"):
        job.wait(timeout=20)  # killed long before its 30 s sleep ends
    with pytest.raises(SessionLost):
        session.mem_alloc(4096)
