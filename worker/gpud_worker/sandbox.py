"""Namespaces for the worker's user processes: what a job or a session process can see of its VM.

``Sandbox`` is made once, at worker start: it probes whether namespaces can be made here
(``probe``) and so fixes the worker's isolation level, ``"namespaces"`` or ``"rlimits only"``, which
the worker logs and reports (READY ``isolation``). ``Sandbox.plan`` is called in the worker for
each process to start, and the ``Plan`` it returns is entered in the new process itself
(``Plan.enter``), while it is still root and before any of the user's code runs: from the
``preexec_fn`` of a job's ``subprocess.Popen`` (``gpud_worker.jobs``) or at the start of a session
process (``gpud_worker.session_host``).

Why ``unshare(2)``/``mount(2)`` through ctypes in the new process, and not util-linux ``unshare``
or bubblewrap: those are programs to execute, each an exec (and a Python job start already forks
the worker), and they would have to be told the GPU nodes, the hidden paths and the job directory
on a command line; done in the forked child it costs a few system calls and one more fork, needs
nothing installed, and a session process (which executes no program) gets the same code as a job.

What ``Plan.enter`` does, in order:

1. ``unshare`` mount, PID (a job's process is in its own already, see 7), IPC, UTS and (unless
   ``job_network = "host"``) network namespaces.
2. Makes every mount private and read-only, keeping its nosuid, nodev, noexec flags (one
   ``mount_setattr(2)`` of the whole tree; before Linux 5.12 a bind remount of each mount): the job
   can write nothing of the VM's file systems.
3. Size-limited tmpfs on ``/tmp`` and ``/var/tmp``; an empty read-only tmpfs over each hidden path
   (the worker's work root, its configuration and keys, its runtime directory): other jobs'
   directories, keys and sockets are not there.
4. A new ``/dev`` (tmpfs): null, zero, full, random, urandom, tty, a private ``devpts`` (``ptmx``),
   a size-limited ``/dev/shm``, and the granted GPUs' ``/dev/nvidiaN`` with ``nvidiactl``,
   ``nvidia-uvm`` and ``nvidia-uvm-tools`` where the host has them. No other GPU's node exists there.
5. The job's own directory bound back at its path (also where the work root lies under ``/tmp``),
   and made the current directory.
6. Loopback up in the new network namespace (which has nothing else); host name ``gpud-job``.
7. Forks. A job's process is forked by the worker as PID 1 of a new PID namespace already
   (``Sandbox.pid_namespace``: the worker's thread unshares ``CLONE_NEWPID`` for its next child
   only, and sets its namespace back after): it is ``I``, the one the worker waits for and
   signals. ``I`` reaps orphans and, when the job's process ends, writes the job's wait status to
   the worker (``job_status``: PID 1 cannot end by the job's signal) and exits, which makes the
   kernel kill whatever else still runs in the namespace; as PID 1 it ignores the signals it has
   no handler for (SIGTERM, SIGINT, SIGHUP of a group kill), but not the worker's SIGKILL. ``I``'s
   child ``J`` mounts the namespace's own ``/proc`` and returns from ``enter``: it is the one that
   becomes the pool user and runs the user's code. A group signal of the worker (``killpg``)
   reaches ``J`` directly, as before; ``J`` dies when ``I`` does (``PR_SET_PDEATHSIG``). A session
   process, forked by the session host in the worker's PID namespace, forks once more: it stays
   as ``P`` in the worker's namespace, waits for ``I`` and then exits as the job did (by its
   signal or with its code), ignoring SIGTERM/SIGINT/SIGHUP meanwhile; ``P`` and ``I`` die with
   SIGKILL, and ``I`` and ``J`` die when their parent does.

Then, once it is the pool user with ``PR_SET_NO_NEW_PRIVS``, the process that runs the user's code
installs the seccomp filter that keeps it from making user namespaces of its own
(``Plan.deny_user_namespaces``, ``gpud_worker.seccomp``), where the worker's probe found it working.

Nothing of this runs unless the probe succeeded; a failure of ``enter`` in a process (a mount the
kernel refuses) raises there, so the job fails to start with a clear error: never a job that runs
less isolated than the worker reported.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import signal
import socket
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from gpud_worker import seccomp

log = logging.getLogger(__name__)

NAMESPACES = "namespaces"
RLIMITS_ONLY = "rlimits only"
ISOLATION_LEVELS = (NAMESPACES, RLIMITS_ONLY)
NETWORKS = ("none", "host")

DEFAULT_TMP_SIZE = 256 << 20
"""Bytes of each private tmpfs (``/tmp``, ``/var/tmp``, ``/dev/shm``) by default."""

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
INIT_NAME = b"gpud-init"
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFF_RUNNING = 0x40

BASE_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The character devices every sandbox's ``/dev`` has (copied from the host's)."""
NVIDIA_SHARED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
"""The NVIDIA nodes every GPU process needs, besides its GPUs' ``nvidiaN``."""
HOSTNAME = b"gpud-job"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                       flags, data.encode() if data else None), f"mount {target}")


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(mountinfo: str) -> list[tuple[str, int]]:
    """Every mount point of a ``/proc/PID/mountinfo`` text with its per-mount flags (nosuid,
    nodev, noexec, atime), each path once, parents before children (pure)."""
    seen: dict[str, int] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        flags = 0
        for option in fields[5].split(","):
            flags |= _MOUNT_FLAGS.get(option, 0)
        seen[unescape(fields[4])] = flags
    return sorted(seen.items(), key=lambda item: (item[0].count("/") if item[0] != "/" else 0, item[0]))


@dataclass(frozen=True, slots=True)
class Node:
    """A device node to make in a sandbox's ``/dev``: its name there, mode and device number."""

    name: str
    mode: int
    rdev: int


def host_nodes(names: Iterable[str], dev: str = "/dev") -> list[Node]:
    """The character devices ``names`` as the host has them under ``dev``; absent ones left out."""
    out = []
    for name in names:
        try:
            st = os.stat(os.path.join(dev, name))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append(Node(name, stat.S_IMODE(st.st_mode), st.st_rdev))
    return out


def gpu_node_names(minors: Iterable[int]) -> list[str]:
    """``nvidiaN`` of each granted GPU's minor number, then the shared NVIDIA nodes."""
    return [f"nvidia{m}" for m in minors] + list(NVIDIA_SHARED)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one sandboxed process gets (made by ``Sandbox.plan`` in the worker; entered in the
    process by ``enter``)."""

    network: str
    tmp_size: int
    hidden: tuple[str, ...]
    nodes: tuple[Node, ...]
    shared: tuple[str, ...] = ()
    workdir: str | None = None
    workdir_fd: int | None = None
    gpus: tuple[int, ...] = ()  # minor numbers of the granted GPUs
    # The process that runs the user's code installs ``seccomp.deny_user_namespaces`` once it is
    # the pool user (``deny_user_namespaces`` below): it makes no user namespace of its own.
    no_user_namespaces: bool = False

    def deny_user_namespaces(self) -> None:
        """In the process that runs the user's code, as the pool user with
        ``PR_SET_NO_NEW_PRIVS`` and before any of the user's code: where the worker's probe found
        the filter working, install it (an OSError if the kernel refuses it now)."""
        if self.no_user_namespaces:
            seccomp.deny_user_namespaces()

    def flags(self) -> int:
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        return flags | CLONE_NEWNET if self.network == "none" else flags

    def enter(self, outer_pid: bool = False, keep_handlers: bool = False, status_fd: int = -1) -> int:
        """Enter the sandbox (see the module's doc); only the process that is to run the user's
        code returns. Returns its pid in the worker's PID namespace when ``outer_pid`` (a session
        process reports it), else 0. Raises OSError where a step fails (before any fork).

        In a process that is PID 1 already (a job's, forked in ``pid_namespace``), it is ``I``
        from the start: no ``P``, one fork fewer; it writes the job's wait status to
        ``status_fd`` (``job_status`` reads it), as PID 1 cannot end by the job's signal.

        ``P`` and ``I`` are forks of the worker, with its Python signal handlers (a SIGTERM would
        run the worker's shutdown in them): all signals are blocked across the forks and each of
        them sets its own dispositions first. The process that returns gets the default ones (a
        job's program is executed next), or, with ``keep_handlers`` (a session process, which goes
        on in Python), the ones this process had."""
        if os.getpid() == 1:  # forked in pid_namespace(): this process is I itself
            return self._enter_as_init(status_fd)
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")  # P: with the worker
        _check(_libc.unshare(self.flags()), "unshare")
        self._mounts()
        if self.network == "none":
            _loopback_up()
        _libc.sethostname(HOSTNAME, len(HOSTNAME))  # cosmetic (systemd's ProtectHostname forbids it)
        saved = {sig: signal.getsignal(sig) for sig in _SIGNALS} if keep_handlers else {}
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        r, w = os.pipe()
        child = os.fork()
        if child:
            _outer(child, r, w, mask)
        try:  # I: never returns, whatever fails
            _default_handlers()
            _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
            _rename_init()  # before the job exists, so it never sees the worker's command line
            child = os.fork()
        except BaseException:
            os._exit(255)
        if child:
            os.close(r)
            _init(child, w, mask)
        os.close(r)
        os.close(w)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        return self._enter_as_job(mask, outer_pid)

    def _enter_as_init(self, status_fd: int) -> int:
        """``enter`` in a process that is PID 1 of its own PID namespace already: the other
        namespaces and the mounts, then ``I``'s part (it forks ``J``, which returns)."""
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")  # with the worker
        _check(_libc.unshare(self.flags() & ~CLONE_NEWPID), "unshare")
        self._mounts()
        if self.network == "none":
            _loopback_up()
        _libc.sethostname(HOSTNAME, len(HOSTNAME))
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:  # the worker's handlers are not I's (a SIGTERM would run the worker's shutdown)
            _default_handlers()
            _rename_init()
            child = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        if child:
            _init(child, status_fd, mask)
        return self._enter_as_job(mask, False)  # status_fd stays until the exec (close-on-exec): for a failure

    def _enter_as_job(self, mask: Iterable[int], outer_pid: bool) -> int:
        """``J``: its own ``/proc``, the other GPUs' driver entries covered."""
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        pid = _outer_pid() if outer_pid else 0
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _hide_other_gpus(self.gpus)
        return pid

    def _mounts(self) -> None:
        umask = os.umask(0o022)  # the directories made here are the sandbox's, not the job's
        try:
            self._mount_all()
        finally:
            os.umask(umask)

    def _mount_all(self) -> None:
        if not _read_only_private_tree():
            _read_only_mount_by_mount()
        # What is bound back after the covers, opened as this namespace sees it (a mount of the
        # worker's namespace, which the worker's fd is in, cannot be bound here): the job's
        # directory, checked to be that same directory, and the shared paths (MPS's directories).
        keep: list[tuple[str, int]] = []
        if self.workdir is not None and self.workdir_fd is not None:
            src = os.open(self.workdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            mine, theirs = os.fstat(src), os.fstat(self.workdir_fd)
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
                raise OSError(errno.EXDEV, f"{self.workdir} is not the job's directory")
            keep.append((self.workdir, src))
        for path in self.shared:
            try:
                keep.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)))
            except OSError:
                continue  # not there (MPS not started yet): nothing to share
        tmp = f"size={self.tmp_size},mode=1777"
        for path in ("/tmp", "/var/tmp"):
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmp)
        covered = [p for p in self.hidden if os.path.isdir(p)]
        for path in covered:
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
        for path in self.hidden:  # a file (the configuration): the VM's /dev/null in its place
            if os.path.isfile(path):
                _mount("/dev/null", path, None, MS_BIND)
        self._dev(tmp)
        for path, src in keep:
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{src}", path, None, MS_BIND)
            os.close(src)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        os.chdir(self.workdir if self.workdir is not None and self.workdir_fd is not None else "/")
        for path in covered:
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)

    def _dev(self, tmp: str) -> None:
        _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
        for node in self.nodes:
            path = "/dev/" + node.name
            os.mknod(path, stat.S_IFCHR | 0o600, node.rdev)
            os.chmod(path, node.mode)
        os.mkdir("/dev/pts", 0o755)
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
        os.symlink("pts/ptmx", "/dev/ptmx")
        os.mkdir("/dev/shm")
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmp)
        os.symlink("/proc/self/fd", "/dev/fd")
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{i}", "/dev/" + name)
        _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


class _MountAttr(ctypes.Structure):
    """``struct mount_attr`` of mount_setattr(2)."""

    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_SYS_MOUNT_SETATTR = 442  # Linux 5.12; one number on every architecture
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 0x1


def _read_only_private_tree() -> bool:
    """Make every mount of this namespace read-only and private, keeping each one's other flags,
    in one mount_setattr(2) call; False where the kernel has none (before 5.12, or a seccomp
    filter that does not know it)."""
    attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY, propagation=MS_PRIVATE)
    result = _libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/",
                           ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):
        return False
    raise OSError(err, f"mount_setattr /: {os.strerror(err)}")


def _read_only_mount_by_mount() -> None:
    """What ``_read_only_private_tree`` does, on older kernels: every mount private, then a bind
    remount of each that ``/proc/self/mountinfo`` lists, read-only with its own flags.

    The list can be out of date by the time a mount's turn comes: the worker unmounts and removes
    job directories all the while, and the removal of a directory detaches the copies of its
    mount in this namespace too. Such a remount fails (EINVAL: no mount point there now; ENOENT:
    no such path now), which is what, under load, failed the start of jobs ("Exception occurred
    in preexec_fn"); a mount that is still listed after a failure is an error."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    points = _mount_points()
    for path, flags in points:
        if path.startswith(("/proc/", "/dev/")) or path in ("/proc", "/dev"):
            continue  # replaced by the sandbox's own (autofs mounts there refuse a remount)
        try:
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EACCES):  # shadowed by a later mount, or gone
                continue
            if exc.errno != errno.EINVAL or path in dict(_mount_points()):
                raise


def _mount_points() -> list[tuple[str, int]]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return mount_points(f.read())


NVIDIA_PROC_GPUS = "/proc/driver/nvidia/gpus"


def _hide_other_gpus(granted: Sequence[int]) -> None:
    """Cover ``/proc/driver/nvidia/gpus/<PCI address>`` of each GPU not granted (its
    ``information`` says its ``Device Minor``), as NVIDIA's container toolkit does: the driver's
    tools (``nvidia-smi``) list the GPUs found there."""
    try:
        addresses = os.listdir(NVIDIA_PROC_GPUS)
    except OSError:
        return  # no NVIDIA driver here
    for address in addresses:
        path = os.path.join(NVIDIA_PROC_GPUS, address)
        minor = None
        try:
            with open(os.path.join(path, "information"), encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Device Minor:"):
                        minor = int(line.split(":", 1)[1])
        except (OSError, ValueError):
            pass
        if minor not in granted:
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = bytearray(struct.pack("16sH22x", b"lo", 0))
        fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, ifr)
        flags = struct.unpack_from("H", ifr, 16)[0] | _IFF_UP | _IFF_RUNNING
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags))


def _outer_pid() -> int:
    """This process's pid in the outermost PID namespace (``NSpid`` of the host's ``/proc``,
    still mounted: the sandbox's own is mounted after this)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return 0


def _close_all_but(keep: int) -> None:
    os.closerange(0, keep)
    os.closerange(keep + 1, 1 << 20)


_SIGNALS = [sig for sig in signal.valid_signals() if sig not in (signal.SIGKILL, signal.SIGSTOP)]


def _default_handlers() -> None:
    """Every signal this process handles in Python, or ignores, back to its default action."""
    for sig in _SIGNALS:
        if signal.getsignal(sig) not in (signal.SIG_DFL, None):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                continue  # one the C library keeps for itself


def _outer(child: int, r: int, w: int, mask: Iterable[int]) -> None:
    """``P``: wait for PID 1 of the sandbox, then end as the job ended. Never returns."""
    try:
        _default_handlers()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(w)
        _close_all_but(r)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except ChildProcessError:
                status = 0
                break
        report = os.read(r, 32)
        if report:
            status = int(report)
        if os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status))
            if sig != signal.SIGKILL:  # the one signal whose action cannot be set (or ignored)
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)
    finally:
        os._exit(255)


def _init(child: int, w: int, mask: Iterable[int]) -> None:
    """``I``, PID 1 of the sandbox: reap, and report the job's wait status on ``w`` (to ``P``, or
    to the worker) when it ends. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _close_all_but(w)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(0)
            if pid == child:
                if w >= 0:
                    os.write(w, str(status).encode())
                os._exit(0)
    finally:
        os._exit(255)


SETUP_FAILED = "!"
"""What a line on a job's status pipe starts with that says why its setup failed."""
CGROUP_FAILED = "~"
"""What a line on a job's status pipe starts with that says why it is not in its cgroup."""


@dataclass(frozen=True, slots=True)
class JobReport:
    """What a job's processes wrote on their status pipe (``job_report``).

    Attributes:
        setup: why its setup failed ("": it did not).
        cgroup: why it did not enter its cgroup ("": it did, or it has none).
        status: the job's wait status, which its PID 1 writes at the end (None: nothing, it was
            SIGKILLed, or it has no PID 1 of its own).
    """

    setup: str = ""
    cgroup: str = ""
    status: int | None = None


def job_report(r: int) -> JobReport:
    """What a job's processes wrote on the pipe ``r`` (``status_fd`` of ``Plan.enter``), once they
    are gone: a line after ``CGROUP_FAILED`` and one after ``SETUP_FAILED``, each where that
    failed, and the digits of the job's wait status that its PID 1 writes at the end."""
    os.set_blocking(r, False)
    chunks = []
    while True:
        try:
            chunk = os.read(r, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    said = b"".join(chunks).decode(errors="replace")
    setup = cgroup = ""
    while said[:1] in (SETUP_FAILED, CGROUP_FAILED):
        line, _, said = said.partition("\n")
        if line[0] == SETUP_FAILED:
            setup = line[1:]
        else:
            cgroup = line[1:]
    return JobReport(setup, cgroup, int(said) if said.isdigit() else None)


def job_status(written: int | None, status: int) -> int:
    """The job's exit code (negative: killed by that signal, as subprocess says) from the wait
    status its ``I`` wrote (``JobReport.status``), which PID 1 of a namespace has to write, not
    die of; ``status`` (the exit code of the worker's child) where it wrote nothing (it was
    SIGKILLed)."""
    return status if written is None else os.waitstatus_to_exitcode(written)


def _rename_init() -> None:
    """Show PID 1 as ``gpud-init``: it is a fork of the worker, whose command line (its paths and
    endpoints) is none of the job's business. Its name is set with ``PR_SET_NAME``; its command
    line, which ``/proc`` reads from the process's memory, is overwritten where it lies
    (``arg_start``-``arg_end`` of ``/proc/self/stat``; this process's copy of the worker's)."""
    name = ctypes.create_string_buffer(INIT_NAME)
    _libc.prctl(_PR_SET_NAME, ctypes.addressof(name), 0, 0, 0)
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5), counted from 1
    if 0 < start < end:
        blank = INIT_NAME[: end - start - 1].ljust(end - start, b"\0")
        ctypes.memmove(start, blank, len(blank))


def probe(network: str) -> str:
    """Whether this process can make the namespaces a ``Plan`` needs: "" if so, else why not.
    Forks a child that tries (the worker's own namespaces are never changed)."""
    if os.geteuid() != 0:
        return "the worker does not run as root"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            _check(_libc.unshare(CLONE_NEWPID), "unshare")  # what pid_namespace() does, and undoes
            _check(_libc.setns(own, CLONE_NEWPID), "setns")
            plan = Plan(network, 1 << 20, (), ())
            _check(_libc.unshare(plan.flags()), "unshare")
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k")
            if network == "none":
                _loopback_up()
            grandchild = os.fork()
            if grandchild == 0:
                try:
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    os._exit(0 if os.getpid() == 1 else 3)
                finally:
                    os._exit(4)
            _, status = os.waitpid(grandchild, 0)
            if status != 0:
                raise OSError(errno.EPERM, "cannot mount /proc in a new PID namespace")
        except BaseException as exc:  # the child must never return into the worker's code
            os.write(w, str(exc).encode()[:500])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        why = os.read(r, 1000).decode(errors="replace")
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0 and not why:
        why = f"the probe process ended with status {status}"
    return why


class Sandbox:
    """The worker's sandbox settings and isolation level (see the module's doc).

    Args:
        network: ``"none"`` (a network namespace with loopback only) or ``"host"``.
        tmp_size: bytes of each private tmpfs.
        hidden: paths covered in every sandbox: a directory by an empty one, a file by
            ``/dev/null``.
        shared: directories of the VM bound into every sandbox at their path, writable (CUDA
            MPS's pipe and log directories, which may lie in ``/tmp``).
        enabled: False: do not probe, the level is "rlimits only" (the worker is not root).
    """

    def __init__(self, network: str = "none", tmp_size: int = DEFAULT_TMP_SIZE, hidden: Sequence[str] = (),
                 shared: Sequence[str] = (), *, enabled: bool = True, dev: str = "/dev") -> None:
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}")
        self.network = network
        self.tmp_size = tmp_size
        self.hidden = tuple(dict.fromkeys(os.path.abspath(p) for p in hidden if p))
        self.shared = tuple(dict.fromkeys(os.path.abspath(p) for p in shared if p))
        self.dev = dev
        self.reason = probe(network) if enabled else "the worker does not run as root"
        self.level = RLIMITS_ONLY if self.reason else NAMESPACES
        # Why jobs may still make user namespaces of their own ("": they may not).
        self.userns_reason = seccomp.probe() if self.active else self.reason
        self._own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if self.active else -1
        self._base = tuple(host_nodes(BASE_DEVICES, dev))

    @property
    def active(self) -> bool:
        return self.level == NAMESPACES

    @contextmanager
    def pid_namespace(self) -> Iterator[None]:
        """What the calling thread forks in this block is PID 1 of a new PID namespace (a job's
        ``I``: one fork fewer than ``P``, ``I``, ``J``); the thread's later children are in the
        worker's again. ``unshare(CLONE_NEWPID)`` changes the namespace of the caller's children
        only, and of this thread only; ``setns`` back to the worker's own namespace undoes it."""
        _check(_libc.unshare(CLONE_NEWPID), "unshare")
        try:
            yield
        finally:
            _check(_libc.setns(self._own_pid_ns, CLONE_NEWPID), "setns")

    def describe(self) -> str:
        """One line for the worker's start-up log."""
        if not self.active:
            return (f"isolation: {RLIMITS_ONLY} ({self.reason}): jobs and session processes share the VM's "
                    "/tmp, /dev/shm, /proc, devices and network; only pool users, rlimits and cgroups separate them")
        net = "no network (loopback only)" if self.network == "none" else "the HOST network (job_network = host)"
        return (f"isolation: {NAMESPACES}: each job and session process gets mount, PID, IPC, UTS and network "
                f"namespaces, private /tmp, /var/tmp, /dev/shm ({self.tmp_size} bytes each), its own /proc, "
                f"only its GPUs' device nodes, {net}, "
                + ("no user namespaces of its own (seccomp)" if not self.userns_reason
                   else f"user namespaces of its own where the kernel allows them ({self.userns_reason})")
                + f"; hidden: {', '.join(self.hidden) or 'nothing'}")

    def plan(self, minors: Sequence[int], workdir: str | None = None, workdir_fd: int | None = None) -> Plan | None:
        """The plan of one process granted the GPUs of ``minors``; None without namespaces."""
        if not self.active:
            return None
        nodes = self._base + tuple(host_nodes(gpu_node_names(minors), self.dev))
        return Plan(self.network, self.tmp_size, self.hidden, nodes, self.shared, workdir, workdir_fd, tuple(minors),
                    not self.userns_reason)


# ---------------------------------------------------------------------------- outside a sandbox

MNT_DETACH = 2
_IPC_RMID = 0
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
SWEPT_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
"""Where files of a pool user are swept after its job when there are no namespaces."""


def private_mounts() -> str:
    """Move this process (the worker, at start, before it has threads) into a mount namespace of
    its own that still receives the VM's mounts: what it mounts (job directories' tmpfs) is
    nobody else's, and goes with it when it dies, also by SIGKILL. "" once done, else why not."""
    try:
        _check(_libc.unshare(CLONE_NEWNS), "unshare")
        _mount(None, "/", None, MS_REC | MS_SLAVE)
    except OSError as exc:
        return str(exc)
    return ""


def mount_tmpfs(path: str, options: str) -> None:
    """Mount a tmpfs with ``options`` on ``path`` (nosuid, nodev) in this process's namespace."""
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)


def unmount(path: str) -> bool:
    """Detach whatever is mounted on ``path``; False where nothing was (or it cannot be)."""
    return bool(_libc.umount2(path.encode(), MNT_DETACH) == 0)


def parse_sysvipc(text: str) -> list[tuple[int, int, int]]:
    """``(id, uid, cuid)`` of each object in a ``/proc/sysvipc/{shm,sem,msg}`` text (pure)."""
    lines = text.splitlines()
    if not lines:
        return []
    head = lines[0].split()
    try:
        at_id, at_uid, at_cuid = 1, head.index("uid"), head.index("cuid")
    except ValueError:
        return []
    out = []
    for line in lines[1:]:
        fields = line.split()
        try:
            out.append((int(fields[at_id]), int(fields[at_uid]), int(fields[at_cuid])))
        except (IndexError, ValueError):
            continue
    return out


def _remove_ipc(uid: int, proc: str = "/proc/sysvipc") -> int:
    """Remove the SysV IPC objects of ``uid``, as ``uid`` (IPC_RMID is the owner's, or
    CAP_SYS_ADMIN's, which a worker without namespaces may well lack); how many went."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.write(w, str(_remove_own_ipc(uid, proc)).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        report = os.read(r, 32)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return int(report) if report.isdigit() else 0


def _remove_own_ipc(uid: int, proc: str) -> int:
    removed = 0
    removers: dict[str, Callable[[int], int]] = {
        "shm": lambda i: int(_libc.shmctl(i, _IPC_RMID, None)),
        "sem": lambda i: int(_libc.semctl(i, 0, _IPC_RMID)),
        "msg": lambda i: int(_libc.msgctl(i, _IPC_RMID, None)),
    }
    for kind, remove in removers.items():
        try:
            with open(os.path.join(proc, kind), encoding="ascii") as f:
                objects = parse_sysvipc(f.read())
        except OSError:
            continue
        for ident, owner, creator in objects:
            if uid in (owner, creator) and remove(ident) == 0:
                removed += 1
    return removed


SWEEP_MAX_DEPTH = 128
"""Directory levels below a swept directory that a sweep goes down (two fds held per level)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def may_hold_entries_of_others(st: os.stat_result) -> bool:
    """Whether a pool user other than the owner may have linked entries into directory ``st``
    (made, renamed or hard-linked them there): it is not root's, or its group or others may
    write it (an ACL that grants a user more shows in the group bits, its mask) (pure)."""
    return st.st_uid != 0 or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def may_be_entered(st: os.stat_result) -> bool:
    """Whether a pool user may ever have reached inside directory ``st``: not root's, or its group
    or others may search it (root's own 0700 directories are no pool user's business) (pure)."""
    return st.st_uid != 0 or bool(st.st_mode & (stat.S_IXGRP | stat.S_IXOTH))


def _remove_files_of(uid: int, top: str) -> int:
    """Remove every file and directory of ``uid`` below ``top``; how many (a directory with what is
    in it counts once). Through directory fds, never following a symlink (another user cannot
    redirect the sweep), depth first without recursion, and only where ``uid`` can have left
    something: in a directory of root's that no pool user may write, only its directories are
    looked at (its files cannot be a pool user's), and only until the last of them (a directory
    has 2 links and one more per subdirectory, as ``find`` relies on; overlayfs and btrfs say 1,
    which tells nothing), so one without subdirectories is not listed at all, and one
    that no pool user may search is not entered. On a VM whose /tmp holds a large tree of root's
    (a checkout, a build), that is most of it: every entry of it was ``stat``-ed, once per job.
    The uid's own trees go however deep they are (what lies deeper than ``SWEEP_MAX_DEPTH`` below
    the sweep is moved up to be removed from there); others' are swept down to that depth (a
    WARNING names where it stopped)."""
    try:
        fd = os.open(top, _DIR_FLAGS)
    except OSError as exc:
        log.warning("cannot sweep %s for uid %d: %s", top, uid, exc)
        return 0
    removed = 0
    # Each level: its fd, its entries, its path (for the log), whether all of its entries are
    # this uid's to remove, whether others' entries may be in it (then each is stat-ed), and where
    # not, how many subdirectories are still to come (-1: not known; 0: nothing more to look at);
    # in a tree being removed, its top's count is how many directories too deep to go down to
    # were moved up into it (it is listed again for them).
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str, bool, bool, list[int]]] = []
    deep = ""

    def push(dfd: int, where: str, removing: bool, st: os.stat_result) -> None:
        look = removing or may_hold_entries_of_others(st)
        subdirs = st.st_nlink - 2 if not look and st.st_nlink >= 2 else -1
        stack.append((dfd, os.scandir(dfd), where, removing, look, [0 if removing else subdirs]))

    try:
        push(fd, top, False, os.fstat(fd))
    except OSError as exc:
        os.close(fd)
        log.warning("cannot sweep %s for uid %d: %s", top, uid, exc)
        return 0
    while stack:
        dfd, entries, where, removing, look, subdirs = stack[-1]
        try:
            entry = next(entries, None) if removing or subdirs[0] != 0 else None
        except OSError as exc:
            log.warning("cannot list %s to sweep uid %d: %s", where, uid, exc)
            entry = None
        if entry is None and removing and subdirs[0] > 0:  # the top of a tree, with directories moved up
            subdirs[0] = 0
            _close(entries, -1)
            stack[-1] = (dfd, os.scandir(dfd), where, removing, look, subdirs)
            continue
        if entry is None:
            stack.pop()
            _close(entries, dfd)
            if removing and stack:  # a directory of the uid's, now empty
                try:
                    os.rmdir(os.path.basename(where), dir_fd=stack[-1][0])
                except OSError as exc:
                    log.warning("cannot remove %s of uid %d: %s", where, uid, exc)
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)  # from the directory entry: no stat
            if removing and not is_dir:
                os.unlink(entry.name, dir_fd=dfd)
                continue
            if not (look or is_dir):
                continue  # in a directory of root's no pool user may write: not a pool user's file
            if not look:
                subdirs[0] -= 1  # once its last one is seen, the rest of it is files: not looked at
            st = entry.stat(follow_symlinks=False)
            mine = removing or st.st_uid == uid
            if not is_dir:
                if mine:
                    os.unlink(entry.name, dir_fd=dfd)
                    removed += 1
                continue
            if not (mine or may_be_entered(st)):
                continue
            if not mine and not may_hold_entries_of_others(st) and st.st_nlink == 2:
                continue  # no subdirectory in it (2 links: its entry and its "."), and its files are root's
            if len(stack) > SWEEP_MAX_DEPTH:
                top_fd, *_, moved = next(frame for frame in stack if frame[3]) if removing else stack[-1]
                if removing and top_fd != dfd:  # up into the top of the tree being removed, to go down from there
                    os.rename(entry.name, f".gpud-deep-{os.urandom(8).hex()}", src_dir_fd=dfd, dst_dir_fd=top_fd)
                    moved[0] += 1
                else:
                    deep = deep or os.path.join(where, entry.name)
                continue
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dfd)
            try:
                if os.fstat(sub).st_ino != st.st_ino:
                    raise OSError(errno.EAGAIN, "replaced while being swept")
                push(sub, os.path.join(where, entry.name), mine, st)
            except BaseException:
                os.close(sub)
                raise
            if mine and not removing:
                removed += 1
        except FileNotFoundError:
            continue  # gone meanwhile (someone else's, or removed with its directory)
        except OSError as exc:
            log.warning("cannot sweep %s of uid %d: %s", os.path.join(where, entry.name), uid, exc)
    if deep:
        log.warning("the sweep of uid %d did not go below %d levels of %s (at %s)", uid, SWEEP_MAX_DEPTH, top, deep)
    return removed


def _close(entries: Iterator[os.DirEntry[str]], fd: int) -> None:
    close = getattr(entries, "close", None)
    if close is not None:
        close()
    if fd >= 0:
        os.close(fd)


def sweep_uid(uid: int) -> None:
    """Remove what pool user ``uid`` left outside a sandbox (its processes are gone already): its
    files in ``SWEPT_DIRS``, its SysV IPC objects and its POSIX message queues. Root only."""
    if os.geteuid() != 0:
        return
    files = sum(_remove_files_of(uid, top) for top in SWEPT_DIRS if os.path.isdir(top))
    ipc = _remove_ipc(uid)
    queues = 0
    where = "/dev/mqueue"
    mounted_here = False
    if not os.path.ismount(where):
        where = os.path.join("/run", f"gpud-mqueue-{os.getpid()}")
        try:
            os.makedirs(where, 0o700, exist_ok=True)
            _mount("mqueue", where, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            mounted_here = True
        except OSError as exc:
            log.debug("cannot mount mqueue to sweep uid %d: %s", uid, exc)
            where = ""
    if where:
        queues = _remove_files_of(uid, where)
        if mounted_here:
            unmount(where)
            os.rmdir(where)
    if files or ipc or queues:
        log.info("uid %d left %d file(s), %d SysV IPC object(s) and %d message queue(s): removed", uid, files, ipc, queues)
