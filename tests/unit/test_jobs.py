"""Tests of gpud_worker.jobs: the job sandbox, with real processes and, as root, real pool users.

Run as root, every job runs as a user of a pool created for this module (``gpud-jt<pid>-*``) and the
root-only tests prove the isolation; run as another user, jobs run as that user and the root-only
tests are skipped.
"""

from __future__ import annotations

import array
import os
import pathlib
import pwd
import random
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
import zmq

from gpud.errors import InvalidRequest, RemoteError
from gpud.protocol import JobSpec
from gpud_worker.jobs import JobLimits, JobOutcome, JobRunner, UserPool

IS_ROOT = os.geteuid() == 0
# Pool users of this module and this run only: concurrent runs of this file must not share users
# (each kills every process of its users). Users of runs whose process is gone are removed.
PREFIX = f"gpud-jt{os.getpid()}-"
_PREFIX_RE = re.compile(r"gpud-jt(\d+)-\d+")
NUSERS = 3
REPO = pathlib.Path(__file__).resolve().parents[2]

root_only = pytest.mark.skipif(not IS_ROOT, reason="needs root to create and switch to pool users")


# -- helpers ----------------------------------------------------------------------------------


def job(*argv: str, **fields: Any) -> JobSpec:
    return JobSpec(
        argv=argv,
        env=fields.pop("env", {}),
        files=tuple(fields.pop("files", ())),
        outputs=tuple(fields.pop("outputs", ())),
        **fields,
    )


def run(
    runner: JobRunner,
    spec: JobSpec,
    inputs: tuple[Any, ...] = (),
    *,
    tenant: str = "tenant",
    job_id: bytes | None = None,
    cancel: threading.Event | None = None,
) -> JobOutcome:
    return runner.run(job_id or os.urandom(8), spec, inputs, "0", tenant, cancel)


def marker() -> str:
    """A unique ``sleep`` argument, to find a job's processes by command line."""
    return f"{random.randint(10**6, 10**7)}.{random.randint(100, 999)}"


def survivors(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if mark in (proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def user_processes(uid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["uids"])
        if p.info["uids"] is not None and uid in p.info["uids"]
    ]


def wait_for(path: pathlib.Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _user_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    for _ in range(50):
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 10:  # 10: /etc/passwd is locked by a concurrent useradd/userdel
            return proc
        time.sleep(0.1)
    return proc


def _delete_user(name: str) -> None:
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for _ in range(3):
        for proc in user_processes(uid):
            try:
                proc.kill()
            except psutil.Error:
                pass
        if _user_tool("userdel", name).returncode in (0, 6):  # 6: gone already
            return
        time.sleep(0.2)
    _user_tool("userdel", "--force", name)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool_users() -> Iterator[list[pwd.struct_passwd]]:
    if not IS_ROOT:
        pytest.skip("needs root")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel not installed")
    for entry in pwd.getpwall():
        stale = _PREFIX_RE.fullmatch(entry.pw_name)
        if stale and not psutil.pid_exists(int(stale.group(1))):
            _delete_user(entry.pw_name)
    names = [f"{PREFIX}{i}" for i in range(NUSERS)]
    try:
        for name in names:
            proc = _user_tool(
                "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name
            )
            if proc.returncode not in (0, 9):  # 9: exists already (left by a crashed run)
                pytest.fail(f"useradd {name} failed: {proc.stderr.strip()}")
        yield [pwd.getpwnam(name) for name in names]
    finally:
        for name in names:
            _delete_user(name)


@pytest.fixture
def workroot() -> Iterator[pathlib.Path]:
    # Under /tmp, not tmp_path: pool users must be able to traverse the parents of their directory.
    path = pathlib.Path(tempfile.mkdtemp(prefix="gpud-jtest-", dir="/tmp" if IS_ROOT else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_runner(request: pytest.FixtureRequest, workroot: pathlib.Path) -> Callable[..., JobRunner]:
    pool = None
    if IS_ROOT:
        request.getfixturevalue("pool_users")
        pool = UserPool(PREFIX)

    def make(**kwargs: Any) -> JobRunner:
        return JobRunner(workroot, kwargs.pop("pool", pool), **kwargs)

    return make


@pytest.fixture
def runner(make_runner: Callable[..., JobRunner]) -> JobRunner:
    return make_runner()


# -- running a program ------------------------------------------------------------------------


def test_echo_argv(runner: JobRunner) -> None:
    out = run(runner, job("echo", "hello", "a b", "$HOME"))
    assert out.stdout == b"hello a b $HOME\n"
    assert (out.exit_code, out.timed_out, out.stderr) == (0, False, b"")
    assert not out.stdout_truncated and not out.stderr_truncated
    assert out.files == []
    assert out.user == (PREFIX + "0" if IS_ROOT else pwd.getpwuid(os.getuid()).pw_name)


def test_nonzero_exit_and_stderr(runner: JobRunner) -> None:
    out = run(runner, job("sh", "-c", "echo out; echo oops >&2; exit 3"))
    assert (out.exit_code, out.stdout, out.stderr) == (3, b"out\n", b"oops\n")


def test_killed_by_signal_is_negative(runner: JobRunner) -> None:
    assert run(runner, job("sh", "-c", "kill -KILL $$")).exit_code == -9


def test_program_not_found_is_an_outcome(runner: JobRunner) -> None:
    out = run(runner, job("/nonexistent/program", "x"))
    assert out.exit_code == 127
    assert b"/nonexistent/program" in out.stderr


def test_files_in_and_out(make_runner: Callable[..., JobRunner], workroot: pathlib.Path) -> None:
    runner = make_runner(max_output_file=1000)
    script = (
        "cat a.txt b.bin c.frame d.ints > joined; ln -s /etc/passwd link; mkfifo fifo; mkdir dir;"
        " head -c 1001 /dev/zero > big; head -c 1000 /dev/zero > edge"
    )
    spec = job(
        "sh",
        "-c",
        script,
        files=["a.txt", "b.bin", "c.frame", "d.ints"],
        outputs=["joined", "missing", "link", "fifo", "dir", "big", "edge", "a.txt", "joined"],
    )
    ints = array.array("i", [1, 2])
    inputs = (b"one\n", memoryview(bytearray(b"two\n")), zmq.Frame(b"three\n"), ints)
    out = run(runner, spec, inputs)
    assert out.exit_code == 0, out.stderr
    # Missing, symlink, FIFO, directory and over-cap files are omitted; order is spec order.
    assert out.files == [
        ("joined", b"one\ntwo\nthree\n" + ints.tobytes()),
        ("edge", bytes(1000)),
        ("a.txt", b"one\n"),
    ]
    assert os.listdir(workroot) == []  # the job directory is gone


def test_workdir_is_private(runner: JobRunner, workroot: pathlib.Path) -> None:
    job_id = b"\xab\xcd"
    out = run(
        runner, job("sh", "-c", 'pwd; stat -c "%a %U" .; echo "$HOME $TMPDIR"'), job_id=job_id
    )
    workdir = workroot / "abcd"
    lines = out.stdout.decode().splitlines()
    assert lines[0] == str(workdir)
    assert lines[1] == f"700 {out.user}"
    assert lines[2] == f"{workdir} {workdir}"
    st = os.stat(workroot)
    assert stat.S_IMODE(st.st_mode) == (0o711 if IS_ROOT else 0o700)
    if IS_ROOT:
        assert st.st_uid == 0
    assert not workdir.exists()


def test_environment_is_scrubbed(runner: JobRunner) -> None:
    out = run(runner, job("/usr/bin/env", env={"FOO": "bar=baz", "PATH": "/bin"}))
    env = dict(line.split("=", 1) for line in out.stdout.decode().splitlines())
    hexid = env["GPUD_JOB_ID"]
    assert re.fullmatch(r"[0-9a-f]{16}", hexid)
    assert env == {
        "PATH": "/bin",  # a job may set its own PATH
        "HOME": env["HOME"],
        "TMPDIR": env["HOME"],
        "USER": out.user,
        "LOGNAME": out.user,
        "LANG": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUD_JOB_ID": hexid,
        "FOO": "bar=baz",
    }
    assert env["HOME"].endswith("/" + hexid)


def test_visible_devices_exact(runner: JobRunner) -> None:
    out = runner.run(b"\x01", job("sh", "-c", 'printf %s "$CUDA_VISIBLE_DEVICES"'), [], "1,3", "t")
    assert out.stdout == b"1,3"


@pytest.mark.parametrize(
    "key", ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUD_JOB_ID", "GPUD_X", "lower", "A-B"]
)
def test_reserved_or_bad_env_refused(runner: JobRunner, workroot: pathlib.Path, key: str) -> None:
    with pytest.raises(InvalidRequest):
        run(runner, job("touch", str(workroot / "ran"), env={key: "1"}))
    assert os.listdir(workroot) == []


def test_input_count_mismatch_refused(runner: JobRunner) -> None:
    with pytest.raises(InvalidRequest):
        run(runner, job("true", files=["a", "b"]), (b"only one",))


def test_resource_limits(make_runner: Callable[..., JobRunner]) -> None:
    runner = make_runner(limits=JobLimits(address_space=8 << 30))
    out = run(runner, job("sh", "-c", "cat /proc/self/limits /proc/self/status", time_limit=10))
    text = out.stdout.decode()

    def limit(name: str) -> tuple[str, str]:
        found = re.search(rf"^Max {name}\s+(\S+)\s+(\S+)", text, re.M)
        assert found, name
        return found.group(1), found.group(2)

    assert limit("core file size") == ("0", "0")
    assert limit("open files") == ("1024", "1024")
    assert limit("cpu time") == ("15", "15")
    assert limit("address space") == (str(8 << 30),) * 2
    if IS_ROOT:
        assert limit("processes") == ("512", "512")
    assert re.search(r"^NoNewPrivs:\s+1$", text, re.M)


# -- output, time limit, cancel and leftovers ---------------------------------------------------


def test_output_cap(runner: JobRunner) -> None:
    started = time.monotonic()
    out = run(
        runner,
        job(
            "sh", "-c", "head -c 10000000 /dev/zero; head -c 5000000 /dev/zero >&2", output_cap=1000
        ),
    )
    assert out.exit_code == 0
    assert out.stdout == bytes(1000) and out.stderr == bytes(1000)
    assert out.stdout_truncated and out.stderr_truncated
    assert time.monotonic() - started < 10


def test_time_limit_kills_whole_group(runner: JobRunner) -> None:
    mark = marker()
    started = time.monotonic()
    out = run(
        runner,
        job("sh", "-c", f'trap "" TERM; sleep {mark} & sleep {mark}', time_limit=1),
    )
    elapsed = time.monotonic() - started
    assert out.timed_out
    assert out.exit_code == -9  # the shell ignores SIGTERM: SIGKILL after the grace period
    assert 1 <= elapsed < 6
    assert survivors(mark) == []


def test_background_child_killed_when_leader_exits(runner: JobRunner) -> None:
    mark = marker()
    started = time.monotonic()
    out = run(runner, job("sh", "-c", f"sleep {mark} & echo started"))
    assert (out.exit_code, out.stdout, out.timed_out) == (0, b"started\n", False)
    assert time.monotonic() - started < 5  # the child holds stdout open until it is killed
    assert survivors(mark) == []


def test_cancel(runner: JobRunner, workroot: pathlib.Path) -> None:
    mark = marker()
    cancel = threading.Event()
    job_id = os.urandom(8)
    spec = job("sh", "-c", f"touch started; sleep {mark}")
    with ThreadPoolExecutor(1) as executor:
        future = executor.submit(run, runner, spec, job_id=job_id, cancel=cancel)
        wait_for(workroot / job_id.hex() / "started")
        with pytest.raises(RemoteError, match="already running"):
            run(runner, spec, job_id=job_id)
        started = time.monotonic()
        cancel.set()
        out = future.result(timeout=10)
    assert time.monotonic() - started < 3
    assert out.exit_code < 0 and not out.timed_out
    assert survivors(mark) == []


# -- the user pool ----------------------------------------------------------------------------


def test_pool_prefers_same_tenant_then_fresh_user() -> None:
    pool = UserPool("")  # every non-root user of this machine; only names are handed around
    if len(pool) < 3:
        pytest.skip("needs 3 non-root users")
    a = pool.acquire("A", 1)
    assert a.pw_uid != 0
    pool.release(a)
    b = pool.acquire("B", 1)
    assert b.pw_name != a.pw_name  # a user that never served anyone beats A's
    pool.release(b)
    assert pool.acquire("A", 1).pw_name == a.pw_name
    with pytest.raises(ValueError):
        pool.release(b)  # not held


def test_pool_waits_and_times_out() -> None:
    pool = UserPool("")
    if len(pool) < 1:
        pytest.skip("needs a non-root user")
    held = [pool.acquire(f"t{i}", 1) for i in range(len(pool))]
    with pytest.raises(RemoteError, match="busy"):
        pool.acquire("late", 0.05)
    with ThreadPoolExecutor(1) as executor:
        waiter = executor.submit(pool.acquire, "late", 30)
        pool.release(held[0])
        assert waiter.result(timeout=10).pw_name == held[0].pw_name


def test_empty_pool_refused() -> None:
    pool = UserPool("gpud-no-such-user-prefix-")
    assert len(pool) == 0
    with pytest.raises(RemoteError, match="no pool users named gpud-no-such-user-prefix-"):
        pool.acquire("t", 1)


# -- as root: pool users and isolation --------------------------------------------------------


@root_only
def test_runs_as_pool_user_without_groups(
    runner: JobRunner, pool_users: list[pwd.struct_passwd]
) -> None:
    out = run(runner, job("sh", "-c", "id -u; id -g; id -G"))
    uid, gid, groups = out.stdout.decode().split("\n")[:3]
    user = pwd.getpwnam(out.user)
    assert user.pw_name.startswith(PREFIX) and user in pool_users
    assert int(uid) == user.pw_uid != 0
    assert int(gid) == user.pw_gid != 0
    assert groups.split() == [gid]


@root_only
def test_root_without_pool_users_refused(
    make_runner: Callable[..., JobRunner], workroot: pathlib.Path
) -> None:
    ran = workroot / "ran"
    for pool in (None, UserPool("gpud-no-such-user-prefix-")):
        with pytest.raises(RemoteError):
            run(make_runner(pool=pool), job("touch", str(ran)))
    assert not ran.exists()


@root_only
def test_tenants_cannot_reach_each_other(runner: JobRunner, workroot: pathlib.Path) -> None:
    keys = pathlib.Path(tempfile.mkdtemp(prefix="gpud-jtest-keys-", dir="/tmp"))
    try:
        keys.chmod(0o755)
        (keys / "key").write_text("TOPSECRET-1")
        (keys / "key").chmod(0o600)
        (keys / "closed").mkdir(mode=0o700)
        (keys / "closed" / "key").write_text("TOPSECRET-2")
        mark = marker()
        cancel = threading.Event()
        b_id = os.urandom(8)
        b_spec = job(
            "sh", "-c", f"echo TOPSECRET-B > secret; chmod 644 secret; touch ready; sleep {mark}"
        )
        with ThreadPoolExecutor(1) as executor:
            b_future = executor.submit(run, runner, b_spec, tenant="B", job_id=b_id, cancel=cancel)
            wait_for(workroot / b_id.hex() / "ready")
            (b_pid,) = [p.pid for p in survivors(mark)]
            probe = (
                'for f in "$BDIR/secret" "$KEY1" "$KEY2"; do cat "$f"; echo "rc=$?"; done;'
                ' ls ..; echo "rc=$?"; ls "$BDIR"; echo "rc=$?"; kill -0 "$BPID"; echo "rc=$?";'
                ' mkdir ../intruder; echo "rc=$?"'
            )
            env = {
                "BDIR": f"../{b_id.hex()}",
                "KEY1": str(keys / "key"),
                "KEY2": str(keys / "closed" / "key"),
                "BPID": str(b_pid),
            }
            a_out = run(runner, job("sh", "-c", probe, env=env), tenant="A")
            cancel.set()
            b_out = b_future.result(timeout=10)
        assert a_out.user != b_out.user
        assert b"TOPSECRET" not in a_out.stdout
        assert a_out.stdout.count(b"rc=") == 7 and b"rc=0" not in a_out.stdout
        assert b"Permission denied" in a_out.stderr
        assert b_out.exit_code < 0 and survivors(mark) == []
    finally:
        shutil.rmtree(keys)


@root_only
def test_setsid_escapee_killed(runner: JobRunner) -> None:
    mark = marker()
    script = (
        f"setsid sh -c 'touch escaped; exec sleep {mark}' &"
        " while [ ! -e escaped ]; do sleep 0.01; done; echo ok"
    )
    out = run(runner, job("sh", "-c", script))
    assert out.stdout == b"ok\n"
    assert survivors(mark) == []


@root_only
def test_fork_bomb_contained(runner: JobRunner) -> None:
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 a pool user can run")
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(2000):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(1000)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n, flush=True)\n"
        "time.sleep(1000)\n"
    )
    started = time.monotonic()
    out = run(runner, job(python, "-c", bomb, time_limit=3), tenant="bomb")
    assert out.timed_out
    assert 0 < int(out.stdout) < 512  # RLIMIT_NPROC of the pool user stopped it
    assert time.monotonic() - started < 15
    uid = pwd.getpwnam(out.user).pw_uid
    assert user_processes(uid) == []  # all killed, and the orphans' zombies reaped
    after = run(runner, job("id", "-u"), tenant="bomb")
    assert after.user == out.user
    assert (after.exit_code, after.stdout) == (0, f"{uid}\n".encode())


@root_only
def test_without_root_runs_as_current_user(pool_users: list[pwd.struct_passwd]) -> None:
    """Run the runner itself as an unprivileged user: jobs run as that user, the pool is unused."""
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} the pool user can run")
    user = pool_users[-1]
    root = pathlib.Path(tempfile.mkdtemp(prefix="gpud-jtest-nonroot-", dir="/tmp"))
    os.chown(root, user.pw_uid, user.pw_gid)
    mark = marker()
    script = (
        "import os, pathlib, sys\n"
        "from gpud.protocol import JobSpec\n"
        "from gpud_worker.jobs import JobRunner, UserPool\n"
        "runner = JobRunner(pathlib.Path(sys.argv[1]), UserPool('gpud-no-such-user-prefix-'))\n"
        f"spec = JobSpec(('sh', '-c', 'id -u; sleep {mark} & echo ok'), {{}}, (), ())\n"
        "out = runner.run(b'\\x07', spec, [], '0', 't')\n"
        "print(out.user, out.exit_code, out.stdout.split(), os.listdir(sys.argv[1]))\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(REPO / "worker"), sysconfig.get_paths()["purelib"]]
        ),
    }
    try:
        proc = subprocess.run(
            [python, "-c", script, str(root)],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            env=env,
            cwd="/tmp",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(root)
    if "ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr:
        pytest.skip(f"{python} cannot import this virtualenv's packages: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        user.pw_name,
        "0",
        "[b'" + str(user.pw_uid) + "',",
        "b'ok']",
        "[]",
    ]
    assert survivors(mark) == []
