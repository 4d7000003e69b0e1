"""gpud_broker.core.BrokerCore driven directly: FakeClock times, plain lists as sockets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.heartbeat import HeartbeatPolicy
from gpud.protocol import Command, Message, Peer
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.registry import WorkerRecord

GiB = 1 << 30
MiB = 1 << 20
C1, C2 = b"client-1", b"client-2"
W1, W2, W3 = b"conn-w1", b"conn-w2", b"conn-w3"


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class CoreOnFakeClock:
    """One BrokerCore (``**config``) on a fake clock, with its two outboxes."""

    def __init__(self, **config: Any) -> None:
        self.clock = FakeClock(1000.0)
        self.to_client: list[tuple[bytes, list[Any]]] = []
        self.to_worker: list[tuple[bytes, list[Any]]] = []
        self.core = BrokerCore(
            BrokerConfig(**config),
            self.clock.monotonic(),
            lambda ident, frames: self.to_client.append((ident, list(frames))),
            lambda ident, frames: self.to_worker.append((ident, list(frames))),
        )


class Harness(CoreOnFakeClock):
    """One BrokerCore, its two outboxes, and helpers that speak the wire protocol to it."""

    # time ---------------------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock; the socket shell sets ``core.now`` before handing over each message."""
        self.clock.advance(seconds)
        self.core.now = self.clock.monotonic()

    def tick(self, seconds: float = 0.0) -> None:
        self.clock.advance(seconds)
        self.core.tick(self.clock.monotonic())

    # client side ----------------------------------------------------------------------------------

    def client(
        self, ident: bytes, cmd: Command, header: dict[str, Any], frames: Sequence[Any] = ()
    ) -> None:
        self.core.now = self.clock.monotonic()
        self.core.on_client(
            ident, P.decode(P.encode(Peer.CLIENT, cmd, header, frames), Peer.CLIENT)
        )

    def request(
        self, ident: bytes, r: bytes, kind: str = "echo", frames: Sequence[Any] = (), **fields: Any
    ) -> None:
        self.client(ident, Command.REQUEST, {"id": r, "kind": kind, **fields}, frames)

    # worker side ----------------------------------------------------------------------------------

    def worker(
        self, ident: bytes, cmd: Command, header: dict[str, Any], frames: Sequence[Any] = ()
    ) -> bytes:
        """Send a worker message; returns the raw header frame the core was given."""
        self.core.now = self.clock.monotonic()
        enc = P.encode(Peer.WORKER, cmd, header, frames)
        raw: bytes = enc[2]
        self.core.on_worker(ident, P.decode(enc, Peer.WORKER), raw)
        return raw

    def ready(
        self, ident: bytes, name: str, ngpus: int = 1, mem: int = 16 * GiB, **extra: Any
    ) -> WorkerRecord:
        gpus = [
            {"uuid": f"GPU-{name}-{i}", "index": i, "model": "A100", "mem": mem, "cc": [8, 0]}
            for i in range(ngpus)
        ]
        header = {
            "name": name,
            "gpus": gpus,
            "cpu_milli": 8000,
            "host_mem": 64 * GiB,
            "slots": 8,
            **extra,
        }
        self.worker(ident, Command.READY, header)
        w = self.core.registry.get(ident)
        assert w is not None and w.name == name
        return w

    def result(
        self, ident: bytes, r: bytes, ok: bool = True, frames: Sequence[Any] = (), **fields: Any
    ) -> bytes:
        return self.worker(ident, Command.RESULT, {"id": r, "ok": ok, **fields}, frames)

    def heartbeat(self, ident: bytes, seq: int, **fields: Any) -> None:
        self.worker(ident, Command.HEARTBEAT, {"seq": seq, **fields})

    # outboxes ---------------------------------------------------------------------------------------

    def take_client(self) -> list[tuple[bytes, Message, list[Any]]]:
        out = [(i, P.decode(f, Peer.CLIENT), f) for i, f in self.to_client]
        self.to_client.clear()
        return out

    def take_worker(self, *, heartbeats: bool = False) -> list[tuple[bytes, Message, list[Any]]]:
        out = [(i, P.decode(f, Peer.WORKER), f) for i, f in self.to_worker]
        self.to_worker.clear()
        if not heartbeats:
            out = [o for o in out if o[1].command is not Command.HEARTBEAT]
        return out

    def one_reply(self, ident: bytes) -> Message:
        out = self.take_client()
        assert len(out) == 1, out
        assert out[0][0] == ident
        assert out[0][1].command is Command.REPLY
        return out[0][1]

    def one_dispatch(self, ident: bytes) -> Message:
        out = self.take_worker()
        assert len(out) == 1, out
        assert out[0][0] == ident, f"dispatched to {out[0][0]!r}, expected {ident!r}"
        assert out[0][1].command is Command.DISPATCH
        return out[0][1]

    def assert_idle(self) -> None:
        """Every ledger number is back to zero, and nothing is in flight."""
        for uuid, g in self.core.registry.gpus.items():
            assert (g.granted_milli, g.granted_mem, g.tasks, g.exclusive) == (0, 0, 0, False), uuid
        for w in self.core.registry:
            assert (w.granted_cpu, w.granted_host_mem, w.inflight) == (0, 0, 0), w.name
            assert w.assigned == {}, w.name
        assert len(self.core.queue) == 0


def error_code(msg: Message) -> str:
    assert msg.header["ok"] is False
    assert type(msg.header["message"]) is str
    code: str = msg.header["code"]
    return code


@pytest.fixture
def h() -> Harness:
    return Harness()


# --------------------------------------------------------------------------- READY / WELCOME


def _ready_header(name: str, uuid: str) -> dict[str, Any]:
    return {"name": name, "gpus": [{"uuid": uuid, "index": 0, "model": "A100", "mem": GiB, "cc": [8, 0]}], "slots": 4}


def _refusal(h: Harness, ident: bytes) -> str:
    [(who, msg, _)] = h.take_worker()
    assert who == ident and msg.command is Command.DISCONNECT, msg
    reason: str = msg.header["reason"]
    return reason


def test_a_worker_name_is_its_keys_name() -> None:
    h = Harness()
    h.core.worker_names_bound = True
    enc = P.encode(Peer.WORKER, Command.READY, _ready_header("w0", "GPU-a"))
    h.core.on_worker(W1, P.decode(enc, Peer.WORKER), enc[2], "w0")
    assert h.core.registry.by_name["w0"].identity == W1
    h.take_worker()
    # The key of w1 (workers/w1.key) sends READY as w0: refused, and the real w0 stays.
    enc = P.encode(Peer.WORKER, Command.READY, _ready_header("w0", "GPU-b"))
    h.core.on_worker(W2, P.decode(enc, Peer.WORKER), enc[2], "w1")
    reason = _refusal(h, W2)
    assert "workers/w1.key" in reason and "not w0" in reason
    assert h.core.registry.by_name["w0"].identity == W1 and W2 not in h.core.registry.by_identity
    enc = P.encode(Peer.WORKER, Command.READY, _ready_header("w1", "GPU-b"))
    h.core.on_worker(W2, P.decode(enc, Peer.WORKER), enc[2], "w1")
    assert h.core.registry.by_name["w1"].identity == W2


def test_a_second_connection_of_a_live_name_is_refused_until_the_first_goes_silent(h: Harness) -> None:
    h.worker(W1, Command.READY, _ready_header("host", "GPU-a"))
    h.take_worker()
    h.request(C1, rid(1))
    h.one_dispatch(W1)
    # A second worker of the same (host) name: refused, the first keeps its work; no flapping.
    for _ in range(3):
        h.worker(W2, Command.READY, _ready_header("host", "GPU-b"))
        reason = _refusal(h, W2)
        assert "worker host is already connected from host" in reason and "--name" in reason
        h.advance(0.5)
        h.heartbeat(W1, 1)
    assert h.core.registry.by_name["host"].identity == W1 and h.core.counters["worker_losses"] == 0
    # The first goes silent past its liveness (a restart): the new connection takes the name.
    h.advance(h.core.config.heartbeat.expiry + 0.1)
    h.worker(W2, Command.READY, _ready_header("host", "GPU-a"))
    assert h.core.registry.by_name["host"].identity == W2


def test_ready_gets_welcome_with_negotiated_heartbeat(h: Harness) -> None:
    h.ready(W1, "w1", heartbeat_ms=2500, liveness=2)
    out = h.take_worker()
    assert len(out) == 1 and out[0][0] == W1
    welcome = out[0][1]
    assert welcome.command is Command.WELCOME
    assert welcome.header["heartbeat_ms"] == 2500 and welcome.header["liveness"] == 3
    w1 = h.core.registry.by_name["w1"]
    assert w1.liveness.policy == HeartbeatPolicy(2.5, 3)

    h.ready(W2, "w2", heartbeat_ms=200, liveness=10)
    welcome = h.take_worker()[0][1]
    assert (welcome.header["heartbeat_ms"], welcome.header["liveness"]) == (1000, 10)
    assert len(h.core.registry) == 2 and set(h.core.registry.gpus) == {"GPU-w1-0", "GPU-w2-0"}


def test_welcome_heartbeat_ms_is_never_below_the_proposal(h: Harness) -> None:
    h.ready(W1, "w1", heartbeat_ms=1001, liveness=3)
    welcome = h.take_worker()[0][1]
    assert welcome.header["heartbeat_ms"] == 1001


@pytest.mark.parametrize(
    "header",
    [
        {"gpus": []},
        {"name": "", "gpus": []},
        {"name": "w1"},
        {"name": "w1", "gpus": [{"uuid": "x"}]},
        {"name": "w1", "gpus": [], "slots": 0},
        {"name": "w1", "gpus": [], "heartbeat_ms": -1},
        {"name": "w1", "gpus": [], "cpu_milli": True},
    ],
    ids=lambda x: repr(x)[:40],
)
def test_bad_ready_gets_error_and_is_not_registered(h: Harness, header: dict[str, Any]) -> None:
    h.worker(W1, Command.READY, header)
    out = h.take_worker()
    assert len(out) == 1 and out[0][1].command is Command.ERROR
    assert out[0][1].header["code"] == "PROTOCOL" or out[0][1].header["code"] == "INVALID_REQUEST"
    assert len(h.core.registry) == 0


# --------------------------------------------------------------------------- request / dispatch / reply


def test_echo_request_dispatch_result_reply(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    payload = [b"hello", b"", b"\x00" * 100]
    h.request(C1, rid(1), frames=payload)
    d = h.one_dispatch(W1)
    assert (
        d.header["id"] == rid(1) and d.header["kind"] == "echo" and d.header["tenant"] == "default"
    )
    assert d.header["grant"] == {"gpus": ["GPU-w1-0"], "gpu_milli": 1, "mem": 0, "cpu_milli": 0, "host_mem": 0}
    assert [bytes(f) for f in d.frames] == payload
    g = h.core.registry.gpus["GPU-w1-0"]
    assert (g.granted_milli, g.tasks) == (1, 1) and h.core.registry.by_name["w1"].inflight == 1
    assert h.take_client() == []  # nothing to the client until the work is done

    raw = h.result(W1, rid(1), frames=payload, worker="w1", gpus=["GPU-w1-0"])
    out = h.take_client()
    assert len(out) == 1
    ident, reply, frames = out[0]
    assert ident == C1 and reply.command is Command.REPLY
    assert frames[0] == Peer.CLIENT.value
    assert frames[2] == raw  # the RESULT header is forwarded byte for byte
    assert reply.header == {"id": rid(1), "ok": True, "worker": "w1", "gpus": ["GPU-w1-0"]}
    assert [bytes(f) for f in reply.frames] == payload
    h.assert_idle()


def test_request_with_explicit_need_and_bad_request(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    h.request(C1, rid(1), need={"gpu_milli": 250, "mem": GiB, "tenant": "alice", "cpu_milli": 500, "host_mem": MiB})
    d = h.one_dispatch(W1)
    assert d.header["grant"] == {"gpus": ["GPU-w1-0"], "gpu_milli": 250, "mem": GiB, "cpu_milli": 500, "host_mem": MiB}
    assert d.header["tenant"] == "alice"
    h.request(C1, rid(2), need={"gpu_milli": 1001})
    assert error_code(h.one_reply(C1)) == "INVALID_REQUEST"
    h.request(C1, rid(3), kind="teleport")
    assert error_code(h.one_reply(C1)) == "INVALID_REQUEST"
    assert h.take_worker() == []
    h.result(W1, rid(1))
    h.one_reply(C1)
    h.assert_idle()


def test_duplicate_request_runs_once_and_gets_the_cached_reply(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    h.request(C1, rid(7), frames=[b"x"])
    h.one_dispatch(W1)
    h.request(C1, rid(7), frames=[b"x"])  # a retry while running
    h.request(C2, rid(7), frames=[b"x"])  # the same id from a reconnected client
    assert h.take_worker() == [] and h.take_client() == []
    raw = h.result(W1, rid(7), frames=[b"x"])
    reply = h.one_reply(C2)  # the latest sender of the id gets the answer
    assert reply.header["id"] == rid(7) and reply.frames == [b"x"]
    h.request(C1, rid(7), frames=[b"x"])  # after completion: the cached reply, at once
    out = h.take_client()
    assert len(out) == 1 and out[0][0] == C1 and out[0][2][2] == raw and out[0][1].frames == [b"x"]
    assert h.take_worker() == []
    assert h.core.counters["retries"] == 3
    h.assert_idle()


def test_request_without_workers_is_queued_then_placed_on_ready(h: Harness) -> None:
    h.request(C1, rid(1), frames=[b"p"])
    assert h.take_client() == [] and h.take_worker() == []
    assert len(h.core.queue) == 1
    h.advance(1.0)
    h.ready(W1, "w1")
    out = h.take_worker()
    assert [m.command for _, m, _ in out] == [Command.WELCOME, Command.DISPATCH]
    assert out[1][0] == W1 and out[1][1].header["id"] == rid(1) and out[1][1].frames == [b"p"]
    assert len(h.core.queue) == 0
    h.result(W1, rid(1), frames=[b"p"])
    assert h.one_reply(C1).frames == [b"p"]
    h.assert_idle()


def test_queue_deadline_gives_timeout(h: Harness) -> None:
    h.request(C1, rid(1), deadline_ms=500)
    h.request(C1, rid(2))  # default deadline: 30 s
    h.tick(0.5)  # exactly the deadline
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1) and error_code(reply) == "TIMEOUT"
    assert len(h.core.queue) == 1
    h.tick(29.0)
    assert h.take_client() == []
    h.tick(0.6)
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(2) and error_code(reply) == "TIMEOUT"
    assert len(h.core.queue) == 0
    # a retry of a timed-out id gets the same answer, not a new run
    h.request(C1, rid(1))
    assert error_code(h.one_reply(C1)) == "TIMEOUT"


def test_queue_full_gives_busy() -> None:
    h = Harness(max_queue=2)
    h.request(C1, rid(1))
    h.request(C1, rid(2))
    assert h.take_client() == []
    h.request(C2, rid(3))
    reply = h.one_reply(C2)
    assert reply.header["id"] == rid(3) and error_code(reply) == "BUSY"
    assert len(h.core.queue) == 2
    # BUSY is not remembered: once there is room, the same id is judged afresh
    h.client(C1, Command.CANCEL, {"id": rid(1)})
    assert error_code(h.one_reply(C1)) == "CANCELLED"
    h.request(C2, rid(3))
    assert h.take_client() == [] and len(h.core.queue) == 2


def test_need_no_gpu_could_ever_satisfy_gives_no_capacity(h: Harness) -> None:
    h.ready(W1, "w1", mem=16 * GiB)
    h.ready(W2, "w2", mem=24 * GiB)
    h.take_worker()
    h.request(C1, rid(1), need={"mem": 24 * GiB + 1})
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1) and error_code(reply) == "NO_CAPACITY"
    h.request(C1, rid(2), need={"models": ["H100"]})
    assert error_code(h.one_reply(C1)) == "NO_CAPACITY"
    h.request(C1, rid(3), kind="job", argv=["true"], need={"gpus": 2})
    assert error_code(h.one_reply(C1)) == "NO_CAPACITY"
    assert h.take_worker() == [] and len(h.core.queue) == 0
    assert h.core.tasks.get(rid(1)) is None  # refused at the door, nothing kept
    h.request(C1, rid(4), need={"mem": 24 * GiB})  # the biggest GPU exactly
    assert h.one_dispatch(W2).header["grant"]["mem"] == 24 * GiB


def test_cancel_queued_request(h: Harness) -> None:
    h.request(C1, rid(1))
    h.request(C1, rid(2))
    h.client(C1, Command.CANCEL, {"id": rid(1)})
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1) and error_code(reply) == "CANCELLED"
    assert len(h.core.queue) == 1
    h.client(C1, Command.CANCEL, {"id": rid(1)})  # again: already finished, ignored
    h.client(C1, Command.CANCEL, {"id": rid(99)})  # unknown: ignored
    assert h.take_client() == []
    h.ready(W1, "w1")
    dispatched = [m.header["id"] for _, m, _ in h.take_worker() if m.command is Command.DISPATCH]
    assert dispatched == [rid(2)]
    h.client(C1, Command.CANCEL, {"id": rid(2)})  # running: it runs on
    assert h.take_client() == []
    h.result(W1, rid(2))
    assert h.one_reply(C1).header["ok"] is True
    h.assert_idle()


# --------------------------------------------------------------------------- worker loss


def echo_on_w1_of_two(h: Harness, payload: bytes) -> None:
    """Workers w1 and w2 ready, and echo ``rid(1)`` of ``payload`` dispatched to w1."""
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    h.request(C1, rid(1), frames=[payload])
    assert h.one_dispatch(W1).header["id"] == rid(1)


def test_silent_worker_is_removed_and_its_echo_runs_elsewhere() -> None:
    h = Harness(worker_resume_periods=0)  # no grace window: removed at once (PROTOCOL.md §4.2)
    echo_on_w1_of_two(h, b"data")
    h.advance(2.5)
    h.heartbeat(W2, 1)  # w2 stays alive, w1 says nothing
    h.tick(0.5)  # 3.0 s of silence: exactly the expiry, still there
    assert h.core.registry.get(W1) is not None
    h.tick(0.5)
    assert h.core.registry.get(W1) is None and "GPU-w1-0" not in h.core.registry.gpus
    d = h.one_dispatch(W2)
    assert d.header["id"] == rid(1) and d.frames == [b"data"]
    assert h.take_client() == []
    h.result(W2, rid(1), frames=[b"data"])
    assert h.one_reply(C1).frames == [b"data"]
    # a late RESULT from the lost connection is not a second answer
    h.result(W1, rid(1))
    assert h.take_client() == []
    assert [m.command for _, m, _ in h.take_worker()] == [Command.DISCONNECT]
    h.assert_idle()


def test_retry_never_goes_back_to_the_same_worker() -> None:
    h = Harness(worker_resume_periods=0)
    h.ready(W1, "w1")
    h.take_worker()
    h.request(C1, rid(1))
    h.one_dispatch(W1)
    h.tick(3.5)  # w1 lost; nowhere else to go: queued
    assert len(h.core.registry) == 0 and len(h.core.queue) == 1
    h.ready(W3, "w1")  # the same worker reconnects
    assert [m.command for _, m, _ in h.take_worker()] == [Command.WELCOME]
    h.ready(W2, "w2")
    out = h.take_worker()
    assert [(i, m.command) for i, m, _ in out] == [(W2, Command.WELCOME), (W2, Command.DISPATCH)]
    h.result(W2, rid(1))
    assert h.one_reply(C1).header["ok"] is True
    h.assert_idle()


def test_worker_lost_fails_plain_jobs_and_replaces_idempotent_ones() -> None:
    h = Harness(policy="balanced", worker_resume_periods=0)  # spreads: both jobs go to w1's two idle GPUs
    h.ready(W1, "w1", ngpus=2)
    h.ready(W2, "w2")
    h.take_worker()
    h.request(C1, rid(1), kind="job", argv=["train.py"])
    h.request(
        C1,
        rid(2),
        kind="job",
        argv=["render.py"],
        idempotent=True,
        files=["in.txt"],
        frames=[b"input"],
    )
    out = h.take_worker()
    assert [(i, m.header["id"]) for i, m, _ in out] == [(W1, rid(1)), (W1, rid(2))]
    d2 = out[1][1]
    assert d2.header["argv"] == ["render.py"] and d2.header["idempotent"] is True
    assert d2.header["grant"]["gpu_milli"] == 1000 and d2.frames == [b"input"]
    h.worker(W1, Command.START, {"ids": [rid(1), rid(2)]})  # both may have begun (PROTOCOL.md §4.4)
    assert [(m.command, m.header["ids"]) for _, m, _ in h.take_worker()] == [(Command.GO, [rid(1), rid(2)])]
    h.advance(3.0)
    h.heartbeat(W2, 1)
    h.tick(0.5)
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1) and error_code(reply) == "WORKER_LOST"
    d = h.one_dispatch(W2)
    assert d.header["id"] == rid(2) and d.header["argv"] == ["render.py"] and d.frames == [b"input"]
    h.result(W2, rid(2), exit_code=0)
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(2) and reply.header["exit_code"] == 0
    h.assert_idle()


def test_retries_stop_after_max_attempts() -> None:
    h = Harness(max_attempts=2)
    for ident, name in ((W1, "w1"), (W2, "w2"), (W3, "w3")):
        h.ready(ident, name)
    h.take_worker()
    h.request(C1, rid(1))
    assert h.one_dispatch(W1)
    h.worker(W1, Command.DISCONNECT, {"reason": "bye"})
    assert h.one_dispatch(W2)
    h.worker(W2, Command.DISCONNECT, {"reason": "bye"})
    assert h.take_worker() == []
    assert error_code(h.one_reply(C1)) == "WORKER_LOST"
    h.assert_idle()


def test_shutting_down_result_is_placed_elsewhere(h: Harness) -> None:
    echo_on_w1_of_two(h, b"z")
    h.result(W1, rid(1), ok=False, code="SHUTTING_DOWN", message="stopping")
    assert h.take_client() == []
    d = h.one_dispatch(W2)
    assert d.header["id"] == rid(1) and d.frames == [b"z"]
    w1 = h.core.registry.by_name["w1"]
    assert w1.draining and w1.inflight == 0
    assert h.core.registry.gpus["GPU-w1-0"].granted_milli == 0
    h.request(C1, rid(2))  # nothing new goes to the stopping worker
    assert h.one_dispatch(W2).header["id"] == rid(2)
    h.result(W2, rid(1), frames=[b"z"])
    h.result(W2, rid(2))
    assert [m.header["id"] for _, m, _ in h.take_client()] == [rid(1), rid(2)]
    h.assert_idle()


def test_draining_heartbeat_stops_placement(h: Harness) -> None:
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    h.heartbeat(W1, 1, draining=True)
    assert h.core.registry.by_name["w1"].draining
    for n in range(1, 4):
        h.request(C1, rid(n))
        assert h.one_dispatch(W2).header["id"] == rid(n)
    h.heartbeat(W2, 1, draining=True)
    h.request(C1, rid(9))  # every worker is draining: it waits, it is not NO_CAPACITY
    assert h.take_client() == [] and h.take_worker() == [] and len(h.core.queue) == 1


def test_heartbeat_updates_state_and_broker_beats(h: Harness) -> None:
    h.ready(W1, "w1", ngpus=2)
    h.take_worker()
    h.heartbeat(
        W1,
        5,
        gpus=[
            {"uuid": "GPU-w1-0", "util": 500, "mem_used": GiB, "health": "ok"},
            {"uuid": "GPU-w1-1", "util": 10, "health": "melting"},
            "not a map",
        ],
        running=[{"id": rid(1), "kind": "echo", "since": 0.5}, 7],
    )
    reg = h.core.registry
    assert reg.gpus["GPU-w1-0"].state.util == 100.0 and reg.gpus["GPU-w1-0"].state.mem_used == GiB
    assert reg.gpus["GPU-w1-1"].state.health == "failed"
    w1 = reg.by_name["w1"]
    assert w1.liveness.seq_heard == 5 and len(w1.running) == 1
    h.request(C1, rid(1))  # the failed GPU takes nothing
    assert h.one_dispatch(W1).header["grant"]["gpus"] == ["GPU-w1-0"]
    seqs = []
    for _ in range(3):
        h.heartbeat(W1, 6)
        h.tick(1.0)
        beats = [m for _, m, _ in h.take_worker(heartbeats=True) if m.command is Command.HEARTBEAT]
        seqs += [m.header["seq"] for m in beats]
    assert seqs == [1, 2, 3]


def test_message_from_unknown_worker_gets_disconnect(h: Harness) -> None:
    h.heartbeat(W1, 1)
    out = h.take_worker()
    assert len(out) == 1 and out[0][0] == W1
    assert (
        out[0][1].command is Command.DISCONNECT and out[0][1].header["reason"] == "unknown worker"
    )
    h.result(W2, rid(1))
    out = h.take_worker()
    assert [(i, m.command) for i, m, _ in out] == [(W2, Command.DISCONNECT)]
    assert h.take_client() == [] and len(h.core.registry) == 0


def test_result_for_unknown_id_is_dropped(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    h.request(C1, rid(1))
    h.one_dispatch(W1)
    h.result(W1, rid(42))
    assert h.take_client() == [] and h.take_worker() == []
    h.result(W1, rid(1))
    h.result(W1, rid(1))  # a second RESULT for the same id: dropped too
    assert len(h.take_client()) == 1 and h.take_worker() == []
    h.assert_idle()


# --------------------------------------------------------------------------- sessions


def open_session(h: Harness, sid: bytes, ident: bytes = W1) -> None:
    h.request(C1, sid, kind="session")
    d = h.one_dispatch(ident)
    assert d.header["kind"] == "session"
    assert d.header["grant"] == {
        "gpus": [d.header["grant"]["gpus"][0]],
        "gpu_milli": 100,
        "mem": 256 * MiB,
        "cpu_milli": 0,
        "host_mem": 0,
    }
    h.result(ident, sid, session=sid, worker="w1")
    reply = h.one_reply(C1)
    assert reply.header["ok"] is True and reply.header["session"] == sid


def leased_session(*others: tuple[bytes, str]) -> tuple[Harness, bytes]:
    """A core whose session leases last 5 s (a worker's liveness 30 s), workers w1 and ``others``
    (ident, name) ready, and session ``rid(100)`` open on w1; the harness and the session id."""
    h = Harness(session_lease=5.0, heartbeat=HeartbeatPolicy(10.0, 3))
    h.ready(W1, "w1")
    for ident, name in others:
        h.ready(ident, name)
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    return h, sid


def test_session_open_call_close(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    s = h.core.sessions[sid]
    assert s.worker == "w1" and s.gpu == "GPU-w1-0" and not s.closing
    g = h.core.registry.gpus["GPU-w1-0"]
    assert (g.granted_milli, g.granted_mem, g.tasks) == (100, 256 * MiB, 1)  # held by the session
    assert h.core.registry.by_name["w1"].inflight == 0

    h.client(
        C1,
        Command.CALL,
        {"id": rid(101), "session": sid, "op": "htod", "args": {"handle": 1, "offset": 0}},
        [b"buf"],
    )
    d = h.one_dispatch(W1)
    assert d.header["kind"] == "call" and "grant" not in d.header
    assert (d.header["id"], d.header["session"], d.header["op"]) == (rid(101), sid, "htod")
    assert d.header["args"] == {"handle": 1, "offset": 0} and d.frames == [b"buf"]
    h.result(W1, rid(101))
    assert h.one_reply(C1).header["id"] == rid(101)
    assert g.tasks == 1  # a call holds nothing of its own

    h.client(C1, Command.CALL, {"id": rid(102), "session": sid, "op": "close"})
    assert h.one_dispatch(W1).header["op"] == "close"
    h.client(C1, Command.CALL, {"id": rid(103), "session": sid, "op": "info"})  # while closing
    assert error_code(h.one_reply(C1)) == "SESSION_LOST"
    h.result(W1, rid(102))
    assert h.one_reply(C1).header["id"] == rid(102)
    assert sid not in h.core.sessions
    h.assert_idle()


def test_call_to_unknown_session(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    h.client(C1, Command.CALL, {"id": rid(1), "session": rid(999), "op": "info"})
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(1) and error_code(reply) == "SESSION_LOST"
    assert h.take_worker() == []
    h.client(C1, Command.CALL, {"id": rid(2), "session": rid(999), "op": "explode"})
    assert error_code(h.one_reply(C1)) == "INVALID_REQUEST"


def test_session_lease_expiry_closes_and_releases() -> None:
    h, sid = leased_session()
    h.tick(4.0)
    assert h.take_worker() == []
    h.client(C1, Command.PING, {"sessions": [sid, rid(5), "junk"]})  # renews the lease
    out = h.take_client()
    assert len(out) == 1 and out[0][1].command is Command.PONG
    h.tick(4.0)  # 8 s since open, 4 s since the PING
    assert h.take_worker() == [] and not h.core.sessions[sid].closing
    h.tick(1.0)  # exactly the lease
    assert h.take_worker() == []
    h.tick(0.5)  # past the lease
    d = h.one_dispatch(W1)
    assert d.header["kind"] == "call" and d.header["op"] == "close" and d.header["session"] == sid
    assert d.header["id"] != sid
    assert h.core.sessions[sid].closing
    assert h.core.registry.gpus["GPU-w1-0"].granted_milli == 100  # held until the worker confirms
    h.tick(10.0)
    assert h.take_worker() == []  # asked once, not on every tick
    h.client(C1, Command.CALL, {"id": rid(7), "session": sid, "op": "info"})
    assert error_code(h.one_reply(C1)) == "SESSION_LOST"
    h.result(W1, d.header["id"])
    assert h.take_client() == []  # the broker's own close has no client to answer
    assert sid not in h.core.sessions
    h.assert_idle()


def test_sessions_of_a_lost_worker_are_gone(h: Harness) -> None:
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    h.client(C1, Command.CALL, {"id": rid(101), "session": sid, "op": "sync"})
    h.one_dispatch(W1)
    h.worker(W1, Command.DISCONNECT, {"reason": "stopping"})
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(101) and error_code(reply) == "SESSION_LOST"
    assert h.take_worker() == []  # a call is never re-placed
    h.client(C1, Command.CALL, {"id": rid(102), "session": sid, "op": "info"})
    assert error_code(h.one_reply(C1)) == "SESSION_LOST"
    assert sid not in h.core.sessions
    h.assert_idle()


def test_a_session_the_broker_ended_is_closed_on_its_worker_once_it_is_back(h: Harness) -> None:
    """The worker was lost (silent) with a session open, and came back holding it: its
    heartbeat lists a session the broker ended, which the broker has it close, once."""
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    h.worker(W1, Command.DISCONNECT, {"reason": "link dropped"})
    assert sid not in h.core.sessions
    h.ready(W1, "w1")
    h.take_worker()
    listed = [{"id": sid, "kind": "session", "since": 9.0, "idle": 1.0, "tenant": "alice"}]
    h.heartbeat(W1, 1, running=listed + [{"id": sid, "kind": "session", "since": 9.0}])
    d = h.one_dispatch(W1)
    assert (d.header["kind"], d.header["op"], d.header["session"]) == ("call", "close", sid)
    assert d.header["id"] != sid and d.header["tenant"] == "alice"
    h.heartbeat(W1, 2, running=listed)
    assert h.take_worker() == []  # its close is unanswered: not asked twice
    h.result(W1, d.header["id"])
    assert h.take_client() == []  # no client waits for it
    h.heartbeat(W1, 3, running=listed)  # a close answered, yet still listed: asked again
    again = h.one_dispatch(W1)
    assert again.header["session"] == sid
    h.result(W1, again.header["id"], ok=False, code="SESSION_LOST", message="the session is not open")
    h.heartbeat(W1, 4, running=[])
    assert h.take_worker() == []
    h.assert_idle()


def test_only_sessions_not_held_on_that_worker_are_closed(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)  # on w1
    h.request(C1, rid(101), kind="session")  # opening on w1, not answered yet
    assert h.one_dispatch(W1).header["kind"] == "session"
    h.heartbeat(W1, 1, running=[{"id": sid, "kind": "session", "since": 1.0, "idle": 0.0},
                                {"id": rid(101), "kind": "session", "since": 0.1}])
    assert h.take_worker() == []  # held there, or still opening there: nothing to close
    # Junk is skipped; w1's session named by another worker is closed there only, and that
    # close's answer ends nothing in the tables.
    h.ready(W2, "w2")
    h.take_worker()
    h.heartbeat(W2, 1, running=[{"id": "x", "kind": "session"}, {"id": rid(5)[:8], "kind": "session"},
                                {"id": rid(6), "kind": "job"}, {"id": sid, "kind": "session"}, "junk"])
    d = h.one_dispatch(W2)
    assert d.header["session"] == sid and d.header["tenant"] == "default"
    h.result(W2, d.header["id"], ok=False, code="SESSION_LOST", message="unknown")
    assert sid in h.core.sessions and not h.core.sessions[sid].closing


def test_a_passive_broker_closes_nothing() -> None:
    h = Harness()
    h.core.become_passive()
    h.ready(W1, "w1")
    h.take_worker()
    h.heartbeat(W1, 1, running=[{"id": rid(100), "kind": "session", "since": 1.0, "idle": 0.0}])
    assert [m for _, m, _ in h.take_worker() if m.command is Command.DISPATCH] == []


# --------------------------------------------------------------------------- ledger after a mixed load


def test_ledger_returns_to_zero_after_mixed_work(h: Harness) -> None:
    h.ready(W1, "w1", ngpus=2)
    h.ready(W2, "w2", ngpus=1)
    h.take_worker()
    ids = [rid(n) for n in range(1, 9)]
    for n, r in enumerate(ids):
        if n % 3 == 0:
            h.request(
                C1, r, kind="job", argv=["x"], need={"gpu_milli": 300, "mem": GiB, "cpu_milli": 500}
            )
        else:
            h.request(C2, r, need={"gpu_milli": 50, "host_mem": MiB})
    placed = {m.header["id"]: i for i, m, _ in h.take_worker()}
    assert set(placed) == set(ids)
    assert sum(g.granted_milli for g in h.core.registry.gpus.values()) == 3 * 300 + 5 * 50
    assert sum(w.granted_cpu for w in h.core.registry) == 1500
    for r in ids:
        h.result(placed[r], r)
    assert len(h.take_client()) == len(ids)
    h.assert_idle()


# ---------------------------------------------------------------- fairness, aging, backfill


def dispatches(h: Harness) -> list[tuple[bytes, Message, list[Any]]]:
    return [m for m in h.take_worker() if m[1].command is Command.DISPATCH]


def _run_contended(h: Harness, tenants: dict[str, bytes], seconds: float, job_s: float = 1.0,
                   milli: int = 1000, backlog: int = 8) -> dict[str, float]:
    """Keep every tenant's backlog full on a full cluster; jobs finish ``job_s`` after dispatch.
    Returns each tenant's granted milli-GPU x seconds over the run (measured from the grants)."""
    n = 0
    running: dict[bytes, tuple[bytes, str, float]] = {}  # id -> worker, tenant, dispatched
    queued = {t: 0 for t in tenants}
    usage = {t: 0.0 for t in tenants}
    end = h.clock.monotonic() + seconds
    while h.clock.monotonic() < end:
        for tenant, ident in tenants.items():
            while queued[tenant] < backlog:
                n += 1
                h.request(ident, rid(n), "job", need={"gpu_milli": milli, "tenant": tenant},
                          argv=["true"], deadline_ms=10_000_000)
                queued[tenant] += 1
        for w_ident, msg, _ in dispatches(h):
            tenant = msg.header["tenant"]
            running[msg.header["id"]] = (w_ident, tenant, h.clock.monotonic())
            queued[tenant] -= 1
        h.take_client()
        h.tick(0.05)
        now = h.clock.monotonic()
        for r, (w_ident, tenant, t0) in list(running.items()):
            usage[tenant] += milli * 0.05
            if now - t0 >= job_s:
                del running[r]
                h.result(w_ident, r, exit_code=0)
    return usage


def test_weighted_fair_share_in_gpu_time() -> None:
    """Two tenants at weights 1:3 competing for a full cluster get GPU-time within 10% of 1:3."""
    h = Harness(tenant_weights={"a": 1.0, "b": 3.0}, heartbeat=HeartbeatPolicy(1.0, 10_000))
    h.ready(W1, "w1", ngpus=4)
    usage = _run_contended(h, {"a": C1, "b": C2}, seconds=120)
    ratio = usage["b"] / usage["a"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, usage
    # Charged in GPU-time, not in request counts: half-GPU jobs of b count half.
    assert h.core.accounts.fair.usage("b", h.clock.monotonic()) == pytest.approx(usage["b"], rel=0.05)


def test_fair_share_counts_gpu_time_not_requests() -> None:
    """Equal weights; tenant a's jobs hold a GPU 2 s, b's 0.5 s. Charged in GPU-time, both get the
    same GPU-time (so b gets about four times as many requests through), not the same count."""
    h = Harness(heartbeat=HeartbeatPolicy(1.0, 10_000))
    h.ready(W1, "w1", ngpus=4)
    n = 0
    running: dict[bytes, tuple[bytes, str, float]] = {}
    usage = {"a": 0.0, "b": 0.0}
    done = {"a": 0, "b": 0}
    length = {"a": 2.0, "b": 0.5}
    for _ in range(2400):  # 120 s in 50 ms steps
        for tenant in ("a", "b"):
            while sum(1 for t in h.core.queue.in_order() if t.tenant == tenant) < 8:
                n += 1
                h.request(C1, rid(n), "job", need={"gpu_milli": 1000, "tenant": tenant},
                          argv=["true"], deadline_ms=10_000_000)
        for w_ident, msg, _ in dispatches(h):
            running[msg.header["id"]] = (w_ident, msg.header["tenant"], h.clock.monotonic())
        h.take_client()
        h.tick(0.05)
        for r, (w_ident, tenant, t0) in list(running.items()):
            usage[tenant] += 1000 * 0.05
            if h.clock.monotonic() - t0 >= length[tenant] - 1e-9:
                del running[r]
                done[tenant] += 1
                h.result(w_ident, r, exit_code=0)
    assert 0.9 <= usage["b"] / usage["a"] <= 1.1, usage
    assert 3.0 <= done["b"] / done["a"] <= 5.0, done


def test_aging_bounds_the_wait_of_low_priority() -> None:
    """High-priority work keeps arriving; low priority still runs once it has aged past it."""
    h = Harness(aging_s=10.0, heartbeat=HeartbeatPolicy(1.0, 10_000))
    h.ready(W1, "w1", ngpus=1)
    h.take_worker()
    h.request(C2, rid(100), "job", need={"gpu_milli": 1000}, argv=["true"], deadline_ms=10_000_000)
    running: dict[bytes, float] = {h.one_dispatch(W1).header["id"]: h.clock.monotonic()}
    h.request(C1, rid(1), "job", need={"gpu_milli": 1000, "priority": -5}, argv=["true"], deadline_ms=10_000_000)
    n = 100
    started_low = None
    for step in range(2000):  # 100 s
        while len(h.core.queue) < 4:
            n += 1
            h.request(C2, rid(n), "job", need={"gpu_milli": 1000, "priority": 0}, argv=["true"], deadline_ms=10_000_000)
        for _, msg, _ in dispatches(h):
            running[msg.header["id"]] = h.clock.monotonic()
            if msg.header["id"] == rid(1):
                started_low = step * 0.05
        h.take_client()
        h.tick(0.05)
        for r, t0 in list(running.items()):
            if h.clock.monotonic() - t0 >= 1.0:
                del running[r]
                h.result(W1, r, exit_code=0)
        if started_low is not None:
            break
    # Five priority levels at 10 s each: it must start about 50 s in (newer high-priority work
    # keeps arriving with no age), and certainly not before 40 s.
    assert started_low is not None and 40 <= started_low <= 60


def test_backfill_then_reservation_bounds_the_big_request() -> None:
    """Small requests run past a big one that does not fit; after reserve_after the big one
    reserves a worker, backfill stops using it, and it runs."""
    h = Harness(reserve_after=5.0, aging_s=1e9, heartbeat=HeartbeatPolicy(1.0, 10_000))
    h.ready(W1, "w1", ngpus=2)
    h.take_worker()
    # A 1-GPU job holds GPU 0 for 3 s so the 2-GPU job cannot fit at first.
    h.request(C1, rid(1), "job", need={"gpus": 1}, argv=["true"], deadline_ms=10_000_000)
    running = {h.one_dispatch(W1).header["id"]: h.clock.monotonic()}
    h.request(C1, rid(2), "job", need={"gpus": 2}, argv=["true"], deadline_ms=10_000_000)
    assert h.take_worker() == []
    n = 10
    backfilled = 0
    big_started = None
    for step in range(400):  # 20 s
        # A steady stream of small half-GPU jobs of 2 s each, always one waiting.
        if len(h.core.queue) < 2:
            n += 1
            h.request(C2, rid(n), "job", need={"gpu_milli": 500}, argv=["true"], deadline_ms=10_000_000)
        for _, msg, _ in dispatches(h):
            running[msg.header["id"]] = h.clock.monotonic()
            if msg.header["id"] == rid(2):
                big_started = step * 0.05
            elif big_started is None:
                backfilled += 1
        h.take_client()
        h.tick(0.05)
        for r, t0 in list(running.items()):
            if h.clock.monotonic() - t0 >= (3.0 if r == rid(1) else 2.0):
                del running[r]
                h.result(W1, r, exit_code=0)
        if big_started is not None:
            break
    assert backfilled >= 1  # small work was not held behind the big request
    assert big_started is not None and big_started <= 5.0 + 3.0  # reservation, then running work drains
    assert h.core.queue.reservations == {}


def test_refused_ready_does_not_cost_a_live_worker() -> None:
    """A new connection claims live worker w1's name with w2's GPU: refused, and w1 stays."""
    h = Harness()
    h.ready(W1, "w1")
    h.ready(W2, "w2")
    h.take_worker()
    gpus = [{"uuid": "GPU-w2-0", "index": 0, "model": "A100", "mem": GiB, "cc": [8, 0]}]
    h.worker(W3, Command.READY, {"name": "w1", "gpus": gpus})
    (ident, msg, _), = h.take_worker()
    assert ident == W3 and msg.command is Command.DISCONNECT
    assert sorted(w.name for w in h.core.registry) == ["w1", "w2"]
    assert h.core.registry.get(W1) is not None


def test_a_session_its_worker_no_longer_lists_is_ended_and_its_grant_freed(h: Harness) -> None:
    h.ready(W1, "w1")
    h.take_worker()
    open_session(h, rid(1))
    open_session(h, rid(2))
    h.tick()
    assert rid(1) in h.core.sessions  # no heartbeat since it opened: nothing to judge by
    h.advance(2.0)
    h.heartbeat(W1, 2, running=[{"id": rid(2), "kind": "session"}])  # the worker closed rid(1)
    h.tick()
    assert rid(1) not in h.core.sessions and rid(2) in h.core.sessions
    g = h.core.registry.gpus["GPU-w1-0"]
    assert (g.granted_milli, g.tasks) == (100, 1)  # only rid(2)'s grant is left
    h.client(C1, Command.CALL, {"id": rid(3), "session": rid(1), "op": "info"})
    assert h.one_reply(C1).header["code"] == "SESSION_LOST"
