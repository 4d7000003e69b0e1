"""A broker and simulated workers as subprocesses, driven through the real client library."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client, OutOfMemory, SessionLost, WorkerLost
from tests.waiting import Gate, wait_for

HB = ["--heartbeat-ms", "200"]


@pytest.fixture(scope="module")
def cluster(job_user_prefix: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(workers=2, gpus_per_worker=2, heartbeat_ms=200, job_user_prefix=job_user_prefix) as c:
        yield c


@pytest.fixture()
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.frontend, timeout=30) as c:
        yield c


def test_status_shows_simulated_workers_and_gpus(cluster: LocalCluster) -> None:
    st = cluster.status()
    assert st["counts"]["workers"] == 2 and st["counts"]["gpus"] == 4
    assert all(g["simulated"] for g in st["gpus"])
    assert {g["uuid"] for g in st["gpus"]} == {"SIM-w0-0", "SIM-w0-1", "SIM-w1-0", "SIM-w1-1"}


def test_thousand_echoes_none_lost(client: Client) -> None:
    payloads = [os.urandom(1 + i % 300) for i in range(1000)]
    window: list = []
    results = []
    for p in payloads:
        window.append(client.submit_echo(p))
        if len(window) >= 50:
            results.append(window.pop(0).wait())
    results += [w.wait() for w in window]
    assert results == payloads


def test_hundred_jobs_every_result_right(client: Client) -> None:
    jobs = []
    for i in range(100):
        data = f"job {i}\n".encode() * (i + 1)
        jobs.append((i, data, client.submit(
            ["sh", "-c", 'wc -l < in.txt; echo "$CUDA_VISIBLE_DEVICES" >&2; cp in.txt out.txt; exit $(($0 % 7))', str(i)],
            files={"in.txt": data}, outputs=["out.txt"], gpu_milli=100, time_limit=30,
        )))
    for i, data, job in jobs:
        r = job.wait()
        assert r.exit_code == i % 7
        assert int(r.stdout) == i + 1
        assert r.files["out.txt"] == data
        # CUDA_VISIBLE_DEVICES names exactly the granted GPU (simulated GPUs are named by index).
        assert len(r.gpus) == 1 and r.stderr.strip().decode() == r.gpus[0].rsplit("-", 1)[1]
        assert r.worker in ("w0", "w1")
    users = {job.wait().user for _, _, job in jobs}
    assert "root" not in users


def test_job_as_root_daemon_never_runs_as_root(client: Client) -> None:
    r = client.run(["id", "-u"], gpu_milli=10)
    assert r.exit_code == 0
    if os.geteuid() == 0:
        assert int(r.stdout) != 0


def test_job_time_limit_kills_the_group(client: Client) -> None:
    t0 = time.monotonic()
    r = client.run(["sh", "-c", "trap '' TERM; sleep 30 & sleep 30"], gpu_milli=10, time_limit=1)
    assert r.timed_out and r.exit_code < 0
    assert time.monotonic() - t0 < 15


def test_sessions_every_builtin_kernel_against_numpy(client: Client) -> None:
    rng = np.random.default_rng(1)
    with client.session(gpu_milli=200, mem=32 << 20) as s:
        assert s.device_info()["simulated"] is True
        n = 10_000
        a = rng.standard_normal(n, dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32)
        da, db, dc = (s.mem_alloc(n * 4) for _ in range(3))
        s.memcpy_htod(da, a)
        s.memcpy_htod(db, b)
        s.launch(BUILTIN, "vector_add", (40,), (256,), (da, db, dc, np.int32(n)))
        np.testing.assert_allclose(np.frombuffer(s.memcpy_dtoh(dc), np.float32), a + b, rtol=1e-6)
        s.launch(BUILTIN, "saxpy", (40,), (256,), (np.float32(-1.5), da, db, np.int32(n)))
        out = np.empty(n, np.float32)
        s.memcpy_dtoh(db, out=out)
        np.testing.assert_allclose(out, np.float32(-1.5) * a + b, rtol=1e-5, atol=1e-6)
        m, k, nn = 64, 48, 80
        A = rng.standard_normal((m, k), dtype=np.float32)
        B = rng.standard_normal((k, nn), dtype=np.float32)
        dA, dB, dC = s.mem_alloc(A.nbytes), s.mem_alloc(B.nbytes), s.mem_alloc(m * nn * 4)
        s.memcpy_htod(dA, A)
        s.memcpy_htod(dB, B)
        s.launch(BUILTIN, "sgemm", (5, 4), (16, 16), (dA, dB, dC, np.int32(m), np.int32(nn), np.int32(k)))
        C = np.frombuffer(s.memcpy_dtoh(dC), np.float32).reshape(m, nn)
        np.testing.assert_allclose(C, A @ B, rtol=1e-4, atol=1e-4)
        dsum = s.mem_alloc(4)
        s.launch(BUILTIN, "reduce_sum", (1,), (256,), (da, dsum, np.int32(n)))
        s.synchronize()
        assert np.frombuffer(s.memcpy_dtoh(dsum), np.float32)[0] == pytest.approx(float(a.sum(dtype=np.float64)), abs=1e-2)
        # A partial copy at an offset.
        part = s.memcpy_dtoh(da, nbytes=16, offset=8)
        assert part == a[2:6].tobytes()


def test_memory_grant_enforced(client: Client, cluster: LocalCluster) -> None:
    with client.session(gpu_milli=50, mem=1 << 20) as s:
        h = s.mem_alloc(768 << 10)
        with pytest.raises(OutOfMemory):
            s.mem_alloc(512 << 10)
        s.mem_free(h)
        s.mem_alloc(1 << 20)  # fits again once freed
        granted = sum(g["granted_mem"] for g in cluster.status()["gpus"])
        assert granted >= 1 << 20
    with pytest.raises(SessionLost):
        s.mem_alloc(16)


def test_retried_request_id_runs_once(cluster: LocalCluster) -> None:
    """The same REQUEST id sent twice runs once: both answers carry the first run's output."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.frontend)
    try:
        rid = P.new_id()
        header = {"id": rid, "kind": "job", "need": {"gpu_milli": 10},
                  "argv": ["sh", "-c", "sleep 0.3; cat /proc/sys/kernel/random/uuid"]}
        sock.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, header))
        sock.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, header))
        outs = []
        while len(outs) < 1:
            assert sock.poll(20_000), "no reply"
            msg = P.decode(sock.recv_multipart(), Peer.CLIENT)
            assert msg.header["id"] == rid and msg.header["ok"] is True
            outs.append(bytes(msg.frames[0]))
        # A retry after completion gets the cached reply at once.
        sock.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, header))
        assert sock.poll(5_000)
        again = P.decode(sock.recv_multipart(), Peer.CLIENT)
        assert bytes(again.frames[0]) == outs[0]
        assert sock.poll(500) == 0  # and nothing else: it never ran twice
    finally:
        sock.close()
        ctx.term()


def test_heartbeats_do_not_wait_on_work(cluster: LocalCluster, client: Client) -> None:
    """A job longer than the liveness window (200 ms x 3) does not make its worker look dead."""
    r = client.run(["sleep", "2"], gpu_milli=10, time_limit=10)
    assert r.exit_code == 0
    st = cluster.status()
    assert st["counts"]["workers"] == 2


def test_busy_worker_reports_running_work(cluster: LocalCluster, client: Client) -> None:
    job = client.submit(["sleep", "1.5"], gpu_milli=10, time_limit=10)

    def running():  # type: ignore[no-untyped-def]
        return [r for w in cluster.status()["workers"] for r in w["running"] if r["id"] == job.id.hex()]

    entries = wait_for(running, what="the job in a heartbeat's running list")
    assert entries[0]["kind"] == "job"
    assert job.wait().exit_code == 0


def running_on(c: LocalCluster, worker: str) -> set[str]:
    """The ids (hex) of the work ``worker`` runs, as the broker's status lists it (from its
    heartbeats)."""
    return {r["id"] for w in c.status()["workers"] if w["name"] == worker for r in w["running"]}


@pytest.fixture()
def small_cluster(job_user_prefix: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(workers=2, gpus_per_worker=1, heartbeat_ms=200, job_user_prefix=job_user_prefix,
                      broker_args=["--session-lease", "1"]) as c:
        yield c


def test_killed_worker_removed_and_its_work_placed_elsewhere(small_cluster: LocalCluster) -> None:
    c = small_cluster
    with Client(c.frontend, timeout=60) as client, Gate() as gate:
        # One whole-GPU job per worker runs; the rest wait in the broker's queue. Each runs until
        # w0 is gone (the gate), 20 s at most.
        jobs = [client.submit(["sh", "-c", gate.shell(20) + "; echo done"], gpu_milli=1000, time_limit=30,
                              idempotent=True) for _ in range(4)]
        fragile = None

        def on_both():  # type: ignore[no-untyped-def]
            st = c.status()
            return st["counts"]["running"] == 2 and st["counts"]["queued"] == 2

        wait_for(on_both, what="two jobs running and two queued")
        c.kill_worker("w0", signal.SIGKILL)
        st = wait_for(lambda: (s := c.status())["counts"]["workers"] == 1 and s, what="w0 removed")
        assert [w["name"] for w in st["workers"]] == ["w1"]
        gate.open()
        fragile = client.submit(["sleep", "0.1"], gpu_milli=1000, time_limit=30)
        results = [j.wait() for j in jobs]
        assert all(r.exit_code == 0 and r.stdout == b"done\n" for r in results)
        assert all(r.worker == "w1" for r in results)  # w0 died before any finished
        assert fragile.wait().worker == "w1"


def test_non_idempotent_job_on_killed_worker_gets_worker_lost(small_cluster: LocalCluster) -> None:
    c = small_cluster
    with Client(c.frontend, timeout=60) as client:
        # Long enough to be running when w1 is killed. The cluster's close would drain w0's (it
        # runs on: running work is not stopped); w0 is killed too once the test is over.
        jobs = [client.submit(["sleep", "8"], gpu_milli=1000, time_limit=30) for _ in range(2)]
        wait_for(lambda: c.status()["counts"]["running"] == 2, what="both jobs dispatched")
        # Begun, not only dispatched: a job its worker had not started yet would be placed again.
        wait_for(lambda: " started as " in c.log_tail("w1", 200), what="w1's job started")
        [on_w1] = wait_for(lambda: [j for j in jobs if j.id.hex() in running_on(c, "w1")],
                           what="w1's job in its heartbeat's running list")
        c.kill_worker("w1", signal.SIGKILL)
        with pytest.raises(WorkerLost):  # not placed again: it had begun, and may not run twice
            on_w1.wait(timeout=30)
        # The test is over: neither w0's job drained at the close, nor the broker's wait for it.
        c.kill_worker("w0", signal.SIGKILL)
        c.kill_broker("broker")


def test_session_of_vanished_client_is_reclaimed(small_cluster: LocalCluster) -> None:
    c = small_cluster
    code = textwrap.dedent(f"""
        import os, sys, time
        from gpud_client import Client
        c = Client({c.frontend!r}, timeout=10)
        s = c.session(gpu_milli=300, mem=4 << 20)
        s.mem_alloc(1 << 20)
        print("open", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
        st = c.status()
        assert st["counts"]["sessions"] == 1
        assert sum(g["granted_milli"] for g in st["gpus"]) == 300
        proc.kill()
        proc.wait()
        # Lease 1 s: the broker reclaims the session and its grant.
        wait_for(lambda: c.status()["counts"]["sessions"] == 0, what="session reclaimed")
        wait_for(lambda: sum(g["granted_milli"] + g["granted_mem"] for g in c.status()["gpus"]) == 0,
                 what="grant released")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_worker_sigterm_finishes_running_work_and_says_goodbye(small_cluster: LocalCluster) -> None:
    c = small_cluster
    with Client(c.frontend, timeout=30) as client:
        job = client.submit(["sh", "-c", "sleep 1; echo finished"], gpu_milli=1000, time_limit=30)
        busy = wait_for(lambda: [w["name"] for w in c.status()["workers"] if w["running"]],
                        what="a heartbeat naming the running job")
        victim = busy[0]
        proc = c.worker_procs[victim]
        proc.send_signal(signal.SIGTERM)
        r = job.wait()
        assert r.exit_code == 0 and r.stdout == b"finished\n" and r.worker == victim
        assert proc.wait(timeout=10) == 0
        # It said goodbye: gone at once, not after missed heartbeats.
        wait_for(lambda: c.status()["counts"]["workers"] == 1, timeout=2, what="goodbye")
        # New work goes to the remaining worker.
        assert client.run(["true"], gpu_milli=10).worker != victim
