"""The OpenStack controller (gpud_broker.openstack.controller) between a real BrokerCore and the
fault server (tests/compute_api.py) through the real python-novaclient: Nova calls run on its
threads and ``on_tick`` never waits for them, even while Nova holds its answer; a server stuck in
BUILD fails its boot and is deleted; a Nova that is misconfigured, or a passive broker, is refused
with reasons. Boot and retire against real Nova: tests/integration/test_openstack_controller.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.errors import ConflictError, InvalidRequest
from gpud_broker.openstack.controller import Controller

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compute_api import ComputeAPI  # noqa: E402
from openstack_harness import admin, config, core, last_action, ready, tick_until  # noqa: E402


@pytest.fixture()
def api() -> Iterator[ComputeAPI]:
    with ComputeAPI() as cloud:
        cloud.add_flavor("g1.a100", {"pci_passthrough:alias": "a100:1"})
        cloud.add_image("ubuntu-gpu")
        yield cloud


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


def test_a_server_stuck_in_build_fails_its_boot_and_is_deleted(api: ComputeAPI) -> None:
    api.stuck_in_build = True  # Nova never gets it past BUILD
    ctl = Controller(config(boot_timeout=1.0), env=api.auth_env(), clouds_files=[])
    ctl.start()
    try:
        c = core()
        admin(ctl, c, action="boot", count=1)
        act = tick_until(ctl, c, lambda: (a := last_action(ctl, c))["outcome"] != "running" and a, "the boot to fail")
        assert act["outcome"] == "failed" and "stuck in BUILD" in act["message"]
        tick_until(ctl, c, lambda: api.names() == {}, "the stuck server to be deleted")
        tick_until(ctl, c, lambda: last_action(ctl, c)["message"].endswith("deleted it"), "the deletion to be recorded")
    finally:
        ctl.stop()


def test_a_misconfigured_nova_is_reported_and_the_broker_goes_on() -> None:
    ctl = Controller(config(), env={}, clouds_files=[])  # no cloud, no OS_* variables
    ctl.start()
    try:
        c = core()
        view = tick_until(ctl, c, lambda: (v := admin(ctl, c, action="list"))["list_error"] and v, "the list error")
        assert "no credentials" in view["list_error"] and view["listed_s"] is None
        admin(ctl, c, action="boot", count=1)
        act = tick_until(ctl, c, lambda: (a := last_action(ctl, c))["outcome"] != "running" and a, "the boot to fail")
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
    with pytest.raises(InvalidRequest, match="openstack retire takes one WORKER"):
        admin(ctl, c, action="retire")
    with pytest.raises(InvalidRequest, match="openstack list takes neither"):
        admin(ctl, c, action="list", count=2)
