"""Attacks from a job's program on its GPU VM that the sandbox must stop, against real daemons.

A tenant's job may try to make a user namespace of its own (``unshare -U -r``: "root" there,
and with it every namespaced part of the kernel to attack; most recent kernel privilege
escalations start so): the job's and the session processes' seccomp filter refuses it, and what a
program needs of threads and child processes still works.

Real daemons (a broker and a simulated-GPU worker, labelled simulated) as subprocesses on
loopback, the real client library, jobs under dynamic pool uids in namespaces (as root).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from gpud_worker import seccomp

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and pool users need root"),
              pytest.mark.skipif(seccomp.FILTER is None, reason="no seccomp filter for this architecture")]

PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, worker_args=["--session-processes", "on"]) as c:
        yield c


def _seccomp_mode(status: str) -> str:
    return next((line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:")), "")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_job_cannot_make_a_user_namespace_of_its_own(cluster: LocalCluster) -> None:
    script = ("unshare -U -r id; echo rc=$?; unshare -U -r -n -m true; echo rc=$?; "
              "unshare -U --map-current-user true; echo rc=$?; cat /proc/self/status")
    with Client(cluster.frontend, timeout=30) as c:
        out = c.run(["sh", "-c", script], gpu_milli=10, time_limit=20)
    text = out.stdout.decode()
    assert out.exit_code == 0, out
    assert "uid=0" not in text and text.count("rc=") == 3 and "rc=0" not in text, text
    assert "Operation not permitted" in out.stderr.decode(), out.stderr
    assert _seccomp_mode(text) == "2", text  # SECCOMP_MODE_FILTER


@pytest.mark.skipif(not os.access(PYTHON, os.X_OK), reason=f"needs {PYTHON}")
def test_threads_and_child_processes_still_work_in_a_job(cluster: LocalCluster) -> None:
    """The filter answers clone3 ENOSYS: the C library falls back to clone for threads and
    processes, so a program that starts both runs as before."""
    program = ("import subprocess, threading\n"
               "seen = []\n"
               "ts = [threading.Thread(target=seen.append, args=(i,)) for i in range(8)]\n"
               "[t.start() for t in ts]; [t.join() for t in ts]\n"
               "print(sorted(seen) == list(range(8)), subprocess.run(['echo', 'child'], capture_output=True).stdout)\n")
    with Client(cluster.frontend, timeout=30) as c:
        out = c.run([PYTHON, "-c", program], gpu_milli=10, time_limit=20)
    assert (out.exit_code, out.stdout) == (0, b"True b'child\\n'\n"), out


def test_a_session_process_is_under_the_filter_too(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30) as c, c.session(gpu_milli=10, mem=1 << 20) as s:
        pid = s.device_info()["process"]["pid"]
        with open(f"/proc/{pid}/status") as f:
            assert _seccomp_mode(f.read()) == "2"
        x = s.mem_alloc(16)
        s.memcpy_htod(x, b"\x01" * 16)
        assert s.memcpy_dtoh(x, 16) == b"\x01" * 16  # and it serves as before
