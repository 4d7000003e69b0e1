"""The broker's admin commands on a BrokerCore driven directly (fake clock, lists as sockets), and the
registry's schema checks, serialization and logging."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from gpud import protocol as P
from gpud.admin import Arg, CommandSpec, Registry
from gpud.admin_commands import COMMANDS
from gpud.clock import FakeClock
from gpud.errors import ConflictError, GpudError, InvalidRequest
from gpud.protocol import Command, Message, Peer
from gpud_broker.commands import ADMIN
from gpud_broker.core import BrokerConfig, BrokerCore

GiB = 1 << 30
C1 = b"client-1"
W1, W2, W1B = b"conn-w1", b"conn-w2", b"conn-w1-again"


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Core:
    def __init__(self) -> None:
        self.clock = FakeClock(1000.0)
        self.to_client: list[tuple[bytes, list[Any]]] = []
        self.to_worker: list[tuple[bytes, list[Any]]] = []
        self.core = BrokerCore(
            BrokerConfig(),
            self.clock.monotonic(),
            lambda ident, frames: self.to_client.append((ident, list(frames))),
            lambda ident, frames: self.to_worker.append((ident, list(frames))),
        )

    def admin(self, cmd: str, **args: Any) -> Any:
        return ADMIN.dispatch(self.core, cmd, args, who="tester pid 1")

    def ready(self, ident: bytes, name: str, ngpus: int = 1) -> None:
        gpus = [{"uuid": f"GPU-{name}-{i}", "index": i, "model": "A100", "mem": 16 * GiB, "cc": [8, 0]}
                for i in range(ngpus)]
        enc = P.encode(Peer.WORKER, Command.READY, {"name": name, "gpus": gpus, "slots": 8})
        self.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2])

    def request(self, r: bytes, kind: str = "echo", **need: Any) -> None:
        enc = P.encode(Peer.CLIENT, Command.REQUEST, {"id": r, "kind": kind, "need": need})
        self.core.on_client(C1, P.decode(enc, Peer.CLIENT))

    def result(self, ident: bytes, r: bytes) -> None:
        enc = P.encode(Peer.WORKER, Command.RESULT, {"id": r, "ok": True})
        self.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2])

    def dispatched_to(self) -> list[bytes]:
        out = [i for i, f in self.to_worker if P.decode(f, Peer.WORKER).command is Command.DISPATCH]
        self.to_worker.clear()
        return out

    def replies(self) -> list[Message]:
        out = [P.decode(f, Peer.CLIENT) for _, f in self.to_client]
        self.to_client.clear()
        return out


@pytest.fixture
def c() -> Core:
    core = Core()
    core.ready(W1, "w1", ngpus=2)
    core.ready(W2, "w2")
    core.to_worker.clear()
    return core


def test_registry_implements_exactly_the_table() -> None:
    assert set(ADMIN.commands) == set(COMMANDS)
    ADMIN.verify()
    for name, cmd in ADMIN.commands.items():
        assert cmd.doc == COMMANDS[name].doc == cmd.handler.__doc__
        assert cmd.mutating is COMMANDS[name].mutating


def test_drain_keeps_new_work_off_and_undrain_places_queued(c: Core) -> None:
    c.request(rid(1), gpu_milli=100)
    first = c.dispatched_to()
    assert len(first) == 1
    busy = "w1" if first == [W1] else "w2"
    other = W2 if busy == "w1" else W1
    assert c.admin("drain", worker=busy)["running"] == 1
    for n in range(2, 8):  # fewer than a worker's 8 slots
        c.request(rid(n), gpu_milli=10)
    assert c.dispatched_to() == [other] * 6
    c.admin("drain", worker="w2" if busy == "w1" else "w1")
    c.request(rid(20), gpu_milli=100)
    assert c.dispatched_to() == [] and len(c.core.queue) == 1
    out = c.admin("undrain", worker=busy)
    assert out["placed"] == 1 and c.dispatched_to() == [W1 if busy == "w1" else W2]
    # The running request on the drained worker finishes normally.
    c.result(W1 if busy == "w1" else W2, rid(1))
    assert c.replies()[0].header["ok"] is True


def test_drain_and_cordon_outlast_a_reconnection(c: Core) -> None:
    c.admin("drain", worker="w1")
    c.admin("cordon", gpu="w2/0")
    c.ready(W1B, "w1", ngpus=2)
    assert c.core.registry.by_name["w1"].draining
    c.core.workers.lost(c.core.registry.by_name["w2"], "test")
    c.ready(W2, "w2")
    assert c.core.registry.gpus["GPU-w2-0"].cordoned
    c.admin("undrain", worker="w1")
    c.admin("uncordon", gpu="GPU-w2-0")
    c.ready(W1, "w1", ngpus=2)
    assert not c.core.registry.by_name["w1"].draining
    assert not c.core.registry.gpus["GPU-w2-0"].cordoned


def test_cordon_by_uuid_or_name_and_health_shows_it(c: Core) -> None:
    assert c.admin("cordon", gpu="GPU-w1-1")["name"] == "w1/1"
    c.admin("cordon", gpu="w1/0")
    health = {g["name"]: g["health"] for g in c.admin("gpus")}
    assert health == {"w1/0": "cordoned", "w1/1": "cordoned", "w2/0": "ok"}
    for n in range(5):
        c.request(rid(n), gpu_milli=10)
    assert set(c.dispatched_to()) == {W2}
    with pytest.raises(InvalidRequest, match="no connected GPU"):
        c.admin("cordon", gpu="w1/7")


def test_cancel_a_queued_request_answers_its_client(c: Core) -> None:
    c.request(rid(1), gpus=1)
    c.request(rid(2), gpus=1)
    c.request(rid(3), gpus=1)
    c.request(rid(4), gpus=1)  # w1 has 2 GPUs, w2 one: this one waits
    c.to_client.clear()
    queued = c.admin("queue")
    assert [q["id"] for q in queued] == [rid(4).hex()]
    with pytest.raises(InvalidRequest, match="give more digits"):
        c.admin("cancel", id="00000000")  # every id here starts with zeros
    out = c.admin("cancel", id=rid(4).hex())
    assert out["cancelled"] is True
    (reply,) = c.replies()
    assert reply.header["id"] == rid(4) and reply.header["code"] == "CANCELLED"
    assert "administrator" in reply.header["message"]
    with pytest.raises(ConflictError, match="cannot be cancelled yet"):
        c.admin("cancel", id=rid(1).hex())
    with pytest.raises(ConflictError, match="already finished"):
        c.admin("cancel", id=rid(4).hex())
    with pytest.raises(InvalidRequest, match="not a request id"):
        c.admin("cancel", id="xyz")
    assert c.core.cancel(rid(99), "nothing") is False


def test_tasks_filters_and_limit(c: Core) -> None:
    for n in range(1, 6):
        c.request(rid(n), gpu_milli=10, tenant="alice" if n % 2 else "bob")
        c.clock.advance(1)
        c.core.now = c.clock.monotonic()
    out = c.admin("tasks", tenant="alice")
    assert out["matched"] == 3 and [t["id"] for t in out["tasks"]] == [rid(n).hex() for n in (5, 3, 1)]
    assert c.admin("tasks", limit=2)["matched"] == 5 and len(c.admin("tasks", limit=2)["tasks"]) == 2
    assert c.admin("tasks", state="queued")["matched"] == 0
    assert c.admin("tasks", state="running", kind="echo")["matched"] == 5
    on_w2 = c.admin("tasks", worker="w2")["tasks"]
    assert on_w2 and all(t["worker"] == "w2" and t["gpus"] == ["GPU-w2-0"] for t in on_w2)


def test_status_says_standalone_and_failover_refuses(c: Core) -> None:
    st = c.admin("status")
    assert st["broker"]["role"] == "standalone" and st["broker"]["peer"] is None
    with pytest.raises(ConflictError, match=r"this broker has no peer \(standalone\)"):
        c.admin("failover")
    assert c.admin("reload")["reloaded"] is False


class WithHooks:
    """A target with the hooks a Broker may offer (reload; failover once there is a pair)."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self.reloads = 0

    def reload(self) -> dict[str, Any]:
        self.reloads += 1
        return {"changed": ("policy",), "odd": object()}


def test_reload_calls_the_hook_and_returns_plain_data(c: Core) -> None:
    target = WithHooks(c.core)
    out = ADMIN.dispatch(target, "reload", {}, who="x pid 2")
    assert target.reloads == 1 and out["reloaded"] is True
    assert out["result"]["changed"] == ["policy"] and isinstance(out["result"]["odd"], str)
    assert out["message"] == "configuration re-read; changed: policy"
    P.packb(out)  # the reply can be sent


@pytest.mark.parametrize(
    ("cmd", "args", "match"),
    [
        ("tasks", {"limit": 0}, "'limit' must be at least 1"),
        ("tasks", {"limit": True}, "'limit' must be an integer"),
        ("tasks", {"limit": "5"}, "'limit' must be an integer"),
        ("tasks", {"state": "sleeping"}, "'state' must be one of queued, running, done"),
        ("tasks", {"tenant": 7}, "'tenant' must be a string"),
        ("tasks", {"tenant": "a\nb"}, "printable"),
        ("tasks", {"bogus": 1}, "unknown argument 'bogus'"),
        ("status", {"x": 1}, "it takes none"),
        ("drain", {}, "'worker' is required"),
        ("drain", {"worker": "nobody"}, "no connected worker named 'nobody'"),
        ("cancel", {"id": b"\x00" * 16}, "'id' must be a string"),
    ],
)
def test_bad_args_are_refused_before_use(c: Core, cmd: str, args: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        ADMIN.dispatch(c.core, cmd, args)


def test_bad_command_and_args_shapes(c: Core) -> None:
    with pytest.raises(InvalidRequest, match="unknown admin command"):
        ADMIN.dispatch(c.core, "explode", {})
    with pytest.raises(InvalidRequest, match="unknown admin command"):
        ADMIN.dispatch(c.core, b"status", {})
    with pytest.raises(InvalidRequest, match="must be a map"):
        ADMIN.dispatch(c.core, "status", [1])
    assert ADMIN.dispatch(c.core, "status", None)["counts"]["workers"] == 2


def test_mutating_commands_are_logged_with_who_asked(c: Core, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpud.admin")
    ADMIN.dispatch(c.core, "drain", {"worker": "w1"}, who="alice pid 4242")
    ADMIN.dispatch(c.core, "gpus", {})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["admin drain worker=w1 by alice pid 4242"]


def test_registry_serializes_mutating_commands() -> None:
    spec = CommandSpec("bump", "Bump.\n\nExample: gpudctl bump", mutating=True)
    reg = Registry({"bump": spec})
    inside = 0
    overlap = []

    @reg.command("bump")
    def bump(target: Any, args: dict[str, Any]) -> None:
        nonlocal inside
        inside += 1
        overlap.append(inside)
        time.sleep(0.002)
        inside -= 1

    threads = [threading.Thread(target=reg.dispatch, args=(None, "bump", {})) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlap == [1] * 8


def test_registry_refuses_commands_outside_its_table() -> None:
    reg = Registry({"a": CommandSpec("a", "A."), "b": CommandSpec("b", "B.", mutating=True)})
    with pytest.raises(ValueError, match="not in the command table"):
        reg.command("c")
    with pytest.raises(ValueError, match="disagrees"):
        reg.command("b", mutating=False)
    reg.command("a")(lambda t, a: None)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        reg.verify()


def test_spec_parses_examples_and_checks_args() -> None:
    spec = CommandSpec(
        "x",
        """Do x.

        Example: gpudctl x 5
        Example: ``gpudctl x 6 --json``  # exit 1: no such x
        """,
        args=(Arg("n", int, "n", positional=True, min=0), Arg("tag", str, "t", default="none")),
    )
    assert spec.summary == "Do x."
    assert spec.examples == [("gpudctl x 5", 0, ""), ("gpudctl x 6 --json", 1, "no such x")]
    assert spec.check({"n": 3}) == {"n": 3, "tag": "none"}
    assert spec.check({"n": 3, "tag": None}) == {"n": 3, "tag": "none"}
    with pytest.raises(GpudError):
        spec.check({"n": -1})


def test_queue_says_what_each_request_needs_and_why_it_waits() -> None:
    from gpud.resources import TenantLimits

    c = Core()
    c.core.set_tenant_limits({"capped": TenantLimits(max_milli=1000)})
    c.ready(W1, "w1", ngpus=2)
    c.request(rid(1), gpus=1)  # one GPU, whole
    c.request(rid(5), gpu_milli=500, tenant="capped")  # half the other
    c.request(rid(6), gpu_milli=400, tenant="capped")  # 900 of its 1000: placed
    c.request(rid(7), gpu_milli=100, tenant="capped")  # 1000: placed
    c.request(rid(8), gpu_milli=50, tenant="capped")  # 1050: its limit holds it back
    c.request(rid(2), gpus=1, mem=GiB)  # no whole GPU is free
    rows = {q["id"]: q for q in c.admin("queue")}
    assert set(rows) == {rid(8).hex(), rid(2).hex()}
    assert rows[rid(2).hex()]["needs"] == {"gpus": 1, "mem": GiB} and rows[rid(2).hex()]["wait"] == "no_gpu_fits"
    assert rows[rid(8).hex()]["needs"] == {"gpu_milli": 50} and rows[rid(8).hex()]["wait"] == "tenant_limit"
    assert "limits" in rows[rid(8).hex()]["why"]
    task_rows = c.admin("tasks", state="running")["tasks"]
    assert len(task_rows) == 4 and all(t["gpu_names"] and t["gpu_names"][0] in ("w1/0", "w1/1") for t in task_rows)
    c.core.workers.lost(c.core.registry.by_name["w1"], "test")  # the only worker goes
    rows = c.admin("queue")
    assert rows and {q["wait"] for q in rows} == {"held"} and "no connected worker" in rows[0]["why"]


def test_why_waiting_checks_in_order() -> None:
    from gpud_broker.queue import WAIT_REASONS, WaitFacts, why_waiting

    fits = WaitFacts(held=None, within_limits=True, ever_fits=True, fits_now=True, fits_unreserved=True,
                     ahead_higher=0, ahead_same=0)
    cases = [
        (dict(held="settling"), "held"), (dict(within_limits=False, ever_fits=False), "tenant_limit"),
        (dict(ever_fits=False, fits_now=False), "no_gpu_ever"), (dict(fits_now=False, ahead_higher=3), "no_gpu_fits"),
        (dict(fits_unreserved=False, ahead_higher=3), "reserved"), (dict(ahead_higher=2, ahead_same=5), "priority"),
        (dict(ahead_same=5), "fair_share"), ({}, "next"),
    ]
    import dataclasses

    for change, code in cases:
        got, why = why_waiting(dataclasses.replace(fits, **change))
        assert got == code and why, change
    assert [code for _, code in cases] == list(WAIT_REASONS)
    assert "worker w9" in why_waiting(dataclasses.replace(fits, fits_now=False, reserved="w9"))[1]


def test_an_operand_stands_for_the_flag_its_action_names() -> None:
    spec = COMMANDS["openstack"]
    assert spec.with_operand({"action": "boot"}, "2") == {"action": "boot", "count": 2}
    assert spec.with_operand({"action": "retire"}, "w1") == {"action": "retire", "worker": "w1"}
    assert spec.with_operand({"action": "list"}, None) == {"action": "list"}
    for args, word, problem in [({"action": "list"}, "x", "takes nothing after it"),
                                ({"action": "boot", "count": 1}, "2", "not both"),
                                ({"action": "boot"}, "two", "is a number")]:
        with pytest.raises(ValueError, match=problem):
            spec.with_operand(args, word)
    with pytest.raises(ValueError, match="takes nothing after it"):
        COMMANDS["status"].with_operand({}, "x")
