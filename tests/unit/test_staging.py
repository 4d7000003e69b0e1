"""Staged job inputs on the broker (PROTOCOL.md §11), driven through BrokerCore: the PUT dialog,
the claim by the job's REQUEST, FETCH and CHUNK with its worker, budgets and limits, expiry, and
the replication of the spool to a passive peer (real Pair shells over inproc, a FakeClock)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.errors import ShuttingDown
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message
from gpud.transfer import CHUNK_BYTES, WINDOW
from gpud_broker.accounts import Budgets
from gpud_broker.tasks import State as TaskState
from tests.unit.test_broker_core import C1, C2, W1, W2, Harness, MiB, rid
from tests.unit.test_pair_clock import EXPIRY, Side, settle

JOB = rid(77)
DATA = [bytes(range(256)) * 40, b"", b"tail-bytes" * 3]  # 10240, 0 and 30 bytes


def put(h: Harness, n: int, job: bytes = JOB, tenant: str = "acme", frames: tuple[Any, ...] = (), ident: bytes = C1,
        **fields: Any) -> None:
    h.client(ident, Command.PUT, {"id": rid(1000 + n), "job": job, "tenant": tenant, **fields}, frames)


def replies(h: Harness) -> list[Message]:
    return [m for _, m, _ in h.take_client()]


def stage_all(h: Harness, chunk: int = 4096, job: bytes = JOB, tenant: str = "acme") -> None:
    put(h, 0, job=job, tenant=tenant, sizes=[len(d) for d in DATA])
    n = 1
    for i, data in enumerate(DATA):
        for start in range(0, len(data), chunk):
            put(h, n, job=job, tenant=tenant, file=i, offset=start, frames=(data[start : start + chunk],))
            n += 1


def loop_turn(h: Harness) -> None:
    """What the broker's loop does once the spool's disk thread has done what it was handed
    (writes, reads): reads are answered, PUT REPLYs and pulls go on."""
    h.core.staging.spool.io.stop()  # every write and read queued is done (the thread starts again when needed)
    h.core.staging.after_io(h.core)
    h.to_client.extend(h.core.staging.take_replies(h.core.journal.durable))
    h.core.staging.settle_pulls(h.core, h.core.journal.durable)


def staged_job(h: Harness, ident: bytes = C1, job: bytes = JOB, tenant: str = "acme") -> None:
    h.request(ident, job, kind="job", argv=["cat"], files=["a", "b", "c"], staged=[len(d) for d in DATA],
              need={"gpu_milli": 100, "tenant": tenant})


def fetch_all(h: Harness, ident: bytes = W1, job: bytes = JOB, chunk: int = 3000) -> list[bytes]:
    out = []
    for i, data in enumerate(DATA):
        got = b""
        while len(got) < len(data):
            h.worker(ident, Command.FETCH, {"id": job, "file": i, "offset": len(got), "nbytes": chunk})
            (_, msg, _), = h.take_worker()
            assert msg.command is Command.CHUNK and msg.header["offset"] == len(got), msg
            got += P.as_bytes(msg.frames[0])
        out.append(got)
    return out


def placed_with_its_first_chunk(incarnation: bytes = b"", **config: Any) -> Harness:
    """A core (``config``) with one worker, W1 (of ``incarnation``, when given), which JOB is
    placed on while its upload has sent only its first chunk (pipelined)."""
    h = Harness(heartbeat=HeartbeatPolicy(30.0, 3), **config)
    h.ready(W1, "w1", **({"incarnation": incarnation} if incarnation else {}))
    h.take_worker()
    put(h, 0, sizes=[len(d) for d in DATA])
    put(h, 1, file=0, offset=0, frames=(DATA[0][:4096],))
    staged_job(h)
    replies(h)
    h.one_dispatch(W1)
    return h


def test_a_staged_job_runs_from_the_spool_and_its_bytes_are_released_with_it() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    stage_all(h)
    answers = replies(h)
    assert all(m.header["ok"] is True for m in answers) and len(answers) == 5
    assert answers[0].header["have"] == [0, 0, 0]
    assert h.core.accounts.spooled == {"acme": 10270}
    staged_job(h)
    d = h.one_dispatch(W1)
    assert d.header["staged"] == [10240, 0, 30] and d.frames == []
    assert fetch_all(h) == DATA
    h.result(W1, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled == {} and h.core.accounts.spooled_bytes == 0
    h.assert_idle()


def test_too_large_comes_at_the_opening_put_naming_the_limit() -> None:
    h = Harness(max_job_input_bytes=10 * MiB)
    put(h, 0, sizes=[6 * MiB, 5 * MiB])
    (m,) = replies(h)
    assert m.header["code"] == "TOO_LARGE" and "max_job_input_bytes (10485760)" in m.header["message"]
    assert len(h.core.staging.spool) == 0
    h.request(C1, rid(5), kind="echo", frames=[b"x" * (17 * MiB)])
    m = h.one_reply(C1)
    assert m.header["code"] == "TOO_LARGE" and "max_echo_bytes (65536)" in m.header["message"]


def test_a_job_is_placed_while_its_upload_still_comes_and_its_fetches_wait_for_the_bytes() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    put(h, 0, sizes=[len(d) for d in DATA])
    put(h, 1, file=0, offset=0, frames=(DATA[0][:4096],))
    replies(h)
    staged_job(h)  # pipelined: the REQUEST right after the opening PUT (PROTOCOL.md §11.1)
    assert h.take_client() == []  # accepted, not refused
    d = h.one_dispatch(W1)
    assert d.header["staged"] == [10240, 0, 30]
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 4096})
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})  # asked again: waits once
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 2, "offset": 0, "nbytes": 4096})
    (_, first, _), = h.take_worker()
    assert first.command is Command.CHUNK and P.as_bytes(first.frames[0]) == DATA[0][:4096]
    put(h, 2, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    (_, second, _), = h.take_worker()  # the waiting FETCH, answered by the PUT that brought its bytes
    assert second.header == {"id": JOB, "file": 0, "offset": 4096} and P.as_bytes(second.frames[0]) == DATA[0][4096:8192]
    put(h, 3, file=0, offset=8192, frames=(DATA[0][8192:],))
    assert h.take_worker() == []  # nobody asked for these yet
    put(h, 4, file=2, offset=0, frames=(DATA[2],))
    (_, third, _), = h.take_worker()
    assert third.header["file"] == 2 and P.as_bytes(third.frames[0]) == DATA[2]  # clipped to the file's size
    assert all(m.header["ok"] is True for m in replies(h))
    h.result(W1, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled == {}
    h.assert_idle()
    h.request(C1, rid(9), kind="job", argv=["cat"], files=["a"], staged=[5], need={"tenant": "acme"})
    assert "open their upload first" in h.one_reply(C1).header["message"]


def test_a_placed_jobs_upload_runs_at_most_lead_bytes_ahead_of_its_worker_and_holds_no_one_else() -> None:
    h = Harness(heartbeat=HeartbeatPolicy(30.0, 3))
    h.ready(W1, "w1")
    h.take_worker()
    h.core.staging.lead_bytes = 2048
    put(h, 0, sizes=[len(d) for d in DATA])
    staged_job(h)
    h.one_dispatch(W1)
    replies(h)
    put(h, 1, file=0, offset=0, frames=(DATA[0][:2048],))  # 2048 ahead of a worker that asked for nothing: answered
    put(h, 2, file=0, offset=2048, frames=(DATA[0][2048:4096],))  # 4096 ahead: stored, its REPLY held
    assert [m.header["id"] for m in replies(h)] == [rid(1001)]
    other = rid(78)  # another upload (not placed) is answered meanwhile
    put(h, 10, job=other, sizes=[4096])
    put(h, 11, job=other, file=0, offset=0, frames=(b"o" * 4096,))
    assert [m.header["id"] for m in replies(h)] == [rid(1010), rid(1011)]
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 1024})
    assert P.as_bytes(h.take_worker()[0][1].frames[0]) == DATA[0][:1024]
    assert replies(h) == []  # the worker asked up to byte 1024: still 3072 behind
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 1024, "nbytes": 1024})
    assert P.as_bytes(h.take_worker()[0][1].frames[0]) == DATA[0][1024:2048]
    assert [m.header["id"] for m in replies(h)] == [rid(1002)]  # within 2048 again: let go
    put(h, 3, file=0, offset=4096, frames=(DATA[0][4096:8192],))  # 6144 ahead of 2048: held again
    assert replies(h) == []
    h.worker(W1, Command.DISCONNECT, {})  # the job leaves its worker: held REPLYs go by the next tick
    h.tick(1.0)
    assert [m.header["id"] for m in replies(h)] == [rid(1003)]
    assert h.core.staging.spool.uploads[JOB].held == []


def test_a_stalled_upload_fails_its_job_and_its_worker_is_told_to_drop_it() -> None:
    h = placed_with_its_first_chunk(stage_ttl=10.0)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    assert h.take_worker() == []
    h.tick(5.0)
    assert JOB in h.core.tasks.tasks and h.take_client() == []  # not yet: 10 s without a PUT
    h.tick(6.0)
    m = h.one_reply(C1)
    assert m.header["code"] == "INVALID_REQUEST" and "stopped coming" in m.header["message"]
    assert "staged file 0 has 4096 of its 10240 bytes" in m.header["message"]
    (_, err, _), = h.take_worker()
    assert err.command is Command.ERROR and err.header["id"] == JOB
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled == {}
    h.assert_idle()


def staged_on_two_workers(**config: Any) -> Harness:
    """A core (``config``) with workers W1 and W2, and JOB staged and placed on one of them."""
    h = Harness(**config)
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    stage_all(h)
    staged_job(h)
    replies(h)
    return h


def test_a_staged_job_that_fails_on_its_worker_before_it_began_is_placed_again_elsewhere() -> None:
    h = staged_on_two_workers()
    (ident, first, _), = h.take_worker()
    other = W2 if ident == W1 else W1
    h.result(ident, JOB, ok=False, code="REMOTE_ERROR", message="cannot write the job's staged inputs: ENOSPC")
    assert h.take_client() == []  # not failed: it never began
    (again, d, _), = h.take_worker()
    assert again == other and d.command is Command.DISPATCH and d.header["staged"] == [10240, 0, 30]
    assert fetch_all(h, other) == DATA  # the upload is still held
    h.worker(ident, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 100})  # the worker it left
    (_, err, _), = h.take_worker()
    assert err.command is Command.ERROR and err.header["id"] == JOB
    h.result(other, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    h.assert_idle()


def test_an_out_of_order_chunk_is_refused_and_a_resent_one_is_answered_without_counting_twice() -> None:
    h = Harness()
    put(h, 0, sizes=[10240])
    put(h, 1, file=0, offset=0, frames=(b"a" * 4096,))
    put(h, 2, file=0, offset=0, frames=(b"a" * 4096,))  # a re-send after a failover
    put(h, 3, file=0, offset=8192, frames=(b"c" * 2048,))
    put(h, 4, file=1, offset=0, frames=(b"x",))
    oks = [m.header.get("code") for m in replies(h)]
    assert oks == [None, None, None, "INVALID_REQUEST", "INVALID_REQUEST"]
    up = h.core.staging.spool.uploads[JOB]
    assert up.have == [4096] and h.core.staging.spool.stored == 4096
    put(h, 5, sizes=[10240])  # opened again: the client resumes from what is held
    assert replies(h)[0].header["have"] == [4096]
    put(h, 6, sizes=[10241])
    assert "other file sizes" in replies(h)[0].header["message"]


def test_another_tenant_cannot_touch_an_upload_and_the_spool_budgets_hold() -> None:
    h = Harness(budgets=Budgets(max_spool_bytes=30 * MiB))
    put(h, 0, sizes=[10240])
    put(h, 1, tenant="mallory", sizes=[10240])
    put(h, 2, tenant="mallory", file=0, offset=0, frames=(b"m" * 10,))
    codes = [(m.header.get("code"), m.header.get("message", "")) for m in replies(h)]
    assert codes[0][0] is None
    assert codes[1][0] == "INVALID_REQUEST" and "already in use" in codes[1][1]
    assert codes[2][0] == "INVALID_REQUEST"
    assert h.core.staging.spool.uploads[JOB].have == [0]
    put(h, 3, job=rid(78), sizes=[30 * MiB])
    m = replies(h)[0]
    assert m.header["code"] == "BUSY" and "spool_quota_bytes" in m.header["message"]
    staged_job(h, C2, job=JOB, tenant="mallory")  # another tenant's REQUEST under that id claims nothing
    assert h.one_reply(C2).header["code"] == "INVALID_REQUEST"
    assert not h.core.staging.spool.uploads[JOB].claimed


def test_an_unclaimed_upload_expires_and_a_fetch_from_another_worker_gets_an_error() -> None:
    h = Harness(stage_ttl=10.0, heartbeat=HeartbeatPolicy(30.0, 3))  # the workers stay while the clock runs
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    stage_all(h)
    stage_all(h, job=rid(88))
    replies(h)
    staged_job(h)
    h.take_worker()
    h.tick(11.0)
    assert set(h.core.staging.spool.uploads) == {JOB}  # the claimed one stays
    assert h.core.accounts.spooled == {"acme": 10270}
    other = W2 if h.core.tasks.tasks[JOB].worker == "w1" else W1
    h.worker(other, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 100})
    (_, msg, _), = [o for o in h.take_worker() if o[1].command is not Command.HEARTBEAT]
    assert msg.command is Command.ERROR and msg.header["id"] == JOB


# --------------------------------------------------------------------------- the pair


def pair_in_sync(name: str, **passive: Any) -> Iterator[tuple[Side, Side]]:
    """A pair in sync over inproc (``name`` tells its sockets apart), the passive's core
    configured with ``passive``."""
    ctx: zmq.Context[Any] = zmq.Context()
    clock = FakeClock(1000.0)
    a = Side(ctx, clock, "primary", f"inproc://{name}-a", f"inproc://{name}-b")
    b = Side(ctx, clock, "backup", f"inproc://{name}-b", f"inproc://{name}-a", **passive)
    try:
        settle(a, b)
        yield a, b
    finally:
        a.pair.close()
        b.pair.close()
        ctx.term()


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    yield from pair_in_sync("stage")


def test_a_put_is_answered_only_once_the_passive_holds_its_chunk(sides: tuple[Side, Side]) -> None:
    a, b = sides
    stage_all(a.h)
    core = a.h.core
    assert core.staging.take_replies(core.journal.durable) == []  # nothing is durable yet
    assert a.h.take_client() == []
    a.tick()  # the updates go out; the peer has not applied them yet
    assert core.staging.take_replies(core.journal.durable) == []
    settle(a, b)
    released = core.staging.take_replies(core.journal.durable)
    assert len(released) == 5 and all(P.unpackb(f[2])["ok"] is True for _, f in released)
    up = b.h.core.staging.spool.uploads[JOB]
    assert up.complete() and not up.claimed
    assert [b.h.core.staging.spool.read(up, i, 0, len(d)) for i, d in enumerate(DATA)] == DATA
    staged_job(a.h)
    settle(a, b)
    assert up.claimed  # the task update claimed it on the passive too
    a.h.ready(W1, "w1")
    a.h.result(W1, JOB, exit_code=0)
    settle(a, b)
    assert len(b.h.core.staging.spool) == 0 and b.h.core.accounts.spooled_bytes == 0


def test_a_passive_that_resyncs_gets_the_spool_back_chunk_by_chunk(sides: tuple[Side, Side]) -> None:
    a, b = sides
    big = b"z" * (20 * MiB)
    put(a.h, 0, sizes=[len(big)])
    for n, start in enumerate(range(0, len(big), 4 * MiB)):
        put(a.h, n + 1, file=0, offset=start, frames=(big[start : start + 4 * MiB],))
    settle(a, b)
    b.pair._sync(a.clock.monotonic())  # the passive re-syncs: a snapshot, the uploads without bytes
    settle(a, b, rounds=100)
    up = b.h.core.staging.spool.uploads[JOB]
    assert up.sizes == (len(big),) and up.have == [0]
    turns = 0
    while a.h.core.staging.backfilling:
        a.h.core.staging.backfill(a.h.core)
        settle(a, b)
        turns += 1
    assert turns == 1
    chunks = [u for u in b.updates if u[0] == "chunk"]
    assert max(len(u[4]) for u in chunks) <= 8 * MiB  # no update carries a large piece
    assert up.complete() and b.h.core.staging.spool.read(up, 0, len(big) - 5, 5) == b"zzzzz"


@pytest.fixture
def small_passive(small_fs: Any) -> Iterator[tuple[Side, Side]]:
    """A pair whose passive broker's spool is a 64 MiB disk (the active's is not), in sync."""
    yield from pair_in_sync("hold", spool_dir=str(small_fs), spool_ram_bytes=0)


def test_an_upload_the_passive_peer_has_no_room_for_is_answered_busy_at_its_opening(
        small_passive: tuple[Side, Side]) -> None:
    a, b = small_passive
    room = a.h.core.staging.peer_room  # its STATE's: 64 MiB less the 16 of headroom
    assert room is not None and 40 * MiB < room <= 48 * MiB
    put(a.h, 0, sizes=[50 * MiB])
    (busy,) = replies(a.h)
    assert busy.header["code"] == "BUSY" and "the standby broker's spool disk has room for" in busy.header["message"]
    assert JOB not in a.h.core.staging.spool.uploads
    put(a.h, 1, sizes=[40 * MiB])
    settle(a, b)
    core = a.h.core
    (ok,) = [P.unpackb(f[2]) for _, f in core.staging.take_replies(core.journal.durable)]  # once the peer holds it
    assert ok["ok"] is True
    assert a.h.core.staging.peer_room == room - 40 * MiB  # it owes 40 now
    a.clock.advance(EXPIRY + 0.1)  # the peer is gone: its room bounds nothing
    a.tick()
    assert a.h.core.staging.peer_room is None


def test_a_passive_removes_the_files_it_keeps_for_reuse_when_an_upload_needs_their_room(
        small_passive: tuple[Side, Side]) -> None:
    a, b = small_passive
    core, spool = a.h.core, b.h.core.staging.spool
    piece = b"k" * MiB
    for n in range(3):  # three uploads of 15 MiB, then dropped: the passive keeps their files
        job = rid(90 + n)
        put(a.h, 100 * n, job=job, sizes=[15 * MiB])
        settle(a, b)
        for k in range(15):
            put(a.h, 100 * n + 1 + k, job=job, file=0, offset=k * MiB, frames=(piece,))
        settle(a, b)
    core.staging.expire(core, core.now + 3600)  # unclaimed: dropped (unstage)
    settle(a, b)
    assert len(spool) == 0 and spool.kept_bytes == 45 * MiB
    assert core.staging.peer_room is not None and core.staging.peer_room >= 45 * MiB  # kept files count as room
    # 45 MiB more: over what is free beside the kept files, within what is free without them.
    put(a.h, 400, sizes=[45 * MiB])
    settle(a, b)
    for k in range(45):
        put(a.h, 401 + k, file=0, offset=k * MiB, frames=(piece,))
        settle(a, b)
    assert spool.uploads[JOB].complete() and b.h.core.staging.unheld == set()
    assert spool.kept_bytes == 0 and spool.io.failed == []
    assert spool.read(spool.uploads[JOB], 0, 45 * MiB - 2, 2) == b"kk"


def test_a_passive_that_cannot_hold_an_uploads_bytes_says_so_and_the_job_goes_on_without_it(
        small_passive: tuple[Side, Side]) -> None:
    """Two 40 MiB uploads opened in one turn, before the passive's next STATE (each fits its
    reported room; together they overfill its 64 MiB disk). It does not re-sync (which would
    fill it again, and leave nothing durable for anyone meanwhile): it names the second upload
    in its STATE, and the active goes on with it without the passive, journalling none of its
    chunks more. Once the passive takes over, that job (not begun) fails BUSY at once, and the
    others, whose bytes it holds, are still there (PROTOCOL.md §11.4)."""
    a, b = small_passive
    core = a.h.core  # no worker: the jobs wait in the queue
    big = b"q" * (4 * MiB)
    first, second, other = JOB, rid(80), rid(79)
    for n, job in enumerate((first, second)):
        put(a.h, 10 * n, job=job, sizes=[10 * len(big)])
        a.h.request(C1, job, kind="job", argv=["cat"], files=["a"], staged=[10 * len(big)],
                    need={"gpu_milli": 100, "tenant": "acme"})
    stage_all(a.h, job=other, tenant="bob")
    staged_job(a.h, C2, job=other, tenant="bob")
    settle(a, b)
    for job in (first, second):
        for n in range(10):
            put(a.h, 100 + n, job=job, file=0, offset=n * len(big), frames=(big,))
            settle(a, b)
    assert any("unheld" in header and second in header["unheld"] for cmd, header in a.heard if cmd is Command.STATE)
    assert b.pair.snapshots == 1  # never re-synced
    assert core.journal.durable == core.seq  # the peer has applied everything the active journalled
    chunks = [u for u in b.updates if u[0] == "chunk" and u[1] == second]
    assert 4 <= len(chunks) < 10  # those after the passive said so were not journalled
    released = core.staging.take_replies(core.journal.durable)
    assert [P.unpackb(f[2])["ok"] for _, f in released] == [True] * (2 + 5 + 20)  # every PUT answered ok
    assert core.staging.spool.uploads[second].complete() and second not in b.h.core.staging.spool.uploads
    assert b.h.core.staging.unheld == {second}
    assert b.h.core.accounts.spooled["acme"] == 10 * len(big)  # the budget of the upload it lets go is freed
    for job, data in ((first, [big * 10]), (other, DATA)):  # held by both, whole
        up = b.h.core.staging.spool.uploads[job]
        assert up.complete() and [b.h.core.staging.spool.read(up, i, 0, len(d)) for i, d in enumerate(data)] == data
    # The active broker is gone: the passive takes over on a client's vote.
    b.clock.advance(EXPIRY + 0.1)
    b.client(rid(7))
    b.tick()
    assert b.state.value == "active"
    lost = b.h.core.tasks.tasks[second]
    assert lost.state is TaskState.DONE and lost.reply is not None
    header = P.unpackb(lost.reply[2])  # [signature, command, header]
    assert header["code"] == "BUSY" and "lost in a broker failover" in header["message"], header
    for job in (first, other):
        assert b.h.core.tasks.tasks[job].state is TaskState.QUEUED and job in b.h.core.staging.spool.uploads


# --------------------------------------------------------------------------- outputs (§11.5)


def pull_all(h: Harness, job: bytes, files: list[bytes], ident: bytes = W1) -> tuple[int, list[Message]]:
    """Answer the broker's FETCHes of ``job``'s outputs from ``files`` until it asks no more: how
    many rounds of FETCHes came, and what else the worker got."""
    rounds = 0
    others: list[Message] = []
    while True:
        sent = [m for _, m, _ in h.take_worker()]
        asks = [m for m in sent if m.command is Command.FETCH]
        others += [m for m in sent if m.command is not Command.FETCH]
        if not asks:
            return rounds, others
        rounds += 1
        assert len(asks) <= 4  # the window
        for m in asks:
            i, off, n = m.header["file"], m.header["offset"], m.header["nbytes"]
            h.worker(ident, Command.CHUNK, {"id": job, "file": i, "offset": off}, [files[i][off : off + n]])


def test_staged_outputs_are_pulled_into_the_spool_then_read_by_their_client() -> None:
    h = Harness(stage_ttl=30.0, heartbeat=HeartbeatPolicy(30.0, 3))
    h.ready(W1, "w1")
    h.take_worker()
    job = rid(60)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o1", "o2"], need={"gpu_milli": 100, "tenant": "acme"})
    h.one_dispatch(W1)
    files = [b"o" * (6 * CHUNK_BYTES + 3), b"p" * 5]
    h.result(W1, job, exit_code=0, files=["o1", "o2"], staged=[len(f) for f in files], frames=[b"out", b"err"])
    assert h.take_client() == []  # no REPLY before the outputs are here
    rounds, others = pull_all(h, job, files)
    assert rounds == 2  # 8 chunks, at most 4 asked at once
    loop_turn(h)  # once the spool's writes are done
    others += [m for _, m, _ in h.take_worker()]
    out = h.take_client()
    (_, reply, _), = [o for o in out if o[1].command is Command.REPLY]
    assert reply.header["staged"] == [len(f) for f in files] and [P.as_bytes(f) for f in reply.frames] == [b"out", b"err"]
    assert [m for m in others if m.command is Command.ACK] == []  # owed, in the turn's batch (take_acks)
    assert h.core.take_acks() == {W1: [job]}  # a standalone broker ACKs a staged result too
    h.client(C1, Command.FETCH, {"id": rid(61), "job": job, "file": 0, "offset": 6 * CHUNK_BYTES, "nbytes": 8 * MiB,
                                 "tenant": "acme"})
    loop_turn(h)  # a chunk of 3 bytes is not held in memory: the disk thread reads it
    got = h.one_reply(C1)
    assert P.as_bytes(got.frames[0]) == b"ooo"
    h.client(C2, Command.FETCH, {"id": rid(62), "job": job, "file": 1, "offset": 0, "nbytes": 5, "tenant": "mallory"})
    assert h.one_reply(C2).header["code"] == "INVALID_REQUEST"  # another tenant reads nothing
    h.tick(29.0)
    assert h.core.accounts.spooled_bytes == sum(map(len, files))
    h.tick(2.0)  # stage_ttl since the last read: released
    assert h.core.accounts.spooled_bytes == 0 and len(h.core.staging.spool) == 0


def test_a_worker_lost_while_its_outputs_are_fetched_fails_the_job() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    job = rid(63)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o"], need={"gpu_milli": 100})
    h.one_dispatch(W1)
    h.result(W1, job, exit_code=0, files=["o"], staged=[10 * MiB], frames=[b"", b""])
    assert [m.command for _, m, _ in h.take_worker()] == [Command.FETCH] * WINDOW
    h.worker(W1, Command.DISCONNECT, {})
    m = h.one_reply(C1)
    assert m.header["code"] == "WORKER_LOST" and "outputs" in m.header["message"]
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled_bytes == 0


def test_fetches_are_answered_from_memory_or_from_the_disk_thread_and_the_loop_never_waits(tmp_path: Any) -> None:
    h = Harness(spool_dir=str(tmp_path), spool_ram_bytes=0)  # every file on disk
    spool = h.core.staging.spool
    spool.hold_bytes = 8192  # two chunks of 4096 held in memory once on disk, unless read
    spool.hold_min_bytes = 1  # small chunks here, as if large
    h.ready(W1, "w1")
    h.take_worker()
    stage_all(h)
    staged_job(h)
    loop_turn(h)
    assert all(m.header["ok"] is True for m in replies(h))
    h.one_dispatch(W1)
    # Once on disk, the oldest chunk is let go to stay under hold_bytes: 4096@4096, 2048@8192, file 2's 30 are kept.
    assert spool.held_bytes == 4096 + 2048 + 30
    # The last chunks of file 0 are in memory: answered at once, and let go (read, on disk).
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 8192, "nbytes": 4096})
    (_, chunk, _), = h.take_worker()
    assert P.as_bytes(chunk.frames[0]) == DATA[0][8192:]
    assert spool.held_bytes == 4096 + 30
    # The first ones are not: read by the spool's disk thread, answered when the loop takes the read.
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 4096})
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 100, "nbytes": 50})
    assert h.take_worker() == []
    spool.io.stop()  # the disk thread did what it was handed
    h.core.staging.after_io(h.core)
    got = [(m.header["offset"], P.as_bytes(m.frames[0])) for _, m, _ in h.take_worker()]
    assert got == [(0, DATA[0][:4096]), (100, DATA[0][100:150])]
    # A read that comes back after the job ended is dropped, not sent.
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 200, "nbytes": 10})
    h.result(W1, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    spool.io.stop()
    h.core.staging.after_io(h.core)
    assert h.take_worker() == []


def test_a_chunk_past_the_spool_disk_backlog_is_answered_busy_and_not_taken(tmp_path: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from gpud_broker import staging

    h = Harness(spool_dir=str(tmp_path), spool_ram_bytes=0)
    put(h, 0, sizes=[len(d) for d in DATA])
    put(h, 1, file=0, offset=0, frames=(DATA[0][:4096],))
    loop_turn(h)
    assert all(m.header["ok"] is True for m in replies(h))
    monkeypatch.setattr(staging, "MAX_BACKLOG_BYTES", -1)  # as if more than it waited for the disk
    put(h, 2, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    (busy,) = replies(h)
    assert busy.header["code"] == "BUSY" and "resume" in busy.header["message"]
    assert h.core.staging.spool.uploads[JOB].have == [4096, 0, 0]  # nothing of it taken
    monkeypatch.setattr(staging, "MAX_BACKLOG_BYTES", 64 << 20)
    put(h, 3, sizes=[len(d) for d in DATA])  # the client opens it again and resumes from what is held
    (opened,) = replies(h)
    assert opened.header["have"] == [4096, 0, 0]
    put(h, 4, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    loop_turn(h)
    assert [m.header["ok"] for m in replies(h)] == [True]


def test_a_staged_job_that_fails_before_it_began_on_every_worker_tried_gets_its_own_error() -> None:
    h = staged_on_two_workers(max_attempts=2)
    for _ in range(2):  # each worker once
        (ident, d, _), = h.take_worker()
        assert d.command is Command.DISPATCH
        h.result(ident, JOB, ok=False, code="REMOTE_ERROR", message="cannot write job input files: EIO")
    reply = h.one_reply(C1).header
    assert reply["code"] == "REMOTE_ERROR" and "before it began on 2 workers (max_attempts)" in reply["message"]
    assert "cannot write job input files: EIO" in reply["message"]  # not WORKER_LOST: no worker was lost
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled == {}


def test_a_job_whose_upload_leaves_its_worker_waiting_gives_up_its_slot_until_the_upload_is_complete() -> None:
    # A trickle: PUTs keep coming (so the upload never stalls), but too slowly for the worker.
    h = placed_with_its_first_chunk(stage_ttl=60.0, stage_idle_s=5.0)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 4096})
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    h.take_worker()
    for n in range(2, 6):  # a byte a second: the worker's FETCH of 4096 waits on
        h.tick(1.0)
        put(h, n, file=0, offset=4096 + n - 2, frames=(DATA[0][4096 + n - 2 : 4096 + n - 1],))
        assert h.take_worker() == []
    h.tick(1.5)
    (_, err, _), = h.take_worker()  # told to drop it: it waited 5 s for bytes
    assert err.command is Command.ERROR and err.header["id"] == JOB and "too slow" in err.header["message"]
    assert all(m.header["ok"] is True and m.header["id"] != JOB for m in replies(h))  # the PUTs'; the job is not failed
    task = h.core.tasks.tasks[JOB]
    assert task.worker is None and task.attempts == 0
    # Its slot is free: another tenant's job is placed at once.
    h.request(C2, rid(5), kind="job", argv=["true"], need={"gpu_milli": 100, "tenant": "other"})
    h.one_dispatch(W1)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4100, "nbytes": 4096})  # late: refused
    (_, late, _), = h.take_worker()
    assert late.command is Command.ERROR
    h.result(W1, rid(5), exit_code=0)
    assert h.one_reply(C2).header["ok"] is True
    # The rest of the upload comes: the job is placed again, and runs from the spool.
    put(h, 9, file=0, offset=4100, frames=(DATA[0][4100:],))
    put(h, 10, file=2, offset=0, frames=(DATA[2],))
    loop_turn(h)
    assert all(m.header["ok"] is True for m in replies(h))
    d = h.one_dispatch(W1)
    assert d.header["staged"] == [10240, 0, 30]
    assert fetch_all(h) == DATA
    h.result(W1, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    assert len(h.core.staging.spool) == 0 and not h.core.staging.parked
    h.assert_idle()


def test_a_parked_job_outlives_its_queue_deadline_while_its_upload_comes_and_can_be_cancelled() -> None:
    # Two jobs, queue deadlines of 5 s: time spent waiting for their own upload is not queue time.
    h = Harness(stage_ttl=30.0, stage_idle_s=2.0, heartbeat=HeartbeatPolicy(300.0, 3))
    h.ready(W1, "w1")
    h.take_worker()
    for n, job in enumerate((JOB, rid(78))):
        put(h, 10 * n, job=job, sizes=[len(d) for d in DATA])
        h.request(C1, job, kind="job", argv=["cat"], files=["a", "b", "c"], staged=[len(d) for d in DATA],
                  need={"gpu_milli": 100, "tenant": "acme"}, deadline_ms=5000)
        replies(h)
        h.one_dispatch(W1)
        h.worker(W1, Command.FETCH, {"id": job, "file": 0, "offset": 0, "nbytes": 4096})
    h.tick(3.0)
    assert len(h.take_worker()) == 2 and set(h.core.staging.parked) == {JOB, rid(78)}
    h.client(C1, Command.CANCEL, {"id": rid(78)})
    assert h.one_reply(C1).header["code"] == "CANCELLED"
    for step in range(1, 5):  # JOB's upload comes, slowly, past its queue deadline: it waits on
        h.tick(2.0)
        put(h, step, file=0, offset=(step - 1) * 2560, frames=(DATA[0][(step - 1) * 2560 : step * 2560],))
    assert all(m.header["ok"] is True for m in replies(h)) and JOB in h.core.staging.parked
    put(h, 5, file=2, offset=0, frames=(DATA[2],))  # complete: placed again, with a fresh queue deadline
    replies(h)
    assert h.one_dispatch(W1).header["id"] == JOB and not h.core.staging.parked
    assert fetch_all(h) == DATA
    h.result(W1, JOB, exit_code=0)
    assert h.one_reply(C1).header["ok"] is True
    assert len(h.core.staging.spool) == 0 and h.core.accounts.spooled == {}
    h.assert_idle()


def test_a_stopping_broker_answers_a_parked_job_as_it_answers_the_queued_ones() -> None:
    """A parked job is waiting for its upload out of the queue: a drain that answered only the
    queue left its client without an answer until its own timeout."""
    h = placed_with_its_first_chunk(stage_ttl=10.0, stage_idle_s=2.0)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    h.tick(3.0)
    h.take_worker()
    assert JOB in h.core.staging.parked
    assert h.core.fail_queued(ShuttingDown("broker b is stopping")) == 1
    m = h.one_reply(C1)
    assert m.header["id"] == JOB and m.header["code"] == "SHUTTING_DOWN"
    assert not h.core.staging.parked


def test_a_parked_job_whose_upload_stops_fails_as_stalled() -> None:
    h = placed_with_its_first_chunk(stage_ttl=10.0, stage_idle_s=2.0)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    h.tick(3.0)
    (_, err, _), = h.take_worker()
    assert err.command is Command.ERROR and JOB in h.core.staging.parked
    h.tick(8.0)
    m = h.one_reply(C1)
    assert m.header["code"] == "INVALID_REQUEST" and "stopped coming" in m.header["message"]
    assert not h.core.staging.parked and len(h.core.staging.spool) == 0
    h.assert_idle()


def test_outputs_are_pulled_no_faster_than_the_spool_disk_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpud_broker import staging

    h = Harness(heartbeat=HeartbeatPolicy(30.0, 3))
    h.ready(W1, "w1")
    h.take_worker()
    job = rid(60)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o1"], need={"gpu_milli": 100, "tenant": "acme"})
    h.one_dispatch(W1)
    monkeypatch.setattr(staging, "REPLY_BACKLOG_BYTES", -1)  # as if the disk were behind
    h.result(W1, job, exit_code=0, files=["o1"], staged=[9 * CHUNK_BYTES], frames=[b"out", b"err"])
    assert [m for _, m, _ in h.take_worker() if m.command is Command.FETCH] == []  # nothing asked for yet
    h.core.staging.settle_pulls(h.core, h.core.journal.durable)
    assert h.take_worker() == []  # still behind
    monkeypatch.setattr(staging, "REPLY_BACKLOG_BYTES", 16 << 20)
    h.core.staging.settle_pulls(h.core, h.core.journal.durable)  # the disk caught up: the loop's next turn
    asked = [m.header["offset"] for _, m, _ in h.take_worker() if m.command is Command.FETCH]
    assert asked == [i * CHUNK_BYTES for i in range(WINDOW)]


def fill(directory: Any) -> None:
    """Fill ``directory``'s file system, as another program would, until ENOSPC."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(MiB))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_disk_filled_by_something_else_mid_upload_fails_the_job_busy_not_invalid(small_fs: Any) -> None:
    """The opening PUT found room; then another program filled the spool's disk. The write that
    fails ends the upload, and its job gets BUSY saying so (not the client's fault: try later);
    the spool and the tenant's budget hold nothing of it after."""
    h = Harness(spool_dir=str(small_fs), spool_ram_bytes=0, heartbeat=HeartbeatPolicy(30.0, 3))
    size = 8 * MiB
    put(h, 0, sizes=[size])
    h.request(C1, JOB, kind="job", argv=["cat"], files=["a"], staged=[size], need={"gpu_milli": 100, "tenant": "acme"})
    assert [m.header["ok"] for m in replies(h)] == [True]
    fill(small_fs)  # another program
    for n in range(8):
        put(h, 1 + n, file=0, offset=n * MiB, frames=(bytes(MiB),))
    loop_turn(h)
    errors = [m for m in replies(h) if m.header.get("id") == JOB]
    assert len(errors) == 1 and errors[0].header["code"] == "BUSY", errors
    assert "spool disk is full, try again later" in errors[0].header["message"]
    assert JOB not in h.core.staging.spool.uploads and h.core.accounts.spooled_bytes == 0


def test_outputs_the_spool_loses_mid_pull_fail_the_job_and_are_acked_so_the_worker_lets_them_go(
        small_fs: Any) -> None:
    """The pull's opening found room; then another program filled the spool's disk. The job (it
    ran) ends BUSY saying its outputs were lost, and its RESULT is ACKed at once: its worker
    stops holding the outputs now, not at its UNACKED_TTL (a held output takes room in the
    worker's hold that other tenants' finished jobs wait for)."""
    h = Harness(spool_dir=str(small_fs), spool_ram_bytes=0, heartbeat=HeartbeatPolicy(30.0, 3))
    h.ready(W1, "w1")
    h.take_worker()
    job = rid(64)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o"], need={"gpu_milli": 100, "tenant": "acme"})
    h.one_dispatch(W1)
    h.result(W1, job, exit_code=0, files=["o"], staged=[8 * MiB], frames=[b"", b""])
    assert h.core.take_acks() == {}  # owed once the outputs are here
    fill(small_fs)  # another program
    pull_all(h, job, [bytes(8 * MiB)])
    loop_turn(h)
    errors = [m for _, m, _ in h.take_client() if m.header.get("id") == job]
    assert len(errors) == 1 and errors[0].header["code"] == "BUSY", errors
    assert "the job ran, but its outputs were lost" in errors[0].header["message"]
    assert h.core.take_acks() == {W1: [job]}
    assert h.core.accounts.spooled_bytes == 0 and job not in h.core.staging.pulls


def test_an_upload_the_spool_disk_cannot_take_is_answered_busy_at_its_opening(small_fs: Any) -> None:
    h = Harness(spool_dir=str(small_fs), spool_ram_bytes=0, heartbeat=HeartbeatPolicy(30.0, 3))
    put(h, 0, sizes=[30 * MiB])
    put(h, 1, job=rid(78), sizes=[30 * MiB])  # 48 MiB to stage, 30 owed already
    ok, busy = replies(h)
    assert ok.header["ok"] is True and ok.header["have"] == [0]
    assert busy.header["code"] == "BUSY" and "spool disk has room for" in busy.header["message"]
    assert rid(78) not in h.core.staging.spool.uploads and h.core.accounts.spooled_bytes == 30 * MiB
    # A job's staged outputs likewise: the job ran, and its RESULT says why they are not here.
    h.ready(W1, "w1")
    h.take_worker()
    job = rid(60)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o"], need={"gpu_milli": 100, "tenant": "acme"})
    h.one_dispatch(W1)
    h.result(W1, job, exit_code=0, files=["o"], staged=[20 * MiB], frames=[b"out", b"err"])
    reply = h.one_reply(C1)
    assert reply.header["code"] == "BUSY" and "no room for its outputs" in reply.header["message"]
    assert "spool disk has room for" in reply.header["message"]


def test_the_spool_shows_in_the_metrics_against_its_quota_and_each_tenants_budget() -> None:
    pytest.importorskip("prometheus_client")
    from gpud_broker.metrics import BrokerCollector

    h = Harness(budgets=Budgets(max_spool_bytes=1 << 30))
    h.ready(W1, "w1")
    h.take_worker()
    stage_all(h)
    put(h, 50, job=rid(78), tenant="beta", sizes=[5000])
    put(h, 51, job=rid(78), tenant="beta", file=0, offset=0, frames=(b"x" * 2000,))
    loop_turn(h)
    staged_job(h)
    h.one_dispatch(W1)
    fetch_all(h)
    fams = {f.name: f for f in BrokerCollector(h.core).collect()}

    def value(name: str, **labels: str) -> float:
        (got,) = [s.value for s in fams[name].samples if s.labels == labels and not s.name.endswith("_created")]
        return got

    assert value("gpud_spool_uploads") == 2
    assert value("gpud_spool_reserved_bytes") == 10270 + 5000 and value("gpud_spool_stored_bytes") == 10270 + 2000
    assert value("gpud_spool_quota_bytes") == 1 << 30
    assert value("gpud_tenant_spool_bytes", tenant="acme") == 10270 and value("gpud_tenant_spool_bytes", tenant="beta") == 5000
    assert value("gpud_spool_disk_room_bytes") > 0
    fetches = h.core.counters["fetches_on_data"] + h.core.counters["fetches_on_control"]
    assert fetches > 0 and value("gpud_staged_chunks", direction="inputs", connection="control") == \
        h.core.counters["fetches_on_control"]
    assert value("gpud_staged_chunks", direction="outputs", connection="data") == 0
