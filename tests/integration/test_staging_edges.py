"""Edge cases of staged job inputs (PROTOCOL.md §11.3) with real daemons: a worker that stops
in the middle of fetching a job's inputs is taken for lost, the job is placed again on the other
worker and runs there once with the right bytes, and the first worker, once it runs again, drops
the job it no longer holds (the broker answers its FETCH with ERROR) instead of answering for it.

Real daemons (one broker, two workers with one simulated GPU each, labelled simulated) as
subprocesses on loopback, a real client, real jobs under restricted users.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client
from tests.integration.chaos import executions
from tests.integration.test_large_inputs import MiB, payload, ran_once

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    rundir = tmp_path_factory.mktemp("staging-edges")
    # The workers log each fetch they begin (DEBUG): the test stops the one that fetches.
    with LocalCluster(workers=2, gpus_per_worker=1, rundir=rundir, worker_args=["--log-level", "DEBUG"]) as c:
        yield c


def test_a_worker_stopped_mid_fetch_loses_the_job_to_the_other_which_runs_it_once(cluster: LocalCluster) -> None:
    data = payload(300 * MiB, 7)
    logs = [Path(str(cluster.rundir)) / f"{w}.log" for w in cluster.worker_procs]
    _, before = executions(logs)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with Client(cluster.frontends, timeout=60) as c:
                job = c.submit(["md5sum", "a"], files={"a": data}, gpu_milli=100, time_limit=120, timeout=120)
                result["id"] = job.id.hex()
                out = job.wait()
                result["sum"] = out.stdout.split()[0].decode() if out.exit_code == 0 else out.stderr
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"

    admin = cluster.admin
    thread = threading.Thread(target=run)
    thread.start()
    # The job is placed while its upload still comes (pipelined): stop its worker mid-fetch.
    deadline = time.monotonic() + 60
    first = None
    while first is None:  # the worker that began fetching its inputs
        assert time.monotonic() < deadline and thread.is_alive(), f"the job was never placed: {result}"
        for name in cluster.worker_procs:
            if ": fetching " in (Path(str(cluster.rundir)) / f"{name}.log").read_text(errors="replace"):
                first = name
        time.sleep(0.002)
    stopped = cluster.worker_procs[first]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        while len([w for w in admin_call(admin, "workers") if w["name"] == first]):
            assert time.monotonic() < deadline, "the stopped worker was never taken for lost"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    started = ran_once(thread, result, data, logs, before)
    short = result["id"][:12]
    assert short in started
    # The stopped worker came back: it no longer counts the job as running (the broker's ERROR
    # to its FETCH made it drop the job, without a RESULT that would have answered for it).
    deadline = time.monotonic() + 30
    while True:
        rows = {w["name"]: w for w in admin_call(admin, "workers")}
        if first in rows and not any(r["id"].startswith(short) for r in rows[first]["running"]):
            break
        assert time.monotonic() < deadline, f"worker {first} still runs the job it lost: {rows.get(first)}"
        time.sleep(0.1)
    text = (Path(str(cluster.rundir)) / f"{first}.log").read_text(errors="replace")
    assert f"job {short}: dropped" in text
    assert short not in executions([Path(str(cluster.rundir)) / f"{first}.log"])[1]  # it ran on the other one


def test_a_staged_job_refused_at_once_stops_its_upload(cluster: LocalCluster) -> None:
    from gpud.errors import NoCapacity

    log = Path(str(cluster.rundir)) / "broker.log"
    before = len(log.read_text(errors="replace"))
    with Client(cluster.frontends, timeout=30) as c:
        with pytest.raises(NoCapacity):  # refused when its REQUEST comes, right after the opening PUT
            c.run(["true"], files={"a": bytes(256 * MiB)}, gpu_milli=100, models=["no-such-gpu"])
    spool = admin_call(cluster.admin, "status")["spool"]
    assert (spool["uploads"], spool["reserved"]) == (0, 0)
    new = log.read_text(errors="replace")[before:]
    # The chunks in flight when the refusal came are refused; the client then stops, and never
    # opens the upload again (which would send the whole input once more for nothing).
    assert 1 <= new.count("refused PUT") <= 8, new
