"""Waiting in tests for something a daemon does by itself."""

from __future__ import annotations

import time
from collections.abc import Callable
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
