"""Starting a local cluster on this machine's real GPUs, for the GPU checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def repo_paths() -> str:
    """PYTHONPATH for daemons run from this checkout (gpud need not be installed)."""
    return os.pathsep.join(str(ROOT / p) for p in (".", "cli", "broker", "worker", "standby", "libclient"))


def start_cluster(tmp: Path, *worker_args: str) -> Any:
    """A broker and one worker serving this machine's GPUs (no --simulate); modules cached in
    ``tmp``, so that each run compiles afresh."""
    from gpud_cli.cluster import LocalCluster

    env = {"PYTHONPATH": repo_paths(), "GPUD_MODULE_CACHE": str(tmp / "modules")}
    c = LocalCluster(workers=1, simulate=False, heartbeat_ms=250, liveness=8, env=env,
                     worker_args=list(worker_args))
    try:
        c.start(timeout=60)
    except BaseException:
        c.stop()
        raise
    return c
