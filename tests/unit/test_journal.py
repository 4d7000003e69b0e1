"""The session journal (gpud_client/journal.py): what it records, what it drops, its bound.

The strongest check replays a journal on a small reference device (numpy, the built-in kernels'
semantics of PROTOCOL.md §5.4, plus a kernel of an unknown module that reads and writes every
pointer it gets) and compares every open allocation with the device that ran the whole history.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gpud_client import journal as jmod
from gpud_client.journal import ENTRY_COST, Entry, Journal

F32 = np.float32


# --------------------------------------------------------------------------- a reference device


class Device:
    """Allocations as bytearrays; the kernels as in gpud_worker/kernels.py. Handles start at
    ``first`` so that a replay gets other handles than the original."""

    def __init__(self, first: int = 1) -> None:
        self.mem: dict[int, bytearray] = {}
        self.next = first
        self.used = self.peak = 0

    def f32(self, handle: int) -> np.ndarray:
        return np.frombuffer(self.mem[handle], dtype=F32)

    def alloc(self, nbytes: int) -> int:
        handle, self.next = self.next, self.next + 1
        self.mem[handle] = bytearray(nbytes)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return handle

    def free(self, handle: int) -> None:
        self.used -= len(self.mem.pop(handle))

    def htod(self, handle: int, offset: int, data: bytes) -> None:
        self.mem[handle][offset : offset + len(data)] = data

    def launch(self, module: str, name: str, args: list[list[Any]]) -> None:
        v: list[Any] = [self.f32(x) if t == "ptr" else x for t, x in args]
        if module == "mine" and name == "mix":  # reads and writes every pointer
            ptrs = [a for a in v if isinstance(a, np.ndarray)]
            size = min(len(p) for p in ptrs)
            tmp = [p[:size].copy() for p in ptrs]
            for i, p in enumerate(ptrs):
                p[:size] = tmp[i] * F32(0.5) + tmp[(i + 1) % len(ptrs)]
        elif name == "vector_add":
            n = max(v[3], 0)
            np.add(v[0][:n], v[1][:n], out=v[2][:n])
        elif name == "saxpy":
            n = max(v[3], 0)
            v[2][:n] = F32(v[0]) * v[1][:n] + v[2][:n]
        elif name == "sgemm":
            m, n, k = v[3], v[4], v[5]
            v[2][: m * n] = (v[0][: m * k].reshape(m, k) @ v[1][: k * n].reshape(k, n)).reshape(-1)
        elif name == "reduce_sum":
            v[1][0] = F32(np.sum(v[0][: v[2]], dtype=np.float64))
        else:
            raise AssertionError(f"unknown kernel {module}.{name}")


def replay(entries: list[Entry], device: Device) -> dict[int, int]:
    """Run the journal's entries on ``device``, as Session does; returns caller -> device handle."""
    handles: dict[int, int] = {}
    for e in entries:
        if e.op == "alloc":
            handles[e.handle] = device.alloc(e.args["nbytes"])
        elif e.op == "free":
            device.free(handles.pop(e.handle))
        elif e.op == "htod":
            device.htod(handles[e.args["handle"]], e.args["offset"], e.data)
        else:
            args = [["ptr", handles[x]] if t == "ptr" else [t, x] for t, x in e.args["args"]]
            device.launch(e.args["module"], e.args["name"], args)
    return handles


class Recorder:
    """Runs ops on a device and records them in a journal, as Session does (caller handle = the
    device's handle)."""

    def __init__(self, journal: Journal) -> None:
        self.j = journal
        self.dev = Device()

    def alloc(self, nbytes: int) -> int:
        h = self.dev.alloc(nbytes)
        self.j.alloc(h, nbytes)
        return h

    def free(self, h: int) -> None:
        self.dev.free(h)
        self.j.free(h)

    def htod(self, h: int, data: bytes, offset: int = 0) -> None:
        self.dev.htod(h, offset, data)
        self.j.htod(h, offset, data)

    def launch(self, name: str, *args: Any, module: str = "builtin") -> None:
        pairs = [list(a) if isinstance(a, tuple) else ["ptr", a] for a in args]
        self.dev.launch(module, name, pairs)
        self.j.launch(module, name, [1], [32], pairs, 0)

    def check_replay(self) -> tuple[Device, dict[int, int]]:
        """Replaying the journal rebuilds every open allocation, byte for byte; returns the fresh
        device and the caller's handles on it."""
        assert self.j.usable, self.j.reason
        fresh = Device(first=10_000)
        handles = replay(self.j.entries(), fresh)
        assert set(handles) == set(self.dev.mem) == set(self.j.live())
        for h, mem in self.dev.mem.items():
            assert fresh.mem[handles[h]] == mem, f"allocation {h} differs after replay"
        assert fresh.peak <= self.dev.peak  # replay never needs more memory than the original
        return fresh, handles


def floats(*values: float) -> bytes:
    return np.array(values, dtype=F32).tobytes()


def i32(n: int) -> tuple[str, int]:
    return ("i32", n)


# --------------------------------------------------------------------------- recording


def test_journal_off_records_nothing() -> None:
    j = Journal(0)
    j.alloc(1, 16)
    j.htod(1, 0, b"x" * 16)
    assert not j.usable and len(j) == 0 and j.entries() == [] and j.nbytes == 0
    assert j.reason is not None and "journal_bytes=0" in j.reason
    assert not j.overflowed
    with pytest.raises(ValueError):
        Journal(-1)


def test_records_state_changing_ops_in_order_with_their_bytes() -> None:
    r = Recorder(Journal(1 << 20))
    x = r.alloc(16)
    y = r.alloc(16)
    buf = bytearray(floats(1, 2, 3, 4))
    r.htod(x, bytes(buf))
    r.htod(y, floats(9), offset=4)
    r.launch("saxpy", ("f32", 2.0), x, y, i32(4))
    ops = [(e.op, e.handle) for e in r.j.entries()]
    assert ops == [("alloc", x), ("alloc", y), ("htod", x), ("htod", y), ("launch", 0)]
    launch = r.j.entries()[-1].args
    assert launch == {
        "module": "builtin",
        "name": "saxpy",
        "grid": [1],
        "block": [32],
        "args": [["f32", 2.0], ["ptr", x], ["ptr", y], ["i32", 4]],
        "shared_mem": 0,
    }
    assert r.j.entries()[2].data == floats(1, 2, 3, 4)
    assert r.j.entries()[3].args == {"handle": y, "offset": 4}
    assert r.j.nbytes == 5 * ENTRY_COST + 16 + 4
    assert r.j.live() == {x: 16, y: 16}
    r.check_replay()


def test_free_of_an_allocation_no_launch_used_drops_everything_about_it() -> None:
    r = Recorder(Journal(1 << 20))
    keep = r.alloc(8)
    r.htod(keep, floats(1, 2))
    before = r.j.entries()
    tmp = r.alloc(64)
    r.htod(tmp, bytes(64))
    r.htod(tmp, b"\x01" * 8, offset=8)
    r.free(tmp)
    assert r.j.entries() == before
    assert r.j.nbytes == 2 * ENTRY_COST + 8
    r.check_replay()


def test_allocate_use_free_loop_stays_bounded() -> None:
    r = Recorder(Journal(1 << 20))
    acc = r.alloc(64)
    r.htod(acc, bytes(64))
    lengths = []
    for i in range(500):
        x = r.alloc(64)
        y = r.alloc(64)
        r.htod(x, np.full(16, i, F32).tobytes())
        r.htod(y, np.full(16, 1, F32).tobytes())
        r.launch("vector_add", x, y, acc, i32(16))  # writes all of acc: what was there is dead
        r.free(x)
        r.free(y)
        lengths.append(len(r.j))
    assert max(lengths) <= 2 * jmod.MIN_COMPACT_ENTRIES + 8
    fresh, handles = r.check_replay()
    assert fresh.f32(handles[acc]).tolist() == [500.0] * 16  # acc = 499 + 1


def test_copy_launch_read_back_loop_stays_bounded() -> None:
    r = Recorder(Journal(1 << 20))
    a, b, out = r.alloc(32), r.alloc(32), r.alloc(32)
    for i in range(500):
        r.htod(a, np.full(8, i, F32).tobytes())
        r.htod(b, np.full(8, 2 * i, F32).tobytes())
        r.launch("vector_add", a, b, out, i32(8))
    assert len(r.j) <= 2 * jmod.MIN_COMPACT_ENTRIES + 8
    r.j.compact()
    assert [e.op for e in r.j.entries()] == ["alloc"] * 3 + ["htod", "htod", "launch"]
    r.check_replay()


def test_accumulating_launches_are_all_kept() -> None:
    r = Recorder(Journal(1 << 20))
    x, y = r.alloc(16), r.alloc(16)
    r.htod(y, bytes(16))
    for i in range(10):
        r.htod(x, np.full(4, i, F32).tobytes())
        r.launch("saxpy", ("f32", 1.0), x, y, i32(4))  # y += x: every step counts
    r.j.compact()
    assert [e.op for e in r.j.entries()].count("launch") == 10
    assert [e.op for e in r.j.entries()].count("htod") == 11
    fresh, handles = r.check_replay()
    assert fresh.f32(handles[y]).tolist() == [45.0] * 4


def test_free_keeps_an_input_that_a_kept_launch_read() -> None:
    r = Recorder(Journal(1 << 20))
    x, y = r.alloc(16), r.alloc(16)
    r.htod(x, floats(1, 2, 3, 4))
    r.launch("mix", x, y, module="mine")  # unknown kernel: reads and writes both
    r.free(x)
    r.j.compact()
    assert [e.op for e in r.j.entries()] == ["alloc", "alloc", "htod", "launch", "free"]
    r.check_replay()
    r.free(y)  # now nothing is open: nothing is needed
    r.j.compact()
    assert r.j.entries() == [] and r.j.nbytes == 0


def test_handles_may_be_reused_after_free() -> None:
    j = Journal(1 << 20)
    j.alloc(7, 16)
    j.htod(7, 0, b"a" * 16)
    j.alloc(8, 16)
    j.launch("mine", "mix", [1], [1], [["ptr", 7], ["ptr", 8]], 0)
    j.free(7)
    j.alloc(7, 32)  # the same handle, a new allocation
    j.htod(7, 0, b"b" * 32)
    j.compact()
    assert j.usable and j.live() == {8: 16, 7: 32}
    dev = Device()
    handles = replay(j.entries(), dev)
    assert dev.mem[handles[7]] == b"b" * 32
    assert [e.op for e in j.entries()].count("alloc") == 3


@pytest.mark.parametrize(
    "record",
    [
        lambda j: j.htod(99, 0, b"x"),
        lambda j: j.free(99),
        lambda j: j.launch("builtin", "reduce_sum", [1], [1], [["ptr", 1], ["ptr", 99]], 0),
        lambda j: j.alloc(1, 8),
    ],
)
def test_an_op_on_a_handle_the_journal_does_not_hold_makes_it_unusable(
    record: Callable[[Journal], None],
) -> None:
    j = Journal(1 << 20)
    j.alloc(1, 16)
    record(j)
    assert not j.usable and j.entries() == [] and not j.overflowed
    assert j.reason is not None and ("99" in j.reason or "twice" in j.reason)


def test_past_the_bound_the_journal_overflows_for_good() -> None:
    j = Journal(1000)
    j.alloc(1, 4096)
    j.htod(1, 0, bytes(100))
    assert j.usable and j.nbytes == 2 * ENTRY_COST + 100
    j.htod(1, 100, bytes(1000))
    assert j.overflowed and not j.usable and j.entries() == [] and j.nbytes == 0
    assert j.reason is not None and "1000 bytes" in j.reason
    j.alloc(2, 16)  # ignored from now on
    assert len(j) == 0 and not j.usable


def test_a_compaction_runs_before_the_journal_overflows() -> None:
    j = Journal(3 * (ENTRY_COST + 100))
    j.alloc(1, 100)
    for i in range(200):
        j.htod(1, 0, bytes([i % 256]) * 100)  # each copy of the whole buffer hides the last
    assert j.usable and not j.overflowed and len(j) <= 3
    assert j.entries()[-1].data == bytes([199]) * 100
    j.compact()
    assert [e.op for e in j.entries()] == ["alloc", "htod"]


def test_disable_drops_everything() -> None:
    j = Journal(1 << 20)
    j.alloc(1, 16)
    j.disable("the session is closed")
    assert not j.usable and j.reason == "the session is closed" and len(j) == 0
    j.disable("again")
    assert j.reason == "the session is closed"


# --------------------------------------------------------------------------- random histories


@pytest.mark.parametrize("seed", range(25))
def test_replay_of_a_random_history_rebuilds_every_open_allocation(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jmod, "MIN_COMPACT_ENTRIES", 4)  # compact often
    rng = random.Random(seed)
    r = Recorder(Journal(1 << 30))
    sizes = (16, 32, 64)

    def some() -> int:
        return rng.choice(sorted(r.dev.mem))

    for _ in range(300):
        live = len(r.dev.mem)
        roll = rng.random()
        if live < 2 or roll < 0.15:
            r.alloc(rng.choice(sizes))
        elif roll < 0.25:
            r.free(some())
        elif roll < 0.5:
            h = some()
            size = len(r.dev.mem[h]) // 4
            if rng.random() < 0.5:
                r.htod(h, np.array([rng.randint(-9, 9) for _ in range(size)], F32).tobytes())
            else:
                start = rng.randrange(size)
                count = rng.randint(1, size - start)
                r.htod(h, np.full(count, rng.randint(-9, 9), F32).tobytes(), offset=4 * start)
        else:
            a, b, c = some(), some(), some()
            small = min(len(r.dev.mem[x]) for x in (a, b, c)) // 4
            n = rng.choice([small, rng.randint(0, small), len(r.dev.mem[c]) // 4])
            n = min(n, small)
            kind = rng.randrange(5)
            if kind == 0:
                r.launch("vector_add", a, b, c, i32(n))
            elif kind == 1:
                r.launch("saxpy", ("f32", 0.5), a, b, i32(n))
            elif kind == 2:
                m = rng.choice([1, 2])
                r.launch("sgemm", a, b, c, i32(m), i32(2), i32(2))
            elif kind == 3:
                r.launch("reduce_sum", a, c, i32(n))
            else:
                r.launch("mix", a, b, module="mine")
        if rng.random() < 0.05:
            r.j.compact()
    r.check_replay()
    r.j.compact()
    r.check_replay()
