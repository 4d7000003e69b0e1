"""The worker daemon's connection to its broker(s) and its dispatch of work to executors.

One thread owns the broker links: it sends READY and heartbeats, receives DISPATCH, runs echo
inline and hands jobs and session operations to executor threads. Executors never touch its
sockets: they put their RESULT frames on a queue and wake the loop through a pipe, so no GPU call or
job wait can ever delay a heartbeat. A direct session's thread has a socket of its own
(``gpud_worker.data.SessionSocket``): its client's CALLs are received, run and answered there.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import select
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from gpud import notify, protocol
from gpud.errors import (
    GpudError,
    GpuFault,
    InternalError,
    InvalidRequest,
    NotActive,
    RemoteError,
    SessionLost,
    ShuttingDown,
    TooLarge,
)
from gpud.heartbeat import HeartbeatPolicy, Liveness
from gpud.protocol import Command, Peer
from gpud.resources import GpuInfo
from gpud.security import HANDSHAKE_FAILURES, CurveKeys, HandshakeLog, apply_client_keys
from gpud.sockets import NOBLOCK, recv_frames, send_frames
from gpud_worker.data import DataSocket, SessionSocket
from gpud_worker.device import Device, DeviceSession
from gpud_worker.fetch import Fetch, FetchAbandoned, StagedFile, data_context
from gpud_worker.gpu import GpuProbe
from gpud_worker.held_outputs import HeldOutputs
from gpud_worker.jobs import JobGrant, JobOutcome, JobRunner

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.02  # how often liveness, heartbeats and idle sessions are looked at
UNACKED_TTL_S = 600.0  # seconds a RESULT is kept for a broker that never ACKs it
GOODBYE_LINGER_MS = 1000  # how long a stopping worker's DISCONNECT may wait for its connection
MAX_OUTPUT_FETCH = 16 << 20  # the most one broker FETCH of staged outputs is answered (gpud's ask 1 MiB)
DATA_DRAIN = 64  # messages of a data connection handled per loop turn at most (each a chunk, 1 MiB)
POLL_EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

# Where a session call's answer goes: an int is the index of the broker link it came on; bytes are
# the routing id of the client that sent it on the session's own socket.
Route = int | bytes


class JobNotStarted(Exception):
    """A job that must never start here: the broker refused its START (it was placed again
    elsewhere, or answered already), or the worker stopped before its GO. It gets no RESULT."""


class StartWait:
    """One job's wait for its GO (PROTOCOL.md §4.4), between its job thread and the loop."""

    __slots__ = ("answered", "go", "asked_at")

    def __init__(self) -> None:
        self.answered = threading.Event()
        self.go = False
        self.asked_at = 0.0  # when its START last went out (0: not yet)


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
    replica_of: str = ""  # the worker whose work this one takes first when that one is lost
    instance_id: str = ""  # this GPU VM's Nova server id, for the broker's OpenStack view ("": unknown)
    data_bind: str = ""  # where clients send session CALLs directly (PROTOCOL.md §10); "": nowhere
    data_advertise: str = ""  # the endpoint clients are told to use ("": from data_bind)
    data_ports: str = ""  # "LOW-HIGH": the ports direct sessions' own sockets bind ("": any free one)
    max_job_output_bytes: int = 1 << 30  # a job's output files together (PROTOCOL.md §11.5)


class BrokerLink:
    """The connections to one broker, with their liveness and reconnect backoff: the control
    connection (``sock``: the worker dialog) and, with ``data_ctx``, the data connection
    (``data_sock``, a socket of that context: the staged inputs' FETCHes and their CHUNKs,
    PROTOCOL.md §11.3), opened, closed and opened again together."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, policy: HeartbeatPolicy, now: float,
                 curve: CurveKeys | None = None, data_ctx: zmq.Context[Any] | None = None) -> None:
        self.ctx = ctx
        self.data_ctx = data_ctx
        self.endpoint = endpoint
        self.policy = policy
        self.curve = curve
        self.sock: zmq.Socket[bytes] | None = None
        self.data_sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None  # handshake failures (CURVE only)
        self.handshakes = HandshakeLog("broker", skip_auth=False)
        self.liveness = Liveness(policy, now)
        self.welcomed = False
        self.active = False  # this broker said it is the active one of its pair (WELCOME, HEARTBEAT)
        self.acks = False  # it ACKs results (every broker of this version): keep each until it does
        self.epoch = 0  # the epoch it said that with
        self.told = False  # it has said whether it is active, and at which epoch (PROTOCOL.md §9.4)
        self.max_message_bytes = protocol.DEFAULT_MAX_MESSAGE_BYTES  # the largest message it takes (WELCOME)
        self.backoff = 0.0
        self.retry_at = now
        # Messages wait here until the loop's turn ends (``flush``): a burst of RESULTs to a burst
        # of DISPATCHes then goes out as one BATCH (PROTOCOL.md §2.1), in the order queued.
        self.out: list[list[Any]] = []
        self.data_out: list[list[Any]] = []  # the same, for the data connection

    def open(self, now: float) -> zmq.Socket[bytes]:
        """Connect (the data connection too); returns the control connection's socket."""
        sock = self._dealer(self.ctx)
        if self.curve is not None:
            self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        sock.connect(self.endpoint)
        self.sock = sock
        if self.data_ctx is not None:
            self.data_sock = self._dealer(self.data_ctx)
            self.data_sock.connect(self.endpoint)
        self.welcomed = False
        self.active = False
        self.liveness = Liveness(self.policy, now)
        return sock

    def _dealer(self, ctx: zmq.Context[Any]) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if self.curve is not None:
            apply_client_keys(sock, self.curve)
        return sock

    def check_handshakes(self) -> None:
        """Log failed CURVE handshakes (the broker refused our key, or we have the wrong one of its)."""
        if self.monitor is not None:
            self.handshakes.drain(self.monitor)

    def send(self, frames: list[Any]) -> None:
        """Queue one message for this broker; the loop sends it at the end of its turn."""
        if self.sock is not None:
            self.out.append(frames)

    def send_data(self, frames: list[Any]) -> None:
        """Queue one message for this broker's data connection (the control one without it)."""
        if self.data_sock is not None:
            self.data_out.append(frames)
        else:
            self.send(frames)

    def flush(self) -> None:
        """Send what is queued, runs of small messages as one BATCH each."""
        if self.sock is not None:
            for frames in protocol.batched(self.out):
                send_frames(self.sock, frames)
        self.out.clear()
        if self.data_out:
            if self.data_sock is not None:
                for frames in protocol.batched(self.data_out):
                    send_frames(self.data_sock, frames)
            self.data_out.clear()

    def close(self, linger_ms: int = 0) -> None:
        """Close both connections; what is unsent is dropped, except that the control
        connection's may still leave for ``linger_ms`` (a goodbye; the data connection's bulk
        bytes never wait)."""
        if self.out or self.data_out:
            self.flush()
        if self.sock is not None:
            if self.monitor is not None:
                self.check_handshakes()
                self.sock.disable_monitor()
                self.monitor.close(0)
                self.monitor = None
            self.sock.close(linger_ms)
            self.sock = None
        if self.data_sock is not None:
            self.data_sock.close(0)
            self.data_sock = None


class SessionRunner:
    """A device session and the thread that runs its operations in order."""

    def __init__(self, sid: bytes, dev_session: DeviceSession | None, gpu: GpuInfo, tenant: str) -> None:
        self.id = sid
        self.dev = dev_session
        self.gpu = gpu
        self.tenant = tenant
        # Relayed calls (from the loop), then a ring of the doorbell: the thread waits on it and
        # on its own socket at once.
        self.ops: queue.SimpleQueue[tuple[Route, dict[str, Any], list[Any]] | None] = queue.SimpleQueue()
        self.door = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._door_lock = threading.Lock()  # closed by the thread as it ends, rung by the loop
        self.sock: SessionSocket | None = None  # its direct path, once open (its thread's alone)
        self.opened = self.last_used = time.monotonic()
        self.closed = False
        self.busy = False  # a call is running (a long kernel is not idleness)
        self.lost = ""  # why its GPU failed: its calls are answered SESSION_LOST
        self.thread: threading.Thread | None = None
        self.direct = False  # the broker offered the direct path (DISPATCH 'direct')
        self.relay = True  # the broker relays its CALLs too (DISPATCH 'relay')
        self.client_key = ""  # the client key the broker named for it (CURVE)
        self.grant = JobGrant()  # what the broker granted (DISPATCH 'grant')

    def put(self, item: tuple[Route, dict[str, Any], list[Any]] | None) -> None:
        """(The loop) Queue a relayed call (None: end the thread) and wake the thread; nothing
        once the thread has ended."""
        with self._door_lock:
            if self.door >= 0:
                self.ops.put(item)
                os.eventfd_write(self.door, 1)

    def close_door(self) -> None:
        """(Its thread, ending) Nothing more can be queued."""
        with self._door_lock:
            os.close(self.door)
            self.door = -1


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
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[Any] = zmq.Context() if ctx is None else ctx
        now = time.monotonic()
        self.links = [BrokerLink(self.ctx, ep, config.heartbeat, now, config.curve) for ep in config.brokers]
        self.data_ctx: zmq.Context[Any] | None = None  # the links' data connections' (``run``)
        self.jobs = ThreadPoolExecutor(max_workers=config.slots, thread_name_prefix="job")
        self.sessions: dict[bytes, SessionRunner] = {}
        self._session_threads: list[threading.Thread] = []  # running or ended not long ago
        self.running: dict[bytes, tuple[str, float, list[str]]] = {}  # id -> kind, since, gpus
        self.gpu_faults: dict[str, str] = {}  # GPUs out of service (probe.failed()): uuid -> reason
        self._job_cancels: dict[bytes, threading.Event] = {}  # set: kill the job, answer GPU_FAULT
        self._stopped: set[bytes] = set()  # jobs the broker said to stop (killed, no RESULT: PROTOCOL.md §4.2)
        # This process's, in every READY: a broker that suspended us for silence tells our
        # reconnection from a restart by it, and keeps our running work (PROTOCOL.md §4.2).
        self.incarnation = os.urandom(protocol.ID_BYTES)
        self.results: queue.SimpleQueue[tuple[int, bytes, list[Any]]] = queue.SimpleQueue()
        # Taken by a wake and by the close: a wake never writes to a descriptor closed meanwhile
        # (whose number another file may have taken). Re-entrant: a signal handler wakes too.
        self._wake_lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self.draining = False
        self._reload_requested = False
        self._seq = itertools.count(1)
        # The broker pair (PROTOCOL.md §9.4): results are kept until the active broker ACKs them,
        # and sent to whichever broker is active; DISPATCHes of an older epoch are refused.
        self.unacked: dict[bytes, tuple[list[Any], float]] = {}  # id -> RESULT frames, when made
        self.calls: set[bytes] = set()  # session calls dispatched and not answered yet
        self.owner: dict[bytes, str] = {}  # id -> tenant, while in flight
        self.active_idx: int | None = None  # index in links of the active broker
        self.max_epoch = 0
        # Until every broker has told its state, or one expiry of our heartbeat policy since the
        # loop began (PROTOCOL.md §9.4, learning the epoch), DISPATCHes wait here, in order.
        self._learn_until: float | None = None
        self._held: list[tuple[int, BrokerLink, protocol.Message]] = []
        self._alive_at = 0.0  # the next time a long drain looks at queued sends and heartbeats
        # Jobs ready to start, waiting for the active broker's GO (PROTOCOL.md §4.4): job threads
        # add and remove entries, the loop asks START for them and answers them.
        self.start_waits: dict[bytes, StartWait] = {}
        self._start_asks: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.data = (DataSocket(config.data_bind, config.data_advertise, config.curve, config.data_ports)
                     if config.data_bind else None)
        # Staged jobs whose inputs are being fetched from the broker (PROTOCOL.md §11.3), by id,
        # with what their job thread needs once complete: (fetch, link index, DISPATCH header, gpus, tenant).
        self.fetches: dict[bytes, Fetch] = {}
        self._fetch_room = False  # a job thread wrote a fetched chunk: the loop may ask for more
        self._polling = False  # the loop is about to poll, or polls: what a job thread tells it must wake it
        # Staged outputs of finished jobs, held until their RESULT is ACKed: id -> (files, when made).
        self.staged_out: dict[bytes, tuple[HeldOutputs, float]] = {}

    # ---------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Begin a graceful stop: take no new work, let running work finish, say goodbye."""
        self._stop.set()
        self._wake()

    def request_reload(self) -> None:
        """Have the loop call ``reload()`` soon (SIGHUP). Safe from a signal handler."""
        self._reload_requested = True
        self._wake()

    def close_wake_pipe(self, wait_s: float = 5.0) -> None:
        """Close the pipe that threads wake the loop through, once the session threads have ended
        (up to ``wait_s`` in all): a thread that wrote to a closed descriptor could write into
        whatever file reused its number."""
        deadline = time.monotonic() + wait_s
        for t in list(self._session_threads):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        with self._wake_lock:
            r, w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1
            os.close(r)
            os.close(w)

    def reload(self) -> None:
        """Re-read the configuration (SIGHUP), in the loop's thread. Nothing is re-read yet: the
        worker keeps its start-up configuration. Tells systemd RELOADING=1, then READY=1."""
        notify.reloading()
        log.info("reload requested: nothing is re-read yet; the worker keeps its start-up configuration")
        notify.ready()

    def _wake(self) -> None:
        with self._wake_lock:
            fd = self._wake_w
            if fd < 0:  # stopped: nothing waits for the loop any more
                return
            try:
                os.write(fd, b"x")
            except BlockingIOError:
                pass

    def ready_header(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "hostname": socket.gethostname(),
            "gpus": [protocol.gpu_info_to_wire(g) for g in self.gpus.values()],
            "cpu_milli": self.config.cpu_milli,
            "host_mem": self.config.host_mem,
            "slots": self.config.slots,
            "heartbeat_ms": int(self.config.heartbeat.interval * 1000),
            "liveness": self.config.heartbeat.liveness,
            "simulated": self.probe.simulated,
            "instance_id": self.config.instance_id,
            "replica_of": self.config.replica_of,
            "incarnation": self.incarnation,
            "holds": self._holds()[:protocol.MAX_HOLDS],
            **self.runner.ready_fields(),
        }

    def _holds(self) -> list[bytes]:
        """The ids of what this worker runs or keeps a RESULT of (READY's ``holds``)."""
        return list({*self.running, *self.calls, *self.sessions, *self.unacked})

    def _stop_work(self, ids: list[Any]) -> None:
        """The broker took these jobs off us while it thought us gone (placed them again, or
        ended them): each is killed, or never started, and gets no RESULT (PROTOCOL.md §4.2)."""
        for rid in ids:
            if type(rid) is not bytes:
                continue
            self.unacked.pop(rid, None)
            self._drop_outputs(rid)
            entry = self.running.get(rid)
            if entry is None or entry[0] != "job":
                continue
            log.warning("job %s: stopped, the broker took it off this worker while it thought it gone",
                        protocol.id_text(rid))
            self._stopped.add(rid)
            if rid in self.fetches:  # its inputs still come: it never began
                self._end_fetch(rid)
            self._job_cancels.setdefault(rid, threading.Event()).set()
            wait = self.start_waits.get(rid)
            if wait is not None and not wait.answered.is_set():
                wait.go = False
                wait.answered.set()

    def run(self) -> None:
        """Serve until stop(); then drain for at most ``drain_timeout`` and disconnect."""
        if self.data is not None:
            self.data.start()
        # The links' data connections share one context of their own, its I/O thread nicer.
        self.data_ctx = data_context()
        for link in self.links:
            link.data_ctx = self.data_ctx
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
        self._learn_until = time.monotonic() + self.config.heartbeat.expiry
        while True:
            now = time.monotonic()
            if self._held and not self._learning(now):
                self._release_held(poller, now)
            for link in self.links:
                if link.sock is None and now >= link.retry_at:
                    poller.register(link.open(now), zmq.POLLIN)
                    if link.data_sock is not None:
                        poller.register(link.data_sock, zmq.POLLIN)
                    self._send(link, Command.READY, self.ready_header())
                    log.info("connecting to broker %s", link.endpoint)
            if self._stop.is_set():
                if drain_deadline is None:
                    log.info("stopping: draining %d running task(s), %d session(s)", len(self.running), len(self.sessions))
                    self.draining = True
                    drain_deadline = now + self.config.drain_timeout
                    # Outputs waiting for room are answered before the deadline, not cut off at it.
                    self.runner.hold.stop("the worker is stopping", drain_deadline - min(2.0, self.config.drain_timeout / 4))
                    self._beat_all(now)
                if (not self.running and (not self.unacked or self.active_idx is None)) or now >= drain_deadline:
                    return  # done, and what it answered is ACKed (or no broker is there to ACK it)
            for link in self.links:
                if link.out or link.data_out:
                    link.flush()
            # Poll only after a round that found nothing to do: while work keeps coming, reading
            # until empty costs fewer system calls than a poll per round.
            if not busy:
                self._polling = True  # from here a job thread's written chunk wakes the poll
                if not self._fetch_room and self._wake_r in dict(poller.poll(50)):
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                self._polling = False
            busy = False
            if not self.results.empty():
                self._flush_results()
                busy = True
            if self._fetch_room:
                self._fetch_room = False
                for rid in list(self.fetches):
                    self._fetch_more(rid, time.monotonic())
            if not self._start_asks.empty():
                self._ask_starts(now, fresh=True)
            for i, link in enumerate(self.links):
                sock = link.sock
                if sock is not None and self._drain(i, link, sock, poller):
                    busy = True
            for i, link in enumerate(self.links):  # the data connections after every control one
                data = link.data_sock
                # Asked first: a read that finds nothing raises (about 4 us, every turn of a loop
                # busy with echoes); the socket's EVENTS costs about half, without an exception.
                if data is not None and int(data.getsockopt(POLL_EVENTS)) & POLLIN and self._drain_data(i, link, data):
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
            if self.unacked or self.staged_out:
                self._drop_old_unacked(now)
            if self.start_waits:
                self._ask_starts(now)
            if self.fetches:
                self._ask_fetches(now, stale=True)
            self._fail_work_on_failed_gpus()

    def _reconnect(self, link: BrokerLink, poller: zmq.Poller, now: float) -> None:
        if link.sock is not None:
            poller.unregister(link.sock)
        if link.data_sock is not None:
            poller.unregister(link.data_sock)
        link.close()
        link.active = False
        self._choose_active(now)
        cfg = self.config
        link.backoff = min(cfg.reconnect_min if link.backoff == 0 else link.backoff * 2, cfg.reconnect_max)
        link.retry_at = now + link.backoff * (0.5 + random.random() / 2)

    def _shutdown(self) -> None:
        for wait in list(self.start_waits.values()):  # never started: the broker places them again
            wait.answered.set()
        for s in list(self.sessions.values()):  # a session process ends at once: its memory with it
            self._close_session(s, kill="the worker is stopping")
        for link in self.links:
            if link.sock is not None:
                self._send(link, Command.DISCONNECT, {"reason": "worker stopping"})
            link.close(GOODBYE_LINGER_MS)  # else the broker learns of it only a liveness later
        self.jobs.shutdown(wait=False, cancel_futures=True)
        for rid in list(self.fetches):
            self._end_fetch(rid)
        self.close_wake_pipe()
        if self.data_ctx is not None:
            self.data_ctx.destroy(0)
        if self.data is not None:
            self.data.close()
        self.probe.close()
        if self._own_ctx:  # its goodbyes leave (or their linger passes) before the process ends
            self.ctx.destroy(GOODBYE_LINGER_MS)
        log.info("worker %s stopped", self.config.name)

    # ---------------------------------------------------------------- socket side

    def _send(self, link: BrokerLink, cmd: Command, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        link.send(protocol.encode(Peer.WORKER, cmd, header, frames))

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
        gpus = [protocol.gpu_state_to_wire(u, s) for u, s in states.items()]
        running: list[dict[str, Any]] = [
            {"id": rid, "kind": kind, "since": round(now - since, 3)} for rid, (kind, since, _) in self.running.items()]
        running += [{"id": s.id, "kind": "session", "since": round(now - s.opened, 3),
                     "idle": 0.0 if s.busy else round(max(0.0, now - s.last_used), 3)} for s in self.sessions.values()]
        for r in running:
            tenant = self.owner.get(r["id"])
            if tenant is not None:
                r["tenant"] = tenant
        header: dict[str, Any] = {"seq": seq, "gpus": gpus, "running": running, "simulated": self.probe.simulated,
                                  "epoch": self.max_epoch, "held_outputs": self.runner.hold.held}
        heard = [other.liveness.last_heard for other in self.links if other is not link and other.active and other.sock is not None]
        if heard:
            header["active_age_ms"] = max(0, int((now - max(heard)) * 1000))
        if self.draining:
            header["draining"] = True
        self._send(link, Command.HEARTBEAT, header)
        # A heartbeat goes at once (with what is queued before it): it must not wait for the loop's
        # turn to end, which under load (many job threads taking the GIL) can be late.
        link.flush()

    def _drain(self, idx: int, link: BrokerLink, sock: zmq.Socket[bytes], poller: zmq.Poller) -> int:
        """Handle up to 256 queued messages from one broker; returns how many there were."""
        for n in range(256):
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=3)
            except zmq.Again:
                return n
            now = time.monotonic()
            link.liveness.heard(now)
            for one in _messages(link, frames):
                self._handle(idx, link, one, poller, now)
                if link.sock is not sock:  # it told us to reconnect: the rest was for the old link
                    return n + 1
                self._keep_alive()
        return 256

    def _keep_alive(self) -> None:
        """During a long drain (a BATCH of job DISPATCHes starts a thread each, and under load each
        waits for the GIL): send what has waited HOUSEKEEPING_S and the heartbeats that are due, so
        that a busy worker never looks silent to its brokers."""
        now = time.monotonic()
        if now < self._alive_at:
            return
        self._alive_at = now + HOUSEKEEPING_S
        for link in self.links:
            if link.sock is None:
                continue
            if link.liveness.beat_due(now):
                self._beat(link, now)  # flushes what is queued before it, too
            elif link.out or link.data_out:
                link.flush()

    def _handle(self, idx: int, link: BrokerLink, msg: protocol.Message, poller: zmq.Poller, now: float) -> None:
        """One message from a broker, alone or out of a BATCH."""
        try:
            self._on_broker(idx, link, msg, poller, now)
        except GpudError as exc:
            log.warning("bad message from broker %s: %s %s", link.endpoint, exc.code, exc.message)
        except Exception:
            log.exception("bug while handling a broker message")

    def _on_broker(self, idx: int, link: BrokerLink, msg: protocol.Message, poller: zmq.Poller, now: float) -> None:
        cmd = msg.command
        header = msg.header
        if cmd is Command.DISPATCH and self._learning(now):
            self._held.append((idx, link, msg))
        elif cmd is Command.DISPATCH:
            self._on_dispatch(idx, link, header, msg.frames, now)
        elif cmd is Command.HEARTBEAT:
            self._broker_state(idx, link, header, now)
        elif cmd is Command.ACK:
            ids = header.get("ids")
            if type(ids) is list and self._acks_count(idx, link):
                for rid in ids:
                    if type(rid) is bytes:
                        self.unacked.pop(rid, None)
                        self._drop_outputs(rid)
        elif cmd is Command.GO:
            self._on_go(idx, link, header)
        elif cmd is Command.WELCOME:
            hb = header.get("heartbeat_ms")
            lv = header.get("liveness")
            if type(hb) is int and type(lv) is int and hb > 0 and lv > 0:
                link.liveness.policy = HeartbeatPolicy(hb / 1000.0, lv)
            link.welcomed = True
            link.backoff = 0.0
            most = header.get("max_message_bytes")
            if type(most) is int and most > 0:
                link.max_message_bytes = most
            log.info("registered with broker %s (heartbeat %dms x %s)", link.endpoint, hb, lv)
            notify.status(f"registered with {link.endpoint}")
            state = header if "active" in header else {**header, "active": True, "epoch": 0}
            changed = self._broker_state(idx, link, state, now, follow=False)
            stop = header.get("stop")
            if header.get("resumed") is True and type(stop) is list and stop and idx == self.active_idx:
                self._stop_work(stop)  # first: a RESULT the broker has already is not sent again
            if changed:
                self._follow_active(now)
            elif idx == self.active_idx:  # welcomed again by the same one: it may lack them
                self._resend_results(link)
            self._beat(link, now)
        elif cmd is Command.DISCONNECT:
            reason = header.get("reason")
            (log.error if type(reason) is str and reason.startswith("refused") else log.warning)(
                "broker %s disconnected us (%s); reconnecting", link.endpoint, reason)
            self._reconnect(link, poller, now)
        elif cmd is Command.CHUNK:
            self._on_chunk(idx, header, msg.frames, now)
        elif cmd is Command.FETCH:
            self._on_output_fetch(link, header)
        elif cmd is Command.ERROR:
            self._on_error(idx, link, header)
        else:
            log.warning("unexpected %s from broker %s", cmd.name, link.endpoint)

    def _on_error(self, idx: int, link: BrokerLink, header: dict[str, Any]) -> None:
        rid = header.get("id")
        if type(rid) is bytes and rid in self.fetches and idx == self.active_idx:
            # The broker holds no inputs of it placed here: it failed the job or placed it
            # elsewhere (PROTOCOL.md §11.3). Dropped without a RESULT: its fate is decided.
            log.info("job %s: dropped (%s)", protocol.id_text(rid), header.get("message"))
            self._end_fetch(rid)
            self.running.pop(rid, None)
            self.owner.pop(rid, None)
            return
        log.warning("broker %s reports an error: %s %s", link.endpoint, header.get("code"), header.get("message"))

    def _drain_data(self, idx: int, link: BrokerLink, sock: zmq.Socket[bytes]) -> int:
        """Handle up to DATA_DRAIN queued messages of one broker's data connection (CHUNKs and
        ERRORs answering our FETCHes, PROTOCOL.md §11.3); returns how many there were. They are
        not the broker's liveness: its control connection says whether it lives."""
        for n in range(DATA_DRAIN):
            try:
                frames = recv_frames(sock, NOBLOCK, copy_first=3)
            except zmq.Again:
                return n
            now = time.monotonic()
            for one in _messages(link, frames):
                if one.command is Command.CHUNK:
                    self._on_chunk(idx, one.header, one.frames, now)
                elif one.command is Command.ERROR:
                    self._on_error(idx, link, one.header)
                else:
                    log.warning("unexpected %s on broker %s's data connection", one.command.name, link.endpoint)
        return DATA_DRAIN

    def _broker_state(self, idx: int, link: BrokerLink, header: dict[str, Any], now: float, follow: bool = True) -> bool:
        """A broker said whether it is active, and at which epoch: follow the active one (returns
        whether the active one changed; ``follow`` False: the caller follows it, ``_follow_active``)."""
        active, epoch = header.get("active"), header.get("epoch")
        if type(active) is not bool or type(epoch) is not int:
            return False
        link.active, link.epoch = active, epoch
        link.acks = header.get("acks") is True
        link.told = True
        if epoch > self.max_epoch:
            self.max_epoch = epoch
        return self._choose_active(now, follow)

    def _choose_active(self, now: float, follow: bool = True) -> bool:
        """The active broker is the connected one that says so at the largest epoch seen; none
        while there is none: an old active one at a lower epoch, woken from a freeze, is not, even
        while the newer one's connection is down (PROTOCOL.md §9.4). When it changes, every
        unacknowledged RESULT goes to the new one, then a HEARTBEAT (``follow`` False: the caller
        does, ``_follow_active``). Returns whether it changed."""
        best = next((i for i, link in enumerate(self.links)
                     if link.sock is not None and link.active and link.epoch >= self.max_epoch), None)
        if best == self.active_idx:
            return False
        self.active_idx = best
        if follow:
            self._follow_active(now)
        return True

    def _follow_active(self, now: float) -> None:
        """A new active broker: it gets every unacknowledged RESULT, a HEARTBEAT, and the STARTs
        and FETCHes still unanswered."""
        if self.active_idx is None:
            return
        link = self.links[self.active_idx]
        log.info("broker %s is the active one (epoch %d)", link.endpoint, link.epoch)
        if link.sock is not None:
            self._resend_results(link)
            self._beat(link, now)
            if self.start_waits:
                self._ask_starts(now, again=True)
            if self.fetches:
                self._ask_fetches(now, again=True)

    def _acks_count(self, idx: int, link: BrokerLink) -> bool:
        """Whether an ACK from this broker lets go of RESULTs: only the active one's does
        (PROTOCOL.md §9.4); any other broker's tables do not answer the client, and the RESULT
        would be lost."""
        if idx == self.active_idx:
            return True
        log.info("ACK from broker %s ignored: it is not the active one at epoch %d", link.endpoint, self.max_epoch)
        return False

    def _resend_results(self, link: BrokerLink) -> None:
        """Send every unacknowledged RESULT again (to the active broker): only an ACK proves one
        arrived; the broker takes each once and ACKs a second copy again (PROTOCOL.md §9.4)."""
        if self.unacked:
            log.info("re-sending %d unacknowledged result(s) to broker %s", len(self.unacked), link.endpoint)
            for frames, _ in list(self.unacked.values()):
                link.send(frames)

    def _deliver(self, rid: bytes, frames: list[Any]) -> None:
        """Send a RESULT to the active broker and keep it until ACKed; while none is active,
        keep it for the next one."""
        self.running.pop(rid, None)
        self.calls.discard(rid)
        self.owner.pop(rid, None)
        self._stopped.discard(rid)
        if rid in self.fetches:  # it failed while its inputs came (its job thread gave up)
            self._end_fetch(rid)
        if self.active_idx is None:
            self.unacked[rid] = (frames, time.monotonic())
            return
        link = self.links[self.active_idx]
        if link.acks:
            self.unacked[rid] = (frames, time.monotonic())
        link.send(frames)

    def _drop_old_unacked(self, now: float) -> None:
        """Results no broker ACKed for UNACKED_TTL_S (e.g. a broker that does not ACK): dropped."""
        limit = now - UNACKED_TTL_S
        old = [rid for rid, (_, made) in self.unacked.items() if made < limit]
        for rid in old:
            del self.unacked[rid]
        if old:
            log.warning("%d result(s) never acknowledged in %.0fs; dropped", len(old), UNACKED_TTL_S)
        outputs = [rid for rid, (_, made) in self.staged_out.items() if made < limit]
        for rid in outputs:
            self._drop_outputs(rid)
        if outputs:
            log.warning("staged outputs of %d job(s) never fetched in %.0fs; dropped", len(outputs), UNACKED_TTL_S)

    def _flush_results(self) -> None:
        while True:
            try:
                idx, rid, frames = self.results.get_nowait()
            except queue.Empty:
                return
            if frames:
                self._deliver(rid, frames)
            else:  # a job that never started (its START refused): no longer ours, and no RESULT
                self.running.pop(rid, None)
                self.owner.pop(rid, None)
                self._end_fetch(rid)

    # ---------------------------------------------------------------- work

    def _result(self, idx: int, rid: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        """Queue a RESULT from any thread; the loop sends it."""
        header["id"] = rid
        self._stamp(rid, header)
        self.results.put((idx, rid, protocol.encode(Peer.WORKER, Command.RESULT, header, frames)))
        self._wake()

    def _error(self, idx: int, rid: bytes, exc: GpudError) -> None:
        self._result(idx, rid, protocol.error_header(rid, exc))

    def _learning(self, now: float) -> bool:
        """Whether DISPATCHes are held: this worker has just started, and not every broker has told
        it its state yet (PROTOCOL.md §9.4, learning the epoch)."""
        if self._learn_until is None:
            return False
        if now < self._learn_until and not all(link.told for link in self.links):
            return True
        self._learn_until = None
        return False

    def _release_held(self, poller: zmq.Poller, now: float) -> None:
        """The largest epoch is learnt: the DISPATCHes held meanwhile are handled, in order."""
        held, self._held = self._held, []
        log.info("the largest epoch seen is %d: handling %d DISPATCH(es) held until it was learnt", self.max_epoch, len(held))
        for idx, link, msg in held:
            self._handle(idx, link, msg, poller, now)

    def _on_dispatch(self, idx: int, link: BrokerLink, header: dict[str, Any], frames: list[Any], now: float) -> None:
        rid = protocol.get_id(header)
        kind = header.get("kind")
        epoch = header.get("epoch")
        if type(epoch) is int:
            if epoch < self.max_epoch:
                log.warning("DISPATCH %s from broker %s at epoch %d refused: epoch %d is active",
                            protocol.id_text(rid), link.endpoint, epoch, self.max_epoch)
                self._send(link, Command.RESULT, protocol.error_header(rid, NotActive(f"a broker of epoch {self.max_epoch} is active")))
                return
            if not link.active or epoch > link.epoch:  # its HEARTBEAT saying so went missing
                self._broker_state(idx, link, {"active": True, "epoch": epoch, "acks": link.acks}, now)
        kept = self.unacked.get(rid)
        if kept is not None:  # answered already: the broker asks again after a failover
            link.send(kept[0])
            return
        if rid in self.running or rid in self.calls:
            return  # running already: its RESULT goes out when it is done
        tenant = header.get("tenant")
        if type(tenant) is str:
            self.owner[rid] = tenant
        if kind == "call":
            self.calls.add(rid)
            self._on_call(idx, rid, header, frames)
            return
        try:
            if self.draining:
                raise ShuttingDown(f"worker {self.config.name} is stopping")
            grant = header.get("grant")
            if type(grant) is not dict:
                raise InvalidRequest("DISPATCH needs 'grant'")
            uuids = grant.get("gpus")
            if type(uuids) is not list or not uuids or not all(u in self.gpus for u in uuids):
                raise InvalidRequest("the grant names GPUs this worker does not have")
            failed = [u for u in uuids if u in self.gpu_faults]
            if failed:
                raise GpuFault(f"GPU {failed[0]} is out of service: {self.gpu_faults[failed[0]]}")
            mem = grant.get("mem", 0)
            if type(mem) is not int or mem < 0:
                raise InvalidRequest("grant 'mem' must be a non-negative int")
            tenant = header.get("tenant", "default")
            if type(tenant) is not str:
                raise InvalidRequest("'tenant' must be a string")
        except GpudError as exc:
            self._send_now(idx, rid, protocol.error_header(rid, exc))
            return
        if kind == "echo":
            log.debug("echo %s", protocol.id_text(rid))  # one line per execution: chaos tests count them
            self._send_now(idx, rid, {"id": rid, "ok": True, "worker": self.config.name, "gpus": uuids}, frames)
            return
        self.running[rid] = (str(kind), now, uuids)
        if kind == "job" and "staged" in header:
            self._start_fetch(idx, rid, header, uuids, tenant, now)
        elif kind == "job":
            self.jobs.submit(self._run_job, idx, rid, header, frames, uuids, tenant)
        elif kind == "session":
            key = header.get("client_key")
            self._open_session(idx, rid, uuids[0], mem, tenant, grant, header.get("direct") is True,
                               key if type(key) is str else "", header.get("relay") is not False)
        else:
            self.running.pop(rid, None)
            self._send_now(idx, rid, protocol.error_header(rid, InvalidRequest(f"unknown kind {kind!r}")))

    def _stamp(self, rid: bytes, header: dict[str, Any]) -> None:
        """What every RESULT header says besides its outcome: this worker, and the tenant of the
        DISPATCH (a broker that takes over keeps a result it never dispatched for that tenant)."""
        header.setdefault("worker", self.config.name)
        tenant = self.owner.get(rid)
        if tenant is not None:
            header["tenant"] = tenant

    def _send_now(self, idx: int, rid: bytes, header: dict[str, Any], frames: list[Any] | tuple[Any, ...] = ()) -> None:
        self._stamp(rid, header)
        self._deliver(rid, protocol.encode(Peer.WORKER, Command.RESULT, header, frames))

    def _run_job(self, idx: int, rid: bytes, dispatch: dict[str, Any], frames: list[Any], uuids: list[str], tenant: str) -> None:
        cancel = self._job_cancels.setdefault(rid, threading.Event())
        try:
            spec = protocol.parse_job(dispatch, len(frames))
            visible = ",".join(self._visible_name(u) for u in uuids)
            # Inputs as buffers; a fetched staged one as the StagedFile that writes itself (copy_to).
            inputs: list[Any] = [f if isinstance(f, StagedFile) else memoryview(f.buffer if hasattr(f, "buffer") else f)
                                 for f in frames]
            out = self.runner.run(rid, spec, inputs, visible, tenant, cancel,
                                  JobGrant.from_wire(dispatch.get("grant")), lambda: self._await_go(rid, cancel),
                                  gpus=uuids)
            try:
                self._job_result(idx, rid, out, uuids, cancel)
            except BaseException:
                if out.held is not None:  # no RESULT names them: they go now, not at UNACKED_TTL
                    out.held.close()
                raise
        except (JobNotStarted, FetchAbandoned):
            why = ("stopped by the broker" if rid in self._stopped else
                   "the worker is stopping" if self._stop.is_set() else "START refused")
            log.info("job %s: no RESULT (%s)", protocol.id_text(rid), why)
            self.results.put((idx, rid, []))  # no RESULT: the loop only forgets it
            self._wake()
        except GpudError as exc:
            self._error(idx, rid, exc)
        except Exception as exc:
            log.exception("job %s failed in the worker", protocol.id_text(rid))
            self._error(idx, rid, InternalError(f"the worker failed to run the job: {exc.__class__.__name__}"))
        finally:
            self._job_cancels.pop(rid, None)
            self._stopped.discard(rid)

    def _job_result(self, idx: int, rid: bytes, out: JobOutcome, uuids: list[str], cancel: threading.Event) -> None:
        """(Job thread) The RESULT of a job that ran: its outcome, or why it is not one (raised)."""
        if rid in self._stopped:
            raise JobNotStarted(protocol.id_text(rid))
        if cancel.is_set():
            failed = next((u for u in uuids if u in self.gpu_faults), uuids[0])
            raise GpuFault(f"GPU {failed} failed ({self.gpu_faults.get(failed, 'health check')}) while the job ran; the job was killed")
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
        held = out.held  # staged: the broker fetches them in chunks (PROTOCOL.md §11.5)
        files = [data for _, data in out.files]
        total = held.total if held is not None else sum([len(d) for d in files])
        if total > self.config.max_job_output_bytes or out.oversize:
            what = (f"outputs are, from {out.oversize[0]} on," if out.oversize
                    else f"output files are {total} bytes,")
            raise TooLarge(f"the job's {what} over the worker's max_job_output_bytes "
                           f"({self.config.max_job_output_bytes})")
        if held is not None:
            header["files"], header["staged"] = held.names, held.sizes
        result = [out.stdout, out.stderr] if held is not None else [out.stdout, out.stderr, *files]
        check_result_size(header, result, self.links[idx].max_message_bytes)
        if held is not None:
            self.staged_out[rid] = (held, time.monotonic())
        self._result(idx, rid, header, result)

    # ---------------------------------------------------------------- staged inputs (PROTOCOL.md §11.3)

    def _start_fetch(self, idx: int, rid: bytes, header: dict[str, Any], uuids: list[str], tenant: str, now: float) -> None:
        """Begin fetching a staged job's inputs; its job thread sets it up meanwhile and writes
        them into its directory as they come (``gpud_worker.fetch``)."""
        try:
            spec = protocol.parse_job(header, 0)
            fetch = Fetch(rid, list(spec.staged or ()), self._fetch_written)
            limit = self.runner.dir_size
            if limit and fetch.total > limit:  # no worker of this size can take it: said before any byte comes
                raise TooLarge(f"the job's input files are {fetch.total} bytes, over the worker's job_dir_size "
                               f"({limit}): they do not fit the job's directory")
        except GpudError as exc:
            self.running.pop(rid, None)
            self._send_now(idx, rid, protocol.error_header(rid, exc))
            return
        inline = {k: v for k, v in header.items() if k != "staged"}  # what the job thread sees: inline inputs
        self.fetches[rid] = fetch
        log.debug("job %s: fetching %d staged bytes", protocol.id_text(rid), fetch.total)
        self.jobs.submit(self._run_job, idx, rid, inline, fetch.inputs(), uuids, tenant)
        self._fetch_more(rid, now)

    def _fetch_written(self) -> None:
        """(Job thread) A fetched chunk is written: the loop may ask for more. Woken once (the
        loop clears the flag before it reads how many chunks are written), and only if it polls:
        a loop still at work sees the flag in its next round, before it would poll."""
        if not self._fetch_room:
            self._fetch_room = True
            if self._polling:
                self._wake()

    def _fetch_more(self, rid: bytes, now: float) -> None:
        fetch = self.fetches.get(rid)
        if fetch is None:
            return
        if fetch.done():  # every chunk came: the job thread writes what is left
            del self.fetches[rid]
            return
        self._send_fetches(rid, fetch.next_asks(now))

    def _send_fetches(self, rid: bytes, asks: list[tuple[int, int, int]]) -> None:
        link = self.links[self.active_idx] if self.active_idx is not None else None
        if link is None or link.sock is None or not asks:
            return  # asked again once a broker is active (``_choose_active``)
        # On the data connection, which the broker binds to us by name and incarnation (§11.3).
        name, incarnation = self.config.name, self.incarnation
        for index, offset, nbytes in asks:
            link.send_data(protocol.encode(Peer.WORKER, Command.FETCH, {
                "id": rid, "file": index, "offset": offset, "nbytes": nbytes, "worker": name,
                "incarnation": incarnation}))

    def _ask_fetches(self, now: float, again: bool = False, stale: bool = False) -> None:
        """Ask again for outstanding chunks: all of them (``again``: the active broker changed) or
        those unanswered for two heartbeat intervals (``stale``)."""
        idx = self.active_idx
        if idx is None:
            return
        older = None if again else now - 2 * self.links[idx].liveness.policy.interval
        for rid, fetch in list(self.fetches.items()):
            self._send_fetches(rid, fetch.again(now, older))

    def _on_chunk(self, idx: int, header: dict[str, Any], frames: list[Any], now: float) -> None:
        rid = header.get("id")
        fetch = self.fetches.get(rid) if type(rid) is bytes else None
        if fetch is None or type(rid) is not bytes or len(frames) != 1:
            return  # a late or repeated chunk of a job that has all its inputs, or is gone
        if fetch.on_chunk(header.get("file"), header.get("offset"), frames[0]):
            self._fetch_more(rid, now)

    def _on_output_fetch(self, link: BrokerLink, header: dict[str, Any]) -> None:
        """The broker asks for a chunk of a finished job's staged outputs: CHUNK with the bytes."""
        rid, index, offset, nbytes = header.get("id"), header.get("file"), header.get("offset"), header.get("nbytes")
        held = self.staged_out.get(rid) if type(rid) is bytes else None
        data = None
        if held is not None and type(index) is int and type(offset) is int and type(nbytes) is int:
            try:
                data = held[0].read(index, offset, min(nbytes, MAX_OUTPUT_FETCH))
            except OSError as exc:  # the disk under the hold: the broker asks again, then fails the job
                log.error("cannot read the held outputs %s: %s", ", ".join(held[0].names), exc)
                return
        if data is None:
            log.info("broker %s asked for outputs this worker does not hold; ignored", link.endpoint)
            return
        chunk = {"id": rid, "file": index, "offset": offset}
        if header.get("data") is True and link.data_sock is not None:  # bound by the broker as our FETCHes are
            chunk["worker"], chunk["incarnation"] = self.config.name, self.incarnation
            link.send_data(protocol.encode(Peer.WORKER, Command.CHUNK, chunk, [data]))
        else:
            self._send(link, Command.CHUNK, chunk, [data])

    def _drop_outputs(self, rid: bytes) -> None:
        """Let a job's held staged outputs go (their RESULT is ACKed, or will never be)."""
        held = self.staged_out.pop(rid, None)
        if held is not None:
            held[0].close()

    def _end_fetch(self, rid: bytes) -> None:
        """Stop fetching (the job ended, was dropped, or the worker stops): its job thread, if
        still waiting for chunks, ends without starting it."""
        fetch = self.fetches.pop(rid, None)
        if fetch is not None:
            fetch.abandon()

    def _await_go(self, rid: bytes, cancel: threading.Event) -> None:
        """(Job thread) Ask the active broker whether job ``rid`` may start and wait for its
        answer (PROTOCOL.md §4.4): return on GO, raise JobNotStarted when refused, GpuFault
        when its GPU fails meanwhile."""
        wait = self.start_waits[rid] = StartWait()
        self._start_asks.put(rid)
        self._wake()
        try:
            while not wait.answered.wait(0.1):
                if cancel.is_set():
                    raise GpuFault("the job's GPU failed before the job started; it was not started")
        finally:
            self.start_waits.pop(rid, None)
        if not wait.go:
            raise JobNotStarted(protocol.id_text(rid))
        log.debug("job %s: GO", protocol.id_text(rid))

    def _ask_starts(self, now: float, fresh: bool = False, again: bool = False) -> None:
        """Send START for the jobs waiting for their GO to the active broker: ``fresh``, those
        just ready; ``again``, all of them (the active broker changed); otherwise those asked more
        than a heartbeat interval ago."""
        ids: list[bytes] = []
        if fresh:
            while True:
                try:
                    ids.append(self._start_asks.get_nowait())
                except queue.Empty:
                    break
        idx = self.active_idx
        link = self.links[idx] if idx is not None else None
        if link is None or link.sock is None:
            return  # asked again once a broker is active (``_choose_active``)
        if not fresh:
            limit = now if again else now - link.liveness.policy.interval
            ids = [rid for rid, w in list(self.start_waits.items()) if w.asked_at <= limit]
        asked = []
        for rid in ids:
            wait = self.start_waits.get(rid)
            if wait is not None and not wait.answered.is_set():
                wait.asked_at = now
                asked.append(rid)
        if asked:
            link.send(protocol.encode(Peer.WORKER, Command.START, {"ids": asked}))

    def _on_go(self, idx: int, link: BrokerLink, header: dict[str, Any]) -> None:
        """The active broker's answer to STARTs: each job named in ``ids`` may start, none named
        in ``refused`` ever may. A GO from a broker we do not regard as active is ignored (its
        jobs are asked for again from the active one)."""
        if idx != self.active_idx:
            log.info("GO from broker %s, which is not the active one; ignored", link.endpoint)
            return
        for key, go in (("ids", True), ("refused", False)):
            ids = header.get(key)
            if type(ids) is not list:
                continue
            for rid in ids:
                wait = self.start_waits.get(rid) if type(rid) is bytes else None
                if wait is not None and not wait.answered.is_set():
                    wait.go = go
                    wait.answered.set()

    def _visible_name(self, uuid: str) -> str:
        g = self.gpus[uuid]
        return str(g.index) if g.simulated else g.uuid

    # ---------------------------------------------------------------- sessions

    def _open_session(self, idx: int, rid: bytes, uuid: str, mem: int, tenant: str, grant: dict[str, Any] | None = None,
                      direct: bool = False, client_key: str = "", relay: bool = True) -> None:
        """Open a session in its own thread (a device may take a while: a session process, a CUDA
        context), which then runs its calls; the reply goes out when it is open."""
        device = self.devices.get(uuid)
        if device is None:
            self.running.pop(rid, None)
            self._send_now(idx, rid, protocol.error_header(rid, RemoteError("sessions on this GPU need the pycuda device backend (extra 'cuda'), which this worker lacks or could not start on it (its log says why)")))
            return
        s = SessionRunner(rid, None, self.gpus[uuid], tenant)
        s.direct, s.client_key, s.relay = direct, client_key, relay
        s.grant = JobGrant.from_wire(grant)
        mps = self.runner.mps  # where MPS runs, a session gets its grant's MPS limits as a job does
        env = None if mps is None else mps.environment(s.grant.gpu_milli, [mem])
        s.thread = threading.Thread(target=self._session_thread, args=(s, idx, device, mem, env), name=f"session-{rid.hex()[:8]}", daemon=True)
        self.sessions[rid] = s
        self._session_threads = [t for t in self._session_threads if t.is_alive()]
        self._session_threads.append(s.thread)
        s.thread.start()

    def _start_session(self, s: SessionRunner, idx: int, device: Device, mem: int, env: dict[str, str] | None) -> bool:
        """(Session thread) Open the device session of ``s`` and answer the DISPATCH."""
        rid = s.id
        try:
            s.dev = device.open_session(mem, mps=env, tenant=s.tenant, grant=s.grant)
            s.last_used = time.monotonic()  # idle from when it is open: a session process may take a while
        except GpudError as exc:
            self._close_session(s)
            self._error(idx, rid, exc)
            return False
        except Exception as exc:
            log.exception("session %s could not be opened", protocol.id_text(rid))
            self._close_session(s)
            self._error(idx, rid, InternalError(f"the worker failed to open the session: {exc.__class__.__name__}"))
            return False
        if s.closed:  # reclaimed or its GPU failed while it opened
            s.dev.close()
            self._error(idx, rid, SessionLost(s.lost or "the session was closed while it opened"))
            return False
        log.info("session %s opened on GPU %s (%d bytes granted)", protocol.id_text(rid), s.gpu.uuid, mem)
        header: dict[str, Any] = {"ok": True, "session": rid, "gpu": protocol.gpu_info_to_wire(s.gpu)}
        data = self.data
        # Under CURVE a direct session needs the key the broker named: without one, none is offered.
        if data is not None and s.direct and (data.curve is None or s.client_key):
            try:
                s.sock, header["data"] = data.open_session(rid, s.client_key, s.relay)
            except GpudError as exc:
                log.error("session %s: no direct path offered: %s", protocol.id_text(rid), exc.message)
        self._result(idx, rid, header)
        return True

    def _on_call(self, idx: int, rid: bytes, header: dict[str, Any], frames: list[Any]) -> None:
        sid = header.get("session")
        s = self.sessions.get(sid) if type(sid) is bytes else None
        if s is None or s.closed:
            self._send_now(idx, rid, protocol.error_header(rid, SessionLost("the session is not open on this worker")))
            return
        s.last_used = time.monotonic()
        if header.get("op") == "close":
            s.closed = True
            del self.sessions[s.id]
            if self.data is not None:
                self.data.revoke(s.id)
            if s.busy and s.dev is not None and hasattr(s.dev, "kill"):
                # Closed (by its client, or by the broker for a client gone) while a call runs:
                # nobody waits for that call, and a kernel that never ends would hold it for good.
                s.dev.kill("the session was closed while a call ran")
        s.put((idx, header, frames))

    def _session_thread(self, s: SessionRunner, idx: int, device: Device, mem: int, env: dict[str, str] | None) -> None:
        try:
            self._serve_session(s, idx, device, mem, env)
        finally:
            if s.sock is not None:
                s.sock.close()
            s.close_door()

    def _serve_session(self, s: SessionRunner, idx: int, device: Device, mem: int, env: dict[str, str] | None) -> None:
        if not self._start_session(s, idx, device, mem, env):
            return
        sock = s.sock
        # A plain poll of the doorbell and the socket's ZMQ_FD: zmq_poll would first poll both
        # without waiting and ask the socket's events before and after, system calls a call pays.
        waits = select.poll()
        waits.register(s.door, select.POLLIN)
        if sock is not None:
            waits.register(int(sock.sock.getsockopt(zmq.FD)), select.POLLIN)
        name = self.config.name
        while True:
            item = self._next_op(s, sock, waits)
            if item is None:
                break
            route, call, frames = item
            rid: bytes = call["id"]
            op = call.get("op")
            s.busy = True
            try:
                if s.closed and type(route) is bytes:  # ended meanwhile (by the broker, its GPU, the idle timeout)
                    raise SessionLost("the session is not open on this worker")
                if s.lost:
                    raise SessionLost(f"the session's GPU failed ({s.lost})")
                header, out = self._session_op(s, op, call.get("args") or {}, frames, lend=type(route) is bytes)
                header["ok"] = True
            except GpudError as exc:
                header, out = protocol.error_header(rid, exc), []
            except Exception as exc:
                log.exception("session op %s failed", op)
                header, out = protocol.error_header(rid, InternalError(f"session op {op!r} failed in the worker: {exc.__class__.__name__}")), []
            finally:
                s.last_used = time.monotonic()
                s.busy = False
            if isinstance(route, int):
                self._result(route, rid, header, out)
            elif sock is not None:  # a direct call: back to its client at once, from here
                header["id"], header["worker"] = rid, name
                sock.reply(route, header, out, s.dev.hold if op == "dtoh" and s.dev is not None else None)
            if op == "close":
                break
        assert s.dev is not None
        s.dev.close()

    @staticmethod
    def _next_op(s: SessionRunner, sock: SessionSocket | None, waits: select.poll) -> tuple[Route, dict[str, Any], list[Any]] | None:
        """(Session thread) The session's next call: a relayed one from the loop, else a direct
        one from its socket, waiting for either; None when the thread is to end. The socket's
        ZMQ_FD only says that it has news: ``take`` reads its events, before each wait."""
        ops, door = s.ops, s.door
        while True:
            if not ops.empty():  # a lone consumer: what is there stays there
                return ops.get_nowait()
            if sock is not None:
                call = sock.take()
                if call is not None:
                    s.last_used = time.monotonic()
                    return call
            for fd, _ in waits.poll():
                if fd == door:
                    os.eventfd_read(door)

    def _session_op(self, s: SessionRunner, op: Any, args: Any, frames: list[Any], lend: bool = False) -> tuple[dict[str, Any], list[Any]]:
        """Run one CALL; ``lend``: a ``dtoh`` may answer with device memory itself
        (``dtoh_lent``), for a reply sent at once that holds it (``SessionSocket.reply``)."""
        if type(args) is not dict:
            raise InvalidRequest("'args' must be a map")
        dev = s.dev
        assert dev is not None  # set before the session's first call
        if op == "alloc":
            return {"handle": dev.alloc(protocol.req(args, "nbytes", int))}, []
        if op == "free":
            dev.free(protocol.req(args, "handle", int))
            return {}, []
        if op == "htod":
            if len(frames) != 1:
                raise InvalidRequest("htod carries exactly one payload frame")
            f = frames[0]
            dev.htod(protocol.req(args, "handle", int), protocol.opt(args, "offset", int, 0), memoryview(f.buffer if hasattr(f, "buffer") else f))
            return {}, []
        if op == "dtoh":
            # Relayed, the reply is kept for a resend (unacked): it must be a copy.
            copy = dev.dtoh_lent if lend else dev.dtoh
            data = copy(protocol.req(args, "handle", int), protocol.opt(args, "offset", int, 0), protocol.opt(args, "nbytes", int, None))
            return {}, [data]
        if op == "launch":
            module = protocol.opt(args, "module", str, protocol.BUILTIN_MODULE)
            name = protocol.req(args, "name", str)
            grid = protocol.parse_dims(args.get("grid", [1]), "grid")
            block = protocol.parse_dims(args.get("block", [1]), "block")
            kargs = protocol.parse_launch_args(args.get("args", []))
            shared = protocol.opt(args, "shared_mem", int, 0)
            dev.launch(module, name, grid, block, kargs, shared)
            return {}, []
        if op == "load":  # a module: CUDA C source, PTX or cubin (PROTOCOL.md §5.4)
            if len(frames) != 1:
                raise InvalidRequest("load carries exactly one payload frame: the module")
            f = frames[0]
            options = protocol.opt(args, "options", list, [])
            loaded = dev.load(protocol.req(args, "kind", str), protocol.req(args, "name", str),
                              memoryview(f.buffer if hasattr(f, "buffer") else f), options)
            return dict(loaded), []
        if op == "sync":
            dev.sync()
            return {}, []
        if op == "info":
            return dict(dev.info()), []
        if op == "close":
            return {}, []
        raise InvalidRequest(f"unknown session op {op!r}")

    def _close_session(self, s: SessionRunner, kill: str = "") -> None:
        """Close ``s`` after the calls queued before; ``kill``: why to end a session that runs in
        a process of its own at once, also mid-call (``HostedSession.kill``)."""
        s.closed = True
        self.sessions.pop(s.id, None)
        if self.data is not None:
            self.data.revoke(s.id)
        s.put(None)
        if kill and s.dev is not None and hasattr(s.dev, "kill"):
            s.dev.kill(kill)

    def _reclaim_idle_sessions(self) -> None:
        limit = time.monotonic() - self.config.session_idle
        for s in list(self.sessions.values()):
            if s.dev is not None and s.last_used < limit and not s.busy:  # not while it opens
                log.info("session %s idle past %.0fs; reclaimed", protocol.id_text(s.id), self.config.session_idle)
                self._close_session(s, kill=f"idle for more than {self.config.session_idle:g} s")

    def _fail_work_on_failed_gpus(self) -> None:
        """Fail the work on GPUs that failed a health check (``probe.failed()``): their jobs are
        killed and answered GPU_FAULT, their sessions closed (calls get SESSION_LOST), and new
        DISPATCHes naming them are answered GPU_FAULT (``_on_dispatch``)."""
        self.gpu_faults = failed = self.probe.failed()
        if not failed and not self._job_cancels:
            return
        for rid, (kind, _, uuids) in self.running.items():
            bad = next((u for u in uuids if u in failed), None)
            if kind == "job" and bad is not None:
                cancel = self._job_cancels.setdefault(rid, threading.Event())
                if not cancel.is_set():
                    log.error("job %s: GPU %s failed (%s); killing the job", protocol.id_text(rid), bad, failed[bad])
                    cancel.set()
        for rid in list(self._job_cancels):  # list(): job threads add and remove entries
            if rid not in self.running:  # it finished before its event was set
                self._job_cancels.pop(rid, None)
        for s in [s for s in self.sessions.values() if s.gpu.uuid in failed]:
            log.error("session %s: GPU %s failed (%s); closing the session", protocol.id_text(s.id), s.gpu.uuid, failed[s.gpu.uuid])
            s.lost = failed[s.gpu.uuid]
            self._close_session(s, kill=f"its GPU failed ({s.lost})")


RESULT_HEADROOM = 64 << 10  # bytes of a RESULT kept for its header and frame overheads


def _messages(link: BrokerLink, frames: list[Any]) -> list[protocol.Message]:
    """The messages of what a broker sent: one, or a BATCH's inner ones in order (checked whole
    first, PROTOCOL.md §2.1); none, logged, for what cannot be decoded."""
    try:
        msg = protocol.decode(frames, Peer.WORKER)
        return [one for one, _ in protocol.unbatch(msg)] if msg.command is Command.BATCH else [msg]
    except GpudError as exc:
        log.warning("bad message from broker %s: %s %s", link.endpoint, exc.code, exc.message)
    except Exception:
        log.exception("bug while decoding a broker message")
    return []


def check_result_size(header: dict[str, Any], frames: list[Any], max_message_bytes: int) -> None:
    """Raise TOO_LARGE when a job's result (its header, and its frames: stdout, stderr, output
    files) would not fit in one message the broker takes (PROTOCOL.md §2, §4.2): the job fails
    with a clear error instead of the worker's connection, and all its other work with it."""
    total = sum(len(f) for f in frames)
    limit = max_message_bytes - RESULT_HEADROOM
    if len(frames) > protocol.MAX_PAYLOAD_FRAMES:
        raise TooLarge(f"the job returns {len(frames) - 2} output files; a result holds at most {protocol.MAX_PAYLOAD_FRAMES - 2}")
    if len(protocol.packb(header)) > protocol.MAX_HEADER_BYTES - 1024:
        raise TooLarge(f"the names of the job's {len(frames) - 2} output files do not fit in a result's header")
    if total > limit:
        raise TooLarge(f"the job's result (stdout, stderr and {len(frames) - 2} output file(s)) is {total} bytes, over "
                       f"the {limit} a result may hold (the broker's maximum message size); return less, or "
                       "move big data through a session")


def _on_stop_signal(worker: Worker) -> None:
    notify.stopping()
    worker.stop()


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM/SIGINT drain and stop (STOPPING=1 to systemd); SIGHUP calls ``Worker.reload``."""
    signal.signal(signal.SIGTERM, lambda *_: _on_stop_signal(worker))
    signal.signal(signal.SIGINT, lambda *_: _on_stop_signal(worker))
    signal.signal(signal.SIGHUP, lambda *_: worker.request_reload())
    signal.signal(signal.SIGUSR2, lambda *_: worker.probe.request_faults())


def default_workroot() -> Path:
    return Path("/var/lib/gpud/jobs") if os.geteuid() == 0 else Path(os.environ.get("TMPDIR", "/tmp")) / f"gpud-jobs-{os.getuid()}"
