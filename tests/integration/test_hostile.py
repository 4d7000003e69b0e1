"""Hostile input against a live broker: garbage, lies and out-of-bounds messages on both sockets.

One broker with one simulated worker runs as subprocesses for the whole module, once without
security and once with CURVE (then the raw sockets hold allowed keys). Raw DEALER sockets
throw malformed messages at the frontend (client dialog) and the backend (worker dialog). Where
PROTOCOL.md says the broker answers, the answer is checked frame by frame (signature of the socket's
own dialog, command, error code, the request id when it was readable). After every case the broker
must still be running and still serve a real client through the real worker.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, apply_client_keys
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

ANSWER_TIMEOUT_S = 5.0
BAD_LOG_S = 2.0  # the broker's bad_log_s: one bad-message line in full per sender per this many seconds
REQUEST = P.CMD_BYTES[Command.REQUEST]
ERROR = P.CMD_BYTES[Command.ERROR]
REPLY = P.CMD_BYTES[Command.REPLY]

# Bad messages sent so far in this module; the broker must account in its log for (at least) each
# one that reached its frontend or backend decoding (a line, or a count), and sent_bad counts exactly those.
sent_bad = [0]


# --------------------------------------------------------------------------- fixtures and helpers


# Under CURVE, the keys the raw sockets connect with, by endpoint: a client key of tenant
# "hostile" on the frontend, the allowed worker key "hostile" on the backend (its READYs under
# other names are refused); none on the IPC admin socket.
KEYS: dict[str, CurveKeys] = {}


@pytest.fixture(scope="module", params=["none", "curve"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Without security, and with CURVE: what an authenticated tenant or worker can send."""
    conf = tmp_path_factory.mktemp("hostile") / "broker.toml"
    conf.write_text(f"[broker]\nbad_log_s = {BAD_LOG_S}\n")
    c = LocalCluster(workers=1, gpus_per_worker=1, log_level="INFO", security=request.param,
                     broker_args=["--config", str(conf)])
    try:
        c.start()
        KEYS.clear()
        sent_bad[0] = 0
        if c.security == "curve":
            KEYS[c.frontend] = c.client_keys("hostile")
            KEYS[c.backend] = CurveKeys.from_files(c._pair("hostile", c.keys / "workers"), c.keys / "broker.key")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.term()


@contextmanager
def dealer(ctx: zmq.Context[Any], endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if endpoint in KEYS:
        apply_client_keys(sock, KEYS[endpoint])
    try:
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close(0)


def recv(sock: zmq.Socket[bytes], timeout: float = ANSWER_TIMEOUT_S) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), f"the broker did not answer within {timeout:g}s"
    return sock.recv_multipart()


def exchange(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[bytes]:
    sock.send_multipart(frames)
    return recv(sock)


def expect_error(reply: list[bytes], peer: Peer, code: str, rid: bytes | None = None) -> dict[str, Any]:
    """``reply`` is an ERROR of ``peer``'s dialog with ``code`` (and ``rid`` when given)."""
    msg = P.decode(reply, expect=peer)  # the answer itself is well-formed
    assert reply[0] == peer.value
    assert msg.command is Command.ERROR, f"expected ERROR {code}, got {msg.command.name} {msg.header}"
    h = msg.header
    assert h.get("code") == code, h
    assert type(h.get("message")) is str and h["message"], h
    if rid is not None:
        assert h.get("id") == rid, h
    assert msg.frames == []
    return h


def expect_refused(reply: list[bytes], rid: bytes, code: str) -> dict[str, Any]:
    """``reply`` is a client REPLY with ``ok: false``, ``code`` and the request's own id."""
    msg = P.decode(reply, expect=Peer.CLIENT)
    assert msg.command is Command.REPLY, f"expected REPLY, got {msg.command.name} {msg.header}"
    h = msg.header
    assert h.get("id") == rid and h.get("ok") is False and h.get("code") == code, h
    assert type(h.get("message")) is str and h["message"], h
    assert msg.frames == []
    return h


def assert_alive(cluster: LocalCluster) -> None:
    """The broker process runs and a real client still gets an echo through the real worker."""
    assert cluster.broker is not None and cluster.broker.poll() is None, cluster.log_tail("broker")
    with Client(cluster.frontend, timeout=5, curve=KEYS.get(cluster.frontend)) as client:
        assert client.echo(b"still alive") == b"still alive"
    assert cluster.broker.poll() is None


def header(**fields: Any) -> bytes:
    return P.packb(fields)


def client_msg(command: Command, hdr: bytes, *payload: bytes) -> list[bytes]:
    return [Peer.CLIENT.value, P.CMD_BYTES[command], hdr, *payload]


def worker_msg(command: Command, hdr: bytes, *payload: bytes) -> list[bytes]:
    return [Peer.WORKER.value, P.CMD_BYTES[command], hdr, *payload]


def echo_header(rid: Any = None, **extra: Any) -> bytes:
    fields: dict[str, Any] = {"kind": "echo", "need": {"tenant": "default"}, "deadline_ms": 5000}
    if rid is not None:
        fields["id"] = rid
    fields.update(extra)
    return P.packb(fields)


def nested_list(depth: int) -> bytes:
    """A msgpack value nested ``depth`` lists deep (0x91: a one-element fixarray), inside a map."""
    return b"\x81\xa1x" + b"\x91" * depth + b"\xc0"


# --------------------------------------------------------------------------- the broker is up


def test_cluster_serves_before_the_attack(cluster: LocalCluster) -> None:
    assert cluster.status()["counts"]["workers"] == 1
    assert_alive(cluster)


# --------------------------------------------------------------------------- frontend: one bad message each

RID = bytes(range(16))

# (case name, frames after the ROUTER identity, expected ERROR code, id the ERROR must carry)
FRONTEND_ERRORS: list[tuple[str, list[bytes], str, bytes | None]] = [
    ("wrong signature", [b"HTTP/1", REQUEST, echo_header(RID)], "PROTOCOL", RID),
    ("short signature", [b"GPUD", REQUEST, echo_header(RID)], "PROTOCOL", RID),
    ("empty frames", [b"", b"", b""], "PROTOCOL", None),
    ("one frame", [Peer.CLIENT.value], "PROTOCOL", None),
    ("two frames", [Peer.CLIENT.value, REQUEST], "PROTOCOL", None),
    ("wrong version", [b"GPUDC9", REQUEST, echo_header(RID)], "VERSION", RID),
    ("version zero", [b"GPUDC0", REQUEST, echo_header(RID)], "VERSION", RID),
    ("garbage msgpack header", client_msg(Command.REQUEST, b"\xc1\xff\x00garbage"), "PROTOCOL", None),
    ("truncated msgpack header", client_msg(Command.REQUEST, echo_header(RID)[:-3]), "PROTOCOL", None),
    ("bin32 header claiming 2 GiB", client_msg(Command.REQUEST, b"\xc6\x7f\xff\xff\xff abc"), "PROTOCOL", None),
    ("header is a msgpack list", client_msg(Command.REQUEST, msgpack.packb([RID, "echo"])), "PROTOCOL", None),
    ("header is a msgpack int", client_msg(Command.REQUEST, msgpack.packb(7)), "PROTOCOL", None),
    ("header map with int keys", client_msg(Command.REQUEST, msgpack.packb({1: 2})), "PROTOCOL", None),
    ("header nested 50000 deep", client_msg(Command.REQUEST, nested_list(50_000)), "PROTOCOL", None),
    ("empty header frame", client_msg(Command.REQUEST, b""), "PROTOCOL", None),
    ("unknown command byte", [Peer.CLIENT.value, b"\x42", echo_header(RID)], "UNKNOWN_COMMAND", RID),
    ("two-byte command", [Peer.CLIENT.value, b"\x01\x01", echo_header(RID)], "UNKNOWN_COMMAND", RID),
    ("empty command", [Peer.CLIENT.value, b"", echo_header(RID)], "UNKNOWN_COMMAND", RID),
    ("client sends READY", client_msg(Command.READY, header(name="w", gpus=[])), "UNKNOWN_COMMAND", None),
    ("client sends RESULT", client_msg(Command.RESULT, header(id=RID, ok=True), b"x"), "UNKNOWN_COMMAND", RID),
    ("client sends HEARTBEAT", client_msg(Command.HEARTBEAT, header(seq=1)), "UNKNOWN_COMMAND", None),
    ("client sends DISPATCH", client_msg(Command.DISPATCH, header(id=RID, kind="echo")), "UNKNOWN_COMMAND", RID),
    ("client sends REPLY", client_msg(Command.REPLY, header(id=RID, ok=True)), "UNKNOWN_COMMAND", RID),
    ("client sends ERROR", client_msg(Command.ERROR, header(code="X", message="y")), "UNKNOWN_COMMAND", None),
    ("client sends ADMIN", client_msg(Command.ADMIN, header(id=RID, cmd="status")), "UNKNOWN_COMMAND", RID),
    ("worker signature on the frontend", worker_msg(Command.READY, header(name="w", gpus=[])), "UNKNOWN_COMMAND", None),
    ("worker RESULT on the frontend", worker_msg(Command.RESULT, header(id=RID, ok=True)), "UNKNOWN_COMMAND", RID),
    ("admin signature on the frontend",
     [Peer.ADMIN.value, P.CMD_BYTES[Command.ADMIN], header(id=RID, cmd="status", args={})], "UNKNOWN_COMMAND", RID),
    ("oversized header", client_msg(Command.REQUEST, echo_header(RID, pad="x" * (P.MAX_HEADER_BYTES + 1))),
     "TOO_LARGE", None),
    ("too many payload frames", client_msg(Command.REQUEST, echo_header(RID), *([b"p"] * (P.MAX_PAYLOAD_FRAMES + 1))),
     "TOO_LARGE", RID),
    ("REQUEST without id", client_msg(Command.REQUEST, echo_header()), "PROTOCOL", None),
    ("REQUEST with a str id", client_msg(Command.REQUEST, echo_header("0123456789abcdef")), "PROTOCOL", None),
    ("REQUEST with an int id", client_msg(Command.REQUEST, echo_header(12345)), "PROTOCOL", None),
    ("REQUEST with a 15-byte id", client_msg(Command.REQUEST, echo_header(RID[:15])), "PROTOCOL", None),
    ("REQUEST with a 17-byte id", client_msg(Command.REQUEST, echo_header(RID + b"!")), "PROTOCOL", None),
    ("REQUEST with a nil id", client_msg(Command.REQUEST, echo_header(None, id=None)), "PROTOCOL", None),
    ("CANCEL with a list id", client_msg(Command.CANCEL, header(id=[1, 2])), "PROTOCOL", None),
    ("CALL without id", client_msg(Command.CALL, header(session=RID, op="info")), "PROTOCOL", None),
    # Only the broker and workers send BATCH (PROTOCOL.md §2.1), however well-formed.
    ("client sends BATCH", P.batch([client_msg(Command.REQUEST, echo_header(RID), b"x"),
                                    client_msg(Command.PING, header())]), "UNKNOWN_COMMAND", None),
]


@pytest.mark.parametrize(
    ("frames", "code", "rid"),
    [pytest.param(f, c, r, id=name) for name, f, c, r in FRONTEND_ERRORS],
)
def test_frontend_malformed_gets_error(
    cluster: LocalCluster, ctx: zmq.Context[Any], frames: list[bytes], code: str, rid: bytes | None
) -> None:
    with dealer(ctx, cluster.frontend) as sock:
        reply = exchange(sock, frames)
        sent_bad[0] += 1
        expect_error(reply, Peer.CLIENT, code, rid)
        assert not sock.poll(50), "exactly one answer per message"
    assert_alive(cluster)


# (case name, header fields besides id/kind/deadline, expected REPLY code)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("gpu_milli 5000", {"need": {"gpu_milli": 5000}}, "INVALID_REQUEST"),
    ("gpu_milli negative", {"need": {"gpu_milli": -1}}, "INVALID_REQUEST"),
    ("gpu_milli a string", {"need": {"gpu_milli": "all"}}, "INVALID_REQUEST"),
    ("gpu_milli a bool", {"need": {"gpu_milli": True}}, "INVALID_REQUEST"),
    ("gpu_milli a huge int", {"need": {"gpu_milli": 1 << 63}}, "INVALID_REQUEST"),
    ("tenant with spaces", {"need": {"tenant": "evil tenant"}}, "INVALID_REQUEST"),
    ("tenant too long", {"need": {"tenant": "t" * 65}}, "INVALID_REQUEST"),
    ("tenant empty", {"need": {"tenant": ""}}, "INVALID_REQUEST"),
    ("tenant not a str", {"need": {"tenant": b"bytes"}}, "INVALID_REQUEST"),
    ("gpus 65", {"need": {"gpus": 65}}, "INVALID_REQUEST"),
    ("gpus with a share", {"need": {"gpus": 1, "gpu_milli": 500}}, "INVALID_REQUEST"),
    ("priority 101", {"need": {"priority": 101}}, "INVALID_REQUEST"),
    ("models empty", {"need": {"models": []}}, "INVALID_REQUEST"),
    ("min_cc garbage", {"need": {"min_cc": [1, 2, 3]}}, "INVALID_REQUEST"),
    ("need a list", {"need": [1000]}, "INVALID_REQUEST"),
    ("unknown kind", {"kind": "rm -rf"}, "INVALID_REQUEST"),
    ("kind a list", {"kind": ["echo"]}, "INVALID_REQUEST"),
    ("deadline negative", {"deadline_ms": -5}, "INVALID_REQUEST"),
    ("deadline a float", {"deadline_ms": 1.5}, "INVALID_REQUEST"),
    ("job argv empty", {"kind": "job", "argv": []}, "INVALID_REQUEST"),
    ("job file name escapes", {"kind": "job", "argv": ["true"], "files": ["../etc/passwd"]}, "INVALID_REQUEST"),
    ("no worker has 8 GPUs", {"need": {"gpus": 8}}, "NO_CAPACITY"),
    ("no GPU has 1 TiB", {"need": {"mem": 1 << 40}}, "NO_CAPACITY"),
    ("no such model", {"need": {"models": ["H100-SXM"]}}, "NO_CAPACITY"),
    ("no such compute capability", {"need": {"min_cc": [99, 0]}}, "NO_CAPACITY"),
]


@pytest.mark.parametrize(
    ("fields", "code"),
    [pytest.param(f, c, id=name) for name, f, c in BAD_REQUESTS],
)
def test_bad_request_content_is_refused_with_its_id(
    cluster: LocalCluster, ctx: zmq.Context[Any], fields: dict[str, Any], code: str
) -> None:
    rid = P.new_id()
    with dealer(ctx, cluster.frontend) as sock:
        reply = exchange(sock, client_msg(Command.REQUEST, echo_header(rid, **fields)))
        expect_refused(reply, rid, code)
        assert not sock.poll(50), "exactly one answer per message"
    assert_alive(cluster)


def test_cancel_of_unknown_id_is_ignored_and_ping_answered(cluster: LocalCluster, ctx: zmq.Context[Any]) -> None:
    """CANCEL of an unknown id gets no answer (§4.1); a PING with junk sessions still gets a PONG."""
    with dealer(ctx, cluster.frontend) as sock:
        sock.send_multipart(client_msg(Command.CANCEL, header(id=P.new_id())))
        reply = exchange(sock, client_msg(Command.PING, header(sessions=[1, "x", None, b"short", P.new_id()])))
        msg = P.decode(reply, expect=Peer.CLIENT)
        assert msg.command is Command.PONG
        assert not sock.poll(50)
    assert_alive(cluster)


# --------------------------------------------------------------------------- random frames, both sockets

_JUNK_VALUES: list[Any] = [None, 0, -1, 1 << 40, 3.5, True, "", "x" * 200, b"", b"\x00" * 15, b"\xff" * 17,
                           [], [1, "a"], {}, {"gpu_milli": 5000}]
_JUNK_KEYS = ["id", "kind", "need", "session", "op", "args", "name", "gpus", "seq", "ok", "code", "sessions"]


def _random_message(rng: random.Random, sig: bytes) -> list[bytes]:
    """A message of random frames, shaped enough like ours to get past the first checks sometimes.

    Never a valid request: ids are never 16 bytes and names never valid, so every message must get
    exactly one answer (an ERROR, a PONG, or a DISCONNECT for an unknown worker).
    """
    def junk(n: int) -> bytes:
        return rng.randbytes(rng.randint(0, n))

    first = rng.choice([sig, sig, Peer.CLIENT.value, Peer.WORKER.value, Peer.ADMIN.value, b"GPUDC7", junk(8)])
    frames = [first]
    if rng.random() < 0.95:
        frames.append(rng.choice([bytes([c]) for c in Command] + [junk(2)]))
    if rng.random() < 0.9:
        style = rng.random()
        if style < 0.5:
            frames.append(P.packb({rng.choice(_JUNK_KEYS): rng.choice(_JUNK_VALUES)
                                   for _ in range(rng.randint(0, 4))}))
        elif style < 0.7:
            frames.append(P.packb(rng.choice(_JUNK_VALUES)))
        else:
            frames.append(junk(64))
    frames += [junk(256) for _ in range(rng.choice([0, 0, 1, 2, 5, 40]))]
    return frames


def _count(reply: list[bytes], peer: Peer) -> int:
    return len(P.messages(P.decode(reply, expect=peer)))


@pytest.mark.parametrize("side", ["frontend", "backend"])
def test_random_frames(cluster: LocalCluster, ctx: zmq.Context[Any], side: str) -> None:
    peer = Peer.CLIENT if side == "frontend" else Peer.WORKER
    allowed = {Command.ERROR, Command.PONG} if side == "frontend" else {Command.ERROR, Command.DISCONNECT}
    rng = random.Random(0x6770_7564 + len(side))
    messages = [_random_message(rng, peer.value) for _ in range(300)]
    got: list[list[bytes]] = []
    with dealer(ctx, getattr(cluster, side)) as sock:
        for frames in messages:
            sock.send_multipart(frames)
        deadline = time.monotonic() + 10.0
        while sum(_count(reply, peer) for reply in got) < len(messages) and time.monotonic() < deadline:
            if sock.poll(200):
                got.append(sock.recv_multipart())
        assert not sock.poll(100)
    # Answers to a burst may come as BATCHes (PROTOCOL.md §2.1): what counts is the messages in them.
    answers = [one for reply in got for one in P.messages(P.decode(reply, expect=peer))]
    assert len(answers) == len(messages), f"{len(answers)} answers to {len(messages)} messages"
    for msg in answers:
        assert msg.command in allowed, (msg.command, msg.header)
        if msg.command is Command.ERROR and side == "frontend":  # backend: some are "bad READY"
            sent_bad[0] += 1
            assert msg.header.get("code") in {"PROTOCOL", "VERSION", "UNKNOWN_COMMAND", "TOO_LARGE"}, msg.header
    assert_alive(cluster)


def test_a_flood_of_bad_messages_is_answered_up_to_its_senders_allowance(
    cluster: LocalCluster, ctx: zmq.Context[Any]
) -> None:
    """PROTOCOL.md §7: of one sender's bad messages, BAD_ANSWERED per BAD_WINDOW_S are answered;
    the rest of that window's are counted (``bad_unanswered``) and not answered, so that a flood
    of them costs the broker no replies. Its well-formed messages are served all the while, and
    in a later window its bad messages are answered again."""
    from gpud_broker.broker import BAD_ANSWERED, BAD_WINDOW_S

    n = 3 * BAD_ANSWERED
    time.sleep(BAD_WINDOW_S)  # under CURVE the sender is the tenant: the earlier tests' window is over
    before = cluster.status()["counters"]["bad_unanswered"]
    with dealer(ctx, cluster.frontend) as sock:
        for _ in range(n):
            sock.send_multipart(client_msg(Command.REQUEST, b"\xc1"))
        sock.send_multipart(client_msg(Command.PING, header()))
        answers: list[P.Message] = []
        while not answers or answers[-1].command is not Command.PONG:
            answers += P.messages(P.decode(recv(sock), expect=Peer.CLIENT))
        assert not sock.poll(200)
        sent_bad[0] += n
        errors = [m for m in answers if m.command is Command.ERROR]
        assert len(answers) == len(errors) + 1 and {m.header["code"] for m in errors} == {"PROTOCOL"}
        unanswered = cluster.status()["counters"]["bad_unanswered"] - before
        # One window's allowance (two, were the burst read across a window's end under load).
        assert BAD_ANSWERED <= len(errors) <= 2 * BAD_ANSWERED, len(errors)
        assert len(errors) + unanswered == n, (len(errors), unanswered)
        time.sleep(BAD_WINDOW_S)
        expect_error(exchange(sock, client_msg(Command.REQUEST, b"\xc1")), Peer.CLIENT, "PROTOCOL")
        sent_bad[0] += 1
    assert_alive(cluster)


def test_a_sender_at_the_cut_has_its_connection_closed_and_its_key_held_off(
    cluster: LocalCluster, ctx: zmq.Context[Any]
) -> None:
    """PROTOCOL.md §7: at BAD_CUT bad messages within a BAD_WINDOW_S the broker closes the
    sender's connection (``cut_connections``) and, under CURVE, refuses its key's handshakes for
    BAD_HOLD_OFF_S: libzmq's reconnects fail their handshake. Other senders are served."""
    from zmq.utils.monitor import recv_monitor_message

    from gpud_broker.broker import BAD_CUT

    before = cluster.status()["counters"]
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    curve = cluster.security == "curve"
    if curve:  # a tenant of its own: "hostile"'s key must stay admitted for the tests after this one
        apply_client_keys(sock, cluster.client_keys("flooder"))
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(cluster.frontend)
        for _ in range(2 * BAD_CUT):
            sock.send_multipart(client_msg(Command.REQUEST, b"\xc1"))
        seen: set[int] = set()
        want = {zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_FAILED_AUTH} if curve else {zmq.EVENT_DISCONNECTED}
        deadline = time.monotonic() + 4 * ANSWER_TIMEOUT_S
        while not want <= seen and time.monotonic() < deadline:
            if monitor.poll(200):
                seen.add(int(recv_monitor_message(monitor)["event"]))
        assert want <= seen, seen
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    after = cluster.status()["counters"]
    assert after["cut_connections"] > before["cut_connections"]
    sent_bad[0] += after["bad_messages"] - before["bad_messages"]  # those that reached the broker
    assert_alive(cluster)


# --------------------------------------------------------------------------- backend


def test_result_from_unregistered_connection_is_told_to_reconnect(
    cluster: LocalCluster, ctx: zmq.Context[Any]
) -> None:
    with dealer(ctx, cluster.backend) as sock:
        for cmd, hdr in [
            (Command.RESULT, header(id=P.new_id(), ok=True, worker="w0")),
            (Command.HEARTBEAT, header(seq=1, gpus=[], running=[])),
            (Command.DISCONNECT, header(reason="bye")),
            # Not a worker command at all, but "anything but READY" from an unknown worker (§4.2).
            (Command.REQUEST, echo_header(RID)),
            (Command.ADMIN, header(id=RID, cmd="drain")),
        ]:
            reply = exchange(sock, worker_msg(cmd, hdr, b"payload"))
            msg = P.decode(reply, expect=Peer.WORKER)
            assert reply[0] == Peer.WORKER.value
            assert msg.command is Command.DISCONNECT, (cmd.name, msg.command.name, msg.header)
            assert msg.header.get("reason") == "unknown worker"
    assert cluster.status()["counts"]["workers"] == 1
    assert_alive(cluster)


GPU = {"uuid": "GPU-hostile-0", "index": 0, "model": "EVIL", "mem": 1 << 30, "cc": [8, 0]}

# (case name, READY header) -- each must be refused with an ERROR: PROTOCOL (a malformed READY),
# except that a wrong-typed optional field is also let pass as INVALID_REQUEST (see WRONG_TYPE).
BAD_READY: list[tuple[str, dict[str, Any]]] = [
    ("gpus a string", {"name": "evil", "gpus": "all of them"}),
    ("gpus a map", {"name": "evil", "gpus": {"uuid": "x"}}),
    ("gpus of ints", {"name": "evil", "gpus": [1, 2, 3]}),
    ("gpu uuid an int", {"name": "evil", "gpus": [{**GPU, "uuid": 5}]}),
    ("gpu mem negative", {"name": "evil", "gpus": [{**GPU, "mem": -1}]}),
    ("gpu cc garbage", {"name": "evil", "gpus": [{**GPU, "cc": "8.0"}]}),
    ("gpu index a bool", {"name": "evil", "gpus": [{**GPU, "index": True}]}),
    ("same gpu twice", {"name": "evil", "gpus": [GPU, GPU]}),
    ("65 gpus", {"name": "evil", "gpus": [{**GPU, "uuid": f"GPU-{i}"} for i in range(65)]}),
    ("no gpus key", {"name": "evil"}),
    ("no name", {"gpus": [GPU]}),
    ("name too long", {"name": "n" * 129, "gpus": [GPU]}),
    ("slots zero", {"name": "evil", "gpus": [GPU], "slots": 0}),
    ("heartbeat a string", {"name": "evil", "gpus": [GPU], "heartbeat_ms": "fast"}),
    ("slots a float", {"name": "evil", "gpus": [GPU], "slots": 1.5}),
]
# PROTOCOL.md §2 makes a wrong-typed value a malformed message (PROTOCOL); the broker currently
# answers INVALID_REQUEST for wrong-typed optional READY fields (they go through protocol.opt).
WRONG_TYPE = {"heartbeat a string", "slots a float"}


def test_ready_with_garbage_is_refused(cluster: LocalCluster, ctx: zmq.Context[Any]) -> None:
    with dealer(ctx, cluster.backend) as sock:
        for name, hdr in BAD_READY:
            reply = exchange(sock, worker_msg(Command.READY, P.packb(hdr)))
            msg = P.decode(reply, expect=Peer.WORKER)
            assert msg.command is Command.ERROR, (name, msg.command.name)
            code = msg.header.get("code")
            assert code == "PROTOCOL", (name, msg.header)
            expect_error(reply, Peer.WORKER, str(code))
        assert not sock.poll(50)
    assert cluster.status()["counts"]["workers"] == 1
    assert_alive(cluster)


@pytest.mark.parametrize("frames", [[b"junk"], [Peer.ADMIN.value, P.CMD_BYTES[Command.ADMIN], b"\xc1"],
                                    [Peer.ADMIN.value, P.CMD_BYTES[Command.ADMIN], header(cmd="status")],
                                    [Peer.CLIENT.value, P.CMD_BYTES[Command.REQUEST], header(id=RID)]])
def test_admin_socket_malformed_gets_error(cluster: LocalCluster, ctx: zmq.Context[Any], frames: list[bytes]) -> None:
    with dealer(ctx, cluster.admin) as sock:
        reply = exchange(sock, frames)
        msg = P.decode(reply, expect=Peer.ADMIN)
        assert msg.command is Command.ERROR and msg.header["code"] in ("PROTOCOL", "UNKNOWN_COMMAND")
    assert cluster.status()["counters"]["bad_messages"] > 0
    assert_alive(cluster)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        pytest.param([b"GPUDW9", P.CMD_BYTES[Command.READY], header(name="evil", gpus=[GPU])], "VERSION",
                     id="wrong version"),
        pytest.param(client_msg(Command.REQUEST, echo_header(RID)), "UNKNOWN_COMMAND", id="client signature"),
        pytest.param(worker_msg(Command.READY, b"\x93\x01\x02\x03"), "PROTOCOL", id="header a list"),
        pytest.param(worker_msg(Command.RESULT, header(id=RID, ok=True, pad="x" * (P.MAX_HEADER_BYTES + 1))),
                     "TOO_LARGE", id="oversized header"),
        pytest.param(worker_msg(Command.RESULT, header(id=RID, ok=True), *([b""] * (P.MAX_PAYLOAD_FRAMES + 1))),
                     "TOO_LARGE", id="too many frames"),
        pytest.param(worker_msg(Command.BATCH, header(msgs=[[int(Command.HEARTBEAT), header(seq=1), 0],
                                                             [int(Command.RESULT), b"\xc1", 0]])),
                     "PROTOCOL", id="batch with a garbage inner header"),
        pytest.param(worker_msg(Command.BATCH, header(msgs=[[int(Command.BATCH), header(msgs=[]), 0]])),
                     "PROTOCOL", id="batch in a batch"),
        pytest.param(worker_msg(Command.BATCH, header(msgs=[[int(Command.RESULT), header(id=RID, ok=True), 2]]), b"x"),
                     "PROTOCOL", id="batch frame counts off"),
    ],
)
def test_backend_malformed_gets_error(
    cluster: LocalCluster, ctx: zmq.Context[Any], frames: list[bytes], code: str
) -> None:
    with dealer(ctx, cluster.backend) as sock:
        reply = exchange(sock, frames)
        sent_bad[0] += 1
        expect_error(reply, Peer.WORKER, code)
    assert cluster.status()["counts"]["workers"] == 1
    assert_alive(cluster)


def test_registered_worker_that_lies(cluster: LocalCluster, ctx: zmq.Context[Any]) -> None:
    """A worker that registers properly, then sends garbage heartbeats and results for ids it was
    never given. Nothing of it may reach a client; after its DISCONNECT the broker is as before."""
    with dealer(ctx, cluster.backend) as sock:
        ready = {"name": "hostile", "gpus": [GPU], "slots": 1, "heartbeat_ms": 60_000, "liveness": 100}
        reply = exchange(sock, worker_msg(Command.READY, P.packb(ready)))
        assert P.decode(reply, expect=Peer.WORKER).command is Command.WELCOME
        assert cluster.status()["counts"]["workers"] == 2
        for hb in [
            header(seq="one", gpus="none", running="nothing", draining="maybe"),
            header(seq=-(1 << 62), gpus=[1, None, {"uuid": 5}, {"uuid": "GPU-unknown", "util": 50}],
                   running=[1, "x", {"id": 5}] * 500),
            header(seq=2, gpus=[{"uuid": GPU["uuid"], "util": "hot", "temp": 1e308, "mem_used": -5,
                                 "health": "on fire"}]),
        ]:
            sock.send_multipart(worker_msg(Command.HEARTBEAT, hb))
        # Results for ids never dispatched to it: taken as stale, answered with an ACK only (every
        # broker ACKs what it takes, PROTOCOL.md §9.4), which tells it nothing it did not send.
        forged = [P.new_id(), P.new_id()]
        sock.send_multipart(worker_msg(Command.RESULT, header(id=forged[0], ok=True), b"forged"))
        sock.send_multipart(worker_msg(Command.RESULT, header(id=forged[1], ok="yes")))
        acked: list[bytes] = []
        while len(acked) < len(forged):  # one ACK per loop turn of the broker: one or two
            ack = P.decode(recv(sock), expect=Peer.WORKER)
            assert ack.command is Command.ACK, ack
            acked += ack.header["ids"]
        assert acked == forged
        # A RESULT whose id is unreadable is a malformed message: ERROR.
        reply = exchange(sock, worker_msg(Command.RESULT, header(id=b"short", ok=True)))
        sent_bad[0] += 1
        expect_error(reply, Peer.WORKER, "PROTOCOL")
        # Commands of other dialogs from a registered worker: UNKNOWN_COMMAND.
        for cmd, hdr in [(Command.REQUEST, echo_header(RID)), (Command.ADMIN, header(id=RID, cmd="drain")),
                         (Command.WELCOME, header(heartbeat_ms=1, liveness=1))]:
            reply = exchange(sock, worker_msg(cmd, hdr))
            sent_bad[0] += 1
            expect_error(reply, Peer.WORKER, "UNKNOWN_COMMAND")
        # A BATCH with one malformed part is refused whole: its DISCONNECT is not acted on.
        bye = worker_msg(Command.DISCONNECT, header(reason="done lying"))
        reply = exchange(sock, P.batch([bye, worker_msg(Command.HEARTBEAT, b"\xc1")]))
        sent_bad[0] += 1
        expect_error(reply, Peer.WORKER, "PROTOCOL")
        # A well-formed BATCH: each inner message is judged as if it came alone, one ERROR each.
        sock.send_multipart(P.batch([worker_msg(Command.RESULT, header(id=b"short", ok=True)),
                                     worker_msg(Command.HEARTBEAT, header(seq=3)),
                                     worker_msg(Command.REQUEST, echo_header(RID))]))
        codes = [P.decode(recv(sock), expect=Peer.WORKER).header.get("code") for _ in range(2)]
        sent_bad[0] += 2
        assert codes == ["PROTOCOL", "UNKNOWN_COMMAND"]
        # The garbage GPU state must not have made the status unreadable.
        st = cluster.status()
        assert {w["name"] for w in st["workers"]} == {"w0", "hostile"}
        # Goodbye, inside a BATCH: acted on.
        sock.send_multipart(P.batch([worker_msg(Command.HEARTBEAT, header(seq=4)), bye]))
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while cluster.status()["counts"]["workers"] != 1:
            assert time.monotonic() < deadline, "the broker kept the worker that said goodbye"
            time.sleep(0.02)
        assert not sock.poll(50), "nothing the lying worker sent deserved an answer"
    assert_alive(cluster)


# --------------------------------------------------------------------------- aftermath


def test_broker_logged_the_bad_messages(cluster: LocalCluster, ctx: zmq.Context[Any]) -> None:
    """Every bad message is accounted for in the log, but not one line each (a flood of them
    would cost the broker a line per message): each sender's first bad message of every
    BAD_LOG_S is logged in full, with its code, and the rest are counted, the counts logged once
    the interval is over. So the lines plus the counts cover every bad message sent, and one
    sender's flood is a few lines."""
    n = 300
    earlier = len(cluster.log_tail("broker", 10_000_000))
    with dealer(ctx, cluster.frontend) as sock:
        # The sender as the log names it: its tenant under CURVE, else its routing id.
        flooder = "tenant hostile" if cluster.security == "curve" else sock.getsockopt(zmq.ROUTING_ID).hex()[:16]
        for _ in range(n):
            sock.send_multipart([b"LOGME!", REQUEST, b"\xc1"])
        for _ in range(n):
            expect_error(recv(sock), Peer.CLIENT, "PROTOCOL")
        sent_bad[0] += n
    deadline = time.monotonic() + BAD_LOG_S + 2 * ANSWER_TIMEOUT_S
    while True:
        log = cluster.log_tail("broker", 10_000_000)
        warnings = [line for line in log.splitlines() if " WARNING " in line and "bad message" in line]
        full = [line for line in warnings if "bad message from" in line]
        counted = sum(int(m.group(1)) for m in re.finditer(r"(\d+) more bad message\(s\)", log))
        if len(full) + counted >= sent_bad[0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert full, cluster.log_tail("broker", 50)
    assert len(full) + counted >= sent_bad[0], f"{len(full)} lines and {counted} counted for {sent_bad[0]} bad messages"
    assert any("client" in line and "PROTOCOL" in line for line in full)
    assert any("worker" in line for line in full)
    since = [line for line in log[earlier:].splitlines() if " WARNING " in line and flooder in line]
    assert len(since) <= 3, f"{len(since)} lines for one sender's {n} bad messages"
    assert cluster.status()["counters"]["bad_messages"] >= sent_bad[0]
    assert "Traceback" not in log, log
    assert_alive(cluster)
