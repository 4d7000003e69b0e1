"""Job start overhead of the sandbox: ``JobRunner.run`` with and without namespaces, in one run.

As root, both ways interleaved (so a noisy machine hits both alike): a runner with a ``Sandbox``
(mount, PID, IPC, UTS, network namespaces, private tmpfs, minimal /dev, the job directory bound
back) and one without (pool user, rlimits, private directory only). The job is ``date +%s%N``:
its *start* is the time from calling ``run`` to the wall clock it prints (pool user, job directory,
a tmpfs of its own in both, fork, sandbox, exec of date); the *whole* job is ``run`` to its
outcome, which without namespaces includes the sweep of the pool user's leftovers in /tmp,
/var/tmp and /dev/shm (``sweep_uid``). Then the sweep alone, in CPU time (robust to load): 10
sweeps of a uid that has nothing there, against 10 walks that ``stat`` every entry of those
directories as the sweep did before it looked only where a pool user can have left something
(the baseline, in the same run; nothing is removed). Prints p50/p90 of each, the start p50 ratio,
the time the sandbox adds per job start and the sweep's CPU per job; the last line is one JSON
object.

Usage::

    sudo .venv/bin/python bench/sandbox_start.py [--jobs 100]

About a minute on the 2-core VM with 100 jobs each way (its /tmp held 190,000 entries).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from gpud.protocol import JobSpec
from gpud_cli.uid_ranges import UidBlocks
from gpud_worker.jobs import JobRunner, UserPool
from gpud_worker.sandbox import SWEPT_DIRS, Sandbox, sweep_uid


def stat_every_entry(top: str) -> int:
    """The baseline: every entry below ``top`` stat-ed, as the sweep did (nothing removed)."""
    n = 0
    for _, dirnames, filenames, dfd in os.fwalk(top, follow_symlinks=False):
        for name in dirnames + filenames:
            try:
                os.stat(name, dir_fd=dfd, follow_symlinks=False)
                n += 1
            except OSError:
                continue
    return n


def cpu_ms(fn: Callable[[], object], runs: int = 10) -> float:
    """Median CPU time of ``fn()`` in ms over ``runs`` calls."""
    times = []
    for _ in range(runs):
        c0 = time.process_time()
        fn()
        times.append((time.process_time() - c0) * 1000)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=100, help="jobs each way (default 100)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("sandbox_start.py needs root (pool users, namespaces)", file=sys.stderr)
        return 2
    blocks = UidBlocks()
    uids = blocks.take()
    sandbox = Sandbox("none")
    if not sandbox.active:
        print(f"no namespaces here: {sandbox.reason}", file=sys.stderr)
        return 2
    spec = JobSpec(argv=("date", "+%s%N"), env={}, files=(), outputs=())
    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp:
        os.chmod(tmp, 0o711)
        runners = {
            "namespaces": JobRunner(pathlib.Path(tmp, "ns"), UserPool("gpud-dyn-", uids[:8]), sandbox=sandbox, dir_size=64 << 20),
            "rlimits only": JobRunner(pathlib.Path(tmp, "plain"), UserPool("gpud-dyn-", uids[8:]), dir_size=64 << 20),
        }
        start: dict[str, list[float]] = {name: [] for name in runners}
        whole: dict[str, list[float]] = {name: [] for name in runners}
        for i in range(args.jobs):
            for name, runner in runners.items():
                t0, wall0 = time.perf_counter(), time.time_ns()
                out = runner.run(os.urandom(16), spec, [], "0", "bench")
                whole[name].append((time.perf_counter() - t0) * 1000)
                if out.exit_code != 0:
                    print(f"{name}: job {i} exited {out.exit_code}: {out.stderr!r}", file=sys.stderr)
                    return 1
                start[name].append((int(out.stdout) - wall0) / 1e6)
    idle = uids[-1]  # held by this run, so no job of anyone's runs under it
    entries = sum(stat_every_entry(top) for top in SWEPT_DIRS if os.path.isdir(top))
    sweep = cpu_ms(lambda: sweep_uid(idle))
    every = cpu_ms(lambda: [stat_every_entry(top) for top in SWEPT_DIRS if os.path.isdir(top)])
    blocks.close()

    def pct(values: list[float]) -> tuple[float, float]:
        return statistics.median(values), statistics.quantiles(values, n=10)[-1]

    figures = {}
    for name in runners:
        (s50, s90), (w50, w90) = pct(start[name]), pct(whole[name])
        figures[name] = {"start_p50_ms": round(s50, 2), "start_p90_ms": round(s90, 2),
                         "whole_p50_ms": round(w50, 2), "whole_p90_ms": round(w90, 2)}
        print(f"{name:13s} start p50 {s50:7.2f} ms  p90 {s90:7.2f} ms   whole job p50 {w50:7.2f} ms  p90 {w90:7.2f} ms")
    ns, plain = figures["namespaces"]["start_p50_ms"], figures["rlimits only"]["start_p50_ms"]
    print(f"job start, namespaces / rlimits only: p50 ratio {ns / plain:.2f}, {ns - plain:+.2f} ms per job ({args.jobs} jobs each)")
    print(f"sweep of a pool uid (rlimits only, per job): {sweep:.1f} ms CPU; stat of every entry: {every:.1f} ms CPU "
          f"({entries} entries in {', '.join(SWEPT_DIRS)}): ratio {sweep / every:.3f}")
    print(json.dumps({"jobs": args.jobs, **figures, "start_ratio_p50": round(ns / plain, 3),
                      "start_added_ms_p50": round(ns - plain, 2), "swept_entries": entries,
                      "sweep_cpu_ms_p50": round(sweep, 1), "stat_every_entry_cpu_ms_p50": round(every, 1),
                      "sweep_ratio": round(sweep / every, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
