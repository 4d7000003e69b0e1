"""Broker failover (NOT_ACTIVE) and session replay in the client library.

Two kinds of test:

- protocol level, against a scripted broker (a ROUTER in a thread on loopback, one process) that
  answers as the active broker of a pair, or NOT_ACTIVE as the passive one, and can lose sessions
  on demand: what the client sends (ids, ``replaces``, replayed ops, handles) and what reaches the
  caller;
- end to end, with real daemons (gpud_cli.cluster.LocalCluster: a broker and two simulated workers as
  subprocesses): a session's worker is SIGKILLed and the next calls still succeed, with numerically
  right results, on the other worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from gpud import protocol
from gpud.errors import GpudError, InvalidRequest, NotActive, SessionLost, Timeout
from gpud.protocol import Command, Peer, decode, encode
from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client
from tests.router_thread import RouterThread
from tests.waiting import wait_for

F32 = np.float32
SETTLE = 0.05  # seconds; short, so that tests that alternate do so often


# --------------------------------------------------------------------------- a scripted broker


@dataclass
class Backend:
    """What the brokers of a scripted pair share: the sessions (as if replicated) and the device.
    Handles come from one counter, so a replaced session never gets the handles of the lost one."""

    sessions: dict[bytes, dict[int, bytearray]] = field(default_factory=dict)
    next_handle: int = 1
    opened: int = 0  # sessions opened so far; the n-th is on worker "wn"
    lose_on: dict[str, int] = field(default_factory=dict)  # op -> how many of its CALLs, from
    # now on, lose their session before running
    lose_code: str = "SESSION_LOST"
    open_error: str | None = None  # code for session REQUESTs that replace one
    lock: threading.Lock = field(default_factory=threading.Lock)


class ScriptedBroker(RouterThread):
    """A ROUTER in a thread. ``passive``: REQUEST and CALL get NOT_ACTIVE (as a REPLY, or as an
    ERROR naming the id when ``as_error``), PING gets PONG. ``silent``: reads and answers nothing.
    ``stall``: seconds the next REQUEST blocks the broker (no PONG either) before it answers."""

    def __init__(self, ctx: zmq.Context[Any], backend: Backend, name: str) -> None:
        self.ctx = ctx
        self.backend = backend
        self.name = name
        self.passive = False
        self.as_error = False
        self.silent = False
        self.stall = 0.0
        self.seen: list[tuple[Command, dict[str, Any], list[bytes]]] = []
        self.pings: list[tuple[list[bytes], bool]] = []  # (sessions named, silent when heard)
        self._start(f"scripted-{name}")

    def ids(self, command: Command = Command.REQUEST) -> list[bytes]:
        return [h["id"] for c, h, _ in list(self.seen) if c is command]

    def headers(self, command: Command) -> list[dict[str, Any]]:
        return [h for c, h, _ in list(self.seen) if c is command]

    def session_pings(self, sid: bytes, *, while_silent: bool | None = None) -> int:
        return sum(
            1
            for names, silent in list(self.pings)
            if sid in names and (while_silent is None or silent == while_silent)
        )

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._ready.set()
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                ident, *frames = sock.recv_multipart()
                msg = decode(frames, expect=Peer.CLIENT)
                if msg.command is Command.PING:
                    self.pings.append((list(msg.header.get("sessions", [])), self.silent))
                else:
                    self.seen.append((msg.command, msg.header, [bytes(f) for f in msg.frames]))
                if self.silent:
                    continue
                if self.stall and msg.command is Command.REQUEST:
                    time.sleep(self.stall)
                    self.stall = 0.0
                for command, header, payload in self._answer(msg):
                    sock.send_multipart([ident, *encode(Peer.CLIENT, command, header, payload)])
        finally:
            sock.close()

    def _answer(self, msg: protocol.Message) -> list[tuple[Command, dict[str, Any], list[bytes]]]:
        h = msg.header
        if msg.command is Command.PING:
            return [(Command.PONG, {}, [])]
        if msg.command is Command.CANCEL:
            return []
        rid = h["id"]
        if self.passive:
            text = f"{self.name} is the passive broker"
            if self.as_error:
                return [(Command.ERROR, {"id": rid, "code": "NOT_ACTIVE", "message": text}, [])]
            return [(Command.REPLY, _err(rid, "NOT_ACTIVE", text), [])]
        with self.backend.lock:
            try:
                return [self._active(rid, msg)]
            except GpudError as exc:
                return [(Command.REPLY, protocol.error_header(rid, exc), [])]

    def _active(
        self, rid: bytes, msg: protocol.Message
    ) -> tuple[Command, dict[str, Any], list[bytes]]:
        h, be = msg.header, self.backend
        if msg.command is Command.REQUEST and h["kind"] == "echo":
            return Command.REPLY, {"id": rid, "ok": True, "worker": self.name}, list(msg.frames)
        if msg.command is Command.REQUEST and h["kind"] == "session":
            if be.open_error is not None and "replaces" in h:
                return Command.REPLY, _err(rid, be.open_error, "scripted"), []
            be.sessions[rid] = {}
            be.opened += 1
            worker = f"w{be.opened}"
            return Command.REPLY, {"id": rid, "ok": True, "session": rid, "worker": worker}, []
        op, args, sid = h["op"], h.get("args", {}), h["session"]
        mem = be.sessions.get(sid)
        if mem is None:
            return Command.REPLY, _err(rid, "SESSION_LOST", "unknown session"), []
        if be.lose_on.get(op, 0) > 0:
            be.lose_on[op] -= 1
            del be.sessions[sid]
            return Command.REPLY, _err(rid, be.lose_code, "scripted loss"), []
        out: dict[str, Any] = {"id": rid, "ok": True}
        payload: list[bytes] = []
        if op == "alloc":
            out["handle"] = be.next_handle
            mem[be.next_handle] = bytearray(args["nbytes"])
            be.next_handle += 1
        elif op in ("free", "htod", "dtoh"):
            buf = mem.get(args["handle"])
            if buf is None:
                return Command.REPLY, _err(rid, "INVALID_REQUEST", "unknown handle"), []
            if op == "free":
                del mem[args["handle"]]
            elif op == "htod":
                buf[args["offset"] : args["offset"] + len(msg.frames[0])] = msg.frames[0]
            else:
                payload = [bytes(buf[args["offset"] : args["offset"] + args["nbytes"]])]
        elif op == "launch":  # saxpy only: y = alpha x + y
            (_, alpha), (_, x), (_, y), (_, n) = args["args"]
            xs = np.frombuffer(mem[x], F32)[:n]
            ys = np.frombuffer(mem[y], F32)[:n].copy()
            mem[y][: 4 * n] = (F32(alpha) * xs + ys).tobytes()
        elif op == "close":
            del be.sessions[sid]
        return Command.REPLY, out, payload


def _err(rid: bytes, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "code": code, "message": message}


@pytest.fixture
def pair(ctx: zmq.Context[Any]) -> Iterator[tuple[ScriptedBroker, ScriptedBroker]]:
    backend = Backend()
    a, b = ScriptedBroker(ctx, backend, "a"), ScriptedBroker(ctx, backend, "b")
    yield a, b
    a.stop()
    b.stop()


def switches(caplog: pytest.LogCaptureFixture) -> int:
    """Failovers the client logged because a broker answered NOT_ACTIVE."""
    return sum(
        1
        for r in caplog.records
        if r.name == "gpud_client.connection" and "is passive (NOT_ACTIVE)" in r.getMessage()
    )


# --------------------------------------------------------------------------- NOT_ACTIVE


@pytest.mark.parametrize("as_error", [False, True])
def test_not_active_moves_to_the_other_endpoint_with_the_same_id(
    pair: tuple[ScriptedBroker, ScriptedBroker], as_error: bool, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    a.passive, a.as_error = True, as_error
    caplog.set_level(logging.INFO, logger="gpud_client.connection")
    with Client([a.endpoint, b.endpoint], timeout=10, settle=SETTLE) as client:
        pending = client.submit_echo(b"over there")
        assert pending.wait() == b"over there"  # not NotActive
        assert client.endpoint == b.endpoint
        assert client.echo(b"next") == b"next"
    assert a.ids() == [pending.id]
    assert b.ids()[0] == pending.id and len(b.ids()) == 2
    assert switches(caplog) == 1


def test_one_switch_for_many_outstanding_requests(
    pair: tuple[ScriptedBroker, ScriptedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    a.passive = True
    caplog.set_level(logging.INFO, logger="gpud_client.connection")
    with Client([a.endpoint, b.endpoint], timeout=10, settle=SETTLE) as client:
        pendings = [client.submit_echo(b"%d" % i) for i in range(8)]
        assert wait_for(lambda: len(a.ids()) == 8)
        assert [p.wait() for p in pendings] == [b"%d" % i for i in range(8)]
    assert sorted(b.ids()) == sorted(p.id for p in pendings)
    assert switches(caplog) == 1  # once per switch, not per request


def test_when_every_broker_is_passive_the_call_alternates_until_its_deadline(
    pair: tuple[ScriptedBroker, ScriptedBroker], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    a.passive = b.passive = True
    caplog.set_level(logging.INFO, logger="gpud_client.connection")
    with Client([a.endpoint, b.endpoint], timeout=10, settle=SETTLE) as client:
        pending = client.submit_echo(b"anyone active?")
        with pytest.raises(Timeout, match="NOT_ACTIVE") as info:
            pending.wait(timeout=2.0)
        assert not isinstance(info.value, NotActive)
        # Every send after the first followed one logged switch (nothing switches while the
        # client is not called, and its socket delivers what it sent while it is open).
        assert wait_for(lambda: len(a.ids()) + len(b.ids()) == switches(caplog) + 1)
    assert set(a.ids()) == set(b.ids()) == {pending.id}
    assert len(a.ids()) >= 2 and len(b.ids()) >= 2


@pytest.mark.parametrize(("size", "resent"), [(16, True), (16 << 20, False)])
def test_payloads_in_flight_lengthen_the_silence_allowed(
    pair: tuple[ScriptedBroker, ScriptedBroker], size: int, resent: bool
) -> None:
    a, _ = pair
    a.stall = 1.5  # seconds without a word: far past 2 x ping_interval
    payload = bytes(range(256)) * (size // 256) if size >= 256 else b"x" * size
    with Client(a.endpoint, timeout=20, ping_interval=0.2) as client:
        pending = client.submit_echo(payload)
        assert pending.wait() == payload
    # 16 MiB there and back may take 3.2 s at the assumed floor rate: the broker was not given up.
    assert (len(a.ids()) > 1) is resent
    assert set(a.ids()) == {pending.id}


def test_a_session_call_moves_to_the_newly_active_broker_and_keeps_its_lease_there(
    pair: tuple[ScriptedBroker, ScriptedBroker],
) -> None:
    a, b = pair
    with Client([a.endpoint, b.endpoint], timeout=10, keepalive=0.1, settle=SETTLE) as client:
        s = client.session()
        x = s.mem_alloc(16)
        s.memcpy_htod(x, np.arange(4, dtype=F32))
        assert wait_for(lambda: a.session_pings(s.id) >= 1)
        a.passive = True  # the pair failed over; b holds the replicated session
        s.launch(BUILTIN, "saxpy", args=[F32(2), x, x, np.int32(4)])
        assert client.endpoint == b.endpoint
        assert np.frombuffer(s.memcpy_dtoh(x), F32).tolist() == [0, 3, 6, 9]
        launch = next(h for h in a.headers(Command.CALL) if h["op"] == "launch")
        assert [h["id"] for h in b.headers(Command.CALL)][0] == launch["id"]
        assert wait_for(lambda: b.session_pings(s.id) >= 2)  # the keepalive followed
        s.close()


def test_keepalive_votes_elsewhere_while_its_broker_is_silent_and_comes_back_to_it(
    pair: tuple[ScriptedBroker, ScriptedBroker],
) -> None:
    a, b = pair
    with Client([a.endpoint, b.endpoint], timeout=10, keepalive=0.1) as client:
        s = client.session()
        assert wait_for(lambda: a.session_pings(s.id) >= 1)
        assert b.session_pings(s.id) == 0
        a.silent = True  # the client's broker stops answering; the client itself is idle
        assert wait_for(lambda: b.session_pings(s.id) >= 1)  # the vote on the other broker
        before = a.session_pings(s.id, while_silent=False)
        a.silent = False
        # b answers PONG too (a passive broker does), but the client still uses a: the lease
        # must be renewed there.
        assert wait_for(lambda: a.session_pings(s.id, while_silent=False) >= before + 3)
        assert client.endpoint == a.endpoint
        s.close()


# --------------------------------------------------------------------------- replay, scripted


def _session_requests(*brokers: ScriptedBroker) -> list[dict[str, Any]]:
    return [h for br in brokers for h in br.headers(Command.REQUEST) if h["kind"] == "session"]


@pytest.mark.parametrize("code", ["SESSION_LOST", "GPU_FAULT"])
def test_a_lost_session_is_replaced_and_replayed_and_the_failed_op_applied_once(
    pair: tuple[ScriptedBroker, ScriptedBroker], code: str
) -> None:
    a, _ = pair
    be = a.backend
    be.lose_code = code
    with Client(a.endpoint, timeout=10) as client:
        s = client.session(gpu_milli=300, mem=1 << 20)
        first = s.id
        x, y, tmp = s.mem_alloc(16), s.mem_alloc(16), s.mem_alloc(64)
        s.memcpy_htod(x, np.array([1, 2, 3, 4], F32))
        s.memcpy_htod(y, np.array([10, 20, 30, 40], F32))
        s.mem_free(tmp)
        be.lose_on = {"launch": 1}  # the worker dies with the launch in flight
        calls_before = len(a.headers(Command.CALL))
        s.launch(BUILTIN, "saxpy", args=[F32(2), x, y, np.int32(4)])  # no error reaches us
        assert np.frombuffer(s.memcpy_dtoh(y), F32).tolist() == [12, 24, 36, 48]  # once
        assert s.id != first and s.replays == 1 and s.worker == "w2"
        assert (x.handle, y.handle) == (1, 2)  # the caller's pointers do not change
    first_req, second_req = _session_requests(a)
    assert "replaces" not in first_req and second_req["replaces"] == first
    assert second_req["need"] == first_req["need"]
    replayed = [(h["op"], h["session"]) for h in a.headers(Command.CALL)[calls_before + 1 :]]
    assert replayed[:5] == [
        ("alloc", s.id),
        ("alloc", s.id),
        ("htod", s.id),
        ("htod", s.id),
        ("launch", s.id),  # the failed launch, sent again once, after the replay
    ]
    launch = a.headers(Command.CALL)[calls_before + 5]
    new_x, new_y = 4, 5  # the backend's handles 1..3 went to the lost session
    assert launch["args"]["args"] == [["f32", 2.0], ["ptr", new_x], ["ptr", new_y], ["i32", 4]]


def test_pointers_freed_before_the_loss_stay_unknown_after_it(
    pair: tuple[ScriptedBroker, ScriptedBroker],
) -> None:
    a, _ = pair
    with Client(a.endpoint, timeout=10) as client:
        s = client.session()
        keep, gone = s.mem_alloc(8), s.mem_alloc(8)
        s.mem_free(gone)
        a.backend.sessions.clear()  # the worker is lost
        s.memcpy_htod(keep, b"12345678")
        assert s.replays == 1
        with pytest.raises(InvalidRequest, match="unknown handle"):
            s.memcpy_dtoh(gone)
        assert s.memcpy_dtoh(keep) == b"12345678"
        s.close()


def test_replays_are_bounded_per_session(pair: tuple[ScriptedBroker, ScriptedBroker]) -> None:
    a, _ = pair
    a.backend.lose_on = {"sync": 100}  # every new session is lost again by the retried call
    with Client(a.endpoint, timeout=10, session_replays=2) as client:
        s = client.session()
        s.mem_alloc(8)
        with pytest.raises(SessionLost, match="after 2 replay"):
            s.synchronize()
        assert s.replays == 2
        requests = len(_session_requests(a))
        with pytest.raises(SessionLost):
            s.synchronize()
        assert len(_session_requests(a)) == requests == 3  # no more replays for this session


def test_a_replacement_that_cannot_be_opened_ends_in_session_lost(
    pair: tuple[ScriptedBroker, ScriptedBroker],
) -> None:
    a, _ = pair
    a.backend.open_error = "NO_CAPACITY"
    with Client(a.endpoint, timeout=10) as client:
        s = client.session()
        s.mem_alloc(8)
        a.backend.sessions.clear()
        with pytest.raises(SessionLost, match="NO_CAPACITY") as info:
            s.synchronize()
        cause = info.value.__cause__
        assert isinstance(cause, GpudError) and cause.code == "NO_CAPACITY"
        with pytest.raises(SessionLost, match="not replayed"):
            s.synchronize()
        assert len(_session_requests(a)) == 2


def test_close_of_a_lost_session_does_not_replay(
    pair: tuple[ScriptedBroker, ScriptedBroker],
) -> None:
    a, _ = pair
    with Client(a.endpoint, timeout=10) as client:
        s = client.session()
        s.mem_alloc(8)
        a.backend.sessions.clear()
        s.close()
        assert s.closed and s.replays == 0
    assert len(_session_requests(a)) == 1


# --------------------------------------------------------------------------- replay, real daemons


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    # Short heartbeats: a SIGKILLed worker is noticed after liveness x heartbeat = 0.6 s.
    with LocalCluster(workers=2, gpus_per_worker=1, heartbeat_ms=200, liveness=3) as c:
        yield c


def test_session_survives_the_loss_of_its_worker(cluster: LocalCluster) -> None:
    rng = np.random.default_rng(7)
    n = 1000
    a = rng.standard_normal(n).astype(F32)
    b = rng.standard_normal(n).astype(F32)
    y0 = rng.standard_normal(n).astype(F32)
    m, k, nn = 7, 5, 6
    A = rng.standard_normal((m, k)).astype(F32)
    B = rng.standard_normal((k, nn)).astype(F32)
    with Client(cluster.frontend, timeout=30) as client:
        s = client.session(gpu_milli=500, mem=16 << 20)
        first_worker, first_id = s.worker, s.id
        pa, pb, pout, py = (s.mem_alloc(4 * n) for _ in range(4))
        pA, pB, pC = s.mem_alloc(A.nbytes), s.mem_alloc(B.nbytes), s.mem_alloc(4 * m * nn)
        tmp = s.mem_alloc(4 * n)
        s.memcpy_htod(pa, a)
        s.memcpy_htod(pb, b)
        s.memcpy_htod(py, y0)
        s.memcpy_htod(pA, A)
        s.memcpy_htod(pB, B)
        s.memcpy_htod(tmp, np.ones(n, F32))
        s.launch(BUILTIN, "vector_add", (4,), (256,), [pa, pb, pout, np.int32(n)])
        s.launch(BUILTIN, "saxpy", (4,), (256,), [F32(2.5), pa, py, np.int32(n)])
        s.launch(BUILTIN, "saxpy", (4,), (256,), [F32(-1), tmp, py, np.int32(n)])
        s.mem_free(tmp)  # read by a launch whose result counts: the journal keeps it
        s.launch(
            BUILTIN, "sgemm", (2,), (64,), [pA, pB, pC, np.int32(m), np.int32(nn), np.int32(k)]
        )
        s.synchronize()

        cluster.kill_worker(first_worker)  # SIGKILL

        out = np.frombuffer(s.memcpy_dtoh(pout), F32)  # a delay, then the result
        assert s.worker != first_worker and s.worker in {"w0", "w1"}
        assert s.id != first_id and s.replays == 1
        np.testing.assert_array_equal(out, a + b)
        y = np.frombuffer(s.memcpy_dtoh(py), F32)
        np.testing.assert_allclose(y, F32(2.5) * a + y0 - 1, rtol=1e-6, atol=1e-6)
        C = np.frombuffer(s.memcpy_dtoh(pC), F32).reshape(m, nn)
        np.testing.assert_allclose(C, A @ B, rtol=1e-5, atol=1e-5)
        # The session goes on on the new worker with the pointers the caller holds.
        s.launch(BUILTIN, "saxpy", (4,), (256,), [F32(1), pout, py, np.int32(n)])
        y2 = np.frombuffer(s.memcpy_dtoh(py), F32)
        np.testing.assert_allclose(y2, y + (a + b), rtol=1e-6, atol=1e-6)
        info = s.device_info()
        assert info["mem_used"] == 4 * 4 * n + A.nbytes + B.nbytes + 4 * m * nn  # tmp freed
        st = cluster.status()
        assert st["counts"]["sessions"] == 1  # the replacement, nothing else
        s.close()


def test_a_chunked_copy_is_replayed_after_the_loss_of_its_worker(cluster: LocalCluster) -> None:
    chunk = 64 << 10
    rng = np.random.default_rng(11)
    n = 7 * chunk + 333  # 8 chunks, the last one short
    data = rng.integers(0, 256, n, np.uint8)
    # Relayed (data_path="broker"): the spy below counts the CALLs on the broker connection.
    with Client(cluster.frontend, timeout=30, chunk_bytes=chunk, chunk_window=2, data_path="broker") as client:
        s = client.session(gpu_milli=500, mem=16 << 20)
        first_worker = s.worker
        p = s.mem_alloc(n + 100)
        s.memcpy_htod(p, np.full(n + 100, 9, np.uint8))
        s.memcpy_htod(p, data, 50)  # chunked, journaled once
        assert [e.op for e in s.journal.entries()] == ["alloc", "htod", "htod"]

        cluster.kill_worker(first_worker)

        sent: list[int] = []  # payload bytes of each REQUEST and CALL from now on
        submit = client._conn.submit

        def spy(rid: bytes, frames: list[Any], what: str, expect: int = 0) -> None:
            sent.append(sum(len(memoryview(f)) for f in frames[3:]))
            submit(rid, frames, what, expect)

        client._conn.submit = spy  # type: ignore[method-assign]
        out = np.empty(n + 100, np.uint8)
        s.memcpy_dtoh(p, out=out)  # chunked too: the first chunk finds the session lost
        assert s.worker != first_worker and s.replays == 1
        assert sum(sent) == 2 * n + 100 and max(sent) == chunk  # both htods replayed, chunked
        np.testing.assert_array_equal(out[50 : 50 + n], data)
        assert (out[:50] == 9).all() and (out[50 + n :] == 9).all()
        s.close()


@pytest.mark.parametrize("journal_bytes", [0, 4096])
def test_session_loss_reaches_the_caller_without_a_usable_journal(
    cluster: LocalCluster, journal_bytes: int
) -> None:
    with Client(cluster.frontend, timeout=30, journal_bytes=journal_bytes) as client:
        s = client.session(gpu_milli=500, mem=16 << 20)
        first_worker = s.worker
        p = s.mem_alloc(16 << 10)
        s.memcpy_htod(p, np.ones(4 << 10, F32))  # 16 KiB: past a 4 KiB journal
        assert not s.journal.usable and s.journal.overflowed == (journal_bytes > 0)
        cluster.kill_worker(first_worker)
        with pytest.raises(SessionLost, match="not replayed") as info:
            s.memcpy_dtoh(p)
        why = "journal_bytes=0" if journal_bytes == 0 else "past its bound of 4096 bytes"
        assert why in info.value.message
        assert s.worker == first_worker and s.replays == 0
