"""The OpenStack controller (gpud_broker.openstack.controller) between a real BrokerCore and the
local Compute API through the real python-novaclient: Nova calls run on its threads and ``on_tick``
never waits for them; ``gpudctl openstack`` boot and retire reach Nova, the broker's drain and the
worker allow-list; a Nova that is misconfigured, or a passive broker, is refused with reasons.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud import protocol as P
from gpud.config import OpenStackConfig
from gpud.errors import ConflictError
from gpud.protocol import Command, Peer
from gpud.security import SecuritySettings, keygen, load_public_key
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.openstack.controller import Controller

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compute_api import ComputeAPI  # noqa: E402

GiB = 1 << 30


@pytest.fixture()
def api() -> Iterator[ComputeAPI]:
    with ComputeAPI() as cloud:
        cloud.add_flavor("g1.a100", {"pci_passthrough:alias": "a100:1"})
        cloud.add_image("ubuntu-gpu")
        yield cloud


def config(**over: object) -> OpenStackConfig:
    base = dict(enabled=True, image="ubuntu-gpu", flavor="g1.a100", brokers=("tcp://control-1:5556",), max_workers=2,
                poll_interval=0.1, api_timeout=5.0, api_retries=0, boot_timeout=30.0, retire_timeout=5.0)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


def core() -> BrokerCore:
    return BrokerCore(BrokerConfig(), time.monotonic(), lambda i, f: None, lambda i, f: None)


def ready(c: BrokerCore, name: str, instance_id: str) -> None:
    gpus = [{"uuid": f"GPU-{name}", "index": 0, "model": "A100", "mem": 16 * GiB, "cc": [8, 0]}]
    enc = P.encode(Peer.WORKER, Command.READY, {"name": name, "gpus": gpus, "slots": 4, "instance_id": instance_id})
    c.on_worker(name.encode(), P.decode(enc, Peer.WORKER), enc[2])


def tick_until(ctl: Controller, c: BrokerCore, pred: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        c.now = time.monotonic()
        ctl.on_tick(c, c.now)
        value = pred()
        if value:
            return value
        if c.now > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def admin(ctl: Controller, c: BrokerCore, **args: Any) -> dict[str, Any]:
    c.now = time.monotonic()
    return ctl.admin(c, {"worker": None, "count": None, **args})


def test_on_tick_never_waits_for_nova(api: ComputeAPI) -> None:
    api.slow("GET", r"/servers/detail", 60.0)
    ctl = Controller(config(), env=api.auth_env(), clouds_files=[])
    ctl.start()
    try:
        c = core()
        ctl.on_tick(c, time.monotonic())  # asks for the server list; a thread sends it
        deadline = time.monotonic() + 20
        while api.count("GET", r"/servers/detail") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(20):
            c.now = time.monotonic()
            ctl.on_tick(c, c.now)  # Nova holds its answer: the loop goes on regardless
        view = admin(ctl, c, action="list")
        assert view["listed_s"] is None and view["servers"] == [] and ctl.pool.list_pending
        api.release()
        tick_until(ctl, c, lambda: admin(ctl, c, action="list")["listed_s"] is not None, "the list")
    finally:
        ctl.stop()


def test_boot_and_retire_through_gpudctl_reach_nova_the_drain_and_the_allow_list(api: ComputeAPI, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keygen(keys, "broker")
    security = SecuritySettings(mode="curve", keys_dir=str(keys))
    ctl = Controller(config(), security=security, env=api.auth_env(), clouds_files=[])
    ctl.start()
    try:
        c = core()
        tick_until(ctl, c, lambda: admin(ctl, c, action="list")["listed_s"] is not None, "the first list")
        out = admin(ctl, c, action="boot", count=1)
        name = out["actions"][0]["new_server_name"]
        assert out["message"].startswith(f"booting 1 server(s): {name}")
        sid = tick_until(ctl, c, lambda: next((i for i, n in api.names().items() if n == name), None), "the boot")
        # The user data carries a key pair whose public half the broker now admits.
        user_data = api.servers[sid].user_data
        allowed = keys / "workers" / f"{name}.key"
        assert allowed.exists() and load_public_key(allowed).decode() in user_data
        assert load_public_key(keys / "broker.key").decode() in user_data and '"tcp://control-1:5556"' in user_data
        assert api.servers[sid].metadata == {"gpud:role": "worker"}
        tick_until(ctl, c, lambda: admin(ctl, c, action="actions")["actions"][0]["step"] == "join", "ACTIVE")
        ready(c, name, sid)  # what cloud-init and gpud-worker.service do on the VM
        tick_until(ctl, c, lambda: admin(ctl, c, action="actions")["actions"][0]["outcome"] == "done", "the join")
        row = next(s for s in admin(ctl, c, action="list")["servers"] if s["id"] == sid)
        assert row["worker"] == name and row["pci_alias"] == "a100:1" and row["status"] == "ACTIVE"
        with pytest.raises(ConflictError, match="max_workers is 2"):
            admin(ctl, c, action="boot", count=2)

        out = admin(ctl, c, action="retire", worker=name)
        assert "drains it, then deletes its server" in out["message"]
        assert c.registry.by_name[name].draining  # applied on the loop, at once
        tick_until(ctl, c, lambda: sid not in api.names(), "the delete")
        tick_until(ctl, c, lambda: admin(ctl, c, action="actions")["actions"][0]["outcome"] == "done", "the retire")
        assert not allowed.exists()  # the key left with the server
    finally:
        ctl.stop()


def test_a_server_stuck_in_build_fails_its_boot_and_is_deleted(api: ComputeAPI) -> None:
    api.build_s = None  # Nova never gets it past BUILD
    ctl = Controller(config(boot_timeout=1.0), env=api.auth_env(), clouds_files=[])
    ctl.start()
    try:
        c = core()
        admin(ctl, c, action="boot", count=1)
        act = tick_until(ctl, c, lambda: (a := admin(ctl, c, action="actions")["actions"][0])["outcome"] != "running" and a,
                         "the boot to fail")
        assert act["outcome"] == "failed" and "stuck in BUILD" in act["message"]
        tick_until(ctl, c, lambda: api.names() == {}, "the stuck server to be deleted")
        tick_until(ctl, c, lambda: admin(ctl, c, action="actions")["actions"][0]["message"].endswith("deleted it"),
                   "the deletion to be recorded")
    finally:
        ctl.stop()


def test_a_misconfigured_nova_is_reported_and_the_broker_goes_on(api: ComputeAPI) -> None:
    ctl = Controller(config(), env={}, clouds_files=[])  # no cloud, no OS_* variables
    ctl.start()
    try:
        c = core()
        view = tick_until(ctl, c, lambda: (v := admin(ctl, c, action="list"))["list_error"] and v, "the list error")
        assert "no credentials" in view["list_error"] and view["listed_s"] is None
        admin(ctl, c, action="boot", count=1)
        act = tick_until(ctl, c, lambda: (a := admin(ctl, c, action="actions")["actions"][0])["outcome"] != "running" and a,
                         "the boot to fail")
        assert act["outcome"] == "failed" and "no credentials" in act["message"]
        ready(c, "w0", "")
        assert len(c.registry) == 1  # the broker's own work is untouched
    finally:
        ctl.stop()


def test_requests_that_cannot_be_served_are_refused() -> None:
    ctl = Controller(config(image="", brokers=()), env={}, clouds_files=[], active=lambda: False)
    c = core()
    with pytest.raises(ConflictError, match="passive one of its pair"):
        admin(ctl, c, action="boot", count=1)
    ctl.active = lambda: True
    with pytest.raises(ConflictError, match="cannot boot: \\[openstack\\] image, brokers not set"):
        admin(ctl, c, action="boot", count=1)
    from gpud.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="openstack retire takes one WORKER"):
        admin(ctl, c, action="retire")
    with pytest.raises(InvalidRequest, match="openstack list takes neither"):
        admin(ctl, c, action="list", count=2)
