"""Logging setup. Called only from a daemon's or tool's main(); library modules never configure logging."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str | int | None = None, name: str = "gpud") -> None:
    """Log to stderr as ``time level logger: message``; level from argument or ``GPUD_LOG_LEVEL``."""
    chosen = level if level is not None else os.environ.get("GPUD_LOG_LEVEL", "INFO")
    if isinstance(chosen, str):
        chosen = chosen.upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)
