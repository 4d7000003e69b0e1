"""Chunked copies: how a large ``htod`` or ``dtoh`` is cut into CALLs, and the window they run in.

A copy larger than the client's ``chunk_bytes`` travels as several CALLs on consecutive offsets of
the same allocation (PROTOCOL.md §5.4), at most ``chunk_window`` of them outstanding at once: flow
control, so that neither the broker nor the worker ever holds more than window x chunk bytes of
one copy, and the hops work on different chunks at the same time.

This module is pure (no sockets, no clock): :func:`plan` cuts a copy, :func:`run_windowed` drives
any submit/collect pair through a window. :class:`~gpud_client.session.Session` plugs its CALLs in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_CHUNK_WINDOW", "plan", "run_windowed"]

DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes of the largest copy sent as one CALL; larger copies are chunked."""
DEFAULT_CHUNK_WINDOW = 4
"""Chunk CALLs of one copy outstanding at once."""

S = TypeVar("S")
P = TypeVar("P")


def plan(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a copy of ``nbytes``: ``(start, length)`` pairs, consecutive from 0, each at
    most ``chunk_bytes``, only the last one shorter; one empty chunk for an empty copy."""
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if type(chunk_bytes) is not int or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(chunk_bytes, nbytes - start)) for start in range(0, nbytes, chunk_bytes)]


def run_windowed(
    items: Iterable[S],
    window: int,
    submit: Callable[[S], P],
    collect: Callable[[P], None],
    abandon: Callable[[P], None],
) -> None:
    """Submit every item, with at most ``window`` submitted and not yet collected at any time, and
    collect them in order. An item is submitted only once the oldest outstanding one has been
    collected, when ``window`` are outstanding.

    The first ``collect`` (or ``submit``) that raises ends the run: every item still outstanding is
    passed to ``abandon``, nothing more is submitted, and the exception propagates. ``collect``
    deals with its own item whatever it raises."""
    if type(window) is not int or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    pending: deque[P] = deque()
    try:
        for item in items:
            if len(pending) >= window:
                collect(pending.popleft())
            pending.append(submit(item))
        while pending:
            collect(pending.popleft())
    except BaseException:
        while pending:
            abandon(pending.popleft())
        raise
