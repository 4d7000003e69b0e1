"""Fetching a staged job's inputs from the broker (PROTOCOL.md §11.3), chunk by chunk, straight
into the job's own input files.

A ``Fetch`` is the state of one job's inputs: its window (``gpud.transfer.ChunkWindow``: which
chunks are asked for, at most ``window`` at once, which have come) and the chunks that came and
wait to be written. It has no sockets and no clock of its own: the worker loop sends the FETCHes
it names, hands it each CHUNK and passes the time. The job's thread meanwhile sets the job up and
writes each input file from the chunks as they come (``StagedFile.copy_to``, called by the job
runner where it writes inline inputs), so the worker's loop never touches the disk and each byte
is written once. A chunk taken counts against the window until it is written: the loop asks for
more only as the job's thread keeps up (``busy``), which bounds the memory held.

The FETCHes and their CHUNKs travel on each broker link's data connection, a socket of a ZeroMQ
context of their own (``data_context``) whose one I/O thread runs IO_NICE nicer, so that moving
the bulk bytes yields the CPU to the control connection's heartbeats, DISPATCHes and RESULTs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from gpud.protocol import id_text
from gpud.transfer import CHUNK_BYTES, WINDOW, ChunkWindow, pwrite_all

log = logging.getLogger(__name__)

ABANDON_WAIT_S = 600.0  # a job thread waits at most this long for its next chunk
WRITE_NICE = 10  # how much nicer a job thread writes fetched inputs (as root)
IO_NICE = 10  # how much nicer the data connections' I/O thread runs than the process
IO_PREFIX = 7  # the data context's thread names begin "7/" (ZMQ_THREAD_NAME_PREFIX)
IO_THREAD = f"{IO_PREFIX}/ZMQbg/IO/0"  # what libzmq then names its one I/O thread (/proc/self/task/TID/comm)


class FetchAbandoned(Exception):
    """The fetch ended before every chunk came (the broker dropped the job, or the worker stops)."""


class Fetch(ChunkWindow):
    """One staged job's inputs, ``sizes`` bytes each. ``on_written`` is called (from the job's
    thread) after each chunk is written: room in the window for the loop to ask for more."""

    def __init__(self, job: bytes, sizes: list[int], on_written: Callable[[], None], chunk: int = CHUNK_BYTES,
                 window: int = WINDOW) -> None:
        super().__init__(sizes, chunk, window)
        self.job = job
        self.taken = 0  # chunks handed to the job's thread (the loop's count)
        self.written = 0  # chunks it wrote (the job thread's count)
        self._chunks: queue.SimpleQueue[tuple[int, int, memoryview] | None] = queue.SimpleQueue()
        self._early: dict[int, list[tuple[int, memoryview]]] = {}  # (job thread) chunks of later files that came first
        self._on_written = on_written

    @property
    def busy(self) -> int:
        """Chunks taken and not written yet."""
        return self.taken - self.written

    def next_asks(self, now: float) -> list[tuple[int, int, int]]:
        return self.asks(now, self.busy)

    def on_chunk(self, index: Any, offset: Any, data: Any) -> bool:
        """Take a CHUNK's bytes; False (dropped) for a chunk not asked for or of the wrong size."""
        view = memoryview(data.buffer if hasattr(data, "buffer") else data)
        if not self.expects(index, offset, len(view)):
            if (index, offset) in self.asked:
                log.warning("job %s: chunk %s@%s has %d bytes, not those asked for; asked again",
                            id_text(self.job), index, offset, len(view))
            return False
        self.took(index, offset)
        self.taken += 1
        self._chunks.put((index, offset, view))
        return True

    def inputs(self) -> list[StagedFile]:
        """The inputs, in order, for the job runner (each written as its chunks come)."""
        return [StagedFile(self, i, size) for i, size in enumerate(self.sizes)]

    def abandon(self) -> None:
        """End the fetch: a job thread waiting for a chunk raises FetchAbandoned."""
        self._chunks.put(None)

    def write_file(self, out: int, index: int) -> None:
        """(Job thread) Write file ``index`` to ``out`` from its chunks as they come (files in
        order); raises FetchAbandoned when the fetch ends first. As root the thread runs
        ``WRITE_NICE`` nicer meanwhile (bulk work: the worker's loop wins the CPU over it), and
        as it was again after (only root may lower a nice value: the job it starts inherits it)."""
        with _nicer(WRITE_NICE if os.geteuid() == 0 else 0):
            self._write_file(out, index)

    def _write_file(self, out: int, index: int) -> None:
        need = self.sizes[index]
        early = self._early
        pending = early.pop(index, [])
        while need > 0:
            if pending:
                offset, view = pending.pop()
            else:
                try:
                    item = self._chunks.get(timeout=ABANDON_WAIT_S)
                except queue.Empty:
                    raise FetchAbandoned(f"no chunk came for {ABANDON_WAIT_S:.0f}s") from None
                if item is None:
                    self._chunks.put(None)  # for the next file's wait too
                    raise FetchAbandoned("the fetch ended")
                i, offset, view = item
                if i != index:
                    early.setdefault(i, []).append((offset, view))
                    continue
            pwrite_all(out, view, offset)
            need -= len(view)
            self.written += 1
            self._on_written()


@contextlib.contextmanager
def _nicer(by: int) -> Iterator[None]:
    """The calling thread ``by`` nicer for the block (Linux: nice values are per thread)."""
    if by <= 0:
        yield
        return
    tid = threading.get_native_id()
    was = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, was + by))
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, tid, was)


class StagedFile:
    """Input ``index`` of a fetch, written into the job's file by ``copy_to`` as its chunks come."""

    __slots__ = ("fetch", "index", "size")

    def __init__(self, fetch: Fetch, index: int, size: int) -> None:
        self.fetch = fetch
        self.index = index
        self.size = size

    def copy_to(self, out: int) -> None:
        """Write the whole file to ``out`` (a new, empty file); raises FetchAbandoned when the
        fetch ends first."""
        self.fetch.write_file(out, self.index)


def data_context() -> zmq.Context[Any]:
    """A ZeroMQ context for the broker links' data connections (PROTOCOL.md §11.3): one I/O
    thread, IO_NICE nicer than the caller (raising one's nice needs no privilege). libzmq starts
    the thread with the context's first socket and names it a moment later; its name's prefix
    (IO_PREFIX) tells it from other contexts' I/O threads, and so does its being new."""
    before = set(os.listdir("/proc/self/task"))
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.THREAD_NAME_PREFIX, IO_PREFIX)
    ctx.socket(zmq.DEALER).close(0)
    deadline = time.monotonic() + 2.0
    while not (new := _io_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.001)
    for tid in new:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, os.getpriority(os.PRIO_PROCESS, int(tid)) + IO_NICE))
        except OSError as exc:
            log.warning("cannot make the data connections' I/O thread nicer: %s", exc)
    if not new:
        log.warning("the data connections' I/O thread was not found: it runs as nice as the loop")
    return ctx


def _io_threads() -> set[str]:
    """The ids of this process's threads named as a data context's I/O thread."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == IO_THREAD:
                    found.add(tid)
        except OSError:
            continue  # it ended meanwhile
    return found
