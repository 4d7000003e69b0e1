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
        self._pid = 0

    def take16(self) -> bytes:
        with self._lock:
            if len(self._pool) < 16 or self._pid != os.getpid():
                self._pool, self._pid = os.urandom(4096), os.getpid()
            out, self._pool = self._pool[:16], self._pool[16:]
        return out


_ids = _IdSource()


def new_id() -> bytes:
    """A fresh client-chosen request id: a random (version 4) UUID's 16 bytes. Ids must not be
    guessable: a request with a known id attaches to that request."""
    b = bytearray(_ids.take16())
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return bytes(b)
