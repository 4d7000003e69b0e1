"""A worker's false silence never loses its running work (PROTOCOL.md §4.2), with real daemons.

One broker and one worker of SIMULATED GPUs under CURVE, heartbeat 200 ms x 3 (silent after
0.6 s), grace window 10 periods (6 s). Tenant alice runs a job that may not run twice; tenant bob
holds a session on the same worker. Then the worker's process is frozen past its liveness
(SIGSTOP, SIGCONT), or its connection to the broker is cut (it reconnects and says READY with its
incarnation), or it is really restarted (SIGKILL and a new process: a new incarnation).
"""

from __future__ import annotations

import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from gpud.errors import WorkerLost
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client, Session
from tests.integration.chaos import executions
from tests.waiting import Gate

N = 64  # floats in bob's buffer


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", rundir=tmp_path,
                      env={"GPUD_BROKER_WORKER_RESUME_PERIODS": "10"}) as c:
        yield c


def wait_for(what: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def job_started(c: LocalCluster, short_id: str) -> bool:
    _, runs = executions([c.rundir / "w0.log"])  # type: ignore[operator]
    return runs[short_id] > 0


def bobs_session(c: LocalCluster) -> tuple[Client, Session, int]:
    """Bob's client and a session on w0 holding N floats 0..N-1; and its device pointer."""
    bob = Client(c.frontend, timeout=30, curve=c.client_keys("bob"))
    s = bob.session(mem=1 << 20)
    ptr: int = s.mem_alloc(4 * N)
    s.memcpy_htod(ptr, struct.pack(f"{N}f", *range(N)))
    return bob, s, ptr


def views_agree(c: LocalCluster) -> bool:
    """``gpudctl sessions`` and ``gpudctl workers`` name the same sessions on w0."""
    sessions = {r["id"] for r in admin_call(c.admin, "sessions", {"tenant": None, "worker": None})}
    [w0] = admin_call(c.admin, "workers", {})
    listed = {r["id"] for r in w0["running"] if r["kind"] == "session"}
    return sessions == listed


def counters(c: LocalCluster) -> dict[str, int]:
    got: dict[str, int] = c.status()["counters"]
    return got


def check_alice_and_bob_served(c: LocalCluster, pending: Any, short_id: str, s: Session, ptr: int) -> None:
    """Alice's job answers once, correctly, having run once; bob's session goes on, not replayed."""
    got = pending.wait()
    assert got.exit_code == 0 and got.stdout == b"alice-done\n", got
    _, runs = executions([c.rundir / "w0.log"])  # type: ignore[operator]
    assert runs[short_id] == 1
    assert struct.unpack(f"{N}f", s.memcpy_dtoh(ptr, 4 * N)) == tuple(float(i) for i in range(N))
    assert s.replays == 0 and s.worker == "w0"
    assert wait_for(lambda: views_agree(c), 5.0), (admin_call(c.admin, "sessions", {"tenant": None, "worker": None}),
                                                    admin_call(c.admin, "workers", {}))
    assert counters(c)["worker_losses"] == 0


def test_a_frozen_worker_keeps_its_job_and_the_other_tenants_session(cluster: LocalCluster) -> None:
    c = cluster
    bob, s, ptr = bobs_session(c)
    with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as alice, Gate() as gate:
        pending = alice.submit(["sh", "-c", gate.shell(10) + "; echo alice-done"], gpu_milli=100)
        short_id = pending.id.hex()[:12]
        assert wait_for(lambda: job_started(c, short_id)), c.log_tail("w0")
        proc = c.worker_procs["w0"]
        proc.send_signal(signal.SIGSTOP)
        try:
            assert wait_for(lambda: counters(c)["worker_suspensions"] >= 1, 5.0), c.log_tail("broker")
            time.sleep(0.5)  # well past its liveness, well inside its grace window
        finally:
            proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: "is back after" in c.log_tail("broker", 200)), c.log_tail("broker")
        gate.open()  # the job ran through the freeze; it may end now
        check_alice_and_bob_served(c, pending, short_id, s, ptr)
        assert "is back after" in (c.rundir / "broker.log").read_text()  # type: ignore[operator]
    s.close()
    bob.close()


def test_a_cut_connection_resumes_by_incarnation(cluster: LocalCluster) -> None:
    c = cluster
    bob, s, ptr = bobs_session(c)
    port = urlparse(str(c.backend)).port
    with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as alice, Gate() as gate:
        pending = alice.submit(["sh", "-c", gate.shell(10) + "; echo alice-done"], gpu_milli=100)
        short_id = pending.id.hex()[:12]
        assert wait_for(lambda: job_started(c, short_id)), c.log_tail("w0")
        # The worker's TCP connection to the broker's backend is aborted (a network fault): its
        # socket reconnects, the broker does not know the new connection, the worker says READY.
        cut = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)], capture_output=True, text=True)
        assert cut.returncode == 0, cut.stderr
        log = c.rundir / "broker.log"  # type: ignore[operator]
        assert wait_for(lambda: "w0 resumed" in log.read_text()), c.log_tail("broker")
        gate.open()  # the job ran through the cut; it may end now
        check_alice_and_bob_served(c, pending, short_id, s, ptr)
    s.close()
    bob.close()


def test_a_restarted_worker_is_a_new_process_its_job_lost_as_before(cluster: LocalCluster) -> None:
    c = cluster
    with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as alice:
        pending = alice.submit(["sh", "-c", "sleep 5; echo alice-done"], gpu_milli=100)
        short_id = pending.id.hex()[:12]
        assert wait_for(lambda: job_started(c, short_id)), c.log_tail("w0")
        c.kill_worker("w0")
        c.add_worker("w0")
        with pytest.raises(WorkerLost):
            pending.wait()
        assert counters(c)["worker_losses"] == 1
        assert "from another process" in (c.rundir / "broker.log").read_text()  # type: ignore[operator]
        assert alice.run(["true"], gpu_milli=10).exit_code == 0  # the new process serves


def test_a_job_placed_again_while_its_worker_was_frozen_is_killed_there_not_resumed(cluster: LocalCluster) -> None:
    c = cluster
    with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as alice, Gate() as gate:
        pending = alice.submit(["sh", "-c", gate.shell(10) + "; echo again"], gpu_milli=100, idempotent=True)
        short_id = pending.id.hex()[:12]
        assert wait_for(lambda: job_started(c, short_id)), c.log_tail("w0")
        c.add_worker("w1")  # after the job went to w0: where it goes when w0 is suspended
        c.wait_workers(2)
        proc = c.worker_procs["w0"]
        proc.send_signal(signal.SIGSTOP)
        try:
            w1_log = c.rundir / "w1.log"  # type: ignore[operator]
            assert wait_for(lambda: short_id in w1_log.read_text()), c.log_tail("broker")
        finally:
            proc.send_signal(signal.SIGCONT)
        w0_log = c.rundir / "w0.log"  # type: ignore[operator]
        assert wait_for(lambda: f"{short_id}" in w0_log.read_text() and "stopped by the broker" in w0_log.read_text()), \
            c.log_tail("w0")
        gate.open()  # w0's copy is stopped: w1's may end
        got = pending.wait()
        assert got.exit_code == 0 and got.stdout == b"again\n" and got.worker == "w1", got
        assert counters(c)["worker_losses"] == 0
