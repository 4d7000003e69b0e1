"""Tests of gpud_worker.jobs: the job sandbox, with real processes and, as root, real pool users.

Run as root, every job runs as a user of a pool created for this module (``gpud-jt<pid>-*``) and the
root-only tests prove the isolation; run as another user, jobs run as that user and the root-only
tests are skipped.
"""

from __future__ import annotations

import array
import hashlib
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

from gpud import protocol as P
from gpud.errors import ConfigError, InvalidRequest, RemoteError, TooLarge
from gpud.protocol import JobSpec
from gpud.transfer import SYSCALL_BYTES
from gpud_worker import cgroups as cgroups_module
from gpud_worker import jobs, sandbox
from gpud_worker.cgroups import (
    JobCgroup,
    JobCgroups,
    JobCgroupsV1,
    parse_mountinfo,
    setup_job_cgroups,
)
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import SimulatedProbe, simulated_gpus
from gpud_worker.held_outputs import OutputHold
from gpud_worker.jobs import (
    JobGrant,
    JobLimits,
    JobOutcome,
    JobRunner,
    MpsSettings,
    UserPool,
    mps_mem_limit,
    mps_settings,
    mps_thread_percentage,
)
from gpud_worker.worker import Worker, WorkerConfig

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
    grant: JobGrant | None = None,
) -> JobOutcome:
    return runner.run(job_id or os.urandom(8), spec, inputs, "0", tenant, cancel, grant)


def marker() -> str:
    """A unique ``sleep`` argument, to find a job's processes by command line."""
    return f"{random.randint(10**6, 10**7)}.{random.randint(100, 999)}"


def survivors(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if mark in (proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def the_one_survivor(mark: str, timeout: float = 10.0) -> list[psutil.Process]:
    """``survivors(mark)`` once the one process carrying ``mark`` runs: a job's shell has made its
    file before it starts the command after it, so a look right after the file can find none."""
    deadline = time.monotonic() + timeout
    while not (found := survivors(mark)) and time.monotonic() < deadline:
        time.sleep(0.01)
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


def test_outputs_together_past_max_outputs_are_omitted_not_read(make_runner: Callable[..., JobRunner]) -> None:
    """Each file under the per-file cap, the three together over ``max_outputs``: the one that
    would pass it is named in ``oversize``, and no output is returned (nor read into the
    worker's memory): the worker ends such a job TOO_LARGE."""
    runner = make_runner(max_output_file=1000, max_outputs=1500)
    script = "head -c 800 /dev/zero > a; head -c 800 /dev/zero > b; head -c 600 /dev/zero > c; echo x > d"
    out = run(runner, job("sh", "-c", script, outputs=["a", "b", "c", "d"]))
    assert out.exit_code == 0, out.stderr
    assert out.files == [] and out.held is None
    assert out.oversize == ("b",)
    unbounded = run(make_runner(max_output_file=1000), job("sh", "-c", script, outputs=["a", "b", "c"]))
    assert [name for name, _ in unbounded.files] == ["a", "b", "c"] and unbounded.oversize == ()


def test_outputs_over_the_stage_threshold_are_held_on_disk_not_read(make_runner: Callable[..., JobRunner],
                                                                     tmp_path: pathlib.Path) -> None:
    """Outputs over the hold's ``stage_above`` together come back as ``held``: copied into a
    private unlinked file on the hold's disk (none of it in ``files``, the worker's memory), their
    bytes right; under it they are read as before. Limits apply as to read outputs."""
    holdroot = tmp_path / "hold"
    holdroot.mkdir()
    hold = OutputHold(holdroot, limit=64 << 20, stage_above=1 << 20)
    runner = make_runner(max_output_file=8 << 20, max_outputs=12 << 20, hold=hold)
    script = "head -c 3000000 /dev/urandom > a; cp a b; printf tail >> b; echo small > s"
    out = run(runner, job("sh", "-c", script + "; cat a | md5sum", outputs=["a", "b", "c", "s"]))
    assert out.exit_code == 0, out.stderr
    held = out.held
    assert held is not None and out.files == []
    try:
        assert held.names == ["a", "b", "s"] and held.sizes == [3000000, 3000004, 6]
        a = b"".join(held.read(0, off, 1 << 20) or b"" for off in range(0, 3000000, 1 << 20))
        assert hashlib.md5(a).hexdigest() == out.stdout.split()[0].decode()
        assert held.read(1, 3000000, 100) == b"tail" and held.read(2, 0, 100) == b"small\n"
        assert hold.held == held.total and os.listdir(holdroot) == []
    finally:
        held.close()
    assert hold.held == 0
    small = run(runner, job("sh", "-c", "head -c 1000000 /dev/zero > a", outputs=["a"]))
    assert small.held is None and small.files == [("a", bytes(1000000))]
    # One output over max_output_file: the job ends TOO_LARGE, so the others are not copied either.
    over = run(runner, job("sh", "-c", script + "; head -c 9000000 /dev/zero > c", outputs=["a", "b", "c", "s"]))
    assert over.oversize == ("c",) and over.held is None and over.files == [] and hold.held == 0


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
        outputs=["joined", "missing", "link", "fifo", "dir", "edge", "a.txt", "joined"],
    )
    ints = array.array("i", [1, 2])
    inputs = (b"one\n", memoryview(bytearray(b"two\n")), zmq.Frame(b"three\n"), ints)
    out = run(runner, spec, inputs)
    assert out.exit_code == 0, out.stderr
    # Missing, symlink, FIFO and directory files are omitted; order is spec order; at the cap is in.
    assert out.files == [
        ("joined", b"one\ntwo\nthree\n" + ints.tobytes()),
        ("edge", bytes(1000)),
        ("a.txt", b"one\n"),
    ]
    assert out.oversize == ()
    assert os.listdir(workroot) == []  # the job directory is gone
    # A file over the cap: named, and then no output at all (the worker ends the job TOO_LARGE).
    over = run(runner, job("sh", "-c", script, files=list(spec.files), outputs=["joined", "big", "edge"]), inputs)
    assert over.oversize == ("big",) and over.files == []


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
    "key",
    [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "GPUD_JOB_ID",
        "GPUD_X",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PIPE_DIRECTORY",
        "lower",
        "A-B",
    ],
)
def test_reserved_or_bad_env_refused(runner: JobRunner, workroot: pathlib.Path, key: str) -> None:
    with pytest.raises(InvalidRequest):
        run(runner, job("touch", str(workroot / "ran"), env={key: "1"}))
    assert os.listdir(workroot) == []


def test_an_inline_input_is_written_in_bounded_system_calls(runner: JobRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # As fetched inputs are (gpud.transfer.pwrite_all): no write holds a core for a whole MiB.
    sizes: list[int] = []
    real = os.pwrite

    def watch(fd: int, data: Any, offset: int) -> int:
        sizes.append(len(memoryview(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", watch)
    data = os.urandom(3 * SYSCALL_BYTES + 5)
    out = run(runner, job("md5sum", "in", files=("in",)), (data,))
    assert out.exit_code == 0, out.stderr
    assert out.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
    assert sum(sizes) == len(data) and max(sizes) == SYSCALL_BYTES


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
            (b_pid,) = [p.pid for p in the_one_survivor(mark)]
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


# -- CUDA MPS ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("milli", "percent"), [(1, 1), (9, 1), (10, 1), (11, 2), (250, 25), (999, 100), (1000, 100), (0, 1), (5000, 100)]
)
def test_mps_thread_percentage(milli: int, percent: int) -> None:
    assert mps_thread_percentage(milli) == percent


def test_mps_mem_limit_is_nvidias_ordinal_list() -> None:
    mib = 1 << 20
    assert mps_mem_limit([1024 * mib, 512 * mib]) == "0=1024M,1=512M"  # as NVIDIA's "0=1G,1=512M"
    assert mps_mem_limit([64 * mib + 5]) == "0=64M"  # whole MiB, never more than granted
    assert mps_mem_limit([100]) == "0=1M"  # but at least 1M: 0M would be no memory at all
    assert mps_mem_limit([0, 0]) == ""  # no memory grant: no limit


def test_job_grant_from_wire_tolerates_missing_and_bad_fields() -> None:
    wire = {"gpus": ["a", "b"], "gpu_milli": 250, "mem": 7, "cpu_milli": 1500, "host_mem": 9}
    assert JobGrant.from_wire(wire) == JobGrant(gpu_milli=250, mem=7, gpus=2, cpu_milli=1500, host_mem=9)
    assert JobGrant.from_wire(None) == JobGrant()
    bad = {"gpus": "x", "gpu_milli": -1, "mem": "7", "cpu_milli": 1.5, "host_mem": True}
    assert JobGrant.from_wire(bad) == JobGrant()


def test_mps_settings_from_config_then_environment_then_defaults() -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps", "CUDA_MPS_LOG_DIRECTORY": "/var/log/mps"}
    assert mps_settings("", "", {}) == MpsSettings("/tmp/nvidia-mps", "/var/log/nvidia-mps")
    assert mps_settings("", "", env) == MpsSettings("/run/mps", "/var/log/mps")
    assert mps_settings("/a", "/b", env) == MpsSettings("/a", "/b")


def test_job_gets_mps_limits_from_its_grant(make_runner: Callable[..., JobRunner]) -> None:
    runner = make_runner(mps=MpsSettings("/run/nvidia-mps", "/var/log/nvidia-mps"))
    grant = JobGrant(gpu_milli=250, mem=(3 << 30) // 2, gpus=2)
    out = runner.run(os.urandom(8), job("/usr/bin/env"), [], "GPU-a,GPU-b", "t", None, grant)
    env = dict(line.split("=", 1) for line in out.stdout.decode().splitlines())
    assert {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")} == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1536M,1=1536M",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia-mps",
        "CUDA_MPS_LOG_DIRECTORY": "/var/log/nvidia-mps",
    }
    whole = run(runner, job("/usr/bin/env"))  # no grant figures: a whole GPU, no memory limit
    env = dict(line.split("=", 1) for line in whole.stdout.decode().splitlines())
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


@pytest.fixture
def make_worker(make_runner: Callable[..., JobRunner]) -> Iterator[Callable[..., Worker]]:
    """A Worker with one simulated GPU and no broker sockets: dispatches are fed to it directly."""
    made: list[tuple[Worker, zmq.Context[Any]]] = []

    def make(**runner_kwargs: Any) -> Worker:
        device = SimulatedDevice(simulated_gpus(1, mem=1 << 30, worker_name="wj")[0])
        ctx: zmq.Context[Any] = zmq.Context()
        worker = Worker(
            WorkerConfig(name="wj", brokers=("tcp://127.0.0.1:9",)),
            SimulatedProbe([device]),
            {device.gpu.uuid: device},
            make_runner(**runner_kwargs),
            ctx,
        )
        made.append((worker, ctx))
        return worker

    yield make
    for worker, ctx in made:
        for s in list(worker.sessions.values()):
            worker._close_session(s)
        worker.jobs.shutdown(wait=True)
        worker.close_wake_pipe()
        ctx.term()


def test_worker_passes_the_grant_to_sessions_and_jobs(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker(mps=MpsSettings("/run/nvidia-mps", "/var/log/nvidia-mps"))
    uuid = next(iter(worker.gpus))
    grant = {"gpus": [uuid], "gpu_milli": 125, "mem": 64 << 20}
    sid = os.urandom(16)
    worker._on_dispatch(0, worker.links[0], {"id": sid, "kind": "session", "tenant": "t", "grant": grant}, [], time.monotonic())
    _, rid, frames = worker.results.get(timeout=30)  # opened in the session's thread
    assert rid == sid and P.unpackb(frames[2])["ok"] is True
    header, _ = worker._session_op(worker.sessions[sid], "info", {}, [])
    assert header["mps"] == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "13",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=64M",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia-mps",
        "CUDA_MPS_LOG_DIRECTORY": "/var/log/nvidia-mps",
    }
    assert header["mem_granted"] == 64 << 20
    jid = os.urandom(16)
    dispatch = {"id": jid, "kind": "job", "tenant": "t", "grant": grant, "argv": ["/usr/bin/env"], "time_limit": 10.0}
    worker._on_dispatch(0, worker.links[0], dispatch, [], time.monotonic())
    assert worker._start_asks.get(timeout=30) == jid  # it starts only on the broker's GO
    worker.active_idx = 0
    worker._on_go(0, worker.links[0], {"ids": [jid]})
    _, rid, frames = worker.results.get(timeout=30)
    result = P.unpackb(frames[2])
    assert rid == jid and result["ok"] is True and result["exit_code"] == 0
    env = dict(line.split("=", 1) for line in bytes(frames[3]).decode().splitlines())
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "13"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=64M"


def test_worker_without_mps_sets_no_mps_values(make_worker: Callable[..., Worker]) -> None:
    worker = make_worker()
    uuid = next(iter(worker.gpus))
    sid = os.urandom(16)
    grant = {"gpus": [uuid], "gpu_milli": 125, "mem": 64 << 20}
    worker._on_dispatch(0, worker.links[0], {"id": sid, "kind": "session", "tenant": "t", "grant": grant}, [], time.monotonic())
    _, rid, frames = worker.results.get(timeout=30)  # opened in the session's thread
    assert rid == sid and P.unpackb(frames[2])["ok"] is True
    header, _ = worker._session_op(worker.sessions[sid], "info", {}, [])
    assert "mps" not in header


# -- the start gate: a job starts only on the broker's GO (PROTOCOL.md §4.4) -------------------------

def _dispatch_job(worker: Worker) -> bytes:
    """Dispatch a job to ``worker`` and return its id, once the worker asks the broker to start it."""
    jid = os.urandom(16)
    uuid = next(iter(worker.gpus))
    dispatch = {"id": jid, "kind": "job", "tenant": "t", "grant": {"gpus": [uuid], "gpu_milli": 1000, "mem": 0},
                "argv": ["/bin/sh", "-c", "echo ran > mark; cat mark"], "outputs": ["mark"], "time_limit": 10.0}
    worker._on_dispatch(0, worker.links[0], dispatch, [], time.monotonic())
    assert worker._start_asks.get(timeout=30) == jid
    return jid


def _wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_worker_runs_a_job_only_on_the_active_brokers_go(make_worker: Callable[..., Any]) -> None:
    worker = make_worker()
    worker.active_idx = 0
    jid = _dispatch_job(worker)
    worker._on_go(1, worker.links[0], {"ids": [jid]})  # from a broker that is not the active one
    time.sleep(0.3)
    assert worker.results.empty() and jid in worker.start_waits
    worker._on_go(0, worker.links[0], {"ids": [jid]})
    _, got, frames = worker.results.get(timeout=30)
    result = P.unpackb(frames[2])
    assert got == jid and result["ok"] is True and bytes(frames[3]) == b"ran\n"


def test_a_refused_job_never_runs_and_gets_no_result(make_worker: Callable[..., Any]) -> None:
    worker = make_worker()
    worker.active_idx = 0
    jid = _dispatch_job(worker)
    assert jid in worker.running
    worker._on_go(0, worker.links[0], {"ids": [], "refused": [jid]})
    item = worker.results.get(timeout=30)
    assert item[1:] == (jid, [])  # no RESULT: the loop only forgets it
    worker.results.put(item)
    worker._flush_results()
    assert jid not in worker.running and worker.unacked == {}
    _wait_until(lambda: not worker.start_waits)
    assert not any(worker.runner.workroot.iterdir())  # its directory is gone; it never started


def test_a_job_waiting_for_go_is_asked_for_again_after_a_heartbeat_interval(make_worker: Callable[..., Any]) -> None:
    worker = make_worker()
    link = worker.links[0]
    link.sock = object()  # type: ignore[assignment]  # what _ask_starts looks for; nothing is sent
    worker.active_idx = 0
    jid = _dispatch_job(worker)
    now = time.monotonic()
    worker._start_asks.put(jid)
    worker._ask_starts(now, fresh=True)
    assert [P.unpackb(m[2]) for m in link.out] == [{"ids": [jid]}]
    link.out.clear()
    worker._ask_starts(now + link.liveness.policy.interval / 2)
    assert link.out == []
    worker._ask_starts(now + link.liveness.policy.interval * 1.5)
    assert [P.unpackb(m[2]) for m in link.out] == [{"ids": [jid]}]
    link.out.clear()
    link.sock = None
    worker._on_go(0, link, {"ids": [], "refused": [jid]})
    worker.results.get(timeout=30)


# -- cgroups: failures never stop a job ------------------------------------------------------


def test_job_runs_when_its_cgroup_cannot_be_made(
    make_runner: Callable[..., JobRunner], caplog: pytest.LogCaptureFixture
) -> None:
    runner = make_runner(cgroups=JobCgroups("/nonexistent/gpud-cgroups", {"memory", "cpu", "pids"}))
    with caplog.at_level("WARNING"):
        out = run(runner, job("echo", "ok"))
    assert (out.exit_code, out.stdout) == (0, b"ok\n")
    assert "cannot create job cgroup" in caplog.text


def test_job_runs_when_it_cannot_enter_its_cgroup(
    make_runner: Callable[..., JobRunner], caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path
) -> None:
    fake = tmp_path / "job-fake"
    fake.mkdir()

    class NoEntry(JobCgroups):
        def create(self, hexid: str, limits: Any, *_: Any, **__: Any) -> JobCgroup | None:
            return JobCgroup(str(fake), os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC))

    runner = make_runner(cgroups=NoEntry(str(tmp_path), set()))
    with caplog.at_level("WARNING"):
        out = run(runner, job("echo", "ok"))
        again = run(runner, job("echo", "again"))
    assert (out.exit_code, out.stdout, again.stdout) == (0, b"ok\n", b"again\n")
    assert "did not enter its cgroup" in caplog.text
    assert not fake.exists()  # removed after the job all the same


# -- as root: the daemon's secrets, detached children, memory hogs, cgroups ------------------


def _huge_tmpfs_here(tmp_path: pathlib.Path) -> bool:
    """Whether this kernel mounts a tmpfs with huge pages (the runner's own probe, done apart)."""
    probe = tmp_path / "huge-probe"
    probe.mkdir()
    try:
        sandbox.mount_tmpfs(str(probe), "size=4m" + jobs.HUGE_DIR_OPTIONS)
    except OSError:
        return False
    sandbox.unmount(str(probe))
    return True


@root_only
def test_a_job_directory_takes_huge_pages_within_its_size_and_keeps_its_limit(
        make_runner: Callable[..., JobRunner], tmp_path: pathlib.Path) -> None:
    """The job directory's tmpfs is mounted huge=within_size where the kernel can (a large staged
    input is written in 2 MiB pages), and its size limit holds all the same: 6 MiB do not fit a
    4 MiB directory, 3.5 MiB do, in files of whole huge pages and not."""
    huge = _huge_tmpfs_here(tmp_path)
    runner = make_runner(dir_size=4 << 20)
    seen = run(runner, job("sh", "-c", 'grep -F " $PWD " /proc/self/mountinfo'))
    assert seen.exit_code == 0 and b" tmpfs " in seen.stdout, seen
    assert (b"huge=within_size" in seen.stdout) == huge, seen.stdout
    full = run(runner, job("sh", "-c", "head -c 6291456 /dev/zero > big; echo rc=$?"))
    assert b"rc=1" in full.stdout and b"No space left" in full.stderr, full
    fits = run(runner, job("sh", "-c", "head -c 2097152 /dev/zero > a && head -c 1572864 /dev/zero > b && "
                           "cat a b | wc -c"))
    assert (fits.exit_code, fits.stdout.strip(), fits.stderr) == (0, b"3670016", b""), fits
    with pytest.raises(TooLarge, match="limited to 4194304 bytes"):
        run(runner, job("true", files=("in",)), (b"x" * (6 << 20),))


@root_only
def test_the_job_directory_has_its_size_and_says_when_it_is_full(make_runner: Callable[..., JobRunner]) -> None:
    """With dir_size (job_dir_size) 1 MiB the job directory is a tmpfs of that size: a job that
    writes 2 MiB there gets ENOSPC and a line on its stderr naming the limit; input files that
    do not fit fail the job with an error naming it; the next job has its whole MiB again."""
    runner = make_runner(dir_size=1 << 20)
    full = run(runner, job("sh", "-c", "head -c 2097152 /dev/zero > big; echo rc=$?; df -k . | tail -1"))
    assert b"rc=1" in full.stdout and b"No space left" in full.stderr, full
    assert full.stderr.endswith(b"gpud: the job directory is full: it is limited to 1048576 bytes (job_dir_size)\n")
    # TooLarge, not RemoteError: the job's own size, which placing it on another worker does not cure.
    with pytest.raises(TooLarge, match="do not fit its directory, limited to 1048576 bytes"):
        run(runner, job("true", files=("in",)), (b"x" * (2 << 20),))
    again = run(runner, job("sh", "-c", "head -c 900000 /dev/zero > mid && echo fits"))
    assert (again.stdout, again.stderr) == (b"fits\n", b"")


@root_only
def test_job_cannot_read_daemon_keys_or_config(runner: JobRunner) -> None:
    """A copy of the real layout: /etc/gpud (0755) with gpud.toml (0600) and keys/ (0755) holding
    the worker's key pair (secret 0600, public 0644), all root's."""
    etc = pathlib.Path(tempfile.mkdtemp(prefix="gpud-jtest-etc-", dir="/tmp"))
    try:
        etc.chmod(0o755)
        conf = etc / "gpud.toml"
        conf.write_text('[worker]\nbrokers = ["tcp://control:5556"]\n# CONFIG-SECRET-7\n')
        conf.chmod(0o600)
        keys = etc / "keys"
        try:
            from gpud.security import keygen

            public, secret = keygen(keys, "worker")
        except ConfigError:  # a libzmq without CURVE: files of the same modes
            keys.mkdir(mode=0o755)
            public, secret = keys / "worker.key", keys / "worker.key_secret"
            public.write_text("public-key\n")
            secret.write_text("secret-key\n")
            public.chmod(0o644)
            secret.chmod(0o600)
        for f in (conf, public, secret):
            assert os.stat(f).st_uid == 0
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        secret_text = secret.read_text()
        probe = (
            'cat "$CONF"; echo "rc=$?"; cat "$SECRET"; echo "rc=$?";'
            ' cat "$PUBLIC" > /dev/null; echo "public rc=$?";'
            ' echo x >> "$CONF"; echo "rc=$?"; touch "$KEYS/planted"; echo "rc=$?";'
            ' cp "$SECRET" .; echo "rc=$?"'
        )
        env = {"CONF": str(conf), "SECRET": str(secret), "PUBLIC": str(public), "KEYS": str(keys)}
        out = run(runner, job("sh", "-c", probe, env=env))
        assert out.user.startswith(PREFIX)
        assert b"CONFIG-SECRET-7" not in out.stdout and secret_text.encode() not in out.stdout
        assert out.stdout.count(b"rc=") == 6
        assert b"public rc=0" in out.stdout  # the directory is reachable: only the secrets are closed
        assert out.stdout.replace(b"public rc=0", b"").count(b"rc=0") == 0
        assert out.stderr.count(b"Permission denied") == 5, out.stderr
        assert not (keys / "planted").exists()
        assert conf.read_text().endswith("# CONFIG-SECRET-7\n")
    finally:
        shutil.rmtree(etc)


@root_only
def test_time_limit_kills_detached_children_that_ignore_sigterm(runner: JobRunner) -> None:
    """The job forks, ignores SIGTERM (inherited across exec), and double-forks a grandchild into
    a session of its own: at the time limit all of them die."""
    mark = marker()
    script = (
        'trap "" TERM;'
        f" (setsid sh -c 'sleep {mark} & touch detached; sleep {mark}' &);"
        f" sleep {mark} & while [ ! -e detached ]; do sleep 0.01; done; sleep {mark}"
    )
    started = time.monotonic()
    out = run(runner, job("sh", "-c", script, time_limit=1))
    assert out.timed_out and out.exit_code == -9
    assert time.monotonic() - started < 8
    assert survivors(mark) == []
    assert user_processes(pwd.getpwnam(out.user).pw_uid) == []


def _hog(limit_mib: int) -> str:
    """A program that touches 64 MiB more memory at a time, to ``limit_mib`` at most."""
    return (
        "import sys\n"
        "chunks = []\n"
        "try:\n"
        f"    while len(chunks) * 64 < {limit_mib}:\n"
        "        b = bytearray(64 << 20)\n"
        "        b[::4096] = b'\\x01' * (len(b) // 4096)\n"
        "        chunks.append(b)\n"
        "        print(len(chunks), flush=True)\n"
        "except MemoryError:\n"
        "    print('MemoryError', flush=True)\n"
        "    sys.exit(3)\n"
        "print('survived', flush=True)\n"
    )


def _system_python() -> str:
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 a pool user can run")
    return python


@root_only
def test_memory_hog_contained_by_rlimit_as(make_runner: Callable[..., JobRunner]) -> None:
    """Without cgroups (this runner has none), RLIMIT_AS (JobLimits.address_space) is what bounds a
    job's memory: the hog fails to allocate far below what it asks, and the worker serves on."""
    python = _system_python()
    runner = make_runner(limits=JobLimits(address_space=512 << 20))
    out = run(runner, job(python, "-c", _hog(8 << 10), time_limit=30), tenant="hog")
    assert out.exit_code == 3, out.stderr
    lines = out.stdout.decode().split()
    assert lines[-1] == "MemoryError" and len(lines) - 1 < 8  # under 512 MiB of the 8 GiB it wanted
    assert user_processes(pwd.getpwnam(out.user).pw_uid) == []
    after = run(runner, job("echo", "serving"), tenant="hog")
    assert (after.exit_code, after.stdout) == (0, b"serving\n")


@pytest.fixture
def job_cgroups() -> Iterator[JobCgroups]:
    """Real job cgroups below a test parent in this host's cgroup v2 hierarchy (root only)."""
    if not IS_ROOT:
        pytest.skip("needs root")
    with open("/proc/self/mountinfo") as f:
        hierarchy = parse_mountinfo(f.read())
    if hierarchy.v2 is None:
        pytest.skip(f"no cgroup v2 hierarchy on this host (cgroup {hierarchy.mode})")
    parent = pathlib.Path(hierarchy.v2) / f"gpud-jtest-{os.getpid()}"
    try:
        parent.mkdir()
    except OSError as exc:
        pytest.skip(f"cgroup v2 at {hierarchy.v2} is not writable here: {exc}")
    try:
        cg = JobCgroups.setup(str(parent))
        if cg is None:
            pytest.skip(f"cgroup v2 at {hierarchy.v2} is not usable here (see the log)")
        yield cg
    finally:
        cgroups_module.remove_cgroup(str(parent))


@root_only
def test_job_runs_in_its_cgroup_and_nothing_survives_it(
    make_runner: Callable[..., JobRunner], job_cgroups: JobCgroups
) -> None:
    runner = make_runner(cgroups=job_cgroups)
    mark = marker()
    job_id = os.urandom(8)
    script = (
        'trap "" TERM; cat /proc/self/cgroup;'
        f" (setsid sh -c 'touch detached; exec sleep {mark}' &);"
        f" while [ ! -e detached ]; do sleep 0.01; done; sleep {mark}"
    )
    out = run(runner, job("sh", "-c", script, time_limit=1), job_id=job_id)
    assert out.timed_out
    assert f"0::/{os.path.basename(job_cgroups.base)}/job-{job_id.hex()}\n".encode() in out.stdout
    assert survivors(mark) == []
    assert not os.path.exists(os.path.join(job_cgroups.base, f"job-{job_id.hex()}"))
    after = run(runner, job("echo", "serving"))
    assert after.stdout == b"serving\n"


@root_only
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_short_job_in_a_working_cgroup_gives_no_warning(
    version: str, make_runner: Callable[..., JobRunner], request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``true`` has exited (a zombie) before the worker could look at its /proc/PID/cgroup: only
    what its own process said, that it entered its cgroup, may decide a warning. With the host's
    cgroup v1 hierarchies and with real v2 job cgroups."""
    if version == "v1":
        found = setup_job_cgroups()
        if not isinstance(found, JobCgroupsV1):
            pytest.skip("this host has no cgroup v1 hierarchies the worker would use")
        request.addfinalizer(found.close)
        cgroups: JobCgroups | JobCgroupsV1 = found
    else:
        cgroups = request.getfixturevalue("job_cgroups")
    runner = make_runner(cgroups=cgroups)
    with caplog.at_level("WARNING"):
        outs = [run(runner, job("true")) for _ in range(20)]
    assert [o.exit_code for o in outs] == [0] * 20
    assert "did not enter its cgroup" not in caplog.text


@root_only
def test_memory_hog_contained_by_cgroup(
    make_runner: Callable[..., JobRunner], job_cgroups: JobCgroups, caplog: pytest.LogCaptureFixture
) -> None:
    if "memory" not in job_cgroups.controllers:
        pytest.skip(
            f"the cgroup v2 hierarchy here offers no memory controller at {job_cgroups.base} (it is on"
            " cgroup v1): test_memory_hog_contained_by_rlimit_as covers memory with RLIMIT_AS instead"
        )
    python = _system_python()
    runner = make_runner(cgroups=job_cgroups, limits=JobLimits(memory=128 << 20))
    with caplog.at_level("INFO"):
        out = run(runner, job(python, "-c", _hog(8 << 10), time_limit=30), tenant="hog")
    assert out.exit_code == -9 and b"survived" not in out.stdout  # the OOM killer, in its cgroup
    assert "killed for its memory limit" in caplog.text
    after = run(runner, job("echo", "serving"), tenant="hog")
    assert (after.exit_code, after.stdout) == (0, b"serving\n")
