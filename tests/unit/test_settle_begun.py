"""Settling after a takeover (PROTOCOL.md §9.4) never begins a job a second time: a job marked
started (told GO, §4.4) that its worker's first HEARTBEAT at the new epoch does not list (neither
running nor as a RESULT re-sent before that HEARTBEAT) was lost on that worker (it restarted, or
forgot it). Dispatched again it would run twice; it ends WORKER_LOST, or is placed again elsewhere
when ``idempotent`` (§4.3). A job never told GO is dispatched again to the same worker, as before.

BrokerCore pair driven directly on a fake clock (the harnesses of test_broker_core and
test_replication): the worker's messages are spoken by hand.
"""

from __future__ import annotations

from gpud import protocol as P
from gpud.protocol import Command
from gpud_broker.tasks import State
from tests.unit.test_broker_core import C1, C2, W1, W2, Harness, rid
from tests.unit.test_replication import confirm, dispatched, pair, ship, take_over

PLAIN, IDEM, NOGO, STILL, ENDED = rid(1), rid(2), rid(3), rid(4), rid(5)


def pair_with_w2_busy(milli: int) -> tuple[Harness, Harness]:
    """A pair, w1 and w2 ready at both; w2's GPU has ``milli`` granted (so w1 sorts first)."""
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
        h.ready(W2, "w2")
        h.core.registry.by_name["w2"].gpus[0].granted_milli = milli
    a.take_worker()
    return a, b


def on_w1_before_the_takeover() -> tuple[Harness, Harness]:
    """On w1, through a: PLAIN, IDEM (idempotent), STILL and ENDED told GO, NOGO dispatched and
    never asked START; b holds every mark; w2, busy then, sorts after w1."""
    a, b = pair_with_w2_busy(600)
    a.request(C1, PLAIN, kind="job", argv=["train.py"], need={"gpu_milli": 100})
    a.request(C2, IDEM, kind="job", argv=["render.py"], idempotent=True, need={"gpu_milli": 100})
    a.request(C1, NOGO, kind="job", argv=["later.py"], need={"gpu_milli": 100})
    a.request(C2, STILL, kind="job", argv=["long.py"], need={"gpu_milli": 100})
    a.request(C1, ENDED, kind="job", argv=["quick.py"], need={"gpu_milli": 100})
    assert dispatched(a) == [(W1, PLAIN), (W1, IDEM), (W1, NOGO), (W1, STILL), (W1, ENDED)]
    a.worker(W1, Command.START, {"ids": [PLAIN, IDEM, STILL, ENDED]})
    ship(a, b)
    a.core.set_durable(a.core.seq)
    assert list(a.core.take_go()) == [W1]  # told GO: each may have begun
    for r in (PLAIN, IDEM, STILL, ENDED):
        assert b.core.tasks.tasks[r].started
    assert not b.core.tasks.tasks[NOGO].started
    a.take_client()
    return a, b


def code_of(h: Harness, r: bytes) -> str:
    task = h.core.tasks.tasks[r]
    assert task.state is State.DONE and task.reply is not None
    code: str = P.unpackb(task.reply[2]).get("code", "OK")
    return code


def test_a_begun_job_its_worker_no_longer_holds_is_lost_not_dispatched_again() -> None:
    _, b = on_w1_before_the_takeover()
    take_over(b)
    # w1's RESULT of ENDED (kept unacknowledged) comes before its first HEARTBEAT at the new epoch.
    b.result(W1, ENDED, exit_code=0)
    b.core.registry.by_name["w2"].gpus[0].granted_milli = 0
    confirm(b, W1, running=[{"id": STILL, "kind": "job", "tenant": "default"}])
    confirm(b, W2)
    sent = dispatched(b)
    assert (W1, PLAIN) not in sent and (W1, IDEM) not in sent  # neither begins a second time on w1
    assert (W1, NOGO) in sent  # never told GO: w1 runs it now, once
    assert (W2, IDEM) in sent  # idempotent: placed again, elsewhere
    assert code_of(b, PLAIN) == "WORKER_LOST"
    assert code_of(b, ENDED) == "OK"
    still = b.core.tasks.tasks[STILL]
    assert still.state is State.RUNNING and still.worker == "w1" and still.started
    idem = b.core.tasks.tasks[IDEM]
    assert idem.state is State.RUNNING and idem.worker == "w2" and idem.avoid == {"w1"} and not idem.started
    w1 = b.core.registry.by_name["w1"]
    assert sorted(w1.assigned) == sorted([NOGO, STILL])
    assert b.core.registry.gpus["GPU-w1-0"].granted_milli == 200  # PLAIN's and IDEM's shares refunded
    # PLAIN's client's retry gets the answer, not a run.
    b.request(C1, PLAIN, kind="job", argv=["train.py"], need={"gpu_milli": 100})
    reply = b.one_reply(C1)
    assert reply.header["ok"] is False and reply.header["code"] == "WORKER_LOST"
    assert b.take_worker() == []


def test_a_worker_heard_only_after_settling_timed_out_gets_no_begun_job_again() -> None:
    _, b = on_w1_before_the_takeover()
    take_over(b)
    confirm(b, W2)
    b.tick(2.5)  # settling times out: w1 has not answered at the new epoch
    assert not b.core.settling
    sent = dispatched(b)
    assert (W1, NOGO) in sent and all(r == NOGO for who, r in sent if who == W1)
    assert b.core.tasks.tasks[PLAIN].state is State.RUNNING  # not judged before w1 is heard
    b.result(W1, ENDED, exit_code=0)
    confirm(b, W1, running=[{"id": STILL, "kind": "job"}, {"id": NOGO, "kind": "job"}])
    assert code_of(b, PLAIN) == "WORKER_LOST"
    assert code_of(b, ENDED) == "OK"
    assert b.core.tasks.tasks[STILL].state is State.RUNNING
    assert b.core.tasks.tasks[IDEM].state is not State.DONE and b.core.tasks.tasks[IDEM].worker != "w1"
    # Only the first heartbeat at the new epoch is read so: later ones judge nothing.
    assert b.result(W1, STILL, exit_code=0) and code_of(b, STILL) == "OK"
    confirm(b, W1, running=[])
    assert b.core.tasks.tasks[NOGO].state is State.RUNNING


def test_a_begun_job_its_worker_still_lists_runs_on_untouched() -> None:
    _, b = on_w1_before_the_takeover()
    take_over(b)
    listed = [{"id": r, "kind": "job"} for r in (PLAIN, IDEM, NOGO, STILL, ENDED)]
    confirm(b, W1, running=listed)
    confirm(b, W2)
    for r in (PLAIN, IDEM, NOGO, STILL, ENDED):
        task = b.core.tasks.tasks[r]
        assert task.state is State.RUNNING and task.worker == "w1", r
    assert b.take_client() == []
