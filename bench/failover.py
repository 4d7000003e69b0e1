"""Failover benchmark: how long a broker pair and a worker loss interrupt service, and what
replication costs on the broker's hot path. Real daemons on loopback, SIMULATED GPUs.

1. Broker failover, ``--trials`` times (at least 5): a client with both endpoints sends echo
   requests one after another; the active broker is killed with SIGKILL; the time from the kill
   to the first request answered by the other broker is one sample. The killed broker is then
   restarted, comes back passive and re-syncs, and the next trial kills the other one. Every
   request of every trial must end with its own payload (``lost`` counts those that did not);
   echo executions are counted from the workers' logs (``duplicates``: requests run more than
   once; echo is retryable, so this is reported, not refused).
2. Worker recovery: idempotent jobs that print their start time run on worker w0; w0 is killed
   with SIGKILL; the sample is the time from the kill to the first of them starting elsewhere
   (default worker heartbeat 1 s x 3: the loss is noticed after about 3 s of silence).
3. Replication cost: echo throughput (``--window`` outstanding) through the active broker of a
   pair, against the same broker without a peer, in alternating rounds of one run; the ratio of
   medians.

Defaults are the shipped ones: peer heartbeat 250 ms, expiry 750 ms, client ping 0.5 s.
The last line is one JSON object with ``failover_median_s``, ``failover_max_s``,
``worker_recovery_s``, ``replication_ratio``, ``lost`` and ``duplicates``.

Usage::

    .venv/bin/python bench/failover.py [--trials 5] [--requests 5000] [--window 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpud.errors import GpudError  # noqa: E402
from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402
from tests.integration.chaos import executions  # noqa: E402


def broker_failover(trials: int) -> dict[str, Any]:
    samples: list[float] = []
    lost_box = [0]
    sent_ids: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp:
        c = LocalCluster(workers=2, pair=True, rundir=Path(tmp), log_level="WARNING",
                         worker_args=["--log-level", "DEBUG"])
        with c:
            active = c.wait_active()
            for _ in range(trials):
                other = "backup" if active == "primary" else "primary"
                deadline = time.monotonic() + 20
                while not (c.pair_state(other).get("synced") and c.pair_state(other).get("state") == "passive"):
                    assert time.monotonic() < deadline, "the passive broker did not sync"
                    time.sleep(0.05)
                killed_at: list[float] = []
                first_after: list[float] = []
                stop = threading.Event()

                t = threading.Thread(target=_traffic, args=(c.frontends, stop, killed_at, first_after, sent_ids, lost_box), daemon=True)
                t.start()
                time.sleep(0.5)
                killed_at.append(time.monotonic())
                c.kill_broker(active)
                while not first_after and time.monotonic() < killed_at[0] + 30:
                    time.sleep(0.005)
                stop.set()
                t.join(30)
                assert first_after, "no request was answered after the failover"
                samples.append(first_after[0] - killed_at[0])
                assert c.wait_active() == other
                c.restart_broker(active)
                active = other
            echo_runs, _ = executions([c.rundir / f"{w}.log" for w in c.worker_procs])  # type: ignore[operator]
    dups = sum(1 for i in sent_ids if echo_runs[i] > 1)
    return {"samples": samples, "lost": lost_box[0], "duplicates": dups, "requests": len(sent_ids)}


def _traffic(endpoints: list[str], stop: threading.Event, killed_at: list[float], first_after: list[float],
             sent_ids: list[str], lost: list[int]) -> None:
    """Echo requests one after another until ``stop``; notes when the first request sent after
    the kill is answered, and counts answers that were not the payload (lost)."""
    with Client(endpoints, timeout=20) as cl:
        n = 0
        while not stop.is_set():
            payload = b"t%d" % n
            n += 1
            t_send = time.monotonic()
            p = cl.submit_echo(payload)
            sent_ids.append(p.id.hex()[:12])
            try:
                ok = p.wait() == payload
            except GpudError:
                ok = False
            if not ok:
                lost[0] += 1
            if killed_at and t_send > killed_at[0] and not first_after:
                first_after.append(time.monotonic())


def worker_recovery(jobs: int = 6) -> float:
    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp:
        c = LocalCluster(workers=0, rundir=Path(tmp), log_level="INFO")
        c.start()
        try:
            c.add_worker("w0")
            c.wait_workers(1)
            with Client(c.frontend, timeout=60) as cl:
                script = "python3 -c 'import time; print(time.time())'; sleep 30"
                pend = [cl.submit(["sh", "-c", script], gpu_milli=100, idempotent=True, time_limit=60) for _ in range(jobs)]
                time.sleep(1.0)  # they run on w0 (the only worker)
                c.add_worker("w1")
                c.wait_workers(2)
                killed = time.time()
                c.kill_worker("w0")
                # The first re-placed job to start on w1 says when it started; the rest are not waited for.
                deadline = time.monotonic() + 60
                starts: list[float] = []
                while not starts and time.monotonic() < deadline:
                    for w in c.worker_procs:
                        log = (c.rundir / f"{w}.log")  # type: ignore[operator]
                        if w == "w1" and log.exists() and " started as " in log.read_text():
                            starts.append(time.time())
                    time.sleep(0.005)
                for p in pend:
                    p.cancel()
                assert starts, "no job started elsewhere"
                return starts[0] - killed
        finally:
            c.stop()


def _throughput(pair: bool, requests: int, window: int) -> float:
    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp:
        c = LocalCluster(workers=2, pair=pair, rundir=Path(tmp), log_level="WARNING", worker_args=["--slots", "32"])
        with c:
            if pair:
                c.wait_active()
                deadline = time.monotonic() + 20
                while not c.pair_state("backup").get("synced"):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            with Client(c.frontends, timeout=30) as cl:
                payload = b"x" * 64
                for _ in range(500):  # warm up
                    cl.echo(payload)
                t0 = time.perf_counter()
                pending: deque[Any] = deque()
                sent = 0
                while sent < requests or pending:
                    while sent < requests and len(pending) < window:
                        pending.append(cl.submit_echo(payload))
                        sent += 1
                    if pending.popleft().wait() != payload:
                        raise RuntimeError("echo payload mismatch")
                return requests / (time.perf_counter() - t0)


def replication(requests: int, window: int, rounds: int) -> dict[str, Any]:
    alone: list[float] = []
    paired: list[float] = []
    for _ in range(rounds):
        alone.append(_throughput(False, requests, window))
        paired.append(_throughput(True, requests, window))
    return {"standalone": alone, "pair": paired, "ratio": statistics.median(paired) / statistics.median(alone)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    fo = broker_failover(args.trials)
    print(f"broker failover: {', '.join(f'{s:.3f}' for s in fo['samples'])} s "
          f"(median {statistics.median(fo['samples']):.3f}, max {max(fo['samples']):.3f}); "
          f"{fo['requests']} requests, lost {fo['lost']}, run twice {fo['duplicates']}")
    wr = worker_recovery()
    print(f"worker recovery (default heartbeat 1 s x 3): {wr:.3f} s from SIGKILL to a job starting elsewhere")
    rep = replication(args.requests, args.window, args.rounds)
    print(f"echo throughput, window {args.window}: standalone {', '.join(f'{v:.0f}' for v in rep['standalone'])} req/s; "
          f"pair {', '.join(f'{v:.0f}' for v in rep['pair'])} req/s; ratio of medians {rep['ratio']:.2f}")
    print(json.dumps({
        "failover_median_s": round(statistics.median(fo["samples"]), 3),
        "failover_max_s": round(max(fo["samples"]), 3),
        "failover_samples_s": [round(s, 3) for s in fo["samples"]],
        "worker_recovery_s": round(wr, 3),
        "replication_ratio": round(rep["ratio"], 3),
        "throughput_standalone": [round(v) for v in rep["standalone"]],
        "throughput_pair": [round(v) for v in rep["pair"]],
        "lost": fo["lost"],
        "duplicates": fo["duplicates"],
        "requests": fo["requests"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
