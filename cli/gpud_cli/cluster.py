"""A local cluster: one broker (or a Binary Star pair) and N workers as child processes on loopback
(``gpud up``, tests).

Endpoints are bound by the broker itself (``tcp://127.0.0.1:*``) and read back from its ready file;
readiness has a deadline and fails fast, with the child's log, when a child exits early.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from gpud import protocol
from gpud.errors import GpudError, Timeout, error_for
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, keygen
from gpud_cli.uid_ranges import UidBlocks


def admin_call(endpoint: str, cmd: str, args: dict[str, Any] | None = None, timeout: float = 5.0,
               ctx: zmq.Context[Any] | None = None) -> Any:
    """One admin request: send ADMIN, wait for its REPLY, return ``result`` or raise its error."""
    ctx = ctx or zmq.Context.instance()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        rid = protocol.new_id()
        header = {"id": rid, "cmd": cmd, "args": args or {}, "user": "gpud.cluster", "pid": os.getpid()}
        sock.send_multipart(protocol.encode(Peer.ADMIN, Command.ADMIN, header))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise Timeout(f"the broker's admin socket {endpoint} did not answer within {timeout:g}s")
            msg = protocol.decode(sock.recv_multipart(), Peer.ADMIN)
            reply = msg.header
            if msg.command is Command.ERROR:
                raise error_for(str(reply.get("code")), str(reply.get("message")))
            if msg.command is not Command.REPLY or reply.get("id") != rid:
                continue
            if reply.get("ok") is not True:
                raise error_for(str(reply.get("code")), str(reply.get("message")))
            return reply.get("result")
    finally:
        sock.close(0)


@dataclass
class LocalCluster:
    """Broker + workers as subprocesses. Use as a context manager or call start()/stop()."""

    workers: int = 1
    gpus_per_worker: int = 1
    simulate: bool = True
    heartbeat_ms: int = 1000
    liveness: int = 3
    broker_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    rundir: Path | None = None
    log_level: str = "INFO"
    env: dict[str, str] | None = None
    # Pool users of worker NAME are those named ``{job_user_prefix}{NAME}-*``: workers on one host
    # must not share pool users (a worker kills every process of a user after each job).
    job_user_prefix: str | None = None
    # Otherwise, as root, each worker runs jobs under 16 dynamic uids of its own (no accounts
    # needed), a block from this uid up that no other cluster on the host holds (gpud_cli.uid_ranges).
    dynamic_uid_base: int = 61184
    pool_size: int = 16  # of those, how many a worker uses (1 to 16)
    # A command the workers are started under (``setpriv ...`` in a test of a worker with fewer
    # capabilities); default: none.
    worker_prefix: list[str] = field(default_factory=list)
    # "none" (passed explicitly: loopback only, no keys) or "curve": a throwaway key set under
    # ``keys_dir`` (default RUNDIR/keys): the broker's pair, one per worker, and clients' keys
    # made by ``client_keys(tenant)``.
    security: str = "none"
    keys_dir: Path | None = None
    # A Binary Star pair ("primary" and "backup") instead of one broker: workers connect to both,
    # ``frontends`` lists both for clients; ``kill_broker``/``restart_broker`` act on one.
    pair: bool = False
    # Per broker role: a network namespace to run it in (``ip netns exec``), the address its
    # frontend and backend bind, and the address of its peer socket (tests that cut the link
    # between the two brokers). Default: this namespace, loopback.
    broker_netns: dict[str, str] = field(default_factory=dict)
    broker_hosts: dict[str, str] = field(default_factory=dict)
    peer_hosts: dict[str, str] = field(default_factory=dict)
    # Each worker binds a data socket on loopback (an ephemeral port), so sessions call it
    # directly (PROTOCOL.md §10); False: no data socket, every CALL relayed by the broker.
    direct: bool = True

    def __post_init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.broker: subprocess.Popen[bytes] | None = None
        self.brokers: dict[str, subprocess.Popen[bytes]] = {}  # by role ("broker" when not a pair)
        self.broker_endpoints: dict[str, dict[str, Any]] = {}  # by role, from the ready files
        self._broker_argv: dict[str, list[str]] = {}
        self.worker_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.endpoints: dict[str, Any] = {}
        self.uid_blocks: dict[str, range] = {}  # worker name -> its dynamic uids
        self._uids = UidBlocks(self.dynamic_uid_base)

    @property
    def roles(self) -> list[str]:
        return ["primary", "backup"] if self.pair else ["broker"]

    @property
    def frontends(self) -> list[str]:
        """Every broker's frontend (primary first): what a client is given."""
        return [str(self.broker_endpoints[r]["frontend"]) for r in self.roles]

    def admin_of(self, role: str) -> str:
        assert self.rundir is not None
        return f"ipc://{self.rundir}/admin-{role}.sock" if self.pair else self.admin

    @property
    def frontend(self) -> str:
        return str(self.endpoints["frontend"])

    @property
    def backend(self) -> str:
        return str(self.endpoints["backend"])

    @property
    def admin(self) -> str:
        return str(self.endpoints["admin"])

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()  # what started before the failure does not outlive it
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        assert self.rundir is not None
        env = dict(os.environ, GPUD_LOG_LEVEL=self.log_level, PYTHONUNBUFFERED="1")
        if self.env:
            env.update(self.env)
        fd = os.open(self.rundir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        ns = self.broker_netns.get(name)
        prefix = ["ip", "netns", "exec", ns] if ns else [] if name in self.roles else self.worker_prefix
        try:
            return subprocess.Popen([*prefix, sys.executable, "-m", "gpud_cli", *args], stdout=fd,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(fd)

    def log_tail(self, name: str, lines: int = 30) -> str:
        assert self.rundir is not None
        path = self.rundir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def start(self, timeout: float = 30.0) -> None:
        if self.rundir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gpud-up-")
            self.rundir = Path(self._tmp.name)
        # Pool users must reach their job directories below it; nobody may list it.
        os.chmod(self.rundir, 0o711)
        deadline = time.monotonic() + timeout
        if self.pair:
            peers = {role: f"tcp://{self.peer_hosts[role]}:5557" if role in self.peer_hosts
                     else f"tcp://127.0.0.1:{_free_port()}" for role in self.roles}
            for role, other in (("primary", "backup"), ("backup", "primary")):
                self._broker_argv[role] = [
                    "broker", "--name", role, "--admin", f"ipc://{self.rundir}/admin-{role}.sock",
                    "--role", role, "--peer", peers[other], "--peer-bind", peers[role]]
        else:
            self._broker_argv["broker"] = ["broker", "--admin", f"ipc://{self.rundir}/admin.sock"]
        for role in self.roles:
            host = self.broker_hosts.get(role, "127.0.0.1")
            self._start_broker(role, f"tcp://{host}:*", f"tcp://{host}:*")
        for role in self.roles:
            self._wait_broker(role, deadline)
        self.endpoints = self.broker_endpoints[self.roles[0]]
        for i in range(self.workers):
            self.add_worker(f"w{i}")
        self.wait_workers(self.workers, timeout=max(1.0, deadline - time.monotonic()))

    def _start_broker(self, role: str, frontend: str, backend: str) -> None:
        assert self.rundir is not None
        ready = self.rundir / f"{role}.json"
        ready.unlink(missing_ok=True)
        proc = self._spawn(role, [
            *self._broker_argv[role], "--frontend", frontend, "--backend", backend, "--ready-file", str(ready),
            "--heartbeat-ms", str(self.heartbeat_ms), "--liveness", str(self.liveness),
            "--spool-dir", str(self.rundir / f"spool-{role}"),  # removed with the cluster, even after a SIGKILL
            *self._security_args("broker"), *self.broker_args,
        ])
        self.brokers[role] = proc
        if role in ("broker", "primary"):
            self.broker = proc

    def _wait_broker(self, role: str, deadline: float) -> None:
        assert self.rundir is not None
        ready = self.rundir / f"{role}.json"
        while not ready.exists():
            self._check_alive(role, self.brokers[role])
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {role} broker did not become ready in time:\n" + self.log_tail(role))
            time.sleep(0.02)
        self.broker_endpoints[role] = json.loads(ready.read_text())

    def kill_broker(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Signal broker ``role`` (default SIGKILL) and wait for it to exit."""
        proc = self.brokers[role]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def restart_broker(self, role: str, timeout: float = 30.0) -> None:
        """Start broker ``role`` again on the same endpoints (after ``kill_broker``)."""
        ep = self.broker_endpoints[role]
        self._start_broker(role, str(ep["frontend"]), str(ep["backend"]))
        self._wait_broker(role, time.monotonic() + timeout)

    def pair_state(self, role: str, timeout: float = 2.0) -> dict[str, Any]:
        """The ``pair`` part of broker ``role``'s status (state, epoch, peer...)."""
        st = admin_call(self.admin_of(role), "status", timeout=timeout)
        assert isinstance(st, dict)
        return dict(st.get("pair") or {})

    def wait_active(self, timeout: float = 30.0) -> str:
        """Wait until exactly one broker of the pair says it is active (and has settled); its role."""
        deadline = time.monotonic() + timeout
        while True:
            active = []
            for role in self.roles:
                if self.brokers[role].poll() is not None:
                    continue
                try:
                    p = self.pair_state(role)
                except GpudError:
                    continue
                if p.get("state") == "active" and not p.get("settling"):
                    active.append(role)
            if len(active) == 1:
                return active[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no single active broker in time (active: {active})")
            time.sleep(0.05)

    # ------------------------------------------------------------------ keys (security "curve")

    @property
    def keys(self) -> Path:
        """The key set: broker.key(_secret), workers/, clients/TENANT/, private/ (secrets)."""
        if self.keys_dir is not None:
            return self.keys_dir
        assert self.rundir is not None, "start() first, or set keys_dir"
        return self.rundir / "keys"

    def _security_args(self, who: str, worker_key: str | None = None) -> list[str]:
        if self.security != "curve":
            return ["--security", "none"]
        keys = self.keys
        if who == "broker":
            if not (keys / "broker.key_secret").exists():
                keys.mkdir(mode=0o700, parents=True, exist_ok=True)
                keygen(keys, "broker")
                for d in ("workers", "clients", "private"):
                    (keys / d).mkdir(mode=0o700, exist_ok=True)
            return ["--security", "curve", "--keys-dir", str(keys)]
        return ["--security", "curve", "--keys-dir", str(keys), "--key-file", str(worker_key)]

    def _pair(self, name: str, allow_in: Path | None) -> Path:
        """A new pair private/NAME.key_secret; its public key copied into ``allow_in``."""
        private = self.keys / "private"
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        public, secret = keygen(private, name, overwrite=True)
        if allow_in is not None:
            allow_in.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copy(public, allow_in / public.name)
        return secret

    def client_keys(self, tenant: str, name: str | None = None, allowed: bool = True) -> CurveKeys:
        """Keys of a new client of ``tenant`` (``allowed``: its public key goes into the broker's
        clients/TENANT/ allow-list; otherwise the broker does not know it)."""
        name = name or f"client-{tenant}-{os.urandom(4).hex()}"
        secret = self._pair(name, self.keys / "clients" / tenant if allowed else None)
        return CurveKeys.from_files(secret, self.keys / "broker.key")

    def add_worker(self, name: str, extra: list[str] | None = None, allowed: bool = True) -> subprocess.Popen[bytes]:
        """Start worker ``name``. With CURVE it gets a key pair of its own, in the broker's
        allow-list unless not ``allowed``."""
        assert self.rundir is not None
        brokers = [a for role in self.roles for a in ("--broker", str(self.broker_endpoints[role]["backend"]))]
        args = ["worker", *brokers, "--name", name, "--workdir", str(self.rundir / f"jobs-{name}"),
                "--heartbeat-ms", str(self.heartbeat_ms), "--liveness", str(self.liveness)]
        if self.security == "curve":
            args += self._security_args("worker", str(self._pair(name, self.keys / "workers" if allowed else None)))
        else:
            args += self._security_args("worker")
        if self.job_user_prefix:
            args += ["--job-user-prefix", f"{self.job_user_prefix}{name}-"]
        elif os.geteuid() == 0:
            block = self.uid_blocks.get(name) or self.uid_blocks.setdefault(name, self._uids.take())
            args += ["--job-uids", f"{block.start}-{block.start + max(1, min(self.pool_size, len(block))) - 1}"]
        if self.simulate:
            args += ["--simulate", str(self.gpus_per_worker)]
        if self.direct:
            args += ["--data-bind", "tcp://127.0.0.1:*"]
        proc = self._spawn(name, [*args, *self.worker_args, *(extra or [])])
        self.worker_procs[name] = proc
        return proc

    def _check_alive(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n" + self.log_tail(name))

    def status(self, timeout: float = 5.0, role: str | None = None) -> dict[str, Any]:
        result = admin_call(self.admin_of(role) if role else self.admin, "status", timeout=timeout)
        assert isinstance(result, dict)
        return result

    def wait_workers(self, n: int, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the broker counts exactly ``n`` workers; returns that status."""
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.worker_procs.items():
                self._check_alive(name, proc)
            live = [r for r, proc in self.brokers.items() if proc.poll() is None]
            if not live:
                self._check_alive(self.roles[0], self.brokers[self.roles[0]])
            try:
                sts = [self.status(timeout=2.0, role=r) for r in live]
                if all(st["counts"]["workers"] == n for st in sts):
                    return sts[0]
            except GpudError:
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {w}\n{self.log_tail(w, 10)}" for w in self.worker_procs)
                raise RuntimeError(f"the broker did not count {n} workers in time:\n{tails}")
            time.sleep(0.05)

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.worker_procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every child (workers first), wait, SIGKILL stragglers; returns exit codes."""
        procs = {**self.worker_procs, **self.brokers}
        codes = dict(zip(procs, terminate(list(procs.values()), timeout), strict=True))
        self.worker_procs.clear()
        self.brokers.clear()
        self.broker = None
        self._uids.close()
        self.uid_blocks.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.rundir = None
        return codes


def terminate(procs: list[subprocess.Popen[bytes]], timeout: float = 15.0) -> list[int | None]:
    """SIGTERM every process still running, wait for all (``timeout`` in all), SIGKILL the
    stragglers; their exit codes, in order."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the pair's peer endpoints, which each broker must
    know of the other before either starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
