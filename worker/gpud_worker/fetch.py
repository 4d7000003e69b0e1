"""Fetching a staged job's inputs from the broker (PROTOCOL.md §11.3), chunk by chunk, into
staging files of the worker's own.

A ``Fetch`` is the state of one job's inputs: its window (``gpud.transfer.ChunkWindow``: which
chunks are asked for, at most ``window`` at once, which have come) and the files they are
written to. It has no sockets and no clock of its own: the worker loop sends the FETCHes it names, hands it each CHUNK and passes the time. Once
complete, ``buffers`` maps the files for the job runner, which copies them into the job's own
directory as it does inline inputs.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

from gpud.protocol import id_text
from gpud.transfer import CHUNK_BYTES, WINDOW, ChunkWindow

log = logging.getLogger(__name__)


class Fetch(ChunkWindow):
    """One staged job's inputs, ``sizes`` bytes each, fetched into files under ``directory``."""

    def __init__(self, job: bytes, sizes: list[int], directory: str, chunk: int = CHUNK_BYTES,
                 window: int = WINDOW) -> None:
        super().__init__(sizes, chunk, window)
        self.job = job
        self.paths: list[str] = []
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
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

    def buffers(self) -> list[Any]:
        """The complete inputs, in order, as buffers (the files mapped read-only)."""
        out: list[Any] = []
        for fd, size in zip(self.fds, self.sizes, strict=True):
            if size == 0:
                out.append(b"")
                continue
            m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            self._maps.append(m)
            out.append(m)
        return out

    def close(self) -> None:
        """Unmap and remove the staging files (idempotent)."""
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view of it is still alive somewhere: unmapped when collected
                pass
        self._maps.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths.clear()
