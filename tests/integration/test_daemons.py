"""The daemons' own behaviour as processes: start-up refusals, reconnection, gpudctl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from gpud_cli.cluster import admin_call
from gpud_client import Client

GPUD = [sys.executable, "-m", "gpud_cli"]
GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]


def test_worker_without_driver_or_simulate_exits_with_a_clear_message() -> None:
    from gpud_worker.gpu import NvmlProbe

    if NvmlProbe.available():
        pytest.skip("this machine has an NVIDIA driver")
    r = subprocess.run([*GPUD, "worker", "--broker", "tcp://127.0.0.1:1"], capture_output=True, timeout=30)
    assert r.returncode == 2
    assert b"no NVIDIA driver" in r.stderr and b"--simulate" in r.stderr


def _start_broker(tmp_path: Path, frontend: str, backend: str, admin: str,
                  heartbeat: tuple[str, ...] | list[str] = ("--heartbeat-ms", "200")) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ready = tmp_path / "broker.json"
    ready.unlink(missing_ok=True)
    with open(tmp_path / "broker.log", "ab") as log:
        proc = subprocess.Popen([*GPUD, "broker", "--security", "none", "--frontend", frontend, "--backend", backend, "--admin", admin,
                                 "--ready-file", str(ready), *heartbeat],
                                stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None, (tmp_path / "broker.log").read_text()
        assert time.monotonic() < deadline, "broker not ready"
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())


def _wait_workers(admin: str, n: int, timeout: float = 20) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = admin_call(admin, "status", timeout=1)
            if st["counts"]["workers"] == n:
                return st  # type: ignore[no-any-return]
        except Exception:
            pass
        assert time.monotonic() < deadline, f"broker never counted {n} workers"
        time.sleep(0.05)


def test_worker_reconnects_after_broker_restart_and_gpudctl_shows_it(tmp_path: Path) -> None:
    admin = f"ipc://{tmp_path}/admin.sock"
    broker, ep = _start_broker(tmp_path, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", admin)
    with open(tmp_path / "worker.log", "ab") as log:
        worker = subprocess.Popen([*GPUD, "worker", "--security", "none", "--broker", ep["backend"], "--name", "wr", "--simulate", "2",
                                   "--heartbeat-ms", "200"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_workers(admin, 1)
        # gpudctl against the real broker: JSON and the human table.
        out = subprocess.run([*GPUDCTL, "--admin", admin, "status", "--json"], capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert [g["uuid"] for g in st["gpus"]] == ["SIM-wr-0", "SIM-wr-1"] and all(g["simulated"] for g in st["gpus"])
        table = subprocess.run([*GPUDCTL, "--admin", admin, "status"], capture_output=True, timeout=30, text=True)
        assert table.returncode == 0 and "SIM" in table.stdout and "wr" in table.stdout
        assert max(len(line) for line in table.stdout.splitlines()) <= 80

        # The broker dies; a new one comes up on the same endpoints; the worker finds it again.
        broker.send_signal(signal.SIGKILL)
        broker.wait()
        os.unlink(f"{tmp_path}/admin.sock")
        broker, _ = _start_broker(tmp_path, ep["frontend"], ep["backend"], admin)
        _wait_workers(admin, 1)
        with Client(ep["frontend"], timeout=10) as c:
            assert c.echo(b"after restart") == b"after restart"
        assert worker.poll() is None
    finally:
        for p in (worker, broker):
            p.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert broker.wait(timeout=30) == 0


def test_gpudctl_times_out_cleanly_without_a_broker(tmp_path: Path) -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"ipc://{tmp_path}/silent.sock")
    try:
        r = subprocess.run([*GPUDCTL, "--admin", f"ipc://{tmp_path}/silent.sock", "--timeout", "0.5", "status"],
                           capture_output=True, timeout=30)
        assert r.returncode == 3 and r.stderr
    finally:
        silent.close()
        ctx.term()
