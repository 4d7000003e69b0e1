"""The ACK of a RESULT whose outputs are staged (PROTOCOL.md §9.4, §11.5) goes the way every ACK
goes: owed in ``core.unacked``, sent in the loop turn's batch (``take_acks``: one ACK per worker
naming every id due), and, with a passive peer, only once the peer holds what the result changed.

BrokerCore driven directly on a fake clock (the harness of ``test_broker_core``); the pair's
durability is the journal's ``durable`` mark, set as the peer's ``applied`` would set it."""

from __future__ import annotations

from gpud.protocol import Command
from gpud_broker.replication import Journal
from tests.unit.test_broker_core import C1, W1, Harness, rid
from tests.unit.test_staging import loop_turn, pull_all

OUT = [b"p" * 5]


def staged_result_and_an_echo(h: Harness) -> tuple[bytes, bytes]:
    """A job with staged outputs and an echo, both on W1; the job's RESULT comes, then the echo's."""
    h.ready(W1, "w1")
    h.take_worker()
    job, echo = rid(60), rid(61)
    h.request(C1, job, kind="job", argv=["x"], outputs=["o"], need={"gpu_milli": 100, "tenant": "acme"})
    h.request(C1, echo)
    assert len([m for _, m, _ in h.take_worker() if m.command is Command.DISPATCH]) == 2
    h.result(W1, job, exit_code=0, files=["o"], staged=[len(OUT[0])], frames=[b"", b""])
    return job, echo


def test_a_standalone_brokers_ack_of_staged_outputs_goes_in_the_turns_batch() -> None:
    h = Harness()
    job, echo = staged_result_and_an_echo(h)
    assert h.core.take_acks() == {}  # not before its outputs are held
    _, sent = pull_all(h, job, OUT)
    h.core.staging.spool.io.stop()
    h.core.staging.settle_pulls(h.core, h.core.journal.durable)
    h.result(W1, echo)
    sent += [m for _, m, _ in h.take_worker()]
    assert [m.command for m in sent] == []  # no ACK of its own, outside the turn's batch
    assert h.core.take_acks() == {W1: [job, echo]}  # one ACK naming both, in the order taken
    assert [m.header["ok"] for _, m, _ in h.take_client()] == [True, True]


def test_with_a_passive_peer_the_ack_of_staged_outputs_waits_until_the_peer_holds_the_reply() -> None:
    h = Harness()
    core = h.core
    core.journal, core.acking = Journal(), True  # active, its peer connected and passive
    job, _ = staged_result_and_an_echo(h)
    while core.staging.pulls:  # each chunk asked for once the one before is at the peer
        pull_all(h, job, OUT)
        core.set_durable(core.journal.seq)
        loop_turn(h)
    (_, reply, _), = [o for o in h.take_client() if o[1].header["id"] == job]
    assert reply.header["ok"] is True
    assert core.take_acks() == {}  # the client has its answer; the peer does not hold it yet
    assert [m.command for _, m, _ in h.take_worker()] == []
    core.set_durable(core.journal.seq)  # the peer applied the reply
    assert core.take_acks() == {W1: [job]}
