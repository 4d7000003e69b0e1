"""Staged job outputs, before and after a change: their rate, the worker's CPU per GiB and its
peak memory, as ratios.

A job whose output files are over 8 MiB together has them staged (PROTOCOL.md §11.5): the
broker fetches them from the worker in chunks into its spool, and the client reads them from
there. This measures that path on a fresh local cluster (one broker, one worker with simulated
GPUs, labelled simulated): ``--jobs`` jobs at once, each writing ``--mib`` MiB into one output
file (``head -c N /dev/zero``), from their submit until the client holds every byte. ``rate``
is those bytes over that time less the time of the same jobs writing the file and returning
nothing; ``worker_cpu_s_per_gib`` is the worker's CPU over the outputs' bytes, less that of the
jobs returning nothing; ``worker_rss_growth_mib`` is how far its peak resident memory (VmHWM) rose
over the measured jobs; ``echo_p99_ratio`` is another client's 64-byte echoes' p99 (through the
same worker, from a process of its own) while the outputs travel, against its p99 idle just
before. With ``--against REV`` the same runs, in alternating rounds, on the commit
``REV`` (a temporary ``git worktree``; this script, that tree's code) and on the working tree; the
summary gives after/before ratios of the means. The last line is one JSON object.

Usage::

    .venv/bin/python bench/outputs.py [--mib 300] [--jobs 2] [--against REV] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "bench"))

from staging import Echoes  # noqa: E402  (the staged-upload benchmark's echo client)

KEYS = ("rate_gb_s", "worker_cpu_s_per_gib", "worker_rss_growth_mib", "echo_p99_idle_ms", "echo_p99_ms",
        "echo_p99_ratio")
MiB = 1 << 20


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One round on the code this interpreter imports (a tree on PYTHONPATH, or this one)."""
    from gpud_cli.cluster import LocalCluster
    from gpud_client import Client

    nbytes = args.mib * MiB

    def batch(client: Any, keep: bool, size: int = nbytes, jobs: int = args.jobs) -> float:
        script = f"head -c {size} /dev/zero > out" + ("" if keep else "; rm out")
        t0 = time.perf_counter()
        pending = [client.submit(["sh", "-c", script], outputs=["out"], gpu_milli=10, time_limit=120)
                   for _ in range(jobs)]
        for job in pending:
            res = job.wait(timeout=300)
            assert res.exit_code == 0 and len(res.files.get("out", b"")) == (size if keep else 0), res.stderr
        return time.perf_counter() - t0

    with LocalCluster(workers=1, gpus_per_worker=2, log_level="WARNING") as c:
        worker = c.worker_procs["w0"].pid
        with Client(c.frontend, timeout=300) as client:
            batch(client, True, 16 * MiB, 1)  # warm up: pool users, the first staged outputs
            cpu0 = _cpu(worker)
            empty = batch(client, False)
            cpu_empty = _cpu(worker) - cpu0
            echoes = Echoes([c.frontend])  # another client's echoes, through the same worker
            try:
                time.sleep(1.0)
                idle0 = time.perf_counter()
                time.sleep(args.idle)
                rss0 = _peak_rss(worker)
                cpu0 = _cpu(worker)
                t0 = time.perf_counter()
                full = batch(client, True)
                t1 = time.perf_counter()
                cpu_full = _cpu(worker) - cpu0
                rss1 = _peak_rss(worker)
            finally:
                echoes.stop()
    gib = args.jobs * nbytes / (1 << 30)
    idle, busy = echoes.p99(idle0, t0) * 1000, echoes.p99(t0, t1) * 1000
    return {"rate_gb_s": round(args.jobs * nbytes / max(1e-6, full - empty) / 1e9, 3),
            "worker_cpu_s_per_gib": round((cpu_full - cpu_empty) / gib, 3),
            "worker_rss_growth_mib": round((rss1 - rss0) / MiB, 1),
            "echo_p99_idle_ms": round(idle, 2), "echo_p99_ms": round(busy, 2), "echo_p99_ratio": round(busy / idle, 2)}


def run_in(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` in a child interpreter whose imports (and daemons) come from ``tree``."""
    from before_after import measure_in

    return measure_in(tree, HERE / "bench" / "outputs.py",
                      ["--mib", str(args.mib), "--jobs", str(args.jobs), "--idle", str(args.idle)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=300, help="MiB of outputs per job (default %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="jobs at once (default %(default)s)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle echoes first (default %(default)s)")
    p.add_argument("--against", metavar="REV", help="the commit to compare the working tree against")
    p.add_argument("--pairs", type=int, default=3, help="alternating before/after rounds (default %(default)s)")
    p.add_argument("--role", choices=["bench", "measure"], default="bench", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "measure" or args.against is None:
        print(json.dumps(measure(args)))
        return 0
    from before_after import alternate

    sides = alternate(args.against, args.pairs, lambda tree: run_in(tree, args), KEYS)
    means = {side: {k: round(statistics.fmean(r[k] for r in runs), 3) for k in KEYS} for side, runs in sides.items()}
    ratios = {f"{k}_ratio": round(means["after"][k] / means["before"][k], 3) if means["before"][k] else None
              for k in KEYS}
    for side in ("before", "after"):
        print(f"mean {side:6s} " + "  ".join(f"{k} {v}" for k, v in means[side].items()))
    print("after/before " + "  ".join(f"{k} {v}" for k, v in ratios.items()))
    print(json.dumps({"against": args.against, "pairs": args.pairs, "mib": args.mib, "jobs": args.jobs,
                      **means, **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
