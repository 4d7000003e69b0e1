"""Job starts, before and after a change: jobs per second and the latency of one job, as ratios.

A job's start costs a process start (fork, exec, the program's own start), and since START/GO
(PROTOCOL.md §4.4) also a round trip to the active broker, which with a pair waits for the passive
peer to hold the mark. This measures what that adds: a fresh local cluster (one simulated
worker; ``--pair`` for a broker pair) runs ``--latency-jobs`` jobs one after another (``true``,
submit to result: p50 and p90) and then ``--jobs`` at once (jobs per second). With ``--against
REV`` the same measurement runs, in alternating rounds, on the commit ``REV`` (a temporary ``git
worktree``) and on the working tree, so that the machine's swings hit both sides alike; the
summary gives after/before ratios of the means. The last line is one JSON object.

Usage::

    .venv/bin/python bench/job_start.py --against main [--pairs 3] [--pair]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
KEYS = ("jobs_per_s", "p50_ms", "p90_ms")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One round on the code this interpreter imports (a tree on PYTHONPATH, or this one)."""
    from gpud_cli.cluster import LocalCluster
    from gpud_client import Client

    with LocalCluster(workers=1, heartbeat_ms=500, pair=args.pair, log_level="WARNING") as c:
        with Client(c.frontends if args.pair else c.frontend, timeout=120) as client:
            for _ in range(5):  # warm up: the pool user, the first fork
                client.submit(["true"], gpu_milli=10).wait()
            lat = []
            for _ in range(args.latency_jobs):
                t0 = time.perf_counter()
                r = client.submit(["true"], gpu_milli=10).wait()
                lat.append(time.perf_counter() - t0)
                assert r.exit_code == 0
            lat.sort()
            t0 = time.perf_counter()
            pend = [client.submit(["true"], gpu_milli=10, time_limit=60) for _ in range(args.jobs)]
            assert all(p.wait().exit_code == 0 for p in pend)
            took = time.perf_counter() - t0
    return {"jobs_per_s": round(args.jobs / took, 1), "p50_ms": round(1000 * lat[len(lat) // 2], 2),
            "p90_ms": round(1000 * lat[int(len(lat) * 0.9)], 2)}


def run_in(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` in a child interpreter whose imports (and daemons) come from ``tree``."""
    sys.path.insert(0, str(HERE / "bench"))
    from before_after import measure_in

    return measure_in(tree, HERE / "bench" / "job_start.py", ["--jobs", str(args.jobs), "--latency-jobs",
                      str(args.latency_jobs), *(["--pair"] if args.pair else [])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", metavar="REV", help="the commit to compare the working tree against")
    p.add_argument("--pairs", type=int, default=3, help="alternating before/after rounds (default %(default)s)")
    p.add_argument("--pair", action="store_true", help="a broker pair (GO waits for the passive peer)")
    p.add_argument("--jobs", type=int, default=200, help="jobs in flight at once (default %(default)s)")
    p.add_argument("--latency-jobs", type=int, default=50, help="jobs one after another (default %(default)s)")
    p.add_argument("--role", choices=["bench", "measure"], default="bench", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "measure" or args.against is None:
        print(json.dumps(measure(args)))
        return 0
    sys.path.insert(0, str(HERE / "bench"))
    from before_after import alternate

    sides = alternate(args.against, args.pairs, lambda tree: run_in(tree, args), KEYS)
    means = {side: {k: round(statistics.fmean(r[k] for r in runs), 2) for k in KEYS} for side, runs in sides.items()}
    ratios = {f"{k}_ratio": round(means["after"][k] / means["before"][k], 3) for k in KEYS}
    for side in ("before", "after"):
        print(f"mean {side:6s} " + "  ".join(f"{k} {v}" for k, v in means[side].items()))
    print("after/before " + "  ".join(f"{k} {v}" for k, v in ratios.items()))
    print(json.dumps({"against": args.against, "pairs": args.pairs, "pair": args.pair, "jobs": args.jobs,
                      "latency_jobs": args.latency_jobs, **means, **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
