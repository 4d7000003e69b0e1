"""Sessions in processes of their own: one process per session, as a pool user.

Why: on a real GPU a CUDA error that CUDA makes sticky (an illegal address in a user's kernel, a
device-side assert...) poisons the CUDA driver for the whole *process*, not only the context that
faulted: measured on an H200 (``make gpu-check``), once one session's kernel wrote to a wild
address, every other context of the worker process failed and no new one could be made
(``cuCtxCreate``: CUDA_ERROR_ILLEGAL_ADDRESS). One tenant's bad kernel must not end the other
tenants' sessions, so each session runs in a process of its own: a fault ends that process and
nothing else. The process also runs the user's code (kernels, module loads) as an unprivileged pool
user (``JobRunner.lease_user``), never as root, with ``PR_SET_NO_NEW_PRIVS`` (and, in a sandbox,
its seccomp filter: no user namespaces of its own), and sees only its
own GPU (``CUDA_VISIBLE_DEVICES``) and its grant's MPS limits, which CUDA reads when the process
starts.

- ``SessionHosts`` starts the processes. They are forked from a *forkserver* started once, as this
  process's user, with the session code and pycuda imported (``multiprocessing``'s forkserver):
  forking it is cheap, and a child that has become a pool user needs to read no file to run (the
  interpreter may live where pool users cannot reach it, e.g. under ``/root``). CUDA itself starts
  only in the child (``cuInit`` does not survive a fork).
- ``HostedDevice`` wraps a device (``CudaDevice``, or ``SimulatedDevice`` where a test or an
  operator asks for it) so that its sessions are ``HostedSession`` s. The wrapped device stays in
  the worker: it compiles CUDA C (with its module cache, nvcc run as an unprivileged user) and
  keeps the busy time and memory counts the heartbeats report.
- ``HostedSession`` is the worker's side of one session: each call is one request and one reply on
  a socket pair (msgpack maps); bulk bytes go through a shared memory buffer (a memfd mapped by
  both sides, ``staging`` bytes, default 8 MiB), a copy larger than it in pieces.
- Each session process has a cgroup of its own where the worker has job cgroups
  (``JobRunner.make_cgroup``, ``session-<hex>`` beside the jobs' ``job-<hex>``): the same memory,
  CPU and pids limits a job of its grant gets, and its devices fenced as a job's are (the v1
  ``devices`` cgroup denies the GPUs not granted; on v2 a BPF device program allows only its
  sandbox's nodes). It is removed, with whatever still runs in it, when the session ends or the
  worker drops it; an out-of-memory kill is said in why the session was lost.
- ``_serve`` is the child's side: it first enters its cgroup (``cgroups.enter``; it says in its
  first message whether it could, and the worker warns where it could not), then its sandbox
  (``gpud_worker.sandbox``: namespaces of its own, a ``/dev`` with only its GPU's nodes, no
  network) where the worker has one, becomes the pool user, opens the one session on a device of
  its own, and answers calls until it is closed or the worker goes away. After an error that
  leaves its context unusable it answers that call, saying the session is lost, and exits.

A session whose process dies (killed, crashed) is lost: its calls get SESSION_LOST, and the client
library replays its journal onto a new session where it can. ``HostedSession.kill`` ends the
process at once, also while it runs a kernel that never ends.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import pwd
import resource
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from gpud.errors import (
    GpudError,
    InternalError,
    InvalidRequest,
    RemoteError,
    SessionLost,
    error_for,
)
from gpud.protocol import gpu_info_to_wire, parse_gpu_info
from gpud.resources import GpuInfo
from gpud_worker.cgroups import SESSION_PREFIX, JobCgroup, enter
from gpud_worker.device import Dims, _BaseDevice, _byte_view, _check_grant, _out_view
from gpud_worker.jobs import JobGrant
from gpud_worker.kernels import Arg
from gpud_worker.modules import check_cuda_source, check_load_args, decode_text
from gpud_worker.sandbox import Plan, Sandbox

log = logging.getLogger(__name__)

DEFAULT_STAGING = 8 << 20  # bytes of the buffer a session's copies go through
START_TIMEOUT_S = 120.0  # a session's process: forked, CUDA started, its context made
CLOSE_TIMEOUT_S = 10.0  # a closed session's process must be gone by then, else it is killed

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39

_packb = msgpack.Packer(use_bin_type=True).pack
_PID = 0  # in a session process: its pid as the worker sees it (its own namespace numbers it 2)


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


# --------------------------------------------------------------------------- the worker's side


class SessionHosts:
    """Starts session processes (see the module's doc) and holds their pool users.

    Parameters
    ----------
    lease, end_lease:
        Take a pool user for a tenant and give it back, killing what still runs as it
        (``JobRunner.lease_user`` / ``end_lease``): None from ``lease`` means "as this process's
        user" (the worker does not run as root).
    cuda:
        Whether sessions may be on real GPUs: the forkserver then imports pycuda too.
    staging:
        Bytes of each session's shared copy buffer.
    sandbox, gpu_minors:
        The namespaces session processes run in (None: none) and each GPU's ``/dev/nvidiaN``
        minor number by uuid (default: its index), as for jobs (``JobRunner``).
    make_cgroup:
        Makes the cgroup of a session process (``JobRunner.make_cgroup``: name, grant, granted
        GPUs' minors, prefix), None where there is none; None here: session processes get none.
    """

    def __init__(
        self,
        lease: Callable[[str], pwd.struct_passwd | None],
        end_lease: Callable[[pwd.struct_passwd | None], None],
        *,
        cuda: bool = False,
        staging: int = DEFAULT_STAGING,
        sandbox: Sandbox | None = None,
        gpu_minors: Mapping[str, int] | None = None,
        make_cgroup: Callable[[str, JobGrant, Sequence[int], str], JobCgroup | None] | None = None,
    ) -> None:
        if staging < 4096:
            raise ValueError("staging must be at least 4096 bytes")
        self.lease = lease
        self.end_lease = end_lease
        self.staging = staging
        self.sandbox = sandbox if sandbox is not None and sandbox.active else None
        self.gpu_minors = dict(gpu_minors or {})
        self.make_cgroup = make_cgroup
        self._ctx = multiprocessing.get_context("forkserver")
        preload = ["gpud_worker.session_host", "numpy"]
        if cuda:
            preload += ["gpud_worker.cuda", "pycuda.driver"]
        self._ctx.set_forkserver_preload(preload)

    def start(self, spec: dict[str, Any], user: pwd.struct_passwd | None,
              grant: JobGrant | None = None) -> tuple[Any, Any, mmap.mmap, JobCgroup | None]:
        """Fork a session process for ``spec`` (see ``_serve``) running as ``user`` in a cgroup
        limited by ``grant``; returns the process, the worker's end of its socket pair, the shared
        buffer and its cgroup (None: it has none; the caller removes it after the process)."""
        uuid = spec["gpu"]["uuid"]
        minors = [self.gpu_minors[uuid]] if uuid in self.gpu_minors else []
        cgroup = None
        if self.make_cgroup is not None:
            cgroup = self.make_cgroup(os.urandom(8).hex(), grant or JobGrant(), minors, SESSION_PREFIX)
        try:
            fd = os.memfd_create("gpud-session", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.staging)
                buf = mmap.mmap(fd, self.staging)
                ours, theirs = self._ctx.Pipe(duplex=True)
                ids = None if user is None else (user.pw_uid, user.pw_gid)
                plan = self.sandbox.plan(minors) if self.sandbox is not None else None
                joins = ([_Fd(f) for f in cgroup.procs_fds], cgroup.name) if cgroup is not None else None
                proc = self._ctx.Process(target=_serve, args=(theirs, _Fd(fd), self.staging, spec, ids, plan, joins),
                                         name=f"gpud-session-{spec['gpu']['index']}", daemon=True)
                try:
                    proc.start()  # the forkserver has its own copies of the fds now
                finally:
                    theirs.close()
            finally:
                os.close(fd)
                if cgroup is not None:
                    cgroup.close_fd()
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        return proc, ours, buf, cgroup


class _Fd:
    """A file descriptor handed to a session process: duplicated into it as the process starts
    (``multiprocessing.reduction.DupFd``, made while the forkserver is being asked for it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._dup: Any = None

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.reduction import DupFd

        return {"dup": DupFd(self.fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fd, self._dup = -1, state["dup"]

    def detach(self) -> int:
        return int(self._dup.detach())


class HostedDevice:
    """A device whose sessions each run in a process of their own (``HostedSession``)."""

    def __init__(self, inner: _BaseDevice, hosts: SessionHosts) -> None:
        self.inner = inner
        self.hosts = hosts
        self.gpu: GpuInfo = inner.gpu
        self.simulated: bool = inner.simulated
        self.clock = inner.clock

    def open_session(self, mem_grant: int, mps: Mapping[str, str] | None = None, tenant: str = "default",
                     grant: JobGrant | None = None) -> HostedSession:
        """Start a session process (this waits until its context is made) and return its session;
        ``grant``: the DISPATCH's, whose ``host_mem`` and ``cpu_milli`` limit its cgroup as a job's.
        RemoteError when it cannot start (no pool user free, CUDA refused...)."""
        _check_grant(mem_grant)
        return HostedSession(self, mem_grant, dict(mps or {}), tenant, grant)

    def mem_used(self) -> int:
        """Bytes the sessions hold, counted by the wrapped device (the simulated GPU's state,
        which its heartbeats report, sees them)."""
        return self.inner.mem_used()

    def busy_fraction(self, now: float) -> float:
        return self.inner.busy_fraction(now)


class HostedSession:
    """The worker's side of a session run by a process of its own (see the module's doc).

    Thread-safe: calls run one at a time. ``pid`` and ``uid`` say which process and user run it.
    """

    def __init__(self, device: HostedDevice, mem_grant: int, mps: dict[str, str], tenant: str,
                 grant: JobGrant | None = None) -> None:
        self._device = device
        self._hosts = device.hosts
        self._lock = threading.Lock()
        self._used = 0
        self._closed = False
        self._lost: str | None = None
        self.tenant = tenant
        inner = device.inner
        spec: dict[str, Any] = {
            "backend": "simulated" if device.simulated else "cuda",
            "gpu": gpu_info_to_wire(device.gpu),
            "grant": mem_grant,
            "mps": mps,
            "builtin": None if device.simulated else _builtin_image(inner),
            "log_level": logging.getLogger().getEffectiveLevel(),
        }
        self._user = self._hosts.lease(tenant)
        self._cgroup: JobCgroup | None = None
        try:
            self._proc, self._conn, self._buf, self._cgroup = self._hosts.start(spec, self._user, grant)
            try:
                hello = self._receive(START_TIMEOUT_S)
            except BaseException:
                self._stop(kill=True)
                raise
            if not hello.get("ok"):
                self._stop(kill=True)
                raise RemoteError(f"the session could not start on GPU {device.gpu.uuid}: {hello.get('message')}")
        except BaseException:
            self._hosts.end_lease(self._user)
            raise
        self.pid: int = hello["pid"]
        self.uid: int = hello["uid"]
        log.info("session process %d on GPU %s runs as %s%s", self.pid, device.gpu.uuid,
                 self._user.pw_name if self._user is not None else f"uid {self.uid}",
                 f" in cgroup {self._cgroup.path}" if self._cgroup is not None else "")
        if self._cgroup is not None and hello.get("cgroup"):
            log.warning("session process %d did not enter its cgroup %s (%s): it runs without cgroup limits",
                        self.pid, self._cgroup.path, hello["cgroup"])

    # ---------------------------------------------------------------- the calls

    def alloc(self, nbytes: int) -> int:
        if type(nbytes) is not int or nbytes < 1:
            raise InvalidRequest(f"nbytes must be an int >= 1, got {nbytes!r}")
        with self._lock:
            reply = self._call({"op": "alloc", "nbytes": nbytes})
            self._track(reply["used"])
            return int(reply["handle"])

    def free(self, handle: int) -> None:
        with self._lock:
            self._track(self._call({"op": "free", "handle": handle})["used"])

    def htod(self, handle: int, offset: int, data: Any) -> None:
        view = _byte_view(data)
        with self._lock:
            if type(offset) is not int:
                raise InvalidRequest("offset must be an int")
            step = len(self._buf)
            with self._device.inner._working():
                for pos in range(0, len(view) or 1, step):  # an empty copy still checks its range
                    piece = view[pos : pos + step]
                    self._buf[: len(piece)] = piece
                    self._call({"op": "htod", "handle": handle, "offset": offset + pos, "n": len(piece)})

    def dtoh(self, handle: int, offset: int, nbytes: int | None = None, out: Any = None) -> bytes | memoryview:
        with self._lock:
            if type(offset) is not int:
                raise InvalidRequest("offset must be an int")
            step = len(self._buf)
            with self._device.inner._working():
                first = self._call({"op": "dtoh", "handle": handle, "offset": offset, "nbytes": nbytes})
                total, n = int(first["total"]), int(first["n"])
                dest = memoryview(bytearray(total)) if out is None else _out_view(out, total)
                dest[:n] = self._buf[:n]
                pos = n
                while pos < total:
                    n = min(step, total - pos)
                    self._call({"op": "dtoh", "handle": handle, "offset": offset + pos, "nbytes": n})
                    dest[pos : pos + n] = self._buf[:n]
                    pos += n
            return dest

    def dtoh_lent(self, handle: int, offset: int, nbytes: int | None = None) -> bytes | memoryview:
        """A copy, as ``dtoh``: the session's memory is in its process."""
        return self.dtoh(handle, offset, nbytes)

    def hold(self, view: memoryview, tracker: Any) -> None:
        """Nothing to hold: ``dtoh_lent`` copies."""

    def extent(self, handle: int, offset: int, nbytes: int | None = None) -> int:
        with self._lock:
            return int(self._call({"op": "extent", "handle": handle, "offset": offset, "nbytes": nbytes})["n"])

    def launch(self, module: str, name: str, grid: Dims, block: Dims, args: Sequence[Arg], shared_mem: int = 0) -> None:
        request = {"op": "launch", "module": module, "name": name, "grid": list(grid), "block": list(block),
                   "args": [[tag, value] for tag, value in args], "shared_mem": shared_mem}
        with self._lock, self._device.inner._working():
            self._call(request)

    def load(self, kind: str, name: str, data: Any, options: Sequence[str] = ()) -> dict[str, Any]:
        raw = bytes(_byte_view(data))
        image = None
        if kind == "cuda" and not self._device.simulated:
            # Compiled here, by the worker's device (its module cache; nvcc as an unprivileged
            # user): a session's process compiles nothing. The same checks as the session's first.
            _, _, opts = check_load_args(kind, name, list(options))
            text = decode_text(raw, kind)
            check_cuda_source(text)
            with self._lock:
                self._check_open()
            image = self._device.inner.compile(text, opts)  # type: ignore[attr-defined]
        with self._lock:
            reply = self._call({"op": "load", "kind": kind, "name": name, "data": raw,
                                "options": list(options), "image": image})
            return {"module": reply["module"], "functions": reply["functions"]}

    def sync(self) -> None:
        with self._lock:
            self._call({"op": "sync"})

    def info(self) -> dict[str, Any]:
        with self._lock:
            info: dict[str, Any] = self._call({"op": "info"})["info"]
            return info

    def close(self) -> None:
        """Close the session: its process frees everything and exits (killed if it does not)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._lost is None:
                try:
                    self._exchange({"op": "close"}, CLOSE_TIMEOUT_S)
                except GpudError as exc:
                    log.info("session process %d: close: %s", self.pid, exc.message)
            self._stop(kill=False)
            self._hosts.end_lease(self._user)
            self._track(0)

    def kill(self, why: str) -> None:
        """End the session's process now, from any thread (a call it runs, even a kernel that
        never ends, then gets SESSION_LOST); ``close`` still frees the rest."""
        if self._lost is None:
            self._lost = why
        try:
            self._proc.kill()
        except (OSError, ValueError, AttributeError):
            pass

    # ---------------------------------------------------------------- plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise SessionLost("session closed")
        if self._lost is not None:
            raise SessionLost(f"the session is lost: {self._lost}")

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        """(Lock held) One request and its reply; the reply's error raised as it came."""
        self._check_open()
        reply = self._exchange(request, None)
        if reply.get("lost"):
            self._lost = str(reply["lost"])
        if not reply.get("ok"):
            raise error_for(str(reply.get("code")), str(reply.get("message")))
        return reply

    def _exchange(self, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        try:
            self._conn.send_bytes(_packb(request))
        except OSError:
            self._died()
        return self._receive(timeout)

    def _receive(self, timeout: float | None) -> dict[str, Any]:
        try:
            if timeout is not None and not self._conn.poll(timeout):
                self.kill(f"its process did not answer within {timeout:g} s")
                raise SessionLost(f"the session's process did not answer within {timeout:g} s")
            reply = _unpackb(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._died()
        if type(reply) is not dict:
            raise InternalError("the session's process answered with something that is not a map")
        return reply

    def _died(self) -> Any:
        """The process is gone (its end of the socket pair closed): raise SessionLost saying why."""
        self._proc.join(5)
        code = self._proc.exitcode
        how = ("still running" if code is None else f"killed by {signal.Signals(-code).name}" if code < 0
               else f"exit status {code}")
        if self._cgroup is not None and self._cgroup.oom_kills():
            how += ", for its memory limit"  # the kernel's OOM kill in its cgroup
        why = self._lost or f"its process ended ({how})"
        self._lost = why
        log.warning("session process %s on GPU %s: %s", getattr(self, "pid", "?"), self._device.gpu.uuid, why)
        raise SessionLost(f"the session is lost: {why}")

    def _track(self, used: int) -> None:
        self._device.inner._count(int(used) - self._used)
        self._used = int(used)

    def _stop(self, kill: bool) -> None:
        if kill:
            self.kill(self._lost or "stopped")
        self._proc.join(CLOSE_TIMEOUT_S)
        if self._proc.exitcode is None:
            log.warning("session process %d did not exit: killed", self._proc.pid)
            self._proc.kill()
            self._proc.join(CLOSE_TIMEOUT_S)
        self._conn.close()
        try:
            self._buf.close()
        except BufferError:  # a view of it is still alive somewhere: it goes with the last one
            pass
        if self._cgroup is not None:  # with whatever of it still runs (its sandbox's PID 1, a child)
            oom = self._cgroup.oom_kills()
            if oom:
                log.info("session process %d: %d process(es) killed for its memory limit", self._proc.pid, oom)
            self._cgroup.remove()
            self._cgroup = None


def _builtin_image(device: Any) -> bytes | None:
    """The built-in kernels' cubin for a session's process; None where they cannot be compiled
    (no nvcc): a launch of one then says why, as it does in the worker."""
    try:
        return bytes(device.builtin_image())
    except RemoteError as exc:
        log.warning("GPU %s: the built-in kernels are not compiled: %s", device.gpu.uuid, exc.message)
        return None


# --------------------------------------------------------------------------- the process's side


def _let_go_of_the_worker() -> None:
    """Close what a forkserver child inherits and a session process must not hold: the write end
    of the forkserver's "worker alive" pipe and the resource tracker's. Held here, they would keep
    the forkserver (and so this process, whose death signal is the forkserver's end) alive after
    the worker died, for as long as a kernel of this session ran."""
    from multiprocessing import forkserver, resource_tracker

    for owner, attr in ((forkserver._forkserver, "_forkserver_alive_fd"), (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(owner, attr, None)
        if isinstance(fd, int) and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
            setattr(owner, attr, None)


def _become(ids: tuple[int, int] | None) -> None:
    """In the session's process, before anything of the user's: become the pool user ``ids``
    (none: stay), die with the forkserver, never gain privileges, dump no core."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if ids is not None:
        uid, gid = ids
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.geteuid() == 0 or uid == 0:
            raise PermissionError("refusing to run a session as root")
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")
    if os.getppid() != parent:  # the forkserver died before PDEATHSIG was set
        os._exit(1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _open(spec: dict[str, Any]) -> Any:
    """The session this process serves, on a device of its own."""
    gpu = parse_gpu_info(spec["gpu"])
    grant = int(spec["grant"])
    if spec["backend"] == "simulated":
        from gpud_worker.device import SimulatedDevice

        return SimulatedDevice(gpu).open_session(grant, spec["mps"] or None)
    from gpud_worker.cuda import CudaDevice

    # Only its own GPU is visible here: CUDA ordinal 0. CUDA reads these (and MPS's) at cuInit.
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ.update(spec["mps"] or {})
    device = CudaDevice(gpu, 0, builtin=spec["builtin"], inline=True)  # this thread makes every call
    session = device.open_session(grant, spec["mps"] or None)
    session.sync()  # waits for its context: an error now is the open's, not the first call's
    return session


def _serve(conn: Any, fd: _Fd, staging: int, spec: dict[str, Any], ids: tuple[int, int] | None,
           plan: Plan | None = None, joins: tuple[list[_Fd], str] | None = None) -> None:
    """The body of a session process (forked from the forkserver; see the module's doc);
    ``joins``: the ``cgroup.procs`` fds and the name of its cgroup, entered first."""
    global _PID
    outside = ""  # why it is not in its cgroup
    if joins is not None:
        fds = [f.detach() for f in joins[0]]
        outside = enter(fds, joins[1])
        for f in fds:
            os.close(f)
    _PID = os.getpid()
    logging.basicConfig(level=spec.get("log_level", logging.INFO),
                        format=f"%(asctime)s gpud-session[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in `gpud up` is the worker's to handle
    _let_go_of_the_worker()
    try:
        raw = fd.detach()
        buf = mmap.mmap(raw, staging)
        os.close(raw)
        if plan is not None:  # from here on, the process that serves is PID 2 of its namespace
            _PID = plan.enter(outer_pid=True, keep_handlers=True)
        _become(ids)
        if plan is not None:
            plan.deny_user_namespaces()
        session = _open(spec)
    except Exception as exc:
        text = exc.message if isinstance(exc, GpudError) else f"{type(exc).__name__}: {exc}"
        conn.send_bytes(_packb({"ok": False, "message": text}))
        return
    conn.send_bytes(_packb({"ok": True, "pid": _PID, "uid": os.geteuid(), "cgroup": outside}))
    view = memoryview(buf)
    while True:
        try:
            request = _unpackb(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the worker is gone
        reply = _answer(session, view, request)
        lost = getattr(session, "_lost", None)  # a CUDA session after a sticky error
        if lost:
            reply["lost"] = lost
        conn.send_bytes(_packb(reply))
        if lost or request.get("op") == "close":
            break
    try:
        session.close()
    except Exception:
        log.exception("closing the session failed")


def _answer(session: Any, view: memoryview, r: dict[str, Any]) -> dict[str, Any]:
    op = r.get("op")
    try:
        if op == "alloc":
            return {"ok": True, "handle": session.alloc(r["nbytes"]), "used": session.used}
        if op == "free":
            session.free(r["handle"])
            return {"ok": True, "used": session.used}
        if op == "htod":
            session.htod(r["handle"], r["offset"], view[: r["n"]])
            return {"ok": True}
        if op == "dtoh":
            total = session.extent(r["handle"], r["offset"], r["nbytes"])
            n = min(total, len(view))
            session.dtoh(r["handle"], r["offset"], n, out=view)
            return {"ok": True, "n": n, "total": total}
        if op == "extent":
            return {"ok": True, "n": session.extent(r["handle"], r["offset"], r["nbytes"])}
        if op == "launch":
            args = [(tag, value) for tag, value in r["args"]]
            session.launch(r["module"], r["name"], tuple(r["grid"]), tuple(r["block"]), args, r["shared_mem"])
            return {"ok": True}
        if op == "load":
            kwargs = {"image": r["image"]} if r.get("image") is not None else {}
            return {"ok": True, **session.load(r["kind"], r["name"], r["data"], r["options"], **kwargs)}
        if op == "sync":
            session.sync()
            return {"ok": True}
        if op == "info":
            info = session.info()
            info["process"] = {"pid": _PID, "uid": os.geteuid()}
            return {"ok": True, "info": info}
        if op == "close":
            return {"ok": True}
        raise InvalidRequest(f"unknown session op {op!r}")
    except GpudError as exc:
        return {"ok": False, "code": exc.code, "message": exc.message}
    except Exception as exc:
        log.exception("session op %s failed", op)
        return {"ok": False, "code": "INTERNAL", "message": f"session op {op!r} failed: {type(exc).__name__}"}
