"""A worker's data connection (PROTOCOL.md §11.3): FETCHes of staged inputs on a connection of
their own, bound by the broker's core to the worker they name only when that is true."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.errors import GpudError
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud.transfer import CHUNK_BYTES
from gpud_worker.fetch import IO_NICE, _io_threads, data_context
from tests.unit.test_broker_core import C1, W1, W2, Harness, rid
from tests.unit.test_staging import (
    DATA,
    JOB,
    loop_turn,
    placed_with_its_first_chunk,
    put,
    replies,
    stage_all,
    staged_job,
)

INC1 = b"\x11" * 16
INC2 = b"\x22" * 16
D1 = b"\x00data-w1"  # the routing ids of the workers' data connections
D2 = b"\x00data-w2"


def data_fetch(h: Harness, ident: bytes, user: str | None = None, **fields: Any) -> None:
    """A FETCH on a data connection (``user``: its key's name, as ZAP says under CURVE)."""
    h.core.now = h.clock.monotonic()
    enc = P.encode(Peer.WORKER, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 4096, **fields})
    h.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2], user)


def two_workers(**config: Any) -> Harness:
    h = Harness(heartbeat=HeartbeatPolicy(1.0, 3), **config)
    h.ready(W1, "w1", incarnation=INC1)
    h.ready(W2, "w2", incarnation=INC2)
    h.take_worker()
    return h


def placed(h: Harness) -> tuple[str, bytes, bytes, bytes]:
    """JOB staged and placed: its worker's name, incarnation, control and data routing ids."""
    stage_all(h)
    staged_job(h)
    replies(h)
    (ident, msg, _), = h.take_worker()
    assert msg.command is Command.DISPATCH
    return ("w1", INC1, W1, D1) if ident == W1 else ("w2", INC2, W2, D2)


def test_a_fetch_on_a_data_connection_is_answered_there_and_is_not_the_workers_liveness() -> None:
    h = two_workers()
    name, inc, control, data = placed(h)
    record = h.core.registry.by_name[name]
    h.advance(2.5)  # nearly silent on its control connection
    heard = record.liveness.last_heard
    data_fetch(h, data, worker=name, incarnation=inc, nbytes=3000)
    (to, msg, _), = h.take_worker()
    assert to == data and msg.command is Command.CHUNK and P.as_bytes(msg.frames[0]) == DATA[0][:3000]
    assert record.liveness.last_heard == heard  # the data connection does not keep it alive
    assert h.core.counters["fetches_on_data"] == 1 and h.core.counters["fetches_on_control"] == 0
    # A FETCH on the control connection (an older worker) still works, answered there.
    h.worker(control, Command.FETCH, {"id": JOB, "file": 0, "offset": 3000, "nbytes": 3000})
    (to, msg, _), = h.take_worker()
    assert to == control and P.as_bytes(msg.frames[0]) == DATA[0][3000:6000]
    assert h.core.counters["fetches_on_control"] == 1


def test_a_fetch_that_waits_for_its_bytes_is_answered_on_the_data_connection_it_came_on() -> None:
    h = placed_with_its_first_chunk(INC1)
    data_fetch(h, D1, worker="w1", incarnation=INC1, offset=4096)
    assert h.take_worker() == []  # waits for the bytes
    put(h, 2, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    (to, msg, _), = h.take_worker()
    assert to == D1 and msg.header == {"id": JOB, "file": 0, "offset": 4096}
    assert P.as_bytes(msg.frames[0]) == DATA[0][4096:8192]


@pytest.mark.parametrize("fields, user, why", [
    ({"worker": "nobody", "incarnation": INC1}, None, "an unknown worker name"),
    ({"worker": "w1", "incarnation": INC2}, None, "another process's incarnation"),
    ({"worker": "w1"}, None, "no incarnation"),
    ({"worker": 7, "incarnation": INC1}, None, "a name of the wrong type"),
])
def test_a_fetch_naming_a_worker_untruly_gets_a_bad_message_error_and_no_byte(fields: dict[str, Any], user: str | None,
                                                                              why: str) -> None:
    h = two_workers()
    placed(h)
    with pytest.raises(GpudError) as exc:
        data_fetch(h, D1, user, **fields)
    assert exc.value.code == "INVALID_REQUEST", why
    assert h.take_worker() == [] and h.core.counters["fetches_on_data"] == 0, why


def test_under_curve_only_the_workers_own_key_binds_its_data_connection() -> None:
    h = two_workers()
    h.core.worker_names_bound = True
    name, inc, _, data = placed(h)
    other = "w2" if name == "w1" else "w1"
    for user in (other, None, f"acme {name}"):  # another worker's key; none said; a client-like User-Id
        with pytest.raises(GpudError):
            data_fetch(h, data, user, worker=name, incarnation=inc)
        assert h.take_worker() == []
    data_fetch(h, data, name, worker=name, incarnation=inc)
    (to, msg, _), = h.take_worker()
    assert to == data and msg.command is Command.CHUNK


def test_a_bound_fetch_of_a_job_placed_on_another_worker_gets_an_error_on_its_data_connection() -> None:
    h = two_workers()
    name, _, _, _ = placed(h)
    other, inc, data = ("w2", INC2, D2) if name == "w1" else ("w1", INC1, D1)
    data_fetch(h, data, worker=other, incarnation=inc)
    (to, msg, _), = h.take_worker()
    assert to == data and msg.command is Command.ERROR and msg.header["id"] == JOB


def test_a_fetch_from_a_worker_lost_meanwhile_is_refused_and_its_job_is_placed_again() -> None:
    h = two_workers(worker_resume_periods=0)
    name, inc, control, data = placed(h)
    survivor = W2 if control == W1 else W1
    h.advance(2.0)
    h.heartbeat(survivor, 1)
    h.tick(1.5)  # the placed-on worker is silent past its liveness: lost, its job (not begun) placed again
    assert name not in h.core.registry.by_name
    h.take_worker()
    with pytest.raises(GpudError):
        data_fetch(h, data, worker=name, incarnation=inc)
    assert h.take_worker() == []
    assert h.core.tasks.tasks[JOB].worker != name


def test_a_flood_of_unbound_fetches_changes_nothing_of_the_worker_it_names() -> None:
    h = two_workers()
    name, inc, control, data = placed(h)
    record = h.core.registry.by_name[name]
    before = (record.liveness.last_heard, record.identity, dict(record.assigned), record.suspended_at)
    refused = 0
    for n in range(2000):
        try:
            data_fetch(h, b"\x00flood%d" % n, worker=name, incarnation=bytes(16))
        except GpudError:
            refused += 1
    assert refused == 2000 and h.take_worker() == []
    assert (record.liveness.last_heard, record.identity, dict(record.assigned), record.suspended_at) == before
    assert h.core.registry.by_name[name] is record and h.core.tasks.tasks[JOB].worker == name
    # Its control dialog and its real data connection go on as before.
    h.heartbeat(control, 1)
    data_fetch(h, data, worker=name, incarnation=inc)
    (to, msg, _), = h.take_worker()
    assert to == data and msg.command is Command.CHUNK


def test_the_data_connections_io_thread_runs_io_nice_nicer_and_the_other_contexts_do_not() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = set(os.listdir("/proc/self/task"))
    control = zmq.Context(io_threads=1)
    control.socket(zmq.DEALER).close(0)  # another context's I/O thread
    ctx = data_context()
    try:
        (new,) = _io_threads() - before
        assert os.getpriority(os.PRIO_PROCESS, int(new)) == min(19, mine + IO_NICE)
        started = set(os.listdir("/proc/self/task")) - before - {new}  # the control context's threads
        assert started and all(os.getpriority(os.PRIO_PROCESS, int(tid)) == mine for tid in started)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        ctx.destroy(0)
        control.destroy(0)


# -- staged outputs: the worker's CHUNKs on its data connection (PROTOCOL.md §11.5) ----------------

OUT_JOB = rid(90)
OUTPUT = b"q" * (2 * CHUNK_BYTES + 7)


def pulling(h: Harness) -> tuple[str, bytes, bytes, bytes, list[Message]]:
    """OUT_JOB ran with staged outputs (OUTPUT) and the broker asks for them: its worker's name,
    incarnation, control and data routing ids, and the FETCHes it got."""
    h.request(C1, OUT_JOB, kind="job", argv=["x"], outputs=["o"], need={"gpu_milli": 100, "tenant": "acme"})
    (ident, msg, _), = h.take_worker()
    assert msg.command is Command.DISPATCH
    name, inc, control, data = ("w1", INC1, W1, D1) if ident == W1 else ("w2", INC2, W2, D2)
    h.result(control, OUT_JOB, exit_code=0, files=["o"], staged=[len(OUTPUT)], frames=[b"", b""])
    asks = [m for to, m, _ in h.take_worker() if to == control and m.command is Command.FETCH]
    return name, inc, control, data, asks


def data_chunk(h: Harness, ident: bytes, ask: Message, user: str | None = None, **fields: Any) -> None:
    h.core.now = h.clock.monotonic()
    i, off, n = ask.header["file"], ask.header["offset"], ask.header["nbytes"]
    enc = P.encode(Peer.WORKER, Command.CHUNK, {"id": OUT_JOB, "file": i, "offset": off, **fields},
                   [OUTPUT[off : off + n]])
    h.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2], user)


def test_the_workers_output_chunks_on_its_data_connection_are_taken_and_are_not_its_liveness() -> None:
    h = two_workers()
    name, inc, control, data, asks = pulling(h)
    assert len(asks) == 3 and all(a.header["data"] is True for a in asks)  # "answer on your data connection"
    record = h.core.registry.by_name[name]
    h.advance(2.5)
    heard = record.liveness.last_heard
    for ask in asks:
        data_chunk(h, data, ask, worker=name, incarnation=inc)
    assert record.liveness.last_heard == heard
    assert h.core.counters["output_chunks_on_data"] == 3 and h.core.counters["output_chunks_on_control"] == 0
    loop_turn(h)
    (_, reply, _), = [o for o in h.take_client() if o[1].command is Command.REPLY]
    assert reply.header["staged"] == [len(OUTPUT)]
    h.client(C1, Command.FETCH, {"id": rid(91), "job": OUT_JOB, "file": 0, "offset": 0, "nbytes": len(OUTPUT),
                                 "tenant": "acme"})
    loop_turn(h)
    assert P.as_bytes(h.one_reply(C1).frames[0]) == OUTPUT


@pytest.mark.parametrize("fields, user, why", [
    ({"worker": "nobody", "incarnation": INC1}, None, "an unknown worker name"),
    ({"worker": "w1", "incarnation": INC2}, None, "another process's incarnation"),
    ({"worker": "w1"}, None, "no incarnation"),
    ({"worker": "w1", "incarnation": INC1}, "w2", "another worker's key under CURVE"),
])
def test_an_output_chunk_naming_a_worker_untruly_is_a_bad_message_and_writes_nothing(
        fields: dict[str, Any], user: str | None, why: str) -> None:
    h = two_workers()
    h.core.worker_names_bound = user is not None
    _, _, _, _, asks = pulling(h)
    with pytest.raises(GpudError) as exc:
        data_chunk(h, b"\x00someone", asks[0], user, **fields)
    assert exc.value.code == "INVALID_REQUEST", why
    assert h.core.counters["output_chunks_on_data"] == 0
    pull = h.core.staging.pulls[OUT_JOB]
    assert pull.window.got == 0 and len(pull.window.asked) == 3, why


def test_another_workers_true_chunk_does_not_write_the_outputs_of_a_job_it_did_not_run() -> None:
    h = two_workers()
    name, _, _, _, asks = pulling(h)
    other, inc, data = ("w2", INC2, D2) if name == "w1" else ("w1", INC1, D1)
    data_chunk(h, data, asks[0], worker=other, incarnation=inc)  # bound to ``other``: true, but not its job
    pull = h.core.staging.pulls[OUT_JOB]
    assert h.core.counters["output_chunks_on_data"] == 1 and pull.window.got == 0
