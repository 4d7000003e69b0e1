"""``--daemon`` (hosts without systemd): detach, PID file, log file, SIGTERM, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpud_cli.cluster import admin_call

GPUD = [sys.executable, "-m", "gpud_cli"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: the daemon is no child of ours, init reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _daemon_broker(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUD, "broker", "--daemon", "--pid-file", str(tmp_path / "broker.pid"), "--log-file", str(tmp_path / "broker.log"),
         "--security", "none", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
         "--admin", f"ipc://{tmp_path}/admin.sock", "--ready-file", str(tmp_path / "broker.json"), *extra],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def _kill(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_broker_daemon_pid_file_serves_and_stops(tmp_path: Path) -> None:
    pid_file = tmp_path / "broker.pid"
    try:
        r = _daemon_broker(tmp_path)
        assert r.returncode == 0, r.stderr  # the command returns once detached
        _wait(pid_file.exists, 20, "the PID file")
        _wait(lambda: pid_file.read_text().strip().isdigit(), 5, "the PID in the file")
        pid = int(pid_file.read_text())
        assert _alive(pid)
        _wait((tmp_path / "broker.json").exists, 20, "the ready file")
        info = json.loads((tmp_path / "broker.json").read_text())
        assert info["pid"] == pid  # the daemon itself, not the command that started it
        st = admin_call(info["admin"], "status", timeout=5)
        assert st["counts"]["workers"] == 0
        # Detached: a session of its own (double fork: not its leader, so it can never get a
        # controlling terminal back), no terminal, stdin from /dev/null.
        stat = Path(f"/proc/{pid}/stat").read_text()
        tty_nr = int(stat[stat.rindex(")") + 2:].split()[4])
        assert os.getsid(pid) not in (os.getsid(0), pid) and tty_nr == 0
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
        os.kill(pid, signal.SIGTERM)
        _wait(lambda: not _alive(pid), 20, "the daemon to exit")
        _wait(lambda: not pid_file.exists(), 5, "the PID file to be removed")
        log = (tmp_path / "broker.log").read_text()
        assert "ready: frontend tcp://127.0.0.1:" in log and "stopped" in log
        lines = [line for line in log.splitlines() if line.strip()]
        assert all(" gpud-broker[" in line for line in lines), lines  # one event per line
    finally:
        _kill(pid_file)


def test_broker_daemon_refuses_a_live_pid_file_and_replaces_a_stale_one(tmp_path: Path) -> None:
    pid_file = tmp_path / "broker.pid"
    pid_file.write_text(f"{os.getpid()}\n")  # a live process: this test
    r = _daemon_broker(tmp_path)
    assert r.returncode == 2 and f"already running as PID {os.getpid()}" in r.stderr
    # A PID file left by a crash names a process that is gone: it is replaced.
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_file.write_text(f"{dead.pid}\n")
    try:
        r = _daemon_broker(tmp_path)
        assert r.returncode == 0, r.stderr
        _wait(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit() and int(pid_file.read_text()) != dead.pid,
              20, "the new PID file")
        pid = int(pid_file.read_text())
        _wait((tmp_path / "broker.json").exists, 20, "the ready file")
        os.kill(pid, signal.SIGTERM)
        _wait(lambda: not _alive(pid), 20, "the daemon to exit")
    finally:
        _kill(pid_file)


def test_pid_file_without_daemon_is_refused(tmp_path: Path) -> None:
    r = subprocess.run([*GPUD, "broker", "--security", "none", "--pid-file", str(tmp_path / "x.pid")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--pid-file needs --daemon" in r.stderr


def test_daemon_without_python_daemon_says_which_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['daemon'] = None; from gpud_cli.main import main; "
            f"sys.exit(main(['broker', '--security', 'none', '--daemon', '--pid-file', {str(tmp_path / 'x.pid')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "pip install 'gpud[daemon]'" in r.stderr, r.stderr


def test_worker_daemon_pid_file_and_stop(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    args = [*GPUD, "worker", "--daemon", "--pid-file", str(pid_file), "--log-file", str(tmp_path / "worker.log"),
            "--security", "none", "--simulate", "1", "--broker", "tcp://127.0.0.1:1", "--name", "wd",
            "--workdir", str(tmp_path / "jobs")]
    if os.geteuid() == 0:
        args += ["--job-uids", "61904-61907"]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        _wait(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), 20, "the PID file")
        pid = int(pid_file.read_text())
        _wait(lambda: "connecting to broker tcp://127.0.0.1:1" in (tmp_path / "worker.log").read_text(), 20, "the worker to start")
        os.kill(pid, signal.SIGTERM)
        _wait(lambda: not _alive(pid), 30, "the worker to exit")
        _wait(lambda: not pid_file.exists(), 5, "the PID file to be removed")
        assert "worker wd stopped" in (tmp_path / "worker.log").read_text()
    finally:
        _kill(pid_file)


@pytest.mark.parametrize("target", ["file", "syslog"])
def test_log_target_of_a_daemon(tmp_path: Path, target: str) -> None:
    """Without --log-file a daemon logs to syslog (it has no stderr); with one, to that file."""
    import argparse

    from gpud import daemonize

    p = argparse.ArgumentParser()
    daemonize.add_arguments(p)
    ns = p.parse_args(["--daemon"] + (["--log-file", "rel.log"] if target == "file" else []))
    got = daemonize.log_target(ns)
    assert got == (os.path.abspath("rel.log") if target == "file" else "syslog")
    assert daemonize.log_target(p.parse_args([])) is None  # stderr (journald under systemd)
