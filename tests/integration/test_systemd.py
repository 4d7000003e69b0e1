"""The daemons as systemd services: the unit files, the units run by a real systemd, and the
sd_notify dialog (READY, WATCHDOG, STOPPING, RELOADING) seen from a socket this test binds.

- ``systemd-analyze verify`` on every rendered unit (``make units`` with ``BINDIR`` pointing at this
  virtualenv, so ExecStart= names a real executable), failing on any output at all.
- ``systemd-sysusers --dry-run`` and ``systemd-tmpfiles --root`` on the sysusers.d/tmpfiles.d files.
- A real systemd (Debian's 252, as PID 1 of a namespace: tests/systemd_ns.py) with the rendered units
  installed as docs/OPERATIONS.md says: systemd-sysusers and systemd-tmpfiles create the users and
  directories; gpud-broker@primary, @backup (a broker pair on one host, each with a drop-in for its
  ports and role) and gpud-worker (one simulated GPU) start as Type=notify and are active only after
  READY=1 (a broker that cannot bind never is); the hardening holds (no capabilities, no new
  privileges, read-only outside the unit's directories, jobs as pool users); ``systemctl reload``
  re-reads gpud.toml and fails on a bad one; ``systemctl stop`` of the worker lets its running job
  finish; a hung broker (SIGSTOP) is killed by the watchdog and restarted. Skipped, saying why, only
  where the namespace cannot be made (not root, no cgroup v2, the kernel refuses).
- Without systemd: ``gpud broker`` and ``gpud worker`` with ``$NOTIFY_SOCKET`` pointing at a datagram
  socket of this test.

systemd's tools come from Debian's ``systemd`` package, which ``make test`` installs where missing.
Not checked here: MemoryMax, TasksMax and CPUQuota (this host binds those controllers to cgroup v1,
so the namespace's cgroup v2 has none of them).
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
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUD = [sys.executable, "-m", "gpud_cli"]
WATCHDOG_USEC = 200_000  # pings every 0.1 s


# ---------------------------------------------------------------------------------- unit files


def _render(bindir: Path | str, out: Path) -> Path:
    """The units rendered by ``make units`` for ``bindir``, in ``out``."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed: cannot render the units with `make units`")
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "units", f"BINDIR={bindir}", f"UNITDIR={out}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units rendered by ``make units`` for this virtualenv."""
    return _render(BIN, tmp_path_factory.mktemp("units"))


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


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


CONFIG = """\
[broker]
policy = "{policy}"
heartbeat_ms = 300

[security]
mode = "none"

[metrics]
listen = ""

[worker]
name = "vm-1"
brokers = ["tcp://127.0.0.1:{primary_backend}", "tcp://127.0.0.1:{backup_backend}"]
simulate = 1
heartbeat_ms = 300
drain_timeout = 20.0
"""

BROKER_DROPIN = """\
# The test's pair runs on one host: each instance gets its own ports and role.
[Service]
Environment=GPUD_STANDBY_ROLE={role} GPUD_STANDBY_PEER=tcp://127.0.0.1:{peer} GPUD_STANDBY_PEER_BIND=tcp://127.0.0.1:{bind}
Environment=GPUD_BROKER_FRONTEND=tcp://127.0.0.1:{frontend} GPUD_BROKER_BACKEND=tcp://127.0.0.1:{backend}
"""


UNITS = ("gpud-broker@primary", "gpud-broker@backup", "gpud-worker")


class Installed:
    """The units, sysusers.d and tmpfiles.d files installed as OPERATIONS.md says, in a systemd
    booted in a namespace; ``ports`` by name; ``config`` writes /etc/gpud/gpud.toml there."""

    def __init__(self, ns: Any, units: Path) -> None:
        self.ns = ns
        self.units = units
        names = ("primary_frontend", "primary_backend", "primary_peer", "backup_frontend", "backup_backend", "backup_peer")
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        self.host_passwd = Path("/etc/passwd").read_text()
        self.sysusers = self.tmpfiles = ""

    def config(self, policy: str = "balanced") -> None:
        etc = self.ns.root / "etc/gpud"
        etc.mkdir(exist_ok=True)
        (etc / "gpud.toml").write_text(CONFIG.format(policy=policy, **self.ports))

    def frontend(self, role: str = "primary") -> str:
        return f"tcp://127.0.0.1:{self.ports[role + '_frontend']}"

    def admin(self, role: str = "primary") -> str:
        return f"ipc://{self.ns.root}/run/gpud/{role}/admin.sock"

    def main_pid(self, unit: str) -> int:
        """The unit's main PID, in the namespace."""
        return int(self.ns.show(unit, "MainPID"))

    def proc(self, unit: str, name: str) -> Path:
        """/proc/PID/``name`` of the unit's main process."""
        return self.ns.root / f"proc/{self.main_pid(unit)}/{name}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """systemd 252 as PID 1 of a namespace with the rendered units in its unit path, the users
    made by systemd-sysusers and the directories by systemd-tmpfiles, gpud.toml in its /etc."""
    sys.path.insert(0, str(ROOT / "tests"))
    from systemd_ns import INSIDE, SystemdNamespace, Unavailable, unit_bindir

    work = tmp_path_factory.mktemp("systemd")
    unitdir = work / "units"
    try:
        bindir = unit_bindir(work)
        _render(f"{INSIDE}/{bindir.relative_to(work)}", unitdir)
        ns = SystemdNamespace(work, unitdir).start()
    except Unavailable as exc:
        pytest.skip(f"cannot boot systemd in a namespace: {exc}")
    try:
        inst = Installed(ns, unitdir)
        p = inst.ports
        for role, peer in (("primary", "backup"), ("backup", "primary")):
            d = unitdir / f"gpud-broker@{role}.service.d"
            d.mkdir()
            (d / "test-pair.conf").write_text(BROKER_DROPIN.format(
                role=role, peer=p[f"{peer}_peer"], bind=p[f"{role}_peer"], frontend=p[f"{role}_frontend"],
                backend=p[f"{role}_backend"]))
        inst.config()
        # As OPERATIONS.md installs them (the files given by path instead of copied to /usr/lib).
        inst.sysusers = ns.run("systemd-sysusers", ns.inside(unitdir / "gpud-sysusers.conf")).stderr
        inst.tmpfiles = ns.run("systemd-tmpfiles", "--create", ns.inside(unitdir / "gpud-tmpfiles.conf")).stderr
        ns.systemctl("daemon-reload")
        yield inst
    finally:
        ns.close()


def test_sysusers_and_tmpfiles_create_users_and_directories(installed: Installed) -> None:
    ns = installed.ns
    assert "Creating user 'gpud'" in installed.sysusers, installed.sysusers
    assert not installed.tmpfiles.strip(), installed.tmpfiles
    users = {}
    for line in ns.run("getent", "passwd").stdout.splitlines():
        name, _, uid, gid, gecos, home, shell = line.split(":")
        users[name] = (int(uid), int(gid), gecos, home, shell)
    assert users["gpud"][2:4] == ("gpud daemon", "/var/lib/gpud")
    for i in range(8):
        uid, gid, gecos, home, shell = users[f"gpud-job{i}"]
        assert uid < 1000 and uid != 0 and gecos == "gpud job pool user" and home == "/nonexistent", users[f"gpud-job{i}"]
        assert shell.endswith("nologin")
    assert len({users[f"gpud-job{i}"][0] for i in range(8)} | {users["gpud"][0]}) == 9
    group = ns.run("getent", "group", "gpud").stdout.split(":")
    assert int(group[2]) == users["gpud"][1]
    # The host's own /etc is untouched: the namespace has an overlay of its own.
    assert "gpud-job7:" not in Path("/etc/passwd").read_text() or "gpud-job7:" in installed.host_passwd
    for path, mode in (("var/lib/gpud", 0o755), ("var/lib/gpud/jobs", 0o711)):
        st = (ns.root / path).stat()
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, 0), path


def _state(installed: Installed, unit: str) -> tuple[str, str]:
    return installed.ns.show(unit, "ActiveState"), installed.ns.show(unit, "SubState")


def test_brokers_and_worker_are_active_only_after_ready(installed: Installed) -> None:
    ns = installed.ns
    # A broker whose frontend is taken cannot bind, so it never says READY=1: its start fails,
    # it is not active although its process ran.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", installed.ports["primary_frontend"]))
        taken.listen()
        r = ns.systemctl("start", "gpud-broker@primary", check=False)
        assert r.returncode != 0, "a broker that could not bind was reported started"
        assert _state(installed, "gpud-broker@primary") != ("active", "running")
        ns.systemctl("stop", "gpud-broker@primary")
        ns.systemctl("reset-failed", "gpud-broker@primary", check=False)
    for unit in UNITS:
        assert ns.show(unit, "Type") == "notify" and ns.show(unit, "NotifyAccess") == "main", unit
        # `systemctl start` waits for the start job, which for Type=notify ends at READY=1.
        r = ns.systemctl("start", unit, timeout=90, check=False)
        assert r.returncode == 0 and _state(installed, unit) == ("active", "running"), ns.journal(unit)[-3000:]
        # STATUS= reached systemd over the notify socket with READY=1.
        status = ns.show(unit, "StatusText")
        if unit == "gpud-worker":
            assert status.startswith(("connecting to", "registered with")), status
        else:
            role = unit.split("@")[1]
            assert status.startswith("serving") and installed.frontend(role) in status, status
        assert ns.show(unit, "WatchdogUSec") == "10s"
        env = installed.proc(unit, "environ").read_bytes().split(b"\0")
        assert b"WATCHDOG_USEC=10000000" in env and b"NOTIFY_SOCKET=/run/systemd/notify" in env
    # Sockets are bound at READY: the primary answers at once over its admin socket, as gpud.
    from gpud_cli.cluster import admin_call

    assert admin_call(installed.admin("primary"), "status", {}, timeout=10)["broker"]["name"] == "primary"
    uid = int(ns.run("id", "-u", "gpud").stdout)
    status = dict(line.split(":", 1) for line in installed.proc("gpud-broker@primary", "status").read_text().splitlines())
    assert int(status["Uid"].split()[0]) == uid and int(status["NoNewPrivs"]) == 1
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    _worker_ready(installed)


def _worker_ready(installed: Installed) -> None:
    """The three units started (a no-op when they are), the worker registered."""
    for unit in UNITS:
        installed.ns.systemctl("start", unit, timeout=90)
    wait = time.monotonic() + 30
    while not installed.ns.show("gpud-worker", "StatusText").startswith("registered with"):
        assert time.monotonic() < wait, installed.ns.show("gpud-worker", "StatusText")
        time.sleep(0.2)


JOB = ("id -un; grep NoNewPrivs /proc/self/status; touch ./mine && echo wrote-workdir; "
       "touch /etc/gpud/x 2>/dev/null && echo wrote-etc; touch /var/lib/gpud/x 2>/dev/null && echo wrote-state; "
       "ls /root >/dev/null 2>&1 && echo saw-root; su -c true root </dev/null >/dev/null 2>&1 && echo became-root; "
       "exit 0")


def test_hardening_holds_and_jobs_run_as_pool_users(installed: Installed) -> None:
    from gpud_client import Client

    _worker_ready(installed)
    ns = installed.ns
    worker = installed.main_pid("gpud-worker")
    status = dict(line.split(":", 1) for line in installed.proc("gpud-worker", "status").read_text().splitlines())
    assert int(status["Uid"].split()[0]) == 0 and int(status["NoNewPrivs"]) == 1
    caps = int(status["CapBnd"], 16)
    # CAP_CHOWN 0, CAP_DAC_OVERRIDE 1, CAP_FOWNER 3, CAP_KILL 5, CAP_SETGID 6, CAP_SETUID 7, CAP_SYS_ADMIN 21
    # and CAP_MKNOD 27 (the job sandbox: namespaces, mounts and its /dev)
    assert caps == sum(1 << b for b in (0, 1, 3, 5, 6, 7, 21, 27)), hex(caps)
    # In the worker's own mount namespace (ProtectSystem=strict), root may write only its
    # StateDirectory, CacheDirectory and private /tmp.
    def writes(pid: int, path: str) -> bool:
        return ns.run("nsenter", "-t", str(pid), "-m", "--", "sh", "-c", f"touch {path} && rm -f {path}", check=False).returncode == 0

    assert not writes(worker, "/etc/gpud/x") and not writes(worker, "/usr/x") and not writes(worker, "/var/lib/x")
    assert writes(worker, "/var/lib/gpud/jobs/x") and writes(worker, "/tmp/x")
    assert not writes(worker, "/root/x")  # ProtectHome
    broker = installed.main_pid("gpud-broker@primary")
    assert not writes(broker, "/etc/gpud/x") and not writes(broker, "/var/lib/gpud/x")
    assert writes(broker, "/var/lib/gpud/primary/x") and writes(broker, "/run/gpud/primary/x")
    with Client(installed.frontend(), timeout=30) as client:
        result = client.submit(["sh", "-c", JOB], gpu_milli=1000, time_limit=30).wait(60)
    out = result.stdout.decode().split("\n")
    assert result.exit_code == 0, result
    assert out[0].startswith("gpud-job") and out[1].split() == ["NoNewPrivs:", "1"], out
    assert "wrote-workdir" in out and not {"wrote-etc", "wrote-state", "saw-root", "became-root"} & set(out), out
    assert not (ns.root / "etc/gpud/x").exists()


def test_reload_rereads_the_configuration(installed: Installed) -> None:
    from gpud_cli.cluster import admin_call

    _worker_ready(installed)
    ns = installed.ns
    unit = "gpud-broker@primary"
    pid = installed.main_pid(unit)
    assert admin_call(installed.admin(), "status", {}, timeout=10)["broker"]["policy"] == "balanced"
    try:
        installed.config(policy="best-fit")
        ns.systemctl("reload", unit)
        assert admin_call(installed.admin(), "status", {}, timeout=10)["broker"]["policy"] == "best-fit"
        assert "configuration re-read: applied" in ns.journal(unit)
        # A bad file fails the reload (ExecReload waits for the broker's answer); the broker
        # goes on with what it had.
        installed.config(policy="no-such-policy")
        r = ns.systemctl("reload", unit, check=False)
        assert r.returncode != 0
        assert "reload refused" in ns.journal(unit)
        assert admin_call(installed.admin(), "status", {}, timeout=10)["broker"]["policy"] == "best-fit"
        assert _state(installed, unit) == ("active", "running") and installed.main_pid(unit) == pid
        # The worker's reload is a SIGHUP: RELOADING=1, then READY=1 again.
        ns.systemctl("reload", "gpud-worker")
        assert _state(installed, "gpud-worker") == ("active", "running")
    finally:
        installed.config()
        ns.systemctl("reload", unit, check=False)


def test_stop_drains_running_work(installed: Installed) -> None:
    from gpud_client import Client

    _worker_ready(installed)
    ns = installed.ns
    with Client(installed.frontend(), timeout=30) as client:
        running = client.submit(["sh", "-c", "sleep 2; echo finished"], gpu_milli=1000, time_limit=30)
        wait = time.monotonic() + 30
        while ns.run("pgrep", "-f", "sleep 2", check=False).returncode != 0:
            assert time.monotonic() < wait, "the job did not start"
            time.sleep(0.05)
        ns.systemctl("stop", "gpud-worker", timeout=60)  # returns once the worker has exited
        result = running.wait(30)
    assert result.exit_code == 0 and result.stdout == b"finished\n", result
    # It exited 0 by itself: not killed at TimeoutStopSec (Result would be "timeout").
    assert ns.show("gpud-worker", "Result") == "success" and ns.show("gpud-worker", "ExecMainStatus") == "0"
    assert "stopping: draining 1 running task(s)" in ns.journal("gpud-worker")
    ns.systemctl("start", "gpud-worker", timeout=90)


def test_watchdog_restarts_a_hung_broker(installed: Installed) -> None:
    _worker_ready(installed)
    ns = installed.ns
    unit = "gpud-broker@backup"
    # The unit's WatchdogSec=10 (checked above) shortened to 3 here, as a drop-in would: what is
    # tested is what a missed watchdog does, not how long systemd waits for it.
    dropin = installed.units / f"{unit}.service.d" / "test-watchdog.conf"
    dropin.write_text("[Service]\nWatchdogSec=3\n")
    try:
        ns.systemctl("daemon-reload")
        ns.systemctl("restart", unit, timeout=90)
        assert installed.proc(unit, "environ").read_bytes().split(b"\0").count(b"WATCHDOG_USEC=3000000") == 1
        pid = installed.main_pid(unit)
        restarts = int(ns.show(unit, "NRestarts"))
        ns.run("kill", "-STOP", str(pid))  # its loop stops: no WATCHDOG=1 for WatchdogSec
        wait = time.monotonic() + 60
        while not (int(ns.show(unit, "NRestarts")) > restarts and _state(installed, unit) == ("active", "running")):
            assert time.monotonic() < wait, (_state(installed, unit), ns.journal(unit)[-2000:])
            time.sleep(0.2)
        assert installed.main_pid(unit) != pid
        log = ns.journal(unit)
        assert "Watchdog timeout" in log and "ABRT" in log, log[-2000:]
    finally:
        dropin.unlink()
        ns.systemctl("daemon-reload")
        ns.systemctl("restart", unit, timeout=90)  # with the unit's own watchdog again


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


def _pings_reloads_and_stops(proc: subprocess.Popen[bytes], notify_socket: NotifySocket, exit_within: float) -> None:
    """The daemon, ready, pings its watchdog; on SIGHUP it says RELOADING then READY, on SIGTERM
    STOPPING, and it exits 0."""
    assert notify_socket.count("WATCHDOG=1", 1.0) >= 3
    proc.send_signal(signal.SIGHUP)
    notify_socket.wait_for("RELOADING=1", timeout=5)
    notify_socket.wait_for("READY=1", timeout=5)
    proc.send_signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING=1", timeout=5)
    assert proc.wait(exit_within) == 0


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
        _pings_reloads_and_stops(proc, notify_socket, exit_within=20)
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
        _pings_reloads_and_stops(worker, notify_socket, exit_within=30)
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
