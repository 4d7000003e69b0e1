"""Before/after on the dispatch benchmark: a commit against the working tree (or against another
commit), in alternating runs.

This VM's speed swings by up to 2x from one minute to the next, so a change on the broker's hot
path is judged by pairs: ``bench/dispatch.py`` of the commit ``REV`` (from a temporary ``git
worktree``), then of the working tree, ``--pairs`` times. With ``--after REV2`` the after side is
that commit (a second temporary worktree) instead of the working tree: what one past change cost.
Each line is one run; the summary is the mean of each side. The last line is one JSON object.

Usage::

    .venv/bin/python bench/before_after.py REV [--after REV2] [--pairs 5] [-- dispatch.py options]

e.g. ``bench/before_after.py HEAD~1 -- --requests 15000 --rounds 3``, or a merge against its first
parent: ``bench/before_after.py b9108b6^ --after b9108b6 -- --requests 15000 --rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
KEYS = ("ratio", "gpud_per_s", "baseline_per_s", "gpud_p50_us", "p50_ratio",
        "gpud_client_cpu_us_per_req", "gpud_broker_cpu_us_per_req", "gpud_workers_cpu_us_per_req")


def run(tree: Path, dispatch_args: list[str]) -> dict[str, Any]:
    """bench/dispatch.py of ``tree``, with this interpreter and ``tree``'s packages first on the path."""
    path = os.pathsep.join(str(tree / d) for d in (".", "cli", "broker", "worker", "standby", "libclient"))
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, str(tree / "bench" / "dispatch.py"), *dispatch_args], cwd=tree,
                         env=env, capture_output=True, text=True, check=True, timeout=900)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def measure_in(tree: Path, script: Path, argv: list[str]) -> dict[str, Any]:
    """``script`` (a benchmark of this tree, its ``--role measure``) run with ``argv`` in a child
    interpreter whose imports (and daemons) come from ``tree``: its last line, as JSON."""
    path = os.pathsep.join(str(tree / d) for d in (".", "cli", "broker", "worker", "standby", "libclient"))
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, str(script), "--role", "measure", *argv], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the measurement in {tree} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def alternate(rev: str, pairs: int, measure: Callable[[Path], dict[str, Any]], keys: tuple[str, ...],
              after: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """``measure`` of the commit ``rev`` (a temporary ``git worktree``), then of the working tree
    (or of the commit ``after``, a second one), ``pairs`` times; each run printed as one line.
    Returns the runs by side."""
    sides: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="gpud-before-") as tmp:
        trees = {"before": Path(tmp) / "before", "after": HERE if after is None else Path(tmp) / "after"}
        added: list[Path] = []
        try:
            for side, commit in (("before", rev), ("after", after)):
                if commit is not None:
                    subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), commit], cwd=HERE,
                                   check=True, capture_output=True)
                    added.append(trees[side])
            for _ in range(pairs):
                for side, tree in trees.items():
                    r = measure(tree)
                    sides[side].append(r)
                    print(f"{side:6s} " + "  ".join(f"{k} {r.get(k)}" for k in keys), flush=True)
        finally:
            for tree in added:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, check=False,
                               capture_output=True)
    return sides


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    own, rest = (args_in[:args_in.index("--")], args_in[args_in.index("--") + 1:]) if "--" in args_in else (args_in, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the commit to compare the working tree against")
    p.add_argument("--after", metavar="REV2", help="compare against this commit instead of the working tree")
    p.add_argument("--pairs", type=int, default=5, help="alternating before/after runs (default %(default)s)")
    args = p.parse_args(own)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    sides = alternate(args.rev, args.pairs, lambda tree: run(tree, rest), KEYS, args.after)
    means = {side: {k: round(statistics.fmean(r[k] for r in runs), 3) for k in KEYS if all(r.get(k) is not None for r in runs)}
             for side, runs in sides.items()}
    for side in ("before", "after"):
        print(f"mean {side:6s} " + "  ".join(f"{k} {v}" for k, v in means[side].items()))
    print(json.dumps({"rev": args.rev, "after_rev": args.after or "working tree", "pairs": args.pairs, "dispatch_args": rest, **means}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
