"""The daemons as systemd services: the unit files, and the sd_notify dialog (READY, WATCHDOG,
STOPPING, RELOADING) seen from a socket this test binds in place of systemd's.

- ``systemd-analyze verify`` on every rendered unit (``make units`` with ``BINDIR`` pointing at this
  virtualenv, so ExecStart= names a real executable), failing on any output at all; skipped where
  systemd-analyze is not installed (``apt-get install systemd`` provides it; ``make test`` does not
  install it).
- ``systemd-sysusers --dry-run`` and ``systemd-tmpfiles --root`` on the sysusers.d/tmpfiles.d files.
- Under a real service manager (PID 1 is systemd, or a user manager answers), the broker as a
  transient ``Type=notify`` unit with a watchdog: active after READY, still active after several
  watchdog periods, killed for a missed watchdog once SIGSTOPped. Skipped, saying why, elsewhere.
- Without systemd: ``gpud broker`` and ``gpud worker`` with ``$NOTIFY_SOCKET`` pointing at a datagram
  socket of this test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUD = [sys.executable, "-m", "gpud_cli"]
WATCHDOG_USEC = 200_000  # pings every 0.1 s


# ---------------------------------------------------------------------------------- unit files


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units rendered by ``make units`` for this virtualenv."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed: cannot render the units with `make units`")
    out = tmp_path_factory.mktemp("units")
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "units", f"BINDIR={BIN}", f"UNITDIR={out}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_units_are_rendered_completely(units: Path) -> None:
    templates = sorted(p.name.removesuffix(".in") for p in (ROOT / "systemd").glob("*.in"))
    assert templates == ["gpud-broker@.service", "gpud-worker.service"]
    for name in templates:
        text = (units / name).read_text()
        assert "@BINDIR@" not in text and "@SYSCONFDIR@" not in text, name
        assert f"ExecStart={BIN}/gpud " in text
        for key in ("Type=notify", "NotifyAccess=main", "WatchdogSec=", "Restart=on-failure", "NoNewPrivileges=yes",
                    "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "CapabilityBoundingSet="):
            assert key in text, (name, key)
    worker = (units / "gpud-worker.service").read_text()
    assert "DeviceAllow=/dev/nvidiactl rw" in worker and "DevicePolicy=closed" in worker
    # /proc/devices names of a current driver (seen on an H200 VM): 195 nvidia, 195 nvidiactl, nvidia-uvm.
    for name in ("nvidia", "nvidiactl", "nvidia-uvm"):
        assert f"DeviceAllow=char-{name} rwm\n" in worker, name  # m: the sandbox makes its GPU nodes
    assert "CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_CHOWN CAP_DAC_OVERRIDE CAP_FOWNER CAP_KILL CAP_SYS_ADMIN CAP_MKNOD\n" in worker
    broker = (units / "gpud-broker@.service").read_text()
    assert "CapabilityBoundingSet=\n" in broker and "User=gpud" in broker and "--name %i" in broker


def test_systemd_analyze_verify_every_unit(units: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd): units not verified")
    # The template is verified through its two instances (systemd finds the template beside them).
    paths = [units / "gpud-broker@primary.service", units / "gpud-broker@backup.service", units / "gpud-worker.service"]
    r = subprocess.run([analyze, "verify", "--man=no", *map(str, paths)], capture_output=True, text=True, timeout=60)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0 and not out, out


def test_verify_reports_a_broken_unit(units: Path, tmp_path: Path) -> None:
    """The check above would see a mistake: verify prints unknown keys and bad values (exit 0)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = (units / "gpud-worker.service").read_text().replace("ProtectHome=yes", "ProtectHome=maybe\nProtectHomme=yes")
    (tmp_path / "gpud-worker.service").write_text(text)
    r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "gpud-worker.service")],
                       capture_output=True, text=True, timeout=60)
    assert "ProtectHomme" in r.stderr and "maybe" in r.stderr


def test_sysusers_file_parses(tmp_path: Path) -> None:
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed (apt-get install systemd)")
    r = subprocess.run([tool, "--dry-run", f"--root={tmp_path}", str(ROOT / "systemd/gpud-sysusers.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "Creating user 'gpud' " in said and "Creating user 'gpud-job7' " in said
    bad = [line for line in said.splitlines() if "ignor" in line.lower() or "fail" in line.lower() or "invalid" in line.lower()]
    assert not bad, bad


def test_tmpfiles_file_creates_the_job_root(tmp_path: Path) -> None:
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        pytest.skip("systemd-tmpfiles is not installed (apt-get install systemd)")
    if os.geteuid() != 0:
        pytest.skip("the directories belong to root: systemd-tmpfiles --root needs root to chown them")
    r = subprocess.run([tool, f"--root={tmp_path}", "--create", str(ROOT / "systemd/gpud-tmpfiles.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    jobs = tmp_path / "var/lib/gpud/jobs"
    assert jobs.is_dir() and (jobs.stat().st_mode & 0o7777) == 0o711


# ---------------------------------------------------------------------------------- a real systemd


def _service_manager() -> tuple[list[str], str] | None:
    """``(["--user"] or [], why)`` for a manager that can run a transient unit, else ``(None, why)``."""
    if shutil.which("systemd-run") is None or shutil.which("systemctl") is None:
        return None
    if os.geteuid() == 0 and Path("/run/systemd/system").is_dir():
        return [], "system manager"
    r = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True, text=True, timeout=10)
    if r.stdout.strip() in ("running", "degraded"):
        return ["--user"], "user manager"
    return None


def _show(scope: list[str], unit: str, prop: str) -> str:
    r = subprocess.run(["systemctl", *scope, "show", "-p", prop, "--value", unit], capture_output=True, text=True, timeout=10)
    return r.stdout.strip()


def test_broker_under_a_real_service_manager(tmp_path: Path) -> None:
    manager = _service_manager()
    if manager is None:
        why = "systemd-run is not installed" if shutil.which("systemd-run") is None else (
            "no service manager to start a unit under: PID 1 is "
            f"{Path('/proc/1/comm').read_text().strip() or '?'}, not systemd, and no user manager answers "
            "(systemd cannot be started in a private namespace on this machine)")
        pytest.skip(why)
    scope, _ = manager
    unit = f"gpud-test-{uuid.uuid4().hex[:8]}.service"
    ready = tmp_path / "broker.json"
    start = subprocess.run(
        ["systemd-run", *scope, "--quiet", f"--unit={unit}",  # no --collect: keep Result= to read
         "-p", "Type=notify", "-p", "NotifyAccess=main", "-p", "WatchdogSec=2", "-p", "TimeoutStartSec=30",
         "-p", f"WorkingDirectory={tmp_path}",
         str(BIN / "gpud"), "broker", "--security", "none", "--frontend", "tcp://127.0.0.1:*",
         "--backend", "tcp://127.0.0.1:*", "--ready-file", str(ready)],
        capture_output=True, text=True, timeout=60)
    try:
        # systemd-run returns once the start job is done: for Type=notify, once READY=1 came.
        assert start.returncode == 0, start.stderr
        assert _show(scope, unit, "ActiveState") == "active" and ready.exists()
        pid = int(_show(scope, unit, "MainPID"))
        # Several watchdog periods later it is still there: the pings arrive.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert _show(scope, unit, "ActiveState") == "active", _show(scope, unit, "Result")
            time.sleep(0.5)
        # A stopped loop misses its pings: systemd kills the service for it.
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while _show(scope, unit, "Result") != "watchdog":
            assert time.monotonic() < deadline, "systemd did not see the missed watchdog"
            time.sleep(0.2)
    finally:
        subprocess.run(["systemctl", *scope, "stop", unit], capture_output=True, timeout=30)
        subprocess.run(["systemctl", *scope, "reset-failed", unit], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------------- sd_notify by hand


class NotifySocket:
    """The service manager's end: a datagram socket the daemon's ``$NOTIFY_SOCKET`` names."""

    def __init__(self, tmp_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = tmp_path / "notify.sock"
        if len(str(path)) < 100:
            self.sock.bind(str(path))
            self.address = str(path)
        else:  # sun_path is 108 bytes: use the abstract namespace (also what systemd does)
            name = f"gpud-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.address = "@" + name

    def env(self, watchdog_usec: int | None = WATCHDOG_USEC) -> dict[str, str]:
        env = dict(os.environ, NOTIFY_SOCKET=self.address, GPUD_LOG_LEVEL="INFO")
        env.pop("WATCHDOG_PID", None)
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        else:
            env.pop("WATCHDOG_USEC", None)
        return env

    def recv(self, timeout: float) -> str | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            return self.sock.recv(4096).decode()
        except TimeoutError:
            return None

    def wait_for(self, prefix: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> tuple[str, list[str]]:
        """The first message starting with ``prefix``, and every message before it."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} within {timeout}s; got {seen[-5:]}")
            msg = self.recv(min(left, 0.5))
            if msg is None:
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"the daemon exited with {proc.returncode} before {prefix!r}")
                continue
            if msg.startswith(prefix):
                return msg, seen
            seen.append(msg)

    def count(self, state: str, seconds: float) -> int:
        n = 0
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg == state:
                n += 1
        return n

    def flush(self) -> None:
        while self.recv(0.001) is not None:
            pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    s = NotifySocket(tmp_path)
    yield s
    s.close()


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen([*GPUD, *args], env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)


def _broker_args(tmp_path: Path) -> list[str]:
    return ["broker", "--security", "none", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
            "--admin", f"ipc://{tmp_path}/admin.sock", "--ready-file", str(tmp_path / "broker.json"), "--heartbeat-ms", "200"]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_broker_ready_watchdog_reload_stopping(tmp_path: Path, notify_socket: NotifySocket) -> None:
    proc = _spawn(_broker_args(tmp_path), notify_socket.env(), tmp_path / "broker.log")
    try:
        msg, before = notify_socket.wait_for("READY=1", proc=proc)
        assert not before, before
        # READY comes after the sockets are bound: the ready file (written once bound) is there.
        info = json.loads((tmp_path / "broker.json").read_text())
        assert info["frontend"].startswith("tcp://127.0.0.1:") and "STATUS=serving" in msg
        assert notify_socket.count("WATCHDOG=1", 1.0) >= 3
        proc.send_signal(signal.SIGHUP)
        notify_socket.wait_for("RELOADING=1", timeout=5)
        notify_socket.wait_for("READY=1", timeout=5)
        proc.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", timeout=5)
        assert proc.wait(20) == 0
    finally:
        _stop(proc)
    log = (tmp_path / "broker.log").read_text()
    assert "configuration re-read" in log and "stopped" in log


def test_broker_without_watchdog_sends_no_pings(tmp_path: Path, notify_socket: NotifySocket) -> None:
    proc = _spawn(_broker_args(tmp_path), notify_socket.env(watchdog_usec=None), tmp_path / "broker.log")
    try:
        notify_socket.wait_for("READY=1", proc=proc)
        assert notify_socket.count("WATCHDOG=1", 0.5) == 0
        proc.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", timeout=5)
        assert proc.wait(20) == 0
    finally:
        _stop(proc)


def test_stopped_broker_misses_its_watchdog(tmp_path: Path, notify_socket: NotifySocket) -> None:
    proc = _spawn(_broker_args(tmp_path), notify_socket.env(), tmp_path / "broker.log")
    try:
        notify_socket.wait_for("READY=1", proc=proc)
        notify_socket.wait_for("WATCHDOG=1", timeout=5)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _process_state(proc.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        notify_socket.flush()  # pings sent before it stopped
        assert notify_socket.count("WATCHDOG=1", 0.6) == 0  # six ping periods
        proc.send_signal(signal.SIGCONT)
        notify_socket.wait_for("WATCHDOG=1", timeout=5)
        proc.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", timeout=5)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        _stop(proc)


def test_worker_ready_status_watchdog_stopping(tmp_path: Path, notify_socket: NotifySocket) -> None:
    broker = _spawn(_broker_args(tmp_path), dict(os.environ), tmp_path / "broker.log")
    worker = None
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "broker.json").exists():
            assert broker.poll() is None and time.monotonic() < deadline, (tmp_path / "broker.log").read_text()
            time.sleep(0.02)
        backend = json.loads((tmp_path / "broker.json").read_text())["backend"]
        args = ["worker", "--security", "none", "--simulate", "1", "--broker", backend, "--name", "wn",
                "--workdir", str(tmp_path / "jobs"), "--heartbeat-ms", "200"]
        if os.geteuid() == 0:
            args += ["--job-uids", "61900-61903"]
        worker = _spawn(args, notify_socket.env(), tmp_path / "worker.log")
        # READY once started (not once registered), then STATUS= when the broker welcomes it.
        msg, _ = notify_socket.wait_for("READY=1", proc=worker)
        assert "STATUS=connecting to " + backend in msg
        notify_socket.wait_for(f"STATUS=registered with {backend}", timeout=20, proc=worker)
        assert notify_socket.count("WATCHDOG=1", 1.0) >= 3
        worker.send_signal(signal.SIGHUP)
        notify_socket.wait_for("RELOADING=1", timeout=5)
        notify_socket.wait_for("READY=1", timeout=5)
        worker.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", timeout=5)
        assert worker.wait(30) == 0
    finally:
        if worker is not None:
            _stop(worker)
        broker.send_signal(signal.SIGTERM)
        broker.wait(20)


def test_broker_sigterm_drains(job_user_prefix: str | None) -> None:
    """SIGTERM: queued and new requests are answered SHUTTING_DOWN, dispatched work finishes and
    its reply still reaches the client, then the broker exits 0."""
    from gpud_cli.cluster import LocalCluster
    from gpud_client import Client, ShuttingDown

    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, job_user_prefix=job_user_prefix) as c:
        with Client(c.frontend, timeout=30) as client:
            running = client.submit(["sh", "-c", "sleep 1.5; echo finished"], gpu_milli=1000, time_limit=30)
            deadline = time.monotonic() + 20
            while c.status()["counts"]["running"] < 1:
                assert time.monotonic() < deadline, "the job was not dispatched"
                time.sleep(0.02)
            queued = client.submit(["true"], gpu_milli=1000, time_limit=30)  # the GPU is taken: it waits
            deadline = time.monotonic() + 20
            while c.status()["counts"]["queued"] < 1:
                assert time.monotonic() < deadline, "the second job was not queued"
                time.sleep(0.02)
            assert c.broker is not None
            c.broker.send_signal(signal.SIGTERM)
            with pytest.raises(ShuttingDown):
                queued.wait(10)
            with pytest.raises(ShuttingDown):
                client.echo(b"new work", timeout=10)
            result = running.wait(20)
            assert result.exit_code == 0 and result.stdout == b"finished\n"
            assert c.broker.wait(20) == 0
        log = c.log_tail("broker", 50)
        assert "stopping: 1 queued request(s) answered SHUTTING_DOWN; waiting up to 10s for 1 dispatched" in log
