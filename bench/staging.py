"""Staged job inputs benchmark (PROTOCOL.md §11): the upload rate of a large job input through
gpud against a bare pyzmq chunked send over the same hops, and another client's echo latency
during the upload as a ratio to idle, in one run.

- gpud: a LocalCluster (one broker, or a Binary Star pair with ``--pair``; one worker with two
  simulated GPUs, labelled simulated). A client runs ``true`` with one input file of ``--mib``
  MiB (staged: PUT chunks to the broker's spool, FETCHed by the worker, copied into the job's
  directory); its rate is the size over the job's time less that of the same job without input
  (the job's own start-up). The upload and the worker's fetch are pipelined (the job is placed
  once its upload opens): ``stage_gbps`` is the size over the time until ``submit`` returns (every
  chunk is in the broker's spool, durable), while the worker fetches behind it. A second client
  meanwhile sends 64-byte echoes one after another;
  their p99 during the upload is compared with their p99 while nothing else runs.
- bare: the forwarder and worker of ``bench/transfer.py`` (ROUTER frontend and backend, one
  DEALER worker that answers each chunk; ``copy=False`` everywhere), the same bytes sent in
  chunks of gpud's staging chunk size (``gpud.transfer.CHUNK_BYTES``), its window outstanding.

Each round also gives the CPU seconds per GiB the broker and the worker spent during the upload
(from /proc: robust to the machine's load, unlike the rates).

Targets: gpud at least 0.7x bare, echo p99 during the upload at most 3x idle.

Usage::

    .venv/bin/python bench/staging.py [--mib 1024] [--rounds 2] [--pair]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transfer import Bare  # noqa: E402  (the bare chain, shared with the session-copy benchmark)

from gpud.transfer import CHUNK_BYTES, WINDOW  # noqa: E402
from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402

MIB = 1 << 20


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


class Echoes:
    """A client that sends small echoes one after another, its latencies kept by phase."""

    def __init__(self, endpoints: list[str]) -> None:
        self.client = Client(endpoints, timeout=30)
        self.phase = "idle"
        self.lat: dict[str, list[float]] = {"idle": [], "upload": [], "off": []}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echoes")

    def _run(self) -> None:
        payload = b"e" * 64
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.client.echo(payload)
            except Exception:
                self.errors += 1
                continue
            self.lat[self.phase].append(time.perf_counter() - t)
            time.sleep(0.002)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpud_round(c: Client, echoes: Echoes, data: bytes, idle_s: float,
               pids: list[int]) -> tuple[float, float, float, float, list[float]]:
    """(net seconds to the job's end, seconds staging to the broker's spool, echo p99 idle, echo
    p99 during the upload, CPU seconds of each of ``pids`` during the upload)."""
    echoes.phase = "idle"
    echoes.lat["idle"].clear()
    echoes.lat["upload"].clear()
    time.sleep(idle_s)
    echoes.phase = "off"
    empty = []
    for _ in range(3):
        t = time.perf_counter()
        c.run(["true"], gpu_milli=100)
        empty.append(time.perf_counter() - t)
    echoes.phase = "upload"
    cpu0 = [cpu_s(pid) for pid in pids]
    t = time.perf_counter()
    job = c.submit(["true"], files={"a": data}, gpu_milli=100, time_limit=300, timeout=300)
    staged = time.perf_counter() - t  # submit returns once the input is in the broker's spool
    out = job.wait()
    took = time.perf_counter() - t
    cpu = [cpu_s(pid) - c0 for pid, c0 in zip(pids, cpu0, strict=True)]
    echoes.phase = "off"
    if out.exit_code != 0:
        raise RuntimeError(f"the job failed: {out.stderr!r}")
    return took - statistics.median(empty), staged, p99(echoes.lat["idle"]), p99(echoes.lat["upload"]), cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the job's input in MiB (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="gpud and bare rounds, alternating (default %(default)s)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of idle echoes per round (default %(default)s)")
    p.add_argument("--pair", action="store_true", help="a Binary Star pair instead of one broker")
    args = p.parse_args(argv)
    nbytes = args.mib * MIB
    data = os.urandom(MIB) * args.mib
    t_start = time.perf_counter()
    rounds: list[dict[str, float]] = []
    with LocalCluster(workers=1, gpus_per_worker=2, pair=args.pair, log_level="WARNING") as cluster:
        if args.pair:
            cluster.wait_active()
        bare = Bare(1)
        try:
            bare.wait_ready()
            echoes = Echoes(cluster.frontends)
            echoes.start()
            try:
                with Client(cluster.frontends, timeout=60) as c:
                    view = memoryview(data)
                    broker = cluster.brokers["primary" if args.pair else "broker"]
                    pids = [broker.pid, next(iter(cluster.worker_procs.values())).pid]
                    for i in range(args.rounds):
                        net, staged, idle, busy, cpu = gpud_round(c, echoes, data, args.idle, pids)
                        t = time.perf_counter()
                        bare.htod_chunked(view, CHUNK_BYTES, WINDOW)
                        bare_s = time.perf_counter() - t
                        r = {"gpud_gbps": nbytes / net / 1e9, "stage_gbps": nbytes / staged / 1e9,
                             "bare_gbps": nbytes / bare_s / 1e9,
                             "echo_p99_idle_ms": idle * 1e3, "echo_p99_upload_ms": busy * 1e3}
                        r["ratio"] = r["gpud_gbps"] / r["bare_gbps"]
                        r["broker_cpu_s_per_gib"] = cpu[0] / (nbytes / (1 << 30))
                        r["worker_cpu_s_per_gib"] = cpu[1] / (nbytes / (1 << 30))
                        r["p99_ratio"] = busy / idle
                        rounds.append(r)
                        print(f"round {i + 1}: gpud {r['gpud_gbps']:.2f} GB/s (client to spool "
                              f"{r['stage_gbps']:.2f}), bare {r['bare_gbps']:.2f} GB/s "
                              f"(ratio {r['ratio']:.2f}); echo p99 {r['echo_p99_idle_ms']:.2f} ms idle, "
                              f"{r['echo_p99_upload_ms']:.2f} ms during the upload ({r['p99_ratio']:.2f}x); CPU s "
                              f"per GiB: broker {r['broker_cpu_s_per_gib']:.2f}, worker {r['worker_cpu_s_per_gib']:.2f}",
                              flush=True)
            finally:
                echoes.stop()
        finally:
            bare.stop()
    rounds.sort(key=lambda r: r["ratio"])
    mid = rounds[len(rounds) // 2]
    print(f"staged job input of {args.mib} MiB through {'a broker pair' if args.pair else 'one broker'} "
          f"to a simulated GPU's worker, against bare pyzmq chunks over the same hops "
          f"(chunk {CHUNK_BYTES >> 20} MiB, window {WINDOW}; {os.cpu_count()} CPUs)")
    summary: dict[str, Any] = {k: round(v, 3) for k, v in mid.items()}
    summary.update({"mib": args.mib, "pair": args.pair, "rounds": args.rounds, "echo_errors": echoes.errors,
                    "ratios": [round(r["ratio"], 3) for r in rounds],
                    "p99_ratios": [round(r["p99_ratio"], 3) for r in rounds],
                    "cpus": os.cpu_count(), "seconds": round(time.perf_counter() - t_start, 1)})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
