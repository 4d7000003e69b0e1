"""The direct data path (PROTOCOL.md §10) with real daemons: sessions call their worker straight,
the worker admits only the session's capability and the key the broker named, a broker failover
does not touch a direct session, a worker loss is replayed through the broker, and an unreachable
data endpoint falls back to the broker relay. SIMULATED GPUs, labelled so.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, client_socket_options
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import BUILTIN, Client, Session

N = 4096


def vector_add(s: Session, seed: int) -> None:
    """A verified kernel on ``s``: out = a + b, checked against numpy."""
    rng = np.random.default_rng(seed)
    a = rng.random(N, dtype=np.float32)
    b = rng.random(N, dtype=np.float32)
    pa, pb, po = s.mem_alloc(4 * N), s.mem_alloc(4 * N), s.mem_alloc(4 * N)
    s.memcpy_htod(pa, a)
    s.memcpy_htod(pb, b)
    s.launch(BUILTIN, "vector_add", grid=16, block=256, args=[pa, pb, po, ("i32", N)])
    out = np.empty(N, dtype=np.float32)
    s.memcpy_dtoh(po, out=out)
    assert np.array_equal(out, a + b)
    for p in (pa, pb, po):
        s.mem_free(p)


class Raw:
    """A bare DEALER on a worker's data socket, for what the library never sends."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: CurveKeys | None = None, server: str = "",
                 rcvhwm: int = 1000) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if keys is not None:
            client_socket_options(self.sock, keys.secret, keys.public, server.encode())
        self.sock.connect(endpoint)

    def call(self, sid: bytes, cap: bytes | None, op: str = "sync", timeout: float = 5.0) -> P.Message | None:
        header: dict[str, Any] = {"id": P.new_id(), "session": sid, "op": op, "args": {}}
        if cap is not None:
            header["cap"] = cap
        self.sock.send_multipart(P.encode(Peer.CLIENT, Command.CALL, header))
        return self.recv(timeout)

    def recv(self, timeout: float = 5.0) -> P.Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return P.decode(self.sock.recv_multipart(), Peer.CLIENT)


def direct(s: Session) -> tuple[str, bytes]:
    """(data endpoint, capability) of a session on the direct path."""
    info = s.info()
    assert info["path"] == "direct", info
    assert s._cap is not None
    return info["endpoint"], s._cap


def refused(msg: P.Message | None) -> bool:
    return msg is not None and msg.header.get("ok") is False and msg.header.get("code") == "SESSION_LOST"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, rundir=tmp_path) as c:
        c.wait_workers(1)
        yield c


def test_capability_is_required_and_dies_with_its_session(cluster: LocalCluster) -> None:
    ctx = zmq.Context()
    try:
        with Client(cluster.frontend, timeout=10) as c:
            s = c.session()
            endpoint, cap = direct(s)
            raw = Raw(ctx, endpoint)
            assert refused(raw.call(s.id, None))  # no capability
            assert refused(raw.call(s.id, bytes(16)))  # a wrong one
            assert refused(raw.call(s.id, cap[:-1] + bytes([cap[-1] ^ 1])))  # one bit off
            assert refused(raw.call(P.new_id(), cap))  # the capability on another session id
            ok = raw.call(s.id, cap)  # the right one works from any socket without CURVE
            assert ok is not None and ok.header.get("ok") is True
            closing = raw.call(s.id, cap, op="close")  # close goes through the broker
            assert closing is not None and closing.header.get("code") == "INVALID_REQUEST"
            # Garbage: the worker answers what it can and keeps serving the session.
            for junk in ([b"x"], [b"GPUDC1", b"\x04", b"\xc1"], [b"GPUDW1", b"\x10", P.packb({})],
                         [b"GPUDC1", b"\x40", P.packb({"msgs": []})], [b"GPUDC1", b"\x01", P.packb({"id": P.new_id()})]):
                raw.sock.send_multipart(junk)
            got = [raw.recv(2.0) for _ in range(5)]
            assert all(m is not None and m.command is Command.ERROR for m in got), got
            vector_add(s, 1)
            assert s.info()["path"] == "direct" and s.replays == 0
            s.close()
            # Replayed after the close: its socket went with it (nothing answers there), and
            # another session's socket, where the port may be bound again, refuses it.
            assert raw.call(s.id, cap, timeout=1.5) is None
            with c.session() as s2:  # the worker still serves
                other = Raw(ctx, direct(s2)[0])
                assert refused(other.call(s.id, cap))
                assert refused(other.call(s2.id, cap))  # nor does it open another session
                other.sock.close(0)
                vector_add(s2, 2)
                assert s2.info()["path"] == "direct"
            raw.sock.close(0)
    finally:
        ctx.destroy(linger=0)


def test_a_dtoh_reply_still_being_sent_keeps_its_bytes_when_the_memory_is_written(cluster: LocalCluster) -> None:
    """The worker sends a direct dtoh's reply from device memory itself (no copy): a write of
    that memory queued behind it (htod) must not change what is still on its way. The client
    stops reading (RCVHWM 1, a reply it leaves unread), so the reply stays in the worker's queue,
    and sends the htod at once."""
    size, tail = 64 << 20, 1 << 20
    old = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
    new = np.full(tail, 7, dtype=np.uint8)
    ctx = zmq.Context()
    try:
        with Client(cluster.frontend, timeout=30) as c:
            s = c.session(mem=size + (1 << 20))
            endpoint, cap = direct(s)
            p = s.mem_alloc(size)
            s.memcpy_htod(p, old)
            raw = Raw(ctx, endpoint, rcvhwm=1)

            def call(op: str, args: dict[str, Any], frames: tuple[Any, ...] = ()) -> bytes:
                rid = P.new_id()
                header = {"id": rid, "session": s.id, "op": op, "args": args, "cap": cap}
                raw.sock.send_multipart(P.encode(Peer.CLIENT, Command.CALL, header, frames), copy=False)
                return rid

            ids = [call("sync", {}), call("dtoh", {"handle": p.handle, "offset": 0, "nbytes": size}),
                   call("htod", {"handle": p.handle, "offset": size - tail}, (memoryview(new),))]
            time.sleep(1.0)  # the htod has reached the worker; the dtoh's reply has not reached us
            replies = [raw.recv(30.0) for _ in ids]
            assert [m.header.get("id") if m is not None else None for m in replies] == ids
            assert all(m is not None and m.header.get("ok") is True for m in replies), replies
            got = replies[1]
            assert got is not None and np.array_equal(np.frombuffer(got.frames[0], dtype=np.uint8), old)
            out = np.empty(size, dtype=np.uint8)
            s.memcpy_dtoh(p, out=out)  # and the write did happen, after
            assert np.array_equal(out[size - tail:], new) and np.array_equal(out[:size - tail], old[:size - tail])
            raw.sock.close(0)
            s.close()
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def curve_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, rundir=tmp_path, security="curve") as c:
        c.wait_workers(1)
        yield c


def test_curve_admits_only_the_key_the_broker_named(curve_cluster: LocalCluster) -> None:
    c = curve_cluster
    alice1, alice2, bob = c.client_keys("alice", "a1"), c.client_keys("alice", "a2"), c.client_keys("bob", "b1")
    ctx = zmq.Context()
    try:
        with Client(c.frontend, curve=alice1, timeout=10) as a1:
            s = a1.session()
            endpoint, cap = direct(s)
            server = s._link.offer.key  # type: ignore[union-attr]
            # Another client of the same tenant and another tenant, with the capability even:
            # refused at the handshake, since no session was granted for their keys.
            for keys in (alice2, bob):
                raw = Raw(ctx, endpoint, keys, server)
                assert raw.call(s.id, cap, timeout=1.5) is None
                raw.sock.close(0)
            # Once they hold a session of their own there, alice1's session socket still refuses
            # their handshake, and a CALL on alice1's session, with its capability, sent to their
            # own session's socket is refused: it is not their key's.
            with Client(c.frontend, curve=alice2, timeout=10) as a2, Client(c.frontend, curve=bob, timeout=10) as b:
                for cl in (a2, b):
                    own = cl.session()
                    assert own.info()["path"] == "direct"
                    raw = Raw(ctx, endpoint, cl._conn._curve, server)
                    assert raw.call(s.id, cap, timeout=1.5) is None
                    raw.sock.close(0)
                    mine = Raw(ctx, direct(own)[0], cl._conn._curve, server)
                    assert refused(mine.call(s.id, cap))  # alice1's session on their own socket
                    ok = mine.call(own.id, own._cap)  # its own session, with its own key: fine
                    assert ok is not None and ok.header.get("ok") is True
                    mine.sock.close(0)
                    vector_add(own, 3)
                    own.close()
            # A key without CURVE at all gets nowhere either.
            raw = Raw(ctx, endpoint)
            assert raw.call(s.id, cap, timeout=1.0) is None
            raw.sock.close(0)
            vector_add(s, 4)
            assert s.replays == 0 and s.info()["path"] == "direct"
            s.close()
    finally:
        ctx.destroy(linger=0)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_data_endpoint_falls_back_to_the_broker(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    with LocalCluster(workers=0, rundir=tmp_path) as c:
        c.add_worker("w0", extra=["--data-advertise", f"tcp://127.0.0.1:{port}"])
        c.wait_workers(1)
        with Client(c.frontend, timeout=10) as cl:
            with caplog.at_level("WARNING", logger="gpud_client.session"):
                s1, s2 = cl.session(), cl.session()
            for s in (s1, s2):
                info = s.info()
                assert info["path"] == "broker" and f"127.0.0.1:{port}" in info["why"], info
                vector_add(s, 5)
                s.close()
            assert sum("relayed through the broker" in r.getMessage() for r in caplog.records) == 1  # once
        with Client(c.frontend, timeout=10, data_path="direct") as strict:
            with pytest.raises(Exception, match="no direct path"):
                strict.session()
        with Client(c.frontend, timeout=10, data_path="broker") as relayed, relayed.session() as s:
            assert s.info()["path"] == "broker"
            vector_add(s, 6)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=0, pair=True, heartbeat_ms=250, rundir=tmp_path,
                      worker_args=["--log-level", "DEBUG"]) as c:
        c.wait_active()
        c.add_worker("w0")
        c.add_worker("w1", extra=["--replica-of", "w0"])
        c.wait_workers(2)
        yield c


def test_direct_session_through_a_broker_kill_then_a_worker_kill(pair: LocalCluster) -> None:
    # The direct session sends the brokers nothing but its keepalive: the keepalive's vote (after
    # 3 silent intervals) is what makes the backup take over. 1 s intervals, not the default 5.
    with Client(pair.frontends, timeout=30, keepalive=1.0) as c, c.session() as s:
        endpoint, _ = direct(s)
        vector_add(s, 10)
        sid, worker = s.id, s.worker
        time.sleep(0.5)  # the session reaches the passive broker
        active = pair.wait_active()
        pair.kill_broker(active)
        t0 = time.monotonic()
        for i in range(20):  # calls keep flowing, straight to the worker: no replay
            vector_add(s, 11 + i)
        assert time.monotonic() - t0 < 10
        assert (s.id, s.worker, s.replays) == (sid, worker, 0)
        assert s.info() == {**s.info(), "path": "direct", "endpoint": endpoint}
        # The new active broker knows the session (replication and heartbeats): it relays too.
        pair.wait_active()
        ptr = s.mem_alloc(16)
        s.memcpy_htod(ptr, np.arange(4, dtype=np.float32))
        # The worker dies: the client sees it silent, replaces the session through the broker
        # (on w0's replica first) and replays its journal; the data comes back right.
        pair.kill_worker(s.worker)
        out = np.empty(4, dtype=np.float32)
        s.memcpy_dtoh(ptr, out=out)
        assert np.array_equal(out, np.arange(4, dtype=np.float32))
        assert s.replays == 1 and s.id != sid and s.worker != worker
        vector_add(s, 40)
        assert s.info()["path"] == "direct"


def _relayed_call(ctx: zmq.Context[Any], frontend: str, sid: bytes) -> P.Message | None:
    """A CALL on session ``sid`` sent through the broker, as a client on the relay would."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, P.new_routing_id())
    sock.connect(frontend)
    try:
        sock.send_multipart(P.encode(Peer.CLIENT, Command.CALL, {"id": P.new_id(), "session": sid, "op": "sync", "args": {}}))
        if not sock.poll(5000):
            return None
        return P.decode(sock.recv_multipart(), Peer.CLIENT)
    finally:
        sock.close(0)


def test_broker_data_path_direct_relays_nothing(tmp_path: Path) -> None:
    port = _closed_port()
    ctx = zmq.Context()
    try:
        with LocalCluster(workers=0, rundir=tmp_path, broker_args=["--data-path", "direct"]) as c:
            c.add_worker("w0")
            c.wait_workers(1)
            with Client(c.frontend, timeout=10) as cl, cl.session() as s:
                assert s.info()["path"] == "direct"
                vector_add(s, 50)
                reply = _relayed_call(ctx, c.frontend, s.id)  # the same session, through the broker
                assert reply is not None and reply.header.get("code") == "INVALID_REQUEST"
                assert "data_path is direct" in str(reply.header.get("message"))
                vector_add(s, 51)  # the direct path is untouched by the refusal
            with Client(c.frontend, timeout=10, data_path="broker") as relayed:
                with pytest.raises(Exception, match="broker's is direct"):
                    relayed.session()
            # A worker whose data endpoint is out of reach: no fallback, the open fails.
            c.kill_worker("w0", signal.SIGTERM)
            del c.worker_procs["w0"]
            c.wait_workers(0)
            c.add_worker("w1", extra=["--data-advertise", f"tcp://127.0.0.1:{port}"])
            c.wait_workers(1)
            with Client(c.frontend, timeout=10) as cl:
                with pytest.raises(Exception, match="broker's data_path is direct"):
                    cl.session()
                deadline = time.monotonic() + 10
                while admin_call(c.admin, "sessions", {}) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert admin_call(c.admin, "sessions", {}) == []  # the failed open left nothing open
    finally:
        ctx.destroy(linger=0)


def _worker_runs(c: LocalCluster) -> list[str]:
    """What ``gpudctl workers`` counts as running (RUN), by kind, as the workers' heartbeats list it."""
    return [r["kind"] for w in admin_call(c.admin, "workers", {}) for r in w["running"]]


def _eventually(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_session_the_broker_ended_is_ended_on_its_worker_when_it_comes_back(tmp_path: Path) -> None:
    """The worker is frozen past its liveness while it holds a session: the broker loses it and
    ends the session. Once the worker runs again and reconnects, the broker has it close the
    session too: its capability is refused, and ``gpudctl workers`` agrees with ``sessions``."""
    ctx = zmq.Context()
    try:
        with LocalCluster(workers=1, heartbeat_ms=200, rundir=tmp_path) as c:
            c.wait_workers(1)
            proc = c.worker_procs["w0"]
            with Client(c.frontend, timeout=10, session_replays=0) as cl:
                s = cl.session()
                endpoint, cap = direct(s)
                vector_add(s, 60)
                assert _eventually(lambda: _worker_runs(c) == ["session"])  # listed by its next heartbeat
                assert len(admin_call(c.admin, "sessions", {})) == 1
                proc.send_signal(signal.SIGSTOP)
                try:
                    c.wait_workers(0, timeout=20)  # silent past 3 x 200 ms: lost, its session ended
                    assert admin_call(c.admin, "sessions", {}) == []
                finally:
                    proc.send_signal(signal.SIGCONT)
                c.wait_workers(1, timeout=20)
                assert _eventually(lambda: _worker_runs(c) == [], 15), _worker_runs(c)
                assert admin_call(c.admin, "sessions", {}) == []
                raw = Raw(ctx, endpoint)
                assert raw.call(s.id, cap, timeout=1.5) is None  # closed on the worker: its socket is gone
                raw.sock.close(0)
                with cl.session() as s2:  # the worker serves on, and the old capability opens nothing
                    other = Raw(ctx, direct(s2)[0])
                    assert refused(other.call(s.id, cap))
                    other.sock.close(0)
                    vector_add(s2, 61)
                s.close()  # the broker ended it: closing counts as done
            assert "closing it there" in (tmp_path / "broker.log").read_text()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            assert "draining 0 running task(s), 0 session(s)" in (tmp_path / "w0.log").read_text()
    finally:
        ctx.destroy(linger=0)
