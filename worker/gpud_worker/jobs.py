"""Running a user's job program on the worker: the job sandbox.

This module owns everything between a validated ``JobSpec`` (PROTOCOL.md §5.3) and its
``JobOutcome``: the pool of unprivileged Unix users jobs run as (``UserPool``), the private working
directory, the scrubbed environment, resource limits, output capture, the time limit and the
killing of everything the job started (``JobRunner``). It has no sockets; the worker loop calls
``JobRunner.run`` from a thread and ships the outcome.

Isolation model (DESIGN.md §5):

- Running as root, a job always runs as a pool user (``gpud-job*``, never uid 0), holding one job
  at a time, with no supplementary groups, ``PR_SET_NO_NEW_PRIVS`` and per-user ``RLIMIT_NPROC``.
  Without root (development), jobs run as the daemon's own user and the pool is ignored.
- ``workroot`` is root-owned ``0711``: job users can reach their own directory but cannot list the
  others. Each job gets ``workroot/<job id hex>``, ``0700``, owned by its user, removed afterwards.
- The job leads its own session and process group; at the time limit or on cancel the group gets
  SIGTERM then, after a grace period, SIGKILL. After the leader exits the group is SIGKILLed
  anyway, and as root every process of the pool user is killed, which also catches processes that
  left the group with ``setsid()``. As root the daemon is made a child subreaper so those orphans
  are re-parented to it and reaped here (a zombie still counts against the user's
  ``RLIMIT_NPROC``).
- Output files are opened with ``O_NOFOLLOW|O_NONBLOCK`` relative to the directory's fd; only
  regular files owned by the job's user are returned (so a hard link to someone else's file is not),
  and a file bigger than ``max_output_file`` is omitted (logged), never truncated, so a client never
  receives a silently cut file; so is one that would take the files read before it past
  ``max_outputs`` together. When one is omitted so (``JobOutcome.oversize``), none is returned:
  the worker ends such a job TOO_LARGE, and reading or holding the others would be wasted (or,
  in a full hold, wait for room and end it BUSY). Outputs over ``hold.stage_above`` together are not read at all: they
  are copied into the worker's hold on disk (``gpud_worker.held_outputs``), out of its memory.

- With a ``sandbox`` (``gpud_worker.sandbox``, as root where namespaces can be made), the job runs
  in mount, PID, IPC, UTS and network namespaces of its own, entered by the forked child before it
  becomes the pool user: every mount read-only, private size-limited ``/tmp``, ``/var/tmp`` and
  ``/dev/shm``, its own ``/proc``, a ``/dev`` with only its GPUs' nodes, the work root, keys and
  configuration covered, its directory bound back at its path, loopback only unless the operator
  chose the host network. When its process ends, everything else in its namespaces dies with it.
  Without one ("rlimits only", said at start and in READY), a pool user's files in ``/tmp``,
  ``/var/tmp``, ``/dev/shm``, its SysV IPC objects and POSIX message queues are swept before the
  user serves again (``sandbox.sweep_uid``: only where a pool user can have left something).
- As root with ``dir_size``, the job's directory is a tmpfs of that size (its disk quota); a job
  that fills it gets a line on its stderr saying so. Where the kernel has them, its files get huge
  pages within their size (``huge=within_size``: a large staged input costs about half the CPU to
  write in 2 MiB pages than in 4 KiB ones, and a small file still takes no huge page).
- With ``cgroups`` (``gpud_worker.cgroups``: cgroup v2 delegated to the worker, else the host's v1
  hierarchies), each job runs in a cgroup of its own, entered before the job's program is executed:
  memory (the grant's ``host_mem``, else ``JobLimits.memory``), CPU (the grant's ``cpu_milli``),
  pids (``JobLimits.nproc``) and its devices: on v1 the GPUs it was not granted denied, on v2 a BPF
  device program (``gpud_worker.device_program``) that allows only its sandbox's ``/dev`` nodes
  (its own GPUs', by device number) and denies every other device; after the job the whole cgroup
  is killed and removed. The job's process itself says, on its status pipe, whether it entered
  its cgroup (``cgroups.enter``); the worker warns where it did not. Without them (not
  delegated, or any cgroup operation failing) the job runs with its rlimits only, logged.
- Session processes (``gpud_worker.session_host``) get the same: a pool user, namespaces, and a
  cgroup of their own (``make_cgroup``, ``session-<hex>``) with the limits and device fence a job
  of their grant gets, removed when the session ends.
- With ``mps`` (CUDA MPS runs on this GPU VM), the job's environment carries the MPS client limits
  of its grant: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``MpsSettings.environment``), and the pipe and log directories.

Not covered (docs/OPERATIONS.md, Tenant isolation): the kernel and the GPU are shared; there is no
user namespace, so a job reads what the VM leaves world-readable. Without a sandbox, GPU device nodes
are not restricted (``CUDA_VISIBLE_DEVICES`` steers CUDA, it does not fence it) except by a devices
cgroup (v1, or v2's device program), and the network and ``/proc`` are the VM's. Without cgroups there is no memory limit unless ``RLIMIT_AS`` is
set (off by default: CUDA needs large virtual address space). Without root, a process that calls
``setsid()`` can escape the kill (unless cgroups are delegated to that user), and there is no
sandbox, sweep or directory size limit.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import pathlib
import pwd
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import psutil

from gpud.errors import ConfigError, InvalidRequest, RemoteError, TooLarge
from gpud.protocol import JobSpec, check_file_name
from gpud.transfer import pwrite_all, read_capped
from gpud_worker.cgroups import JOB_PREFIX, JobCgroup, JobCgroups, JobCgroupsV1, enter, job_limits
from gpud_worker.device_program import job_rules
from gpud_worker.held_outputs import HeldOutputs, OutputHold
from gpud_worker.sandbox import (
    CGROUP_FAILED,
    SETUP_FAILED,
    Plan,
    Sandbox,
    job_report,
    job_status,
    mount_tmpfs,
    sweep_uid,
    unmount,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
HUGE_DIR_OPTIONS = ",huge=within_size"  # a job directory's tmpfs: 2 MiB pages for its large files
# Keys a job's ``env`` may not set: the runner owns them. CUDA_DEVICE_ORDER is pinned because it
# changes which physical GPUs the indices in CUDA_VISIBLE_DEVICES name.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})
# GPUD_*: the runner's; CUDA_MPS_*: MPS limits and directories, the worker's to set (a job could
# otherwise lift its share or point CUDA at another MPS daemon).
RESERVED_ENV_PREFIXES = ("GPUD_", "CUDA_MPS_")
_ENV_KEY_RE = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
MAX_JOB_ID_BYTES = 64
_JOB_DIR_RE = re.compile(rf"(?:[0-9a-f]{{2}}){{1,{MAX_JOB_ID_BYTES}}}\Z")

_READ_CHUNK = 64 * 1024
# Jobs started at once. A start is a fork() with a preexec_fn, which holds the GIL; a burst of
# them (a worker handed 128 jobs at once) would otherwise starve the worker's loop and its
# heartbeats for longer than the broker's liveness allows.
_STARTS = threading.BoundedSemaphore(2)
_POLL_S = 0.1  # reader poll interval and cancel-check interval
_READER_EOF_WAIT_S = 2.0  # after the kill, how long readers may take to reach EOF
_READER_DRAIN_S = 0.5  # then, after being told to stop, how long they may still drain
_REAP_TIMEOUT_S = (
    10.0  # waiting for a SIGKILLed leader (only a process stuck in the kernel takes long)
)
_SWEEP_TIMEOUT_S = 5.0  # killing and reaping the rest of a pool user's processes

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38


def _load_prctl() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    result: Callable[..., int] = fn
    return result


_prctl = _load_prctl()


def _prctl_set(option: int, value: int) -> None:
    """Call ``prctl(option, value, 0, 0, 0)``; raise OSError on failure (also in a forked child)."""
    if _prctl is None:
        raise OSError(errno.ENOSYS, "prctl is not available")
    if _prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """What a finished job produced (result fields of PROTOCOL.md §5.3)."""

    exit_code: int  # negative = killed by that signal (like subprocess)
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    files: list[tuple[str, bytes]]  # (name, content) in spec.outputs order; missing ones omitted
    user: str  # Unix user name it ran as
    oversize: tuple[str, ...] = ()  # outputs omitted for being over max_output_file
    held: HeldOutputs | None = None  # staged outputs (then ``files`` is empty): the caller closes it


@dataclass(frozen=True, slots=True)
class JobLimits:
    """Resource limits and timings applied to every job.

    Attributes:
        nofile: RLIMIT_NOFILE (open files per process).
        nproc: RLIMIT_NPROC, processes of the pool user; applied only as root (without root it
            would count the daemon's own processes).
        address_space: RLIMIT_AS in bytes, or None for unlimited (CUDA maps huge address ranges).
        cpu_slack: seconds of CPU time allowed beyond ``time_limit`` per process (RLIMIT_CPU).
        kill_grace: seconds between SIGTERM and SIGKILL at the time limit or on cancel.
        acquire_timeout: seconds to wait for a free pool user before failing the job.
        memory: ``memory.max`` of the job's cgroup, in bytes, when its grant names no ``host_mem``;
            None: no limit. Only with cgroups (``JobRunner(cgroups=...)``); ``nproc`` is also its
            ``pids.max`` there.
    """

    nofile: int = 1024
    nproc: int = 512
    address_space: int | None = None
    cpu_slack: float = 5.0
    kill_grace: float = 1.0
    acquire_timeout: float = 60.0
    memory: int | None = None


@dataclass(frozen=True, slots=True)
class JobGrant:
    """What the broker granted a job (DISPATCH ``grant``), as far as the sandbox enforces it.

    Attributes:
        gpu_milli: share of each granted GPU, in thousandths (MPS active thread percentage).
        mem: device memory per granted GPU, in bytes; 0: not limited (MPS pinned memory limit).
        gpus: how many GPUs were granted.
        cpu_milli: host CPU, thousandths of a core; 0: not limited (cgroup ``cpu.max``).
        host_mem: host memory in bytes; 0: the runner's default (cgroup ``memory.max``).
    """

    gpu_milli: int = 1000
    mem: int = 0
    gpus: int = 1
    cpu_milli: int = 0
    host_mem: int = 0

    @classmethod
    def from_wire(cls, grant: object) -> JobGrant:
        """From a DISPATCH ``grant`` map; absent or malformed fields keep their defaults."""
        if not isinstance(grant, dict):
            return cls()

        def count(key: str, default: int) -> int:
            value = grant.get(key, default)
            return value if type(value) is int and value >= 0 else default

        gpus = grant.get("gpus")
        return cls(
            gpu_milli=count("gpu_milli", 1000),
            mem=count("mem", 0),
            gpus=len(gpus) if isinstance(gpus, list) and gpus else 1,
            cpu_milli=count("cpu_milli", 0),
            host_mem=count("host_mem", 0),
        )


MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
MPS_DEFAULT_LOG_DIR = "/var/log/nvidia-mps"


def mps_thread_percentage(gpu_milli: int) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for a share of ``gpu_milli`` thousandths: 1 to 100."""
    return min(100, max(1, math.ceil(gpu_milli / 10)))


def mps_mem_limit(mems: Sequence[int]) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for ``mems[i]`` bytes on the client's device ``i``:
    ``"0=1024M,1=1024M"`` (NVIDIA's ``ordinal=size`` list), whole MiB rounded down, at least 1M;
    devices with 0 (no memory grant) are left out, so ``""`` means no limit."""
    return ",".join(f"{i}={max(1, mem >> 20)}M" for i, mem in enumerate(mems) if mem > 0)


@dataclass(frozen=True, slots=True)
class MpsSettings:
    """CUDA MPS on this worker: where its control daemon's pipes and logs are.

    MPS clients read their limits from their environment when CUDA starts; the ordinals of
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` are the client's own (after ``CUDA_VISIBLE_DEVICES``), so a
    job's first granted GPU is 0.
    """

    pipe_dir: str = MPS_DEFAULT_PIPE_DIR
    log_dir: str = MPS_DEFAULT_LOG_DIR

    def environment(self, gpu_milli: int, mems: Sequence[int]) -> dict[str, str]:
        """The MPS variables of a client granted ``gpu_milli`` of each GPU and ``mems`` bytes."""
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(mps_thread_percentage(gpu_milli)),
        }
        limit = mps_mem_limit(mems)
        if limit:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = limit
        return env


def mps_settings(pipe_dir: str, log_dir: str, environ: Mapping[str, str]) -> MpsSettings:
    """The MPS directories: as configured, else the daemon's own ``CUDA_MPS_*_DIRECTORY``
    variables, else NVIDIA's defaults."""
    return MpsSettings(
        pipe_dir=pipe_dir or environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIR,
        log_dir=log_dir or environ.get("CUDA_MPS_LOG_DIRECTORY") or MPS_DEFAULT_LOG_DIR,
    )


class UserPool:
    """Pool of unprivileged Unix users for jobs: every user whose name starts with ``prefix``.

    Users with uid 0 or primary gid 0 are never taken. A user serves one job at a time; ``acquire``
    prefers a user that last served the same tenant, then one that never served anyone, then the
    one free longest. The user list is read once, at construction.
    """

    def __init__(self, prefix: str = "gpud-job", uids: range | None = None) -> None:
        """Users named ``prefix*``; or, with ``uids``, dynamic users: those numeric uids (and the
        same gids), which must belong to no account (like systemd's DynamicUser=)."""
        self.prefix = prefix
        users: list[pwd.struct_passwd] = []
        seen: set[int] = set()
        entries = sorted(pwd.getpwall(), key=lambda p: p.pw_name) if uids is None else _dynamic_users(prefix, uids)
        for entry in entries:
            if not entry.pw_name.startswith(prefix):
                continue
            if entry.pw_uid == 0 or entry.pw_gid == 0:
                log.warning("pool user %s has uid or gid 0: not used", entry.pw_name)
                continue
            if entry.pw_uid in seen:
                log.warning(
                    "pool user %s shares uid %d with another: not used", entry.pw_name, entry.pw_uid
                )
                continue
            seen.add(entry.pw_uid)
            users.append(entry)
        self._users = {u.pw_name: u for u in users}
        self._free: list[str] = [u.pw_name for u in users]  # longest free first
        self._last_tenant: dict[str, str] = {}
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._users)

    def acquire(self, tenant: str, timeout: float) -> pwd.struct_passwd:
        """Take a free user for ``tenant``, waiting up to ``timeout`` seconds.

        Raises:
            RemoteError: the pool is empty, or no user became free in time.
        """
        if not self._users:
            raise RemoteError(
                f"no pool users named {self.prefix}*: create them (systemd/gpud-sysusers.conf)"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                name = self._pick(tenant)
                if name is not None:
                    self._free.remove(name)
                    self._last_tenant[name] = tenant
                    return self._users[name]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RemoteError(
                        f"all {len(self._users)} job users are busy: none free within {timeout:g} s"
                    )
                self._cond.wait(remaining)

    def _pick(self, tenant: str) -> str | None:
        for name in self._free:
            if self._last_tenant.get(name) == tenant:
                return name
        for name in self._free:
            if name not in self._last_tenant:
                return name
        return self._free[0] if self._free else None

    def release(self, user: pwd.struct_passwd) -> None:
        """Give back a user taken with ``acquire``; its processes must be gone already."""
        with self._cond:
            if user.pw_name not in self._users or user.pw_name in self._free:
                raise ValueError(f"user {user.pw_name!r} is not held from this pool")
            self._free.append(user.pw_name)
            self._cond.notify_all()


def _dynamic_users(prefix: str, uids: range) -> list[pwd.struct_passwd]:
    out = []
    for uid in uids:
        try:
            owner = pwd.getpwuid(uid)
        except KeyError:
            out.append(pwd.struct_passwd((f"{prefix}{uid}", "x", uid, uid, "gpud dynamic job user", "/nonexistent", "/usr/sbin/nologin")))
        else:
            log.warning("uid %d belongs to %s: not used as a dynamic job user", uid, owner.pw_name)
    return out


class _Capture:
    """Drains one pipe in a thread, keeping the first ``cap`` bytes and discarding the rest.

    The thread owns the pipe and closes it when it ends, so its fd is never closed under it.
    """

    def __init__(self, pipe: IO[bytes], cap: int, name: str) -> None:
        self._pipe = pipe
        self._cap = cap
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.truncated = False
        self._thread = threading.Thread(target=self._pump, name=name, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            fd = self._pipe.fileno()
            os.set_blocking(fd, False)
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            stop_by: float | None = None
            while True:
                if self._stop.is_set():
                    if stop_by is None:
                        stop_by = time.monotonic() + _READER_DRAIN_S
                    elif time.monotonic() >= stop_by:
                        return
                if not poller.poll(_POLL_S * 1000):
                    if self._stop.is_set():
                        return
                    continue
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    return
                self._keep(chunk)
        except OSError as exc:
            log.warning("job output reader %s failed: %s", self._thread.name, exc)
        finally:
            self._pipe.close()

    def _keep(self, chunk: bytes) -> None:
        with self._lock:
            room = self._cap - len(self._buf)
            if room > 0:
                self._buf += chunk[:room]
            if len(chunk) > room:
                self.truncated = True

    def finish(self) -> bytes:
        """Wait for EOF (bounded: an escaped process may hold the pipe); return what was kept."""
        self._thread.join(_READER_EOF_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "job output pipe %s still open after the kill: stop reading", self._thread.name
            )
            self._stop.set()
            self._thread.join(_READER_DRAIN_S + 2 * _POLL_S + 1.0)
        with self._lock:
            return bytes(self._buf)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _exited(pid: int) -> bool:
    """True once ``pid`` (our child) has exited; it is left a zombie so its pid stays reserved."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait_exit(pid: int, deadline: float, cancel: threading.Event | None) -> bool:
    """Wait for child ``pid`` to exit (True), or for ``deadline`` or ``cancel`` (False)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        pause = 0.001
        while True:
            if _exited(pid):
                return True
            now = time.monotonic()
            if now >= deadline or (cancel is not None and cancel.is_set()):
                return False
            step = deadline - now
            if cancel is not None:
                step = min(step, _POLL_S)
            if pidfd is not None:
                poller.poll(math.ceil(step * 1000))
            else:
                time.sleep(min(step, pause))
                pause = min(pause * 2, 0.05)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _full(dfd: int) -> bool:
    """Whether the file system of directory ``dfd`` has no free block left."""
    try:
        return os.fstatvfs(dfd).f_bavail == 0
    except OSError:
        return False


def _clamped(res: int, want: int) -> tuple[int, int]:
    """``(want, want)`` lowered to the current hard limit, so an unprivileged child can set it."""
    hard = resource.getrlimit(res)[1]
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    return want, want


class JobRunner:
    """Runs jobs in private directories as pool users (as root) or as the current user.

    Constructing it as root makes the process a child subreaper (``PR_SET_CHILD_SUBREAPER``):
    processes a job orphans are re-parented to the daemon, and the runner reaps those of its pool
    users after each job.

    Args:
        workroot: directory holding the per-job directories; created if missing, made root-owned
            ``0711`` as root (``0700`` otherwise). It must not be a symlink, and it belongs to
            this runner: directories with job-id names found there at construction are removed
            as leftovers of a crash.
        pool: users jobs run as; required as root, ignored otherwise.
        max_output_file: output files bigger than this many bytes are omitted from the outcome.
        max_outputs: likewise each file that would take those read before it past this many
            bytes together (None: no bound on the total).
        limits: resource limits and timings for every job.
        cgroups: where jobs get cgroups of their own (``JobCgroups.setup``); None: no cgroups.
        mps: CUDA MPS settings where MPS runs on this worker; None: no MPS variables.
        sandbox: the namespaces jobs and session processes run in (``gpud_worker.sandbox``);
            None: none ("rlimits only").
        gpu_minors: GPU uuid -> minor number of its ``/dev/nvidiaN`` (default: its index).
        dir_size: as root, each job directory is a tmpfs of this many bytes (its size limit);
            0: a plain directory, not limited.
        hold: where outputs over its ``stage_above`` together are held (``JobOutcome.held``)
            instead of read; default: in ``workroot``, 16 GiB at most.
    """

    def __init__(
        self,
        workroot: pathlib.Path,
        pool: UserPool | None = None,
        max_output_file: int = 64 << 20,
        *,
        limits: JobLimits | None = None,
        cgroups: JobCgroups | JobCgroupsV1 | None = None,
        mps: MpsSettings | None = None,
        sandbox: Sandbox | None = None,
        gpu_minors: Mapping[str, int] | None = None,
        dir_size: int = 0,
        max_outputs: int | None = None,
        hold: OutputHold | None = None,
    ) -> None:
        self.workroot = pathlib.Path(workroot).absolute()
        self.sandbox = sandbox if sandbox is not None and sandbox.active else None
        self.gpu_minors = dict(gpu_minors or {})
        self._root = os.geteuid() == 0
        self.dir_size = dir_size if self._root else 0
        self.pool = pool
        self.max_output_file = max_output_file
        self.max_outputs = max_outputs
        self.limits = limits if limits is not None else JobLimits()
        self.cgroups = cgroups
        self.mps = mps
        self.pooled_sessions = False  # set when session processes take pool users (SessionHosts)
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self._dir_options = ""  # what else a job directory's tmpfs is mounted with (_check_dir_size)
        self._prepare_workroot()
        self.hold = hold if hold is not None else OutputHold(self.workroot)
        if self.dir_size:
            self._check_dir_size()
        if self._root:
            try:
                _prctl_set(_PR_SET_CHILD_SUBREAPER, 1)
            except OSError as exc:
                log.warning(
                    "cannot become a child subreaper (%s): orphaned job processes go to init", exc
                )
            if pool is None or len(pool) == 0:
                prefix = getattr(pool, "prefix", None)
                log.error("running as root without job users%s: every job will be refused; create them "
                          "(systemd/gpud-sysusers.conf), or run jobs under dynamic uids that belong to no "
                          "account with --job-uids FIRST-LAST ([worker] job_uids)",
                          f" (no pool users named {prefix}*)" if prefix else "")

    def _check_dir_size(self) -> None:
        """Whether job directories can be tmpfs of their own here, and with huge pages; if not,
        say so and do without."""
        probe = self.workroot / ".gpud-size-probe"
        try:
            os.makedirs(probe, 0o700, exist_ok=True)
            for extra in (HUGE_DIR_OPTIONS, ""):  # a kernel without huge tmpfs pages refuses the option
                try:
                    mount_tmpfs(str(probe), "size=4k,mode=0700" + extra)
                except OSError:
                    if not extra:
                        raise
                    continue
                unmount(str(probe))
                self._dir_options = extra
                break
        except OSError as exc:
            log.warning("job directories cannot be tmpfs of their own here (%s): job_dir_size %d is not enforced, "
                        "a job's directory is limited only by its file system", exc, self.dir_size)
            self.dir_size = 0
        finally:
            try:
                os.rmdir(probe)
            except OSError:
                pass

    def _prepare_workroot(self) -> None:
        root = self.workroot
        root.mkdir(parents=True, exist_ok=True, mode=0o711 if self._root else 0o700)
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"job workroot {root} is not a directory (or is a symlink)")
        if self._root:
            os.chown(root, 0, 0)
            os.chmod(root, 0o711)
            for parent in root.parents:
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    log.warning(
                        "job users cannot reach %s: %s is not searchable by others", root, parent
                    )
                    break
        else:
            os.chmod(root, 0o700)
        for entry in os.listdir(root):  # left by a crash; only names this runner makes
            if _JOB_DIR_RE.match(entry):
                log.info("removing stale job directory %s", root / entry)
                self._remove(root / entry)

    # -- the job ------------------------------------------------------------------------------

    def run(
        self,
        job_id: bytes,
        spec: JobSpec,
        inputs: Sequence[Buffer],
        visible_devices: str,
        tenant: str,
        cancel: threading.Event | None = None,
        grant: JobGrant | None = None,
        begin: Callable[[], None] | None = None,
        gpus: Sequence[str] = (),
    ) -> JobOutcome:
        """Run one job to completion and return its outcome.

        Args:
            job_id: the job's id; its hex form names the working directory and ``GPUD_JOB_ID``.
            spec: the validated request.
            inputs: contents of ``spec.files``, in order (bytes, memoryview, zmq.Frame, ...).
            visible_devices: the value of ``CUDA_VISIBLE_DEVICES``: exactly the granted GPUs.
            tenant: who the job is for; the pool prefers the user that last ran that tenant.
            cancel: when set, the job is killed like at its time limit (``timed_out`` stays False).
            grant: what the broker granted (MPS limits, cgroup limits); None: a whole GPU, no
                memory or CPU figures.
            begin: called once everything is ready and the job's turn to start has come, just
                before its program starts; it returns when the program may start (the broker's
                GO, PROTOCOL.md §4.4) and raises when it must not (the runner then cleans up and
                lets that exception through).
            gpus: the uuids of the granted GPUs: their device nodes are the only ones in the
                sandbox's ``/dev`` (``gpu_minors``).

        Raises:
            InvalidRequest: the spec or inputs are malformed (reserved env key, count mismatch).
            RemoteError: the job could not be set up (no job user, directory, fork failure).

        A program that cannot be executed is an outcome, not an error: exit code 127 (not found)
        or 126 (other), with the reason on stderr, as a shell does.
        """
        hexid = self._check(job_id, spec, inputs, visible_devices)
        user = self._acquire_user(tenant)
        try:
            with self._claim(hexid):
                workdir = self.workroot / hexid
                try:
                    dfd = self._make_workdir(workdir, user, spec, inputs)
                    try:
                        granted = self.minors(gpus)
                        plan = None
                        if self.sandbox is not None:
                            plan = self.sandbox.plan(granted, str(workdir), dfd)
                        job_grant = grant if grant is not None else JobGrant()
                        with self._cgroup(hexid, job_grant, granted) as cgroup, self._status_pipe(plan, cgroup) as status:
                            return self._execute(
                                hexid, spec, workdir, dfd, user, visible_devices, cancel,
                                job_grant, cgroup, begin, plan, status, tenant,
                            )
                    finally:
                        os.close(dfd)
                finally:
                    self._remove(workdir)
        finally:
            if self._root and self.pool is not None:
                self._release_user(user)

    def minors(self, gpus: Sequence[str]) -> list[int]:
        """The minor numbers of GPUs ``gpus`` (uuids) that name their ``/dev/nvidiaN``."""
        return [self.gpu_minors[u] for u in gpus if u in self.gpu_minors]

    @property
    def isolation(self) -> str:
        """The isolation level jobs and session processes run with (``gpud_worker.sandbox``)."""
        return "namespaces" if self.sandbox is not None else "rlimits only"

    def ready_fields(self) -> dict[str, object]:
        """What READY says of this runner (PROTOCOL.md §4): ``isolation``, ``job_network`` and,
        where jobs run as pool users, ``pool_users`` and the kinds of work that hold one."""
        fields: dict[str, object] = {"isolation": self.isolation,
                                     "job_network": self.sandbox.network if self.sandbox is not None else "host"}
        if self._root and self.pool is not None:
            fields["pool_users"] = len(self.pool)
            fields["pool_kinds"] = ["job", "session"] if self.pooled_sessions else ["job"]
        return fields

    def _release_user(self, user: pwd.struct_passwd) -> None:
        """Give ``user`` back to the pool once nothing it owned is left for the next tenant: its
        processes are killed already; in a sandbox its files outside the job directory, SysV IPC
        objects and POSIX message queues died with its namespaces, otherwise they are swept here."""
        assert self.pool is not None
        try:
            if self.sandbox is None:
                sweep_uid(user.pw_uid)
        finally:
            self.pool.release(user)

    def _check(
        self, job_id: bytes, spec: JobSpec, inputs: Sequence[Buffer], visible_devices: str
    ) -> str:
        if not 0 < len(job_id) <= MAX_JOB_ID_BYTES:
            raise InvalidRequest(f"job id must be 1 to {MAX_JOB_ID_BYTES} bytes")
        if not spec.argv or any("\0" in a for a in spec.argv):
            raise InvalidRequest("field 'argv' must be a non-empty list of strings without NUL")
        for key, value in spec.env.items():
            if not _ENV_KEY_RE.match(key) or "\0" in value:
                raise InvalidRequest(f"bad environment entry {key!r}")
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise InvalidRequest(
                    f"environment variable {key} is set by gpud and cannot be overridden"
                )
        for name in (*spec.files, *spec.outputs):
            check_file_name(name)
        if len(set(spec.files)) != len(spec.files):
            raise InvalidRequest("field 'files' names a file twice")
        if len(inputs) != len(spec.files):
            raise InvalidRequest(
                f"'files' names {len(spec.files)} files but {len(inputs)} inputs came"
            )
        if "\0" in visible_devices:
            raise InvalidRequest("bad CUDA_VISIBLE_DEVICES value")
        return bytes(job_id).hex()

    def _acquire_user(self, tenant: str) -> pwd.struct_passwd:
        if not self._root:
            return pwd.getpwuid(os.getuid())
        if self.pool is None:
            raise RemoteError(
                "the worker runs as root but has no pool of job users; jobs never run as root"
            )
        user = self.pool.acquire(tenant, self.limits.acquire_timeout)
        if user.pw_uid == 0:  # UserPool never hands out uid 0; this guards a substitute pool
            self.pool.release(user)
            raise RemoteError(f"job user {user.pw_name} has uid 0: refusing to run a job as root")
        return user

    def lease_user(self, tenant: str) -> pwd.struct_passwd | None:
        """A pool user held for ``tenant`` until ``end_lease``, for work that is not a job (a
        session's process, ``gpud_worker.session_host``); None without root, where such work runs
        as this process's user. RemoteError as for a job: no pool, or no user free in time."""
        return self._acquire_user(tenant) if self._root else None

    def end_lease(self, user: pwd.struct_passwd | None) -> None:
        """Kill whatever still runs as ``user`` (taken with ``lease_user``) and give it back."""
        if user is None or not self._root or self.pool is None:
            return
        try:
            self._kill_user_processes(user)
        finally:
            self._release_user(user)

    @contextmanager
    def _claim(self, hexid: str) -> Iterator[None]:
        with self._lock:
            if hexid in self._active:
                raise RemoteError(f"job {hexid} is already running on this worker")
            self._active.add(hexid)
        try:
            yield
        finally:
            with self._lock:
                self._active.discard(hexid)

    def _make_workdir(
        self,
        workdir: pathlib.Path,
        user: pwd.struct_passwd,
        spec: JobSpec,
        inputs: Sequence[Buffer],
    ) -> int:
        """Create the job directory with its input files; return an fd of the directory."""
        if os.path.lexists(workdir):
            log.warning("job directory %s exists already: replacing it", workdir)
            self._remove(workdir)
        try:
            os.mkdir(workdir, 0o700)
            if self.dir_size:
                mount_tmpfs(str(workdir), f"size={self.dir_size},mode=0700,uid={user.pw_uid},gid={user.pw_gid}"
                            f"{self._dir_options}")
            os.chmod(workdir, 0o700)
            if self._root:
                os.chown(workdir, user.pw_uid, user.pw_gid)
            dfd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise RemoteError(f"cannot create job directory {workdir}: {exc}") from exc
        try:
            for name, data in zip(spec.files, inputs, strict=True):
                self._write_input(dfd, name, data, user)
        except OSError as exc:
            os.close(dfd)
            if exc.errno == errno.ENOSPC and self.dir_size:  # the job's own size: no other worker of this size helps
                raise TooLarge(f"the job's input files do not fit its directory, limited to {self.dir_size} bytes "
                               "(the worker's job_dir_size)") from exc
            raise RemoteError(f"cannot write job input files: {exc}") from exc
        return dfd

    def _write_input(self, dfd: int, name: str, data: Buffer, user: pwd.struct_passwd) -> None:
        # 0700 so an uploaded program can be run directly (./prog); the directory is private anyway.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o700, dir_fd=dfd)
        try:
            if self._root:
                os.fchown(fd, user.pw_uid, user.pw_gid)
            copy_to = getattr(data, "copy_to", None)
            if copy_to is not None:  # a fetched staged input (gpud_worker.fetch): written as its chunks come
                copy_to(fd)
                return
            with memoryview(data) as raw:
                pwrite_all(fd, raw if raw.ndim == 1 and raw.itemsize == 1 else raw.cast("B"), 0)
        finally:
            os.close(fd)

    def _environment(
        self,
        hexid: str,
        spec: JobSpec,
        workdir: pathlib.Path,
        user: pwd.struct_passwd,
        devices: str,
        grant: JobGrant,
    ) -> dict[str, str]:
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": str(workdir),
            "USER": user.pw_name,
            "LOGNAME": user.pw_name,
            "LANG": "C.UTF-8",
            "TMPDIR": str(workdir),
        }
        env.update(spec.env)
        env["CUDA_VISIBLE_DEVICES"] = devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["GPUD_JOB_ID"] = hexid
        if self.mps is not None:
            env.update(self.mps.environment(grant.gpu_milli, [grant.mem] * grant.gpus))
        return env

    def _child_setup(
        self, spec: JobSpec, user: pwd.struct_passwd, cgroup: JobCgroup | None = None, plan: Plan | None = None,
        status_fd: int = -1,
    ) -> Callable[[], None]:
        """Build the preexec function: it runs in the forked child, before the job's program.

        As root it first enters the job's cgroup (``cgroups.enter``: writing ``0`` to its
        ``cgroup.procs``, one per v1 hierarchy: root's right, so before anything else), and says on
        ``status_fd`` if it is not in it after (the worker's warning), then enters its sandbox's
        namespaces (``plan``: only the process that runs the job returns), then becomes the job user itself
        (no supplementary groups), then sets the death signal (which a change of uid would clear),
        ``PR_SET_NO_NEW_PRIVS``, the sandbox's seccomp filter (no user namespaces) and the resource
        limits.
        """
        limits = self.limits
        cpu = math.ceil(spec.time_limit) + math.ceil(limits.cpu_slack)
        rlimits = [
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NOFILE, _clamped(resource.RLIMIT_NOFILE, limits.nofile)),
            (resource.RLIMIT_CPU, _clamped(resource.RLIMIT_CPU, cpu)),
        ]
        if self._root:
            rlimits.append((resource.RLIMIT_NPROC, _clamped(resource.RLIMIT_NPROC, limits.nproc)))
        if limits.address_space is not None:
            rlimits.append((resource.RLIMIT_AS, _clamped(resource.RLIMIT_AS, limits.address_space)))
        use_prctl = _prctl is not None
        switch = self._root
        uid, gid = user.pw_uid, user.pw_gid

        cgroup_fds = cgroup.procs_fds if cgroup is not None else []
        cgroup_name = cgroup.name if cgroup is not None else ""

        def setup() -> None:
            try:
                set_up()
            except BaseException as exc:  # for the worker to say why (subprocess says only that it failed)
                if status_fd >= 0:
                    os.write(status_fd, f"{SETUP_FAILED}{exc}".encode(errors="replace")[:500] + b"\n")
                raise

        def set_up() -> None:
            if cgroup_fds:
                why = enter(cgroup_fds, cgroup_name)
                if why and status_fd >= 0:  # it runs all the same, with its rlimits
                    os.write(status_fd, f"{CGROUP_FAILED}{why}".encode(errors="replace")[:300] + b"\n")
            if plan is not None:
                plan.enter(status_fd=status_fd)
            if switch:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            if use_prctl:
                # Die with the daemon's thread that started us; never gain privileges via exec.
                _prctl_set(_PR_SET_PDEATHSIG, signal.SIGKILL)
                _prctl_set(_PR_SET_NO_NEW_PRIVS, 1)
            if plan is not None:
                plan.deny_user_namespaces()
            for res, value in rlimits:
                resource.setrlimit(res, value)

        return setup

    @contextmanager
    def _cgroup(self, hexid: str, grant: JobGrant, granted: Sequence[int] = ()) -> Iterator[JobCgroup | None]:
        """The job's cgroup (None without cgroups) while it runs; its OOM kills are logged and it
        is removed after."""
        cgroup = self.make_cgroup(hexid, grant, granted)
        try:
            yield cgroup
        finally:
            if cgroup is not None:
                oom = cgroup.oom_kills()
                if oom:
                    log.info("job %s: %d process(es) killed for its memory limit", hexid, oom)
                cgroup.remove()

    def _pid_namespace(self, plan: Plan | None) -> AbstractContextManager[None]:
        """Where a sandboxed job's process is forked: PID 1 of a new PID namespace."""
        return self.sandbox.pid_namespace() if plan is not None and self.sandbox is not None else nullcontext()

    @staticmethod
    @contextmanager
    def _status_pipe(plan: Plan | None, cgroup: JobCgroup | None) -> Iterator[tuple[int, int] | None]:
        """The pipe from a sandboxed job's process or one with a cgroup (``sandbox.job_report``:
        whether it entered its cgroup, why its setup failed, its PID 1's wait status): its read end
        is closed after the job, its write end by ``_execute`` once the job has started."""
        status = os.pipe2(os.O_CLOEXEC) if plan is not None or cgroup is not None else None
        try:
            yield status
        finally:
            if status is not None:
                os.close(status[0])

    def make_cgroup(self, hexid: str, grant: JobGrant, granted: Sequence[int] = (),
                    prefix: str = JOB_PREFIX) -> JobCgroup | None:
        """A cgroup for job ``hexid`` (or, with ``prefix`` ``SESSION_PREFIX``, a session process;
        ``gpud_worker.session_host``), limited by ``grant``; its devices fenced to the GPUs of minors
        ``granted``: on v1 the others denied, on v2 a device program of the process's own nodes
        only. None without cgroups, or where it cannot be made (logged)."""
        if self.cgroups is None:
            return None
        limits = job_limits(grant.host_mem, grant.cpu_milli, self.limits.memory, self.limits.nproc)
        if isinstance(self.cgroups, JobCgroupsV1):
            return self.cgroups.create(hexid, limits, sorted(set(self.gpu_minors.values()) - set(granted)), prefix)
        if self.cgroups.device_fence:
            return self.cgroups.create(hexid, limits, job_rules(granted), prefix)
        return self.cgroups.create(hexid, limits, prefix=prefix)

    def _execute(
        self,
        hexid: str,
        spec: JobSpec,
        workdir: pathlib.Path,
        dfd: int,
        user: pwd.struct_passwd,
        devices: str,
        cancel: threading.Event | None,
        grant: JobGrant,
        cgroup: JobCgroup | None,
        begin: Callable[[], None] | None = None,
        plan: Plan | None = None,
        status: tuple[int, int] | None = None,
        tenant: str = "",
    ) -> JobOutcome:
        started = time.monotonic()
        try:
            with _STARTS:
                if begin is not None:  # its turn has come: only now may it have begun
                    begin()
                    started = time.monotonic()  # its time limit counts from its GO
                with self._pid_namespace(plan):
                    proc = subprocess.Popen(
                        list(spec.argv),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=workdir,
                        env=self._environment(hexid, spec, workdir, user, devices, grant),
                        start_new_session=True,
                        close_fds=True,
                        umask=0o077,
                        preexec_fn=self._child_setup(
                            spec, user, cgroup, plan, status[1] if status is not None else -1,
                        ),
                    )
        except OSError as exc:
            if exc.filename != spec.argv[0]:
                raise RemoteError(f"cannot start job {hexid}: {exc}") from exc
            code = 127 if exc.errno == errno.ENOENT else 126
            log.info("job %s: cannot execute %r: %s", hexid, spec.argv[0], exc.strerror)
            message = f"gpud: cannot execute {spec.argv[0]!r}: {exc.strerror}\n".encode()
            return JobOutcome(code, False, b"", message, False, False, [], user.pw_name)
        except subprocess.SubprocessError as exc:  # the child's setup failed before its exec
            why = job_report(status[0]).setup if status is not None else ""  # what subprocess does not say
            log.error("job %s: its process setup failed: %s", hexid, why or exc)
            raise RemoteError(f"cannot start job {hexid}: {why or exc}") from exc
        finally:
            if cgroup is not None:
                cgroup.close_fd()
            if status is not None:
                os.close(status[1])

        assert proc.stdout is not None and proc.stderr is not None
        out = _Capture(proc.stdout, spec.output_cap, f"job-{hexid[:8]}-stdout")
        err = _Capture(proc.stderr, spec.output_cap, f"job-{hexid[:8]}-stderr")
        log.info("job %s started as %s (pid %d): %s", hexid, user.pw_name, proc.pid, spec.argv[0])
        timed_out = False
        try:
            deadline = started + spec.time_limit
            if not _wait_exit(proc.pid, deadline, cancel):
                timed_out = not (cancel is not None and cancel.is_set())
                log.info(
                    "job %s: %s: killing its process group",
                    hexid,
                    "time limit" if timed_out else "cancelled",
                )
                _killpg(proc.pid, signal.SIGTERM)
                _wait_exit(proc.pid, time.monotonic() + self.limits.kill_grace, None)
        finally:
            # The leader is a zombie or still running: its pid, the group id, cannot be reused yet.
            _killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            try:
                exit_code = proc.wait(_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("job %s: leader pid %d survives SIGKILL", hexid, proc.pid)
                exit_code = -signal.SIGKILL
            report = job_report(status[0]) if status is not None else None
            if report is not None and plan is not None:  # the leader is the job's PID 1, which ends by no signal
                exit_code = job_status(report.status, exit_code)
            if report is not None and report.cgroup and cgroup is not None:
                log.warning("job %s did not enter its cgroup %s (%s): it ran without cgroup limits", hexid,
                            cgroup.path, report.cgroup)
            if cgroup is not None:  # everything the job started, whatever its session or user
                cgroup.kill()
            if self._root:  # also what left the group (setsid) and would hold the pipes open
                self._kill_user_processes(user)
        stdout, stderr = out.finish(), err.finish()
        if self.dir_size and _full(dfd):
            log.info("job %s filled its directory (%d bytes)", hexid, self.dir_size)
            note = f"gpud: the job directory is full: it is limited to {self.dir_size} bytes (job_dir_size)\n".encode()
            stderr = stderr[: max(0, spec.output_cap - len(note))] + note
        oversize: list[str] = []
        files, held = self._collect_outputs(hexid, spec, dfd, user, oversize, tenant)
        log.info(
            "job %s finished: exit %d%s after %.2f s",
            hexid,
            exit_code,
            " (time limit)" if timed_out else "",
            time.monotonic() - started,
        )
        return JobOutcome(
            exit_code=exit_code,
            timed_out=timed_out,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            files=files,
            user=user.pw_name,
            oversize=tuple(oversize),
            held=held,
        )

    def _collect_outputs(
        self, hexid: str, spec: JobSpec, dfd: int, user: pwd.struct_passwd, oversize: list[str], tenant: str = ""
    ) -> tuple[list[tuple[str, bytes]], HeldOutputs | None]:
        """The job's output files: read (inline), or, over ``hold.stage_above`` together, copied
        into the worker's hold (``gpud_worker.held_outputs``) without passing through its memory."""
        found: list[tuple[str, int, int]] = []  # (name, fd, size) of the files to return
        left = self.max_outputs  # of the bound on the files together, what those taken so far leave
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            for name in dict.fromkeys(spec.outputs):
                try:
                    fd = os.open(name, flags, dir_fd=dfd)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # ELOOP: a symlink
                    log.info("job %s: output %s not returned: %s", hexid, name, exc.strerror)
                    continue
                try:
                    st = os.fstat(fd)
                except OSError as exc:
                    log.warning("job %s: cannot read output %s: %s", hexid, name, exc)
                    os.close(fd)
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_uid != user.pw_uid:
                    log.info("job %s: output %s is not a regular file of the job: skipped", hexid, name)
                    os.close(fd)
                    continue
                cap = self.max_output_file if left is None else min(self.max_output_file, left)
                if st.st_size > cap:  # over the cap alone, or with the files taken before it
                    log.warning("job %s: output %s has %d bytes, over the cap (%d): skipped", hexid, name,
                                st.st_size, cap)
                    oversize.append(name)
                    os.close(fd)
                    continue
                if left is not None:
                    left -= st.st_size
                found.append((name, fd, st.st_size))
            if oversize:  # the job ends TOO_LARGE: none of its outputs is read, nor copied into the hold
                return [], None  # (where it might also wait for room, and end BUSY instead)
            # The job's processes are all gone: its files keep the sizes they have now.
            if sum(size for _, _, size in found) > self.hold.stage_above:
                return [], self.hold.take(hexid, tenant, [name for name, _, _ in found],
                                          [(fd, size) for _, fd, size in found])
            files: list[tuple[str, bytes]] = []
            for name, fd, size in found:
                try:
                    data = read_capped(fd, size)
                except OSError as exc:
                    log.warning("job %s: cannot read output %s: %s", hexid, name, exc)
                    continue
                if data is None:
                    log.warning("job %s: output %s grew while it was read: skipped", hexid, name)
                    oversize.append(name)
                    continue
                files.append((name, data))
            return files, None
        finally:
            for _, fd, _ in found:
                os.close(fd)

    # -- cleanup ------------------------------------------------------------------------------

    def _kill_user_processes(self, user: pwd.struct_passwd) -> None:
        """Kill every process of pool user ``user`` and reap those re-parented to us (root only)."""
        uid = user.pw_uid
        # First, race-free: kill(-1) sent *as the user* reaches exactly its processes, and a process
        # with SIGKILL pending cannot fork, so nothing new appears after it.

        def kill_all() -> None:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass

        try:
            subprocess.run(
                [shutil.which("true") or "/bin/true"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                user=uid,
                group=user.pw_gid,
                extra_groups=[],
                preexec_fn=kill_all,
                timeout=_SWEEP_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("kill helper for %s: %s", user.pw_name, exc)  # EAGAIN at exec: already killed
        # Then verify with the process table: kill leftovers, reap our zombies, wait for the rest.
        me = os.getpid()
        deadline = time.monotonic() + _SWEEP_TIMEOUT_S
        while True:
            mine = [
                p
                for p in psutil.process_iter(["uids", "ppid", "status"])
                if p.info["uids"] is not None and uid in p.info["uids"]
            ]
            pids = {p.pid for p in mine}
            pending = 0
            for proc in mine:
                if proc.info["status"] != psutil.STATUS_ZOMBIE:
                    pending += 1
                    try:
                        proc.kill()
                    except psutil.Error:
                        pass
                elif proc.info["ppid"] == me:
                    pending += 1
                    try:
                        os.waitpid(proc.pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                elif proc.info["ppid"] in pids:
                    pending += 1  # its parent is dying: it will be re-parented to us
            if not pending:
                return
            if time.monotonic() >= deadline:
                log.error("%d processes of job user %s survive the kill", pending, user.pw_name)
                return
            time.sleep(0.02)

    def _remove(self, path: pathlib.Path) -> None:
        if self._root and os.path.isdir(path) and not os.path.islink(path):
            unmount(str(path))  # a job directory of its own size (dir_size), or not mounted at all
        if os.path.islink(path) or not os.path.isdir(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        try:
            shutil.rmtree(path)
            return
        except OSError as exc:
            if self._root:
                log.error("cannot remove job directory %s: %s", path, exc)
                return
        # Without root a job can leave a directory without write permission: restore it first.
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                sub = os.path.join(dirpath, name)
                if not os.path.islink(sub):
                    os.chmod(sub, 0o700)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.error("cannot remove job directory %s", path)
