"""The client library against a fake broker: real zmq sockets over loopback TCP, one process.

The fake broker is a ROUTER in a thread that speaks the client and admin dialogs of PROTOCOL.md
(with scripted misbehaviour); it is not the real broker and checks only what the client sends.

What the client does with an unusable reply (documented here and in client.py):
- a reply that names an outstanding request id but has fields of the wrong type ends that request
  with ProtocolError (the broker de-duplicates, so asking again would get the same reply);
- a message that cannot be tied to a request (garbage header, no valid id) is dropped with a log
  line, and the call then ends in Timeout, whose message names the last dropped message.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gpud import protocol
from gpud.errors import (
    Busy,
    GpudError,
    InvalidRequest,
    NoCapacity,
    ProtocolError,
    RemoteError,
    SessionLost,
    Timeout,
)
from gpud.protocol import Command, Peer, decode, encode
from gpud_client import BUILTIN, Client, DevicePtr, JobResult, Need, ctl
from gpud_client._request import encode_launch_arg
from tests.router_thread import RouterThread
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = 0.15  # ping interval for liveness tests, seconds

STATUS: dict[str, Any] = {
    "broker": {
        "name": "ctl-a",
        "version": "0.1.0",
        "uptime_s": 3725.5,
        "role": "active",
        "policy": "balanced",
    },
    "counts": {"workers": 1, "gpus": 2, "queued": 0, "running": 1, "sessions": 1, "done": 17},
    "workers": [
        {
            "name": "w1",
            "hostname": "gpu-vm-1",
            "slots": 4,
            "inflight": 1,
            "cpu_milli": 8000,
            "host_mem": 32 << 30,
            "simulated": True,
            "last_heard_s": 0.4,
            "running": [{"id": "ab" * 16, "kind": "job", "since": 1.5}],
        }
    ],
    "gpus": [
        {
            "worker": "w1",
            "uuid": f"SIM-{i}",
            "index": i,
            "model": "Simulated GPU with a very long model name",
            "mem": 16 << 30,
            "cc": [8, 0],
            "simulated": True,
            "util": 37.5 * i,
            "mem_used": 3 << 29,
            "temp": 41.0,
            "power": 70.0,
            "health": "ok",
            "granted_milli": 500 * i,
            "granted_mem": 1 << 30,
            "tasks": i,
        }
        for i in range(2)
    ],
}


class FakeBroker(RouterThread):
    """A ROUTER in a thread answering the client dialog; ``silent`` reads and never answers;
    ``mute`` ignores that many first messages (a broker that restarted and lost them)."""

    def __init__(self, ctx: zmq.Context[Any], silent: bool = False, mute: int = 0) -> None:
        self.ctx = ctx
        self.silent = silent
        self.mute = mute
        self.seen: list[tuple[Command, dict[str, Any], bytes]] = []
        self.pings: list[tuple[bytes, list[bytes]]] = []
        self.ping_event = threading.Event()
        self.closed_sessions: list[bytes] = []
        self.close_event = threading.Event()
        self.launches: list[dict[str, Any]] = []
        self.memory: dict[int, bytearray] = {}
        self.admin_error: tuple[str, str] | None = None
        self._next_handle = 1
        self.admin_endpoint = ""
        self._start("fake-broker")

    # ------------------------------------------------------------------ plumbing

    def requests(self, command: Command = Command.REQUEST) -> list[bytes]:
        return [h["id"] for c, h, _ in self.seen if c is command]

    def _run(self) -> None:
        front = self.ctx.socket(zmq.ROUTER)
        admin = self.ctx.socket(zmq.ROUTER)
        try:
            for s in (front, admin):
                s.setsockopt(zmq.LINGER, 0)
                s.bind("tcp://127.0.0.1:*")
            self.endpoint = front.getsockopt_string(zmq.LAST_ENDPOINT)
            self.admin_endpoint = admin.getsockopt_string(zmq.LAST_ENDPOINT)
            self._ready.set()
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            poller.register(admin, zmq.POLLIN)
            while not self._stop.is_set():
                for sock, _ in poller.poll(20):
                    ident, *frames = sock.recv_multipart()
                    msg = decode(frames)
                    self.seen.append((msg.command, msg.header, ident))
                    if self.silent:
                        continue
                    if self.mute > 0:
                        self.mute -= 1
                        continue
                    send = self._sender(sock, ident)
                    if sock is admin:
                        self._admin(send, msg.header)
                    else:
                        self._client(send, ident, msg)
        finally:
            front.close()
            admin.close()

    def _sender(self, sock: zmq.Socket[Any], ident: bytes) -> Callable[..., None]:
        def send(
            command: Command, header: dict[str, Any], frames: Any = (), peer: Peer = Peer.CLIENT
        ) -> None:
            sock.send_multipart([ident, *encode(peer, command, header, frames)])

        return send

    # ------------------------------------------------------------------ dialogs

    def _admin(self, send: Callable[..., None], header: dict[str, Any]) -> None:
        rid = header["id"]
        if self.admin_error is not None:
            code, message = self.admin_error
            send(
                Command.REPLY,
                {"id": rid, "ok": False, "code": code, "message": message},
                peer=Peer.ADMIN,
            )
        elif header.get("cmd") == "status":
            send(Command.REPLY, {"id": rid, "ok": True, "result": STATUS}, peer=Peer.ADMIN)
        else:
            err = {"id": rid, "ok": False, "code": "UNKNOWN_COMMAND", "message": "no such command"}
            send(Command.REPLY, err, peer=Peer.ADMIN)

    def _client(self, send: Callable[..., None], ident: bytes, msg: protocol.Message) -> None:
        h = msg.header
        if msg.command is Command.PING:
            self.pings.append((ident, list(h.get("sessions", []))))
            if h.get("sessions"):
                self.ping_event.set()
            send(Command.PONG, {})
            return
        if msg.command is Command.CANCEL:
            return
        rid = h["id"]
        try:
            if msg.command is Command.CALL:
                self._call(send, rid, h, msg.frames)
            elif h["kind"] == "echo":
                self._echo(send, rid, msg.frames)
            elif h["kind"] == "job":
                self._job(send, rid, h, msg.frames)
            elif h["kind"] == "session":
                protocol.parse_need("session", h.get("need"))
                gpu = {
                    "uuid": "SIM-0",
                    "index": 0,
                    "model": "Sim",
                    "mem": 1 << 30,
                    "cc": [8, 0],
                    "simulated": True,
                }
                send(
                    Command.REPLY,
                    {"id": rid, "ok": True, "session": rid, "worker": "w1", "gpu": gpu},
                )
        except GpudError as exc:
            send(Command.REPLY, protocol.error_header(rid, exc))

    def _echo(self, send: Callable[..., None], rid: bytes, frames: list[bytes]) -> None:
        payload = b"".join(frames)
        if payload.startswith(b"error:"):
            code = payload[6:].decode()
            send(
                Command.REPLY, {"id": rid, "ok": False, "code": code, "message": f"scripted {code}"}
            )
        elif payload.startswith(b"errcmd:"):
            send(Command.ERROR, {"id": rid, "code": payload[7:].decode(), "message": "scripted"})
        elif payload == b"garbage-header":
            send(Command.REPLY, b"\xc1 not msgpack")
        elif payload == b"bad-ok":
            send(Command.REPLY, {"id": rid, "ok": "yes"})
        elif payload == b"bad-worker":
            send(Command.REPLY, {"id": rid, "ok": True, "worker": 5})
        elif payload == b"silent":
            pass
        else:
            if payload == b"stale-first":
                send(Command.REPLY, {"id": protocol.new_id(), "ok": True}, [b"stale"])
                send(Command.PONG, {})
            send(Command.REPLY, {"id": rid, "ok": True, "worker": "w1", "gpus": ["SIM-0"]}, frames)

    def _job(
        self, send: Callable[..., None], rid: bytes, h: dict[str, Any], frames: list[bytes]
    ) -> None:
        spec = protocol.parse_job(h, len(frames))  # what the broker would accept
        need = protocol.parse_need("job", h.get("need"))
        inputs = dict(zip(spec.files, frames, strict=True))
        outputs = [name for name in spec.outputs if name != "missing.txt"]
        result = {
            "id": rid,
            "ok": True,
            "exit_code": 3,
            "timed_out": False,
            "stdout_truncated": False,
            "stderr_truncated": True,
            "files": outputs,
            "worker": "w1",
            "gpus": ["SIM-0"],
            "user": f"gpud-{need.tenant}-1",
        }
        stdout = " ".join([*spec.argv, json.dumps(spec.env, sort_keys=True)]).encode()
        files = [b"".join(inputs.values()).upper() for _ in outputs]
        send(Command.REPLY, result, [stdout, b"warning", *files])

    def _call(
        self, send: Callable[..., None], rid: bytes, h: dict[str, Any], frames: list[bytes]
    ) -> None:
        op, args = h["op"], h.get("args", {})
        if h["session"] in self.closed_sessions:
            raise SessionLost("session is closed")
        out: dict[str, Any] = {"id": rid, "ok": True}
        payload: list[bytes] = []
        if op == "alloc":
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            self.memory[handle] = bytearray(args["nbytes"])
            out["handle"] = handle
        elif op == "free":
            del self.memory[args["handle"]]
        elif op == "htod":
            mem, off = self.memory[args["handle"]], args["offset"]
            mem[off : off + len(frames[0])] = frames[0]
        elif op == "dtoh":
            mem, off = self.memory[args["handle"]], args["offset"]
            payload = [bytes(mem[off : off + args["nbytes"]])]
        elif op == "launch":
            protocol.parse_dims(args["grid"], "grid")
            protocol.parse_dims(args["block"], "block")
            protocol.parse_launch_args(args["args"])
            if args["name"] == "explode":
                raise RemoteError("kernel explode failed: illegal address")
            self.launches.append(args)
        elif op == "info":
            out.update(gpu={"uuid": "SIM-0"}, mem_granted=1 << 20, mem_used=64, simulated=True)
        elif op == "close":
            self.closed_sessions.append(h["session"])
            self.close_event.set()
        send(Command.REPLY, out, payload)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def brokers(ctx: zmq.Context[Any]) -> Iterator[Callable[..., FakeBroker]]:
    made: list[FakeBroker] = []

    def make(**kwargs: Any) -> FakeBroker:
        broker = FakeBroker(ctx, **kwargs)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture
def broker(brokers: Callable[..., FakeBroker]) -> FakeBroker:
    return brokers()


# --------------------------------------------------------------------------- echo


def test_echo_roundtrip_and_payload_integrity(broker: FakeBroker) -> None:
    blob = os.urandom(3 << 20)
    arr = np.arange(10_000, dtype=np.float64).reshape(100, 100)
    with Client(broker.endpoint, timeout=10) as client:
        assert client.echo(b"hello") == b"hello"
        assert client.echo() == b""
        assert client.echo(bytearray(b"\x00\xff" * 10)) == b"\x00\xff" * 10
        assert client.echo(blob) == blob
        back = np.frombuffer(client.echo(arr), dtype=np.float64).reshape(100, 100)
        np.testing.assert_array_equal(back, arr)
        with pytest.raises(InvalidRequest, match="C-contiguous"):
            client.echo(arr[:, ::2])
    request = next(h for c, h, _ in broker.seen if c is Command.REQUEST)
    assert request["need"] == {"tenant": "default"}  # broker defaults apply
    assert request["deadline_ms"] == 10_000
    assert client.closed


def test_submit_many_and_wait_out_of_order(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=10) as client:
        pendings = [(i, client.submit_echo(b"msg-%d" % i)) for i in range(100)]
        for i, pending in reversed(pendings):
            assert pending.wait() == b"msg-%d" % i
            assert pending.done()
            assert pending.wait() == b"msg-%d" % i  # the result is kept
        assert len({p.id for _, p in pendings}) == 100
        assert client._conn._table == {} and client._conn._awaiting == 0


def test_stale_reply_for_unknown_id_is_dropped(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=5) as client:
        assert client.echo(b"stale-first") == b"stale-first"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("BUSY", Busy),
        ("NO_CAPACITY", NoCapacity),
        ("REMOTE_ERROR", RemoteError),
        ("SESSION_LOST", SessionLost),
    ],
)
def test_error_reply_raises_the_matching_exception(
    broker: FakeBroker, code: str, cls: type[GpudError]
) -> None:
    with Client(broker.endpoint, timeout=5) as client:
        with pytest.raises(cls) as info:
            client.echo(b"error:" + code.encode())
        assert info.value.code == code
        assert info.value.message == f"scripted {code}"
        with pytest.raises(cls):  # an ERROR command naming the id means the same
            client.echo(b"errcmd:" + code.encode())
        with pytest.raises(GpudError, match="unknown error code") as unknown:
            client.echo(b"error:FROBNICATED")
        assert unknown.value.code == "FROBNICATED"


def test_deadline_when_broker_stays_silent(brokers: Callable[..., FakeBroker]) -> None:
    silent = brokers(silent=True)
    with Client(silent.endpoint, timeout=0.6, ping_interval=FAST) as client:
        pending = client.submit_echo(b"anyone?")
        start = time.monotonic()
        with pytest.raises(Timeout, match=r"no reply within 0\.6s"):
            pending.wait()
        assert 0.55 < time.monotonic() - start < 2.0
        with pytest.raises(Timeout):  # the sync call abandons and cancels; same deadline
            client.echo(b"again", timeout=0.3)
        # Seen before the client closes: closing drops what zmq has not sent yet, and on a busy
        # machine the CANCEL may still be queued right after the call returns.
        assert wait_for(lambda: any(c is Command.CANCEL for c, _, _ in silent.seen))
    # It was PINGed, given up and reconnected to (one endpoint), with the same id re-sent.
    assert wait_for(lambda: silent.requests().count(pending.id) >= 2)
    assert any(c is Command.PING for c, _, _ in silent.seen)


def test_failover_resends_the_same_id_to_the_next_endpoint(
    brokers: Callable[..., FakeBroker],
) -> None:
    silent, good = brokers(silent=True), brokers()
    with Client([silent.endpoint, good.endpoint], timeout=10, ping_interval=FAST) as client:
        pending = client.submit_echo(b"over there")
        assert pending.wait() == b"over there"
        assert client.endpoint == good.endpoint
        assert client.echo(b"next") == b"next"  # stays on the endpoint that answers
    assert wait_for(lambda: silent.requests() == [pending.id])
    assert good.requests()[0] == pending.id
    assert len(good.requests()) == 2


def test_reconnects_to_a_single_endpoint_that_lost_the_request(
    brokers: Callable[..., FakeBroker],
) -> None:
    restarted = brokers(mute=2)  # drops the REQUEST and the PING, as a restarted broker would
    with Client(restarted.endpoint, timeout=10, ping_interval=FAST) as client:
        pending = client.submit_echo(b"retry me")
        assert pending.wait() == b"retry me"
    assert restarted.requests() == [pending.id, pending.id]
    idents = [ident for c, _, ident in restarted.seen if c is Command.REQUEST]
    assert idents[0] != idents[1]  # a fresh socket


def test_garbage_header_is_dropped_then_timeout(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=0.5, ping_interval=FAST) as client:
        with pytest.raises(Timeout, match="malformed message"):
            client.echo(b"garbage-header")
        assert client.echo(b"still fine") == b"still fine"


@pytest.mark.parametrize("payload", [b"bad-ok", b"bad-worker"])
def test_wrong_types_in_a_reply_raise_protocol_error(broker: FakeBroker, payload: bytes) -> None:
    with Client(broker.endpoint, timeout=5) as client:
        with pytest.raises(ProtocolError):
            client.echo(payload)


# --------------------------------------------------------------------------- jobs


def test_run_job(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=7, tenant="lab-1") as client:
        result = client.run(
            ["prog", "--flag"],
            files={"in.txt": b"abc", "arr.bin": np.array([100, 101], dtype=np.uint8)},
            outputs=["out.txt", "missing.txt"],
            env={"FOO": "1"},
            gpu_milli=250,
            mem=1 << 20,
            models=["Sim"],
            min_cc=(7, 0),
            priority=5,
            time_limit=2.5,
        )
        assert isinstance(result, JobResult)
        assert result.exit_code == 3
        assert result.stdout == b'prog --flag {"FOO": "1"}'
        assert result.stderr == b"warning" and result.stderr_truncated
        assert not result.stdout_truncated and not result.timed_out
        assert result.files == {"out.txt": b"ABCDE"}
        assert (result.worker, result.gpus, result.user) == ("w1", ["SIM-0"], "gpud-lab-1-1")

        job = client.submit(["true"], time_limit=100)
        assert job.wait().exit_code == 3
    first, second = (h for c, h, _ in broker.seen if c is Command.REQUEST)
    assert first["need"] == {
        "tenant": "lab-1",
        "gpu_milli": 250,
        "mem": 1 << 20,
        "models": ["Sim"],
        "min_cc": [7, 0],
        "priority": 5,
    }
    assert first["files"] == ["in.txt", "arr.bin"] and first["time_limit"] == 2.5
    assert second["deadline_ms"] == 7000  # queue wait: the client timeout
    assert job._default_timeout == 107.0  # time_limit + timeout


def test_job_arguments_are_checked_before_sending(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=5) as client:
        with pytest.raises(InvalidRequest, match="argv"):
            client.run("prog --flag")
        with pytest.raises(InvalidRequest, match="bad file name"):
            client.run(["prog"], files={"../etc/passwd": b""})
        with pytest.raises(InvalidRequest, match="gpu_milli"):
            client.run(["prog"], gpu_milli=5000)
        with pytest.raises(InvalidRequest, match="environment"):
            client.run(["prog"], env={"lower": "x"})
    assert broker.requests() == []


# --------------------------------------------------------------------------- sessions


def test_session_memory_and_launch(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=5) as client:
        with client.session(mem=1 << 20, model="Sim") as s:
            assert (s.worker, s.gpu["uuid"]) == ("w1", "SIM-0")
            x = s.mem_alloc(64)
            y = s.mem_alloc(64)
            assert isinstance(x, DevicePtr) and x.nbytes == 64
            data = np.arange(16, dtype=np.float32)
            s.memcpy_htod(x, data)
            s.memcpy_htod(y, b"\x01\x02", offset=4)
            out = np.zeros(16, dtype=np.float32)
            assert s.memcpy_dtoh(x, out=out) is out
            np.testing.assert_array_equal(out, data)
            assert s.memcpy_dtoh(y, 4, offset=4) == b"\x01\x02\x00\x00"
            assert len(s.memcpy_dtoh(y)) == 64
            half = bytearray(8)
            s.memcpy_dtoh(x, out=half, offset=8)
            assert bytes(half) == data.tobytes()[8:16]
            with pytest.raises(InvalidRequest, match="out holds 64 bytes but nbytes is 32"):
                s.memcpy_dtoh(x, 32, out=out)
            with pytest.raises(InvalidRequest, match="writable"):
                s.memcpy_dtoh(x, out=b"\x00" * 64)
            with pytest.raises(InvalidRequest, match="do not fit"):
                s.memcpy_htod(x, bytes(65))

            s.launch(
                BUILTIN, "saxpy", grid=2, block=(32, 1), args=[np.float32(2.5), x, y, np.int32(16)]
            )
            with pytest.raises(InvalidRequest) as plain:
                s.launch(BUILTIN, "saxpy", args=[np.float32(2.5), x, 5])
            assert plain.value.message == (
                "argument 2: give a number with its exact C type, e.g. ('i32', 5), ('f32', 2.0) "
                "or numpy.int32(5)"
            )
            with pytest.raises(InvalidRequest, match="grid"):
                s.launch(BUILTIN, "saxpy", grid=(1, 2, 3, 4))
            with pytest.raises(RemoteError, match="illegal address"):
                s.launch(BUILTIN, "explode")
            s.synchronize()
            info = s.device_info()
            assert info["mem_granted"] == 1 << 20 and info["simulated"] is True
            s.mem_free(y)
        assert s.closed
        s.close()  # idempotent
        with pytest.raises(SessionLost):
            s.synchronize()
    assert broker.launches == [
        {
            "module": "builtin",
            "name": "saxpy",
            "grid": [2],
            "block": [32, 1],
            "args": [["f32", 2.5], ["ptr", x.handle], ["ptr", y.handle], ["i32", 16]],
            "shared_mem": 0,
        }
    ]
    ops = [h["op"] for c, h, _ in broker.seen if c is Command.CALL]
    assert ops.count("close") == 1 and ops[-1] == "close"
    request = next(h for c, h, _ in broker.seen if c is Command.REQUEST)
    assert request["kind"] == "session" and request["need"] == {
        "tenant": "default",
        "mem": 1 << 20,
        "models": ["Sim"],
    }


def test_a_second_thread_is_refused_while_the_first_is_in_a_call(broker: FakeBroker) -> None:
    """Two threads on one Client once got each other's replies (an echo returned the other
    thread's request bytes): a call while another thread is inside one is refused, and the call
    under way is unharmed. One thread after the other is fine."""
    with Client(broker.endpoint, timeout=5) as client:
        session = client.session()
        pending = client.submit_echo(b"main")
        held = client.submit_echo(b"silent")  # the fake broker never answers it
        calls: list[Callable[[], object]] = [
            lambda: client.echo(b"other"),
            lambda: client.submit_echo(b"other"),
            lambda: client.run(["prog"]),
            client.session,
            pending.wait,
            pending.done,
            pending.cancel,
            lambda: session.mem_alloc(16),
            client.close,
        ]
        errors: list[str] = []

        def other() -> None:
            assert wait_for(client._conn._busy.locked)  # the main thread is inside its wait
            for call in calls:
                try:
                    call()
                    errors.append("accepted")
                except GpudError as exc:
                    errors.append(exc.message)

        thread = threading.Thread(target=other, name="other")
        thread.start()
        with pytest.raises(Timeout):
            held.wait(timeout=3)  # the other thread's calls are refused meanwhile
        thread.join(10)
        want = "the client is in use by another thread (this call is from thread 'other')"
        assert len(errors) == len(calls) and all(e.startswith(want) for e in errors), errors
        assert pending.wait() == b"main" and client.echo(b"again") == b"again"
        assert not session.closed and session.mem_alloc(16).nbytes == 16

        # Handed to another thread, one at a time: fine.
        results: list[bytes] = []
        later = threading.Thread(target=lambda: results.append(client.echo(b"later")))
        later.start()
        later.join(10)
        assert results == [b"later"]
    assert client.closed and session.closed


def test_need_value_sends_what_the_keywords_send(broker: FakeBroker) -> None:
    """``need=Need(...)`` and the keywords are two spellings of one need."""
    with Client(broker.endpoint, timeout=5, tenant="lab-1") as client:
        client.run(["prog"], gpu_milli=250, mem=1 << 20, models=["Sim"], min_cc=(7, 0), priority=5)
        client.run(["prog"], need=Need(gpu_milli=250, mem=1 << 20, models=["Sim"], min_cc=(7, 0), priority=5))
        client.submit(["prog"], gpus=2, exclusive=True).wait()
        client.submit(["prog"], need=Need(gpus=2, exclusive=True)).wait()
        with client.session(mem=1 << 20, model="Sim", models=["Big"]):
            pass
        with client.session(need=Need(mem=1 << 20, models=["Big", "Sim"])):
            pass
        with pytest.raises(InvalidRequest, match="not both"):
            client.submit(["prog"], gpus=1, need=Need(gpus=1))
        with pytest.raises(InvalidRequest, match="must be a gpud_client.Need"):
            client.session(need={"mem": 1})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="gpu_milli"):
            client.session(need=Need(gpu_milli=5000))  # refused before it is sent
        client.run(["prog"], cpu_milli=500, host_mem=64 << 20)
        client.run(["prog"], need=Need(cpu_milli=500, host_mem=64 << 20))
        with client.session(host_mem=32 << 20):
            pass
        with pytest.raises(InvalidRequest, match="host_mem"):
            client.run(["prog"], host_mem=-1)  # refused before it is sent
    needs = [h["need"] for c, h, _ in broker.seen if c is Command.REQUEST]
    assert len(needs) == 9
    assert needs[6] == needs[7] == {"tenant": "lab-1", "cpu_milli": 500, "host_mem": 64 << 20}
    assert needs[8] == {"tenant": "lab-1", "host_mem": 32 << 20}
    assert needs[0] == needs[1] == {"tenant": "lab-1", "gpu_milli": 250, "mem": 1 << 20,
                                    "models": ["Sim"], "min_cc": [7, 0], "priority": 5}
    assert needs[2] == needs[3] == {"tenant": "lab-1", "gpus": 2, "exclusive": True}
    assert needs[4] == needs[5] == {"tenant": "lab-1", "mem": 1 << 20, "models": ["Big", "Sim"]}


def test_pointer_of_another_session_is_refused(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=5) as client, client.session() as a, client.session() as b:
        p = a.mem_alloc(16)
        with pytest.raises(InvalidRequest, match="another session"):
            b.launch(BUILTIN, "reduce_sum", args=[p, p, np.int32(4)])
        with pytest.raises(InvalidRequest, match="another session"):
            b.memcpy_dtoh(p)


@pytest.mark.parametrize(
    ("value", "tag"),
    [
        (np.float32(1.5), ["f32", 1.5]),
        (np.float64(-2.25), ["f64", -2.25]),
        (np.int32(-7), ["i32", -7]),
        (np.uint32(4_000_000_000), ["u32", 4_000_000_000]),
        (np.int64(-(1 << 40)), ["i64", -(1 << 40)]),
        (np.uint64((1 << 64) - 1), ["u64", (1 << 64) - 1]),
    ],
)
def test_launch_arg_encoding(value: Any, tag: list[Any]) -> None:
    encoded = encode_launch_arg(0, value, b"s" * 16)
    assert encoded == tag and type(encoded[1]) is type(tag[1])
    protocol.parse_launch_args([encoded])  # the worker's validator accepts it


@pytest.mark.parametrize(
    "value", [5, 2.5, True, np.int16(3), np.float16(1), np.zeros(3, np.float32), "x"]
)
def test_launch_arg_refused(value: Any) -> None:
    with pytest.raises(InvalidRequest, match="argument 1"):
        encode_launch_arg(1, value, b"s" * 16)


@pytest.mark.parametrize(
    ("value", "tag"),
    [
        (("f32", 1.5), ["f32", 1.5]),
        (("f32", 2), ["f32", 2.0]),
        (("f64", -2.25), ["f64", -2.25]),
        (("i32", -7), ["i32", -7]),
        (("u32", 4_000_000_000), ["u32", 4_000_000_000]),
        (("i64", -(1 << 40)), ["i64", -(1 << 40)]),
        (("u64", (1 << 64) - 1), ["u64", (1 << 64) - 1]),
    ],
)
def test_launch_arg_typed_pair(value: Any, tag: list[Any]) -> None:
    """Plain Python numbers with their C type named: what a client without numpy passes."""
    encoded = encode_launch_arg(0, value, b"s" * 16)
    assert encoded == tag and type(encoded[1]) is type(tag[1])
    protocol.parse_launch_args([encoded])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (("i32", 1 << 31), "i32 takes an int that fits i32"),
        (("u32", -1), "u32 takes an int that fits u32"),
        (("i32", 2.5), "i32 takes an int"),
        (("i32", True), "i32 takes an int"),
        (("f32", "2"), "f32 takes a number"),
        (("f16", 1.0), "'f16' is not a kernel argument type"),
        (("ptr", 3), "'ptr' is not a kernel argument type"),
        (("i32", 1, 2), "cannot pass tuple"),
    ],
)
def test_launch_arg_typed_pair_refused(value: Any, why: str) -> None:
    with pytest.raises(InvalidRequest, match="argument 1: .*" + re.escape(why)):
        encode_launch_arg(1, value, b"s" * 16)


def test_keepalive_pings_name_open_sessions(broker: FakeBroker) -> None:
    with Client(broker.endpoint, timeout=5, keepalive=0.05) as client:
        s = client.session()
        thread = client._conn._ka_thread
        assert thread is not None and thread.is_alive()
        assert broker.ping_event.wait(5)
        main_idents = {ident for c, _, ident in broker.seen if c is Command.REQUEST}
        ident, sessions = next((i, ss) for i, ss in broker.pings if ss)
        assert sessions == [s.id] and ident not in main_idents  # its own socket
        s.close()
        thread.join(5)
        assert not thread.is_alive() and client._conn._ka_thread is None
        s2 = client.session()  # a new session starts a new keepalive
        assert client._conn._ka_thread is not None and client._conn._ka_thread.is_alive()
    # Closing the client closed the open session (fire and forget) and stopped the keepalive.
    assert broker.close_event.wait(5)
    assert wait_for(lambda: s2.id in broker.closed_sessions)
    assert s2.closed


def test_client_rejects_bad_configuration() -> None:
    with pytest.raises(GpudError, match="endpoints"):
        Client([])
    with pytest.raises(GpudError, match="timeout"):
        Client("tcp://127.0.0.1:1", timeout=0)
    with pytest.raises(GpudError, match="tenant"):
        Client("tcp://127.0.0.1:1", tenant="no spaces")
    with pytest.raises(GpudError, match="cannot connect"):
        Client("nonsense://here")


def test_import_does_not_load_numpy() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "libclient")]))
    code = "import sys, gpud_client, gpud_client.ctl; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


# --------------------------------------------------------------------------- gpudctl


def test_ctl_status_json(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    rc = ctl.main(["--admin", broker.admin_endpoint, "--timeout", "5", "status", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == STATUS
    command, header, _ = broker.seen[-1]
    assert command is Command.ADMIN and header["cmd"] == "status" and header["args"] == {}


def test_ctl_status_table(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    assert ctl.main(["--admin", broker.admin_endpoint, "status"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 and line == line.rstrip() for line in lines), out
    assert lines[0].startswith("broker ctl-a (active, 0.1.0) up 1h02m  policy balanced")
    assert "running 1" in lines[1] and "done 17" in lines[1]
    rows = [line for line in lines if line.startswith("w1")]
    assert len(rows) == 2 and all(" SIM " in row for row in rows)
    assert "38%" in rows[1] and "1.5/16.0" in rows[1] and " 500 " in rows[1]


def test_ctl_error_reply_exits_1(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    broker.admin_error = ("SHUTTING_DOWN", "the broker is stopping")
    assert ctl.main(["--admin", broker.admin_endpoint, "status"]) == 1
    assert "SHUTTING_DOWN: the broker is stopping" in capsys.readouterr().err


def test_ctl_timeout_exits_3(
    ctx: zmq.Context[Any], capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    silent = ctx.socket(zmq.ROUTER)
    try:
        silent.bind("tcp://127.0.0.1:*")
        endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        start = time.monotonic()
        assert ctl.main(["--admin", endpoint, "--timeout", "0.5", "status"]) == 3
        assert time.monotonic() - start < 3
    finally:
        silent.close(linger=0)
    assert "did not answer within 0.5s" in capsys.readouterr().err


def test_ctl_usage_exits_2(capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    assert ctl.main(["status", "--bogus"]) == 2
    assert ctl.main([]) == 2
    assert "usage" in capsys.readouterr().err
