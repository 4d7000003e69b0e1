"""A suspended worker as the operator sees it (PROTOCOL.md §4.2), with real daemons: ``gpudctl
workers`` (a subprocess, through the real admin socket) shows it SUSPENDED with the time left of its
grace window, and the broker's Prometheus endpoint counts it among the workers suspended now, then
its suspension and its resume.

One broker and one worker of SIMULATED GPUs, heartbeat 500 ms x 3 (silent after 1.5 s: a loaded
machine's late heartbeat is no silence), grace window 30 periods (45 s: time for the checks). The worker's process is frozen
(SIGSTOP) past its liveness, then thawed (SIGCONT).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="the extra 'metrics' (prometheus-client) is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpud_cli.cluster import LocalCluster  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

GRACE_S = 30 * 1.5


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=500, broker_args=["--metrics", "127.0.0.1:0"],
                      env={"GPUD_BROKER_WORKER_RESUME_PERIODS": "30"}) as c:
        yield c


def ctl(c: LocalCluster, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "gpud_client.ctl", "--admin", str(c.admin), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"gpudctl {' '.join(args)}: {r.returncode}\n{r.stderr}"
    return r.stdout


def w0_line(c: LocalCluster) -> str:
    [line] = [line for line in ctl(c, "workers").splitlines() if line.startswith("w0 ")]
    return line


def scrape(c: LocalCluster) -> dict[str, float]:
    """The unlabelled samples of the endpoint, by name."""
    with urllib.request.urlopen(c.endpoints["metrics"], timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def counters(c: LocalCluster) -> dict[str, Any]:
    got: dict[str, Any] = c.status()["counters"]
    return got


def test_gpudctl_and_the_metrics_show_a_frozen_worker_suspended_then_resumed(cluster: LocalCluster) -> None:
    c = cluster
    wait_for(lambda: " ok " in w0_line(c), "w0 shown ok", timeout=15)
    before = scrape(c)
    assert before["gpud_workers_suspended"] == 0
    assert before["gpud_worker_suspensions_total"] == before["gpud_worker_resumes_total"]
    suspensions = before["gpud_worker_suspensions_total"]
    proc = c.worker_procs["w0"]
    proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: counters(c)["worker_suspensions"] > suspensions, "w0's suspension", timeout=15)
        line = w0_line(c)
        assert "SUSPENDED" in line and " left" in line, line
        [row] = json.loads(ctl(c, "workers", "--json"))
        assert row["suspended"] is True and 0 < row["grace_left_s"] < GRACE_S, row
        during = scrape(c)
        assert during["gpud_workers"] == 1 and during["gpud_workers_suspended"] == 1
        assert during["gpud_worker_suspensions_total"] == suspensions + 1
        assert during["gpud_worker_resumes_total"] == suspensions
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_for(lambda: counters(c)["worker_resumes"] > suspensions, "w0's resume", timeout=15)
    assert " ok " in w0_line(c)
    [row] = json.loads(ctl(c, "workers", "--json"))
    assert row["suspended"] is False and row["grace_left_s"] is None
    after = scrape(c)
    assert after["gpud_workers_suspended"] == 0
    assert after["gpud_worker_suspensions_total"] == after["gpud_worker_resumes_total"] == suspensions + 1
    assert counters(c)["worker_losses"] == 0
