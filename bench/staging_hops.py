"""Where another client's echo waits during a staged upload (PROTOCOL.md §11): its p99 split into
the broker's part and the rest, against the same probes during a bare transfer.

A LocalCluster (one broker, one worker with two simulated GPUs, labelled simulated). A prober, in
a process of its own, alternates a broker-only PING (answered by the broker's loop: no worker on
its path) and a 64-byte echo (through the worker the upload goes to), 2 ms apart. Meanwhile this
process runs ``--warmup`` uploads not counted, idles for ``--idle`` seconds, runs ``true`` with a
staged input of ``--mib`` MiB ``--rounds`` times, then sends the same bytes ``--rounds`` times
through the bare chain of ``bench/transfer.py`` (its own processes: gpud's are idle then). The p99 of each probe while idle,
during the uploads and during the bare transfers tells whether the wait is the broker's, the
worker's or the machine's: a probe slowed by the bare transfer as much as by gpud's upload waits
for a busy CPU, not for gpud.

Usage::

    .venv/bin/python bench/staging_hops.py [--mib 1024] [--rounds 2] [--idle 3] [--warmup 1]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from staging import MIB, p99  # noqa: E402  (the staged-upload benchmark's helpers)
from transfer import Bare  # noqa: E402  (the bare chain, shared with the other transfer benchmarks)

from gpud import protocol  # noqa: E402
from gpud.protocol import Command, Peer  # noqa: E402
from gpud.transfer import CHUNK_BYTES, WINDOW  # noqa: E402
from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402


def prober(endpoint: str) -> int:
    """The prober's process: PING and echo in turn until its stdin ends, then its samples as JSON
    (start times on CLOCK_MONOTONIC, the same clock in every process)."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(protocol.ROUTING_ID_BYTES))  # a client's routing id
    sock.connect(endpoint)
    ping = protocol.encode(Peer.CLIENT, Command.PING, {"sessions": []})
    out: dict[str, list[tuple[float, float]]] = {"ping": [], "echo": []}
    with Client([endpoint], timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            sock.send_multipart(ping)
            sock.recv_multipart()
            out["ping"].append((t, time.perf_counter() - t))
            time.sleep(0.002)
            t = time.perf_counter()
            client.echo(b"e" * 64)
            out["echo"].append((t, time.perf_counter() - t))
            time.sleep(0.002)
    sock.close(0)
    sys.stdout.write(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the staged input in MiB (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="uploads, then bare transfers (default %(default)s)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of idle probes first (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="uploads before the idle probes, not counted (default %(default)s): the first upload after the "
                        "daemons start writes into memory new to them, which a VM may charge several times more for")
    p.add_argument("--role", choices=["bench", "prober"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "prober":
        return prober(args.endpoint)
    data = os.urandom(MIB) * args.mib
    windows: dict[str, list[tuple[float, float]]] = {"upload": [], "bare": []}
    with LocalCluster(workers=1, gpus_per_worker=2, log_level="WARNING") as cluster:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "prober",
                                  "--endpoint", cluster.frontends[0]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        with Client(cluster.frontends, timeout=60) as c:
            for _ in range(args.warmup):
                c.run(["true"], files={"a": data}, gpu_milli=100, time_limit=300, timeout=300)
            t_idle = time.perf_counter()
            time.sleep(args.idle)
            idle = (t_idle, time.perf_counter())
            for _ in range(args.rounds):
                t = time.perf_counter()
                out = c.run(["true"], files={"a": data}, gpu_milli=100, time_limit=300, timeout=300)
                windows["upload"].append((t, time.perf_counter()))
                if out.exit_code != 0:
                    raise RuntimeError(f"the job failed: {out.stderr!r}")
        bare = Bare(1)
        try:
            bare.wait_ready()
            view = memoryview(data)
            for _ in range(args.rounds):
                t = time.perf_counter()
                bare.htod_chunked(view, CHUNK_BYTES, WINDOW)
                windows["bare"].append((t, time.perf_counter()))
        finally:
            bare.stop()
        child.stdin.close()
        samples = json.loads(child.stdout.read() or b"{}")
        child.wait(timeout=30)
    summary: dict[str, object] = {"mib": args.mib, "rounds": args.rounds, "cpus": os.cpu_count(),
                                  "upload_s": [round(b - a, 2) for a, b in windows["upload"]],
                                  "bare_s": [round(b - a, 2) for a, b in windows["bare"]]}
    for probe in ("ping", "echo"):
        got = samples.get(probe, [])
        at = {"idle": [lat for t, lat in got if idle[0] <= t < idle[1]]}
        for name, spans in windows.items():
            at[name] = [lat for t, lat in got if any(a <= t < b for a, b in spans)]
        for name, lats in at.items():
            summary[f"{probe}_{name}_p99_ms"] = round(p99(lats) * 1e3, 2)
            summary[f"{probe}_{name}_p50_ms"] = round(statistics.median(lats) * 1e3, 2) if lats else None
            summary[f"{probe}_{name}_n"] = len(lats)
        print(f"{probe}: p99 (p50) ms idle {summary[f'{probe}_idle_p99_ms']} ({summary[f'{probe}_idle_p50_ms']}), "
              f"during the upload {summary[f'{probe}_upload_p99_ms']} ({summary[f'{probe}_upload_p50_ms']}), "
              f"during the bare transfer {summary[f'{probe}_bare_p99_ms']} ({summary[f'{probe}_bare_p50_ms']})")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
