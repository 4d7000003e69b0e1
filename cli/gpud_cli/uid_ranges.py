"""Blocks of dynamic job uids that local clusters on one host share out: one lock file per block.

A worker running as root kills every process of its pool users after each job, so two workers
must never have a uid in common, also when they belong to two clusters (``gpud up`` twice, or two
test runs) on one host. ``UidBlocks.take`` hands out the first block of ``size`` uids, from
``base`` up, whose lock file no other process holds: an exclusive ``flock`` on
``LOCK_DIR/uids-FIRST-LAST.lock``, kept for as long as the block is used. The kernel drops the
lock when its holder exits, also when it is killed, so a crashed cluster never holds a block. A
block that some process runs under (a cluster that takes no lock, or one's orphans) is passed over.
"""

from __future__ import annotations

import fcntl
import logging
import os

from gpud.errors import ConfigError

log = logging.getLogger(__name__)

DYNAMIC_BASE = 61184  # systemd's range for dynamic users: 61184-65519
DYNAMIC_LAST = 65519
BLOCK = 16
LOCK_DIR = "/run/lock/gpud" if os.path.isdir("/run/lock") else "/tmp/gpud-lock"


def uids_in_use(uids: range, proc: str = "/proc") -> set[int]:
    """The uids of ``uids`` that some process runs as (its real uid, ``/proc/PID/status``)."""
    busy = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "status"), encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        uid = int(line.split()[1])
                        if uid in uids:
                            busy.add(uid)
                        break
        except (OSError, ValueError, IndexError):
            continue
    return busy


class UidBlocks:
    """Blocks of ``size`` uids from ``base`` to ``last``, taken under lock files in ``lock_dir``."""

    def __init__(self, base: int = DYNAMIC_BASE, size: int = BLOCK, last: int = DYNAMIC_LAST,
                 lock_dir: str = LOCK_DIR) -> None:
        if size < 1 or base < 1 or base + size - 1 > last:
            raise ConfigError(f"no block of {size} uids fits in {base}-{last}: choose a base of at most {last - size + 1}")
        self.base, self.size, self.last, self.lock_dir = base, size, last, lock_dir
        self._held: dict[int, int] = {}  # first uid -> fd of its lock file

    def take(self) -> range:
        """The first block no process holds, now held by this one until ``give_back``.

        Raises:
            ConfigError: every block is held.
        """
        os.makedirs(self.lock_dir, 0o755, exist_ok=True)
        for first in range(self.base, self.last - self.size + 2, self.size):
            if first in self._held:
                continue
            path = os.path.join(self.lock_dir, f"uids-{first}-{first + self.size - 1}.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            block = range(first, first + self.size)
            busy = uids_in_use(block)
            if busy:  # a cluster that takes no lock (an older gpud), or a crashed one's orphans
                log.info("uids %d-%d: processes run as %s; taking another block", first, block[-1], sorted(busy))
                os.close(fd)
                continue
            self._held[first] = fd
            return block
        raise ConfigError(f"every block of {self.size} uids in {self.base}-{self.last} is held by another "
                          f"running cluster (lock files in {self.lock_dir})")

    def give_back(self, block: range) -> None:
        """Release a block from ``take``."""
        fd = self._held.pop(block.start, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Release every block held."""
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()
