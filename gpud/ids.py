"""Request ids: 16 random bytes (a version 4 UUID), chosen by the client."""

from __future__ import annotations

import os
import threading


class _IdSource:
    """Random bytes from os.urandom, read 4 KiB at a time (one system call per 256 ids); never
    shared across threads unlocked, nor across a fork (a child refills its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = b""
        self._at = 0  # the next unused byte of _pool

    def take16(self) -> bytes:
        with self._lock:
            at = self._at
            if at + 16 > len(self._pool):
                self._pool, at = os.urandom(4096), 0
            self._at = at + 16
            return self._pool[at:at + 16]

    def forget(self) -> None:
        """In a forked child: drop the parent's bytes (they would repeat its ids). A fresh lock,
        too: the fork may have copied it held."""
        self._lock = threading.Lock()
        self._pool = b""
        self._at = 0


_ids = _IdSource()
# A hook instead of a getpid() per id (a system call's worth on the client's hot path).
os.register_at_fork(after_in_child=_ids.forget)


def new_id() -> bytes:
    """A fresh client-chosen request id: a random (version 4) UUID's 16 bytes. Ids must not be
    guessable: a request with a known id attaches to that request."""
    b = bytearray(_ids.take16())
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return bytes(b)
