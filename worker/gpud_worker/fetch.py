"""Fetching a staged job's inputs from the broker (PROTOCOL.md §11.3), chunk by chunk, into
staging files of the worker's own.

A ``Fetch`` is the state of one job's inputs: its window (``gpud.transfer.ChunkWindow``: which
chunks are asked for, at most ``window`` at once, which have come) and the files they are
written to. It has no sockets and no clock of its own: the worker loop sends the FETCHes it names, hands it each CHUNK and passes the time. Once
complete, ``inputs`` hands the files to the job runner, which copies each into the job's own
directory file to file in the kernel (``StagedFile.copy_to``), not through the worker's memory.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from gpud.protocol import id_text
from gpud.transfer import CHUNK_BYTES, WINDOW, ChunkWindow

log = logging.getLogger(__name__)


class StagedFile:
    """A complete staged input in its staging file, ``size`` bytes from offset 0 of ``fd``."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def copy_to(self, out: int) -> None:
        """Write the whole file to ``out`` (a new, empty file), in the kernel."""
        done = 0
        while done < self.size:
            n = os.sendfile(out, self.fd, done, self.size - done)
            if n == 0:
                raise OSError(errno.EIO, "the staging file is shorter than its input")
            done += n


class Fetch(ChunkWindow):
    """One staged job's inputs, ``sizes`` bytes each, fetched into files under ``directory``."""

    def __init__(self, job: bytes, sizes: list[int], directory: str, chunk: int = CHUNK_BYTES,
                 window: int = WINDOW) -> None:
        super().__init__(sizes, chunk, window)
        self.job = job
        self.paths: list[str] = []
        self.fds: list[int] = []
        try:
            for i in range(len(sizes)):
                path = os.path.join(directory, f"{job.hex()}-{i}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                self.paths.append(path)
                self.fds.append(fd)
        except OSError:
            self.close()
            raise

    def on_chunk(self, index: Any, offset: Any, data: Any) -> bool:
        """Write a CHUNK's bytes; False (dropped) for a chunk not asked for or of the wrong size."""
        view = memoryview(data.buffer if hasattr(data, "buffer") else data)
        if not self.expects(index, offset, len(view)):
            if (index, offset) in self.asked:
                log.warning("job %s: chunk %s@%s has %d bytes, not those asked for; asked again",
                            id_text(self.job), index, offset, len(view))
            return False
        done = 0
        while done < len(view):
            done += os.pwrite(self.fds[index], view[done:], offset + done)
        self.took(index, offset)
        return True

    def inputs(self) -> list[StagedFile]:
        """The complete inputs, in order (valid until ``close``)."""
        return [StagedFile(fd, size) for fd, size in zip(self.fds, self.sizes, strict=True)]

    def close(self) -> None:
        """Remove the staging files (idempotent)."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths.clear()
