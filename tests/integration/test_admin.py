"""The admin socket end to end: gpudctl (as a subprocess) against a broker and two simulated workers.

Drain and cordon steer real placements, cancel reaches a real client, filters and --json work for
every command, commands that change state are logged with who asked, and ``gpudctl top`` runs in a
real terminal (tmux, 80x24) and quits on ``q``.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.admin_commands import COMMANDS
from gpud_cli.cluster import LocalCluster
from gpud_client import Cancelled, Client
from tests.waiting import wait_for

GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]


@pytest.fixture(scope="module")
def cluster(job_user_prefix: str | None) -> Iterator[LocalCluster]:
    # Default heartbeats (1 s x 3): a loaded test machine must not lose workers mid-test.
    with LocalCluster(workers=2, gpus_per_worker=1, job_user_prefix=job_user_prefix) as c:
        yield c


@pytest.fixture()
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.frontend, timeout=30) as c:
        yield c


def ctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUDCTL, "--admin", cluster.admin, *args], capture_output=True, text=True, timeout=60)


def ctl_json(cluster: LocalCluster, *args: str) -> Any:
    r = ctl(cluster, *args, "--json")
    assert r.returncode == 0, f"gpudctl {' '.join(args)}: {r.returncode}\n{r.stderr}"
    return json.loads(r.stdout)


@pytest.fixture()
def gate() -> Iterator[tuple[list[str], Path]]:
    """A job that runs until the test creates a file: ``(argv, flag)``. The directory is readable by
    the worker's pool users, and outside /tmp where it can be: a job's /tmp is its own."""
    d = Path(tempfile.mkdtemp(prefix="gpud-gate-", dir="/run" if os.access("/run", os.W_OK) else None))
    os.chmod(d, 0o755)
    flag = d / "go"
    try:
        yield ["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done"], flag
    finally:
        shutil.rmtree(d, ignore_errors=True)


def echoes_on(cluster: LocalCluster, worker: str) -> int:
    return int(ctl_json(cluster, "tasks", "--kind", "echo", "--worker", worker, "--limit", "10000")["matched"])


def other(name: str) -> str:
    return "w1" if name == "w0" else "w0"


def test_drain_keeps_new_work_off_and_running_work_finishes(
    cluster: LocalCluster, client: Client, gate: tuple[list[str], Path]
) -> None:
    argv, flag = gate
    job = client.submit(argv, gpu_milli=100, time_limit=60)
    running = wait_for(lambda: ctl_json(cluster, "tasks", "--state", "running", "--kind", "job")["tasks"],
                       what="the job to run")
    busy = running[0]["worker"]
    assert running[0]["id"] == job.id.hex()
    r = ctl(cluster, "drain", busy)
    assert r.returncode == 0 and f"worker {busy} drained" in r.stdout
    assert {w["name"]: w["draining"] for w in ctl_json(cluster, "workers")}[busy] is True
    before = echoes_on(cluster, busy)
    for i in range(20):
        assert client.echo(b"%d" % i) == b"%d" % i
    assert echoes_on(cluster, busy) == before
    assert not job.done(), "the job ended before the test let it"
    flag.touch()
    result = job.wait()  # the running job finishes on the drained worker
    assert result.exit_code == 0 and result.worker == busy

    # Undrain it and drain the other one: new work goes to it again.
    assert ctl(cluster, "undrain", busy).returncode == 0
    assert ctl(cluster, "drain", other(busy)).returncode == 0
    for _ in range(5):
        client.echo(b"x")
    assert echoes_on(cluster, busy) == before + 5
    assert ctl(cluster, "undrain", other(busy)).returncode == 0
    assert not any(w["draining"] for w in ctl_json(cluster, "workers"))


def test_cordon_keeps_work_off_a_gpu(cluster: LocalCluster, client: Client) -> None:
    uuid = {g["worker"]: g["uuid"] for g in ctl_json(cluster, "gpus")}
    r = ctl(cluster, "cordon", uuid["w0"])
    assert r.returncode == 0 and "cordoned" in r.stdout
    assert [g["health"] for g in ctl_json(cluster, "gpus", "--worker", "w0")] == ["cordoned"]
    before = echoes_on(cluster, "w0"), echoes_on(cluster, "w1")
    for _ in range(10):
        client.echo(b"c")
    assert (echoes_on(cluster, "w0"), echoes_on(cluster, "w1")) == (before[0], before[1] + 10)
    assert ctl(cluster, "uncordon", uuid["w0"]).returncode == 0
    assert ctl(cluster, "cordon", "w1/0").returncode == 0  # WORKER/INDEX works too
    for _ in range(10):
        client.echo(b"c")
    assert (echoes_on(cluster, "w0"), echoes_on(cluster, "w1")) == (before[0] + 10, before[1] + 10)
    assert ctl(cluster, "uncordon", "w1/0").returncode == 0
    assert all(g["health"] == "ok" for g in ctl_json(cluster, "gpus"))


def test_cancel_a_queued_request(cluster: LocalCluster, client: Client, gate: tuple[list[str], Path]) -> None:
    # Both GPUs taken whole by jobs that wait for the flag; a third job waits in the queue.
    argv, flag = gate
    long = [client.submit(argv, gpus=1, time_limit=60) for _ in range(2)]
    wait_for(lambda: ctl_json(cluster, "tasks", "--state", "running", "--kind", "job")["matched"] == 2,
             what="both long jobs to run")
    queued = client.submit(["true"], gpus=1, time_limit=30)
    wait_for(lambda: ctl_json(cluster, "queue"), what="the third job to queue")
    assert [q["id"] for q in ctl_json(cluster, "queue")] == [queued.id.hex()]
    r = ctl(cluster, "cancel", queued.id.hex()[:12])
    assert r.returncode == 0 and "cancelled" in r.stdout, r.stderr
    with pytest.raises(Cancelled, match="administrator"):
        queued.wait()
    r = ctl(cluster, "cancel", long[0].id.hex())
    assert r.returncode == 1 and "is running on worker" in r.stderr and "cannot be cancelled yet" in r.stderr
    flag.touch()
    assert all(j.wait().exit_code == 0 for j in long)
    r = ctl(cluster, "cancel", queued.id.hex())
    assert r.returncode == 1 and "already finished" in r.stderr


def test_tasks_and_sessions_filters(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30, tenant="alice") as alice, \
            Client(cluster.frontend, timeout=30, tenant="bob") as bob:
        for _ in range(3):
            bob.echo(b"b")
        with alice.session(gpu_milli=100, mem=1 << 20) as s:
            rows = ctl_json(cluster, "sessions", "--tenant", "alice")
            assert [r["id"] for r in rows] == [s.id.hex()]
            assert rows[0]["worker"] == s.worker and rows[0]["gpu"] == s.gpu["uuid"]
            assert rows[0]["gpu_milli"] == 100 and rows[0]["age_s"] >= 0 and rows[0]["last_seen_s"] >= 0
            assert ctl_json(cluster, "sessions", "--tenant", "bob") == []
            assert len(ctl_json(cluster, "sessions", "--worker", s.worker)) == 1
            assert ctl_json(cluster, "sessions", "--worker", other(s.worker)) == []
            table = ctl(cluster, "sessions").stdout
            assert s.id.hex()[:12] in table and "alice" in table
            gpu = [g for g in ctl_json(cluster, "gpus") if g["uuid"] == s.gpu["uuid"]][0]
            assert gpu["work"].get("session") == 1
        bobs = ctl_json(cluster, "tasks", "--tenant", "bob")
        assert bobs["matched"] >= 3 and {t["tenant"] for t in bobs["tasks"]} == {"bob"}
        sessions = ctl_json(cluster, "tasks", "--tenant", "alice", "--kind", "session", "--state", "done")
        assert sessions["matched"] == 1 and sessions["tasks"][0]["gpus"] == [s.gpu["uuid"]]
        assert ctl_json(cluster, "tasks", "--limit", "1")["tasks"].__len__() == 1
    assert ctl(cluster, "tasks", "--state", "sleeping").returncode == 2
    r = ctl(cluster, "tasks", "--limit", "0")
    assert r.returncode == 1 and "'limit' must be at least 1" in r.stderr


def test_failover_on_a_standalone_broker_is_a_clear_error(cluster: LocalCluster) -> None:
    r = ctl(cluster, "failover")
    assert r.returncode == 1 and "this broker has no peer (standalone)" in r.stderr
    st = ctl_json(cluster, "status")
    assert st["broker"]["role"] == "standalone" and st["broker"]["peer"] is None


# Every command with arguments that work on this cluster; commands that refuse here exit 1.
INVOCATIONS: list[tuple[list[str], int]] = [
    (["status"], 0), (["workers"], 0), (["gpus"], 0), (["gpus", "--worker", "w1"], 0), (["queue"], 0),
    (["tasks", "--state", "done", "--limit", "3"], 0), (["sessions"], 0),
    (["drain", "w0"], 0), (["undrain", "w0"], 0), (["cordon", "w1/0"], 0), (["uncordon", "w1/0"], 0),
    (["cancel", "0123456789abcdef"], 1), (["failover"], 1), (["reload"], 0),
    (["openstack", "list"], 1),  # OpenStack is not enabled on this cluster
]


def test_every_command_has_json_output(cluster: LocalCluster) -> None:
    assert {args[0] for args, _ in INVOCATIONS} == set(COMMANDS)
    for args, status in INVOCATIONS:
        r = ctl(cluster, *args, "--json")
        assert r.returncode == status, f"{args}: {r.returncode} {r.stderr}"
        if status == 0:
            json.loads(r.stdout)
            human = ctl(cluster, *args)
            assert human.returncode == 0 and all(len(line) <= 80 for line in human.stdout.splitlines())
        else:
            assert r.stdout == "" and r.stderr.startswith(f"gpudctl: {args[0]} failed: ")


def test_mutating_commands_are_logged_with_who_asked(cluster: LocalCluster) -> None:
    with subprocess.Popen([*GPUDCTL, "--admin", cluster.admin, "cordon", "w0/0"], stdout=subprocess.DEVNULL) as r:
        assert r.wait(timeout=60) == 0
    assert ctl(cluster, "uncordon", "w0/0").returncode == 0
    assert ctl(cluster, "gpus").returncode == 0
    user = getpass.getuser()
    log = wait_for(lambda: (lambda t: t if "admin uncordon" in t else "")(cluster.log_tail("broker", 400)),
                   what="the broker to log the uncordon")
    assert f"admin cordon gpu=w0/0 by {user} pid {r.pid}" in log
    assert f"admin uncordon gpu=w0/0 by {user} pid " in log
    assert "admin gpus" not in log  # reading is not logged


# --------------------------------------------------------------------------- gpudctl top in tmux


def _tmux(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-S", str(sock), *args], capture_output=True, text=True, timeout=30)


def test_top_in_an_80_column_terminal(tmp_path: Path, job_user_prefix: str | None) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock = tmp_path / "tmux.sock"
    rc_file = tmp_path / "rc"
    with LocalCluster(workers=1, gpus_per_worker=2, job_user_prefix=job_user_prefix) as c:
        # The shell traps SIGINT (so that it outlives the Ctrl-C and writes top's exit status);
        # top itself gets the default handling, as from an interactive shell.
        cmd = (f"trap : INT; {sys.executable} -m gpud_client.ctl --admin {c.admin} top; "
               f"echo $? > {rc_file}")
        env = {**os.environ, "TERM": "xterm"}
        r = subprocess.run(["tmux", "-S", str(sock), "-f", "/dev/null", "new-session", "-d", "-s", "top",
                            "-x", "80", "-y", "24", "sh", "-c", cmd], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode == 0, r.stderr
        try:
            def screen() -> str:
                return _tmux(sock, "capture-pane", "-p", "-t", "top").stdout

            text = wait_for(lambda: (lambda s: s if "w0/1" in s else "")(screen()), what="GPU rows in top")
            lines = text.splitlines()
            assert lines[0].startswith("gpud top") and "role standalone" in lines[0]
            assert any(line.startswith("w0/0") and "[" in line for line in lines)
            assert all(len(line) <= 80 for line in lines)
            # A broker that stops answering is shown as such; top keeps trying.
            assert c.broker is not None
            c.broker.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: "broker not answering" in screen(), what="'broker not answering'")
            finally:
                c.broker.send_signal(signal.SIGCONT)
            wait_for(lambda: "role standalone" in screen(), what="top to see the broker again")
            _tmux(sock, "send-keys", "-t", "top", "q")
            wait_for(rc_file.exists, what="top to exit on q")
            assert rc_file.read_text().strip() == "0"
            # Ctrl-C quits cleanly too, on a tmux server of its own: the first one exits with its
            # last session, and a client that reaches it while it does gets "server exited
            # unexpectedly".
            rc_file.unlink()
            sock = tmp_path / "tmux-ctrl-c.sock"
            r = _tmux(sock, "new-session", "-d", "-s", "top", "-x", "80", "-y", "24", "sh", "-c", cmd)
            assert r.returncode == 0, r.stderr
            wait_for(lambda: "w0/1" in screen(), what="GPU rows in top")
            _tmux(sock, "send-keys", "-t", "top", "C-c")
            wait_for(rc_file.exists, what="top to exit on Ctrl-C")
            assert rc_file.read_text().strip() == "0"
        finally:
            for each in (tmp_path / "tmux.sock", tmp_path / "tmux-ctrl-c.sock"):
                _tmux(each, "kill-server")


def test_output_into_a_closed_pipe_ends_quietly(cluster: LocalCluster) -> None:
    """`gpudctl status --json | head -0`: the reader is gone before gpudctl writes."""
    read, write = os.pipe()
    os.close(read)  # nobody will ever read: the first write is EPIPE
    try:
        r = subprocess.run([*GPUDCTL, "--admin", cluster.admin, "status", "--json"], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_a_missing_socket_is_said_at_once(tmp_path: Path) -> None:
    path = tmp_path / "none" / "admin.sock"
    # A long timeout: only the check before connecting can answer within the test's own.
    r = subprocess.run([*GPUDCTL, "--admin", f"ipc://{path}", "--timeout", "600", "status"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and f"no admin socket at {path}" in r.stderr and "did not answer" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="runs gpudctl as another, unprivileged user")
def test_permission_denied_is_said_to_a_user_the_socket_refuses(cluster: LocalCluster) -> None:
    import pwd
    import sysconfig

    nobody = pwd.getpwnam("nobody")
    sock = Path(cluster.admin.removeprefix("ipc://"))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/"}
    # This interpreter may sit where nobody may not go (/root/.pyenv): the system's of the same
    # version, given this environment's packages (gpud is installed in it as editable paths).
    python = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin")
    if python is None:
        pytest.skip(f"no system python{sys.version_info.major}.{sys.version_info.minor} for an unprivileged user")
    start = (f"import site, sys; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
             "from gpud_client.ctl import main; sys.exit(main())")

    def as_nobody() -> subprocess.CompletedProcess[str]:
        return subprocess.run([python, "-c", start, "--admin", cluster.admin, "--timeout", "600", "status"],
                              capture_output=True, text=True, timeout=60, env=env, cwd="/",
                              user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])

    mode = sock.parent.stat().st_mode
    r = as_nobody()  # the run directory (0700) may not be searched
    assert r.returncode == 3 and "permission denied" in r.stderr and "did not answer" not in r.stderr, r.stderr
    try:
        sock.parent.chmod(0o755)  # now the socket itself (0600, root's) refuses
        r = as_nobody()
        assert r.returncode == 3 and f"permission denied: {sock} (mode 0600" in r.stderr, r.stderr
    finally:
        sock.parent.chmod(mode & 0o7777)
    assert ctl(cluster, "status").returncode == 0  # its owner still may
