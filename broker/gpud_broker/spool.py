"""The broker's spool: the bytes of staged job inputs (PROTOCOL.md §11), held from their first PUT
until their job ends, in memory for small files and in files under the spool directory for the
rest, so that the broker's resident memory does not grow with what is staged.

The spool owns the bytes and their bookkeeping (which upload holds how much of each file); who may
stage how much is the accounts' (``Accounts.over_spool``), checked before ``open``. No sockets, no
clock of its own: the caller passes the time.

Disk I/O is off the broker's loop: writes to spooled files, reads of them, and their removal, go
in order to one thread of the spool's own (``_SpoolIO``), which counts each write done and
signals ``io.fd`` (an eventfd for the loop's poller) after each read, and after writes once it
has caught up with its queue or every ``SIGNAL_EVERY_WRITES`` of them: one wake-up of the loop
per batch. A chunk is held by the spool at once (its
bookkeeping), its bytes on disk once its write is done (``written``). The chunk's own buffer is
kept until then, and after it until the chunk is read once (a worker fetches each chunk once)
while the memory copies of chunks on disk stay under ``hold_bytes``: a worker that keeps up with
the upload is answered from memory, and ``read_soon`` goes to the disk (on the thread) only for
one that lags further behind.

The file of an upload that ends is kept for the next one (``keep_bytes`` of such files at most)
instead of removed: its pages stay in the page cache, and the next upload writes over them rather
than into memory freed and taken again, which a VM that hands free pages back to its host pays a
host fault for on every page (PROTOCOL.md §11.2, "Reuse"). A kept file's old bytes are never read:
reads are of ranges the current upload holds (``have``) only.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpud.errors import InvalidRequest
from gpud.protocol import id_text
from gpud.transfer import pwrite_all

log = logging.getLogger(__name__)

DEFAULT_RAM_BYTES = 64 << 20  # bytes of small files held in memory at most
DEFAULT_RAM_FILE_BYTES = 1 << 20  # files up to this size go to memory (while there is room)
DEFAULT_STAGE_TTL_S = 60.0  # seconds an unclaimed upload is kept after its last PUT
DEFAULT_STAGE_IDLE_S = 10.0  # seconds a placed staged job's worker may wait for bytes of its upload
DEFAULT_KEEP_BYTES = 1 << 30  # bytes of the files of ended uploads kept for the next ones, at most
DISK_HEADROOM_BYTES = 16 << 20  # free disk that uploads never count on: the file system's own needs


IO_NICE = 10  # the spool's disk thread runs this much nicer than the broker (Linux: per thread)
SIGNAL_EVERY_WRITES = 8  # the disk thread tells the loop of its writes at least this often while behind
HOLD_BYTES = 64 << 20  # bytes of chunks on disk kept in memory too, at most, for reads that need no disk
HOLD_MIN_BYTES = 64 << 10  # smaller chunks are not kept (read from the disk if asked for): few entries to keep
# A read from the spool's files waits for the disk thread: (the read's callback, the bytes or the error)
Delivery = Callable[[bytes | OSError], None]


class _SpoolIO:
    """Writes to spooled files, reads of them, then their closing and removal, in order, on a
    thread of its own: a write or a read can wait on the disk, and freeing a large file's blocks
    can take the file system a second, which the broker's loop must never wait for. Writes are
    numbered (tickets, from 1); ``done`` is the last one finished. Each read finished makes ``fd``
    (an eventfd) readable, and writes finished do once the thread has caught up with its queue or
    every ``SIGNAL_EVERY_WRITES`` of them; a read's bytes wait in ``reads`` for the loop. A read
    queued after a write of the same bytes reads what it wrote (one thread, in order)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._fd = -1  # the eventfd, made when first asked for (``fd``)
        self.issued = 0  # the last ticket handed out
        self.done = 0  # the last ticket whose write finished (set by the thread only)
        # Bytes queued (by the loop only) and written (by the thread only): each side writes its
        # own count and reads the other's, so neither takes a lock per write. A lock the loop
        # shares with a thread 10 nicer is a priority inversion: when the thread is preempted
        # holding it, the loop waits until a busy CPU runs the thread again.
        self._queued_bytes = 0
        self._written_bytes = 0
        self._waiters = 0  # threads in ``wait`` (tests, a passive broker's apply): notified only then
        self.failed: list[tuple[bytes, OSError]] = []  # (the upload's job id, error) of writes that failed
        self.reads: collections.deque[tuple[Delivery, bytes | OSError]] = collections.deque()  # finished reads
        self._progress = threading.Condition()

    @property
    def backlog(self) -> int:
        """Bytes queued, not written yet."""
        return self._queued_bytes - self._written_bytes

    @property
    def fd(self) -> int:
        if self._fd < 0:
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return self._fd

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spool-io", daemon=True)
            self._thread.start()

    def write(self, job: bytes, fd: int, offset: int, data: memoryview) -> int:
        """Queue a write of ``data`` (kept referenced until written) to a file of upload ``job``;
        its ticket. Never waits: what bounds the queue is the PUT REPLYs, which wait for it
        (``Staging``)."""
        self._start()
        self.issued += 1
        self._queued_bytes += len(data)
        self._queue.put(("w", fd, offset, data, job))
        return self.issued

    def read(self, fd: int, offset: int, nbytes: int, deliver: Delivery) -> None:
        """Queue a read; ``deliver`` gets its bytes (or the OSError) from ``take_reads``, in the loop."""
        self._start()
        self._queue.put(("r", fd, offset, nbytes, deliver))

    def wait(self, ticket: int) -> None:
        """Block until write ``ticket`` is done (a passive broker's apply, and tests)."""
        with self._progress:
            self._waiters += 1  # before the test of ``done``: a write done after it notifies
            try:
                self._progress.wait_for(lambda: self.done >= ticket, timeout=30.0)
            finally:
                self._waiters -= 1

    def reap(self, fd: int, path: str) -> None:
        """Close ``fd`` and remove ``path`` once the writes and reads queued before are done."""
        self._start()
        self._queue.put(("x", fd, path))

    def _run(self) -> None:
        try:  # bulk work: the loop's control messages (heartbeats, echoes) win the CPU over it
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + IO_NICE))
        except OSError as exc:
            log.debug("spool: cannot lower the disk thread's priority: %s", exc)
        ticket = self.done
        unsignalled = 0  # writes done that the loop has not been told of yet
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:  # caught up: tell the loop of what is done before waiting
                if unsignalled:
                    unsignalled = 0
                    self._signal()
                item = self._queue.get()
            if item is None:
                return
            kind, fd = item[0], item[1]
            if kind == "x":
                try:
                    os.unlink(item[2])
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("spool: cannot remove %s: %s", item[2], exc)
                os.close(fd)
                continue
            if kind == "r":
                _, _, offset, nbytes, deliver = item
                try:
                    got: bytes | OSError = _pread_all(fd, offset, nbytes)
                except OSError as exc:
                    got = exc
                self.reads.append((deliver, got))
                self._signal()
                continue
            _, _, offset, data, job = item
            ticket += 1
            try:
                pwrite_all(fd, data, offset)
            except OSError as exc:
                log.error("spool: cannot write a staged file: %s", exc)
                self.failed.append((job, exc))
            self._written_bytes += len(data)
            self.done = ticket  # after the count: what ``done`` covers is out of the backlog
            if self._waiters:  # read after ``done`` is set: a waiter that missed it is counted
                with self._progress:
                    self._progress.notify_all()
            unsignalled += 1
            if unsignalled >= SIGNAL_EVERY_WRITES:
                unsignalled = 0
                self._signal()

    def _signal(self) -> None:
        if self._fd >= 0:
            os.eventfd_write(self._fd, 1)

    def take_signal(self) -> None:
        """Clear ``fd`` (the loop read it readable)."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def take_reads(self) -> None:
        """(The loop) Hand each finished read to its callback."""
        reads = self.reads
        while reads:
            deliver, got = reads.popleft()
            deliver(got)

    def close(self) -> None:
        self.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def stop(self) -> None:
        """Wait until every write, read and removal handed over is done."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _pread_all(fd: int, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset`` of ``fd``; OSError (EIO) when the file ends first (it lost bytes)."""
    parts = []
    while nbytes > 0:
        got = os.pread(fd, nbytes, offset)
        if not got:
            raise OSError(errno.EIO, f"the spool file ends {nbytes} bytes short of what it held")
        parts.append(got)
        offset += len(got)
        nbytes -= len(got)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _RamStore:
    """One staged file held in memory."""

    on_disk = False

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)

    def write(self, offset: int, data: memoryview) -> int:
        self.buf[offset : offset + len(data)] = data
        return 0  # written now

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.buf[offset : offset + nbytes])

    def close(self) -> None:
        self.buf = bytearray()


class _FileStore:
    """One staged file held in a file of the spool directory: a new one, or ``kept`` (the open
    descriptor of an ended upload's file, already renamed to ``path``, and its length). ``length``
    bounds the file's size: the most this store or an earlier one wrote (writes past ``size`` are
    refused before they reach it)."""

    on_disk = True

    def __init__(self, job: bytes, path: str, io: _SpoolIO, size: int, kept: tuple[int, int] | None = None) -> None:
        self.job = job
        self.path = path
        self.io = io
        if kept is None:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            self.length = size
        else:
            self.fd, length = kept
            self.length = max(length, size)

    def write(self, offset: int, data: memoryview) -> int:
        return self.io.write(self.job, self.fd, offset, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        return _pread_all(self.fd, offset, nbytes)

    def close(self) -> None:
        self.io.reap(self.fd, self.path)


class _Held:
    """A chunk of a spooled file held in memory: its bytes, its write's ticket, whether it was read."""

    __slots__ = ("data", "ticket", "read")

    def __init__(self, data: memoryview, ticket: int) -> None:
        self.data = data
        self.ticket = ticket
        self.read = False


@dataclass(slots=True)
class Upload:
    """The staged inputs of one job: their sizes, how much of each is held (from the start), and
    whether a task holds them (``claimed``: its REQUEST came; they are released with the task)."""

    job: bytes
    tenant: str
    owner: str | None
    sizes: tuple[int, ...]
    touched: float
    have: list[int] = field(default_factory=list)
    stores: list[_RamStore | _FileStore] = field(default_factory=list)
    ram: int = 0  # bytes of it held in memory
    claimed: bool = False
    ahead: dict[tuple[int, int], int] = field(default_factory=dict)  # (file, offset) -> end, past ``have`` (replicas)
    ticket: int = 0  # the write of its last chunk stored (0: none on disk)
    # FETCHes of bytes not held yet (the upload still comes, PROTOCOL.md §11.3): (connection, worker name, file,
    # offset, nbytes)
    waiting: list[tuple[bytes, str, int, int, int]] = field(default_factory=list)
    starved: float = 0.0  # since when a FETCH has waited for bytes with none coming (0: none waits)
    # How far the worker the job is placed on has asked for (``fetcher``; bytes over the files in
    # order), and the PUT REPLYs held until it comes within LEAD_BYTES (``Staging``): (journal
    # seq, write ticket, route, REPLY), in order.
    fetcher: str | None = None
    fetched: int = 0
    held: list[tuple[int, int, bytes, list[Any]]] = field(default_factory=list)
    peer_lacks: bool = False  # (active) its passive peer could not hold its bytes: none journalled (§11.4)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def complete(self) -> bool:
        return all(h == s for h, s in zip(self.have, self.sizes, strict=True))

    def missing(self) -> str | None:
        """What is not here yet, said for an error; None when complete."""
        for i, (h, s) in enumerate(zip(self.have, self.sizes, strict=True)):
            if h != s:
                return f"staged file {i} has {h} of its {s} bytes"
        return None


class Spool:
    """Staged uploads by job id; ``directory`` holds the spooled files (made 0700; what an earlier
    run left in it is removed). ``directory`` "": a fresh temporary directory, made when the first
    file is spooled and removed on ``close``."""

    def __init__(self, directory: str = "", ram_bytes: int = DEFAULT_RAM_BYTES,
                 ram_file_bytes: int = DEFAULT_RAM_FILE_BYTES, hold_bytes: int = HOLD_BYTES,
                 keep_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        self._own_dir = not directory
        self._rmdir: Callable[[], object] = lambda: None  # removes a directory of our own
        self.directory = directory  # "": made on the first spooled file
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)
            for name in os.listdir(directory):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError as exc:
                    log.warning("spool: cannot remove %s left by an earlier run: %s", name, exc)
        self.ram_bytes = ram_bytes
        self.ram_file_bytes = ram_file_bytes
        self.hold_bytes = hold_bytes
        self.hold_min_bytes = HOLD_MIN_BYTES
        # Chunks of spooled files (of at least ``hold_min_bytes``) also held in memory, oldest
        # first, by (job, file, offset): those not on disk yet, and those on disk not read yet
        # while ``hold_bytes`` allow. An OrderedDict: the oldest is let go in O(1).
        self._held: collections.OrderedDict[tuple[bytes, int, int], _Held] = collections.OrderedDict()
        self.held_bytes = 0
        self._read_early: collections.deque[tuple[tuple[bytes, int, int], int]] = collections.deque()  # read before on disk: (key, ticket)
        self.io = _SpoolIO()
        self.uploads: dict[bytes, Upload] = {}
        self.ram_used = 0  # bytes of memory stores
        self.reserved = 0  # sizes of every upload, held or still to come
        self.stored = 0  # bytes written so far
        # Of those, the files' (on disk): what the disk owes the uploads open is the difference
        # (``no_room``).
        self.disk_reserved = 0
        self.disk_stored = 0
        # Files of ended uploads kept for the next ones (``keep_bytes`` of them at most, by their
        # lengths): (descriptor, path, length).
        self.keep_bytes = keep_bytes
        self._kept: list[tuple[int, str, int]] = []
        self.kept_bytes = 0
        self._kept_names = 0
        self._closing = False

    def __len__(self) -> int:
        return len(self.uploads)

    def open(self, job: bytes, tenant: str, owner: str | None, sizes: tuple[int, ...], now: float) -> Upload:
        """A new upload of ``sizes`` (the caller checked it is new and within budgets)."""
        up = Upload(job=job, tenant=tenant, owner=owner, sizes=sizes, touched=now, have=[0] * len(sizes))
        try:
            for i, (size, on_disk) in enumerate(zip(sizes, self._on_disk(sizes), strict=True)):
                if not on_disk:
                    up.stores.append(_RamStore(size))
                    up.ram += size
                    self.ram_used += size
                else:
                    if not self.directory:
                        self.directory = tempfile.mkdtemp(prefix="gpud-spool-")
                        # removed with the spool even when nobody closes it (a core dropped by a
                        # test, a broker leaving on an exception): at collection or at exit
                        self._rmdir = weakref.finalize(self, shutil.rmtree, self.directory, True)
                    path = os.path.join(self.directory, f"{job.hex()}-{i}")
                    up.stores.append(_FileStore(job, path, self.io, size, self._take_kept(path, size)))
        except OSError:
            self._close(up)
            raise
        self.uploads[job] = up
        self.reserved += up.total
        self.disk_reserved += up.total - up.ram
        return up

    def _on_disk(self, sizes: tuple[int, ...]) -> list[bool]:
        """Which files of a new upload of ``sizes`` go to disk (the others to memory), now."""
        ram = self.ram_used
        out = []
        for size in sizes:
            to_ram = size <= self.ram_file_bytes and ram + size <= self.ram_bytes
            ram += size if to_ram else 0
            out.append(not to_ram)
        return out

    def no_room(self, sizes: tuple[int, ...], elsewhere: int | None = None) -> str | None:
        """Why the spool's disk cannot take a new upload of ``sizes`` now, or None when it can
        (PROTOCOL.md §11.2, "Disk room"): the bytes of it that go to files, against ``room()``
        and, when given, ``elsewhere`` (the passive peer's room, its last STATE's). Kept files are
        removed when that makes the room."""
        need = self._disk_need(sizes)
        if not need:
            return None
        if elsewhere is not None and need > elsewhere:
            return (f"the standby broker's spool disk has room for {max(0, elsewhere)} more bytes now, and the "
                    f"upload's files need {need}; try later")
        room = self.make_room(sizes)
        if room is None or need <= room:
            return None
        return (f"the broker's spool disk has room for {max(0, room)} more bytes now, and the upload's files "
                f"need {need}; try later")

    def make_room(self, sizes: tuple[int, ...]) -> int | None:
        """Remove the kept files when a new upload of ``sizes`` needs their room (and that makes
        it); the room there is then, as ``_disk_room`` counts it (None: it cannot tell)."""
        need = self._disk_need(sizes)
        room = self._disk_room()
        if room is not None and need > room and self._kept:
            kept = self._kept_blocks()
            if need <= room + kept:
                log.info("spool: the files kept for reuse are removed to make room for an upload of %d bytes", need)
                self._drop_kept()
                room += kept
        return room

    def _disk_need(self, sizes: tuple[int, ...]) -> int:
        """Bytes of a new upload of ``sizes`` that would go to files."""
        return sum(size for size, on_disk in zip(sizes, self._on_disk(sizes), strict=True) if on_disk)

    def room(self) -> int | None:
        """Bytes of new files the spool's disk can take now, the kept files' counted (they are
        removed when needed); None when it cannot tell."""
        room = self._disk_room()
        return None if room is None else room + self._kept_blocks()

    def _disk_room(self) -> int | None:
        """The file system's free space less what the uploads open in files have still to write,
        what the disk thread has queued, and ``DISK_HEADROOM_BYTES`` (writes over kept files count
        as new blocks: the check errs on the side of refusing); None when it cannot tell."""
        try:
            fs = os.statvfs(self.directory or tempfile.gettempdir())
        except OSError as exc:
            log.warning("spool: cannot tell the free space under %s: %s", self.directory, exc)
            return None
        owed = self.disk_reserved - self.disk_stored + self.io.backlog
        return fs.f_bavail * fs.f_frsize - owed - DISK_HEADROOM_BYTES

    def write(self, up: Upload, index: int, offset: int, data: memoryview, now: float, ordered: bool = True) -> bool:
        """Store one chunk; False when its range is held already (a re-send), True when written.
        InvalidRequest for a chunk past its file's end or, when ``ordered``, one that would leave a
        gap. Not ``ordered`` (a passive broker, whose older chunks come after a snapshot): a chunk
        past ``have`` is kept aside, and ``have`` grows over it once the gap is filled."""
        if index >= len(up.sizes):
            raise InvalidRequest(f"staged file {index} is not one of the upload's {len(up.sizes)}")
        end = offset + len(data)
        if end > up.sizes[index]:
            raise InvalidRequest(f"the chunk runs to byte {end} of staged file {index}, which has {up.sizes[index]}")
        have = up.have[index]
        if offset > have and not ordered:
            self._store(up, index, offset, data)
            up.ahead[index, offset] = max(end, up.ahead.get((index, offset), 0))
            up.touched = now
            return True
        if offset > have:
            raise InvalidRequest(f"the chunk at offset {offset} of staged file {index} leaves a gap: "
                                 f"the broker holds its first {have} bytes")
        up.touched = now
        if end <= have:
            return False
        fresh = data[have - offset :]
        self._store(up, index, have, fresh)
        merged = bool(up.ahead)
        while merged:  # pieces written ahead that the gap just closed on
            merged = False
            for (i, start), stop in list(up.ahead.items()):
                if i == index and start <= end:
                    del up.ahead[i, start]
                    end, merged = max(end, stop), True
        up.have[index] = end
        self.stored += end - have
        if up.stores[index].on_disk:
            self.disk_stored += end - have
        return True

    def _store(self, up: Upload, index: int, offset: int, data: memoryview) -> None:
        ticket = up.stores[index].write(offset, data)
        if ticket:
            up.ticket = ticket
            if len(data) >= self.hold_min_bytes:
                self._held[up.job, index, offset] = _Held(data, ticket)
                self.held_bytes += len(data)
                if self.held_bytes > self.hold_bytes:
                    self.trim()

    def trim(self) -> None:
        """Let go of the memory copies of chunks on disk: of those read already, and of the
        oldest others while more than ``hold_bytes`` are held (a chunk not written yet is kept).
        Amortized O(1) a chunk: nothing is scanned."""
        done = self.io.done
        held_map, early = self._held, self._read_early
        while early and early[0][1] <= done:
            gone = held_map.pop(early.popleft()[0], None)
            if gone is not None:
                self.held_bytes -= len(gone.data)
        while self.held_bytes > self.hold_bytes and held_map:
            key, held = next(iter(held_map.items()))
            if held.ticket > done:
                break  # not on disk yet, nor are the later ones
            del held_map[key]
            self.held_bytes -= len(held.data)

    def written(self, up: Upload) -> bool:
        """Whether every chunk of ``up`` stored so far is on disk (or in memory)."""
        return up.ticket <= self.io.done

    def _check_range(self, up: Upload, index: int, offset: int, nbytes: int) -> None:
        if not 0 <= index < len(up.sizes) or offset < 0 or nbytes < 0 or offset + nbytes > up.have[index]:
            raise InvalidRequest(f"bytes {offset}..{offset + nbytes} of staged file {index} are not held")

    def read(self, up: Upload, index: int, offset: int, nbytes: int) -> Any:
        """Bytes of a staged file that the spool holds (InvalidRequest for a range it does not):
        a buffer of the chunk that brought them when it is held in memory, else read from the
        disk, after waiting for the writes before. For tests and the rare path; the loop's reads
        go through ``read_soon``, which never waits."""
        self._check_range(up, index, offset, nbytes)
        kept = self._held_range(up, index, offset, nbytes)
        if kept is not None:
            return kept
        if up.ticket > self.io.done:
            self.io.wait(up.ticket)
        return up.stores[index].read(offset, nbytes)

    def read_soon(self, up: Upload, index: int, offset: int, nbytes: int, deliver: Delivery) -> Any:
        """The bytes of a range the spool holds (InvalidRequest for one it does not), without
        waiting: from memory (a small file, or a chunk held since its PUT: the chunk is let go
        once on disk, a worker reads each once) and returned, or else None, and read by the disk
        thread, after the writes before it, and handed to ``deliver`` by ``take_reads`` later."""
        self._check_range(up, index, offset, nbytes)
        store = up.stores[index]
        if isinstance(store, _RamStore):
            return store.read(offset, nbytes)
        kept = self._held_range(up, index, offset, nbytes)
        if kept is not None:
            return kept
        assert isinstance(store, _FileStore)
        self.io.read(store.fd, offset, nbytes, deliver)
        return None

    def _held_range(self, up: Upload, index: int, offset: int, nbytes: int) -> memoryview | None:
        held = self._held.get((up.job, index, offset))
        if held is None or len(held.data) < nbytes:
            return None
        if held.ticket <= self.io.done:  # on disk: the memory copy is not needed any more
            del self._held[up.job, index, offset]
            self.held_bytes -= len(held.data)
        elif not held.read:
            self._read_early.append(((up.job, index, offset), held.ticket))  # let go once on disk (``trim``)
        held.read = True
        return held.data[:nbytes]

    def mark_read(self, up: Upload, index: int, offset: int) -> None:
        """The chunk at (``index``, ``offset``) was sent on from its PUT's own frame: read."""
        if (up.job, index, offset) in self._held:
            self._held_range(up, index, offset, 0)

    def take_reads(self) -> None:
        """(The loop, when the disk thread signalled) Deliver the reads done; let go of the
        memory copies of chunks now on disk that were read already."""
        self.io.take_reads()
        if self._read_early or self.held_bytes > self.hold_bytes:
            self.trim()

    def ranges(self, up: Upload, chunk: int) -> Iterator[tuple[int, int, int]]:
        """(file, offset, nbytes) of every held byte of ``up``, in chunks of at most ``chunk``."""
        for i, have in enumerate(up.have):
            for offset in range(0, have, chunk):
                yield i, offset, min(chunk, have - offset)

    def drop(self, job: bytes) -> Upload | None:
        """Release an upload and its bytes; the upload, or None when there was none."""
        up = self.uploads.pop(job, None)
        if up is not None:
            self.reserved -= up.total
            self.stored -= sum(up.have)
            for store, size, have in zip(up.stores, up.sizes, up.have, strict=True):
                if store.on_disk:
                    self.disk_reserved -= size
                    self.disk_stored -= have
            self._close(up)
        return up

    def expired(self, now: float, ttl: float) -> list[Upload]:
        """Unclaimed uploads untouched for ``ttl`` seconds (the caller drops them)."""
        limit = now - ttl
        return [up for up in self.uploads.values() if not up.claimed and up.touched < limit]

    def stalled(self, now: float, ttl: float) -> list[Upload]:
        """Claimed uploads still incomplete and untouched for ``ttl`` seconds: their job waits
        for bytes that stopped coming."""
        limit = now - ttl
        return [up for up in self.uploads.values() if up.claimed and up.touched < limit and not up.complete()]

    def wait_removed(self) -> None:
        """Wait until the files of every upload dropped so far are gone (they go on a thread)."""
        self.io.stop()

    def clear(self) -> None:
        for job in list(self.uploads):
            self.drop(job)

    def close(self) -> None:
        self._closing = True
        self.clear()
        self._drop_kept()
        self.io.close()
        if self._own_dir and self.directory:
            self._rmdir()
            self.directory = ""

    def _drop_kept(self) -> None:
        """Remove the files kept for reuse (on the disk thread, after what it has queued)."""
        for fd, path, _ in self._kept:
            self.io.reap(fd, path)
        self._kept.clear()
        self.kept_bytes = 0

    def _kept_blocks(self) -> int:
        """Bytes of disk the kept files take (allocated blocks: a kept file may be sparse)."""
        total = 0
        for fd, _, _ in self._kept:
            try:
                total += os.fstat(fd).st_blocks * 512
            except OSError:
                pass
        return total

    def _take_kept(self, path: str, size: int) -> tuple[int, int] | None:
        """A kept file for a new store of ``size`` bytes, renamed to ``path``: the smallest one at
        least that long, else the longest; None when none is kept (or the rename failed)."""
        if not self._kept:
            return None
        fits = [k for k in self._kept if k[2] >= size]
        pick = min(fits, key=lambda k: k[2]) if fits else max(self._kept, key=lambda k: k[2])
        self._kept.remove(pick)
        self.kept_bytes -= pick[2]
        fd, old, length = pick
        try:
            os.rename(old, path)  # a rename, not the removal of blocks: quick enough for the loop
        except OSError as exc:
            log.warning("spool: cannot reuse %s: %s", old, exc)
            self.io.reap(fd, old)
            return None
        return fd, length

    def _keep(self, store: _FileStore) -> bool:
        """Keep an ended upload's file for the next ones, while ``keep_bytes`` allows."""
        if self._closing or self.kept_bytes + store.length > self.keep_bytes:
            return False
        self._kept_names += 1
        path = os.path.join(self.directory, f"kept-{self._kept_names}")
        try:
            os.rename(store.path, path)
        except OSError as exc:
            log.warning("spool: cannot keep %s for reuse: %s", store.path, exc)
            return False
        self._kept.append((store.fd, path, store.length))
        self.kept_bytes += store.length
        return True

    def _close(self, up: Upload) -> None:
        self.ram_used -= up.ram
        up.ram = 0
        for store in up.stores:
            if isinstance(store, _FileStore) and self._keep(store):
                continue
            try:
                store.close()
            except OSError as exc:
                log.warning("spool: cannot remove a staged file of %s: %s", id_text(up.job), exc)
        up.stores = []
        for key in [k for k in self._held if k[0] == up.job]:
            self.held_bytes -= len(self._held.pop(key).data)
        up.waiting.clear()
