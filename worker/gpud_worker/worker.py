"""The worker daemon's connection to its broker(s) and its dispatch of work to executors.

One thread owns the sockets: it sends READY and heartbeats, receives DISPATCH, runs echo inline and
hands jobs and session operations to executor threads. Executors never touch a socket: they put
their RESULT frames on a queue and wake the loop through a pipe, so no GPU call or job wait can ever
delay a heartbeat.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from gpud import notify
from gpud import protocol as P
from gpud.errors import (
    GpudError,
    InternalError,
    InvalidRequest,
    RemoteError,
    SessionLost,
    ShuttingDown,
)
from gpud.heartbeat import HeartbeatPolicy, Liveness
from gpud.protocol import Command, Peer
from gpud.resources import GpuInfo
from gpud.security import HANDSHAKE_FAILURES, CurveKeys, HandshakeLog, apply_client_keys
from gpud.sockets import NOBLOCK, recv_frames, send_frames
from gpud_worker.device import Device, DeviceSession
from gpud_worker.gpu import GpuProbe
from gpud_worker.jobs import JobRunner

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.02  # how often liveness, heartbeats and idle sessions are looked at
_SIG = Peer.WORKER.value
_RESULT = P.CMD_BYTES[Command.RESULT]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    name: str
    brokers: tuple[str, ...]
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    slots: int = 64
    cpu_milli: int = 0
    host_mem: int = 0
    session_idle: float = 600.0  # seconds a session may see no operation before the worker reclaims it
    drain_timeout: float = 30.0  # seconds running work may take to finish after SIGTERM
    reconnect_min: float = 0.1  # first reconnect delay, doubled up to reconnect_max
    reconnect_max: float = 5.0
    curve: CurveKeys | None = None  # CURVE keys (ours and the broker's); None: security none


class BrokerLink:
    """One DEALER connection to one broker, with its liveness and reconnect backoff."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, policy: HeartbeatPolicy, now: float,
                 curve: CurveKeys | None = None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.policy = policy
        self.curve = curve
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None  # handshake failures (CURVE only)
        self.handshakes = HandshakeLog("broker", skip_auth=False)
        self.liveness = Liveness(policy, now)
        self.welcomed = False
        self.backoff = 0.0
        self.retry_at = now

    def open(self, now: float) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if self.curve is not None:
            apply_client_keys(sock, self.curve)
            self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        sock.connect(self.endpoint)
        self.sock = sock
        self.welcomed = False
        self.liveness = Liveness(self.policy, now)
        return sock

    def check_handshakes(self) -> None:
        """Log failed CURVE handshakes (the broker refused our key, or we have the wrong one of its)."""
        if self.monitor is not None:
            self.handshakes.drain(self.monitor)

    def close(self) -> None:
        if self.sock is not None:
            if self.monitor is not None:
                self.check_handshakes()
                self.sock.disable_monitor()
                self.monitor.close(0)
                self.monitor = None
            self.sock.close(0)
            self.sock = None


class SessionRunner:
    """A device session and the thread that runs its operations in order."""

    def __init__(self, sid: bytes, dev_session: DeviceSession, gpu: GpuInfo, tenant: str) -> None:
        self.id = sid
        self.dev = dev_session
        self.gpu = gpu
        self.tenant = tenant
        self.ops: queue.SimpleQueue[tuple[int, dict[str, Any], list[Any]] | None] = queue.SimpleQueue()
        self.opened = self.last_used = time.monotonic()
        self.closed = False
        self.thread: threading.Thread | None = None


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        probe: GpuProbe,
        devices: dict[str, Device],
        runner: JobRunner,
        ctx: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.probe = probe
        self.gpus = {g.uuid: g for g in probe.inventory()}
        self.devices = devices
        self.runner = runner
        self.ctx = ctx or zmq.Context.instance()
        now = time.monotonic()
        self.links = [BrokerLink(self.ctx, ep, config.heartbeat, now, config.curve) for ep in config.brokers]
        self.jobs = ThreadPoolExecutor(max_workers=config.slots, thread_name_prefix="job")
        self.sessions: dict[bytes, SessionRunner] = {}
        self.running: dict[bytes, tuple[str, float, list[str]]] = {}  # id -> kind, since, gpus
        self.results: queue.SimpleQueue[tuple[int, bytes, list[Any]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self.draining = False
        self._reload_requested = False
        self._seq = itertools.count(1)

    # ---------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Begin a graceful stop: take no new work, let running work finish, say goodbye."""
        self._stop.set()
        self._wake()

    def request_reload(self) -> None:
        """Have the loop call ``reload()`` soon (SIGHUP). Safe from a signal handler."""
        self._reload_requested = True
        self._wake()

    def reload(self) -> None:
        """Re-read the configuration (SIGHUP), in the loop's thread. Nothing is re-read yet: the
        worker keeps its start-up configuration. Tells systemd RELOADING=1, then READY=1."""
        notify.reloading()
        log.info("reload requested: nothing is re-read yet; the worker keeps its start-up configuration")
        notify.ready()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def ready_header(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "hostname": socket.gethostname(),
            "gpus": [P.gpu_info_to_wire(g) for g in self.gpus.values()],
            "cpu_milli": self.config.cpu_milli,
            "host_mem": self.config.host_mem,
            "slots": self.config.slots,
            "heartbeat_ms": int(self.config.heartbeat.interval * 1000),
            "liveness": self.config.heartbeat.liveness,
            "simulated": self.probe.simulated,
        }

    def run(self) -> None:
        """Serve until stop(); then drain for at most ``drain_timeout`` and disconnect."""
        try:
            self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        drain_deadline: float | None = None
        next_housekeeping = 0.0
        busy = False
        watchdog = notify.watchdog_interval()
        ping_every = watchdog / 2 if watchdog else None  # systemd's advice: half the timeout
        next_ping = 0.0
        # READY once started (GPUs found, job runner ready, about to connect), not once a broker
        # welcomes us: a worker waiting for its brokers is doing its job, and systemd must not
        # fail the unit for it. STATUS= says whether it is registered.
        notify.ready(f"connecting to {', '.join(link.endpoint for link in self.links)}")
        while True:
            now = time.monotonic()
            for link in self.links:
                if link.sock is None and now >= link.retry_at:
                    poller.register(link.open(now), zmq.POLLIN)
                    self._send(link, Command.READY, self.ready_header())
                    log.info("connecting to broker %s", link.endpoint)
            if self._stop.is_set():
                if drain_deadline is None:
                    log.info("stopping: draining %d running task(s), %d session(s)", len(self.running), len(self.sessions))
                    self.draining = True
                    drain_deadline = now + self.config.drain_timeout
                    self._beat_all(now)
                if not self.running or now >= drain_deadline:
                    return
            # Poll only after a round that found nothing to do: while work keeps coming, reading
            # until empty costs fewer system calls than a poll per round.
            if not busy:
                if self._wake_r in dict(poller.poll(50)):
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
            busy = False
            if not self.results.empty():
                self._flush_results()
                busy = True
            for i, link in enumerate(self.links):
                sock = link.sock
                if sock is not None and self._drain(i, link, sock, poller):
                    busy = True
            now = time.monotonic()
            if now < next_housekeeping:
                continue
            next_housekeeping = now + HOUSEKEEPING_S
            # Only from here: a loop that stops turning stops pinging, and systemd restarts it.
            if ping_every is not None and now >= next_ping:
                notify.watchdog()
                next_ping = now + ping_every
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            for link in self.links:
                if link.sock is None:
                    continue
                if link.monitor is not None:
                    link.check_handshakes()
                if link.liveness.expired(now):
                    log.warning("broker %s silent for %.1fs; reconnecting", link.endpoint, link.liveness.silence(now))
                    self._reconnect(link, poller, now)
                elif link.liveness.beat_due(now):
                    self._beat(link, now)
            self._reclaim_idle_sessions()

    def _reconnect(self, link: BrokerLink, poller: zmq.Poller, now: float) -> None:
        if link.sock is not None:
            poller.unregister(link.sock)
        link.close()
        cfg = self.config
        link.backoff = cfg.reconnect_min if link.backoff == 0 else min(link.backoff * 2, cfg.reconnect_max)
        link.retry_at = now + link.backoff * (0.5 + random.random() / 2)

    def _shutdown(self) -> None:
        for s in list(self.sessions.values()):
            self._close_session(s)
        for link in self.links:
            if link.sock is not None:
                self._send(link, Command.DISCONNECT, {"reason": "worker stopping"})
            link.close()
        self.jobs.shutdown(wait=False, cancel_futures=True)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.probe.close()
        log.info("worker %s stopped", self.config.name)

    # ---------------------------------------------------------------- socket side

    def _send(self, link: BrokerLink, cmd: Command, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        if link.sock is not None:
            send_frames(link.sock, P.encode(Peer.WORKER, cmd, header, frames))

    def _beat_all(self, now: float) -> None:
        for link in self.links:
            if link.sock is not None:
                self._beat(link, now)

    def _beat(self, link: BrokerLink, now: float) -> None:
        seq = link.liveness.sent(now)
        try:
            states = self.probe.states()
        except Exception:
            log.exception("GPU probe failed; heartbeat carries no GPU state")
            states = {}
        gpus = [P.gpu_state_to_wire(u, s) for u, s in states.items()]
        running = [{"id": rid, "kind": kind, "since": round(now - since, 3)} for rid, (kind, since, _) in self.running.items()]
        running += [{"id": s.id, "kind": "session", "since": round(now - s.opened, 3)} for s in self.sessions.values()]
        header: dict[str, Any] = {"seq": seq, "gpus": gpus, "running": running, "simulated": self.probe.simulated}
        if self.draining:
            header["draining"] = True
        self._send(link, Command.HEARTBEAT, header)

    def _drain(self, idx: int, link: BrokerLink, sock: zmq.Socket[bytes], poller: zmq.Poller) -> int:
        """Handle up to 256 queued messages from one broker; returns how many there were."""
        for n in range(256):
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=3)
            except zmq.Again:
                return n
            now = time.monotonic()
            link.liveness.heard(now)
            try:
                msg = P.decode(frames, Peer.WORKER)
                self._on_broker(idx, link, msg, poller, now)
            except GpudError as exc:
                log.warning("bad message from broker %s: %s %s", link.endpoint, exc.code, exc.message)
            except Exception:
                log.exception("bug while handling a broker message")
            if link.sock is not sock:
                return n + 1
        return 256

    def _on_broker(self, idx: int, link: BrokerLink, msg: P.Message, poller: zmq.Poller, now: float) -> None:
        cmd = msg.command
        h = msg.header
        if cmd is Command.DISPATCH:
            self._on_dispatch(idx, link, h, msg.frames, now)
        elif cmd is Command.HEARTBEAT:
            pass
        elif cmd is Command.WELCOME:
            hb = h.get("heartbeat_ms")
            lv = h.get("liveness")
            if type(hb) is int and type(lv) is int and hb > 0 and lv > 0:
                link.liveness.policy = HeartbeatPolicy(hb / 1000.0, lv)
            link.welcomed = True
            link.backoff = 0.0
            log.info("registered with broker %s (heartbeat %dms x %s)", link.endpoint, hb, lv)
            notify.status(f"registered with {link.endpoint}")
            self._beat(link, now)
        elif cmd is Command.DISCONNECT:
            reason = h.get("reason")
            log.warning("broker %s disconnected us (%s); reconnecting", link.endpoint, reason)
            self._reconnect(link, poller, now)
        elif cmd is Command.ERROR:
            log.warning("broker %s reports an error: %s %s", link.endpoint, h.get("code"), h.get("message"))
        else:
            log.warning("unexpected %s from broker %s", cmd.name, link.endpoint)

    def _flush_results(self) -> None:
        while True:
            try:
                idx, rid, frames = self.results.get_nowait()
            except queue.Empty:
                return
            self.running.pop(rid, None)
            sock = self.links[idx].sock
            if sock is not None:
                send_frames(sock, frames)

    # ---------------------------------------------------------------- work

    def _result(self, idx: int, rid: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        """Queue a RESULT from any thread; the loop sends it."""
        header["id"] = rid
        header.setdefault("worker", self.config.name)
        self.results.put((idx, rid, [_SIG, _RESULT, P.packb(header), *frames]))
        self._wake()

    def _error(self, idx: int, rid: bytes, exc: GpudError) -> None:
        self._result(idx, rid, P.error_header(rid, exc))

    def _on_dispatch(self, idx: int, link: BrokerLink, h: dict[str, Any], frames: list[Any], now: float) -> None:
        rid = P.get_id(h)
        kind = h.get("kind")
        if kind == "call":
            self._on_call(idx, rid, h, frames)
            return
        try:
            if self.draining:
                raise ShuttingDown(f"worker {self.config.name} is stopping")
            grant = h.get("grant")
            if type(grant) is not dict:
                raise InvalidRequest("DISPATCH needs 'grant'")
            uuids = grant.get("gpus")
            if type(uuids) is not list or not uuids or not all(u in self.gpus for u in uuids):
                raise InvalidRequest("the grant names GPUs this worker does not have")
            mem = grant.get("mem", 0)
            if type(mem) is not int or mem < 0:
                raise InvalidRequest("grant 'mem' must be a non-negative int")
            tenant = h.get("tenant", "default")
            if type(tenant) is not str:
                raise InvalidRequest("'tenant' must be a string")
        except GpudError as exc:
            self._send_now(idx, rid, P.error_header(rid, exc))
            return
        if kind == "echo":
            self._send_now(idx, rid, {"id": rid, "ok": True, "worker": self.config.name, "gpus": uuids}, frames)
            return
        self.running[rid] = (str(kind), now, uuids)
        if kind == "job":
            self.jobs.submit(self._run_job, idx, rid, h, frames, uuids, tenant)
        elif kind == "session":
            self._open_session(idx, rid, uuids[0], mem, tenant)
        else:
            self.running.pop(rid, None)
            self._send_now(idx, rid, P.error_header(rid, InvalidRequest(f"unknown kind {kind!r}")))

    def _send_now(self, idx: int, rid: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        header.setdefault("worker", self.config.name)
        self._send(self.links[idx], Command.RESULT, header, frames)

    def _run_job(self, idx: int, rid: bytes, h: dict[str, Any], frames: list[Any], uuids: list[str], tenant: str) -> None:
        try:
            spec = P.parse_job(h, len(frames))
            visible = ",".join(self._visible_name(u) for u in uuids)
            out = self.runner.run(rid, spec, [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames], visible, tenant)
            header = {
                "ok": True,
                "exit_code": out.exit_code,
                "timed_out": out.timed_out,
                "stdout_truncated": out.stdout_truncated,
                "stderr_truncated": out.stderr_truncated,
                "files": [name for name, _ in out.files],
                "gpus": uuids,
                "user": out.user,
            }
            self._result(idx, rid, header, [out.stdout, out.stderr, *(data for _, data in out.files)])
        except GpudError as exc:
            self._error(idx, rid, exc)
        except Exception as exc:
            log.exception("job %s failed in the worker", P.id_text(rid))
            self._error(idx, rid, InternalError(f"the worker failed to run the job: {exc.__class__.__name__}"))

    def _visible_name(self, uuid: str) -> str:
        g = self.gpus[uuid]
        return str(g.index) if g.simulated else g.uuid

    # ---------------------------------------------------------------- sessions

    def _open_session(self, idx: int, rid: bytes, uuid: str, mem: int, tenant: str) -> None:
        device = self.devices.get(uuid)
        try:
            if device is None:
                raise RemoteError("sessions on this GPU need the pycuda device backend (extra 'cuda'), which this worker lacks")
            dev_session = device.open_session(mem)
        except GpudError as exc:
            self.running.pop(rid, None)
            self._send_now(idx, rid, P.error_header(rid, exc))
            return
        s = SessionRunner(rid, dev_session, self.gpus[uuid], tenant)
        s.thread = threading.Thread(target=self._session_thread, args=(s,), name=f"session-{rid.hex()[:8]}", daemon=True)
        s.thread.start()
        self.sessions[rid] = s
        self.running.pop(rid, None)
        log.info("session %s opened on GPU %s (%d bytes granted)", P.id_text(rid), uuid, mem)
        self._send_now(idx, rid, {"id": rid, "ok": True, "session": rid, "gpu": P.gpu_info_to_wire(self.gpus[uuid])})

    def _on_call(self, idx: int, rid: bytes, h: dict[str, Any], frames: list[Any]) -> None:
        sid = h.get("session")
        s = self.sessions.get(sid) if type(sid) is bytes else None
        if s is None or s.closed:
            self._send_now(idx, rid, P.error_header(rid, SessionLost("the session is not open on this worker")))
            return
        s.last_used = time.monotonic()
        if h.get("op") == "close":
            s.closed = True
            del self.sessions[s.id]
        s.ops.put((idx, h, frames))

    def _session_thread(self, s: SessionRunner) -> None:
        while True:
            item = s.ops.get()
            if item is None:
                break
            idx, h, frames = item
            rid: bytes = h["id"]
            op = h.get("op")
            try:
                header, out = self._session_op(s, op, h.get("args") or {}, frames)
                header["ok"] = True
                self._result(idx, rid, header, out)
            except GpudError as exc:
                self._error(idx, rid, exc)
            except Exception as exc:
                log.exception("session op %s failed", op)
                self._error(idx, rid, InternalError(f"session op {op!r} failed in the worker: {exc.__class__.__name__}"))
            if op == "close":
                break
        s.dev.close()

    def _session_op(self, s: SessionRunner, op: Any, args: Any, frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        if type(args) is not dict:
            raise InvalidRequest("'args' must be a map")
        dev = s.dev
        if op == "alloc":
            return {"handle": dev.alloc(P.req(args, "nbytes", int))}, []
        if op == "free":
            dev.free(P.req(args, "handle", int))
            return {}, []
        if op == "htod":
            if len(frames) != 1:
                raise InvalidRequest("htod carries exactly one payload frame")
            f = frames[0]
            dev.htod(P.req(args, "handle", int), P.opt(args, "offset", int, 0), memoryview(f.buffer if hasattr(f, "buffer") else f))
            return {}, []
        if op == "dtoh":
            data = dev.dtoh(P.req(args, "handle", int), P.opt(args, "offset", int, 0), P.opt(args, "nbytes", int, None))
            return {}, [data]
        if op == "launch":
            module = P.opt(args, "module", str, P.BUILTIN_MODULE)
            name = P.req(args, "name", str)
            grid = P.parse_dims(args.get("grid", [1]), "grid")
            block = P.parse_dims(args.get("block", [1]), "block")
            kargs = P.parse_launch_args(args.get("args", []))
            shared = P.opt(args, "shared_mem", int, 0)
            dev.launch(module, name, grid, block, kargs, shared)
            return {}, []
        if op == "sync":
            dev.sync()
            return {}, []
        if op == "info":
            return dict(dev.info()), []
        if op == "close":
            return {}, []
        raise InvalidRequest(f"unknown session op {op!r}")

    def _close_session(self, s: SessionRunner) -> None:
        s.closed = True
        self.sessions.pop(s.id, None)
        s.ops.put(None)

    def _reclaim_idle_sessions(self) -> None:
        limit = time.monotonic() - self.config.session_idle
        for s in list(self.sessions.values()):
            if s.last_used < limit:
                log.info("session %s idle past %.0fs; reclaimed", P.id_text(s.id), self.config.session_idle)
                self._close_session(s)


def _on_stop_signal(worker: Worker) -> None:
    notify.stopping()
    worker.stop()


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM/SIGINT drain and stop (STOPPING=1 to systemd); SIGHUP calls ``Worker.reload``."""
    signal.signal(signal.SIGTERM, lambda *_: _on_stop_signal(worker))
    signal.signal(signal.SIGINT, lambda *_: _on_stop_signal(worker))
    signal.signal(signal.SIGHUP, lambda *_: worker.request_reload())


def default_workroot() -> Path:
    return Path("/var/lib/gpud/jobs") if os.geteuid() == 0 else Path(os.environ.get("TMPDIR", "/tmp")) / f"gpud-jobs-{os.getuid()}"
