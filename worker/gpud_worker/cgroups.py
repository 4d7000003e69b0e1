"""cgroup v2 limits for jobs: one cgroup per job below a delegated cgroup of the worker.

The first half is pure: parsing ``/proc/self/mountinfo``, ``/proc/self/cgroup`` and
``cgroup.controllers``, and the limit values a job's cgroup gets from its grant
(``limit_files``). The second half, ``JobCgroups``, does the file-system work and is used by
``gpud_worker.jobs.JobRunner``:

- ``JobCgroups.setup`` picks the base: a configured ``cgroup_parent`` (a directory of the cgroup v2
  hierarchy), or else the worker's own cgroup where the host runs the unified (pure v2) hierarchy.
  When the base is the worker's own cgroup, the worker first moves itself into the leaf
  ``<base>/daemon``: cgroup v2 lets no process live in a cgroup that hands controllers to its
  children ("no internal processes"). It then enables the memory, cpu and pids controllers that
  ``<base>/cgroup.controllers`` offers in ``<base>/cgroup.subtree_control``, and removes (killing
  what is left in them) job cgroups a crash left behind.
- Each job gets ``<base>/job-<job id hex>`` with ``memory.max`` (from the grant's ``host_mem``, else
  the configured default) and ``memory.swap.max`` 0 where one of those is set, ``memory.oom.group``
  1 (an out-of-memory kill takes the whole job), ``cpu.max`` (from the grant's ``cpu_milli``) and
  ``pids.max``. The job's
  process enters it before it executes the job's program (``JobCgroup.procs_fd``, written by the
  child while it is still root), so everything it starts is inside; ``JobCgroup.kill`` kills them all
  (``cgroup.kill``, or one by one on kernels before 5.14) and ``JobCgroup.remove`` removes it.
- Devices: on v2, each job's cgroup gets a BPF device program (``gpud_worker.device_program``)
  that allows only the nodes of the job's sandbox ``/dev`` (its own GPUs' among them), where
  ``setup`` found that one can be attached below the base (``JobCgroups.device_fence``); on v1,
  the ``devices`` hierarchy denies the GPUs not granted (``JobCgroupsV1``). Which one, or neither,
  is logged at start.

Nothing here raises for a cgroup failure at run time: the failure is logged and the job runs
without its cgroup (its rlimits still apply). With cgroup v1, a hybrid hierarchy (controllers on
v1) and no configured parent, or no writable v2 hierarchy, ``setup`` logs why once and returns None.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpud_worker import device_program

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "cpu", "pids")
"""The controllers jobs are limited with, enabled where the base offers them."""
CPU_PERIOD_US = 100_000
MIN_CPU_QUOTA_US = 1_000  # the kernel refuses a cpu.max quota below 1 ms
DAEMON_LEAF = "daemon"
DEVICE_PROBE = "gpud-device-probe"  # the cgroup setup attaches a device program to, once, to see that it can
JOB_PREFIX = "job-"
SESSION_PREFIX = "session-"  # a session process's cgroup (``gpud_worker.session_host``)
_JOB_CGROUP_RE = re.compile(r"(?:job|session)-(?:[0-9a-f]{2}){1,64}\Z")
OPTIONAL_FILES = frozenset({"memory.swap.max", "memory.oom.group"})
"""Limit files a kernel may lack (no swap accounting, older kernels): their failures are not warned."""

_KILL_WAIT_S = 5.0  # for the processes of a killed cgroup to exit
_RMDIR_WAIT_S = 2.0  # for rmdir to stop failing with EBUSY while they do
_POLL_S = 0.01


# ---------------------------------------------------------------------------- pure: parsing


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """What ``/proc/self/mountinfo`` says of this host's cgroup file systems.

    Attributes:
        v2: where the cgroup2 file system is mounted (the first mount of it), or None.
        v1: controllers mounted as cgroup v1 hierarchies (named ones such as ``name=systemd`` aside).
    """

    v2: str | None
    v1: tuple[str, ...]

    @property
    def mode(self) -> str:
        """``unified`` (v2 only), ``hybrid`` (v2 beside v1 controllers), ``v1`` or ``none``."""
        if self.v2 is not None:
            return "hybrid" if self.v1 else "unified"
        return "v1" if self.v1 else "none"


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> Hierarchy:
    """The cgroup mounts of a ``/proc/PID/mountinfo`` text (proc(5)); malformed lines are skipped."""
    v2: str | None = None
    v1: list[str] = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        fstype, super_options = rest[0], rest[2]
        if fstype == "cgroup2" and v2 is None:
            v2 = _unescape(fields[4])
        elif fstype == "cgroup":
            for option in super_options.split(","):
                if option in ("rw", "ro") or option.startswith("name=") or "=" in option:
                    continue
                if option not in v1 and option not in ("noprefix", "clone_children", "xattr"):
                    v1.append(option)
    return Hierarchy(v2, tuple(v1))


def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup v2 path (``/a/b``) in a ``/proc/PID/cgroup`` text: its ``0::PATH`` line, or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            return path or None
    return None


def parse_controllers(text: str) -> frozenset[str]:
    """The names in ``cgroup.controllers`` or ``cgroup.subtree_control`` (space separated)."""
    return frozenset(text.split())


# ---------------------------------------------------------------------------- pure: limits


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    """What one job's cgroup is limited to (None or 0: not limited)."""

    memory: int | None = None  # memory.max, bytes
    cpu_milli: int = 0  # cpu.max, thousandths of a core
    pids: int | None = None  # pids.max, tasks (threads count)


def job_limits(
    host_mem: int, cpu_milli: int, default_memory: int | None, pids: int | None
) -> CgroupLimits:
    """A job's limits: memory from the grant's ``host_mem`` when it names one, else
    ``default_memory``; CPU from the grant's ``cpu_milli`` when it names one; ``pids`` as given."""
    memory = host_mem if host_mem > 0 else default_memory if default_memory else None
    return CgroupLimits(memory=memory, cpu_milli=max(cpu_milli, 0), pids=pids)


def cpu_max(cpu_milli: int, period: int = CPU_PERIOD_US) -> str:
    """``cpu.max`` for ``cpu_milli`` thousandths of a core: ``"QUOTA PERIOD"``, ``"max PERIOD"`` for 0."""
    if cpu_milli <= 0:
        return f"max {period}"
    return f"{max(MIN_CPU_QUOTA_US, cpu_milli * period // 1000)} {period}"


def limit_files(limits: CgroupLimits, controllers: Iterable[str]) -> list[tuple[str, str]]:
    """The interface files to write, in order, for ``limits`` with ``controllers`` enabled."""
    have = set(controllers)
    out: list[tuple[str, str]] = []
    if "memory" in have:  # an out-of-memory kill, of this cgroup or of the host, takes the whole job
        if limits.memory is not None:
            out += [("memory.max", str(limits.memory)), ("memory.swap.max", "0")]
        out.append(("memory.oom.group", "1"))
    if "cpu" in have and limits.cpu_milli > 0:
        out.append(("cpu.max", cpu_max(limits.cpu_milli)))
    if "pids" in have and limits.pids is not None:
        out.append(("pids.max", str(limits.pids)))
    return out


def parse_events(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``cgroup.events``, ``memory.events``): name -> value."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


# ---------------------------------------------------------------------------- file system


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _pids(path: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _populated(path: str) -> bool:
    try:
        return parse_events(_read(os.path.join(path, "cgroup.events"))).get("populated", 0) != 0
    except OSError:
        return bool(_pids(path))


def kill_cgroup(path: str, timeout: float = _KILL_WAIT_S) -> bool:
    """SIGKILL every process in cgroup ``path`` and its children; True once none is left."""
    try:
        _write(os.path.join(path, "cgroup.kill"), "1")
    except FileNotFoundError:  # before Linux 5.14: one by one, until no new one appears
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot write %s/cgroup.kill: %s", path, exc)
    deadline = time.monotonic() + timeout
    while _populated(path):
        for dirpath, _, _ in os.walk(path):
            for pid in _pids(dirpath):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def remove_cgroup(path: str) -> bool:
    """Kill what is in cgroup ``path`` and remove it with its children; True when it is gone."""
    if not os.path.isdir(path):
        return True
    if not kill_cgroup(path):
        log.error("processes of cgroup %s survive SIGKILL", path)
    ok = True
    for dirpath, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        deadline = time.monotonic() + _RMDIR_WAIT_S
        while True:
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    log.warning("cannot remove cgroup %s: %s", dirpath, exc)
                    ok = False
                    break
                time.sleep(_POLL_S)
    return ok


def in_cgroup(proc_cgroup: str, name: str, hierarchies: int) -> bool:
    """Whether a ``/proc/PID/cgroup`` text puts its process in the cgroup called ``name`` of each
    of ``hierarchies`` hierarchies (v2: its ``0::`` path, v1: one line per hierarchy) (pure)."""
    tail = "/" + name
    own = parse_proc_cgroup(proc_cgroup)
    if hierarchies == 1 and own is not None:
        return own.endswith(tail)
    return sum(line.endswith(tail) for line in proc_cgroup.splitlines()) >= hierarchies


def enter(procs_fds: Sequence[int], name: str) -> str:
    """Move the calling process into its cgroup (``JobCgroup.procs_fds``, one per hierarchy; root's
    right, so before it drops root), and check with its own ``/proc/self/cgroup`` that it is in:
    "" if so, else why not. Called in the new process itself (a job's before its exec, a session
    process at its start), which alone can tell: once a short job has ended its parent reads nothing
    true of it."""
    for fd in procs_fds:
        try:
            os.write(fd, b"0")
        except OSError as exc:
            return f"cannot write its cgroup.procs: {exc.strerror or exc}"
    try:
        if in_cgroup(_read("/proc/self/cgroup"), name, len(procs_fds)):
            return ""
    except OSError as exc:
        return f"cannot read /proc/self/cgroup: {exc.strerror or exc}"
    return "it is not in it after writing its cgroup.procs"


class JobCgroup:
    """The cgroup of one running job (on cgroup v1: its cgroup in each controller's hierarchy).

    Attributes:
        path: its directory (v1: the first hierarchy's).
        paths: its directories, one per hierarchy (v2: ``[path]``).
        procs_fds: an fd of each one's ``cgroup.procs``, open for writing (close-on-exec): the
            job's child process writes ``0`` to them before it drops root, which moves it in.
    """

    def __init__(self, path: str, procs_fd: int, more: Iterable[tuple[str, int]] = ()) -> None:
        self.path = path
        self.paths = [path]
        self.procs_fds: list[int] = [procs_fd]
        for p, fd in more:
            self.paths.append(p)
            self.procs_fds.append(fd)

    @property
    def procs_fd(self) -> int | None:
        return self.procs_fds[0] if self.procs_fds else None

    def close_fd(self) -> None:
        for fd in self.procs_fds:
            os.close(fd)
        self.procs_fds = []

    @property
    def name(self) -> str:
        """Its directory's name, the same in every hierarchy (``job-<hex>``, ``session-<hex>``)."""
        return os.path.basename(self.path)

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` (running or a zombie) is in this cgroup (v1: in each)."""
        try:
            return in_cgroup(_read(f"/proc/{pid}/cgroup"), self.name, len(self.paths))
        except OSError:
            return False

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory limit (0 without the memory controller)."""
        for path in self.paths:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    return parse_events(_read(os.path.join(path, name))).get("oom_kill", 0)
                except OSError:
                    continue
        return 0

    def kill(self) -> None:
        """SIGKILL everything in the cgroup, waiting (bounded) until it is empty."""
        for path in self.paths:
            if not kill_cgroup(path):
                log.error("processes of job cgroup %s survive SIGKILL", path)

    def remove(self) -> None:
        """Kill what is left and remove the cgroup (failures are logged)."""
        self.close_fd()
        for path in self.paths:
            remove_cgroup(path)


class JobCgroups:
    """Creates the cgroups of jobs below ``base``, with ``controllers`` enabled there and, with
    ``device_fence`` ``"bpf"``, a device program attached to each."""

    def __init__(self, base: str, controllers: Iterable[str], device_fence: str = "") -> None:
        self.base = base
        self.controllers = frozenset(controllers)
        self.device_fence = device_fence

    @classmethod
    def setup(cls, parent: str = "", proc: str = "/proc/self") -> JobCgroups | None:
        """Prepare job cgroups below ``parent`` (a cgroup v2 directory) or the worker's own cgroup.

        Returns None, having logged why, where cgroups cannot be used: then jobs run without them.
        ``proc`` is where ``mountinfo`` and ``cgroup`` are read (tests point it elsewhere).
        """
        try:
            hierarchy = parse_mountinfo(_read(os.path.join(proc, "mountinfo")))
            own = parse_proc_cgroup(_read(os.path.join(proc, "cgroup")))
        except OSError as exc:
            log.warning("cannot read this process's cgroups (%s): jobs run without cgroup limits", exc)
            return None
        mount = hierarchy.v2
        if mount is None:
            log.warning("cgroup %s: no cgroup v2 hierarchy, so jobs run without cgroup memory and CPU "
                        "limits (their rlimits still apply)", hierarchy.mode)
            return None
        own_path = os.path.normpath(os.path.join(mount, own.lstrip("/"))) if own else None
        if parent:
            base = os.path.normpath(parent)
            if os.path.commonpath([base, mount]) != mount:
                log.warning("cgroup_parent %s is not in the cgroup v2 hierarchy (%s): jobs run without "
                            "cgroup limits", base, mount)
                return None
        elif hierarchy.mode != "unified":
            log.warning("cgroup %s (controllers %s on v1): jobs run without cgroup memory and CPU limits "
                        "(their rlimits still apply); cgroup_parent may name a delegated directory of the "
                        "v2 hierarchy at %s", hierarchy.mode, ",".join(hierarchy.v1), mount)
            return None
        elif own_path is None:
            log.warning("this process has no cgroup v2 path: jobs run without cgroup limits")
            return None
        else:
            base = own_path
        try:
            if base == own_path:  # no internal processes: the worker moves into a leaf first
                leaf = os.path.join(base, DAEMON_LEAF)
                os.makedirs(leaf, exist_ok=True)
                _write(os.path.join(leaf, "cgroup.procs"), "0")
            available = parse_controllers(_read(os.path.join(base, "cgroup.controllers")))
            wanted = [c for c in CONTROLLERS if c in available]
            enabled = parse_controllers(_read(os.path.join(base, "cgroup.subtree_control")))
            missing = [c for c in wanted if c not in enabled]
            if missing:
                _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in missing))
        except OSError as exc:
            log.warning("cgroup v2 at %s is not usable here (%s): jobs run without cgroup limits "
                        "(their rlimits still apply); delegate it, e.g. systemd's Delegate=yes", base, exc)
            return None
        absent = [c for c in CONTROLLERS if c not in wanted]
        if absent:
            log.warning("cgroup %s does not offer the %s controller(s): jobs get no %s limits there",
                        base, ", ".join(absent), "/".join(absent))
        why = probe_device_program(base)
        if why:
            log.warning("no BPF device program can be attached to cgroups below %s (%s): jobs' devices are "
                        "fenced only by their sandbox's /dev, and not at all without namespaces", base, why)
        log.info("jobs run in cgroups below %s (controllers: %s)", base, " ".join(wanted) or "none")
        if not why:
            log.info("devices: each job's cgroup gets a BPF device program that allows only its own nodes")
        cgroups = cls(base, wanted, "" if why else "bpf")
        cgroups.remove_stale()
        return cgroups

    def remove_stale(self) -> None:
        """Kill and remove job cgroups a crash left behind."""
        try:
            names = os.listdir(self.base)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.base, exc)
            return
        for name in names:
            path = os.path.join(self.base, name)
            if _JOB_CGROUP_RE.match(name) and os.path.isdir(path):
                log.info("removing stale job cgroup %s", path)
                remove_cgroup(path)

    def create(self, hexid: str, limits: CgroupLimits,
               devices: Iterable[device_program.Rule] | None = None, prefix: str = JOB_PREFIX) -> JobCgroup | None:
        """A new cgroup for job ``hexid`` (``prefix``: ``SESSION_PREFIX`` for a session process)
        with ``limits`` and, with ``devices`` and a ``device_fence``, a device program that allows
        those devices only; None (logged) where it cannot be made."""
        path = os.path.join(self.base, prefix + hexid)
        kind = prefix.rstrip("-")
        try:
            if os.path.isdir(path):
                log.warning("%s cgroup %s exists already: replacing it", kind, path)
                remove_cgroup(path)
            os.mkdir(path, 0o755)
        except OSError as exc:
            log.warning("cannot create %s cgroup %s (%s): the %s runs without it", kind, path, exc, kind)
            return None
        for name, value in limit_files(limits, self.controllers):
            try:
                _write(os.path.join(path, name), value)
            except OSError as exc:
                if name in OPTIONAL_FILES:
                    log.debug("%s cgroup %s: %s not set: %s", kind, path, name, exc)
                else:
                    log.warning("%s cgroup %s: cannot set %s to %s: %s", kind, path, name, value, exc)
        if devices is not None and self.device_fence:
            try:
                device_program.fence(path, devices)
            except OSError as exc:
                log.warning("%s cgroup %s: no device program (%s): only its sandbox's /dev fences its devices", kind, path, exc)
        try:
            fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot open %s/cgroup.procs (%s): the %s runs without its cgroup", path, exc, kind)
            remove_cgroup(path)
            return None
        return JobCgroup(path, fd)


def probe_device_program(base: str) -> str:
    """Whether a device program can be attached to a cgroup below ``base``: "" if so, else why
    not (the kernel's errno). Tried on a cgroup of its own (``DEVICE_PROBE``), removed after."""
    path = os.path.join(base, DEVICE_PROBE)
    try:
        if os.path.isdir(path):
            os.rmdir(path)
        os.mkdir(path, 0o755)
    except OSError as exc:
        return f"cannot make the cgroup {path} to try: {exc}"
    try:
        device_program.fence(path, [])
    except OSError as exc:
        return str(exc)
    finally:
        try:
            os.rmdir(path)
        except OSError as exc:
            log.warning("cannot remove cgroup %s: %s", path, exc)
    return ""


# ---------------------------------------------------------------------------- cgroup v1

V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
"""The v1 hierarchies jobs are limited with, where the host mounts them."""
NVIDIA_MAJOR = 195  # /dev/nvidiaN and nvidiactl


def parse_v1_mounts(text: str) -> dict[str, str]:
    """Controller -> mount point of each cgroup v1 hierarchy in a mountinfo text (pure)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] != "cgroup":
            continue
        for option in rest[2].split(","):
            if option in V1_CONTROLLERS and option not in out:
                out[option] = _unescape(fields[4])
    return out


def parse_v1_own(text: str) -> dict[str, str]:
    """Controller -> this process's cgroup path, from a ``/proc/PID/cgroup`` text (v1 lines)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1]:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def v1_limit_files(controller: str, limits: CgroupLimits, deny_gpus: Iterable[int]) -> list[tuple[str, str]]:
    """The files to write, in order, in a job's cgroup of v1 hierarchy ``controller`` (pure)."""
    if controller == "memory" and limits.memory is not None:
        return [("memory.limit_in_bytes", str(limits.memory)), ("memory.memsw.limit_in_bytes", str(limits.memory))]
    if controller == "cpu" and limits.cpu_milli > 0:
        quota, period = cpu_max(limits.cpu_milli).split()
        return [("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", quota)]
    if controller == "pids" and limits.pids is not None:
        return [("pids.max", str(limits.pids))]
    if controller == "devices":
        return [("devices.deny", f"c {NVIDIA_MAJOR}:{minor} rwm") for minor in sorted(set(deny_gpus))]
    return []


V1_OPTIONAL = frozenset({"memory.memsw.limit_in_bytes"})  # no swap accounting on this kernel


_WORKER_DIR_RE = re.compile(r"gpud-(\d+)\Z")


class JobCgroupsV1:
    """Job cgroups in the host's cgroup v1 hierarchies (memory, cpu, pids, devices): in each,
    ``<the worker's own cgroup>/gpud-<worker pid>/job-<hex>`` (v1 hierarchies are shared by
    everything on the host, so each worker keeps to a directory of its own, and removes only
    those of workers that are gone). The devices one denies the GPUs a job was not granted
    (``c 195:N``), beside the sandbox's ``/dev`` that lacks their nodes."""

    def __init__(self, bases: dict[str, str]) -> None:
        self.bases = bases  # controller -> directory job cgroups are made in
        self.controllers = frozenset(bases)
        self.device_fence = "v1" if "devices" in bases else ""

    @classmethod
    def setup(cls, proc: str = "/proc/self") -> JobCgroupsV1 | None:
        """The v1 hierarchies usable here; None (nothing logged) where the host has none."""
        try:
            mounts = parse_v1_mounts(_read(os.path.join(proc, "mountinfo")))
            own = parse_v1_own(_read(os.path.join(proc, "cgroup")))
        except OSError:
            return None
        bases: dict[str, str] = {}
        for controller, mount in mounts.items():
            parent = os.path.normpath(os.path.join(mount, own.get(controller, "/").lstrip("/")))
            mine = os.path.join(parent, f"gpud-{os.getpid()}")
            try:
                _remove_gone_workers(parent)
                os.makedirs(mine, 0o755, exist_ok=True)
            except OSError as exc:
                log.warning("cgroup v1 %s at %s is not usable here (%s): jobs get no %s limits", controller, parent, exc, controller)
                continue
            bases[controller] = mine
        if not bases:
            return None
        log.info("jobs run in cgroup v1 hierarchies (controllers: %s) below %s", " ".join(sorted(bases)),
                 ", ".join(sorted(set(bases.values()))))
        if "devices" in bases:
            log.info("devices: the v1 devices cgroup of each job denies the GPUs it was not granted")
        else:
            log.warning("no cgroup v1 devices hierarchy: jobs' devices are fenced only by their sandbox's /dev, "
                        "and not at all without namespaces")
        return cls(bases)

    def close(self) -> None:
        """Remove this worker's directories (killing what is left in them)."""
        for base in set(self.bases.values()):
            remove_cgroup(base)

    def create(self, hexid: str, limits: CgroupLimits, deny_gpus: Iterable[int] = (),
               prefix: str = JOB_PREFIX) -> JobCgroup | None:
        """A job's cgroup (``prefix``: ``SESSION_PREFIX`` for a session process's) in every
        hierarchy, limited; None (logged) where one cannot be made."""
        kind = prefix.rstrip("-")
        deny = list(deny_gpus)
        made: list[tuple[str, int]] = []
        try:
            for controller, base in sorted(self.bases.items()):
                path = os.path.join(base, prefix + hexid)
                if os.path.isdir(path):
                    remove_cgroup(path)
                os.mkdir(path, 0o755)
                made.append((path, -1))
                for name, value in v1_limit_files(controller, limits, deny):
                    try:
                        _write(os.path.join(path, name), value)
                    except OSError as exc:
                        if name not in V1_OPTIONAL:
                            log.warning("%s cgroup %s: cannot set %s to %s: %s", kind, path, name, value, exc)
                made[-1] = (path, os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except OSError as exc:
            log.warning("cannot make %s %s's cgroup v1 (%s): the %s runs without it", kind, hexid, exc, kind)
            for path, fd in made:
                if fd >= 0:
                    os.close(fd)
                remove_cgroup(path)
            return None
        (first, fd), rest = made[0], made[1:]
        return JobCgroup(first, fd, rest)


def _remove_gone_workers(parent: str) -> None:
    """Remove the ``gpud-<pid>`` directories of workers that no longer run (a crash's)."""
    for name in os.listdir(parent):
        m = _WORKER_DIR_RE.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        log.info("removing the job cgroups of a worker that is gone: %s", os.path.join(parent, name))
        remove_cgroup(os.path.join(parent, name))


def setup_job_cgroups(parent: str = "", proc: str = "/proc/self") -> JobCgroups | JobCgroupsV1 | None:
    """Job cgroups for this host: cgroup v2 where the worker can use it (a ``parent`` given, or a
    unified host); else the cgroup v1 controllers the host mounts (hybrid or v1 hosts); else
    none (logged, by ``JobCgroups.setup``)."""
    if not parent:
        try:
            mode = parse_mountinfo(_read(os.path.join(proc, "mountinfo"))).mode
        except OSError:
            mode = "none"
        if mode in ("v1", "hybrid"):
            v1 = JobCgroupsV1.setup(proc)
            if v1 is not None:
                return v1
    return JobCgroups.setup(parent, proc)
