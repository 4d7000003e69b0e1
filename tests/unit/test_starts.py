"""START and GO (PROTOCOL.md §4.4): the broker knows exactly which of a worker's jobs may have
begun, and a worker's loss fails only those. The broker core driven with a fake clock: the races of
§4.4 one by one, standalone and as a pair (the worker's side of the gate is in test_jobs.py).
"""

from __future__ import annotations

from gpud import protocol as P
from gpud.protocol import Command
from gpud_broker import replication
from gpud_broker.tasks import State
from tests.unit.test_broker_core import C1, W1, W2, W3, Harness, error_code, rid
from tests.unit.test_replication import confirm, dispatched, pair, session_on_w1, ship, take_over

JOB = {"kind": "job", "argv": ["/bin/sh", "-c", "date > started"], "need": {"gpu_milli": 100}}


def start(h: Harness, ident: bytes, *ids: bytes) -> None:
    h.worker(ident, Command.START, {"ids": list(ids)})


def gos(h: Harness) -> list[tuple[bytes, list[bytes], list[bytes]]]:
    """(worker, ids told GO, ids refused) of every GO sent since the last look."""
    return [(i, m.header["ids"], m.header.get("refused", [])) for i, m, _ in h.take_worker() if m.command is Command.GO]


def lose(h: Harness, ident: bytes) -> None:
    worker = h.core.registry.get(ident)
    assert worker is not None
    h.core.workers.lost(worker, "killed")


# --------------------------------------------------------------------------- standalone


def test_only_jobs_told_go_fail_when_their_worker_is_lost_the_rest_go_to_the_replica() -> None:
    h = Harness()
    h.ready(W1, "w1")
    for n in (1, 2, 3):
        h.request(C1, rid(n), **JOB)
    h.ready(W2, "w2", replica_of="w1")
    h.ready(W3, "w3")
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 500  # the policy alone would pick w3
    assert dispatched(h) == [(W1, rid(1)), (W1, rid(2)), (W1, rid(3))]
    start(h, W1, rid(1))
    assert gos(h) == [(W1, [rid(1)], [])]  # no peer: GO at once
    start(h, W1, rid(2))  # asked, and its GO went out ... but job 3 never got its turn
    assert gos(h) == [(W1, [rid(2)], [])]
    lose(h, W1)
    replies = {m.header["id"]: m for _, m, _ in h.take_client()}
    assert set(replies) == {rid(1), rid(2)}
    assert all(error_code(m) == "WORKER_LOST" for m in replies.values())
    assert dispatched(h) == [(W2, rid(3))]  # not idempotent, never began: placed again, replica first
    task = h.core.tasks.tasks[rid(3)]
    assert task.state is State.RUNNING and task.started is False and task.attempts == 2 and "w1" in task.avoid
    start(h, W2, rid(3))
    assert gos(h) == [(W2, [rid(3)], [])]
    h.result(W2, rid(3), exit_code=0)
    assert h.one_reply(C1).header["exit_code"] == 0
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 0
    h.assert_idle()


def test_a_job_that_never_began_is_failed_only_past_the_retry_bound() -> None:
    h = Harness(max_attempts=2)
    for ident, name in ((W1, "w1"), (W2, "w2"), (W3, "w3")):
        h.ready(ident, name)
    h.request(C1, rid(1), **JOB)
    first = dispatched(h)
    assert len(first) == 1
    lose(h, first[0][0])
    second = dispatched(h)
    assert len(second) == 1 and second[0][0] != first[0][0] and h.take_client() == []
    lose(h, second[0][0])
    reply = h.one_reply(C1)
    assert error_code(reply) == "WORKER_LOST" and "after 2 attempts" in reply.header["message"]
    assert dispatched(h) == []


def test_a_worker_that_reconnects_is_refused_the_jobs_placed_again_elsewhere() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 500
    h.request(C1, rid(1), **JOB)
    assert dispatched(h) == [(W1, rid(1))]
    h.advance(3.0)  # w1 falls silent (its loop starved, say) while its job waits for its turn
    h.heartbeat(W2, 1)
    h.tick(0.5)
    assert dispatched(h) == [(W2, rid(1))]
    reconnected = b"conn-w1-again"
    h.ready(reconnected, "w1")
    h.take_worker()
    start(h, reconnected, rid(1))  # the job thread of the old connection still asks
    assert gos(h) == [(reconnected, [], [rid(1)])]  # refused: it must never begin there
    start(h, W2, rid(1))
    assert gos(h) == [(W2, [rid(1)], [])]
    h.result(W2, rid(1), exit_code=0)
    assert h.one_reply(C1).header["ok"] is True


def test_a_start_for_anything_but_a_job_running_on_that_worker_is_refused() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 500
    h.request(C1, rid(1), **JOB)  # on w1
    h.request(C1, rid(2))  # an echo: never asks
    h.take_worker()
    h.worker(W2, Command.START, {"ids": [rid(1), rid(2), rid(9), "not-bytes", 7]})
    assert gos(h) == [(W2, [], [rid(1), rid(2), rid(9)])]
    h.worker(W1, Command.START, {"ids": "not a list"})
    assert gos(h) == []
    assert h.core.tasks.tasks[rid(1)].started is False


def test_a_job_asked_again_gets_go_again_and_is_marked_once() -> None:
    a, b = pair()
    a.ready(W1, "w1")
    a.request(C1, rid(1), **JOB)
    a.take_worker()
    start(a, W1, rid(1))
    start(a, W1, rid(1))
    assert [u[0] for u in a.core.journal.updates].count(replication.START) == 1
    a.core.set_durable(a.core.seq)
    assert a.core.take_go() and a.core.take_go() == {}


# --------------------------------------------------------------------------- the pair


def asked_in_a_pair() -> tuple[Harness, Harness]:
    """A pair (active a, passive b) both knowing w1, which runs job 1 and has asked its START."""
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
    a.request(C1, rid(1), **JOB)
    a.take_worker()
    start(a, W1, rid(1))
    return a, b


def test_go_waits_until_the_passive_holds_the_mark() -> None:
    a, b = asked_in_a_pair()
    assert gos(a) == [] and a.core.take_go() == {}  # journalled, not yet held by the peer
    ship(a, b)
    assert b.core.tasks.tasks[rid(1)].started is True
    a.core.set_durable(a.core.seq)
    go = a.core.take_go()
    assert list(go) == [W1] and P.unpackb(go[W1][2]) == {"ids": [rid(1)]}
    assert a.core.take_go() == {}


def test_a_worker_lost_after_asking_and_before_the_go_loses_nothing() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
        h.ready(W2, "w2", replica_of="w1")
    a.core.registry.by_name["w2"].gpus[0].granted_milli = 500  # w1 first
    a.request(C1, rid(1), **JOB)
    assert dispatched(a) == [(W1, rid(1))]
    start(a, W1, rid(1))
    ship(a, b)  # the peer holds the mark ...
    lose(a, W1)  # ... but w1 dies before the GO went out
    assert a.take_client() == []
    assert dispatched(a) == [(W2, rid(1))]  # placed again: it never began
    a.core.set_durable(a.core.seq)
    assert a.core.take_go() == {}  # no GO for the lost worker's old ask
    ship(a, b)
    assert b.core.tasks.tasks[rid(1)].started is False  # the 'run' update cleared the mark
    assert b.core.tasks.tasks[rid(1)].worker == "w2"


def test_after_a_failover_marked_jobs_may_have_begun_the_others_never_did() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
        h.ready(W2, "w2", replica_of="w1")
    a.core.registry.by_name["w2"].gpus[0].granted_milli = 500
    b.core.registry.by_name["w2"].gpus[0].granted_milli = 500
    for n in (1, 2, 3):
        a.request(C1, rid(n), **JOB)
    assert [i for i, _ in dispatched(a)] == [W1, W1, W1]
    start(a, W1, rid(1))  # marked and durable: its GO went out (or was about to)
    ship(a, b)
    a.core.set_durable(a.core.seq)
    assert list(a.core.take_go()) == [W1]
    start(a, W1, rid(2))  # marked, but the active dies before it reaches the peer: no GO was sent
    a.core.take_updates()
    take_over(b)
    b.core.workers.lost(b.core.registry.by_name["w1"], "not connected after the failover")
    done = b.core.tasks.tasks[rid(1)]  # kept for the client's retry (routes do not travel)
    assert done.state is State.DONE and done.reply is not None
    assert P.unpackb(done.reply[2])["code"] == "WORKER_LOST"
    for n in (2, 3):  # placed again, never on w1: queued while the new broker settles
        task = b.core.tasks.tasks[rid(n)]
        assert task.state is State.QUEUED and task.avoid == {"w1"} and task.started is False
    b.take_worker()
    confirm(b, W2)
    assert sorted(dispatched(b)) == [(W2, rid(2)), (W2, rid(3))]


def test_a_go_lost_in_a_failover_is_given_again_by_the_new_active_broker() -> None:
    a, b = asked_in_a_pair()
    ship(a, b)
    a.core.set_durable(a.core.seq)  # the GO is due; the active dies before sending it
    take_over(b)
    b.take_worker()
    start(b, W1, rid(1))  # the worker asks the new active broker (after its first heartbeat)
    b.core.set_durable(b.core.seq)
    go = b.core.take_go()
    assert list(go) == [W1] and P.unpackb(go[W1][2]) == {"ids": [rid(1)]}
    confirm(b, W1, running=[{"id": rid(1), "kind": "job"}])
    b.result(W1, rid(1), exit_code=0)
    b.client(C1, Command.REQUEST, {"id": rid(1), **JOB})  # the client's retry attaches
    assert b.one_reply(C1).header["exit_code"] == 0


def test_a_passive_broker_ignores_start_and_the_mark_travels_in_the_snapshot() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
    a.request(C1, rid(1), **JOB)
    a.take_worker()
    ship(a, b)
    b.take_worker()
    start(b, W1, rid(1))
    assert gos(b) == [] and b.core.tasks.tasks[rid(1)].started is False
    start(a, W1, rid(1))
    c = Harness()
    c.core.become_passive()
    c.core.load(P.unpackb(P.packb(a.core.snapshot())), c.clock.monotonic())
    assert c.core.tasks.tasks[rid(1)].started is True


# --------------------------------------------------------------------------- sessions and calls


def test_a_session_whose_opening_was_never_answered_opens_on_the_replica() -> None:
    h = session_on_w1()
    lose(h, W1)
    assert h.take_client() == [] and dispatched(h) == [(W2, rid(1))]
    h.result(W2, rid(1), session=rid(1))
    assert h.one_reply(C1).header["ok"] is True and h.core.sessions[rid(1)].worker == "w2"


def test_queued_calls_of_a_lost_session_get_session_lost_and_its_replacement_the_replica() -> None:
    h = session_on_w1()
    h.result(W1, rid(1), session=rid(1))
    h.take_client()
    for n in (2, 3):  # a running call and one queued behind it on the worker
        h.client(C1, Command.CALL, {"id": rid(n), "session": rid(1), "op": "sync"})
    assert dispatched(h) == [(W1, rid(2)), (W1, rid(3))]
    lose(h, W1)
    replies = {m.header["id"]: error_code(m) for _, m, _ in h.take_client()}
    assert replies == {rid(2): "SESSION_LOST", rid(3): "SESSION_LOST"}  # the library replays both
    h.request(C1, rid(4), kind="session", need={"gpu_milli": 100}, replaces=rid(1))
    assert dispatched(h) == [(W2, rid(4))]
