"""The broker's part in the direct data path (PROTOCOL.md §10), on a BrokerCore with a fake clock:
what a session's DISPATCH says about the direct path, and the leases the worker's heartbeats renew."""

from __future__ import annotations

from gpud import protocol as P
from gpud.protocol import Command, Peer
from tests.unit.test_broker_core import C1, W1, Harness, leased_session, open_session, rid

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a Z85 public key, as ZAP hands it back


def _dispatch_of_session(h: Harness, user: str | None, **fields: object) -> dict[str, object]:
    h.ready(W1, "w1")
    h.take_worker()
    h.core.now = h.clock.monotonic()
    msg = P.decode(P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid(1), "kind": "session", **fields}), Peer.CLIENT)
    h.core.on_client(C1, msg, user)
    return h.one_dispatch(W1).header


def test_the_dispatch_names_the_authenticated_key_never_a_declared_one() -> None:
    d = _dispatch_of_session(Harness(), f"alice {KEY}", client_key="attacker-key", direct=False)
    assert d["direct"] is True and d["client_key"] == KEY and d["tenant"] == "alice"


def test_without_curve_no_key_and_broker_data_path_offers_nothing() -> None:
    d = _dispatch_of_session(Harness(), None, client_key="declared")
    assert d["direct"] is True and "client_key" not in d
    d = _dispatch_of_session(Harness(data_path="broker"), f"alice {KEY}")
    assert d["direct"] is False and "client_key" not in d


def test_calls_of_a_curve_client_keep_their_tenant() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    h.core.sessions[sid].tenant = "alice"
    msg = P.decode(P.encode(Peer.CLIENT, Command.CALL, {"id": rid(2), "session": sid, "op": "sync"}), Peer.CLIENT)
    h.core.on_client(C1, msg, f"alice {KEY}")
    assert h.one_dispatch(W1).header["op"] == "sync"
    h.core.on_client(C1, P.decode(P.encode(Peer.CLIENT, Command.CALL, {"id": rid(3), "session": sid, "op": "sync"}),
                                  Peer.CLIENT), f"bob {KEY}")
    assert h.one_reply(C1).header["code"] == "SESSION_LOST"  # another tenant's: unknown


def test_heartbeats_hold_the_lease_of_a_session_used_directly() -> None:
    h, sid = leased_session()
    for _ in range(4):  # 16 s with no client message: the worker saw calls 0.5 s ago each time
        h.tick(4.0)
        h.heartbeat(W1, 1, running=[{"id": sid, "kind": "session", "since": 1.0, "idle": 0.5}])
        h.tick()
        assert not h.core.sessions[sid].closing
    assert h.take_worker() == []
    # Junk in the list renews nothing; a session idle past the lease lapses.
    h.tick(4.0)
    h.heartbeat(W1, 2, running=[{"id": sid, "kind": "session", "since": 1.0, "idle": 9.0},
                                {"id": sid, "kind": "session", "idle": "0"}, {"id": "x", "idle": 0.0},
                                {"id": sid, "kind": "session", "idle": float("nan")}])
    h.tick(1.5)
    d = h.one_dispatch(W1)
    assert d.header["op"] == "close" and h.core.sessions[sid].closing


def test_another_workers_heartbeat_renews_nothing() -> None:
    h, sid = leased_session((b"W2", "w2"))
    h.tick(4.0)
    h.heartbeat(b"W2", 1, running=[{"id": sid, "kind": "session", "since": 1.0, "idle": 0.0}])
    h.tick(1.5)
    assert h.core.sessions[sid].closing


def test_a_replacement_for_a_session_still_open_goes_to_the_replica_first() -> None:
    h = Harness()
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)  # on w1
    h.ready(b"W2", "w2")
    h.ready(b"W3", "w3", replica_of="w1")
    h.take_worker()
    # The client found w1 silent on the direct path; the broker has not lost w1 yet.
    h.request(C1, rid(101), kind="session", replaces=sid)
    assert h.one_dispatch(b"W3").header["kind"] == "session"


def test_broker_data_path_direct_relays_no_call_but_close() -> None:
    d = _dispatch_of_session(Harness(data_path="direct"), None)
    assert d["direct"] is True and d["relay"] is False
    assert "relay" not in _dispatch_of_session(Harness(), None)  # auto: relayed too
    h = Harness(data_path="direct")
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    for n, op in enumerate(("sync", "htod", "alloc")):
        h.client(C1, Command.CALL, {"id": rid(2 + n), "session": sid, "op": op, "args": {}})
        reply = h.one_reply(C1)
        assert reply.header["code"] == "INVALID_REQUEST" and "data_path is direct" in reply.header["message"]
    assert h.take_worker() == []
    h.client(C1, Command.CALL, {"id": rid(9), "session": sid, "op": "close"})
    assert h.one_dispatch(W1).header["op"] == "close"
    # An unknown session is SESSION_LOST whatever the path, as before.
    h.client(C1, Command.CALL, {"id": rid(10), "session": rid(99), "op": "sync"})
    assert h.one_reply(C1).header["code"] == "SESSION_LOST"
