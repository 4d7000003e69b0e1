"""No-op task throughput and latency: gpud against Ray, dask.distributed and ipyparallel, side by side.

Every system gets the same shape on this machine: two worker processes, one client in this process
that keeps ``--window`` no-op tasks outstanding for ``--seconds`` (throughput), then
``--latency-requests`` sequential round trips (p50/p99). gpud's task is its echo, through the
broker and a worker and back with the real client library (as bench/dispatch.py, prefetch 32 per
worker); the others run a Python function that returns its 64-byte argument:

- Ray: ``ray.init(num_cpus=2)``, a ``@ray.remote`` function, ``ray.get`` on each reference;
- dask.distributed: ``LocalCluster(n_workers=2, threads_per_worker=1)``, ``client.submit(...,
  pure=False)``, ``future.result()``;
- ipyparallel: ``Cluster(n=2)``, a load-balanced view, ``apply_async(...).get()``.

The systems run one after another, in a new order each round (this VM's speed swings); reported is
each system's median round, and every other system's throughput against gpud's in the same round.
The last line of output is one JSON object.

gpud does not depend on any of them: ``make bench-others`` makes ``.venv-compare`` with them and
runs this script there.

Usage::

    .venv-compare/bin/python bench/others.py [--seconds 3] [--rounds 3] [--window 64]
                                             [--latency-requests 500] [--only ray,dask]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dispatch  # noqa: E402  (the gpud cluster and the latency measure of bench/dispatch.py)

PAYLOAD_BYTES = 64
Submit = Callable[[bytes], Any]  # start one task, return its handle
Wait = Callable[[Any], bytes]  # its result


def _echo(x: bytes) -> bytes:
    return x


@contextlib.contextmanager
def gpud_system(args: argparse.Namespace) -> Iterator[tuple[Submit, Wait]]:
    from gpud_cli.cluster import LocalCluster
    from gpud_client import Client

    cluster = LocalCluster(workers=2, gpus_per_worker=1, log_level="WARNING",
                           worker_args=["--slots", str(args.prefetch)])
    cluster.start()
    try:
        client = Client(cluster.frontend, timeout=60)
        try:
            yield client.submit_echo, lambda p: p.wait()
        finally:
            client.close()
    finally:
        cluster.stop()


@contextlib.contextmanager
def ray_system(args: argparse.Namespace) -> Iterator[tuple[Submit, Wait]]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        echo = ray.remote(_echo)
        yield echo.remote, ray.get
    finally:
        ray.shutdown()


@contextlib.contextmanager
def dask_system(args: argparse.Namespace) -> Iterator[tuple[Submit, Wait]]:
    from dask.distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.ERROR)  # its INFO lines would bury the figures
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=logging.ERROR)
    try:
        client = Client(cluster)
        try:
            yield (lambda p: client.submit(_echo, p, pure=False)), (lambda f: f.result())
        finally:
            client.close()
    finally:
        cluster.close()


@contextlib.contextmanager
def ipyparallel_system(args: argparse.Namespace) -> Iterator[tuple[Submit, Wait]]:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=2, log_level=logging.ERROR)
    rc = cluster.start_and_connect_sync()
    try:
        view = rc.load_balanced_view()
        yield (lambda p: view.apply_async(_echo, p)), (lambda r: r.get())
    finally:
        rc.close()
        cluster.stop_cluster_sync()


SYSTEMS = {"gpud": gpud_system, "ray": ray_system, "dask": dask_system, "ipyparallel": ipyparallel_system}


def measure(submit: Submit, wait: Wait, args: argparse.Namespace) -> dict[str, float]:
    payload = os.urandom(PAYLOAD_BYTES)

    def windowed(seconds: float) -> float:
        """Tasks per second with ``window`` outstanding, every result checked."""
        pending: collections.deque[Any] = collections.deque()
        done = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while True:
            while len(pending) < args.window:
                pending.append(submit(payload))
            if wait(pending.popleft()) != payload:
                raise RuntimeError("a no-op task returned something else")
            done += 1
            if done % 64 == 0 and time.perf_counter() >= end:
                break
        for handle in pending:  # the rest are not counted, but checked and drained
            if wait(handle) != payload:
                raise RuntimeError("a no-op task returned something else")
        return done / (time.perf_counter() - t0)

    windowed(min(1.0, args.seconds))  # warm-up: workers started, code shipped
    per_s = windowed(args.seconds)
    lat = dispatch._latency(lambda p: wait(submit(p)), payload, args.latency_requests)
    return {"per_s": per_s, **lat}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="throughput run per system and round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each system once per round (default %(default)s)")
    p.add_argument("--window", type=int, default=64, help="tasks kept outstanding (default %(default)s)")
    p.add_argument("--prefetch", type=int, default=32, help="gpud: requests each worker takes at once (default %(default)s)")
    p.add_argument("--latency-requests", type=int, default=500, help="sequential round trips (default %(default)s)")
    p.add_argument("--only", default=",".join(SYSTEMS), help="systems to run, comma-separated (gpud always runs)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.window < 1 or args.latency_requests < 1:
        p.error("--seconds, --rounds, --window and --latency-requests must be positive")
    names = ["gpud", *[n for n in args.only.split(",") if n and n != "gpud"]]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    logging.basicConfig(level=logging.ERROR)
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with SYSTEMS[name](args) as (submit, wait):
                rounds[name].append(measure(submit, wait, args))
            print(f"round {r + 1}: {name:12s} {rounds[name][-1]['per_s']:>9,.0f}/s  p50 "
                  f"{rounds[name][-1]['p50_us']:>7,.0f} us", flush=True)
    best = {n: sorted(rs, key=lambda x: x["per_s"])[len(rs) // 2] for n, rs in rounds.items()}
    ahead = {n: statistics.median([g["per_s"] / o["per_s"] for g, o in zip(rounds["gpud"], rounds[n], strict=True)])
             for n in names if n != "gpud"}
    print(f"no-op tasks, window {args.window}, 2 worker processes, {os.cpu_count()} CPUs; median round of {args.rounds}")
    print(f"{'':14s}{'tasks/s':>10s}{'p50 us':>9s}{'p99 us':>9s}{'gpud is':>10s}")
    for n in names:
        x = f"{ahead[n]:.1f}x" if n in ahead else ""
        print(f"{n:14s}{best[n]['per_s']:>10,.0f}{best[n]['p50_us']:>9,.0f}{best[n]['p99_us']:>9,.0f}{x:>10s}")
    print("(gpud is: gpud's throughput over the system's, median of the rounds' ratios)")
    summary: dict[str, Any] = {}
    for n in names:
        summary[f"{n}_per_s"] = round(best[n]["per_s"], 1)
        summary[f"{n}_p50_us"] = round(best[n]["p50_us"], 1)
        summary[f"{n}_p99_us"] = round(best[n]["p99_us"], 1)
    summary.update({f"gpud_over_{n}": round(v, 2) for n, v in ahead.items()})
    summary.update({"window": args.window, "seconds": args.seconds, "rounds": args.rounds,
                    "latency_requests": args.latency_requests, "cpus": os.cpu_count()})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
