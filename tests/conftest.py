"""Fixtures every kind of test may use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
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
