"""A RESULT for an id the broker does not know (PROTOCOL.md §9.4): kept as a finished reply for
its client's retry (after a failover it is the answer to work the old active broker dispatched),
but a worker is not a tenant: what it makes the broker keep so is bounded, pushes no tenant's
replies out of the reply store, and brings back no reply dropped early. It is ACKed either way,
so that the worker lets go of it (a RESULT re-sent after its task was answered and forgotten).

BrokerCore driven directly on a fake clock (the harness of ``test_broker_core``), standalone."""

from __future__ import annotations

from gpud_broker.results import MAX_UNKNOWN_KEPT
from tests.unit.test_broker_core import C1, W1, Harness, rid

KiB = 1 << 10


def with_w1(**config: object) -> Harness:
    h = Harness(**config)
    h.ready(W1, "w1", ngpus=2)
    h.take_worker()
    return h


def answered(h: Harness, r: bytes, kind: str = "echo", nbytes: int = 100 * KiB) -> bytes:
    """Request ``r`` of tenant acme, run on w1 and answered with ``nbytes`` of payload."""
    fields = {"argv": ["x"]} if kind == "job" else {}
    h.request(C1, r, kind=kind, need={"tenant": "acme"}, **fields)
    h.one_dispatch(W1)
    payload = bytes([r[-1]]) * nbytes
    h.result(W1, r, frames=[payload] if kind == "echo" else [payload, b""], tenant="acme")
    assert h.one_reply(C1).header["ok"] is True
    return payload


def test_a_workers_results_for_unknown_ids_push_no_tenants_replies_out_and_are_all_acked() -> None:
    h = with_w1(result_bytes=8 << 20)  # acme's share of the reply store: 2 MiB
    mine = answered(h, rid(1))
    h.core.take_acks()
    flood = [rid(1000 + n) for n in range(MAX_UNKNOWN_KEPT + 100)]
    for r in flood:  # 64 KiB each, naming acme: far past its share
        h.result(W1, r, frames=[b"f" * (64 * KiB)], tenant="acme")
    h.tick(0.0)  # the reply store evicts what is over a share
    assert h.core.take_acks() == {W1: flood}  # every one ACKed: the worker keeps none
    assert h.core.tasks.held_by("acme") <= 2 << 20
    kept = [r for r in flood if r in h.core.tasks.tasks]
    remembered = [r for r in flood if r in h.core.tasks.expired]  # over the share: RESULT_EXPIRED for a retry
    assert kept and remembered and len(kept) + len(remembered) == MAX_UNKNOWN_KEPT  # the rest: nothing at all
    h.request(C1, rid(1), need={"tenant": "acme"})  # acme's own reply is still there for its retry
    again = h.one_reply(C1)
    assert [bytes(f) for f in again.frames] == [mine]


def test_a_result_resent_for_a_reply_dropped_early_brings_it_back_not() -> None:
    h = with_w1(result_bytes=4 << 20)  # acme's share: 1 MiB
    answered(h, rid(1), kind="job", nbytes=600 * KiB)
    second = answered(h, rid(2), kind="job", nbytes=300 * KiB)
    answered(h, rid(3), kind="job", nbytes=300 * KiB)
    h.tick(0.0)  # over acme's share: rid(1), its oldest, is dropped early (a job: not run again)
    assert rid(1) in h.core.tasks.expired
    h.core.take_acks()
    h.result(W1, rid(1), frames=[b"y" * (600 * KiB), b""], tenant="acme")  # re-sent: its ACK was lost
    assert h.core.take_acks() == {W1: [rid(1)]}
    h.tick(0.0)
    h.request(C1, rid(1), kind="job", argv=["x"], need={"tenant": "acme"})
    assert h.one_reply(C1).header["code"] == "RESULT_EXPIRED"  # still: it is not brought back
    h.request(C1, rid(2), kind="job", argv=["x"], need={"tenant": "acme"})
    assert [bytes(f) for f in h.one_reply(C1).frames][0] == second  # and pushed out nothing


def test_a_result_resent_after_its_task_was_answered_and_forgotten_is_acked() -> None:
    h = with_w1(result_ttl=60.0)
    answered(h, rid(1))
    h.core.take_acks()
    h.tick(61.0)  # past result_ttl: forgotten
    assert rid(1) not in h.core.tasks.tasks
    h.result(W1, rid(1), frames=[b"late"], tenant="acme")
    assert h.core.take_acks() == {W1: [rid(1)]}
    assert h.take_client() == []


def test_a_result_for_an_unknown_id_over_its_tenants_full_share_is_not_run_again_on_a_retry() -> None:
    h = with_w1(result_bytes=4 << 20)  # acme's share: 1 MiB
    answered(h, rid(1), kind="job", nbytes=900 * KiB)
    h.core.take_acks()
    lost = rid(7)  # after a failover: work the old active broker dispatched, unknown here
    h.result(W1, lost, frames=[b"z" * (300 * KiB), b""], tenant="acme")
    assert h.core.take_acks() == {W1: [lost]}
    h.tick(0.0)
    h.request(C1, lost, kind="job", argv=["x"], need={"tenant": "acme"})  # its client's retry
    assert h.one_reply(C1).header["code"] == "RESULT_EXPIRED"  # it ran: not run again
    assert h.take_worker() == []
    h.request(C1, rid(1), kind="job", argv=["x"], need={"tenant": "acme"})
    assert h.one_reply(C1).header["ok"] is True  # and acme's own reply is still kept
