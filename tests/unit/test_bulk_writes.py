"""Bulk writes in bounded system calls (gpud.transfer.pwrite_all): every byte lands where it
belongs, and no single system call moves more than ``piece`` bytes, so that the threads that
write staged bytes (the broker's spool, the worker's job threads) never hold a CPU for a whole
chunk on a kernel without full preemption. Real files under tmp_path; ``os.pwrite`` is watched,
not replaced."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpud.transfer import CHUNK_BYTES, SYSCALL_BYTES, pwrite_all, read_capped
from gpud_broker.spool import Spool
from gpud_worker.fetch import Fetch


class Watch:
    """``os.pwrite`` as it is, with the size of each call's data recorded (and, with ``most``,
    each call allowed to write no more than that: a short write, as the system call may make)."""

    def __init__(self, most: int | None = None) -> None:
        self.sizes: list[int] = []
        self.most = most
        self._pwrite = os.pwrite

    def __call__(self, fd: int, data: Any, offset: int) -> int:
        view = memoryview(data)
        self.sizes.append(len(view))
        if self.most is not None:
            view = view[: self.most]
        return self._pwrite(fd, view, offset)


def test_the_default_piece_is_a_fraction_of_a_chunk() -> None:
    assert 0 < SYSCALL_BYTES < CHUNK_BYTES and CHUNK_BYTES % SYSCALL_BYTES == 0


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096, 10_000])
def test_every_byte_is_written_in_pieces_of_at_most_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          nbytes: int) -> None:
    watch = Watch()
    monkeypatch.setattr(os, "pwrite", watch)
    data = os.urandom(nbytes)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 7)
        pwrite_all(fd, memoryview(data), 7, piece=4096)
        assert os.pread(fd, nbytes + 10, 7) == data
    finally:
        os.close(fd)
    assert sum(watch.sizes) == nbytes
    assert all(0 < n <= 4096 for n in watch.sizes)
    assert len(watch.sizes) == -(-nbytes // 4096)


def test_a_short_write_is_followed_by_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch(most=1000)
    monkeypatch.setattr(os, "pwrite", watch)
    data = os.urandom(9_999)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        pwrite_all(fd, memoryview(data), 0, piece=4096)
        assert os.pread(fd, 20_000, 0) == data
    finally:
        os.close(fd)
    assert len(watch.sizes) == 10 and max(watch.sizes) <= 4096


def test_the_spool_writes_a_chunk_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch()
    monkeypatch.setattr(os, "pwrite", watch)
    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=0, keep_bytes=0)
    job = b"j" * 16
    up = spool.open(job, "acme", None, (CHUNK_BYTES + 5,), now=0.0)
    data = os.urandom(CHUNK_BYTES + 5)
    assert spool.write(up, 0, 0, memoryview(data)[:CHUNK_BYTES], now=0.0)
    assert spool.write(up, 0, CHUNK_BYTES, memoryview(data)[CHUNK_BYTES:], now=0.0)
    spool.io.wait(up.ticket)
    assert spool.read(up, 0, 0, len(data)) == data
    spool.io.close()
    assert sum(watch.sizes) == len(data) and max(watch.sizes) == SYSCALL_BYTES


def test_a_job_thread_writes_a_fetched_chunk_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch()
    monkeypatch.setattr(os, "pwrite", watch)
    job = b"j" * 16
    fetch = Fetch(job, [CHUNK_BYTES], lambda: None)
    (ask,) = fetch.next_asks(0.0)[:1]
    data = os.urandom(CHUNK_BYTES)
    assert fetch.on_chunk(ask[0], ask[1], data[: ask[2]])
    fd = os.open(tmp_path / "input", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fetch.inputs()[0].copy_to(fd)
        assert os.pread(fd, CHUNK_BYTES + 1, 0) == data
    finally:
        os.close(fd)
    assert sum(watch.sizes) == CHUNK_BYTES and max(watch.sizes) == SYSCALL_BYTES


def test_read_capped_reads_to_the_end_or_says_it_is_more_than_the_cap(tmp_path: Path) -> None:
    """``read_capped``: the worker's outputs read into a RESULT, and the client's inputs from a
    file that says it is empty (procfs): all of it up to the cap, None past it, never more read."""
    f = tmp_path / "f"
    f.write_bytes(b"x" * (3 << 20) + b"end")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert read_capped(fd, (3 << 20) + 3) == b"x" * (3 << 20) + b"end"
        os.lseek(fd, 0, os.SEEK_SET)
        assert read_capped(fd, (3 << 20) + 2) is None
        assert os.lseek(fd, 0, os.SEEK_CUR) == (3 << 20) + 3  # it read one byte past the cap, no more
        os.lseek(fd, 0, os.SEEK_SET)
        assert read_capped(fd, 0) is None
    finally:
        os.close(fd)
