"""Sessions in processes of their own (gpud_worker.session_host), with real processes and, as
root, real pool users: results as in the worker's process, privileges dropped, a dead session
process loses only its own session, and a worker with ``--session-processes on`` serves sessions
end to end through the client library.

The backend inside the processes is the SIMULATED GPU here (no GPU on this machine); the same
processes host pycuda sessions on real GPUs, which tests/gpu checks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from gpud.errors import InvalidRequest, OutOfMemory, RemoteError, SessionLost, Timeout
from gpud.protocol import BUILTIN_MODULE
from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import simulated_gpus
from gpud_worker.jobs import JobLimits, JobRunner, UserPool
from gpud_worker.session_host import HostedDevice, SessionHosts
from tests.waiting import wait_for

ROOT = os.geteuid() == 0
UIDS = range(61900, 61903)  # dynamic pool users (no accounts needed), as LocalCluster uses
F32 = np.float32


@pytest.fixture()
def pool() -> UserPool | None:
    return UserPool("gpud-dyn-", UIDS) if ROOT else None


@pytest.fixture()
def device(tmp_path: Path, pool: UserPool | None) -> Iterator[HostedDevice]:
    runner = JobRunner(tmp_path / "jobs", pool, limits=JobLimits(acquire_timeout=0.5))
    hosts = SessionHosts(runner.lease_user, runner.end_lease, staging=3 * 4096)  # small: copies go in pieces
    gpu = simulated_gpus(1, mem=1 << 30, worker_name="sh")[0]
    yield HostedDevice(SimulatedDevice(gpu), hosts)


def processes_of(uid: int) -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] is not None and uid in p.info["uids"] and p.info["status"] != psutil.STATUS_ZOMBIE]


def test_results_match_a_session_in_the_worker(device: HostedDevice) -> None:
    local = SimulatedDevice(device.gpu).open_session(64 << 20)
    hosted = device.open_session(64 << 20, tenant="t")
    try:
        rng = np.random.default_rng(3)
        n = 100_003  # 400 KB: many pieces of the 12 KiB staging buffer, the last one short
        a, b = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
        handles = []
        for s in (local, hosted):
            ha, hb, hs = s.alloc(4 * n), s.alloc(4 * n + 8), s.alloc(4)
            s.htod(ha, 0, a)
            s.htod(hb, 5, b.tobytes()[:-3])  # an odd offset and length
            s.launch(BUILTIN_MODULE, "saxpy", (64, 1, 1), (256, 1, 1), [("f32", 1.5), ("ptr", ha), ("ptr", ha), ("i32", n)])
            s.launch(BUILTIN_MODULE, "reduce_sum", (2, 1, 1), (128, 1, 1), [("ptr", ha), ("ptr", hs), ("i32", n)])
            handles.append((ha, hb, hs))
        (la, lb, ls), (ha, hb, hs) = handles
        assert bytes(hosted.dtoh(ha, 0)) == bytes(local.dtoh(la, 0))
        assert bytes(hosted.dtoh(ha, 0)) == (F32(1.5) * a + a).tobytes()
        assert bytes(hosted.dtoh(hb, 3, 20_000)) == bytes(local.dtoh(lb, 3, 20_000))
        assert bytes(hosted.dtoh(hs, 0)) == bytes(local.dtoh(ls, 0))
        out = np.zeros(n + 7, F32)
        view = hosted.dtoh(ha, 0, None, out=out)
        assert len(view) == 4 * n and np.array_equal(out[:n], F32(1.5) * a + a) and not out[n:].any()
        assert hosted.extent(hb, 8) == 4 * n
        info = hosted.info()
        assert info["mem_used"] == 8 * n + 12 and info["simulated"] is True
        assert device.mem_used() == 8 * n + 12  # what the heartbeats report
        hosted.free(hb)
        assert device.mem_used() == 4 * n + 4
    finally:
        local.close()
        hosted.close()
    assert device.mem_used() == 0


def test_errors_come_back_and_the_session_goes_on(device: HostedDevice) -> None:
    s = device.open_session(1 << 20)
    try:
        h = s.alloc(1 << 19)
        with pytest.raises(OutOfMemory, match="grant"):
            s.alloc((1 << 19) + 1)
        with pytest.raises(InvalidRequest, match="unknown handle"):
            s.dtoh(h + 99, 0)
        with pytest.raises(InvalidRequest):
            s.htod(h, (1 << 19) - 2, b"four")  # past the end
        with pytest.raises(RemoteError, match="illegal address"):
            s.launch(BUILTIN_MODULE, "saxpy", (1, 1, 1), (64, 1, 1), [("f32", 1.0), ("ptr", h), ("ptr", h), ("i32", 1 << 20)])
        with pytest.raises(InvalidRequest, match="module 'nope' unknown"):
            s.launch("nope", "k", (1, 1, 1), (1, 1, 1), [])
        s.htod(h, 0, b"\x01\x02")
        assert bytes(s.dtoh(h, 0, 2)) == b"\x01\x02"
    finally:
        s.close()


@pytest.mark.skipif(not ROOT, reason="pool users need root")
def test_the_process_runs_as_a_pool_user_without_privileges(device: HostedDevice, pool: UserPool) -> None:
    s = device.open_session(1 << 20, tenant="alice")
    try:
        assert s.uid in UIDS and s.info()["process"] == {"pid": s.pid, "uid": s.uid}
        status = dict(line.split(":", 1) for line in Path(f"/proc/{s.pid}/status").read_text().splitlines())
        assert status["Uid"].split() == [str(s.uid)] * 4 and status["Gid"].split() == [str(s.uid)] * 4
        assert status["Groups"].strip() == ""
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
        assert status["NoNewPrivs"].strip() == "1"
        assert len(pool._free) == len(UIDS) - 1  # it holds its user until it ends
    finally:
        s.close()
    assert len(pool._free) == len(UIDS)
    assert not processes_of(s.uid)  # nothing of it outlives the session


def test_a_dead_session_process_loses_only_its_session(device: HostedDevice) -> None:
    a = device.open_session(1 << 20, tenant="a")
    b = device.open_session(1 << 20, tenant="b")
    try:
        assert a.pid != b.pid
        ha, hb = a.alloc(1024), b.alloc(1024)
        b.htod(hb, 0, b"b" * 1024)
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="killed by SIGKILL"):
            a.dtoh(ha, 0)
        with pytest.raises(SessionLost, match="killed by SIGKILL"):  # and every call after it
            a.sync()
        assert bytes(b.dtoh(hb, 0)) == b"b" * 1024  # the other session did not notice
    finally:
        a.close()
        b.close()
    assert device.mem_used() == 0


def test_kill_ends_a_call_that_never_returns(device: HostedDevice) -> None:
    s = device.open_session(1 << 20)
    outcome: list[BaseException] = []
    try:
        os.kill(s.pid, signal.SIGSTOP)  # a kernel that never ends, as the worker sees it

        def call() -> None:
            try:
                s.sync()
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)
        assert t.is_alive()
        s.kill("idle for too long")
        t.join(10)
        assert not t.is_alive()
        assert isinstance(outcome[0], SessionLost) and "idle for too long" in str(outcome[0])
    finally:
        s.close()


@pytest.mark.skipif(not ROOT, reason="pool users need root")
def test_no_free_pool_user_refuses_the_session_clearly(tmp_path: Path) -> None:
    pool = UserPool("gpud-dyn-", range(61910, 61911))
    runner = JobRunner(tmp_path / "jobs", pool, limits=JobLimits(acquire_timeout=0.2))
    hosts = SessionHosts(runner.lease_user, runner.end_lease)
    device = HostedDevice(SimulatedDevice(simulated_gpus(1, worker_name="one")[0]), hosts)
    first = device.open_session(4096)
    try:
        with pytest.raises(RemoteError, match="busy"):
            device.open_session(4096)
    finally:
        first.close()
    device.open_session(4096).close()  # the user came back


# --------------------------------------------------------------------------- through a worker


@pytest.fixture(scope="module")
def hosted_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200,
                      worker_args=["--session-processes", "on", "--session-staging", "65536", "--session-idle", "2"]) as c:
        yield c


def session_pid(s: Any) -> tuple[int, int]:
    p = s.device_info()["process"]
    return p["pid"], p["uid"]


def test_worker_runs_each_session_in_its_own_process(hosted_cluster: LocalCluster) -> None:
    rng = np.random.default_rng(5)
    with Client(hosted_cluster.frontend, timeout=30) as client, \
            client.session(gpu_milli=100, mem=16 << 20) as s, client.session(gpu_milli=100, mem=16 << 20) as t:
        (ps, us), (pt, ut) = session_pid(s), session_pid(t)
        assert ps != pt and ps != hosted_cluster.worker_procs["w0"].pid
        if ROOT:
            assert us != 0 and ut != 0 and us != ut
        x = rng.standard_normal(300_000).astype(F32)  # 1.2 MB: pieces of the 64 KiB buffer
        h = s.mem_alloc(x.nbytes)
        s.memcpy_htod(h, x)
        s.launch(BUILTIN, "saxpy", (100,), (256,), [F32(-2), h, h, np.int32(x.size)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(h), F32), F32(-1) * x)
        # Its process killed (as a fault would end it): the client replays the session onto a
        # new one, with the data, and the other session goes on.
        g = t.mem_alloc(8)
        t.memcpy_htod(g, b"12345678")
        os.kill(ps, signal.SIGKILL)
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(h), F32), F32(-1) * x)
        assert s.replays == 1 and session_pid(s)[0] != ps
        assert t.memcpy_dtoh(g) == b"12345678" and t.replays == 0
    if ROOT:
        wait_for(lambda: not processes_of(us) and not processes_of(ut), "the sessions' processes to end", timeout=20)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_long_call_is_not_idleness_but_a_close_ends_it(hosted_cluster: LocalCluster) -> None:
    """--session-idle 2: a call that runs longer (its process stopped, as a kernel that never
    ends would hold it) is not reclaimed as idle; closing the session ends its process at once."""
    with Client(hosted_cluster.frontend, timeout=30) as client:
        s = client.session(gpu_milli=100, mem=1 << 20)
        h = s.mem_alloc(8)
        s.memcpy_htod(h, b"abcdefgh")
        pid = session_pid(s)[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                s.synchronize(timeout=4)  # twice the idle limit, in a call
            assert not gone(pid)  # not reclaimed: it was busy, not idle
        finally:
            os.kill(pid, signal.SIGCONT)
        assert s.memcpy_dtoh(h) == b"abcdefgh" and s.replays == 0  # the same session goes on
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(Timeout):
            s.synchronize(timeout=1)
        s.close()  # the worker kills the process: the stopped call will never be waited for
        wait_for(lambda: gone(pid), "the closed session's process to end", timeout=10)
        # Idle for real: reclaimed, and its process ends.
        t = client.session(gpu_milli=100, mem=1 << 20, )
        tpid = session_pid(t)[0]
        wait_for(lambda: gone(tpid), "the idle session's process to end", timeout=15)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_outlives_the_worker(sig: signal.Signals) -> None:
    """A worker stopped (SIGTERM: it ends its sessions) or killed (SIGKILL: nothing of it runs
    on) while a session is stuck in a call leaves no session process, forkserver or resource
    tracker behind: the forkserver ends with the worker, and the sessions with the forkserver."""
    with LocalCluster(workers=1, gpus_per_worker=1, worker_args=["--session-processes", "on"]) as c, \
            Client(c.frontend, timeout=30) as client:
        stuck, idle = client.session(mem=1 << 20), client.session(mem=1 << 20)
        pid = session_pid(stuck)[0]
        worker = c.worker_procs["w0"]
        helpers = psutil.Process(worker.pid).children(recursive=True)
        assert pid in {p.pid for p in helpers} and len(helpers) >= 3  # forkserver, 2 sessions
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(Timeout):
            stuck.synchronize(timeout=1)
        os.kill(worker.pid, sig)
        worker.wait(10)  # SIGTERM: it does not wait for the stuck call
        wait_for(lambda: all(gone(p.pid) for p in helpers), "the worker's helper processes to end", timeout=10)
        del idle
        # The test is over: the broker's close would wait 10 s for the stuck call's answer (from
        # a worker that is gone, or not yet judged gone after a SIGKILL).
        c.kill_broker("broker")
