"""Every broker ACKs the RESULTs it takes (PROTOCOL.md §9.4): a standalone one in the loop turn a
RESULT came, one ACK per worker naming every id due; a RESULT sent again (its ACK lost) is answered
to its client once and ACKed again, so that its worker lets go of it.

BrokerCore driven directly on a fake clock (the harness of ``test_broker_core``), standalone.
"""

from __future__ import annotations

from gpud.protocol import Command
from tests.unit.test_broker_core import C1, C2, W1, W2, Harness, rid
from tests.unit.test_worker_resume import INC, resume_ready


def test_acks_of_one_turn_go_as_one_per_worker_in_the_order_taken() -> None:
    h = Harness()
    h.ready(W1, "w1", ngpus=2)
    h.ready(W2, "w2", ngpus=2)
    for n in range(1, 5):
        h.request(C1, rid(n))
    placed = {m.header["id"]: who for who, m, _ in h.take_worker() if m.command is Command.DISPATCH}
    assert len(placed) == 4 and h.core.take_acks() == {}  # nothing taken yet: nothing owed
    for n in (3, 1, 4, 2):
        h.result(placed[rid(n)], rid(n))
    want: dict[bytes, list[bytes]] = {}
    for n in (3, 1, 4, 2):
        want.setdefault(placed[rid(n)], []).append(rid(n))
    assert h.core.take_acks() == want
    assert h.core.take_acks() == {}  # each once
    assert len(h.take_client()) == 4


def echo_on_w1() -> Harness:
    """Worker w1 ready, and echo rid(1) of C1 dispatched to it."""
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    h.request(C1, rid(1))
    h.one_dispatch(W1)
    return h


def test_a_result_sent_again_after_its_ack_was_lost_is_answered_once_and_acked_again() -> None:
    h = echo_on_w1()
    h.result(W1, rid(1), frames=[b"first"])
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1)
    assert h.core.take_acks() == {W1: [rid(1)]}
    # The ACK is lost (the connection broke): the worker, welcomed again, sends its copy again.
    h.result(W1, rid(1), frames=[b"again"])
    assert h.take_client() == []  # answered already: dropped
    assert h.core.take_acks() == {W1: [rid(1)]}  # but ACKed, so the worker lets go of it
    # The client's retry still gets the first answer.
    h.request(C1, rid(1))
    again = h.one_reply(C1)
    assert again.header["id"] == rid(1) and [bytes(f) for f in again.frames] == [b"first"]
    h.assert_idle()


def test_a_held_result_the_broker_took_is_named_in_stop_and_one_it_did_not_take_stays_bound() -> None:
    h = Harness()
    h.ready(W1, "w1", ngpus=2, incarnation=INC)
    h.take_worker()
    taken, lost = rid(1), rid(2)
    h.request(C1, taken, kind="job", argv=["a"])
    h.request(C2, lost, kind="job", argv=["b"])
    assert [m.header["id"] for _, m, _ in h.take_worker()] == [taken, lost]
    h.worker(W1, Command.START, {"ids": [taken, lost]})
    h.take_worker()
    h.result(W1, taken, exit_code=0)  # taken; its ACK is lost with the connection
    assert h.one_reply(C1).header["id"] == taken
    h.core.take_acks()
    # The same process on a new connection holds both RESULTs (the second never arrived).
    new = b"conn-w1-new"
    welcome = resume_ready(h, new, holds=[taken, lost])
    assert welcome.header["resumed"] is True and welcome.header["acks"] is True
    assert welcome.header["stop"] == [taken]  # the broker has it: the worker lets go of its copy
    assert list(h.core.registry.by_name["w1"].assigned) == [lost] and h.take_client() == []
    h.result(new, lost, exit_code=3)  # re-sent after the WELCOME
    assert h.one_reply(C2).header["exit_code"] == 3
    assert h.core.take_acks() == {new: [lost]}
    h.assert_idle()


def test_a_result_refused_not_active_is_not_acked() -> None:
    h = echo_on_w1()
    h.result(W1, rid(1), ok=False, code="NOT_ACTIVE", message="epoch 9 is active")
    assert h.core.take_acks() == {} and h.core.fenced  # the worker keeps it for the active broker
