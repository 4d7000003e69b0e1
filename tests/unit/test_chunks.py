"""Bulk data helpers: the chunk planner and window (gpud_client.chunks), the journal's handling of
large copies, and the simulated device's copies (no temporaries of the copy's size)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from gpud.errors import ConfigError
from gpud.resources import GpuInfo
from gpud_client import Client
from gpud_client.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW, plan, run_windowed
from gpud_client.journal import ENTRY_COST, Journal
from gpud_worker.device import SimulatedDevice

# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize(
    ("nbytes", "chunk", "expect"),
    [
        (0, 4, [(0, 0)]),
        (1, 4, [(0, 1)]),
        (4, 4, [(0, 4)]),
        (5, 4, [(0, 4), (4, 1)]),
        (12, 4, [(0, 4), (4, 4), (8, 4)]),
        (13, 5, [(0, 5), (5, 5), (10, 3)]),
    ],
)
def test_plan(nbytes: int, chunk: int, expect: list[tuple[int, int]]) -> None:
    assert plan(nbytes, chunk) == expect


@pytest.mark.parametrize("nbytes", [1, 999, 1000, 1001, 65537, 3 * 4096 - 1])
def test_plan_covers_the_copy_once_in_order(nbytes: int) -> None:
    spans = plan(nbytes, 1000)
    assert spans[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))
    assert sum(n for _, n in spans) == nbytes
    assert all(0 < n <= 1000 for _, n in spans) and all(n == 1000 for _, n in spans[:-1])


@pytest.mark.parametrize(("nbytes", "chunk"), [(-1, 4), (4, 0), (4, -1), (1.5, 4), (4, 2.0)])
def test_plan_refuses_bad_values(nbytes: object, chunk: object) -> None:
    with pytest.raises(ValueError):
        plan(nbytes, chunk)  # type: ignore[arg-type]


def test_defaults() -> None:
    assert DEFAULT_CHUNK_BYTES == 8 << 20 and DEFAULT_CHUNK_WINDOW == 4


# --------------------------------------------------------------------------- window


class Tracker:
    def __init__(self, fail_at: int | None = None) -> None:
        self.outstanding: list[int] = []
        self.most = 0
        self.log: list[tuple[str, int]] = []
        self.fail_at = fail_at

    def submit(self, item: int) -> int:
        self.outstanding.append(item)
        self.most = max(self.most, len(self.outstanding))
        self.log.append(("submit", item))
        return item

    def collect(self, item: int) -> None:
        assert self.outstanding[0] == item  # oldest first
        self.outstanding.pop(0)
        self.log.append(("collect", item))
        if item == self.fail_at:
            raise RuntimeError(f"chunk {item} failed")

    def abandon(self, item: int) -> None:
        self.outstanding.remove(item)
        self.log.append(("abandon", item))


@pytest.mark.parametrize(("items", "window"), [(0, 1), (1, 4), (3, 4), (4, 4), (10, 4), (10, 1), (7, 3)])
def test_window_bound_and_order(items: int, window: int) -> None:
    t = Tracker()
    run_windowed(range(items), window, t.submit, t.collect, t.abandon)
    assert t.most == min(items, window)
    assert [i for what, i in t.log if what == "collect"] == list(range(items))
    assert not t.outstanding
    # Item k is submitted only after item k - window was collected.
    for k in range(window, items):
        assert t.log.index(("collect", k - window)) < t.log.index(("submit", k))


def test_first_failure_abandons_the_rest_and_submits_nothing_more() -> None:
    t = Tracker(fail_at=2)
    with pytest.raises(RuntimeError, match="chunk 2 failed"):
        run_windowed(range(10), 3, t.submit, t.collect, t.abandon)
    assert [i for what, i in t.log if what == "submit"] == [0, 1, 2, 3, 4]
    assert [i for what, i in t.log if what == "abandon"] == [3, 4]
    assert not t.outstanding


def test_a_failing_submit_abandons_what_is_outstanding() -> None:
    t = Tracker()

    def submit(item: int) -> int:
        if item == 2:
            raise OSError("send failed")
        return t.submit(item)

    with pytest.raises(OSError):
        run_windowed(range(5), 4, submit, t.collect, t.abandon)
    assert [i for what, i in t.log if what == "abandon"] == [0, 1]


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run_windowed([1], 0, lambda i: i, lambda i: None, lambda i: None)


@pytest.mark.parametrize("kw", [{"chunk_bytes": 0}, {"chunk_bytes": 1.5}, {"chunk_window": 0}, {"chunk_window": -2}])
def test_client_refuses_bad_chunking(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Client("tcp://127.0.0.1:1", **kw)  # type: ignore[arg-type]


def test_client_chunking_defaults_and_settings() -> None:
    with Client("tcp://127.0.0.1:1") as c:
        assert (c.chunk_bytes, c.chunk_window) == (DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW)
    with Client("tcp://127.0.0.1:1", chunk_bytes=1 << 16, chunk_window=2) as c:
        assert (c.chunk_bytes, c.chunk_window) == (1 << 16, 2)


# --------------------------------------------------------------------------- journal


def test_journal_copies_a_buffer_it_keeps_and_counts_it_once() -> None:
    j = Journal(1 << 20)
    j.alloc(1, 1000)
    buf = bytearray(b"a" * 1000)
    j.htod(1, 0, memoryview(buf))
    buf[:] = b"b" * 1000  # the caller reuses its buffer: the journal has its own copy
    (entry,) = [e for e in j.entries() if e.op == "htod"]
    assert type(entry.data) is bytes and entry.data == b"a" * 1000
    assert j.nbytes == 2 * ENTRY_COST + 1000
    arr = np.arange(10, dtype=np.float32)
    j.htod(1, 0, arr.data)
    assert j.entries()[-1].data == arr.tobytes()


def test_journal_overflows_on_a_copy_past_its_bound_without_copying_it() -> None:
    limit = 1 << 20
    j = Journal(limit)
    j.alloc(1, 64 << 20)
    big = memoryview(bytearray(64 << 20))
    tracemalloc.start()
    try:
        j.htod(1, 0, big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert not j.usable and j.overflowed and f"bound of {limit} bytes" in (j.reason or "")


# --------------------------------------------------------------------------- simulated device


def test_simulated_copies_make_no_temporary_of_the_copy_size() -> None:
    dev = SimulatedDevice(GpuInfo("SIM-t-0", 0, "sim", 1 << 30, (8, 0), simulated=True))
    s = dev.open_session(64 << 20)
    n = 16 << 20
    h = s.alloc(n)
    data = np.random.default_rng(0).integers(0, 256, n, np.uint8)
    tracemalloc.start()
    try:
        s.htod(h, 0, data.data)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = s.dtoh(h, 0, n)
        _, peak_dtoh = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # htod: straight into device memory
    assert peak_dtoh < n + (1 << 20)  # dtoh: the bytes returned, nothing more
    assert out == data.tobytes()
    s.close()
