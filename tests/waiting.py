"""Waiting in tests: for something a daemon does by itself (``wait_for``), and jobs waiting for
the test (``Gate``)."""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(pred: Callable[[], Any], what: str = "condition", timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Call ``pred`` every ``interval`` seconds until it returns something true and return that;
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class Gate:
    """A file that jobs wait for and the test creates: a job that must run until the test has seen
    what it came for ends then, not after a fixed sleep. ``shell(at_most)`` is the job's wait, in
    sh: until the gate is open, or ``at_most`` seconds at least when it never is (as ``sleep``
    would). Under /run as root, which a job's sandbox shows (its /tmp is its own)."""

    STEP = 0.05

    def __init__(self) -> None:
        base = "/run" if os.geteuid() == 0 and os.access("/run", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="gpud-gate-", dir=base))
        self.dir.chmod(0o755)  # pool users look for the file
        self.path = self.dir / "open"

    def shell(self, at_most: float) -> str:
        steps = math.ceil(at_most / self.STEP)
        return (f"i=0; while [ ! -e {self.path} ] && [ $i -lt {steps} ]; do sleep {self.STEP:g}; i=$((i+1)); done")

    def open(self) -> None:
        self.path.touch()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.dir.rmdir()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
