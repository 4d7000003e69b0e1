"""Finished jobs' staged outputs, held on the worker's disk until the broker has them (PROTOCOL.md §11.5).

A job whose output files together are over ``stage_above`` bytes has them *staged*: the broker
fetches them in chunks after the job's RESULT, and the worker keeps them until that RESULT is
ACKed. They are not kept in the worker's memory: a GPU VM runs up to ``slots`` jobs at once, each
with up to ``max_job_output_bytes`` (1 GiB) of outputs, and their sum in the worker's memory is
an OOM kill of the worker and everyone's work on it. The job thread copies them (``sendfile``: no
byte passes through the worker's memory) out of the job's directory, before it goes, into one
unlinked file of the worker's own (``O_TMPFILE``, root's, mode 0600) on the file system of the
job root: its pages are page cache, which the kernel writes back and reclaims under pressure. The
job's user cannot reach that file (so nothing can truncate it under a reader; the file is read with
``pread``, never mapped), and it is gone once its descriptor is closed: on the RESULT's ACK, at
``UNACKED_TTL``, when the broker takes the job away, or when the worker exits.

Together the held outputs take at most ``limit`` bytes and leave ``HEADROOM`` free on that file
system; one tenant's at most half of ``limit`` (``TENANT_SHARE``), so that a tenant whose many
jobs finish with large outputs at once never takes all the room other tenants' finished jobs need.
A job whose outputs never fit (over its tenant's share alone) ends TOO_LARGE at once; one whose
outputs do not fit now waits up to ``wait_s`` for the broker to fetch others, then ends BUSY (it
ran: it is not run again).
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Sequence

from gpud.errors import Busy, TooLarge
from gpud.transfer import SYSCALL_BYTES

log = logging.getLogger(__name__)

STAGE_ABOVE = 8 << 20  # output files larger together are staged: fetched by the broker (PROTOCOL.md §11.5)
HEADROOM = 16 << 20  # bytes the held outputs leave free on their file system
WAIT_S = 60.0  # how long a finished job's outputs wait for room before the job ends BUSY
TENANT_SHARE = 0.5  # of the hold's limit, what one tenant's held outputs may take


class HeldOutputs:
    """One job's staged output files, back to back in one private file: ``read`` serves the
    broker's FETCHes, ``close`` lets them go (and their room in the hold). Reads come from the
    worker's loop; ``close`` may come twice."""

    def __init__(self, fd: int, tenant: str, names: Sequence[str], sizes: Sequence[int], release: OutputHold) -> None:
        self.tenant = tenant
        self.names = list(names)
        self.sizes = list(sizes)
        self.total = sum(self.sizes)
        self._starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._fd = fd
        self._hold = release

    def read(self, index: int, offset: int, nbytes: int) -> bytes | None:
        """Up to ``nbytes`` of file ``index`` from ``offset`` on (fewer at its end); None for a
        range outside the files, or once closed."""
        if self._fd < 0 or not 0 <= index < len(self.sizes) or not 0 <= offset < self.sizes[index] or nbytes <= 0:
            return None
        n = min(nbytes, self.sizes[index] - offset)
        data = os.pread(self._fd, n, self._starts[index] + offset)
        return data if len(data) == n else None

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
            self._hold.release(self.tenant, self.total)


class OutputHold:
    """Where the worker holds finished jobs' staged outputs (module docstring): private files
    under ``directory``, at most ``limit`` bytes together; outputs over ``stage_above`` together
    are held, smaller ones go inline in the RESULT."""

    def __init__(self, directory: pathlib.Path | str, limit: int = 16 << 30, stage_above: int = STAGE_ABOVE,
                 wait_s: float = WAIT_S) -> None:
        self.directory = str(directory)
        self.limit = limit
        self.stage_above = stage_above
        self.wait_s = wait_s
        self.held = 0  # bytes reserved or held, all jobs together
        self.by_tenant: dict[str, int] = {}  # the same, by tenant (none listed with 0)
        self._writing = 0  # of those, reserved and not written yet (statvfs does not count them)
        self._changed = threading.Condition()
        self._stopping: tuple[str, float] | None = None  # why, and until when, outputs still wait for room (``stop``)

    @property
    def tenant_limit(self) -> int:
        return int(self.limit * TENANT_SHARE)

    def take(self, job: str, tenant: str, names: Sequence[str], sources: Sequence[tuple[int, int]]) -> HeldOutputs:
        """Copy the files ``sources`` ((fd, size) each, named ``names``) of a job of ``tenant``
        into a private file and hold them. Waits for room (module docstring); raises TooLarge or
        Busy when there is none."""
        sizes = [size for _, size in sources]
        total = sum(sizes)
        self._reserve(job, tenant, total)
        try:
            fd = self._private_file()
        except OSError as exc:
            self.release(tenant, total, written=False)
            raise Busy(f"the worker cannot hold the job's {total} bytes of staged outputs: {exc.strerror}") from None
        try:
            for src, size in sources:
                _copy(src, fd, size)
        except OSError as exc:
            os.close(fd)
            self.release(tenant, total, written=False)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise Busy(f"the worker's disk filled while it held the job's {total} bytes of staged "
                           f"outputs ({self.directory}); they are lost") from None
            raise
        with self._changed:
            self._writing -= total
        return HeldOutputs(fd, tenant, names, sizes, self)

    def release(self, tenant: str, nbytes: int, written: bool = True) -> None:
        with self._changed:
            self.held -= nbytes
            left = self.by_tenant.pop(tenant, 0) - nbytes
            if left > 0:
                self.by_tenant[tenant] = left
            if not written:
                self._writing -= nbytes
            self._changed.notify_all()

    def stop(self, why: str, by: float) -> None:
        """Outputs waiting for room, and any that will, wait until ``by`` (``time.monotonic``)
        at most, then end their job BUSY saying ``why``: the worker stops, and would cut a longer
        wait off unanswered at its drain deadline. Room that comes before still takes them."""
        with self._changed:
            self._stopping = (why, by)
            self._changed.notify_all()

    def room(self, tenant: str | None = None) -> int:
        """Bytes more the hold may take now (for ``tenant``: under its share too): under
        ``limit``, and on its file system less what is reserved and not written yet and
        ``HEADROOM``."""
        try:
            st = os.statvfs(self.directory)
            disk = st.f_bavail * st.f_frsize - self._writing - HEADROOM
        except OSError:
            disk = 0
        share = self.tenant_limit - self.by_tenant.get(tenant, 0) if tenant is not None else disk
        return max(0, min(self.limit - self.held, disk, share))

    def _reserve(self, job: str, tenant: str, nbytes: int) -> None:
        if nbytes > self.tenant_limit:
            raise TooLarge(f"the job's staged outputs are {nbytes} bytes, over what one tenant's may take of the "
                           f"worker's max_held_output_bytes ({self.limit}): {self.tenant_limit}")
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            waited = False
            while (room := self.room(tenant)) < nbytes:
                stopping = self._stopping
                left = deadline - time.monotonic()
                if stopping is not None and stopping[1] < deadline:
                    left = stopping[1] - time.monotonic()
                    if left <= 0:
                        raise Busy(f"the worker has no room for the job's {nbytes} bytes of staged outputs now, and "
                                   f"{stopping[0]}: the job ran, its outputs are lost")
                if left <= 0:
                    raise Busy(f"the worker has room for {room} more bytes of this tenant's staged outputs now, not the job's "
                               f"{nbytes}: it waited {self.wait_s:g}s for the broker to fetch other jobs' "
                               "outputs; the job ran, its outputs are lost")
                if not waited:
                    log.info("job %s: its %d bytes of staged outputs wait for room (%d held)", job, nbytes, self.held)
                    waited = True
                self._changed.wait(min(left, 1.0))  # the disk's room changes without a release too
            self.held += nbytes
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + nbytes
            self._writing += nbytes

    def _private_file(self) -> int:
        """A new file nobody else can open: unlinked from the start where the file system can."""
        try:
            return os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        fd, path = tempfile.mkstemp(prefix=".held-", dir=self.directory)
        os.unlink(path)
        return fd


def _copy(src: int, dst: int, size: int) -> None:
    """Append ``size`` bytes of ``src`` (from its start) to ``dst``, in the kernel, at most
    ``SYSCALL_BYTES`` per system call (as ``gpud.transfer.pwrite_all``, and for its reason)."""
    offset = 0
    while offset < size:
        try:
            n = os.sendfile(dst, src, offset, min(SYSCALL_BYTES, size - offset))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EXDEV):
                raise
            data = memoryview(os.pread(src, min(SYSCALL_BYTES, size - offset), offset))  # a kernel without it
            n = len(data)
            while data:
                data = data[os.write(dst, data):]
        if n == 0:
            raise OSError(errno.EIO, "an output file shrank while it was copied")
        offset += n
