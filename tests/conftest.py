"""Fixtures every kind of test may use."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """A command's main (gpudctl's, say) configures the root logger, as a main should; put
    pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A zmq context of the test's own."""
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()  # hangs (and the per-test timeout fails the test) if a socket was left open


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A directory on a file system of its own of 64 MiB (a tmpfs, mounted as root): a disk
    that a test can fill."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    path = tmp_path / "small-fs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "gpud-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)
