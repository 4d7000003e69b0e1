"""The broker pair's core, with no sockets: an active core's journal applied to a passive core,
takeover, settling, orphan results, ACKs only once durable, fencing, replica-first placement.

Two Harness cores share one fake clock's readings; the "wire" between them is ``P.packb`` of the
journal, as the pair shell sends it (PROTOCOL.md §9.3).
"""

from __future__ import annotations

from typing import Any

from gpud import protocol as P
from gpud.protocol import Command
from gpud.resources import TenantLimits
from gpud_broker.replication import Journal
from gpud_broker.tasks import State
from tests.unit.test_broker_core import C1, C2, W1, W2, W3, Harness, rid


def dispatched(h: Harness) -> list[tuple[bytes, bytes]]:
    return [(i, m.header["id"]) for i, m, _ in h.take_worker() if m.command is Command.DISPATCH]


def session_on_w1() -> Harness:
    """Session 1 dispatched to w1; w2 is w1's replica, w3 looks better to the policy."""
    h = Harness()
    h.ready(W1, "w1")
    h.request(C1, rid(1), kind="session", need={"gpu_milli": 100})
    h.ready(W2, "w2", replica_of="w1")
    h.ready(W3, "w3")
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 800  # w3 looks better to the policy
    assert dispatched(h) == [(W1, rid(1))]
    return h


def pair(**config: Any) -> tuple[Harness, Harness]:
    """An active core with a journal, and a passive core loaded from its (empty) snapshot."""
    a, b = Harness(**config), Harness(**config)
    a.core.journal = Journal()
    a.core.acking = True  # as the pair shell sets (join_pair)
    b.core.join_pair()
    b.core.load(P.unpackb(P.packb(a.core.snapshot())), b.clock.monotonic())
    return a, b


def ship(a: Harness, b: Harness) -> int:
    """Send a's journal to b as one UPDATES batch (through msgpack); returns how many updates."""
    updates = P.unpackb(P.packb(a.core.take_updates()))
    b.core.apply(updates, b.clock.monotonic())
    return len(updates)


def take_over(b: Harness, epoch: int = 3) -> None:
    b.to_worker.clear()  # WELCOMEs and heartbeats of the passive days
    b.core.take_over(epoch, 2.0, b.clock.monotonic())


def confirm(b: Harness, ident: bytes, running: list[dict[str, Any]] | None = None, epoch: int = 3) -> None:
    """A worker's first heartbeat at the new epoch (what ends settling)."""
    b.heartbeat(ident, 99, epoch=epoch, running=running or [])


def test_the_passive_holds_queued_running_done_and_sessions() -> None:
    a, b = pair()
    a.ready(W1, "w1")
    b.ready(W1, "w1")
    a.request(C1, rid(1), frames=[b"ran"])  # dispatched
    a.request(C1, rid(2), kind="session")  # dispatched
    a.take_worker()
    a.result(W1, rid(1), frames=[b"ran"])
    a.result(W1, rid(2), session=rid(2))
    a.request(C1, rid(3), frames=[b"later"], need={"gpus": 2})  # cannot fit one worker: NO_CAPACITY
    assert ship(a, b) > 0
    t = b.core.tasks.tasks
    assert t[rid(1)].state is State.DONE and t[rid(1)].reply is not None
    assert rid(2) in b.core.sessions and b.core.sessions[rid(2)].worker == "w1"
    assert rid(3) not in t  # refused at the door: forgotten on both
    assert b.core.registry.gpus["GPU-w1-0"].granted_milli == 0  # the passive ledger stays empty


def test_takeover_rebuilds_the_ledger_settles_then_redispatches_what_ran() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
    a.request(C1, rid(1), kind="job", argv=["true"], need={"gpu_milli": 300})
    a.request(C1, rid(2), kind="session", need={"gpu_milli": 100})
    a.take_worker()
    a.result(W1, rid(2), session=rid(2))
    ship(a, b)
    take_over(b)
    assert b.core.active and b.core.epoch == 3 and b.core.hold
    g = b.core.registry.gpus["GPU-w1-0"]
    assert (g.granted_milli, g.tasks) == (400, 2)  # the running job and the session
    beats = b.take_worker(heartbeats=True)
    assert [(m.command, m.header["active"], m.header["epoch"]) for _, m, _ in beats] == [(Command.HEARTBEAT, True, 3)]
    b.request(C2, rid(3))  # new work waits while settling
    assert b.take_worker() == []
    confirm(b, W1, running=[{"id": rid(1), "kind": "job"}])
    out = b.take_worker()
    ids = sorted(m.header["id"] for _, m, _ in out)
    assert ids == [rid(1), rid(3)]  # the job again (the worker ignores a duplicate), then the echo
    assert all(m.header["epoch"] == 3 for _, m, _ in out)
    b.result(W1, rid(1), exit_code=0)
    b.client(C1, Command.REQUEST, {"id": rid(1), "kind": "job", "argv": ["true"]})  # the client's retry
    assert b.one_reply(C1).header["ok"] is True


def test_tenant_limits_count_what_a_takeover_restores() -> None:
    a, b = pair(tenant_limits={"alice": TenantLimits(max_sessions=1)})
    for h in (a, b):
        h.ready(W1, "w1")
    a.request(C1, rid(1), kind="session", need={"tenant": "alice"})
    a.take_worker()
    a.result(W1, rid(1), session=rid(1))
    ship(a, b)
    take_over(b)
    confirm(b, W1, running=[{"id": rid(1), "kind": "session"}])
    assert b.core.accounts.usage["alice"].sessions == 1  # her session, granted by the other broker
    b.take_worker()
    b.request(C1, rid(2), kind="session", need={"tenant": "alice"})
    assert b.take_worker() == [] and b.take_client() == []  # over her limit: it waits
    b.client(C1, Command.CALL, {"id": rid(3), "session": rid(1), "op": "close"})
    b.one_dispatch(W1)
    b.result(W1, rid(3))
    assert b.one_dispatch(W1).header["id"] == rid(2)  # her first closed: the second opens


def test_a_result_for_work_the_new_broker_never_heard_of_is_kept_for_the_retry() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
    a.request(C1, rid(1), frames=[b"x"])  # the active dies before replicating this one
    a.core.take_updates()
    take_over(b)
    confirm(b, W1)
    b.result(W1, rid(1), frames=[b"x"], tenant="default")
    b.core.set_durable(b.core.seq)  # no passive peer: all is durable (the pair shell's rule)
    assert b.core.take_acks() == {W1: [rid(1)]}  # kept, so the worker may drop it
    b.request(C1, rid(1), frames=[b"x"])  # the client's retry, same id: not run again
    reply = b.one_reply(C1)
    assert reply.header["ok"] is True and bytes(reply.frames[0]) == b"x"
    assert b.take_worker() == []


def test_work_a_worker_runs_that_the_tables_lack_is_attached_not_run_again() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
        h.ready(W2, "w2")
    take_over(b)
    confirm(b, W1, running=[{"id": rid(7), "kind": "job", "tenant": "default"}])
    confirm(b, W2)
    b.take_worker()
    b.request(C1, rid(7), kind="job", argv=["true"])  # the retry of work dispatched before the crash
    assert b.take_worker() == [] and b.take_client() == []
    b.result(W1, rid(7), exit_code=0)
    assert b.one_reply(C1).header["ok"] is True


def test_results_are_acked_only_once_the_passive_holds_them() -> None:
    a, b = pair()
    a.ready(W1, "w1")
    a.request(C1, rid(1))
    a.take_worker()
    a.result(W1, rid(1))
    assert a.core.take_acks() == {}  # the DONE update is not yet applied by the peer
    a.core.set_durable(a.core.seq - 1)
    assert a.core.take_acks() == {}
    a.core.set_durable(a.core.seq)
    assert a.core.take_acks() == {W1: [rid(1)]}


def test_a_standalone_broker_acks_at_once_and_a_passive_one_never() -> None:
    h = Harness()
    h.ready(W1, "w1")
    (_, welcome, _), = h.take_worker()
    assert (welcome.command, welcome.header["acks"], welcome.header["active"]) == (Command.WELCOME, True, True)
    h.request(C1, rid(1))
    h.take_worker()
    h.result(W1, rid(1))
    assert h.core.take_acks() == {W1: [rid(1)]}  # no peer to wait for: due in the turn it came
    p = Harness()
    p.core.become_passive()
    p.core.acking = True
    p.ready(W1, "w1")
    p.result(W1, rid(2))
    assert p.core.take_acks() == {} and p.take_client() == []


def test_a_later_epoch_seen_by_a_worker_fences_the_active_broker() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.heartbeat(W1, 1, epoch=1)
    assert not h.core.fenced
    h.heartbeat(W1, 2, epoch=5)
    assert h.core.fenced
    h.request(C1, rid(1))
    h.take_worker()
    h.core.step_down()
    reply = h.one_reply(C1)
    assert reply.header["code"] == "NOT_ACTIVE"
    assert not h.core.active and len(h.core.tasks) == 0
    h.assert_idle()


def test_a_worker_that_refuses_a_dispatch_as_not_active_fences_us() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.request(C1, rid(1))
    h.take_worker()
    h.result(W1, rid(1), ok=False, code="NOT_ACTIVE", message="epoch 9 is active")
    assert h.core.fenced and h.take_client() == []


def test_the_witness_is_a_worker_that_still_hears_another_active_broker() -> None:
    h = Harness()
    h.ready(W1, "w1")
    assert not h.core.witness(0.75)
    h.heartbeat(W1, 1, active_age_ms=100)
    assert h.core.witness(0.75)
    h.advance(1.0)
    assert not h.core.witness(0.75)


def test_work_of_a_lost_worker_goes_to_its_replica_first() -> None:
    h = Harness()
    h.ready(W1, "w1")
    for n in (1, 2):
        h.request(C1, rid(n), kind="job", argv=["true"], idempotent=True, need={"gpu_milli": 50})
    h.ready(W2, "w2", replica_of="w1")
    h.ready(W3, "w3")
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 900  # w3 looks far better to the policy
    h.take_worker()
    h.core.workers.lost(h.core.registry.get(W1), "test")  # type: ignore[arg-type]
    again = sorted((m.header["id"], i) for i, m, _ in h.take_worker())
    assert again == [(rid(1), W2), (rid(2), W2)]
    # Without a replica (or when it is full), anywhere else: w3 now.
    h.core.registry.by_name["w2"].gpus[0].granted_milli = 1000
    h.request(C1, rid(3), kind="job", argv=["true"], idempotent=True, need={"gpu_milli": 50})
    assert h.one_dispatch(W3).header["id"] == rid(3)


def test_a_session_replacing_a_lost_one_opens_on_the_replica() -> None:
    h = session_on_w1()
    h.result(W1, rid(1), session=rid(1))
    h.take_client()
    h.core.workers.lost(h.core.registry.get(W1), "test")  # type: ignore[arg-type]
    h.request(C1, rid(2), kind="session", need={"gpu_milli": 100}, replaces=rid(1))
    assert h.one_dispatch(W2).header["id"] == rid(2)
    h.request(C1, rid(3), kind="session", need={"gpu_milli": 100})  # no replaces: the policy's choice
    assert h.one_dispatch(W3).header["id"] == rid(3)


def test_the_operators_marks_travel_with_the_tables() -> None:
    from gpud_broker.commands import ADMIN

    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
        h.ready(W2, "w2")

    class Target:
        core = a.core

    ADMIN.dispatch(Target(), "drain", {"worker": "w1"}, who="test")
    ADMIN.dispatch(Target(), "cordon", {"gpu": "GPU-w2-0"}, who="test")
    ship(a, b)
    assert b.core.registry.by_name["w1"].draining and b.core.registry.gpus["GPU-w2-0"].cordoned
    snap = P.unpackb(P.packb(a.core.snapshot()))
    c = Harness()
    c.core.become_passive()
    c.ready(W1, "w1")
    c.ready(W2, "w2")
    c.core.load(snap, c.clock.monotonic())
    assert c.core.registry.by_name["w1"].draining and c.core.registry.gpus["GPU-w2-0"].cordoned

    class Passive:
        core = b.core

    import pytest

    from gpud.errors import ConflictError
    with pytest.raises(ConflictError, match="passive"):
        ADMIN.dispatch(Passive(), "undrain", {"worker": "w1"}, who="test")


ALICE, ALICE2, MALLORY = "alice " + "A" * 40, "alice " + "B" * 40, "mallory " + "M" * 40


def user_request(h: Harness, ident: bytes, r: bytes, user: str, **fields: Any) -> None:
    """A REQUEST as a CURVE broker hands it to its core: with the sender's ZAP User-Id."""
    h.core.now = h.clock.monotonic()
    header = {"id": r, "kind": "job", "argv": ["true"], "need": {"gpu_milli": 100}, **fields}
    h.core.on_client(ident, P.decode(P.encode(P.Peer.CLIENT, Command.REQUEST, header), P.Peer.CLIENT), user)


def test_after_a_failover_a_request_stays_bound_to_the_key_that_sent_it() -> None:
    a, b = pair()
    for h in (a, b):
        h.ready(W1, "w1")
    user_request(a, C1, rid(1), ALICE)
    a.take_worker()
    ship(a, b)
    take_over(b)
    confirm(b, W1, running=[{"id": rid(1), "kind": "job"}])
    b.take_worker()
    assert b.core.tasks.tasks[rid(1)].owner == ALICE
    # Another key of the same tenant, and another tenant, retry alice's id: neither attaches.
    user_request(b, C2, rid(1), ALICE2)
    user_request(b, C2, rid(1), MALLORY)
    refused = [m for _, m, _ in b.take_client()]
    assert [(m.header["ok"], m.header.get("code")) for m in refused] == [(False, "INVALID_REQUEST")] * 2
    b.result(W1, rid(1), exit_code=0)
    assert b.take_client() == []  # the reply waits for alice: C1's last sender on this broker is nobody
    user_request(b, C1, rid(1), ALICE)  # alice's own retry gets it
    [(who, reply, _)] = b.take_client()
    assert who == C1 and reply.header["ok"] is True and reply.header["exit_code"] == 0


def test_a_reply_dropped_early_stays_expired_on_the_passive_broker_through_updates_and_snapshots() -> None:
    from gpud_broker.accounts import Budgets, TenantBudget

    a, b = pair(budgets=Budgets(default=TenantBudget(reply_bytes=1)))  # no room for any reply
    for h in (a, b):
        h.ready(W1, "w1")
    user_request(a, C1, rid(1), ALICE)  # not idempotent
    a.take_worker()
    a.result(W1, rid(1), exit_code=0)
    a.take_client()
    a.core.tasks.evict(a.core.now)
    assert rid(1) in a.core.tasks.expired
    ship(a, b)
    assert rid(1) in b.core.tasks.expired and rid(1) not in b.core.tasks.tasks
    # A passive broker that re-syncs from a snapshot keeps the mark too.
    c = Harness(budgets=Budgets(default=TenantBudget(reply_bytes=1)))
    c.core.join_pair()
    c.core.load(P.unpackb(P.packb(a.core.snapshot())), c.clock.monotonic())
    c.ready(W1, "w1")
    for h in (b, c):
        take_over(h)
        confirm(h, W1)
        h.take_worker()
        user_request(h, C1, rid(1), ALICE)  # alice's retry, well inside the window
        [(_, reply, _)] = h.take_client()
        assert reply.header.get("code") == "RESULT_EXPIRED"
        assert h.take_worker() == []  # it never runs a second time
