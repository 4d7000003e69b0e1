"""The OpenStack pool's decisions (gpud_broker.openstack.pool) with a fake clock: matching servers to
workers, healing (reboot, then replace), scaling (grow on a backlog, shrink idle workers, keep the
minimum), boots that fail, one action per worker, and gpudctl's requests refused with reasons.

``Cloud`` plays Nova as the pool sees it: it answers each Nova op at once with a ``Result``; the
tests set server statuses and the broker's workers by hand and move the clock.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from gpud.clock import FakeClock
from gpud.errors import ConflictError, InvalidRequest
from gpud_broker.openstack.pool import (
    NOVA_OPS,
    Op,
    Pool,
    PoolConfig,
    Result,
    ServerInfo,
    Snapshot,
    WorkerView,
    recognised,
)

ROOT = Path(__file__).resolve().parents[2]


class Cloud:
    """Servers by id; ``run(op)`` carries a Nova op out at once. ``errors[kind]`` makes the next
    op of that kind fail with ``(message, error kind)``."""

    def __init__(self) -> None:
        self.servers: dict[str, ServerInfo] = {}
        self.done: list[Op] = []
        self.errors: dict[str, tuple[str, str]] = {}
        self.n = 0

    def add(self, name: str, status: str = "ACTIVE") -> str:
        self.n += 1
        sid = f"id-{self.n}"
        self.servers[sid] = ServerInfo(sid, name, status, pci_alias="a100:1")
        return sid

    def status(self, sid: str, status: str, fault: str = "") -> None:
        s = self.servers[sid]
        self.servers[sid] = ServerInfo(s.id, s.name, status, pci_alias=s.pci_alias, fault=fault)

    def run(self, op: Op) -> Result:
        self.done.append(op)
        if op.kind in self.errors:
            error, kind = self.errors.pop(op.kind)
            return Result(op, False, error=error, kind=kind)
        if op.kind == "list":
            return Result(op, True, servers=tuple(self.servers.values()))
        if op.kind == "boot":
            sid = self.add(op.name, "BUILD")
            return Result(op, True, server=self.servers[sid])
        if op.kind == "reboot":
            self.status(op.server_id, "ACTIVE")
            return Result(op, True)
        assert op.kind == "delete"
        if self.servers.pop(op.server_id, None) is None:
            return Result(op, False, error="gone", kind="not_found")
        return Result(op, True)

    def kinds(self) -> list[str]:
        out = [op.kind for op in self.done if op.kind != "list"]
        self.done.clear()
        return out


class Rig:
    def __init__(self, **cfg: object) -> None:
        defaults: dict[str, object] = {"max_workers": 4, "poll_interval": 1.0, "heal_after": 10.0, "reboot_timeout": 30.0,
                                       "grow_after": 20.0, "shrink_after": 100.0, "boot_timeout": 60.0,
                                       "retire_timeout": 50.0}
        self.pool = Pool(PoolConfig(**{**defaults, **cfg}), rng=random.Random(7))  # type: ignore[arg-type]
        self.clock = FakeClock()
        self.cloud = Cloud()
        self.workers: dict[str, WorkerView] = {}
        self.queued = 0
        self.broker_ops: list[Op] = []

    @property
    def now(self) -> float:
        return self.clock.now

    def snap(self) -> Snapshot:
        return Snapshot(tuple(self.workers.values()), self.queued)

    def carry_out(self, ops: list[Op]) -> None:
        for op in ops:
            if op.kind in NOVA_OPS:
                self.carry_out(self.pool.on_result(self.cloud.run(op), self.now))
            else:
                self.broker_ops.append(op)

    def step(self, seconds: float = 0.0) -> None:
        self.clock.advance(seconds)
        self.carry_out(self.pool.step(self.now, self.snap()))

    def run_for(self, seconds: float, every: float = 1.0) -> None:
        t = 0.0
        while t < seconds:
            self.step(every)
            t += every

    def connect(self, name: str, instance_id: str, busy: bool = False) -> None:
        self.workers[name] = WorkerView(name, instance_id, busy=busy)

    def lose(self, name: str) -> None:
        del self.workers[name]

    def actions(self) -> list[dict[str, object]]:
        return self.pool.actions(self.now)


# --------------------------------------------------------------------------- the view


def test_list_matches_servers_and_workers_both_ways() -> None:
    rig = Rig()
    a = rig.cloud.add("gpu-a")
    rig.cloud.add("gpu-b", "SHUTOFF")
    rig.connect("w-a", a)
    rig.connect("w-anon", "")
    rig.connect("w-elsewhere", "not-a-gpud-server")
    rig.step()
    view = rig.pool.view(rig.now, rig.snap())
    rows = {s["name"]: s for s in view["servers"]}
    assert rows["gpu-a"]["worker"] == "w-a" and rows["gpu-a"]["worker_state"] == "idle"
    assert rows["gpu-a"]["pci_alias"] == "a100:1"
    assert rows["gpu-b"]["worker"] == "" and rows["gpu-b"]["status"] == "SHUTOFF"
    lonely = {w["name"]: w["why"] for w in view["workers_without_server"]}
    assert lonely == {"w-anon": "reported no instance id", "w-elsewhere": "its server is not among Nova's gpud servers"}
    assert view["size"] == 2 and view["listed_s"] == 0


def test_recognised_needs_every_pair_and_tag() -> None:
    want = {"gpud:role": "worker"}
    assert recognised({"gpud:role": "worker", "x": "y"}, ["gpu"], want, ["gpu"])
    assert not recognised({"gpud:role": "worker"}, [], want, ["gpu"])
    assert not recognised({"gpud:role": "other"}, ["gpu"], want, ["gpu"])


def test_a_failed_list_is_reported_and_the_next_one_clears_it() -> None:
    rig = Rig()
    rig.cloud.errors["list"] = ("listing servers: Nova answered 503", "server_error")
    rig.step()
    view = rig.pool.view(rig.now, rig.snap())
    assert view["listed_s"] is None and "503" in view["list_error"]
    rig.step(1.0)
    assert rig.pool.view(rig.now, rig.snap())["list_error"] == ""


# --------------------------------------------------------------------------- healing


def test_heal_reboots_a_dead_worker_after_heal_after_then_it_comes_back() -> None:
    rig = Rig(heal=True)
    sid = rig.cloud.add("gpu-a")
    rig.connect("w-a", sid)
    rig.step()
    rig.lose("w-a")
    rig.cloud.status(sid, "SHUTOFF")
    rig.run_for(9.0)
    assert rig.cloud.kinds() == []  # gone less than heal_after (10 s)
    rig.run_for(2.0)
    assert rig.cloud.kinds() == ["reboot"]
    [act] = rig.actions()
    assert act["kind"] == "reboot" and act["step"] == "return" and "SHUTOFF" in str(act["reason"])
    rig.run_for(20.0)
    assert rig.cloud.kinds() == []  # one action per worker: no second reboot while it waits
    rig.connect("w-a", sid)
    rig.step(1.0)
    [act] = rig.actions()
    assert act["outcome"] == "done" and "back" in str(act["message"])


@pytest.mark.parametrize("status", ["ACTIVE", "BUILD", "ERROR"])
def test_heal_leaves_servers_alone_unless_error_or_shutoff_without_a_worker(status: str) -> None:
    rig = Rig(heal=True)
    sid = rig.cloud.add("gpu-a", status)
    live = rig.cloud.add("gpu-b", "ERROR")  # ERROR in Nova's list, but its worker is connected
    rig.connect("w-b", live)
    rig.run_for(30.0)
    kinds = rig.cloud.kinds()
    assert kinds == (["reboot"] if status == "ERROR" else [])
    assert all(op.server_id == sid for op in rig.cloud.done if op.kind == "reboot")


def test_heal_off_does_nothing() -> None:
    rig = Rig(heal=False)
    rig.cloud.add("gpu-a", "ERROR")
    rig.run_for(60.0)
    assert rig.cloud.kinds() == [] and rig.actions() == []


def test_heal_replaces_a_server_whose_worker_does_not_come_back() -> None:
    rig = Rig(heal=True)
    sid = rig.cloud.add("gpu-a", "ERROR")
    rig.run_for(11.0)
    assert rig.cloud.kinds() == ["reboot"]
    rig.run_for(31.0)  # reboot_timeout: not back; delete first, then boot
    assert rig.cloud.kinds() == ["delete", "boot"]
    [act] = rig.actions()
    assert act["kind"] == "replace" and "not back" in str(act["reason"])
    assert sid not in rig.cloud.servers
    new = str(act["new_server_id"])
    assert rig.cloud.servers[new].name.startswith("gpud-worker-")
    rig.cloud.status(new, "ACTIVE")
    rig.run_for(2.0)  # the next list shows it ACTIVE
    assert rig.actions()[0]["step"] == "join"
    rig.connect("w-new", new)
    rig.step(1.0)
    [act] = rig.actions()
    assert act["outcome"] == "done" and "replaced by" in str(act["message"])


def test_a_failed_reboot_escalates_to_a_replacement() -> None:
    rig = Rig(heal=True)
    rig.cloud.add("gpu-a", "SHUTOFF")
    rig.cloud.errors["reboot"] = ("rebooting: Nova answered 500", "server_error")
    rig.run_for(13.0)
    assert rig.cloud.kinds() == ["reboot", "delete", "boot"]
    assert "the reboot failed" in str(rig.actions()[0]["reason"])


# --------------------------------------------------------------------------- scaling


def test_a_backlog_grows_the_pool_one_at_a_time_up_to_max() -> None:
    rig = Rig(scale=True, max_workers=2)
    rig.step()
    rig.queued = 5
    rig.run_for(19.0)
    assert rig.cloud.kinds() == []  # not yet grow_after (20 s)
    rig.run_for(2.0)
    assert rig.cloud.kinds() == ["boot"]
    rig.run_for(40.0)
    assert rig.cloud.kinds() == []  # one boot at a time: the first one has no worker yet
    first = next(s for s in rig.cloud.servers.values())
    rig.cloud.status(first.id, "ACTIVE")
    rig.connect("w-1", first.id)
    rig.step(1.0)  # joined; still backlogged, and more than grow_after since the last boot
    assert rig.cloud.kinds() == ["boot"]
    second = next(s for s in rig.cloud.servers.values() if s.id != first.id)
    rig.cloud.status(second.id, "ACTIVE")
    rig.connect("w-2", second.id)
    rig.run_for(100.0)
    assert rig.cloud.kinds() == []  # max_workers reached
    assert rig.pool.size() == 2


def test_scale_keeps_min_workers_and_shrinks_idle_ones_down_to_it() -> None:
    rig = Rig(scale=True, min_workers=1, max_workers=3)
    rig.run_for(2.0)
    assert rig.cloud.kinds() == ["boot"]  # below min_workers
    [s] = rig.cloud.servers.values()
    rig.cloud.status(s.id, "ACTIVE")
    rig.connect("w-1", s.id)
    extra = rig.cloud.add("gpu-x")
    rig.connect("w-x", extra, busy=True)
    rig.run_for(150.0)
    assert rig.cloud.kinds() == ["delete"]  # w-1 idle past shrink_after, 2 > min_workers; w-x busy
    rig.run_for(300.0)
    assert rig.cloud.kinds() == []  # at min_workers now
    assert [a["kind"] for a in rig.actions()] == ["retire", "boot"]
    retire = rig.actions()[0]
    assert retire["worker"] == "w-1" and retire["outcome"] == "done" and "idle" in str(retire["reason"])


def test_shrink_retires_the_longest_idle_worker_never_below_min_nor_while_queued() -> None:
    rig = Rig(scale=True, min_workers=1, max_workers=3)
    ids = [rig.cloud.add(f"gpu-{i}") for i in range(3)]
    for i, sid in enumerate(ids):
        rig.connect(f"w-{i}", sid, busy=True)
    rig.step()
    rig.connect("w-2", ids[2])  # idle from now
    rig.step(10.0)
    rig.connect("w-0", ids[0])  # idle 10 s later
    rig.queued = 1
    rig.run_for(150.0)
    assert rig.cloud.kinds() == []  # something is queued
    rig.queued = 0
    rig.run_for(2.0)
    assert rig.cloud.kinds() == ["delete"]
    assert rig.actions()[0]["worker"] == "w-2"
    assert [op.kind for op in rig.broker_ops][:1] == ["drain"]
    rig.lose("w-2")
    rig.run_for(200.0)
    assert rig.cloud.kinds() == ["delete"]  # w-0 next; w-1 stays busy; then the pool is at min
    rig.lose("w-0")
    rig.connect("w-1", ids[1])
    rig.run_for(300.0)
    assert rig.cloud.kinds() == []
    assert rig.pool.size() == 1


def test_retire_waits_for_running_work_at_most_retire_timeout() -> None:
    rig = Rig()
    sid = rig.cloud.add("gpu-a")
    rig.connect("w-a", sid, busy=True)
    rig.step()
    action, ops = rig.pool.retire("w-a", rig.now, rig.snap(), "test")
    rig.carry_out(ops)
    assert [op.kind for op in rig.broker_ops] == ["drain"] and rig.broker_ops[0].name == "w-a"
    rig.run_for(40.0)
    assert rig.cloud.kinds() == [] and action.step == "settle"
    rig.run_for(11.0)  # retire_timeout (50 s): deleted anyway
    assert rig.cloud.kinds() == ["delete"]
    rig.run_for(2.0)
    assert action.outcome == "done" and rig.broker_ops[-1].kind == "forget"


# --------------------------------------------------------------------------- boots that fail


def test_a_server_stuck_in_build_fails_its_boot_and_is_deleted() -> None:
    rig = Rig()
    rig.step()
    [action], ops = rig.pool.boot(1, rig.now, "test")
    rig.carry_out(ops)
    assert action.step == "build"
    rig.run_for(59.0)
    assert action.outcome == "running"
    rig.run_for(2.0)
    assert action.outcome == "failed" and "stuck in BUILD" in action.message
    assert rig.cloud.kinds() == ["boot", "delete"] and rig.cloud.servers == {}
    assert action.message.endswith("deleted it")


def test_a_server_in_error_fails_its_boot_with_the_fault() -> None:
    rig = Rig()
    rig.step()
    [action], ops = rig.pool.boot(1, rig.now, "test")
    rig.carry_out(ops)
    rig.cloud.status(action.new_id, "ERROR", fault="No valid host was found.")
    rig.run_for(2.0)
    assert action.outcome == "failed" and "No valid host was found." in action.message
    assert rig.cloud.kinds() == ["boot", "delete"]


def test_an_active_server_without_a_worker_fails_the_boot_but_stays() -> None:
    rig = Rig()
    rig.step()
    [action], ops = rig.pool.boot(1, rig.now, "test")
    rig.carry_out(ops)
    rig.cloud.status(action.new_id, "ACTIVE")
    rig.run_for(61.0)
    assert action.outcome == "failed" and "no worker reported its id" in action.message
    assert rig.cloud.kinds() == ["boot"] and action.new_id in rig.cloud.servers


def test_a_refused_boot_fails_with_nova_s_reason() -> None:
    rig = Rig()
    rig.step()
    rig.cloud.errors["boot"] = ("booting: Nova answered 403: Quota exceeded for instances", "over_quota")
    [action], ops = rig.pool.boot(1, rig.now, "test")
    rig.carry_out(ops)
    assert action.outcome == "failed" and "Quota exceeded" in action.message


# --------------------------------------------------------------------------- gpudctl's requests


def test_requests_are_refused_with_reasons() -> None:
    rig = Rig(max_workers=2)
    sid = rig.cloud.add("gpu-a")
    rig.connect("w-a", sid)
    rig.connect("w-anon", "")
    rig.step()
    with pytest.raises(ConflictError, match="max_workers is 2"):
        rig.pool.boot(2, rig.now, "test")
    with pytest.raises(InvalidRequest, match="reported no Nova instance id"):
        rig.pool.retire("w-anon", rig.now, rig.snap(), "test")
    with pytest.raises(InvalidRequest, match="no connected worker and no gpud server named 'nope'"):
        rig.pool.replace("nope", rig.now, rig.snap(), "test")
    action, ops = rig.pool.replace("w-a", rig.now, rig.snap(), "test")
    rig.carry_out(ops)
    assert action.steps[0] == "create"  # its worker is connected: the new server first
    for ask in (rig.pool.retire, rig.pool.replace):
        with pytest.raises(ConflictError, match=f"action {action.id} .* one action per worker"):
            ask("gpu-a", rig.now, rig.snap(), "test")  # by server name too
    with pytest.raises(ConflictError, match="the pool has 1 server"):
        rig.pool.boot(2, rig.now, "test")  # the replacement counts, the server it replaces not
    blocked = Pool(PoolConfig(max_workers=5), boot_problem="[openstack] image not set")
    with pytest.raises(ConflictError, match="cannot boot: \\[openstack\\] image not set"):
        blocked.boot(1, 0.0, "test")


def test_replace_of_a_live_worker_boots_first_then_drains_and_deletes_the_old_one() -> None:
    rig = Rig()
    old = rig.cloud.add("gpu-old")
    rig.connect("w-old", old, busy=True)
    rig.step()
    action, ops = rig.pool.replace("w-old", rig.now, rig.snap(), "test")
    rig.carry_out(ops)
    assert rig.cloud.kinds() == ["boot"] and rig.broker_ops == []
    rig.cloud.status(action.new_id, "ACTIVE")
    rig.connect("w-new", action.new_id)
    rig.step(1.0)
    assert [op.kind for op in rig.broker_ops] == ["drain"] and action.step == "settle"
    rig.connect("w-old", old, busy=False)
    rig.run_for(3.0)
    assert rig.cloud.kinds() == ["delete"] and action.outcome == "done"
    assert old not in rig.cloud.servers


def test_new_names_are_unique_and_prefixed() -> None:
    rig = Rig(max_workers=50, name_prefix="gpu")
    rig.step()
    actions, _ = rig.pool.boot(50, rig.now, "test")
    names = [a.new_name for a in actions]
    assert len(set(names)) == 50 and all(n.startswith("gpu-") and len(n) == 10 for n in names)


def test_the_pool_module_is_pure() -> None:
    tree = ast.parse((ROOT / "broker/gpud_broker/openstack/pool.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    assert not names & {"zmq", "asyncio", "socket", "threading", "subprocess", "time", "novaclient", "keystoneauth1"}
