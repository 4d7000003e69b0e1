"""Tenants in gpud_broker.core: the authenticated tenant wins, ids of other tenants behave as unknown,
and per-tenant limits (queue or BUSY). Driven directly with a fake clock, lists as sockets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gpud import protocol as P
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud.resources import TenantLimits
from gpud_broker.core import ID_IN_USE
from tests.unit.test_broker_core import CoreOnFakeClock, rid

GiB = 1 << 30
A, B, C = b"client-a", b"client-b", b"client-c"
W1 = b"conn-w1"


class H(CoreOnFakeClock):
    """The core's client dialog with the tenant each message's connection authenticated."""

    def client(self, ident: bytes, cmd: Command, header: dict[str, Any], tenant: str | None,
               frames: Sequence[Any] = ()) -> None:
        self.core.now = self.clock.monotonic()
        self.core.on_client(ident, P.decode(P.encode(Peer.CLIENT, cmd, header, frames), Peer.CLIENT), tenant)

    def request(self, ident: bytes, r: bytes, tenant: str | None, kind: str = "echo", **fields: Any) -> None:
        self.client(ident, Command.REQUEST, {"id": r, "kind": kind, **fields}, tenant)

    def ready(self, ngpus: int = 1) -> None:
        gpus = [{"uuid": f"GPU-{i}", "index": i, "model": "A100", "mem": 16 * GiB, "cc": [8, 0]} for i in range(ngpus)]
        enc = P.encode(Peer.WORKER, Command.READY, {"name": "w1", "gpus": gpus, "slots": 64})
        self.core.on_worker(W1, P.decode(enc, Peer.WORKER), enc[2])
        self.to_worker.clear()

    def result(self, r: bytes, **fields: Any) -> None:
        self.core.now = self.clock.monotonic()
        enc = P.encode(Peer.WORKER, Command.RESULT, {"id": r, "ok": True, **fields})
        self.core.on_worker(W1, P.decode(enc, Peer.WORKER), enc[2])

    def replies(self) -> list[tuple[bytes, Message]]:
        out = [(i, P.decode(f, Peer.CLIENT)) for i, f in self.to_client]
        self.to_client.clear()
        return out

    def dispatched(self) -> list[dict[str, Any]]:
        out = [P.decode(f, Peer.WORKER) for _, f in self.to_worker]
        self.to_worker.clear()
        return [m.header for m in out if m.command is Command.DISPATCH]


def code(msg: Message) -> str | None:
    return msg.header.get("code") if msg.header.get("ok") is False else None


def open_session(h: H, sid: bytes, ident: bytes, tenant: str) -> None:
    h.request(ident, sid, tenant, kind="session", need={"gpu_milli": 100, "mem": GiB})
    [d] = h.dispatched()
    assert d["id"] == sid
    h.result(sid, session=sid, gpu={})
    [(who, msg)] = h.replies()
    assert who == ident and msg.header["ok"] is True


# ----------------------------------------------------------------------------- the tenant


def test_authenticated_tenant_overrides_the_declared_one() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), "alice", need={"tenant": "bob", "gpu_milli": 10})
    [d] = h.dispatched()
    assert d["tenant"] == "alice"
    assert h.core.tasks.get(rid(1)).tenant == "alice"  # type: ignore[union-attr]
    h.request(A, rid(2), "alice")  # no declaration: still alice
    assert h.dispatched()[0]["tenant"] == "alice"


def test_without_authentication_the_declared_tenant_is_used() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), None, need={"tenant": "bob"})
    assert h.dispatched()[0]["tenant"] == "bob"


# ----------------------------------------------------------------------------- ids of other tenants


def test_retry_of_another_tenants_id_never_returns_its_reply() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), "alice", frames=())
    h.dispatched()
    # B sends A's id while A's request runs: refused, and A's reply still goes to A.
    h.request(B, rid(1), "bob")
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "INVALID_REQUEST" and msg.header["message"] == ID_IN_USE
    h.result(rid(1), worker="w1")
    [(who, msg)] = h.replies()
    assert who == A and msg.header["ok"] is True
    # Finished: B's retry still gets nothing of A's; A's own retry gets the cached reply.
    h.request(B, rid(1), "bob")
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "INVALID_REQUEST" and "worker" not in msg.header
    h.request(A, rid(1), "alice")
    [(who, msg)] = h.replies()
    assert who == A and msg.header["ok"] is True and msg.header["worker"] == "w1"


# ----------------------------------------------------------------------------- replies to their owner

A1 = "alice " + "k" * 40  # User-Ids: tenant and key (security.client_user)
A2 = "alice " + "m" * 40
B1 = "bob " + "n" * 40


def test_reply_never_goes_to_a_routing_id_another_key_took_over() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), A1)
    h.dispatched()
    # A went away; a connection of another key (even of A's tenant) took A's routing id.
    h.client(A, Command.PING, {}, A2)
    [(who, pong)] = h.replies()
    assert who == A and pong.command is Command.PONG
    h.result(rid(1), worker="w1")
    assert h.replies() == []  # withheld: the route's latest sender is not its owner
    # The other key's retry of the id is refused and learns nothing; A's own retry gets it.
    h.request(B, rid(1), A2)
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "INVALID_REQUEST" and "worker" not in msg.header
    h.request(C, rid(1), A1)
    [(who, msg)] = h.replies()
    assert who == C and msg.header["ok"] is True and msg.header["worker"] == "w1"


def test_reply_goes_to_its_owner_on_the_same_route() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), A1)
    h.request(B, rid(2), B1)
    h.dispatched()
    h.result(rid(2), worker="w1")
    h.result(rid(1), worker="w1")
    assert [(who, m.header["id"]) for who, m in h.replies()] == [(B, rid(2)), (A, rid(1))]
    assert h.core.tasks.get(rid(1)).owner == A1  # type: ignore[union-attr]


def test_without_authentication_the_reply_goes_to_the_routing_id() -> None:
    h = H()
    h.ready()
    h.request(A, rid(1), None)
    h.dispatched()
    h.result(rid(1), worker="w1")
    [(who, msg)] = h.replies()
    assert who == A and msg.header["ok"] is True


def test_cancel_of_another_tenants_request_is_ignored() -> None:
    h = H()  # no worker: requests queue
    h.request(A, rid(1), "alice")
    h.client(B, Command.CANCEL, {"id": rid(1)}, "bob")
    assert h.replies() == [] and len(h.core.queue) == 1
    h.client(A, Command.CANCEL, {"id": rid(1)}, "alice")
    [(who, msg)] = h.replies()
    assert who == A and code(msg) == "CANCELLED" and len(h.core.queue) == 0


def test_call_on_another_tenants_session_is_session_lost_like_an_unknown_one() -> None:
    h = H()
    h.ready()
    sid = rid(7)
    open_session(h, sid, A, "alice")
    h.client(B, Command.CALL, {"id": rid(8), "session": sid, "op": "info"}, "bob")
    [(who, lost)] = h.replies()
    h.client(B, Command.CALL, {"id": rid(9), "session": rid(99), "op": "info"}, "bob")
    [(_, unknown)] = h.replies()
    assert who == B and code(lost) == code(unknown) == "SESSION_LOST"
    assert lost.header["message"] == unknown.header["message"].replace(P.id_text(rid(99)), P.id_text(sid))
    assert h.dispatched() == []
    # A's own call goes through; B reusing that call's id gets nothing of it.
    h.client(A, Command.CALL, {"id": rid(10), "session": sid, "op": "info"}, "alice")
    assert [d["op"] for d in h.dispatched()] == ["info"]
    h.client(B, Command.CALL, {"id": rid(10), "session": sid, "op": "info"}, "bob")
    [(who, msg)] = h.replies()
    assert who == B and msg.header["message"] == ID_IN_USE


def test_ping_renews_only_the_senders_own_sessions() -> None:
    h = H(session_lease=10.0, heartbeat=HeartbeatPolicy(60.0, 3))
    h.ready()
    sid = rid(7)
    open_session(h, sid, A, "alice")
    for _ in range(3):
        h.clock.advance(4.0)
        h.client(B, Command.PING, {"sessions": [sid]}, "bob")
        h.core.tick(h.clock.monotonic())
    assert h.core.sessions[sid].closing  # expired: bob's pings did not count
    h2 = H(session_lease=10.0, heartbeat=HeartbeatPolicy(60.0, 3))
    h2.ready()
    open_session(h2, sid, A, "alice")
    for _ in range(3):
        h2.clock.advance(4.0)
        h2.client(A, Command.PING, {"sessions": [sid]}, "alice")
        h2.core.tick(h2.clock.monotonic())
    assert not h2.core.sessions[sid].closing


# ----------------------------------------------------------------------------- limits


def test_max_sessions_makes_the_next_session_wait() -> None:
    h = H(tenant_limits={"alice": TenantLimits(max_sessions=1)})
    h.ready()
    open_session(h, rid(1), A, "alice")
    h.request(A, rid(2), "alice", kind="session", need={"gpu_milli": 100, "mem": GiB})
    assert h.dispatched() == [] and h.replies() == [] and len(h.core.queue) == 1
    h.request(B, rid(3), "bob", kind="session", need={"gpu_milli": 100, "mem": GiB})  # bob has no limit
    assert [d["id"] for d in h.dispatched()] == [rid(3)]
    # Closing alice's first session lets the second one through.
    h.client(A, Command.CALL, {"id": rid(4), "session": rid(1), "op": "close"}, "alice")
    h.dispatched()
    h.result(rid(4))
    assert [d["id"] for d in h.dispatched()] == [rid(2)]
    assert h.core.accounts.usage["alice"].sessions == 1


def test_max_queued_gives_busy_and_max_milli_queues() -> None:
    h = H(tenant_limits={"alice": TenantLimits(max_milli=500, max_queued=1)})
    h.ready()
    h.request(A, rid(1), "alice", need={"gpu_milli": 300})
    h.request(A, rid(2), "alice", need={"gpu_milli": 300})  # over max_milli: waits
    h.request(A, rid(3), "alice", need={"gpu_milli": 300})  # the queue holds 1 of alice's: BUSY
    assert [d["id"] for d in h.dispatched()] == [rid(1)]
    [(who, msg)] = h.replies()
    assert who == A and code(msg) == "BUSY" and msg.header["id"] == rid(3)
    h.request(B, rid(4), "bob", need={"gpu_milli": 300})  # others are not held back
    assert [d["id"] for d in h.dispatched()] == [rid(4)]
    h.result(rid(1))
    assert [d["id"] for d in h.dispatched()] == [rid(2)]
    h.result(rid(2))
    h.result(rid(4))
    assert h.core.accounts.usage["alice"].milli == 0 and h.core.accounts.usage["bob"].milli == 0


def test_max_mem_and_a_request_over_the_limit_alone() -> None:
    h = H(tenant_limits={"alice": TenantLimits(max_mem=2 * GiB, max_milli=1000)})
    h.ready(ngpus=2)
    h.request(A, rid(1), "alice", kind="job", argv=["true"], need={"gpus": 2})  # 2000 milli > 1000
    [(_, msg)] = h.replies()
    assert code(msg) == "NO_CAPACITY" and "alice" in msg.header["message"]
    h.request(A, rid(2), "alice", need={"gpu_milli": 10, "mem": 2 * GiB})
    h.request(A, rid(3), "alice", need={"gpu_milli": 10, "mem": GiB})
    assert [d["id"] for d in h.dispatched()] == [rid(2)]
    h.result(rid(2))
    assert [d["id"] for d in h.dispatched()] == [rid(3)]


def test_reload_recounts_usage() -> None:
    h = H()
    h.ready()
    open_session(h, rid(1), A, "alice")
    h.request(A, rid(2), "alice", need={"gpu_milli": 200})
    assert h.dispatched() and h.core.accounts.usage == {}  # no limits: nothing tracked
    h.core.set_tenant_limits({"alice": TenantLimits(max_sessions=1)})
    u = h.core.accounts.usage["alice"]
    assert (u.sessions, u.milli, u.mem) == (1, 300, GiB)
    h.request(A, rid(3), "alice", kind="session", need={"gpu_milli": 100, "mem": GiB})
    assert h.dispatched() == []


@pytest.mark.parametrize("bad", [{"max_milli": -1}, {"max_sessions": 1.5}])
def test_limits_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TenantLimits(**bad)


# ----------------------------------------------------------------------------- budgets


def _budgeted(**held: int) -> H:
    from gpud_broker.accounts import Budgets, TenantBudget

    budget = TenantBudget(max_queued=3, max_outstanding=5, max_bytes=1000, max_sessions=1, max_deadline_ms=60_000)
    return H(budgets=Budgets(default=budget, max_held_bytes=held.get("total", 1 << 30)))


def test_a_tenant_at_its_queue_budget_is_busy_and_others_are_placed() -> None:
    h = _budgeted()
    n = 0
    for _ in range(10):  # no worker yet: everything queues
        n += 1
        h.request(B, rid(n), "bob", kind="job", argv=["true"])
    got = h.replies()
    assert len(got) == 7 and all(code(m) == "BUSY" and "max_queued" in m.header["message"] for _, m in got)
    assert h.core.queue.queued_for("bob") == 3
    h.request(A, rid(100), "alice", kind="job", argv=["true"])
    assert h.replies() == [] and h.core.queue.queued_for("alice") == 1  # alice is accepted
    h.ready(ngpus=2)
    task = h.core.tasks.get(rid(100))
    assert task is not None and task.worker == "w1"  # and placed: fair share, one GPU each
    assert h.core.queue.queued_for("bob") == 2


def test_outstanding_and_byte_budgets_name_the_budget() -> None:
    h = _budgeted()
    h.ready()
    for n in range(1, 6):
        h.request(B, rid(n), "bob")  # five echoes in flight: bob's max_outstanding
    h.dispatched()
    h.request(B, rid(6), "bob")
    [(_, msg)] = h.replies()
    assert code(msg) == "BUSY" and "max_outstanding" in msg.header["message"]
    h.client(A, Command.REQUEST, {"id": rid(7), "kind": "echo"}, "alice", [b"x" * 600])
    h.client(A, Command.REQUEST, {"id": rid(8), "kind": "echo"}, "alice", [b"x" * 600])  # 1200 bytes: over max_bytes
    [(who, msg)] = h.replies()
    assert who == A and code(msg) == "BUSY" and "max_bytes" in msg.header["message"]
    assert h.core.accounts.load["alice"].bytes == 600
    for n in (1, 2, 3, 4, 5, 7):
        h.result(rid(n), worker="w1")
    h.replies()
    assert h.core.accounts.load == {} and h.core.accounts.held_bytes == 0  # all let go


def test_the_brokers_byte_budget_and_the_longest_deadline() -> None:
    h = _budgeted(total=1500)
    h.ready()
    h.client(A, Command.REQUEST, {"id": rid(1), "kind": "echo"}, "alice", [b"x" * 900])
    h.client(B, Command.REQUEST, {"id": rid(2), "kind": "echo"}, "bob", [b"x" * 900])
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "BUSY" and "max_held_bytes" in msg.header["message"]
    h.request(B, rid(3), "bob", deadline_ms=7 * 24 * 3600 * 1000)
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "TOO_LARGE" and "max_deadline_ms" in msg.header["message"]


def test_session_budget() -> None:
    h = _budgeted()
    h.ready()
    open_session(h, rid(1), B, "bob")
    h.request(B, rid(2), "bob", kind="session", need={"gpu_milli": 100, "mem": GiB})
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "BUSY" and "max_sessions" in msg.header["message"]
    open_session(h, rid(3), A, "alice")  # alice's own budget


# ----------------------------------------------------------------------------- the reply store


def test_a_flood_of_replies_evicts_only_the_flooders_and_a_dropped_job_is_never_run_again() -> None:
    from gpud_broker.accounts import Budgets, TenantBudget

    h = H(budgets=Budgets(default=TenantBudget(reply_bytes=64 << 10)), result_bytes=1 << 30)
    h.ready()
    h.request(A, rid(1), "alice", kind="job", argv=["true"])  # not idempotent: must never run twice
    h.dispatched()
    h.result(rid(1), worker="w1", exit_code=0)
    for n in range(2, 60):  # bob: 58 jobs with 4 KiB of output each, far past his 64 KiB share
        h.request(B, rid(n), "bob", kind="job", argv=["true"])
        h.dispatched()
        h.core.now = h.clock.monotonic()
        enc = P.encode(Peer.WORKER, Command.RESULT, {"id": rid(n), "ok": True, "worker": "w1"}, [b"o" * 4096])
        h.core.on_worker(W1, P.decode(enc, Peer.WORKER), enc[2])
    h.replies()
    h.clock.advance(1.0)
    h.core.tick(h.clock.monotonic())
    assert h.core.tasks.held_by("bob") <= 64 << 10 and h.core.tasks.held_by("alice") > 0
    # Alice's retry, well inside the window: her reply, no second run.
    h.request(C, rid(1), "alice", kind="job", argv=["true"])
    [(who, msg)] = h.replies()
    assert who == C and msg.header["ok"] is True and h.dispatched() == []
    # Bob's first jobs' replies were dropped early: a retry gets RESULT_EXPIRED, nothing runs.
    h.request(B, rid(2), "bob", kind="job", argv=["true"])
    [(who, msg)] = h.replies()
    assert who == B and code(msg) == "RESULT_EXPIRED" and h.dispatched() == []
    # Another tenant's guess of that id learns nothing of it: a fresh request.
    h.request(A, rid(2), "alice", kind="echo")
    assert [d["id"] for d in h.dispatched()] == [rid(2)]
    # After the retry window the id is forgotten like any other.
    h.clock.advance(h.core.config.result_ttl)
    h.core.tick(h.clock.monotonic())
    assert rid(3) not in h.core.tasks.expired
