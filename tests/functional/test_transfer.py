"""Bulk data: chunked session copies and dtoh into a caller's buffer, with real daemons
(gpud_cli.cluster.LocalCluster: a broker and one simulated worker as subprocesses).

A small ``chunk_bytes`` (64 KiB) keeps the copies fast while still cutting them into many chunks;
sizes are chosen not to be multiples of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpud.errors import InvalidRequest
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from gpud_client.direct import DataLink
from gpud_client.journal import ENTRY_COST

CHUNK = 64 << 10
WINDOW = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, log_level="WARNING") as c:
        yield c


@pytest.fixture(params=["broker", "direct"])
def client(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client on each data path (PROTOCOL.md §10): relayed by the broker, and straight to the
    worker; ``Counter`` counts the CALLs on whichever the sessions use."""
    with Client(cluster.frontend, timeout=30, chunk_bytes=CHUNK, chunk_window=WINDOW, data_path=request.param) as c:
        yield c


class Counter:
    """Wraps ``submit`` of the broker connection and of every direct link: counts the CALLs sent
    and the most awaited at once."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.calls = 0
        self.most = 0
        conn_submit = client._conn.submit
        link_submit = DataLink.submit

        def submit(*a: Any, **kw: Any) -> None:
            conn_submit(*a, **kw)
            self.calls += 1
            self.most = max(self.most, client._conn._awaiting)

        def link(link: DataLink, *a: Any, **kw: Any) -> None:
            link_submit(link, *a, **kw)
            self.calls += 1
            self.most = max(self.most, link._awaiting)

        client._conn.submit = submit  # type: ignore[method-assign]
        self._restore = link_submit
        DataLink.submit = link  # type: ignore[method-assign]

    def __del__(self) -> None:
        DataLink.submit = self._restore  # type: ignore[method-assign]

    def reset(self) -> None:
        self.calls = self.most = 0


def test_chunked_round_trip_of_an_odd_size(client: Client) -> None:
    rng = np.random.default_rng(3)
    n = 5 * CHUNK + 12345  # 6 chunks, the last one short
    offset = 1000
    data = rng.integers(0, 256, n, np.uint8)
    counter = Counter(client)
    with client.session(mem=1 << 20) as s:
        p = s.mem_alloc(n + 2 * offset)
        s.memcpy_htod(p, np.zeros(n + 2 * offset, np.uint8))
        counter.reset()
        s.memcpy_htod(p, data, offset)
        assert counter.calls == 6 and counter.most == WINDOW

        # Into a numpy array, a bytearray and a memoryview: the bytes land in place.
        counter.reset()
        arr = np.full(n, 7, np.uint8)
        assert s.memcpy_dtoh(p, offset=offset, out=arr) is arr
        np.testing.assert_array_equal(arr, data)
        assert counter.calls == 6 and counter.most == WINDOW
        f32 = np.empty(n // 4, np.float32)  # another dtype: bytes are bytes
        s.memcpy_dtoh(p, offset=offset, out=f32)
        assert f32.tobytes() == data[: f32.nbytes].tobytes()
        ba = bytearray(n)
        assert s.memcpy_dtoh(p, offset=offset, out=ba) is ba
        assert ba == data.tobytes()
        big = bytearray(n + 10)
        s.memcpy_dtoh(p, offset=offset, out=memoryview(big)[5 : 5 + n])
        assert big[:5] == bytes(5) and big[5 : 5 + n] == data.tobytes() and big[-5:] == bytes(5)

        # Without out: bytes, the whole allocation, zeros around the copy.
        whole = s.memcpy_dtoh(p)
        assert type(whole) is bytes and len(whole) == n + 2 * offset
        assert whole[offset : offset + n] == data.tobytes()
        assert whole[:offset] == bytes(offset) and whole[offset + n :] == bytes(offset)

        # Exactly one chunk, and a small copy: one CALL each.
        counter.reset()
        s.memcpy_htod(p, data[:CHUNK])
        assert s.memcpy_dtoh(p, CHUNK) == data[:CHUNK].tobytes()
        assert counter.calls == 2
        small = bytearray(100)
        s.memcpy_dtoh(p, out=small)
        assert small == data[:100].tobytes()


def test_a_chunked_htod_is_journaled_once(client: Client) -> None:
    n = 3 * CHUNK + 1
    data = np.arange(n, dtype=np.uint8)
    with client.session(mem=1 << 20) as s:
        p = s.mem_alloc(n)
        s.memcpy_htod(p, data)
        entries = s.journal.entries()
        assert [e.op for e in entries] == ["alloc", "htod"]
        assert entries[1].data == data.tobytes() and entries[1].args == {"handle": p.handle, "offset": 0}
        assert s.journal.nbytes == 2 * ENTRY_COST + n


def test_out_is_checked(client: Client) -> None:
    with client.session(mem=1 << 20) as s:
        p = s.mem_alloc(4 * CHUNK)
        with pytest.raises(InvalidRequest, match="writable"):
            s.memcpy_dtoh(p, out=bytes(4 * CHUNK))
        with pytest.raises(InvalidRequest, match="nbytes"):
            s.memcpy_dtoh(p, 100, out=bytearray(200))
        with pytest.raises(InvalidRequest, match="do not fit"):
            s.memcpy_dtoh(p, out=bytearray(4 * CHUNK + 1))


@pytest.mark.parametrize("op", ["htod", "dtoh"])
def test_a_failed_chunk_fails_the_copy_and_the_session_goes_on(client: Client, op: str) -> None:
    size = 3 * CHUNK + 100  # chunks 0..2 fit, chunk 3 runs past the end, chunk 4 starts past it
    data = np.random.default_rng(5).integers(0, 256, size, np.uint8)
    n = 5 * CHUNK
    counter = Counter(client)
    with client.session(mem=1 << 20) as s:
        p = s.mem_alloc(size)
        s.memcpy_htod(p, data)
        # A plain handle is not range-checked by the client: the worker refuses chunk 3.
        counter.reset()
        out = np.zeros(n, np.uint8)
        with pytest.raises(InvalidRequest, match=f"range {3 * CHUNK}..{4 * CHUNK} is outside"):
            if op == "htod":
                s.memcpy_htod(p.handle, np.ones(n, np.uint8))
            else:
                s.memcpy_dtoh(p.handle, n, out=out)
        assert counter.calls == 5 and counter.most == WINDOW  # chunk 4 was sent, then abandoned
        assert not client._conn._table and client._conn._awaiting == 0 and client._conn._inflight == 0
        if op == "htod":  # the chunks before the failed one were written
            expect = np.concatenate([np.ones(3 * CHUNK, np.uint8), data[3 * CHUNK :]])
        else:  # and those read landed in out
            np.testing.assert_array_equal(out[: 3 * CHUNK], data[: 3 * CHUNK])
            assert not out[3 * CHUNK :].any()
            expect = data
        # The session goes on; the late reply of the abandoned chunk is dropped as stale.
        got = np.empty(size, np.uint8)
        s.memcpy_dtoh(p, out=got)
        np.testing.assert_array_equal(got, expect)
        assert s.device_info()["mem_used"] == size
