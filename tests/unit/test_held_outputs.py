"""The worker's hold of finished jobs' staged outputs (``gpud_worker.held_outputs``,
PROTOCOL.md §11.5): private unlinked files on the job root's disk, at most ``limit`` bytes
together, a wait for room and then BUSY, TOO_LARGE for outputs that never fit. Real files, a real
small file system (a 64 MiB tmpfs, as root) for a full disk.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.errors import Busy, TooLarge
from gpud_worker.held_outputs import HEADROOM, HeldOutputs, OutputHold

MiB = 1 << 20


@pytest.fixture
def sources(tmp_path: Path) -> Iterator[list[tuple[int, int]]]:
    """Two output files of a job, open as the runner has them: (fd, size) each."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A" * (3 * MiB) + b"end-of-a")
    b.write_bytes(bytes(range(256)) * 4096 * 2)  # 2 MiB, every byte's offset shows in it
    fds = [os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)]
    try:
        yield [(fd, os.fstat(fd).st_size) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def test_outputs_are_copied_into_a_private_unlinked_file_and_read_back_by_range(
        tmp_path: Path, sources: list[tuple[int, int]]) -> None:
    root = tmp_path / "root"
    root.mkdir()
    hold = OutputHold(root, limit=64 * MiB)
    held = hold.take("job1", "acme", ["a", "b"], sources)
    assert held.names == ["a", "b"] and held.sizes == [3 * MiB + 8, 2 * MiB] and held.total == 5 * MiB + 8
    assert hold.held == held.total
    assert os.listdir(root) == []  # nothing a job user (or anyone) could open by a name
    st = os.fstat(held._fd)
    assert st.st_nlink == 0 and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert st.st_dev == os.stat(root).st_dev and st.st_size == held.total
    # The broker's FETCHes: a range of one file, never past its end or into the next one.
    assert held.read(0, 3 * MiB, MiB) == b"end-of-a"
    assert held.read(1, 0, 256) == bytes(range(256))
    assert held.read(1, 2 * MiB - 3, MiB) == bytes([253, 254, 255])
    for index, offset, nbytes in ((2, 0, 1), (-1, 0, 1), (0, 3 * MiB + 8, 1), (0, -1, 1), (0, 0, 0)):
        assert held.read(index, offset, nbytes) is None
    held.close()
    held.close()  # twice (an ACK after the TTL dropped it): no second release
    assert hold.held == 0 and held.read(0, 0, 1) is None


def test_outputs_over_the_limit_alone_are_too_large_at_once(tmp_path: Path, sources: list[tuple[int, int]]) -> None:
    hold = OutputHold(tmp_path, limit=8 * MiB, wait_s=30)
    began = time.monotonic()
    with pytest.raises(TooLarge, match=r"max_held_output_bytes \(8388608\): 4194304"):
        hold.take("job1", "acme", ["a", "b"], sources)
    assert time.monotonic() - began < 5  # no wait for room that can never come
    assert hold.held == 0


def test_outputs_wait_for_room_and_take_it_when_other_outputs_go(tmp_path: Path,
                                                                  sources: list[tuple[int, int]]) -> None:
    hold = OutputHold(tmp_path, limit=16 * MiB, wait_s=30)
    first = hold.take("job1", "acme", ["a", "b"], sources)
    got: list[HeldOutputs] = []
    waiter = threading.Thread(target=lambda: got.append(hold.take("job2", "acme", ["a", "b"], sources)))
    waiter.start()
    time.sleep(0.3)
    assert got == [] and hold.held == first.total  # 10 MiB do not fit the tenant's 8: it waits
    first.close()
    waiter.join(10)
    assert len(got) == 1 and got[0].read(0, 3 * MiB, 8) == b"end-of-a"
    assert hold.held == got[0].total
    got[0].close()


def test_outputs_without_room_in_time_end_busy_and_hold_nothing(tmp_path: Path,
                                                                 sources: list[tuple[int, int]]) -> None:
    hold = OutputHold(tmp_path, limit=16 * MiB, wait_s=0.5)
    first = hold.take("job1", "acme", ["a", "b"], sources)
    with pytest.raises(Busy, match="waited 0.5s for the broker to fetch other jobs' outputs"):
        hold.take("job2", "acme", ["a", "b"], sources)
    assert hold.held == first.total
    first.close()


def test_a_stopping_worker_cuts_the_wait_for_room_to_its_drain_and_answers_busy_by_then(
        tmp_path: Path, sources: list[tuple[int, int]]) -> None:
    """At SIGTERM the worker drains for drain_timeout (30 s), shorter than the wait for room
    (60 s): a job still waiting at the deadline would be cut off without its RESULT. The wait
    now ends by the time ``stop`` names, BUSY saying why; room that comes before still takes
    the outputs; outputs that fit are held as before."""
    hold = OutputHold(tmp_path, limit=16 * MiB, wait_s=30)
    first = hold.take("job1", "acme", ["a", "b"], sources)
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(hold.take("job2", "acme", ["a", "b"], sources))
        except Busy as exc:
            got.append(exc)

    # Room comes before the stop's deadline: the waiting outputs take it.
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    hold.stop("the worker is stopping", time.monotonic() + 20)
    time.sleep(0.2)
    assert got == []  # still waiting: its deadline is the stop's now, not yet come
    first.close()
    waiter.join(10)
    assert len(got) == 1 and isinstance(got[0], HeldOutputs), got
    # No room by the stop's deadline: BUSY then, long before the 30 s wait, holding nothing.
    first, got[:] = got[0], []
    waiter = threading.Thread(target=wait)
    began = time.monotonic()
    hold.stop("the worker is stopping", began + 0.5)
    waiter.start()
    waiter.join(10)
    assert 0.4 < time.monotonic() - began < 5
    assert len(got) == 1 and isinstance(got[0], Busy) and "the worker is stopping" in got[0].message, got
    assert hold.held == first.total
    other = hold.take("job3", "beta", ["a", "b"], sources)  # another tenant's fit: held as before
    assert other.read(0, 3 * MiB, 8) == b"end-of-a"
    other.close()
    first.close()
    assert hold.held == 0


def test_the_disk_bounds_the_hold_whatever_its_limit(small_fs: Path, tmp_path: Path) -> None:
    """A 64 MiB file system and the default 16 GiB limit: what the disk has, less 16 MiB of
    headroom, is what the hold takes; past it BUSY, naming the room there is."""
    big = tmp_path / "big"
    big.write_bytes(b"x" * (40 * MiB))
    fd = os.open(big, os.O_RDONLY)
    try:
        hold = OutputHold(small_fs, wait_s=0.2)
        assert hold.room() <= 64 * MiB - HEADROOM
        held = hold.take("job1", "acme", ["big"], [(fd, 40 * MiB)])
        with pytest.raises(Busy, match=r"room for \d+ more bytes"):
            hold.take("job2", "bob", ["big"], [(fd, 40 * MiB)])
        held.close()
        assert hold.room() > 40 * MiB  # the file's blocks went with its last descriptor
        hold.take("job3", "bob", ["big"], [(fd, 40 * MiB)]).close()
    finally:
        os.close(fd)


def test_one_tenants_outputs_take_at_most_half_the_hold_and_others_get_theirs_at_once(
        tmp_path: Path, sources: list[tuple[int, int]]) -> None:
    """A tenant whose jobs finish with large outputs together: at half the hold its next job's
    outputs wait, and another tenant's are taken at once beside them."""
    hold = OutputHold(tmp_path, limit=24 * MiB, wait_s=30)
    mine = [hold.take(f"a{i}", "mallory", ["a", "b"], sources) for i in range(2)]  # 10 of its 12 MiB
    got: list[HeldOutputs] = []
    waiter = threading.Thread(target=lambda: got.append(hold.take("a3", "mallory", ["a", "b"], sources)))
    waiter.start()
    time.sleep(0.3)
    assert got == []  # 15 MiB would pass its share
    began = time.monotonic()
    honest = hold.take("b1", "alice", ["a", "b"], sources)
    assert time.monotonic() - began < 1 and hold.by_tenant == {"mallory": 10 * MiB + 16, "alice": 5 * MiB + 8}
    mine[0].close()
    waiter.join(10)
    assert len(got) == 1 and hold.by_tenant["mallory"] == 10 * MiB + 16
    for held in (mine[1], got[0], honest):
        held.close()
    assert hold.held == 0 and hold.by_tenant == {}
