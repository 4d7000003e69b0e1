"""Echo dispatch benchmark: gpud against a bare pyzmq load-balancing broker, in one run.

Both sides get the same shape: one broker process, two worker processes that echo the payload, and
one client in this process that keeps ``--window`` requests outstanding; each worker takes at most
``--prefetch`` requests at once (gpud: the worker's ``--slots``; baseline: the credit a worker
announces). Throughput is requests per second over ``--requests`` echoes; latency is the p50/p99 of
``--latency-requests`` sequential round trips.

The baseline is a minimal but competent credit-based LRU broker (ROUTER frontend, ROUTER backend,
DEALER workers announcing credit, one ``zmq.Poller``, sockets drained in batches, the frontend not
read while no worker has credit). It is the ceiling for a pure-Python broker on this host: what gpud
adds on top (decode and validation, placement, the grant ledger, de-duplication, reply bookkeeping)
is the difference.

The last line of output is one JSON object (for scripts); everything above it is for people.

Usage::

    .venv/bin/python bench/dispatch.py [--requests 20000] [--window 64] [--prefetch 32]
                                       [--latency-requests 2000] [--payload 64]

The script also runs its own baseline processes: ``--role baseline-broker`` and
``--role baseline-worker`` (internal).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

READY = b"\x01"  # baseline worker -> broker: [READY, credit]
BATCH = 256  # messages drained from one socket before looking at the others (as gpud's broker)
POLL_TIMEOUT_MS = 10_000  # no answer for this long is a failure of the run, not a slow result


# --------------------------------------------------------------------------- baseline processes


def _router(ctx: zmq.Context[Any]) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    return s


def baseline_broker() -> int:
    """Credit-based LRU broker. Prints its endpoints as one JSON line, then serves until killed.

    frontend (ROUTER) <- client DEALER: [client, rid, *payload]
    backend  (ROUTER) <- worker DEALER: [worker, READY, credit] or [worker, client, rid, *payload]
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx: zmq.Context[Any] = zmq.Context()
    front, back = _router(ctx), _router(ctx)
    front.bind("tcp://127.0.0.1:*")
    back.bind("tcp://127.0.0.1:*")
    print(json.dumps({"frontend": front.getsockopt_string(zmq.LAST_ENDPOINT),
                      "backend": back.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    # One entry per unit of credit, least recently used first: a worker with P credits appears P
    # times, so requests go round-robin among workers with credit left.
    credit: collections.deque[bytes] = collections.deque()
    both = zmq.Poller()
    both.register(front, zmq.POLLIN)
    both.register(back, zmq.POLLIN)
    back_only = zmq.Poller()
    back_only.register(back, zmq.POLLIN)
    f_recv, f_send = front.recv_multipart, front.send_multipart
    b_recv, b_send = back.recv_multipart, back.send_multipart
    noblock = zmq.NOBLOCK
    try:
        while True:
            ready = dict((both if credit else back_only).poll(1000))
            if back in ready:
                for _ in range(BATCH):
                    try:
                        msg = b_recv(noblock)
                    except zmq.Again:
                        break
                    worker = msg[0]
                    if msg[1] == READY:
                        credit.extend([worker] * int(msg[2]))
                    else:
                        credit.append(worker)
                        f_send(msg[1:])
            if front in ready:
                for _ in range(BATCH):
                    if not credit:
                        break
                    try:
                        msg = f_recv(noblock)
                    except zmq.Again:
                        break
                    b_send([credit.popleft(), *msg])
    finally:
        front.close(0)
        back.close(0)
        ctx.term()


def baseline_worker(backend: str, prefetch: int) -> int:
    """Echo worker: announce ``prefetch`` credit, then send every request straight back."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx: zmq.Context[Any] = zmq.Context()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend)
    sock.send_multipart([READY, str(prefetch).encode()])
    recv, send = sock.recv_multipart, sock.send_multipart
    try:
        while True:
            send(recv())  # [client, rid, *payload] back as it came
    finally:
        sock.close(0)
        ctx.term()


def start_ready(procs: list[subprocess.Popen[bytes]], argv: list[str], what: str, stop: Callable[[], None]) -> Any:
    """Start ``argv``, a child that prints one JSON line once it is ready, add it to ``procs``,
    and return that line's value. When it exits first: ``stop()``, then RuntimeError."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        stop()
        raise RuntimeError(f"{what} exited with {proc.wait()} before it was ready")
    return json.loads(line)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate ``procs`` (SIGTERM, then SIGKILL after 10 s) and close the pipes they printed to."""
    from gpud_cli.cluster import terminate

    terminate(procs, timeout=10)
    for p in procs:
        if p.stdout is not None:
            p.stdout.close()


class BaselineCluster:
    """The baseline broker and two workers as child processes of this script."""

    def __init__(self, prefetch: int, workers: int = 2) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        me = [sys.executable, os.path.abspath(__file__)]
        endpoints = start_ready(self.procs, [*me, "--role", "baseline-broker"], "the baseline broker", self.stop)
        self.frontend: str = endpoints["frontend"]
        self.backend: str = endpoints["backend"]
        for _ in range(workers):
            self.procs.append(subprocess.Popen(
                [*me, "--role", "baseline-worker", "--backend", self.backend, "--prefetch", str(prefetch)],
                stdin=subprocess.DEVNULL))

    @property
    def broker_pid(self) -> int:
        return self.procs[0].pid

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs[1:]]

    def stop(self) -> None:
        stop_all(self.procs)
        self.procs.clear()


class BaselineClient:
    """A DEALER client of the baseline broker, with a request id frame per request."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.seq = 0

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def _recv(self) -> list[bytes]:
        if not self.sock.poll(POLL_TIMEOUT_MS):
            raise TimeoutError(f"baseline: no reply within {POLL_TIMEOUT_MS} ms")
        return self.sock.recv_multipart()

    def echo(self, payload: bytes) -> bytes:
        self.seq += 1
        rid = self.seq.to_bytes(8, "little")
        self.sock.send_multipart([rid, payload])
        while True:
            msg = self._recv()
            if msg[0] == rid:
                return msg[1]

    def windowed(self, payload: bytes, n: int, window: int) -> None:
        """``n`` echoes with ``window`` outstanding; checks every reply."""
        sock = self.sock
        outstanding: set[bytes] = set()
        sent = done = 0
        while done < n:
            while sent < n and len(outstanding) < window:
                self.seq += 1
                rid = self.seq.to_bytes(8, "little")
                sock.send_multipart([rid, payload])
                outstanding.add(rid)
                sent += 1
            msg = self._recv()
            while True:
                if msg[1] != payload:
                    raise RuntimeError("baseline: echo payload mismatch")
                outstanding.remove(msg[0])
                done += 1
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break


# --------------------------------------------------------------------------- measurement


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def seconds_each(fn: Callable[[], Any], count: int, warmup: int = 0) -> list[float]:
    """Seconds each of ``count`` calls of ``fn`` took, after ``warmup`` calls that are not timed."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _latency(roundtrip: Any, payload: bytes, n: int) -> dict[str, float]:
    samples: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        out = roundtrip(payload)
        samples.append((clock() - t0) / 1000.0)
        if out != payload:
            raise RuntimeError("echo payload mismatch")
    samples.sort()
    return {"p50_us": _percentile(samples, 0.50), "p99_us": _percentile(samples, 0.99),
            "mean_us": statistics.fmean(samples)}


def _measure(windowed: Any, roundtrip: Any, broker_pid: int, worker_pids: list[int],
             args: argparse.Namespace) -> dict[str, Any]:
    payload = os.urandom(args.payload)
    windowed(payload, max(args.window * 4, min(2000, args.requests // 5)))  # warm-up
    broker0 = _cpu_seconds(broker_pid)
    workers0 = [_cpu_seconds(pid) for pid in worker_pids]
    client0 = time.process_time()
    t0 = time.perf_counter()
    windowed(payload, args.requests)
    elapsed = time.perf_counter() - t0
    client1 = time.process_time()
    broker1 = _cpu_seconds(broker_pid)
    workers1 = [_cpu_seconds(pid) for pid in worker_pids]
    n = args.requests
    out: dict[str, Any] = {"per_s": n / elapsed, "seconds": elapsed,
                           "client_cpu_us_per_req": (client1 - client0) / n * 1e6}
    if broker0 is not None and broker1 is not None:
        out["broker_cpu_us_per_req"] = (broker1 - broker0) / n * 1e6
    spent = [b - a for a, b in zip(workers0, workers1, strict=True) if a is not None and b is not None]
    if len(spent) == len(worker_pids):
        out["workers_cpu_us_per_req"] = sum(spent) / n * 1e6
    for _ in range(min(200, args.latency_requests)):  # warm-up
        roundtrip(payload)
    out.update(_latency(roundtrip, payload, args.latency_requests))
    return out


def run_gpud(args: argparse.Namespace) -> dict[str, Any]:
    from gpud_cli.cluster import LocalCluster
    from gpud_client import Client

    cluster = LocalCluster(workers=2, gpus_per_worker=1, log_level="WARNING",
                           worker_args=["--slots", str(args.prefetch)])
    try:
        cluster.start()
        assert cluster.broker is not None
        client = Client(cluster.frontend, timeout=POLL_TIMEOUT_MS / 1000)
        try:
            def windowed(payload: bytes, n: int) -> None:
                pending: collections.deque[Any] = collections.deque()
                sent = 0
                while sent < n or pending:
                    while sent < n and len(pending) < args.window:
                        pending.append(client.submit_echo(payload))
                        sent += 1
                    if pending.popleft().wait() != payload:
                        raise RuntimeError("gpud: echo payload mismatch")

            workers = [proc.pid for proc in cluster.worker_procs.values()]
            result = _measure(windowed, client.echo, cluster.broker.pid, workers, args)
        finally:
            client.close()
        return result
    finally:
        cluster.stop()


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    cluster = BaselineCluster(args.prefetch)
    try:
        client = BaselineClient(cluster.frontend)
        try:
            return _measure(lambda p, n: client.windowed(p, n, args.window), client.echo,
                            cluster.broker_pid, cluster.worker_pids, args)
        finally:
            client.close()
    finally:
        cluster.stop()


def _table(gpud: dict[str, Any], base: dict[str, Any], args: argparse.Namespace) -> str:
    cpu_keys = ("client_cpu_us_per_req", "broker_cpu_us_per_req", "workers_cpu_us_per_req")

    def row(name: str, r: dict[str, Any]) -> str:
        cpu = "".join(f"{r[k]:>10.1f}" if r.get(k) is not None else f"{'-':>10}" for k in cpu_keys)
        return f"{name:<16}{r['per_s']:>10,.0f}{r['p50_us']:>9.0f}{r['p99_us']:>9.0f}{r['mean_us']:>9.0f}{cpu}"

    def ratio(key: str) -> str:
        a, b = gpud.get(key), base.get(key)
        return f"{a / b:>{10 if key in cpu_keys else 9}.2f}" if a is not None and b else f"{'-':>10}"

    return "\n".join([
        f"echo dispatch: {args.requests} requests, window {args.window}, prefetch {args.prefetch}/worker, "
        f"2 workers, payload {args.payload} B, latency over {args.latency_requests} round trips "
        f"({os.cpu_count()} CPUs)",
        f"{'':<16}{'req/s':>10}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}"
        f"{'client':>10}{'broker':>10}{'workers':>10}",
        row("gpud", gpud),
        row("baseline zmq", base),
        f"{'gpud/baseline':<16}{gpud['per_s'] / base['per_s']:>10.2f}"
        + "".join(ratio(k) for k in ("p50_us", "p99_us", "mean_us", *cpu_keys)),
        "(client, broker, workers: CPU microseconds per request during the throughput run;"
        " workers summed)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000, help="echoes in the throughput run (default %(default)s)")
    p.add_argument("--latency-requests", type=int, default=2_000, help="sequential round trips for latency (default %(default)s)")
    p.add_argument("--window", type=int, default=64, help="requests the client keeps outstanding (default %(default)s)")
    p.add_argument("--prefetch", type=int, default=32, help="requests each worker takes at once (default %(default)s)")
    p.add_argument("--payload", type=int, default=64, help="payload bytes per echo (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating gpud/baseline runs; figures are from the round with the median ratio (default %(default)s)")
    p.add_argument("--role", choices=["bench", "baseline-broker", "baseline-worker"], default="bench",
                   help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "baseline-broker":
        return baseline_broker()
    if args.role == "baseline-worker":
        return baseline_worker(args.backend, args.prefetch)
    for name in ("requests", "latency_requests", "window", "prefetch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.payload < 0:
        p.error("--payload must be >= 0")

    # The machine is noisy and shared: alternate the two systems and keep the median round, so a
    # burst of outside load lands on both sides rather than on one.
    rounds = []
    for _ in range(args.rounds):
        g, b = run_gpud(args), run_baseline(args)
        rounds.append((g["per_s"] / b["per_s"], g, b))
    rounds.sort(key=lambda r: r[0])
    _, gpud, base = rounds[len(rounds) // 2]
    print(_table(gpud, base, args))
    print("ratios by round: " + ", ".join(f"{r[0]:.2f}" for r in rounds))
    summary = {
        "gpud_per_s": round(gpud["per_s"], 1),
        "baseline_per_s": round(base["per_s"], 1),
        "ratio": round(gpud["per_s"] / base["per_s"], 3),
        "gpud_p50_us": round(gpud["p50_us"], 1),
        "gpud_p99_us": round(gpud["p99_us"], 1),
        "baseline_p50_us": round(base["p50_us"], 1),
        "baseline_p99_us": round(base["p99_us"], 1),
        "p50_ratio": round(gpud["p50_us"] / base["p50_us"], 3),
        **{f"{side}_{who}_cpu_us_per_req": _round(r.get(f"{who}_cpu_us_per_req"))
           for side, r in (("gpud", gpud), ("baseline", base))
           for who in ("client", "broker", "workers")},
        "window": args.window,
        "prefetch": args.prefetch,
        "requests": args.requests,
        "latency_requests": args.latency_requests,
        "payload": args.payload,
        "rounds": args.rounds,
        "ratios": [round(r[0], 3) for r in rounds],
        "workers": 2,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(summary))
    return 0


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


if __name__ == "__main__":
    sys.exit(main())
