"""Hostile tenants on one GPU VM: what a job can see and keep of another tenant's, tried for real.

Real daemons (a broker and workers as root, CURVE), the real client library, two tenants with
keys of their own (``alice`` and ``bob``), jobs as dynamic pool users. Each test performs one
attack and asserts that it is blocked; the last ones check the fallback without namespaces and
that two local clusters on one host leave each other's jobs alone.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.errors import NoCapacity
from gpud.protocol import JobSpec
from gpud.security import CurveKeys
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_cli.uid_ranges import UidBlocks
from gpud_client import Client, Timeout
from gpud_client.ctl import main as gpudctl
from gpud_worker.cgroups import (
    JobCgroups,
    JobCgroupsV1,
    parse_mountinfo,
    parse_proc_cgroup,
    parse_v1_mounts,
    parse_v1_own,
    remove_cgroup,
    setup_job_cgroups,
)
from gpud_worker.jobs import JobLimits, JobRunner, UserPool
from gpud_worker.sandbox import Sandbox
from tests.waiting import Gate, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and pool users need root")

PY = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
# Where these clusters' dynamic uids start: above the blocks that clusters of older gpud versions
# (which take no lock and start at 61184) may use on this host at the same time, and kill.
UID_BASE = 64000


def client(cluster: LocalCluster, keys: CurveKeys) -> Client:
    return Client(cluster.frontend, timeout=60, curve=keys)


def workers_table(cluster: LocalCluster) -> str:
    out = io.StringIO()
    assert gpudctl(["--admin", cluster.admin, "workers"], out=out) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One worker with two SIMULATED GPUs and four pool users (two per tenant at most)."""
    with LocalCluster(workers=1, gpus_per_worker=2, heartbeat_ms=200, security="curve", pool_size=4,
                      dynamic_uid_base=UID_BASE) as c:
        yield c


def test_the_worker_reports_namespaces(cluster: LocalCluster) -> None:
    row = admin_call(cluster.admin, "workers")[0]
    assert (row["isolation"], row["job_network"], row["pool_users"]) == ("namespaces", "none", 4)
    line = next(ln for ln in workers_table(cluster).splitlines() if ln.startswith("w0"))
    assert "namespaces" in line and "host net" not in line
    assert "isolation: namespaces" in cluster.log_tail("w0", 400)


def test_proc_shows_only_the_jobs_own_processes(cluster: LocalCluster, alice: CurveKeys, bob: CurveKeys) -> None:
    """bob's job looks for alice's running job (and its token on the command line) in /proc."""
    secret = "--api-token=" + os.urandom(8).hex()
    with client(cluster, alice) as a, client(cluster, bob) as b, Gate() as gate:
        running = a.submit(["sh", "-c", gate.shell(5) + "; echo done", "sh", secret], gpu_milli=1, time_limit=60)
        deadline = time.monotonic() + 20
        while not any(secret in " ".join(cmdline) for cmdline in _cmdlines()):  # as the VM sees it
            assert time.monotonic() < deadline, "alice's job did not start"
            time.sleep(0.05)
        r = b.run(["sh", "-c", "for d in /proc/[0-9]*; do echo \"${d#/proc/} $(tr '\\0' ' ' < $d/cmdline)\"; done"],
                  gpu_milli=1)
        assert r.exit_code == 0, r.stderr
        assert secret.encode() not in r.stdout
        pids = sorted(int(line.split()[0]) for line in r.stdout.decode().splitlines())
        assert pids[:2] == [1, 2] and len(pids) <= 4, r.stdout  # gpud-init, sh and its subshells
        assert b"gpud-init" in r.stdout and b"gpud.cli" not in r.stdout  # not the worker's command line
        gate.open()
        assert running.wait().stdout == b"done\n"


def _cmdlines() -> list[list[str]]:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            out.append(p.cmdline())
        except psutil.Error:
            continue
    return out


def test_a_job_cannot_connect_to_the_broker_or_reach_its_files(cluster: LocalCluster, alice: CurveKeys) -> None:
    """The broker's frontend and backend on loopback, the cluster's run directory (its keys, the
    admin socket, other jobs' directories) and the VM's file systems, from a job."""
    ports = [int(ep.rsplit(":", 1)[1]) for ep in (cluster.frontend, cluster.backend)]
    assert cluster.rundir is not None
    probe = (
        "import socket, os, sys\n"
        "for port in map(int, sys.argv[1:3]):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), 2).close(); print('connected', port)\n"
        "    except OSError as e: print('refused', port, e.errno)\n"
        "print('rundir', os.path.exists(sys.argv[3] + '/keys'), os.path.exists(sys.argv[3] + '/admin.sock'))\n"
        "for path in ('/etc/x', '/var/x', sys.argv[3] + '/x'):\n"
        "    try: open(path, 'w'); print('wrote', path)\n"
        "    except OSError as e: print('no write', path, e.errno)\n"
        "print('cwd', os.getcwd(), sorted(os.listdir('.')))\n"
    )
    with client(cluster, alice) as a:
        r = a.run([PY, "probe.py", *map(str, ports), str(cluster.rundir)], files={"probe.py": probe.encode()}, gpu_milli=1)
    out = r.stdout.decode()
    assert r.exit_code == 0, r.stderr
    assert "connected" not in out and out.count("refused") == 2, out
    assert "rundir False False" in out, out
    assert "wrote" not in out and out.count("no write") == 3, out
    assert "'probe.py'" in out and f"cwd {cluster.rundir}/jobs-w0/" in out  # its own directory, at its path


def test_files_left_in_tmp_and_shm_are_gone_for_the_next_tenant(alice_and_bob_on_one_user: tuple[LocalCluster, CurveKeys, CurveKeys]) -> None:
    """alice leaves 0600 files in /tmp, /var/tmp and /dev/shm (one of 200 MB), a SysV shared
    memory segment and a POSIX message queue; bob's next job, under the same uid, looks for them."""
    cluster, alice, bob = alice_and_bob_on_one_user
    name = "left-" + os.urandom(4).hex()
    leave = (
        f"umask 077; for d in /tmp /var/tmp /dev/shm; do echo secret > $d/{name}; done; "
        f"head -c 200000000 /dev/zero > /tmp/{name}.big && ls -l /tmp/{name}.big; ipcmk -M 4096; "
        f"{PY} -c \"import ctypes; q = ctypes.CDLL('librt.so.1').mq_open(b'/{name}', 0o100 | 2, 0o600, None); print('mq', q)\"; id -u"
    )
    look = (
        f"for d in /tmp /var/tmp /dev/shm; do cat $d/{name} 2>/dev/null; ls -a $d; done; ipcs -m; "
        f"{PY} -c \"import ctypes; print('mq', ctypes.CDLL('librt.so.1').mq_open(b'/{name}', 0, 0, None))\"; id -u"
    )
    with client(cluster, alice) as a, client(cluster, bob) as b:
        left = a.run(["sh", "-c", leave], gpu_milli=1)
        assert left.exit_code == 0, left.stderr
        assert b"200000000" in left.stdout and b"mq -1" not in left.stdout, left.stdout
        seen = b.run(["sh", "-c", look], gpu_milli=1)
    assert seen.stdout.split()[-1] == left.stdout.split()[-1]  # the same pool user
    assert name.encode() not in seen.stdout, seen.stdout
    assert b"secret" not in seen.stdout and b"mq -1" in seen.stdout, seen.stdout
    assert not re.search(rb"0x[0-9a-f]+\s+\d+\s+\d+", seen.stdout), seen.stdout  # no shm segment listed
    assert not any(name in entry for d in ("/tmp", "/var/tmp", "/dev/shm") for entry in os.listdir(d))


@pytest.fixture(scope="module")
def alice_and_bob_on_one_user() -> Iterator[tuple[LocalCluster, CurveKeys, CurveKeys]]:
    """A worker with a single pool user: every job, whoever's, runs under the same uid."""
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", pool_size=1,
                      dynamic_uid_base=UID_BASE) as c:
        yield c, c.client_keys("alice"), c.client_keys("bob")


STAND_IN_MAJOR = 195  # NVIDIA's character major: stand-ins look like the real nodes


@pytest.fixture
def stand_in_gpu_nodes() -> Iterator[list[str]]:
    """STAND-IN device nodes, made here with mknod because this machine has no GPU:
    /dev/nvidia0 and /dev/nvidia1 (the simulated GPUs' minors) and /dev/nvidiactl, character
    devices of NVIDIA's major with no driver behind them. Removed afterwards; never replaces a
    node that exists."""
    made = []
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        path = f"/dev/{name}"
        if os.path.lexists(path):
            if not stat.S_ISCHR(os.lstat(path).st_mode):
                pytest.skip(f"{path} exists and is not a device node")
            continue
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(STAND_IN_MAJOR, minor))
        os.chmod(path, 0o666)
        made.append(path)
    try:
        yield made
    finally:
        for path in made:
            os.unlink(path)


def test_a_job_sees_only_its_granted_gpus_nodes(stand_in_gpu_nodes: list[str]) -> None:
    """With STAND-IN /dev/nvidia0, nvidia1 and nvidiactl on the VM: a job granted one GPU finds
    only that GPU's node and nvidiactl in its /dev, also with CUDA_VISIBLE_DEVICES unset; a job
    granted both finds both."""
    with LocalCluster(workers=1, gpus_per_worker=2, heartbeat_ms=200, security="curve", pool_size=2,
                      dynamic_uid_base=UID_BASE) as c, \
            client(c, c.client_keys("alice")) as a:
        one = a.run(["sh", "-c", "unset CUDA_VISIBLE_DEVICES; ls /dev"], gpu_milli=500)
        both = a.run(["sh", "-c", "ls /dev"], gpus=2)
    nodes = [n for n in one.stdout.decode().split() if n.startswith("nvidia")]
    assert len(nodes) == 2 and "nvidiactl" in nodes, one.stdout
    granted = [n for n in nodes if n != "nvidiactl"]
    assert granted in (["nvidia0"], ["nvidia1"])
    assert [n for n in both.stdout.decode().split() if n.startswith("nvidia")] == ["nvidia0", "nvidia1", "nvidiactl"]
    assert set(one.stdout.decode().split()) >= {"null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "ptmx"}


def test_one_tenant_cannot_take_every_pool_user(cluster: LocalCluster, alice: CurveKeys, bob: CurveKeys) -> None:
    """alice floods the worker (4 pool users, share 1/2) with long jobs; bob's job still runs at
    once, while alice's are held to two at a time. Four jobs: without the share they would take
    every pool user. Each lasts 8 s, or until bob's job is done (the gate)."""
    with client(cluster, alice) as a, client(cluster, bob) as b, Gate() as gate:
        flood = [a.submit(["sh", "-c", gate.shell(8)], gpu_milli=1, time_limit=30) for _ in range(4)]
        deadline = time.monotonic() + 20
        while admin_call(cluster.admin, "workers")[0]["pool_free"] > 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        r = b.run(["id", "-u"], gpu_milli=1, timeout=20)
        took = time.monotonic() - started
        row = admin_call(cluster.admin, "workers")[0]
        gate.open()
        results = [j.wait() for j in flood]
    assert r.exit_code == 0
    assert took < 8, f"bob's job waited {took:.1f}s for alice's flood"  # it did not wait for a sleep to end
    assert row["pool_free"] >= 1  # alice held at most her share
    assert all(x.exit_code == 0 for x in results), [(x.exit_code, x.user) for x in results]


def test_a_jobs_host_mem_is_its_memory_limit(cluster: LocalCluster, alice: CurveKeys) -> None:
    """The client's ``host_mem`` reaches the worker through the grant and becomes the job's cgroup
    memory limit: 200 MB touched under host_mem 64 MiB is killed, under 512 MiB it is not; and a
    host_mem no worker has is never placed."""
    hog = [PY, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')"]
    with client(cluster, alice) as a:
        small = a.run(hog, gpu_milli=1, host_mem=64 << 20, timeout=30)
        roomy = a.run(hog, gpu_milli=1, host_mem=512 << 20, cpu_milli=500, timeout=30)
        with pytest.raises(NoCapacity):
            a.run(["true"], gpu_milli=1, host_mem=1 << 50, timeout=30)
    assert small.exit_code == -9 and b"survived" not in small.stdout, small
    assert roomy.exit_code == 0 and roomy.stdout.strip() == b"survived", roomy


def test_host_network_with_security_none_is_refused() -> None:
    c = LocalCluster(workers=0, security="none", worker_args=["--job-network", "host"])
    with c:
        proc = c.add_worker("w0")
        assert proc.wait(30) == 2
        assert "refused" in c.log_tail("w0") and "register" in c.log_tail("w0")


def test_without_namespaces_the_worker_says_so_and_sweeps_the_uid() -> None:
    """A worker denied CAP_SYS_ADMIN (setpriv) cannot make namespaces: it says so at start, in
    READY (gpudctl workers) and the metrics, and then sweeps what a job left under its uid."""
    name = "left-" + os.urandom(4).hex()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is missing")
    drop = [setpriv, "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--"]
    with LocalCluster(workers=1, heartbeat_ms=200, security="curve", pool_size=1, worker_prefix=drop,
                      dynamic_uid_base=UID_BASE, broker_args=["--metrics", "127.0.0.1:0"]) as c, \
            client(c, c.client_keys("alice")) as a:
        row = admin_call(c.admin, "workers")[0]
        assert row["isolation"] == "rlimits only"
        with urllib.request.urlopen(c.endpoints["metrics"], timeout=10) as page:
            metrics = page.read().decode()
        assert 'gpud_worker_isolation{job_network="host",level="rlimits only",worker="w0"} 1.0' in metrics, metrics
        assert "RLIMITS ONLY" in workers_table(c)
        assert "isolation: rlimits only" in c.log_tail("w0", 400)
        r = a.run(["sh", "-c", f"umask 077; echo s > /tmp/{name}; echo s > /dev/shm/{name}; ipcmk -M 4096; id -u"], gpu_milli=1)
        uid = int(r.stdout.split()[-1])
        left = [f"{d}/{e}" for d in ("/tmp", "/dev/shm") for e in os.listdir(d) if name in e]
        assert not left, c.log_tail("w0", 30)
        with open("/proc/sysvipc/shm") as f:
            assert not any(line.split()[7] == str(uid) for line in f.read().splitlines()[1:])


def test_two_local_clusters_do_not_touch_each_others_jobs() -> None:
    """Two clusters on this host at once: their workers get different uids, and one cluster's
    after-job cleanup (which kills every process of its pool users) leaves the other's job be."""
    with LocalCluster(workers=1, heartbeat_ms=200, dynamic_uid_base=UID_BASE) as one, \
            LocalCluster(workers=1, heartbeat_ms=200, dynamic_uid_base=UID_BASE) as two:
        mine, theirs = one.uid_blocks["w0"], two.uid_blocks["w0"]
        assert set(mine).isdisjoint(theirs)
        with Client(one.frontend, timeout=60) as c1, Client(two.frontend, timeout=60) as c2, Gate() as gate:
            # The long job runs until the other cluster has run (and cleaned up after) ten jobs.
            long = c1.submit(["sh", "-c", gate.shell(20) + "; id -u"], gpu_milli=1, time_limit=30)
            done = threading.Event()
            users = []

            def churn() -> None:
                while not done.is_set():
                    users.append(int(c2.run(["id", "-u"], gpu_milli=1).stdout))

            t = threading.Thread(target=churn)
            t.start()
            try:
                wait_for(lambda: len(users) >= 10 or long.done(), "ten jobs of the other cluster")
                gate.open()
                r = long.wait()
            finally:
                done.set()
                t.join()
    assert r.exit_code == 0 and int(r.stdout) in mine  # not killed by the other cluster's cleanup
    assert len(users) >= 10 and all(u in theirs for u in users)


def test_cgroup_v1_limits_memory_and_denies_the_gpus_not_granted(stand_in_gpu_nodes: list[str], tmp_path: Path) -> None:
    """The real job runner with the host's cgroup v1 hierarchies and no namespaces (so the
    STAND-IN /dev/nvidia0 and nvidia1 are in reach): a job granted GPU 0 gets EPERM from the
    devices cgroup opening nvidia1, and ENXIO (no driver behind a stand-in) opening nvidia0; a job
    that allocates past its memory limit is killed."""
    cgroups = setup_job_cgroups()
    if not isinstance(cgroups, JobCgroupsV1) or {"memory", "devices"} - cgroups.controllers:
        pytest.skip("this host has no cgroup v1 memory and devices hierarchies")
    blocks = UidBlocks(UID_BASE)
    uids = blocks.take()
    try:
        os.chmod(tmp_path, 0o711)
        runner = JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", uids[:2]), limits=JobLimits(memory=64 << 20),
                           cgroups=cgroups, gpu_minors={"G0": 0, "G1": 1})
        probe = ("import errno\nfor n in (0, 1):\n    try: open(f'/dev/nvidia{n}', 'rb')\n"
                 "    except OSError as e: print(n, errno.errorcode[e.errno])\n")
        spec = JobSpec(argv=(PY, "-c", probe), env={}, files=(), outputs=())
        out = runner.run(os.urandom(8), spec, [], "0", "alice", gpus=["G0"])
        assert out.stdout.decode().split() == ["0", "ENXIO", "1", "EPERM"], out
        hog = JobSpec(argv=(PY, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')"),
                      env={}, files=(), outputs=())
        fat = runner.run(os.urandom(8), hog, [], "0", "alice", gpus=["G0"])
        assert fat.exit_code == -9 and b"survived" not in fat.stdout, fat
    finally:
        cgroups.close()
        blocks.close()


@pytest.fixture
def v2_parent() -> Iterator[str]:
    """A cgroup of the v2 hierarchy for a runner's job cgroups (cgroup_parent): on a hybrid host
    like this one the v1 hierarchies would be chosen otherwise."""
    with open("/proc/self/mountinfo") as f:
        mount = parse_mountinfo(f.read()).v2
    if mount is None:
        pytest.skip("this host has no cgroup v2 hierarchy")
    path = os.path.join(mount, f"gpud-isotest-{os.getpid()}")
    os.mkdir(path)
    try:
        yield path
    finally:
        remove_cgroup(path)


def test_cgroup_v2_device_program_denies_the_gpus_not_granted(stand_in_gpu_nodes: list[str], v2_parent: str,
                                                               tmp_path: Path) -> None:
    """The real job runner with job cgroups on cgroup v2, each with a BPF device program of the
    job's own nodes. Without namespaces (so the VM's /dev, with the STAND-IN /dev/nvidia0, nvidia1
    and nvidiactl, is in reach): a job granted GPU 0 opens /dev/null, gets ENXIO opening nvidia0
    and nvidiactl (allowed; no driver behind a stand-in) and EPERM opening nvidia1 (denied). In
    namespaces, the sandbox's /dev, whose nodes the job's process makes once in its fenced
    cgroup, works as before, terminals (ptmx, pts) included."""
    cgroups = JobCgroups.setup(v2_parent)
    assert cgroups is not None and cgroups.device_fence == "bpf"
    blocks = UidBlocks(UID_BASE)
    uids = blocks.take()
    try:
        os.chmod(tmp_path, 0o711)
        probe = ("import errno, os\nfor n in ('null', 'nvidia0', 'nvidiactl', 'nvidia1'):\n"
                 "    try: open(f'/dev/{n}', 'rb'); print(n, 'ok')\n"
                 "    except OSError as e: print(n, errno.errorcode[e.errno])\n"
                 "m, s = os.openpty(); print('pty', os.ttyname(s))\n")
        spec = JobSpec(argv=(PY, "-c", probe), env={}, files=(), outputs=())
        plain = JobRunner(tmp_path / "plain", UserPool("gpud-dyn-", uids[:2]), cgroups=cgroups,
                          gpu_minors={"G0": 0, "G1": 1})
        out = plain.run(os.urandom(8), spec, [], "0", "alice", gpus=["G0"])
        said = out.stdout.decode().split()
        assert said[:8] == ["null", "ok", "nvidia0", "ENXIO", "nvidiactl", "ENXIO", "nvidia1", "EPERM"], out
        sandbox = Sandbox("none")
        boxed = JobRunner(tmp_path / "boxed", UserPool("gpud-dyn-", uids[2:4]), cgroups=cgroups, sandbox=sandbox,
                          gpu_minors={"G0": 0, "G1": 1})
        out = boxed.run(os.urandom(8), spec, [], "0", "alice", gpus=["G0"])
        assert out.exit_code == 0, out
        said = out.stdout.decode().split()
        assert said[:7] == ["null", "ok", "nvidia0", "ENXIO", "nvidiactl", "ENXIO", "nvidia1"], out
        assert said[7] == "ENOENT" and said[8:] == ["pty", "/dev/pts/0"], out  # not in its /dev at all
    finally:
        blocks.close()


# Run as root by the session cgroup test: opens the session's cgroup.procs files (argv[4:]), enters
# the session's mount namespace and makes a STAND-IN node of the GPU it was not granted in the
# session's own /dev (remounted writable for this), then tries that node and its own GPU's node
# outside the session's cgroup and then in it.
MKNOD_IN_A_SESSION = r"""
import ctypes, errno, os, stat, sys
pid, other, mine = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
procs = [os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY) for d in sys.argv[4:]]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
assert libc.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), 0x00020000) == 0, ctypes.get_errno()
os.chdir("/")
assert libc.mount(None, b"/dev", None, 32 | 4096 | 2 | 8, None) == 0, ctypes.get_errno()  # remount, bind: writable
node = f"/dev/nvidia{other}"

def attempt(what, f):
    try:
        f()
        print(what, "ok")
    except OSError as e:
        print(what, errno.errorcode[e.errno])

attempt("mknod-outside", lambda: os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, other)))
attempt("open-outside", lambda: os.close(os.open(node, os.O_RDWR)))
for fd in procs:
    os.write(fd, b"0")
attempt("open-inside", lambda: os.close(os.open(node, os.O_RDWR)))
attempt("own-inside", lambda: os.close(os.open(f"/dev/nvidia{mine}", os.O_RDWR)))
os.unlink(node)
attempt("mknod-inside", lambda: os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, other)))
"""


def _cgroup_dirs(cgroups: JobCgroups | JobCgroupsV1, pid: int) -> list[str]:
    """The directories of process ``pid``'s cgroups in the hierarchies ``cgroups`` uses."""
    with open(f"/proc/{pid}/cgroup") as f:
        text = f.read()
    if isinstance(cgroups, JobCgroupsV1):
        with open("/proc/self/mountinfo") as f:
            mounts = parse_v1_mounts(f.read())
        own = parse_v1_own(text)
        return [os.path.join(mounts[c], own[c].lstrip("/")) for c in sorted(cgroups.controllers)]
    with open("/proc/self/mountinfo") as f:
        v2 = parse_mountinfo(f.read()).v2
    path = parse_proc_cgroup(text)
    assert v2 is not None and path is not None
    return [os.path.join(v2, path.lstrip("/"))]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_session_process_has_a_cgroup_of_its_own(version: str, stand_in_gpu_nodes: list[str],
                                                   request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Session processes (a real forkserver child, a simulated GPU, in namespaces, as a pool user)
    with the host's cgroup v1 hierarchies (memory, cpu, pids, devices) and with v2 job cgroups
    (a BPF device program). A session on GPU 0 is in a cgroup ``session-<hex>`` of its own in
    every hierarchy; a STAND-IN node of GPU 1 that a root helper makes with mknod in the
    session's own /dev opens (ENXIO: no driver behind it) outside that cgroup, but in it the open
    and a new mknod are refused (EPERM), while its own GPU's node opens (ENXIO); past its memory
    limit (v1: job_memory 96 MiB) the process is killed and the session lost, saying why; and its
    cgroup is gone once the session ends."""
    from gpud.errors import SessionLost
    from gpud_worker.device import SimulatedDevice
    from gpud_worker.gpu import simulated_gpus
    from gpud_worker.session_host import HostedDevice, SessionHosts

    if version == "v1":
        found = setup_job_cgroups()
        if not isinstance(found, JobCgroupsV1) or {"memory", "devices"} - found.controllers:
            pytest.skip("this host has no cgroup v1 memory and devices hierarchies")
        request.addfinalizer(found.close)
        cgroups: JobCgroups | JobCgroupsV1 = found
    else:
        made = JobCgroups.setup(request.getfixturevalue("v2_parent"))
        assert made is not None and made.device_fence == "bpf"
        cgroups = made
    blocks = UidBlocks(UID_BASE)
    request.addfinalizer(blocks.close)
    uids = blocks.take()
    os.chmod(tmp_path, 0o711)
    gpus = simulated_gpus(2, mem=1 << 30, worker_name="cg")
    minors = {g.uuid: g.index for g in gpus}
    runner = JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", uids[:2]), limits=JobLimits(memory=96 << 20),
                       cgroups=cgroups, sandbox=Sandbox("none"), gpu_minors=minors)
    hosts = SessionHosts(runner.lease_user, runner.end_lease, sandbox=runner.sandbox, gpu_minors=minors,
                         make_cgroup=runner.make_cgroup)
    device = HostedDevice(SimulatedDevice(gpus[0]), hosts)
    s = device.open_session(512 << 20, tenant="alice")
    try:
        dirs = _cgroup_dirs(cgroups, s.pid)
        names = {os.path.basename(d) for d in dirs}
        assert len(names) == 1 and next(iter(names)).startswith("session-"), dirs
        assert all(os.path.isdir(d) for d in dirs)
        if version == "v1":  # the limits a job of its grant gets: job_memory, pids 512, no CPU figure granted
            values = dict(zip(sorted(cgroups.controllers), dirs, strict=True))  # as _cgroup_dirs lists them
            assert Path(values["memory"], "memory.limit_in_bytes").read_text() == f"{96 << 20}\n"
            assert Path(values["pids"], "pids.max").read_text() == "512\n"
        helper = subprocess.run([PY, "-c", MKNOD_IN_A_SESSION, str(s.pid), "1", "0", *dirs],
                                capture_output=True, text=True, timeout=60)
        assert helper.returncode == 0, helper.stderr
        assert helper.stdout.split() == ["mknod-outside", "ok", "open-outside", "ENXIO", "open-inside", "EPERM",
                                         "own-inside", "ENXIO", "mknod-inside", "EPERM"], helper.stdout
        if "memory" in cgroups.controllers:
            with pytest.raises(SessionLost, match="for its memory limit"):
                s.alloc(256 << 20)
    finally:
        s.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_a_sandboxed_jobs_exit_is_its_own_code_or_signal(tmp_path: Path) -> None:
    """A job's process is PID 1 of its namespace (gpud-init), which ends by no signal: the job's
    own exit code or signal reaches its outcome all the same, also a SIGTERM at its time limit;
    and PID 1 is gone with it, and so is what the job left running."""
    blocks = UidBlocks(UID_BASE)
    uids = blocks.take()
    try:
        os.chmod(tmp_path, 0o711)
        runner = JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", uids[:2]), sandbox=Sandbox("none"))

        def run(argv: tuple[str, ...], time_limit: float = 60.0) -> tuple[int, bool, bytes]:
            out = runner.run(os.urandom(8), JobSpec(argv=argv, env={}, files=(), outputs=(), time_limit=time_limit),
                             [], "0", "alice")
            return out.exit_code, out.timed_out, out.stdout

        assert run(("sh", "-c", "exit 7")) == (7, False, b"")
        assert run((PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")) == (-11, False, b"")
        assert run(("sh", "-c", "echo $$ $PPID; exec sleep 30"), time_limit=1) == (-15, True, b"2 1\n")
        left = f"1000.{os.getpid()}"  # seconds of a sleep nobody else runs
        code, _, out = run(("sh", "-c", f"sleep {left} & echo $!"))
        assert code == 0 and not any(c[:2] == ["sleep", left] for c in _cmdlines())
    finally:
        blocks.close()


def test_the_private_tmp_and_shm_have_their_size(tmp_path: Path) -> None:
    """job_tmp_size (1 MiB here): a sandboxed job's /tmp, /var/tmp and /dev/shm are tmpfs of that
    size each, so filling them fails with ENOSPC there, not on the VM's file systems."""
    blocks = UidBlocks(UID_BASE)
    uids = blocks.take()
    try:
        os.chmod(tmp_path, 0o711)
        runner = JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", uids[:2]), sandbox=Sandbox("none", tmp_size=1 << 20))
        script = "; ".join(f"head -c 2097152 /dev/zero > {d}/fill 2>/dev/null; echo {d} $? $(wc -c < {d}/fill)"
                           for d in ("/tmp", "/var/tmp", "/dev/shm"))
        out = runner.run(os.urandom(8), JobSpec(argv=("sh", "-c", script), env={}, files=(), outputs=()), [], "0", "alice")
        assert out.stdout.decode().split("\n")[:3] == ["/tmp 1 1048576", "/var/tmp 1 1048576", "/dev/shm 1 1048576"], out
    finally:
        blocks.close()


def test_a_failed_sandbox_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose sandbox cannot be made (here its loopback, made to fail in the job's process
    on purpose) does not start, and the error says why, which Python's subprocess does not pass
    on ("Exception occurred in preexec_fn"); the next job starts."""
    from gpud.errors import RemoteError
    from gpud_worker import sandbox as sb

    blocks = UidBlocks(UID_BASE)
    uids = blocks.take()
    try:
        os.chmod(tmp_path, 0o711)
        runner = JobRunner(tmp_path / "jobs", UserPool("gpud-dyn-", uids[:2]), sandbox=Sandbox("none"))
        spec = JobSpec(argv=("true",), env={}, files=(), outputs=())
        calls = []

        def refused() -> None:
            calls.append(1)  # counted in this process only: each try's child has its own copy
            raise OSError(errno.ENETDOWN, "loopback refused by the test")

        with monkeypatch.context() as m:
            m.setattr(sb, "_loopback_up", refused)
            with pytest.raises(RemoteError, match="loopback refused by the test"):
                runner.run(os.urandom(8), spec, [], "0", "alice")
        assert calls == []  # it failed in the job's process, not here
        assert runner.run(os.urandom(8), spec, [], "0", "alice").exit_code == 0
    finally:
        blocks.close()


def test_a_session_process_runs_in_namespaces_of_its_own(stand_in_gpu_nodes: list[str]) -> None:
    """A session in a process of its own (session_processes on): its mount, PID, IPC, UTS and
    network namespaces are not the worker's, it is in a cgroup of its own, its /dev holds its one
    GPU's STAND-IN node, and the pid it reports is the one the VM sees."""
    with LocalCluster(workers=1, gpus_per_worker=2, heartbeat_ms=200, security="curve", pool_size=2,
                      dynamic_uid_base=UID_BASE, worker_args=["--session-processes", "on"]) as c, \
            client(c, c.client_keys("alice")) as a, a.session(gpu_milli=100, mem=1 << 20) as s:
        process = s.device_info()["process"]
        pid, worker = process["pid"], c.worker_procs["w0"].pid
        for ns in ("mnt", "pid", "ipc", "uts", "net"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/{worker}/ns/{ns}"), ns
        with open(f"/proc/{pid}/status") as f:
            assert f"Uid:\t{process['uid']}" in f.read()
        with open(f"/proc/{pid}/cgroup") as f:
            assert re.search(r"/session-[0-9a-f]{16}$", f.read(), re.M)  # the worker's cgroups (v1 here), its own
        dev = sorted(os.listdir(f"/proc/{pid}/root/dev"))
        gpu = s.device_info()["gpu"]["index"]
        assert [n for n in dev if n.startswith("nvidia")] == [f"nvidia{gpu}", "nvidiactl"], dev
        assert not os.listdir(f"/proc/{pid}/root/tmp")  # a private /tmp, not the VM's


def test_one_tenants_sessions_cannot_take_every_pool_user() -> None:
    """Sessions in processes of their own hold a pool user each: alice's sessions of 1 milli take
    at most her share (2 of 4), and bob's job runs at once beside them."""
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", pool_size=4,
                      dynamic_uid_base=UID_BASE, worker_args=["--session-processes", "on"]) as c, \
            client(c, c.client_keys("alice")) as a, client(c, c.client_keys("bob")) as b:
        row = admin_call(c.admin, "workers")[0]
        assert row["pool_users"] == 4
        with a.session(gpu_milli=1, mem=1 << 20), a.session(gpu_milli=1, mem=1 << 20):
            assert admin_call(c.admin, "workers")[0]["pool_free"] == 2
            with pytest.raises(Timeout):  # alice's third waits: her share is held
                a.session(gpu_milli=1, mem=1 << 20, timeout=2)
            started = time.monotonic()
            r = b.run(["id", "-u"], gpu_milli=1, timeout=20)
            assert r.exit_code == 0 and time.monotonic() - started < 10
