"""The broker's spool (gpud_broker.spool) and the worker's fetch of staged inputs
(gpud_worker.fetch): pure state, real files under tmp_path."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest

from gpud.errors import InvalidRequest
from gpud_broker.spool import Spool
from gpud_worker.fetch import Fetch, FetchAbandoned

JOB = b"j" * 16


def test_small_files_stay_in_memory_and_large_ones_go_to_disk(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "spool"), ram_bytes=900, ram_file_bytes=600, keep_bytes=0)  # none kept: removed
    up = spool.open(JOB, "acme", None, (500, 700, 500, 10), now=0.0)
    # 500 fits in memory; 700 is over the per-file size; the second 500 would pass the memory total.
    assert spool.ram_used == 500 + 10
    on_disk = sorted(os.listdir(tmp_path / "spool"))
    assert on_disk == [f"{JOB.hex()}-1", f"{JOB.hex()}-2"]
    assert (tmp_path / "spool").stat().st_mode & 0o777 == 0o700
    for i, size in enumerate(up.sizes):
        assert spool.write(up, i, 0, memoryview(bytes([i]) * size), now=1.0)
    assert up.complete() and up.missing() is None
    assert spool.read(up, 1, 690, 10) == b"\x01" * 10
    assert spool.read(up, 0, 0, 3) == b"\x00" * 3
    dropped = spool.drop(JOB)
    assert dropped is up
    spool.wait_removed()  # large files are removed on a thread of their own, never in the loop
    assert os.listdir(tmp_path / "spool") == []
    assert (spool.ram_used, spool.reserved, spool.stored, len(spool)) == (0, 0, 0, 0)


def test_an_ended_uploads_file_is_written_over_by_the_next_and_its_old_bytes_never_read(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=0, keep_bytes=1000)
    a = spool.open(b"a" * 16, "acme", None, (800,), now=0.0)
    assert spool.write(a, 0, 0, memoryview(b"A" * 800), now=0.0)
    spool.io.wait(a.ticket)
    inode = os.stat(tmp_path / f"{(b'a' * 16).hex()}-0").st_ino
    spool.drop(b"a" * 16)
    assert os.listdir(tmp_path) == ["kept-1"] and spool.kept_bytes == 800
    assert os.stat(tmp_path / "kept-1").st_ino == inode
    # Another tenant's upload, smaller, takes the kept file: the same inode (its cached pages).
    b = spool.open(b"b" * 16, "other", None, (500,), now=1.0)
    path = tmp_path / f"{(b'b' * 16).hex()}-0"
    assert os.listdir(tmp_path) == [path.name] and os.stat(path).st_ino == inode and spool.kept_bytes == 0
    assert spool.write(b, 0, 0, memoryview(b"B" * 100), now=1.0)
    assert spool.read(b, 0, 0, 100) == b"B" * 100  # its own bytes, read after its write
    for offset, nbytes in ((100, 1), (0, 101), (99, 2), (400, 100)):
        with pytest.raises(InvalidRequest, match="not held"):  # "A"s of the first upload lie there
            spool.read(b, 0, offset, nbytes)
    got: list[object] = []
    with pytest.raises(InvalidRequest, match="not held"):
        spool.read_soon(b, 0, 0, 200, got.append)
    spool.drop(b"b" * 16)
    spool.io.stop()
    assert os.listdir(tmp_path) == ["kept-2"] and spool.kept_bytes == 800  # still bounded by its longest use
    spool.close()
    spool.wait_removed()
    assert os.listdir(tmp_path) == []  # kept files go with the broker


def test_kept_files_stay_under_keep_bytes(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0, keep_bytes=1000)
    ups = [spool.open(bytes([i]) * 16, "acme", None, (600,), now=0.0) for i in range(3)]
    big = spool.open(b"z" * 16, "acme", None, (5000,), now=0.0)
    for up in (*ups, big):
        spool.write(up, 0, 0, memoryview(b"x" * up.sizes[0]), now=0.0)
    spool.drop(big.job)  # longer than keep_bytes: removed
    for up in ups:
        spool.drop(up.job)  # the first fits; the next two would pass 1000
    spool.wait_removed()
    assert os.listdir(tmp_path) == ["kept-1"] and spool.kept_bytes == 600
    # A new upload takes it, the next makes a file of its own.
    c = spool.open(b"c" * 16, "acme", None, (600,), now=1.0)
    d = spool.open(b"d" * 16, "acme", None, (600,), now=1.0)
    assert sorted(os.listdir(tmp_path)) == sorted([f"{c.job.hex()}-0", f"{d.job.hex()}-0"])
    assert spool.kept_bytes == 0
    spool.close()


def test_chunks_must_come_in_order_and_a_resend_is_not_written_twice(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0)
    up = spool.open(JOB, "acme", None, (10,), now=0.0)
    assert spool.write(up, 0, 0, memoryview(b"abcd"), now=0.0)
    with pytest.raises(InvalidRequest, match="leaves a gap"):
        spool.write(up, 0, 6, memoryview(b"gh"), now=0.0)
    assert not spool.write(up, 0, 0, memoryview(b"abcd"), now=0.0)  # held already
    assert spool.write(up, 0, 2, memoryview(b"cdef"), now=0.0)  # overlaps: only "ef" is new
    assert up.have == [6] and spool.stored == 6
    with pytest.raises(InvalidRequest, match="runs to byte 11"):
        spool.write(up, 0, 6, memoryview(b"ghijk"), now=0.0)
    with pytest.raises(InvalidRequest, match="not held"):
        spool.read(up, 0, 4, 4)
    assert up.missing() == "staged file 0 has 6 of its 10 bytes"
    assert spool.read(up, 0, 0, 6) == b"abcdef"


def test_a_replica_takes_chunks_out_of_order_and_closes_the_gap(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0)
    up = spool.open(JOB, "acme", None, (12,), now=0.0)
    assert spool.write(up, 0, 8, memoryview(b"ijkl"), now=0.0, ordered=False)
    assert spool.write(up, 0, 4, memoryview(b"efgh"), now=0.0, ordered=False)
    assert up.have == [0] and not up.complete()
    assert spool.write(up, 0, 0, memoryview(b"abcd"), now=0.0, ordered=False)
    assert up.have == [12] and up.complete() and not up.ahead
    assert spool.read(up, 0, 0, 12) == b"abcdefghijkl"
    assert spool.stored == 12


def test_unclaimed_uploads_expire_and_leftovers_of_an_earlier_run_are_removed(tmp_path: Path) -> None:
    (tmp_path / "old-0").write_bytes(b"x")
    spool = Spool(str(tmp_path))
    assert os.listdir(tmp_path) == []
    a = spool.open(b"a" * 16, "acme", None, (1,), now=0.0)
    b = spool.open(b"b" * 16, "acme", None, (1,), now=0.0)
    b.claimed = True
    spool.write(a, 0, 0, memoryview(b"1"), now=5.0)
    assert spool.expired(64.0, 60.0) == []
    assert spool.expired(65.5, 60.0) == [a]  # b is held by its job: released with it, never expired


def test_a_spool_without_a_directory_makes_one_only_when_needed_and_removes_it(tmp_path: Path) -> None:
    spool = Spool("", ram_bytes=100, ram_file_bytes=100)
    spool.open(b"a" * 16, "acme", None, (50,), now=0.0)
    assert spool.directory == ""
    spool.open(b"b" * 16, "acme", None, (500,), now=0.0)
    made = spool.directory
    assert made and os.path.isdir(made)
    spool.close()
    assert not os.path.exists(made) and len(spool) == 0


def test_a_spool_nobody_closes_still_removes_its_own_directory() -> None:
    """A core dropped without ``close`` (a test's, or a broker leaving on an exception) must not
    leave its temporary directory and the files in it behind in /tmp."""
    spool = Spool("", ram_bytes=100, ram_file_bytes=100)
    spool.open(b"c" * 16, "acme", None, (500,), now=0.0)
    spool.io.close()  # its thread holds no reference to the spool; only ours is left
    made = spool.directory
    assert made and os.path.isdir(made)
    del spool
    gc.collect()
    assert not os.path.exists(made)


def test_fetch_keeps_a_window_asks_again_and_drops_what_it_did_not_ask_for(tmp_path: Path) -> None:
    written: list[int] = []
    f = Fetch(JOB, [10, 0, 5], lambda: written.append(1), chunk=4, window=2)
    assert f.next_asks(0.0) == [(0, 0, 4), (0, 4, 4)]
    assert f.next_asks(0.0) == []  # the window is full
    assert not f.on_chunk(0, 8, b"xx")  # not asked for
    assert not f.on_chunk(0, 0, b"abc")  # wrong size: dropped (asked again later)
    assert f.on_chunk(0, 4, b"efgh")
    assert not f.on_chunk(0, 4, b"efgh")  # a repeat
    assert f.next_asks(1.0) == []  # taken, not written yet: it still counts against the window
    assert f.busy == 1
    assert f.again(2.0, older_than=0.5) == [(0, 0, 4)]  # only the old one
    assert f.on_chunk(0, 0, b"abcd")
    outs = [tmp_path / name for name in ("a", "b", "c")]
    inputs = f.inputs()
    # The job's thread writes file 0 as its chunks come; the loop asks for more as it does.
    got: list[Exception] = []

    def job_thread() -> None:
        try:
            for staged, out in zip(inputs, outs, strict=True):
                with open(out, "wb") as dst:
                    staged.copy_to(dst.fileno())
        except Exception as exc:
            got.append(exc)

    t = threading.Thread(target=job_thread)
    t.start()
    deadline = 50
    while f.busy and deadline:
        t.join(0.05)
        deadline -= 1
    assert f.busy == 0 and len(written) == 2
    assert f.next_asks(4.0) == [(0, 8, 2), (2, 0, 4)]  # the empty file needs nothing
    assert f.on_chunk(2, 0, b"1234")  # a later file's chunk first: kept until its file is written
    assert f.on_chunk(0, 8, b"ij")
    assert f.next_asks(5.0) in ([(2, 4, 1)], [])
    while not f.done():
        for index, offset, n in f.next_asks(6.0):
            assert (index, offset, n) == (2, 4, 1)
            assert f.on_chunk(2, 4, b"5")
        t.join(0.01)
    t.join(5)
    assert not t.is_alive() and got == []
    assert [o.read_bytes() for o in outs] == [b"abcdefghij", b"", b"12345"]
    assert f.total == 15


def test_an_abandoned_fetch_ends_the_job_thread_waiting_for_its_chunks(tmp_path: Path) -> None:

    f = Fetch(JOB, [8], lambda: None, chunk=4, window=2)
    f.next_asks(0.0)
    assert f.on_chunk(0, 0, b"abcd")
    got: list[BaseException] = []

    def job_thread() -> None:
        with open(tmp_path / "a", "wb") as dst:
            try:
                f.inputs()[0].copy_to(dst.fileno())
            except FetchAbandoned as exc:
                got.append(exc)

    t = threading.Thread(target=job_thread)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # it waits for the second chunk
    f.abandon()
    t.join(5)
    assert not t.is_alive() and len(got) == 1
    assert (tmp_path / "a").read_bytes() == b"abcd"


def test_chunks_are_read_from_memory_once_and_let_go_once_on_disk_and_read(tmp_path: Path) -> None:
    n = 12
    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=100 * n)
    spool.hold_min_bytes = 1  # small chunks here, as if large
    up = spool.open(JOB, "acme", None, ((n + 1) * 100,), now=0.0)
    chunks = [bytes([65 + i]) * 100 for i in range(n + 1)]
    for i, chunk in enumerate(chunks[:n]):
        assert spool.write(up, 0, i * 100, memoryview(chunk), now=0.0)
    assert up.ticket == spool.io.issued == n and spool.held_bytes == n * 100
    # Read at once, written or not, from the chunk's own buffer (no disk, no wait).
    assert bytes(spool.read_soon(up, 0, 0, 100, _no_delivery)) == chunks[0]
    assert bytes(spool.read_soon(up, 0, 100, 100, _no_delivery)) == chunks[1]
    spool.io.wait(up.ticket)
    assert spool.written(up)
    spool.take_reads()  # on disk now: the two read are let go, the others kept until read
    assert spool.held_bytes == (n - 2) * 100
    assert bytes(spool.read_soon(up, 0, 200, 100, _no_delivery)) == chunks[2]  # on disk and read: let go at once
    assert spool.held_bytes == (n - 3) * 100
    assert not spool.write(up, 0, 0, memoryview(chunks[0]), now=0.0)  # a re-send: nothing stored
    assert spool.write(up, 0, n * 100, memoryview(chunks[n]), now=0.0)
    # Past hold_bytes, the oldest chunks on disk are let go, read or not; one not written yet is kept.
    assert spool.held_bytes == (n - 2) * 100  # the 9 unread and the new one
    spool.hold_bytes = 300
    spool.io.wait(up.ticket)
    spool.trim()
    assert spool.held_bytes == 300
    # A range no held chunk covers is read by the disk thread and delivered in the loop's turn.
    got: list[bytes | OSError] = []
    assert spool.read_soon(up, 0, 50, 100, got.append) is None
    spool.io.stop()
    assert got == []  # not before the loop takes them
    spool.take_reads()
    assert got == [chunks[0][50:] + chunks[1][:50]]
    with open(tmp_path / f"{JOB.hex()}-0", "rb") as f:
        assert f.read() == b"".join(chunks)
    spool.close()


def test_a_read_queued_behind_a_write_reads_what_it_wrote_and_none_waits(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=0)
    up = spool.open(JOB, "acme", None, (400,), now=0.0)
    for i in range(4):
        spool.write(up, 0, i * 100, memoryview(bytes([48 + i]) * 100), now=0.0)
    assert spool.held_bytes == 0  # chunks under hold_min_bytes are not held: read from the disk
    got: list[bytes | OSError] = []
    # 150 bytes from offset 50: no one chunk covers it, and it may not be on disk yet.
    assert spool.read_soon(up, 0, 50, 150, got.append) is None
    spool.io.stop()
    spool.take_reads()
    assert got == [b"0" * 50 + b"1" * 100]
    spool.close()


def test_the_disk_thread_tells_the_loop_of_a_batch_of_writes_once_and_of_the_last_write_too(tmp_path: Path) -> None:
    import select
    import time

    from gpud_broker.spool import SIGNAL_EVERY_WRITES

    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=0)
    n = 2 * SIGNAL_EVERY_WRITES + 4
    up = spool.open(JOB, "acme", None, (n * 100,), now=0.0)
    io = spool.io
    fd = io.fd  # the loop's poller has it before any write
    started = io._start
    io._start = lambda: None  # type: ignore[method-assign]  # all the writes queue before the thread runs: a batch
    for i in range(n):
        spool.write(up, 0, i * 100, memoryview(b"x" * 100), now=0.0)
    io._start = started  # type: ignore[method-assign]
    io._start()
    io.wait(up.ticket)
    signals = 0
    deadline = time.monotonic() + 5.0
    while signals < 3 and time.monotonic() < deadline:  # every 8 writes while behind, then once caught up
        if select.select([fd], [], [], 0.1)[0]:
            signals += os.eventfd_read(fd)
    time.sleep(0.1)
    if select.select([fd], [], [], 0)[0]:
        signals += os.eventfd_read(fd)
    assert io.done == n
    assert signals == 3  # not one per write (20), and the last writes are not left untold (2)
    spool.close()


def _no_delivery(got: bytes | OSError) -> None:
    raise AssertionError(f"a read from memory was delivered later: {got!r}")


def test_a_write_that_fails_is_reported_with_its_upload(tmp_path: Path) -> None:
    import resource
    import signal

    spool = Spool(str(tmp_path), ram_bytes=0)
    up = spool.open(JOB, "acme", None, (3 << 20,), now=0.0)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old[1]))  # a write past 1 MiB fails (EFBIG), as on a full disk
    try:
        spool.write(up, 0, 0, memoryview(b"x" * (2 << 20)), now=0.0)
        spool.io.wait(up.ticket)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    ((job, exc),) = spool.io.failed
    assert job == JOB and isinstance(exc, OSError)  # so the broker knows whose write it was
    spool.close()


def test_the_spool_disk_thread_runs_at_a_lower_priority_than_the_loop(tmp_path: Path) -> None:
    from gpud_broker.spool import IO_NICE

    spool = Spool(str(tmp_path), ram_bytes=0)
    up = spool.open(JOB, "acme", None, (10,), now=0.0)
    spool.write(up, 0, 0, memoryview(b"x" * 10), now=0.0)
    spool.io.wait(up.ticket)
    thread = spool.io._thread
    assert thread is not None and thread.native_id is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(19, mine + IO_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's thread is not changed
    spool.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may make a thread less nice again")
def test_a_job_thread_writes_fetched_inputs_nicer_and_is_as_nice_as_before_after(tmp_path: Path) -> None:
    from gpud_worker.fetch import WRITE_NICE

    seen: list[int] = []
    f = Fetch(JOB, [4], lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
              chunk=4, window=1)
    f.next_asks(0.0)
    assert f.on_chunk(0, 0, b"abcd")
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with open(tmp_path / "a", "wb") as out:
        f.inputs()[0].copy_to(out.fileno())
    assert seen == [min(19, before + WRITE_NICE)]  # while it wrote (the job's own process is started later)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    assert (tmp_path / "a").read_bytes() == b"abcd"


def test_tiny_chunks_are_not_held_in_memory_so_a_flood_of_them_keeps_no_entry_each(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), ram_bytes=0)
    up = spool.open(JOB, "acme", None, (10_000,), now=0.0)
    for i in range(10_000):
        spool.write(up, 0, i, memoryview(b"x"), now=0.0)
    assert spool.held_bytes == 0 and not spool._held  # under hold_min_bytes: read from the disk when asked
    spool.io.stop()
    assert spool.read(up, 0, 9_990, 10) == b"x" * 10
    spool.close()


def test_the_backlog_counts_bytes_queued_and_not_written_and_waiters_are_woken(tmp_path: Path) -> None:
    """The loop and the disk thread each keep their own count (no lock between a thread 10 nicer
    and the loop): the backlog is what is queued and not written, and every thread waiting for
    a ticket is woken once its write is done, whether it began waiting before or after."""
    spool = Spool(str(tmp_path), ram_bytes=0, hold_bytes=0)
    up = spool.open(JOB, "acme", None, (40 * 1000,), now=0.0)
    io = spool.io
    started = io._start
    io._start = lambda: None  # type: ignore[method-assign]  # the writes queue before the thread runs
    tickets = []
    for i in range(40):
        spool.write(up, 0, i * 1000, memoryview(b"y" * 1000), now=0.0)
        tickets.append(up.ticket)
    assert io.backlog == 40 * 1000 and io.done == 0
    woken: list[int] = []
    waiters = [threading.Thread(target=lambda t=t: (io.wait(t), woken.append(t))) for t in tickets[::8]]
    for w in waiters:
        w.start()
    io._start = started  # type: ignore[method-assign]
    io._start()
    io.wait(tickets[-1])
    for w in waiters:
        w.join(timeout=10)
    assert sorted(woken) == tickets[::8]
    assert io.backlog == 0 and io.done == io.issued == tickets[-1]
    late = threading.Thread(target=lambda: (io.wait(tickets[3]), woken.append(-1)))  # done already: returns at once
    late.start()
    late.join(timeout=10)
    assert woken[-1] == -1
    with open(tmp_path / f"{JOB.hex()}-0", "rb") as f:
        assert f.read() == b"y" * 40 * 1000
    spool.close()


def test_an_upload_is_refused_at_its_opening_when_the_spool_disk_cannot_take_it(small_fs: Path) -> None:
    spool = Spool(str(small_fs), ram_bytes=0, keep_bytes=0)  # 64 MiB, less 16 of headroom: 48 to stage
    assert "room for" in (spool.no_room((50 << 20,)) or "")
    assert spool.no_room((40 << 20,)) is None
    up = spool.open(JOB, "acme", None, (40 << 20,), now=0.0)
    # Nothing of it is written yet, and the 40 MiB it will write are counted: 8 MiB left.
    assert spool.no_room((8 << 20,)) is None
    assert "room for" in (spool.no_room((9 << 20,)) or "")
    assert spool.no_room((9 << 20,)) is not None
    for offset in range(0, 40 << 20, 1 << 20):
        assert spool.write(up, 0, offset, memoryview(b"x" * (1 << 20)), now=0.0)
    spool.io.wait(up.ticket)
    assert spool.io.failed == []  # what it accepted fits: every byte written
    assert spool.read(up, 0, (40 << 20) - 3, 3) == b"xxx"
    assert "room for" in (spool.no_room((9 << 20,)) or "")  # on disk now, counted by the file system
    spool.drop(JOB)
    spool.wait_removed()
    assert spool.no_room((40 << 20,)) is None
    # Files that go to memory need no disk.
    assert Spool(str(small_fs), ram_bytes=1 << 20).no_room((1 << 20,)) is None
    spool.close()


def test_files_kept_for_reuse_are_removed_when_a_new_upload_needs_their_room(small_fs: Path) -> None:
    spool = Spool(str(small_fs), ram_bytes=0, hold_bytes=0, keep_bytes=1 << 30)
    a = spool.open(b"a" * 16, "acme", None, (40 << 20,), now=0.0)
    for offset in range(0, 40 << 20, 1 << 20):
        spool.write(a, 0, offset, memoryview(b"a" * (1 << 20)), now=0.0)
    spool.io.wait(a.ticket)
    spool.drop(b"a" * 16)
    assert os.listdir(small_fs) == ["kept-1"] and spool.kept_bytes == 40 << 20
    assert spool.no_room((1 << 20,)) is None and os.listdir(small_fs) == ["kept-1"]  # room enough without
    # 24 MiB free, 8 past the headroom: the kept file goes to make room for 40.
    assert spool.no_room((40 << 20,)) is None
    assert spool.kept_bytes == 0
    b = spool.open(b"b" * 16, "other", None, (40 << 20,), now=1.0)
    for offset in range(0, 40 << 20, 1 << 20):
        spool.write(b, 0, offset, memoryview(b"b" * (1 << 20)), now=1.0)
    spool.io.wait(b.ticket)
    assert spool.io.failed == [] and spool.read(b, 0, 0, 2) == b"bb"
    assert os.listdir(small_fs) == [f"{(b'b' * 16).hex()}-0"]
    # And where even they would not make room, BUSY's reason, and the kept files stay.
    spool.drop(b"b" * 16)
    assert "room for" in (spool.no_room((60 << 20,)) or "") and spool.kept_bytes == 40 << 20
    spool.close()
