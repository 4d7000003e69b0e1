"""The pure parts of tenant isolation: mountinfo and SysV IPC parsing, the pool-user rule and its
ledger counts, READY's isolation fields, uid blocks under lock files, and the sandbox's /dev."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import random
import stat
import threading
import time
from pathlib import Path

import pytest

from gpud import protocol as P
from gpud.errors import ConfigError, InvalidRequest
from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import GpuInfo, Grant, Need
from gpud_broker import ledger
from gpud_broker.policies import pool_allows, pool_blocked
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_cli.uid_ranges import UidBlocks, uids_in_use
from gpud_client.ctl import render_result
from gpud_worker import sandbox
from gpud_worker.sandbox import (
    CLONE_NEWNET,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RELATIME,
    NVIDIA_SHARED,
    Plan,
    Sandbox,
    gpu_node_names,
    host_nodes,
    mount_points,
    parse_sysvipc,
)

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=10m
24 23 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
25 22 0:22 / /tmp/with\\040space rw,nosuid,nodev,noexec - tmpfs tmpfs rw
26 22 8:1 /x /dev/shm rw - ext4 /dev/sda1 rw
garbage
"""


def test_mount_points_parents_first_each_once_with_their_flags() -> None:
    points = mount_points(MOUNTINFO)
    assert [p for p, _ in points] == ["/", "/dev", "/dev/shm", "/tmp/with space"]
    flags = dict(points)
    assert flags["/"] == MS_RELATIME
    assert flags["/dev"] == MS_NOSUID
    assert flags["/dev/shm"] == 0  # the later (topmost) mount on a path wins
    assert flags["/tmp/with space"] == MS_NOSUID | MS_NODEV | MS_NOEXEC


def test_parse_sysvipc_finds_owner_and_creator() -> None:
    shm = (
        "       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid\n"
        "         0          3  1600                  4096   100   100      0 61184 61184     0     0\n"
        "         0          4  1600                  4096   100   100      0     0     0 61185 61185\n"
        "bad line\n"
    )
    assert parse_sysvipc(shm) == [(3, 61184, 0), (4, 0, 61185)]
    sem = "       key      semid perms      nsems   uid   gid  cuid  cgid\n         1  7  600  1  5  5  6  6\n"
    assert parse_sysvipc(sem) == [(7, 5, 6)]
    assert parse_sysvipc("") == [] and parse_sysvipc("no such columns\n1 2 3\n") == []


def test_gpu_nodes_are_the_granted_minors_and_the_shared_ones() -> None:
    assert gpu_node_names([3]) == ["nvidia3", *NVIDIA_SHARED]
    assert gpu_node_names([]) == list(NVIDIA_SHARED)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_host_nodes_copies_character_devices_and_skips_the_rest(tmp_path: Path) -> None:
    """STAND-IN device nodes in a temporary directory: nvidia0 and nvidia1 (NVIDIA's major 195)."""
    for minor in (0, 1):
        os.mknod(tmp_path / f"nvidia{minor}", stat.S_IFCHR | 0o660, os.makedev(195, minor))
        os.chmod(tmp_path / f"nvidia{minor}", 0o660)  # whatever the umask
    (tmp_path / "nvidiactl").write_text("a regular file is not a device")
    nodes = host_nodes(gpu_node_names([1]), str(tmp_path))
    assert [(n.name, os.major(n.rdev), os.minor(n.rdev), n.mode) for n in nodes] == [("nvidia1", 195, 1, 0o660)]


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
@pytest.mark.parametrize("make_read_only", ["one mount_setattr", "mount by mount"])
def test_every_mount_turns_read_only_keeping_its_flags(make_read_only: str, tmp_path: Path) -> None:
    """In a mount namespace of its own, a child makes every mount read-only: in one
    mount_setattr(2) call, and mount by mount (what kernels before 5.12 get). Then it cannot write
    here, and each mount keeps its nosuid, nodev and noexec flags."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            sandbox._check(sandbox._libc.unshare(sandbox.CLONE_NEWNS), "unshare")
            if make_read_only == "one mount_setattr":
                assert sandbox._read_only_private_tree()
            else:
                sandbox._read_only_mount_by_mount()
            try:
                open(tmp_path / "x", "w").close()
                said = "wrote"
            except OSError as exc:
                said = errno.errorcode[exc.errno]
            with open("/proc/self/mountinfo") as f:
                after = f.read()
            os.write(w, json.dumps([said, after]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        said, after = json.loads(f.read())
    os.waitpid(pid, 0)
    with open("/proc/self/mountinfo") as f:
        before = f.read()
    assert said == "EROFS"
    options = {fields[4]: set(fields[5].split(",")) for fields in (line.split() for line in before.splitlines())}
    changed = {fields[4]: set(fields[5].split(",")) for fields in (line.split() for line in after.splitlines())}
    for path, was in options.items():
        if make_read_only == "mount by mount" and path.startswith(("/proc", "/dev")):
            continue  # left as they are: the sandbox mounts its own there
        assert "ro" in changed[path] and was - {"rw"} <= changed[path], path
    assert not any("shared:" in line for line in after.splitlines())  # every mount private


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")
@pytest.mark.parametrize("kernel", ["mount_setattr", "before 5.12"])
def test_sandboxes_start_while_the_workers_mounts_come_and_go(kernel: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a busy worker: three threads mount, unmount and remove directories (job
    directories) while 150 sandboxes are entered one after the other, in a mount namespace of
    this test's own. A sandbox whose list of mounts names one that is gone by the time it gets to
    it still starts (before, 6 of 300 failed so here: EINVAL, a mount point no more). Both ways of
    making the mounts read-only: one mount_setattr(2), and the remount of each (kernels before
    5.12; forced here with a syscall number that does not exist)."""
    if kernel != "mount_setattr":
        monkeypatch.setattr(sandbox, "_SYS_MOUNT_SETATTR", 1 << 20)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the churn's mounts stay in this child's namespace
        try:
            os.close(r)
            assert not sandbox.private_mounts()
            os.write(w, json.dumps(_starts_under_churn(tmp_path, 150)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        failures = json.loads(f.read() or '["no report"]')
    os.waitpid(pid, 0)
    assert failures == []


def _starts_under_churn(top: Path, starts: int) -> list[str]:
    stop = threading.Event()

    def churn(k: int) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            d = top / f"{k}-{i % 40}"
            d.mkdir(exist_ok=True)
            try:
                sandbox.mount_tmpfs(str(d), "size=1m")
            except OSError:
                pass
            time.sleep(0.0005)
            sandbox.unmount(str(d))
            with contextlib.suppress(OSError):
                d.rmdir()

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    box = Sandbox("none")
    failures = []
    try:
        for n in range(starts):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    box.plan([]).enter()  # type: ignore[union-attr]
                    os._exit(0)
                except BaseException as exc:
                    os.write(w, f"start {n}: {exc!r}".encode())
                    os._exit(3)
            os.close(w)
            with os.fdopen(r) as f:
                said = f.read()
            os.waitpid(pid, 0)
            if said:
                failures.append(said)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return failures


def test_job_status_is_what_pid_1_wrote_else_its_own_exit() -> None:
    r, w = os.pipe()
    try:
        assert sandbox.job_status(sandbox.job_report(r).status, -9) == -9  # it wrote nothing: SIGKILLed itself
        os.write(w, str(15).encode())  # the wait status of a process killed by SIGTERM
        assert sandbox.job_status(sandbox.job_report(r).status, 0) == -15
        os.write(w, str(7 << 8).encode())  # exited with 7
        assert sandbox.job_status(sandbox.job_report(r).status, 0) == 7
    finally:
        os.close(r)
        os.close(w)


def test_job_report_reads_the_cgroup_and_setup_lines_before_the_status() -> None:
    r, w = os.pipe()
    try:
        assert sandbox.job_report(r) == sandbox.JobReport("", "", None)
        os.write(w, b"~cannot write its cgroup.procs: No space left on device\n" + str(9).encode())
        assert sandbox.job_report(r) == sandbox.JobReport("", "cannot write its cgroup.procs: No space left on device", 9)
        os.write(w, b"~not in it\n!mount /tmp: Operation not permitted\n")
        assert sandbox.job_report(r) == sandbox.JobReport("mount /tmp: Operation not permitted", "not in it", None)
    finally:
        os.close(r)
        os.close(w)


def test_plan_network_none_adds_a_network_namespace() -> None:
    assert Plan("none", 1, (), ()).flags() & CLONE_NEWNET
    assert not Plan("host", 1, (), ()).flags() & CLONE_NEWNET


def test_sandbox_without_root_is_rlimits_only_and_plans_nothing() -> None:
    box = Sandbox("none", enabled=False)
    assert (box.level, box.active, box.plan([0])) == ("rlimits only", False, None)
    assert "rlimits only" in box.describe()
    with pytest.raises(ValueError):
        Sandbox("bridge", enabled=False)


# ---------------------------------------------------------------------------- pool users


def worker(pool_users: int, kinds: frozenset[str] = frozenset({"job", "session"})):  # type: ignore[no-untyped-def]
    reg = WorkerRegistry()
    w = reg.add(name="w0", identity=b"w0", hostname="h", gpus=[GpuInfo("G0", 0, "A100", 1 << 34, (8, 0))],
                cpu_milli=8000, host_mem=1 << 34, slots=64, policy=HeartbeatPolicy(), now=0.0)
    w.pool_users, w.pool_kinds = pool_users, kinds
    return w


def test_pool_allows_a_share_per_tenant_and_none_when_all_are_held() -> None:
    w = worker(4)
    need_a, need_b = Need(gpu_milli=1, tenant="a"), Need(gpu_milli=1, tenant="b")
    grants = [ledger.grant(w, w.gpus, need_a, pool=True) for _ in range(2)]
    assert w.pool_held == {"a": 2}
    assert not pool_allows(w, "a", 0.5) and pool_allows(w, "b", 0.5)  # a holds its half
    assert pool_allows(w, "a", 0.75)  # 3 of 4
    grants += [ledger.grant(w, w.gpus, need_b, pool=True) for _ in range(2)]
    assert not pool_allows(w, "c", 1.0)  # every user is held
    assert pool_blocked("job", "c", [w], 0.5) == {"w0"} and pool_blocked("echo", "c", [w], 0.5) == set()
    for g in grants:
        ledger.release(w, w.gpus, g)
    assert w.pool_held == {} and pool_allows(w, "a", 0.5)


def test_a_tiny_pool_still_lets_each_tenant_have_one_and_no_pool_is_no_limit() -> None:
    w = worker(1)
    assert pool_allows(w, "a", 0.5)  # max(1, 1 * 0.5 rounded down)
    g = ledger.grant(w, w.gpus, Need(gpu_milli=1, tenant="a"), pool=True)
    assert not pool_allows(w, "b", 0.5)
    ledger.release(w, w.gpus, g)
    unlimited = worker(0)
    for _ in range(3):
        ledger.grant(unlimited, unlimited.gpus, Need(gpu_milli=1, tenant="a"), pool=True)
    assert pool_allows(unlimited, "a", 0.5)
    plain = ledger.grant(unlimited, unlimited.gpus, Need(gpu_milli=1, tenant="b"))
    assert plain.pool_tenant == "" and "b" not in unlimited.pool_held


def test_the_pool_index_names_every_worker_that_may_refuse_as_a_scan_would() -> None:
    """Random grants, releases, clears and removals on six workers (pools of 0 to 4 users, some
    holding sessions' users too): after each, the broker's candidates (PoolIndex) give the same
    blocked workers as a scan of all of them, for every tenant, kind and share."""
    rng = random.Random(7)
    reg = WorkerRegistry()
    workers = []
    for i in range(6):
        w = reg.add(name=f"w{i}", identity=b"w%d" % i, hostname="h", gpus=[GpuInfo(f"G{i}", 0, "A100", 1 << 34, (8, 0))],
                    cpu_milli=8000, host_mem=1 << 34, slots=64, policy=HeartbeatPolicy(), now=0.0)
        w.pool_users, w.pool_kinds = i % 5, frozenset({"job"} if i % 2 else {"job", "session"})
        reg.pool_index.file(w)
        workers.append(w)
    live: list[tuple[WorkerRecord, Grant]] = []
    refusals = 0
    tenants = ["a", "b", "c"]
    for step in range(600):
        roll = rng.random()
        if roll < 0.55 or not live:
            w = rng.choice(workers)
            live.append((w, ledger.grant(w, w.gpus, Need(gpu_milli=1, tenant=rng.choice(tenants)), pool=rng.random() < 0.9)))
        elif roll < 0.95:
            w, g = live.pop(rng.randrange(len(live)))
            ledger.release(w, w.gpus, g)
        elif roll < 0.98:
            w = rng.choice(workers)
            ledger.clear(w)
            live = [(x, g) for x, g in live if x is not w]
        else:  # the worker is lost (its grants go uncounted) and comes back, new and empty
            old = rng.choice(workers)
            reg.remove(old)
            live = [(x, g) for x, g in live if x is not old]
            w = reg.add(name=old.name, identity=old.identity, hostname="h", gpus=[old.gpus[0].info], cpu_milli=8000,
                        host_mem=1 << 34, slots=64, policy=HeartbeatPolicy(), now=0.0)
            w.pool_users, w.pool_kinds = old.pool_users, old.pool_kinds
            reg.pool_index.file(w)
            workers[workers.index(old)] = w
        for tenant in tenants + ["d"]:
            for kind in ("job", "session"):
                for share in (0.25, 0.5, 1.0):
                    want = pool_blocked(kind, tenant, reg.by_identity.values(), share)
                    assert pool_blocked(kind, tenant, reg.pool_index.candidates(tenant), share) == want, step
                    refusals += len(want)
    assert refusals > 1000  # full pools and tenants at their share were met often


def test_ready_isolation_fields_are_checked() -> None:
    assert P.parse_isolation({}) == ("", "", 0, frozenset())
    assert P.parse_isolation({"isolation": "namespaces", "job_network": "host", "pool_users": 16,
                              "pool_kinds": ["job", "session"]}) == ("namespaces", "host", 16, frozenset({"job", "session"}))
    assert P.parse_isolation({"isolation": "perfect", "job_network": "wifi"})[:2] == ("", "")  # unknown: not said
    for bad in ({"pool_users": -1}, {"pool_users": "16"}, {"pool_kinds": ["echo"]}, {"pool_kinds": "job"},
                {"isolation": 1}):
        with pytest.raises(InvalidRequest):
            P.parse_isolation(bad)


def test_gpudctl_workers_shows_the_isolation_level() -> None:
    rows = [{"name": "w0", "gpus": 1, "isolation": "namespaces", "job_network": "none"},
            {"name": "w1", "gpus": 1, "isolation": "namespaces", "job_network": "host"},
            {"name": "w2", "gpus": 1, "isolation": "rlimits only"},
            {"name": "w3", "gpus": 1}]
    lines = render_result("workers", rows).splitlines()
    assert "ISOLATION" in lines[0]
    assert [line.split()[-1] if not line.endswith("net") else "host net" for line in lines[1:]] == \
        ["namespaces", "host net", "ONLY", "?"]


# ---------------------------------------------------------------------------- uid blocks


def test_uid_blocks_are_exclusive_between_holders_and_freed_on_close(tmp_path: Path) -> None:
    one, two = UidBlocks(63000, 16, 63047, str(tmp_path)), UidBlocks(63000, 16, 63047, str(tmp_path))
    a, b = one.take(), two.take()
    assert (a, b) == (range(63000, 63016), range(63016, 63032))
    c = one.take()
    assert c == range(63032, 63048)
    with pytest.raises(ConfigError):
        two.take()  # every block is held
    one.give_back(a)
    assert two.take() == a
    one.close()
    assert UidBlocks(63000, 16, 63047, str(tmp_path)).take() == c


def test_a_block_someone_runs_under_is_passed_over(tmp_path: Path) -> None:
    me = os.getuid()
    assert me in uids_in_use(range(me, me + 1))
    with pytest.raises(ConfigError):
        UidBlocks(me, 1, me, str(tmp_path)).take()  # its one block is this process's uid


def test_isolation_settings_are_checked() -> None:
    from gpud.config import load

    cfg = load(None, {"GPUD_WORKER_JOB_NETWORK": "host", "GPUD_BROKER_TENANT_POOL_SHARE": "0.25"})
    assert (cfg.worker.job_network, cfg.broker.tenant_pool_share) == ("host", 0.25)
    assert (cfg.worker.job_tmp_size, cfg.worker.job_dir_size) == (256 << 20, 1 << 30)
    for key, value in (("WORKER_JOB_NETWORK", "bridge"), ("BROKER_TENANT_POOL_SHARE", "0"),
                       ("BROKER_TENANT_POOL_SHARE", "1.5"), ("WORKER_JOB_TMP_SIZE", "1000")):
        with pytest.raises(ConfigError):
            load(None, {f"GPUD_{key}": value})


def test_a_grants_pool_tenant_survives_replication() -> None:
    from gpud.resources import Grant
    from gpud_broker.replication import grant_from_wire, grant_to_wire

    held = Grant("w0", ("G0",), 1, 0, pool_tenant="alice")
    plain = Grant("w0", ("G0",), 1, 0)
    assert grant_from_wire(grant_to_wire(held)) == held and grant_from_wire(grant_to_wire(plain)) == plain
    assert len(grant_to_wire(plain) or []) == 7  # as before: an older peer reads it


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other uids")
def test_the_sweep_removes_what_the_uid_can_have_left_and_nothing_else(tmp_path: Path) -> None:
    """A swept directory like /tmp (root's, 1777) with: the uid's file, its symlink to someone
    else's file, its directory (with a 000 subdirectory, nested files, a symlink out); someone
    else's file; a tree of root's 0755 with a leaf and a 1777 directory two levels down holding
    the uid's file. All of the uid's goes, nothing else, and no symlink is followed. A file of the
    uid planted (by root) in root's 0700 directory, where the uid cannot have made it, is not
    looked for: that directory is not entered. Neither is root's 0755 leaf listed."""
    uid, other = 64990, 64991
    top = tmp_path / "tmp"
    top.mkdir(mode=0o1777)
    os.chmod(top, 0o1777)

    def owned(path: Path, owner: int, mode: int = 0o600, text: str = "x") -> Path:
        path.write_text(text)
        os.chown(path, owner, owner)
        os.chmod(path, mode)
        return path

    theirs = owned(top / "theirs", other)
    owned(top / "mine", uid)
    (top / "link").symlink_to(theirs)
    os.lchown(top / "link", uid, uid)
    mydir = top / "mydir"
    (mydir / "closed").mkdir(parents=True)
    owned(mydir / "closed" / "deep", uid)
    owned(mydir / "someone's", other)
    (mydir / "out").symlink_to(tmp_path)
    for d in (mydir, mydir / "closed"):
        os.chown(d, uid, uid)
    os.chmod(mydir / "closed", 0)
    shared = top / "tree" / "a" / "shared"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o1777)
    (top / "tree" / "leaf").mkdir()
    owned(top / "tree" / "leaf" / "root's", 0)
    owned(shared / "mine", uid)
    private = top / "private"
    private.mkdir(mode=0o700)
    planted = owned(private / "planted", uid)
    keep = {theirs, top / "tree" / "leaf" / "root's", planted, tmp_path / "tmp"}

    assert sandbox._remove_files_of(uid, str(top)) == 4  # mine, link, mydir, tree/a/shared/mine
    left = {p for p in top.rglob("*")} | {top}
    assert keep <= left
    assert not [p for p in left if p.lstat().st_uid == uid and p != planted]
    assert theirs.read_text() == "x" and tmp_path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other uids")
def test_a_tree_deeper_than_the_sweep_goes_is_removed_if_the_uids_else_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the sweep's depth limit at 3 (128 in the worker; the sweep recursed before, and a
    1,200-level tree raised RecursionError out of it): a directory chain of the uid's 8 deep goes
    entirely (what is too deep is moved up into its top and removed from there); the uid's file at
    the bottom of someone else's 1777 chain as deep stays, and a WARNING says where it stopped."""
    uid, other = 64990, 64991
    monkeypatch.setattr(sandbox, "SWEEP_MAX_DEPTH", 3)
    os.chmod(tmp_path, 0o1777)  # as /tmp
    for owner, name in ((uid, "mine"), (other, "theirs")):
        chain = tmp_path.joinpath(name, *[f"d{i}" for i in range(7)])
        chain.mkdir(parents=True)
        (chain / "f").write_text("x")
        for p in [tmp_path / name, *(tmp_path / name).rglob("*")]:
            os.chown(p, owner, owner)
            os.chmod(p, 0o1777 if p.is_dir() else 0o600)
    os.chown(chain / "f", uid, uid)
    with caplog.at_level("WARNING"):
        assert sandbox._remove_files_of(uid, str(tmp_path)) == 1
    assert not (tmp_path / "mine").exists()
    assert (chain / "f").exists()
    assert "did not go below 3 levels" in caplog.text and "/theirs/d0/d1/d2" in caplog.text
    assert "cannot remove" not in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as a pool uid")
def test_sweep_uid_removes_its_files_ipc_objects_and_message_queues() -> None:
    """What a pool uid leaves outside a sandbox, made by a real process of that uid: a file in
    /dev/shm, a SysV shared memory segment and a POSIX message queue. ``sweep_uid`` (the worker's
    fallback, before the uid serves another tenant) removes all three."""
    blocks = UidBlocks(64000)
    uid = blocks.take()[0]
    name = "gpud-sweep-" + os.urandom(4).hex()
    try:
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                with open(f"/dev/shm/{name}", "w") as f:
                    f.write("left")
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                rt = ctypes.CDLL("librt.so.1", use_errno=True)
                ok = libc.shmget(0, 4096, 0o1600) >= 0 and rt.mq_open(f"/{name}".encode(), 0o100 | 2, 0o600, None) >= 0
                os._exit(0 if ok else 1)
            finally:
                os._exit(2)
        assert os.waitpid(pid, 0)[1] == 0

        def left() -> list[str]:
            with open("/proc/sysvipc/shm") as f:
                segments = [line for line in f.read().splitlines()[1:] if line.split()[7] == str(uid)]
            return [n for n in os.listdir("/dev/shm") if n == name] + segments + (
                [name] if os.path.isdir("/dev/mqueue") and name in os.listdir("/dev/mqueue") else [])

        rt = __import__("ctypes").CDLL("librt.so.1", use_errno=True)
        queue = rt.mq_open(f"/{name}".encode(), 0, 0, None)
        assert queue >= 0  # there (a message queue descriptor is an fd on Linux)
        os.close(queue)
        assert len(left()) >= 2  # the file and the segment at least (the queue where /dev/mqueue is mounted)
        sandbox.sweep_uid(uid)
        assert left() == []
        assert rt.mq_open(f"/{name}".encode(), 0, 0, None) == -1  # the queue is gone, mounted or not
    finally:
        blocks.close()
