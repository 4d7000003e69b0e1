"""The receiving side's window of a chunked transfer (PROTOCOL.md §11): which chunks of a set of
files of known sizes to ask for next, at most ``window`` unanswered at once, in file and offset
order; which are outstanding (to ask again after a failover or a silence); and which answers to
take. Pure: no sockets, no files, the caller passes the time. (And ``pwrite_all``, the write
of a chunk into a file that both the broker's spool and the worker's fetch make, in bounded
system calls.)

The worker fetching a staged job's inputs and the broker pulling a job's staged outputs both
drive one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

CHUNK_BYTES = 1 << 20  # bytes of one chunk of a staged file (a PUT's, a FETCH's)
WINDOW = 4  # chunks of one transfer unanswered at once
SYSCALL_BYTES = 128 << 10  # the most one system call of ``pwrite_all`` moves (see there)

Ask = tuple[int, int, int]  # (file, offset, nbytes)


class ChunkWindow:
    """The chunks of files of ``sizes`` bytes still to ask for, and those asked for."""

    def __init__(self, sizes: Sequence[int], chunk: int = CHUNK_BYTES, window: int = WINDOW) -> None:
        self.sizes = list(sizes)
        self.chunk = chunk
        self.window = window
        self.asked: dict[tuple[int, int], tuple[int, float]] = {}  # (file, offset) -> (nbytes, when)
        self.got = 0  # bytes taken
        self._cursor = (0, 0)  # the next chunk not asked for yet

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def done(self) -> bool:
        return self.got == self.total

    def asks(self, now: float, busy: int = 0) -> list[Ask]:
        """New chunks to ask for, so that ``window`` are outstanding (``busy`` of them taken but
        not done with yet: the broker's chunks not yet durable at its peer)."""
        out: list[Ask] = []
        index, offset = self._cursor
        while len(self.asked) + busy < self.window and index < len(self.sizes):
            size = self.sizes[index]
            if offset >= size:
                index, offset = index + 1, 0
                continue
            n = min(self.chunk, size - offset)
            self.asked[index, offset] = (n, now)
            out.append((index, offset, n))
            offset += n
        self._cursor = (index, offset)
        return out

    def again(self, now: float, older_than: float | None = None) -> list[Ask]:
        """Outstanding chunks to ask for again: all (``older_than`` None: the other side changed),
        or those asked before ``older_than``."""
        out: list[Ask] = []
        for (index, offset), (n, when) in self.asked.items():
            if older_than is None or when < older_than:
                self.asked[index, offset] = (n, now)
                out.append((index, offset, n))
        return out

    def expects(self, index: object, offset: object, nbytes: int) -> bool:
        """Whether an answer of ``nbytes`` at (``index``, ``offset``) is one asked for."""
        if type(index) is not int or type(offset) is not int:
            return False
        asked = self.asked.get((index, offset))
        return asked is not None and asked[0] == nbytes

    def took(self, index: int, offset: int) -> None:
        """The answer at (``index``, ``offset``) is written: no longer outstanding."""
        n, _ = self.asked.pop((index, offset))
        self.got += n


def pwrite_all(fd: int, data: memoryview, offset: int, piece: int = SYSCALL_BYTES) -> None:
    """Write all of ``data`` to ``fd`` at ``offset``, at most ``piece`` bytes per system call
    (``os.pwrite`` may also write less than asked).

    Why in pieces: a kernel without full preemption (PREEMPT_NONE, the server default, and what
    our VMs run) keeps a thread that is inside a system call on its CPU until the call returns,
    whatever the nice values of the threads waiting for that CPU. A 1 MiB write into the page
    cache is such a stretch, of 0.3 ms to several ms (fresh pages cost most); the threads that make
    these writes (the spool's disk thread, a job thread writing its fetched inputs) are the bulk
    ones, and the loops wait behind them to answer a heartbeat or another tenant's echo. 128 KiB
    pieces cost seven system calls more per MiB and bound each stretch to an eighth of that
    (BENCHMARKS.md, "Bulk writes in 128 KiB system calls")."""
    done = 0
    end = len(data)
    while done < end:
        done += os.pwrite(fd, data[done:done + piece], offset + done)


def read_capped(fd: int, cap: int) -> bytes | None:
    """What ``fd`` holds from its offset to its end, or None when that is more than ``cap``
    bytes (read in 1 MiB pieces, never more than ``cap`` + 1 in all)."""
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, min(1 << 20, cap + 1 - size))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        size += len(chunk)
        if size > cap:
            return None
