"""A staged job's bytes go only to the worker the job is placed on now (PROTOCOL.md §11.3): a
FETCH that waited for bytes, or one asked again, from a worker the job has left (placed elsewhere,
or taken off a silent worker and queued) is dropped or answered ERROR, never with the bytes."""

from __future__ import annotations

from typing import Any

from gpud import protocol as P
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command
from tests.unit.test_broker_core import W1, W2, Harness
from tests.unit.test_staging import DATA, JOB, put, replies, staged_job


def pipelined(h: Harness) -> None:
    """JOB opened with its first chunk only, and its REQUEST: placed on a worker at once."""
    put(h, 0, sizes=[len(d) for d in DATA])
    put(h, 1, file=0, offset=0, frames=(DATA[0][:4096],))
    staged_job(h)
    replies(h)


def chunks_to(h: Harness, ident: bytes) -> list[bytes]:
    return [P.as_bytes(m.frames[0]) for i, m, _ in h.take_worker() if i == ident and m.command is Command.CHUNK]


def moved_while_its_fetch_waited(**config: Any) -> tuple[Harness, bytes, bytes]:
    """Two workers; JOB pipelined onto one, whose FETCH waits for bytes, then placed on the other
    (it failed on the first before it began). Returns the core, the worker it left, its new one."""
    h = Harness(heartbeat=HeartbeatPolicy(30.0, 3), **config)
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    pipelined(h)
    (first, d, _), = h.take_worker()
    other = W2 if first == W1 else W1
    assert d.command is Command.DISPATCH
    h.worker(first, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})  # waits for the PUT
    assert h.take_worker() == []
    h.result(first, JOB, ok=False, code="REMOTE_ERROR", message="cannot set the job up")  # placed elsewhere
    (again, d2, _), = h.take_worker()
    assert again == other and d2.command is Command.DISPATCH
    return h, first, other


def test_a_fetch_that_waited_on_the_worker_a_job_left_gets_none_of_its_bytes() -> None:
    h, _, other = moved_while_its_fetch_waited()
    put(h, 2, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    assert h.take_worker() == []  # the worker it left waited for these: it gets nothing
    assert h.core.staging.spool.uploads[JOB].waiting == []
    h.worker(other, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})
    assert chunks_to(h, other) == [DATA[0][4096:8192]]  # its worker now gets them


def test_a_worker_a_job_was_taken_off_while_silent_gets_none_of_its_bytes_when_it_is_back() -> None:
    h = Harness(heartbeat=HeartbeatPolicy(1.0, 3), stage_idle_s=60.0)
    h.ready(W1, "w1")
    h.take_worker()
    pipelined(h)
    h.one_dispatch(W1)
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 4096, "nbytes": 4096})  # waits for the PUT
    h.tick(4.0)  # silent past its liveness: suspended, its job (not begun) queued again, never on w1
    task = h.core.tasks.tasks[JOB]
    assert h.core.registry.by_name["w1"].suspended_at and task.state.value == "queued"
    put(h, 2, file=0, offset=4096, frames=(DATA[0][4096:8192],))
    assert chunks_to(h, W1) == []  # the FETCH it sent while the job was its own is dropped
    h.heartbeat(W1, 1)  # back: its work stays on it, but this job is no longer its
    h.worker(W1, Command.FETCH, {"id": JOB, "file": 0, "offset": 0, "nbytes": 4096})
    out = [m for i, m, _ in h.take_worker() if i == W1 and m.command in (Command.CHUNK, Command.ERROR)]
    assert [m.command for m in out] == [Command.ERROR] and out[0].header["id"] == JOB


def test_a_fetch_left_waiting_by_the_worker_a_job_left_does_not_take_it_off_its_new_worker() -> None:
    h, _, other = moved_while_its_fetch_waited(stage_idle_s=5.0, stage_ttl=60.0)
    h.tick(6.0)  # past stage_idle since the worker it left began to wait; its new worker has not waited
    assert h.take_worker() == []  # not taken off its new worker ("too slow")
    task = h.core.tasks.tasks[JOB]
    assert task.state.value == "running" and task.worker == h.core.registry.get(other).name
    assert h.core.staging.spool.uploads[JOB].waiting == []
