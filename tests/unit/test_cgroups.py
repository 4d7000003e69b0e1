"""Tests of gpud_worker.cgroups: the pure parsing and limit values; ``JobCgroups.setup`` against a
fake /proc and cgroup tree (plain files); and, as root where a cgroup v2 hierarchy is writable, real
cgroups (creation, placement, kill, removal, stale cleanup).

The jobs themselves in cgroups, with pool users, are tested in test_jobs.py.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import time
from collections.abc import Iterator

import pytest

from gpud_worker import cgroups
from gpud_worker.cgroups import (
    CgroupLimits,
    Hierarchy,
    JobCgroup,
    JobCgroups,
    cpu_max,
    job_limits,
    limit_files,
    parse_controllers,
    parse_events,
    parse_mountinfo,
    parse_proc_cgroup,
    v1_limit_files,
)

IS_ROOT = os.geteuid() == 0

UNIFIED = """\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct,cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_ONLY = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)


# -- pure: parsing ----------------------------------------------------------------------------


def test_parse_mountinfo_unified_hybrid_v1_none() -> None:
    assert parse_mountinfo(UNIFIED) == Hierarchy("/sys/fs/cgroup", ())
    assert parse_mountinfo(UNIFIED).mode == "unified"
    hybrid = parse_mountinfo(HYBRID)
    assert hybrid == Hierarchy("/sys/fs/cgroup/unified", ("cpu", "cpuacct", "memory", "pids"))
    assert hybrid.mode == "hybrid"
    assert parse_mountinfo(V1_ONLY).mode == "v1"
    assert parse_mountinfo("22 27 0:21 / /proc rw,relatime - proc proc rw\ngarbage\n").mode == "none"


def test_parse_mountinfo_named_hierarchy_only_is_unified_and_escapes_decoded() -> None:
    text = (
        "40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
        r"41 31 0:38 / /mnt/my\040cgroups rw - cgroup2 cgroup2 rw" + "\n"
    )
    assert parse_mountinfo(text) == Hierarchy("/mnt/my cgroups", ())


def test_parse_proc_cgroup() -> None:
    assert parse_proc_cgroup("0::/system.slice/gpud-worker.service\n") == "/system.slice/gpud-worker.service"
    assert parse_proc_cgroup("4:memory:/x\n1:name=systemd:/y\n0::/\n") == "/"
    assert parse_proc_cgroup("4:memory:/x\n") is None


def test_parse_controllers_and_events() -> None:
    assert parse_controllers("cpuset cpu io memory pids\n") == {"cpuset", "cpu", "io", "memory", "pids"}
    assert parse_controllers("") == frozenset()
    assert parse_events("populated 1\nfrozen 0\n") == {"populated": 1, "frozen": 0}
    assert parse_events("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\nbad x\n")["oom_kill"] == 2


# -- pure: limits -----------------------------------------------------------------------------


def test_job_limits_grant_first_then_default() -> None:
    assert job_limits(0, 0, None, 512) == CgroupLimits(None, 0, 512)
    assert job_limits(0, 0, 1 << 30, None) == CgroupLimits(1 << 30, 0, None)
    assert job_limits(2 << 30, 1500, 1 << 30, 64) == CgroupLimits(2 << 30, 1500, 64)
    assert job_limits(0, -5, 0, None) == CgroupLimits(None, 0, None)


@pytest.mark.parametrize(
    ("milli", "expected"),
    [(0, "max 100000"), (-1, "max 100000"), (1000, "100000 100000"), (250, "25000 100000"),
     (2500, "250000 100000"), (1, "1000 100000"), (10, "1000 100000"), (11, "1100 100000")],
)
def test_cpu_max(milli: int, expected: str) -> None:
    assert cpu_max(milli) == expected


def test_limit_files_only_for_enabled_controllers() -> None:
    limits = CgroupLimits(memory=64 << 20, cpu_milli=500, pids=100)
    assert limit_files(limits, {"memory", "cpu", "pids"}) == [
        ("memory.max", str(64 << 20)),
        ("memory.swap.max", "0"),
        ("memory.oom.group", "1"),
        ("cpu.max", "50000 100000"),
        ("pids.max", "100"),
    ]
    assert limit_files(limits, {"pids"}) == [("pids.max", "100")]
    assert limit_files(limits, ()) == []
    # No memory figure: no memory.max, but an OOM kill still takes the whole job.
    assert limit_files(CgroupLimits(), {"memory", "cpu", "pids"}) == [("memory.oom.group", "1")]


# -- setup against a fake /proc and cgroup tree ---------------------------------------------------


def fake_host(tmp_path: pathlib.Path, mountinfo: str, own: str, controllers: str) -> pathlib.Path:
    """A /proc/self look-alike at tmp/proc and a cgroup2 'mount' at tmp/cg (plain files)."""
    mount = tmp_path / "cg"
    base = mount / own.strip("/")
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text(controllers + "\n")
    (base / "cgroup.subtree_control").write_text("")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mountinfo.replace("/sys/fs/cgroup/unified", str(mount))
                                    .replace("/sys/fs/cgroup ", f"{mount} "))
    (proc / "cgroup").write_text(f"0::{own}\n")
    return proc


def test_setup_unified_moves_itself_to_a_leaf_and_enables_controllers(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = fake_host(tmp_path, UNIFIED, "/system.slice/gpud-worker.service", "cpuset cpu io memory pids")
    base = tmp_path / "cg" / "system.slice" / "gpud-worker.service"
    (base / "daemon").mkdir()
    (base / "daemon" / "cgroup.procs").write_text("")  # the kernel's file; this fake needs it made
    stale = base / "job-abcd"
    stale.mkdir()
    (base / "job-not-hex").mkdir()
    with caplog.at_level(logging.INFO, "gpud_worker.cgroups"):
        cg = JobCgroups.setup(proc=str(proc))
    assert cg is not None
    assert cg.base == str(base) and cg.controllers == {"memory", "cpu", "pids"}
    assert (base / "daemon" / "cgroup.procs").read_text() == "0"  # the worker moved itself
    assert (base / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert not stale.exists() and (base / "job-not-hex").exists()  # only names it makes
    assert f"jobs run in cgroups below {base} (controllers: memory cpu pids)" in caplog.text


def test_setup_with_a_parent_does_not_move_itself_and_names_missing_controllers(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = fake_host(tmp_path, HYBRID, "/", "hugetlb pids")
    parent = tmp_path / "cg" / "gpud"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("hugetlb pids\n")
    (parent / "cgroup.subtree_control").write_text("pids\n")
    with caplog.at_level(logging.INFO, "gpud_worker.cgroups"):
        cg = JobCgroups.setup(str(parent), proc=str(proc))
    assert cg is not None and cg.controllers == {"pids"}
    assert not (parent / "daemon").exists()
    assert (parent / "cgroup.subtree_control").read_text() == "pids\n"  # enabled already: not written
    assert "does not offer the memory, cpu controller(s)" in caplog.text


@pytest.mark.parametrize(
    ("mountinfo", "parent", "message"),
    [
        (V1_ONLY, "", "cgroup v1: no cgroup v2 hierarchy"),
        ("", "", "cgroup none: no cgroup v2 hierarchy"),
        (HYBRID, "", "cgroup hybrid (controllers cpu,cpuacct,memory,pids on v1)"),
        (UNIFIED, "/elsewhere/gpud", "is not in the cgroup v2 hierarchy"),
    ],
)
def test_setup_refuses_and_says_why(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, mountinfo: str, parent: str, message: str
) -> None:
    proc = fake_host(tmp_path, mountinfo, "/", "memory")
    with caplog.at_level(logging.WARNING, "gpud_worker.cgroups"):
        assert JobCgroups.setup(parent, proc=str(proc)) is None
    assert message in caplog.text
    assert "jobs run without cgroup" in caplog.text


def test_setup_not_writable_is_logged_not_raised(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = fake_host(tmp_path, UNIFIED, "/svc", "memory")
    (tmp_path / "cg" / "svc" / "cgroup.controllers").unlink()  # unreadable: as if not delegated
    with caplog.at_level(logging.WARNING, "gpud_worker.cgroups"):
        assert JobCgroups.setup(proc=str(proc)) is None
    assert "is not usable here" in caplog.text and "Delegate=yes" in caplog.text


def test_create_writes_limits_and_tolerates_failures(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    cg = JobCgroups(str(base), {"memory", "cpu", "pids"})
    real_write = cgroups._write

    def write(path: str, value: str) -> None:
        if path.endswith(("cpu.max", "memory.swap.max")):
            raise PermissionError(13, "Permission denied")
        real_write(path, value)

    real_mkdir = os.mkdir

    def mkdir_with_procs(path: str, mode: int = 0o777) -> None:  # as the kernel makes a cgroup
        real_mkdir(path, mode)
        for name in ("cgroup.procs", "memory.max", "memory.swap.max", "memory.oom.group", "cpu.max", "pids.max"):
            with open(os.path.join(path, name), "w"):
                pass

    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.DEBUG, "gpud_worker.cgroups"):
        mp.setattr(cgroups, "_write", write)
        mp.setattr(cgroups.os, "mkdir", mkdir_with_procs)
        job = cg.create("ab12", CgroupLimits(memory=1 << 20, cpu_milli=100, pids=7))
    assert job is not None and job.path == str(base / "job-ab12")
    assert (base / "job-ab12" / "memory.max").read_text() == str(1 << 20)
    assert (base / "job-ab12" / "pids.max").read_text() == "7"
    assert (base / "job-ab12" / "memory.oom.group").read_text() == "1"
    assert "cannot set cpu.max to 10000 100000" in caplog.text  # a warning
    assert any(r.levelno == logging.DEBUG and "memory.swap.max not set" in r.getMessage() for r in caplog.records)
    job.close_fd()
    assert job.procs_fd is None


def test_create_failure_returns_none(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    cg = JobCgroups(str(tmp_path / "absent"), {"memory"})
    with caplog.at_level(logging.WARNING, "gpud_worker.cgroups"):
        assert cg.create("ab", CgroupLimits()) is None
    assert "the job runs without it" in caplog.text


# -- real cgroups (root, a writable cgroup v2 hierarchy) ---------------------------------------


def _v2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo") as f:
            return parse_mountinfo(f.read()).v2
    except OSError:
        return None


@pytest.fixture
def real_parent() -> Iterator[pathlib.Path]:
    mount = _v2_mount()
    if not IS_ROOT or mount is None:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    parent = pathlib.Path(mount) / f"gpud-cgtest-{os.getpid()}"
    try:
        parent.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup in the cgroup v2 hierarchy at {mount}: {exc}")
    try:
        yield parent
    finally:
        cgroups.remove_cgroup(str(parent))


def test_real_cgroup_holds_kills_and_removes(real_parent: pathlib.Path) -> None:
    cg = JobCgroups.setup(str(real_parent))
    assert cg is not None
    job = cg.create("0123", CgroupLimits(memory=256 << 20, cpu_milli=500, pids=64))
    assert job is not None
    assert job.procs_fd is not None
    fd = job.procs_fd
    # A child that enters through the fd before exec, then detaches a grandchild in a new session.
    proc = subprocess.Popen(
        ["sh", "-c", "setsid sleep 1000 & sleep 1000"],
        preexec_fn=lambda: os.write(fd, b"0") and None,
        start_new_session=True,
    )
    job.close_fd()
    try:
        assert job.holds(proc.pid)
        deadline = time.monotonic() + 5
        while len(cgroups._pids(job.path)) < 3:
            assert time.monotonic() < deadline, "the children never appeared"
            time.sleep(0.01)
        assert not job.holds(os.getpid())
        job.kill()
        assert proc.wait(5) == -9
        assert cgroups._pids(job.path) == []
        job.remove()
        assert not os.path.exists(job.path)
    finally:
        proc.kill()
        proc.wait()


def test_real_stale_job_cgroup_removed_at_setup(real_parent: pathlib.Path) -> None:
    stale = real_parent / "job-beef"
    stale.mkdir()
    proc = subprocess.Popen(["sleep", "1000"])
    try:
        (stale / "cgroup.procs").write_text(str(proc.pid))
        assert JobCgroups.setup(str(real_parent)) is not None
        assert proc.wait(5) == -9
        assert not stale.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_session_process_that_cannot_enter_its_cgroup_is_warned_of_and_still_serves(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real session process (forkserver, simulated GPU) handed a cgroup it cannot be in (its
    cgroup.procs is /dev/null here: the write succeeds, yet its /proc/self/cgroup names no
    session-fake): the worker warns, as for a job, the session serves all the same, and the
    cgroup is removed after it."""
    from gpud_worker.device import SimulatedDevice
    from gpud_worker.gpu import simulated_gpus
    from gpud_worker.session_host import HostedDevice, SessionHosts

    fake = tmp_path / "session-fake"
    made: list[tuple[str, str]] = []

    def make_cgroup(hexid: str, grant: object, minors: object, prefix: str) -> JobCgroup:
        made.append((hexid, prefix))
        fake.mkdir()
        return JobCgroup(str(fake), os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC))

    hosts = SessionHosts(lambda tenant: None, lambda user: None, make_cgroup=make_cgroup)
    device = HostedDevice(SimulatedDevice(simulated_gpus(1, mem=1 << 30, worker_name="cg")[0]), hosts)
    with caplog.at_level(logging.WARNING):
        s = device.open_session(1 << 20)
    try:
        assert "did not enter its cgroup" in caplog.text and "it is not in it" in caplog.text
        handle = s.alloc(16)
        s.htod(handle, 0, b"x" * 16)
        assert bytes(s.dtoh(handle, 0)) == b"x" * 16
    finally:
        s.close()
    assert made and made[0][1] == "session-"
    assert not fake.exists()


def test_v1_limit_files_per_hierarchy() -> None:
    limits = CgroupLimits(memory=64 << 20, cpu_milli=250, pids=100)
    assert v1_limit_files("memory", limits, []) == [("memory.limit_in_bytes", str(64 << 20)),
                                                    ("memory.memsw.limit_in_bytes", str(64 << 20))]
    assert v1_limit_files("cpu", limits, []) == [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "25000")]
    assert v1_limit_files("pids", limits, []) == [("pids.max", "100")]
    assert v1_limit_files("devices", limits, [3, 1, 3]) == [("devices.deny", "c 195:1 rwm"), ("devices.deny", "c 195:3 rwm")]
    assert v1_limit_files("cpu", CgroupLimits(), []) == [] and v1_limit_files("memory", CgroupLimits(), []) == []
