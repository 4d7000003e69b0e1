"""The OpenStack controller (gpud_broker.openstack.controller) between a real BrokerCore and real
Nova 34 (tests/realnova), with Keystone credentials in OS_*: ``gpudctl openstack`` boot and retire
reach Nova, the broker's drain and the worker allow-list; the booted server's user data carries
the key pair the broker admits.

Faults real Nova cannot be made to show on demand (a list held back, a server stuck in BUILD) and
requests refused before Nova is asked are in tests/unit/test_openstack_controller.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.errors import ConflictError
from gpud.security import SecuritySettings, keygen, load_public_key
from gpud_broker.openstack.controller import Controller
from tests.openstack_harness import admin, config, core, last_action, ready, tick_until
from tests.realnova import ALIAS, RealNova
from tests.realnova.project import IMAGE, NETWORK, Project

pytest_plugins = ["tests.realnova.fixture"]
pytestmark = pytest.mark.timeout(600)  # the first test of the session may start Nova

FLAVOR = "g1.ctl"


def test_boot_and_retire_through_gpudctl_reach_nova_the_drain_and_the_allow_list(real_nova: RealNova,
                                                                                   tmp_path: Path) -> None:
    project = Project(real_nova, "gpu-ctl")
    project.flavor(FLAVOR, {"pci_passthrough:alias": f"{ALIAS}:1"})
    keys = tmp_path / "keys"
    keygen(keys, "broker")
    security = SecuritySettings(mode="curve", keys_dir=str(keys))
    cfg = config(image=IMAGE, flavor=FLAVOR, network=NETWORK, poll_interval=0.5, api_timeout=30.0, boot_timeout=60.0)
    ctl = Controller(cfg, security=security, env=project.env(), clouds_files=[])
    ctl.start()
    try:
        c = core()
        tick_until(ctl, c, lambda: admin(ctl, c, action="list")["listed_s"] is not None, "the first list", timeout=60)
        out = admin(ctl, c, action="boot", count=1)
        name = out["actions"][0]["new_server_name"]
        assert out["message"].startswith(f"booting 1 server(s): {name}")
        sid = tick_until(ctl, c, lambda: last_action(ctl, c)["new_server_id"], "the boot", timeout=60)
        assert project.names()[sid] == name
        # The user data, as Nova keeps it, carries a key pair whose public half the broker now admits.
        user_data = project.user_data(sid)
        allowed = keys / "workers" / f"{name}.key"
        assert allowed.exists() and load_public_key(allowed).decode() in user_data
        assert load_public_key(keys / "broker.key").decode() in user_data and '"tcp://control-1:5556"' in user_data
        assert project.admin.servers.get(sid).metadata == {"gpud:role": "worker"}
        tick_until(ctl, c, lambda: last_action(ctl, c)["step"] == "join", "ACTIVE", timeout=60)
        ready(c, name, sid)  # what cloud-init and gpud-worker.service do on the VM
        tick_until(ctl, c, lambda: last_action(ctl, c)["outcome"] == "done", "the join", timeout=60)
        row = next(s for s in admin(ctl, c, action="list")["servers"] if s["id"] == sid)
        assert row["worker"] == name and row["pci_alias"] == f"{ALIAS}:1" and row["status"] == "ACTIVE"
        with pytest.raises(ConflictError, match="max_workers is 2"):
            admin(ctl, c, action="boot", count=2)

        out = admin(ctl, c, action="retire", worker=name)
        assert "drains it, then deletes its server" in out["message"]
        assert c.registry.by_name[name].draining  # applied on the loop, at once
        # Done once Nova no longer lists the server.
        tick_until(ctl, c, lambda: last_action(ctl, c)["outcome"] == "done", "the retire", timeout=60)
        assert sid not in project.names() and project.status(sid) is None
        assert not allowed.exists()  # the key left with the server
    finally:
        ctl.stop()
        project.clear()
