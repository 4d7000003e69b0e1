"""Scale benchmark: a live broker with 1,000 simulated workers of 8 GPUs each, in one run.

A real broker (``python -m gpud_cli broker --security none``, default 1 s heartbeat) serves
``--workers`` simulated workers. They live in ``--procs`` processes, each holding many real DEALER
connections under one ``zmq.Poller``; every simulated worker sends READY with its GPUs, answers
WELCOME, heartbeats every interval with changing GPU measurements and its ``running`` list, and
answers each echo DISPATCH with a RESULT at once (payload echoed). Measured:

(a) broker CPU, as a fraction of one core, over ``--idle-seconds`` with only heartbeats flowing
    (user + system time of the broker process from ``/proc``, its zmq I/O thread included);
(b) placement decision time p50/p99, from the broker's own timing (admin ``status``,
    ``placement``), while one client (``gpud_client.Client``) keeps ``--window`` echoes outstanding
    for ``--drive-seconds``;
(c) broker resident memory (RSS);
(d) end-to-end echo latency p50/p99: ``--latency-requests`` sequential round trips, heartbeats
    flowing meanwhile;
(e) with ``--decisions N``, instead of all that: the placement policies' decision time alone,
    in-process, at the same scale (``decisions``), for ``--policies``.

The same measurements are taken first with ``--baseline-workers`` workers (default 10: 80 GPUs), so
the large figures can be read as ratios on a noisy machine. Targets (the issue's): placement p99
under 1 ms with 8,000 GPUs, heartbeat handling under 25% of one core at a 1 s interval.

The last line of output is one JSON object (for scripts); everything above it is for people.

Usage::

    .venv/bin/python bench/scale.py [--workers 1000] [--gpus 8] [--procs 4] [--window 32]
    .venv/bin/python bench/scale.py --decisions 5000 [--policies balanced,fgd-balanced,fgd]

``--role fake-workers`` runs one process of simulated workers (internal).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.resources import GpuInfo
from gpud.sockets import NOBLOCK, recv_frames, send_frames

GiB = 1 << 30
HEARTBEAT_MS = 1000  # the broker's default; the simulated workers propose the same
CLIENT_TIMEOUT_S = 30.0

# --------------------------------------------------------------------------- simulated workers

def fake_workers(backend: str, first: int, count: int, gpus: int, hb_ms: int) -> int:
    """``count`` simulated workers on as many DEALER sockets in one process. Prints one JSON line
    when all are welcomed and one with its counters when stopped (SIGTERM).

    The sockets are watched through their ``ZMQ_FD`` in one epoll set rather than a ``zmq.Poller``:
    ``zmq_poll`` costs about 160 us per call over 250 sockets, which at a few thousand wake-ups a
    second would take the broker's CPU on a small machine and distort what is measured. A socket is
    read until EAGAIN whenever its FD is readable and after every send on it (a send may consume the
    FD's edge); a sweep over all sockets every second guards against a missed edge."""
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.setsockopt(zmq.MAX_SOCKETS, count + 64)
    interval = hb_ms / 1000.0
    names = [f"sim{n:05d}" for n in range(first, first + count)]
    uuids = [[f"GPU-{n:05d}-{j}" for j in range(gpus)] for n in range(first, first + count)]
    socks: list[zmq.Socket[bytes]] = []
    by_fd: dict[int, int] = {}
    ep = select.epoll()
    for i in range(count):
        s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.connect(backend)
        socks.append(s)
        fd = int(s.getsockopt(zmq.FD))
        by_fd[fd] = i
        ep.register(fd, select.EPOLLIN)

    seq = [0] * count
    welcomed = [False] * count
    n_welcomed = 0
    beats: list[tuple[float, int]] = []  # (due, worker) heap
    counters = {"heartbeats": 0, "results": 0, "readies": 0, "disconnects": 0, "errors": 0}
    encode, decode = P.encode, P.decode
    monotonic = time.monotonic

    def ready(i: int) -> None:
        infos = [P.gpu_info_to_wire(GpuInfo(uuid=u, index=j, model="A100-SXM4-80GB", mem=80 * GiB, cc=(8, 0),
                                            simulated=True)) for j, u in enumerate(uuids[i])]
        header = {"name": names[i], "hostname": "bench-scale", "gpus": infos, "cpu_milli": 64_000,
                  "host_mem": 512 * GiB, "slots": 64, "heartbeat_ms": hb_ms, "liveness": 3, "simulated": True}
        send_frames(socks[i], encode(Peer.WORKER, Command.READY, header))
        counters["readies"] += 1

    def serve(i: int) -> None:
        """Handle everything waiting on worker ``i``'s socket."""
        sock = socks[i]
        while True:
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                return
            for msg in P.messages(decode(frames, Peer.WORKER)):  # a BATCH: each of its messages
                handle(i, sock, msg)

    def handle(i: int, sock: zmq.Socket[bytes], msg: P.Message) -> None:
        """One message from the broker to worker ``i``."""
        nonlocal n_welcomed
        cmd = msg.command
        if cmd is Command.DISPATCH:
            h = msg.header
            grant = h.get("grant") or {}
            if h.get("kind") == "echo":
                out = {"id": h["id"], "ok": True, "worker": names[i], "gpus": grant.get("gpus", [])}
                send_frames(sock, encode(Peer.WORKER, Command.RESULT, out, msg.frames))
            else:
                out = {"id": h["id"], "ok": False, "code": "INVALID_REQUEST",
                       "message": "the scale benchmark's workers run echo only"}
                send_frames(sock, encode(Peer.WORKER, Command.RESULT, out))
            counters["results"] += 1
        elif cmd is Command.HEARTBEAT:
            pass
        elif cmd is Command.WELCOME:
            if not welcomed[i]:
                welcomed[i] = True
                n_welcomed += 1
                # Spread the heartbeats evenly over the interval, as independent hosts are.
                heapq.heappush(beats, (monotonic() + interval * (i + 0.5) / count, i))
        elif cmd is Command.DISCONNECT:
            counters["disconnects"] += 1
            ready(i)  # "unknown worker": register again
        else:
            counters["errors"] += 1

    for i in range(count):
        ready(i)
    announced = False
    next_sweep = monotonic() + 1.0
    while not stop:
        now = monotonic()
        wait = min(next_sweep, beats[0][0] if beats else next_sweep) - now
        try:
            events = ep.poll(max(0.0, wait))
        except InterruptedError:
            continue
        for fd, _ in events:
            serve(by_fd[fd])
        now = monotonic()
        if now >= next_sweep:
            for i in range(count):
                serve(i)
            next_sweep = now + 1.0
        if not announced and n_welcomed == count:
            announced = True
            print(json.dumps({"welcomed": count}), flush=True)
        while beats and beats[0][0] <= now:
            due, i = heapq.heappop(beats)
            seq[i] += 1
            n = seq[i]
            states = [{"uuid": u, "util": float((n * 37 + j * 11) % 101), "mem_used": ((n * 7 + j) % 80) * GiB,
                       "temp": 35.0 + (n + j) % 40, "power": 100.0 + (n * 3 + j) % 300, "health": "ok"}
                      for j, u in enumerate(uuids[i])]
            send_frames(socks[i], encode(Peer.WORKER, Command.HEARTBEAT,
                                         {"seq": n, "gpus": states, "running": [], "simulated": True}))
            counters["heartbeats"] += 1
            serve(i)
            heapq.heappush(beats, (max(due + interval, now), i))
    print(json.dumps(counters), flush=True)
    ep.close()
    for s in socks:
        s.close(0)
    ctx.term()
    return 0


# --------------------------------------------------------------------------- measurement helpers


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far, all cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _ours_seconds(run: Run) -> float:
    """CPU seconds of this benchmark's processes: broker, simulated workers, this client."""
    return _cpu_seconds(run.broker.pid) + sum(_cpu_seconds(p) for p in run.worker_pids()) + _cpu_seconds(os.getpid())


def _rss_mib(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) of a process, MiB."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line[:5]] = int(line.split()[1]) / 1024.0
    return got.get("VmRSS", 0.0), got.get("VmHWM", 0.0)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class Run:
    """One broker and its simulated workers, as child processes."""

    def __init__(self, workers: int, gpus: int, procs: int, tmp: Path, policy: str | None = None) -> None:
        self.tmp = tmp
        self.workers = workers
        self.procs: list[subprocess.Popen[str]] = []
        ready = tmp / "broker.json"
        self.log = open(tmp / "broker.log", "w")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.broker = subprocess.Popen(
            [sys.executable, "-m", "gpud_cli", "broker", "--security", "none",
             "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
             "--admin", f"ipc://{tmp}/admin.sock", "--ready-file", str(ready), "--log-level", "WARNING",
             *(["--policy", policy] if policy else [])],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.broker.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the broker did not start:\n" + (tmp / "broker.log").read_text()[-3000:])
            time.sleep(0.02)
        self.endpoints = json.loads(ready.read_text())
        procs = max(1, min(procs, workers))
        me = [sys.executable, os.path.abspath(__file__), "--role", "fake-workers", "--backend", self.endpoints["backend"],
              "--gpus", str(gpus)]
        first = 0
        for p in range(procs):
            n = workers // procs + (1 if p < workers % procs else 0)
            self.procs.append(subprocess.Popen([*me, "--first", str(first), "--count", str(n)],
                                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
            first += n
        self._wait_welcomed(deadline=time.monotonic() + 60)

    def _wait_welcomed(self, deadline: float) -> None:
        sel = selectors.DefaultSelector()
        for p in self.procs:
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, p)
        left = len(self.procs)
        while left:
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated workers were not all welcomed in time")
            for key, _ in sel.select(timeout=0.5):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError("a simulated worker process exited early")
                if "welcomed" in json.loads(line):
                    sel.unregister(key.fileobj)
                    left -= 1
        sel.close()

    def status(self) -> dict[str, Any]:
        """Admin ``status``. Read by hand: with thousands of GPUs its reply header is far over the
        protocol's 64 KiB header limit, which ``P.decode`` (and so ``admin_call``) enforces."""
        ctx: zmq.Context[Any] = zmq.Context.instance()
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoints["admin"])
            rid = P.new_id()
            send_frames(sock, P.encode(Peer.ADMIN, Command.ADMIN, {"id": rid, "cmd": "status", "args": {},
                                                                  "user": "bench", "pid": os.getpid()}))
            while True:
                if not sock.poll(30_000):
                    raise RuntimeError("the broker's admin socket did not answer within 30 s")
                frames = sock.recv_multipart()
                h = P.unpackb(frames[2])
                if frames[1] == P.CMD_BYTES[Command.REPLY] and h.get("id") == rid:
                    if h.get("ok") is not True:
                        raise RuntimeError(f"admin status failed: {h.get('code')} {h.get('message')}")
                    result = h["result"]
                    assert isinstance(result, dict)
                    return result
        finally:
            sock.close(0)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> dict[str, int]:
        """Stop the workers (their counters are summed and returned), then the broker."""
        totals: dict[str, int] = collections.Counter()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            for line in (out or "").splitlines():
                data = json.loads(line)
                if "heartbeats" in data:
                    totals.update(data)
        if self.broker.poll() is None:
            self.broker.send_signal(signal.SIGTERM)
            try:
                self.broker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.broker.kill()
                self.broker.wait()
        self.log.close()
        return dict(totals)


def measure(workers: int, args: argparse.Namespace) -> dict[str, Any]:
    from gpud_client import Client

    with tempfile.TemporaryDirectory(prefix="gpud-scale-") as d:
        run = Run(workers, args.gpus, args.procs, Path(d), args.policy)
        out: dict[str, Any] = {"workers": workers, "gpus": workers * args.gpus}
        try:
            pid = run.broker.pid
            st = run.status()
            out["policy"] = st["broker"]["policy"]
            if st["counts"]["workers"] != workers:
                raise RuntimeError(f"the broker counts {st['counts']['workers']} workers, not {workers}")
            time.sleep(args.settle_seconds)  # every worker heartbeating at its own phase

            # (a) heartbeats only
            c0, w0 = _cpu_seconds(pid), [_cpu_seconds(p) for p in run.worker_pids()]
            m0, o0 = _machine_busy_seconds(), _ours_seconds(run)
            t0 = time.perf_counter()
            time.sleep(args.idle_seconds)
            wall = time.perf_counter() - t0
            c1, w1 = _cpu_seconds(pid), [_cpu_seconds(p) for p in run.worker_pids()]
            out["heartbeat_cpu_fraction"] = (c1 - c0) / wall
            out["sim_workers_cpu_fraction"] = (sum(w1) - sum(w0)) / wall
            # Cores kept busy by everything else on the machine (other users, other benchmarks).
            out["outside_cpu_idle"] = max(0.0, (_machine_busy_seconds() - m0) - (_ours_seconds(run) - o0)) / wall
            out["rss_idle_mib"] = _rss_mib(pid)[0]

            client = Client(run.endpoints["frontend"], timeout=CLIENT_TIMEOUT_S)
            try:
                payload = os.urandom(args.payload)
                for _ in range(200):  # warm-up: connections, caches
                    client.echo(payload)
                # (b) placement under a windowed echo load
                placed0 = run.status()["placement"]["count"]
                pending: collections.deque[Any] = collections.deque()
                done = 0
                c0 = _cpu_seconds(pid)
                m0, o0 = _machine_busy_seconds(), _ours_seconds(run)
                t0 = time.perf_counter()
                end = t0 + args.drive_seconds
                while True:
                    now = time.perf_counter()
                    while now < end and len(pending) < args.window:
                        pending.append(client.submit_echo(payload))
                    if not pending:
                        break
                    if pending.popleft().wait() != payload:
                        raise RuntimeError("echo payload mismatch")
                    done += 1
                wall = time.perf_counter() - t0
                out["drive_per_s"] = done / wall
                out["drive_broker_cpu_fraction"] = (_cpu_seconds(pid) - c0) / wall
                out["outside_cpu_drive"] = max(0.0, (_machine_busy_seconds() - m0) - (_ours_seconds(run) - o0)) / wall
                st = run.status()
                p = st["placement"]
                out["placement_p50_us"] = p["p50_us"]
                out["placement_p99_us"] = p["p99_us"]
                out["placement_max_us"] = p["max_us"]
                out["placements"] = p["count"] - placed0
                # (d) sequential echo latency, heartbeats flowing
                samples: list[float] = []
                clock = time.perf_counter_ns
                for _ in range(args.latency_requests):
                    t = clock()
                    if client.echo(payload) != payload:
                        raise RuntimeError("echo payload mismatch")
                    samples.append((clock() - t) / 1000.0)
                samples.sort()
                out["echo_p50_us"] = _percentile(samples, 0.50)
                out["echo_p99_us"] = _percentile(samples, 0.99)
            finally:
                client.close()
            # (c) memory
            out["broker_rss_mib"], out["broker_peak_rss_mib"] = _rss_mib(pid)
            t0 = time.perf_counter()
            st = run.status()
            out["admin_status_ms"] = (time.perf_counter() - t0) * 1000  # the broker's loop is busy meanwhile
            out["worker_losses"] = st["counters"]["worker_losses"]
            out["workers_at_end"] = st["counts"]["workers"]
        finally:
            out["sim"] = run.stop()
        return out


def _table(small: dict[str, Any], large: dict[str, Any]) -> str:
    rows: list[tuple[str, Callable[[dict[str, Any]], str], str | None]] = [
        ("workers / GPUs", lambda r: f"{r['workers']:,} / {r['gpus']:,}", None),
        ("heartbeat CPU (% of a core)", lambda r: f"{100 * r['heartbeat_cpu_fraction']:.1f}", "heartbeat_cpu_fraction"),
        ("placement p50 (us)", lambda r: f"{r['placement_p50_us']:.0f}", "placement_p50_us"),
        ("placement p99 (us)", lambda r: f"{r['placement_p99_us']:.0f}", "placement_p99_us"),
        ("placement max (us)", lambda r: f"{r['placement_max_us']:.0f}", "placement_max_us"),
        ("echo p50 (us)", lambda r: f"{r['echo_p50_us']:.0f}", "echo_p50_us"),
        ("echo p99 (us)", lambda r: f"{r['echo_p99_us']:.0f}", "echo_p99_us"),
        ("echo req/s (window)", lambda r: f"{r['drive_per_s']:,.0f}", "drive_per_s"),
        ("broker CPU while driving (%)", lambda r: f"{100 * r['drive_broker_cpu_fraction']:.0f}", "drive_broker_cpu_fraction"),
        ("broker RSS, heartbeats only (MiB)", lambda r: f"{r['rss_idle_mib']:.0f}", "rss_idle_mib"),
        ("broker RSS after the load (MiB)", lambda r: f"{r['broker_rss_mib']:.0f}", "broker_rss_mib"),
        ("sim workers CPU, idle (%)", lambda r: f"{100 * r['sim_workers_cpu_fraction']:.0f}", "sim_workers_cpu_fraction"),
        ("outside load, idle / driving (cores)",
         lambda r: f"{r['outside_cpu_idle']:.2f} / {r['outside_cpu_drive']:.2f}", None),
        ("admin status round trip (ms)", lambda r: f"{r['admin_status_ms']:.0f}", "admin_status_ms"),
        ("worker losses", lambda r: f"{r['worker_losses']}", None),
    ]
    lines = [f"{'':<34}{'baseline':>14}{'large':>14}{'large/base':>12}"]
    for name, fmt, key in rows:
        ratio = ""
        if key and small.get(key):
            ratio = f"{large[key] / small[key]:.2f}"
        lines.append(f"{name:<34}{fmt(small):>14}{fmt(large):>14}{ratio:>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000, help="simulated workers (default %(default)s)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per worker (default %(default)s)")
    p.add_argument("--procs", type=int, default=4, help="processes the workers are simulated in (default %(default)s)")
    p.add_argument("--baseline-workers", type=int, default=10, help="workers of the small run (default %(default)s)")
    p.add_argument("--window", type=int, default=32, help="echoes the client keeps outstanding (default %(default)s)")
    p.add_argument("--idle-seconds", type=float, default=10.0, help="heartbeat-only CPU window (default %(default)s)")
    p.add_argument("--drive-seconds", type=float, default=10.0, help="windowed echo load (default %(default)s)")
    p.add_argument("--settle-seconds", type=float, default=2.0, help="wait after registration (default %(default)s)")
    p.add_argument("--latency-requests", type=int, default=2000, help="sequential echoes (default %(default)s)")
    p.add_argument("--payload", type=int, default=64, help="echo payload bytes (default %(default)s)")
    p.add_argument("--policy", default=None, help="the broker's placement policy (default: the broker's default)")
    p.add_argument("--decisions", type=int, default=0, metavar="N",
                   help="instead: N placement decisions in-process per policy (--policies), no sockets")
    p.add_argument("--policies", default="balanced,fgd-balanced,fgd",
                   help="with --decisions: the policies to time (default %(default)s)")
    p.add_argument("--role", choices=["bench", "fake-workers"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "fake-workers":
        return fake_workers(args.backend, args.first, args.count, args.gpus, HEARTBEAT_MS)
    for name in ("workers", "gpus", "procs", "baseline_workers", "window", "latency_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.gpus > 64:
        p.error("--gpus must be at most 64 (the protocol's limit per worker)")

    if args.decisions:
        return decisions(args)
    small = measure(args.baseline_workers, args)
    large = measure(args.workers, args)
    print(f"scale: {args.workers} simulated workers x {args.gpus} GPUs in {args.procs} processes, heartbeat "
          f"{HEARTBEAT_MS} ms; baseline {args.baseline_workers} workers; window {args.window}, "
          f"{args.latency_requests} sequential echoes ({os.cpu_count()} CPUs)")
    print(_table(small, large))
    p99_ok = large["placement_p99_us"] < 1000.0
    hb_ok = large["heartbeat_cpu_fraction"] < 0.25
    print(f"targets: placement p99 < 1 ms with {large['gpus']:,} GPUs: {'met' if p99_ok else 'MISSED'}; "
          f"heartbeat CPU < 25% of a core: {'met' if hb_ok else 'MISSED'}")
    outside = max(large["outside_cpu_idle"], large["outside_cpu_drive"])
    if outside > 0.25:
        print(f"note: other work kept {outside:.2f} of the machine's {os.cpu_count()} cores busy during the run; "
              "wall-time percentiles (placement, echo) include the time the broker waited for a core")
    summary = {
        **_figures(large, LARGE_FIGURES),
        "outside_cpu_cores": round(outside, 2),
        **_figures(small, BASELINE_FIGURES, "baseline_"),
        "placement_target_met": p99_ok,
        "heartbeat_target_met": hb_ok,
        "heartbeats_sent": large["sim"].get("heartbeats", 0),
        "window": args.window,
        "latency_requests": args.latency_requests,
        "procs": args.procs,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(summary))
    return 0


def decisions(args: argparse.Namespace) -> int:
    """(e) The policy call alone, in this process, with the broker's own objects: ``--workers``
    workers of ``--gpus`` GPUs in a ``WorkerRegistry``, a seeded stream of echoes (1 milli, most of
    the traffic), session and job shares and whole GPUs, each granted through ``ledger.grant`` and
    released first in, first out, so the cluster stays about a third full; the broker's task mix fed
    with every request. Each decision is timed as the broker times it (wall time of the call, with
    ``balanced`` given the broker's random sample first), in this thread's CPU time (what it costs,
    whatever else the machine runs) and in wall time; the first half warms up the cluster."""
    import random
    from collections import deque
    from time import perf_counter, thread_time

    from gpud.heartbeat import HeartbeatPolicy
    from gpud.resources import GpuInfo, Need
    from gpud_broker import ledger
    from gpud_broker.mix import TaskMix
    from gpud_broker.policies import SAMPLE_ABOVE, SAMPLE_K, make_policy
    from gpud_broker.registry import WorkerRegistry

    needs = [Need(gpu_milli=1)] * 6 + [
        Need(gpu_milli=100, mem=256 << 20), Need(gpu_milli=250, cpu_milli=2000), Need(gpu_milli=500, cpu_milli=4000),
        Need(gpus=1, cpu_milli=8000), Need(gpus=2, cpu_milli=16000),
    ]
    capacity = args.workers * args.gpus * 1000
    mean_milli = sum(n.total_milli for n in needs) / len(needs)
    hold = int(capacity / 3 / mean_milli)
    rows = {}
    for policy in [p for p in args.policies.split(",") if p]:
        rng = random.Random(1)
        reg = WorkerRegistry()
        for i in range(args.workers):
            name = f"sim{i:05d}"
            reg.add(name=name, identity=name.encode(), hostname=name, cpu_milli=96_000, host_mem=512 << 30,
                    slots=1 << 20, policy=HeartbeatPolicy(), now=0.0, simulated=True,
                    gpus=[GpuInfo(f"{name}-{g}", g, "simulated", 16 << 30, (8, 0), simulated=True) for g in range(args.gpus)])
        mix = TaskMix()
        place = make_policy(policy, seed=1, mix=mix)
        live: deque[Any] = deque()
        n = args.decisions if policy != "fgd" else max(1, args.decisions // 10)  # fgd looks at every worker
        times: list[float] = []  # wall
        cpus: list[float] = []  # this thread's CPU time: what a decision costs, without the waits
        for i in range(2 * n):
            need = needs[rng.randrange(len(needs))]
            mix.observe(need)
            c0 = thread_time()
            t0 = perf_counter()
            if policy == "balanced" and len(reg.workers) > SAMPLE_ABOVE:
                got = place(need, reg.sample(SAMPLE_K, rng), ()) or place(need, reg.by_identity.values(), ())
            else:
                got = place(need, reg.by_identity.values(), ())
            if i >= n:
                times.append(perf_counter() - t0)
                cpus.append(thread_time() - c0)
            if got is not None:
                live.append((got.worker, got.gpus, ledger.grant(got.worker, got.gpus, need)))
            while len(live) > hold:
                w, gpus, g = live.popleft()
                ledger.release(w, gpus, g)
        times.sort()
        cpus.sort()
        rows[policy] = {
            "decisions": len(times),
            "cpu_p50_us": _r1(1e6 * _percentile(cpus, 0.50)),
            "cpu_p99_us": _r1(1e6 * _percentile(cpus, 0.99)),
            "cpu_max_us": _r1(1e6 * cpus[-1]),
            "wall_p50_us": _r1(1e6 * _percentile(times, 0.50)),
            "wall_p99_us": _r1(1e6 * _percentile(times, 0.99)),
            "held_share": round(sum(g.granted_milli for g in reg.gpus.values()) / capacity, 3),
        }
        r = rows[policy]
        print(f"  {policy:<13} {r['decisions']:>6} decisions: CPU p50 {r['cpu_p50_us']:>8.1f} us  p99 {r['cpu_p99_us']:>8.1f} us  "
              f"max {r['cpu_max_us']:>9.1f} us; wall p50 {r['wall_p50_us']:>8.1f} us  p99 {r['wall_p99_us']:>9.1f} us  "
              f"({100 * r['held_share']:.0f}% of the GPU share held)", flush=True)
    print(json.dumps({"workers": args.workers, "gpus": args.workers * args.gpus, "decisions": rows}))
    return 0


LARGE_FIGURES = ("workers", "gpus", "placement_p50_us", "placement_p99_us", "placement_max_us", "placements",
                 "heartbeat_cpu_fraction", "broker_rss_mib", "broker_rss_idle_mib", "broker_peak_rss_mib",
                 "echo_p50_us", "echo_p99_us", "drive_per_s", "worker_losses", "admin_status_ms")
BASELINE_FIGURES = ("workers", "gpus", "placement_p50_us", "placement_p99_us", "heartbeat_cpu_fraction",
                    "broker_rss_mib", "broker_rss_idle_mib", "echo_p50_us", "echo_p99_us", "drive_per_s")


def _figures(m: dict[str, Any], names: tuple[str, ...], prefix: str = "") -> dict[str, Any]:
    """The figures ``names`` of a measurement for the summary line, rounded for it: times, sizes
    and rates to 0.1, the heartbeat CPU fraction to 1e-4, counts as they are."""
    out: dict[str, Any] = {}
    for name in names:
        value = m["rss_idle_mib" if name == "broker_rss_idle_mib" else name]
        if name == "heartbeat_cpu_fraction":
            value = round(value, 4)
        elif name.endswith(("_us", "_mib", "_per_s", "_ms")):
            value = _r1(value)
        out[prefix + name] = value
    return out


def _r1(value: float) -> float:
    return round(value, 1)


if __name__ == "__main__":
    sys.exit(main())
