"""OpenStack end to end against real Nova: a real broker and workers (LocalCluster) with
``[openstack]`` on, talking through python-novaclient and keystoneauth1 to nova-api, whose real
conductor, scheduler and compute services (a fake virt driver with NVIDIA PCI devices) and
placement run on 127.0.0.1 (tests/realnova), and gpudctl.

The broker is configured as an operator configures it: gpud.toml (``--config``) names a cloud of
clouds.yaml (``$OS_CLIENT_CONFIG_FILE``) whose credentials are a password of a user of a project in
real Keystone; keystoneauth1 gets the token and the catalog from Keystone, the image and network
are found by name in the catalog's Image and Network services, and Nova validates the token with
Keystone (keystonemiddleware).

The test plays cloud-init: when the broker boots a server, the test reads the server's user data
from Nova (as admin) and starts the worker it names, with that server's id, as the VM would. The
healing test kills a worker (SIGKILL) and stops its server through Nova: the broker reboots it, and
replaces it when the worker does not come back. gpud's Nova client and the controller alone:
test_openstack_nova.py, test_openstack_controller.py; faults real Nova cannot be made to show on
demand (429, 5xx, slow answers): tests/unit, against tests/compute_api.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud_cli.cluster import LocalCluster, admin_call
from tests.realnova import ALIAS, GPUS, RealNova
from tests.realnova.project import IMAGE, NETWORK, Project, wait_for

pytest_plugins = ["tests.realnova.fixture"]
# The first test starts Nova: from nothing (no database template yet, a fresh machine) that is a
# minute or two of migrations on a loaded machine.
pytestmark = pytest.mark.timeout(600)

GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]
WORKER = {"gpud:role": "worker"}
FLAVOR = "g1.gpu"


def toml(value: Any) -> str:
    """``value`` written as a TOML value (strings, numbers, booleans, lists, tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml(v)}" for k, v in value.items()) + " }"


class Cloud(Project):
    """The module's project in real Keystone, its servers, and an operator's configuration of a
    broker for it: a clouds.yaml cloud ``gpu`` (Keystone, password) and gpud.toml naming it."""

    def __init__(self, nova: RealNova, tmp: Path) -> None:
        super().__init__(nova, "gpu")
        self.tmp = tmp
        self.clouds = self.clouds_yaml(tmp / "clouds.yaml", "gpu")

    def broker_args(self, name: str, **openstack: Any) -> list[str]:
        """``--config`` of a broker: gpud.toml NAME.toml whose [openstack] names the cloud, the
        image and network (by name) and the flavor, and has ``openstack`` besides."""
        keys = {"enabled": True, "cloud": "gpu", "image": IMAGE, "network": NETWORK, "flavor": FLAVOR,
                "poll_interval": 0.2, "api_retries": 1, **openstack}
        path = self.tmp / f"{name}.toml"
        path.write_text("[openstack]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in keys.items()))
        return ["--config", str(path)]

    def daemon_env(self) -> dict[str, str]:
        """Where the broker finds clouds.yaml (else ./clouds.yaml, ~/.config/openstack, /etc/openstack)."""
        return {"OS_CLIENT_CONFIG_FILE": str(self.clouds)}


@pytest.fixture(scope="module")
def cloud(real_nova: RealNova, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    c = Cloud(real_nova, tmp_path_factory.mktemp("openstack"))
    gpu = c.flavor(FLAVOR, {"pci_passthrough:alias": f"{ALIAS}:1"})
    plain = c.flavor("m1.small", {})
    c.ids = {n: c.boot(n, gpu, WORKER) for n in ("gpu-0", "gpu-1", "gpu-lonely")}  # type: ignore[attr-defined]
    c.ids["web-1"] = c.boot("web-1", plain, {"role": "web"})  # type: ignore[attr-defined]
    yield c
    c.clear()


@pytest.fixture(scope="module")
def cluster(cloud: Cloud) -> Iterator[LocalCluster]:
    args = cloud.broker_args("heal", brokers=["tcp://127.0.0.1:5556"], max_workers=5, heal=True, heal_after=0.5,
                             reboot_timeout=3.0, retire_timeout=5.0)
    # Short heartbeats (a killed worker is gone after 0.9 s); healing acts only on servers that Nova
    # shows ERROR or SHUTOFF, so a worker a loaded machine loses for a moment triggers nothing.
    with LocalCluster(workers=0, heartbeat_ms=300, liveness=3, broker_args=args, env=cloud.daemon_env()) as c:
        ids = cloud.ids  # type: ignore[attr-defined]
        c.add_worker("w0", ["--instance-id", ids["gpu-0"]])
        c.add_worker("w1", ["--instance-id", ids["gpu-1"]])
        c.add_worker("w-anon")
        c.wait_workers(3)
        yield c


def openstack(cluster: LocalCluster, action: str, **args: Any) -> Any:
    return admin_call(cluster.admin, "openstack", {"action": action, **args}, timeout=10)


def gpudctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUDCTL, "--admin", cluster.admin, *args], capture_output=True, text=True, timeout=60)


def action(cluster: LocalCluster, aid: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = openstack(cluster, "actions")["actions"]
    return next(a for a in rows if a["id"] == aid)


def play_cloud_init(cloud: Cloud, cluster: LocalCluster, server_id: str) -> str:
    """Start the worker that the user data of ``server_id`` (as Nova keeps it) would start."""
    name = cloud.names()[server_id]
    data = cloud.user_data(server_id)
    assert data.startswith("#cloud-config") and f'name = "{name}"' in data and 'instance_id = "auto"' in data
    cluster.add_worker(name, ["--instance-id", server_id])
    return name


def test_list_matches_real_nova_then_boot_and_retire(cloud: Cloud, cluster: LocalCluster) -> None:
    ids = cloud.ids  # type: ignore[attr-defined]
    view = wait_for(lambda: (v := openstack(cluster, "list"))["listed_s"] is not None and v, "the first server list")
    rows = {s["name"]: s for s in view["servers"]}
    # What Nova says, seen by its admin: the broker recognises the servers by their metadata.
    nova = cloud.servers()
    workers = {i: s for i, s in nova.items() if s.metadata.get("gpud:role") == "worker"}
    assert {r["id"] for r in view["servers"]} == set(workers) and "web-1" not in rows
    for sid, s in workers.items():
        row = rows[s.name]
        assert (row["id"], row["status"], row["flavor"]) == (sid, s.status, s.flavor["original_name"])
        assert row["pci_alias"] == s.flavor["extra_specs"]["pci_passthrough:alias"] == f"{ALIAS}:1"
    assert rows["gpu-0"]["worker"] == "w0" and rows["gpu-1"]["worker"] == "w1" and rows["gpu-lonely"]["worker"] == ""
    assert [w["name"] for w in view["workers_without_server"]] == ["w-anon"]
    human = gpudctl(cluster, "openstack", "list")
    assert human.returncode == 0, human.stderr
    assert all(len(line) <= 80 for line in human.stdout.splitlines())
    lines = human.stdout.splitlines()
    for name in ("gpu-0", "gpu-1", "gpu-lonely"):
        line = next(x for x in lines if name in x.split())
        assert "ACTIVE" in line and f"{ALIAS}:1" in line, line
    assert "NO WORKER" in next(x for x in lines if "gpu-lonely" in x.split()) and "w-anon" in human.stdout
    assert "web-1" not in human.stdout

    booted = gpudctl(cluster, "openstack", "boot", "1", "--json")
    assert booted.returncode == 0, booted.stderr
    boot = json.loads(booted.stdout)["actions"][0]
    sid = wait_for(lambda: next((i for i, n in cloud.names().items() if n == boot["new_server_name"]), None), "the boot")
    assert sid not in ids.values()
    # Nova scheduled it on the GPU host (the PCI alias of the flavor), with gpud's metadata, in
    # Keystone's project, with the image and network the broker found by name in the catalog.
    wait_for(lambda: cloud.status(sid) == "ACTIVE", "the new server to go ACTIVE")
    server = cloud.admin.servers.get(sid)
    assert server.metadata.get("gpud:role") == "worker" and getattr(server, "OS-EXT-SRV-ATTR:host") == "compute-1"
    assert server.tenant_id == cloud.id and server.image["id"] == cloud.image
    assert {p.net_id for p in cloud.admin.servers.interface_list(sid)} == {cloud.network}
    name = play_cloud_init(cloud, cluster, sid)
    wait_for(lambda: action(cluster, boot["id"])["outcome"] == "done", "the new worker to be matched")

    r = gpudctl(cluster, "openstack", "retire", name)
    assert r.returncode == 0 and "drains it, then deletes its server" in " ".join(r.stdout.split()), r.stderr
    r = gpudctl(cluster, "openstack", "retire", name)
    assert r.returncode == 1 and "one action per worker" in r.stderr
    wait_for(lambda: sid not in cloud.names(), "the retired server to be deleted", timeout=60)
    cluster.kill_worker(name)  # its VM is gone
    retire = next(a for a in openstack(cluster, "actions")["actions"] if a["kind"] == "retire")
    wait_for(lambda: action(cluster, retire["id"])["outcome"] == "done", "the retire")
    log = cluster.log_tail("broker", 400)
    assert f"admin openstack action=retire worker={name} by" in log and "openstack: action" in log


def test_a_killed_worker_is_rebooted_then_replaced(cloud: Cloud, cluster: LocalCluster) -> None:
    ids = cloud.ids  # type: ignore[attr-defined]
    old = ids["gpu-1"]
    cluster.kill_worker("w1", signal.SIGKILL)
    cloud.user.servers.stop(old)  # the VM died with it: Nova shows it SHUTOFF
    reboot = wait_for(lambda: next((a for a in openstack(cluster, "actions")["actions"]
                                    if a["server_id"] == old), None), "healing to start", timeout=60)
    assert reboot["reason"].startswith("heal: no worker for") and "SHUTOFF" in reboot["reason"]
    # Rebooted (Nova's own action log says so; the server is ACTIVE again) but its worker stays
    # dead: replaced, deleting it first.
    wait_for(lambda: old not in cloud.names() or "reboot" in cloud.actions(old), "the reboot", timeout=60)
    wait_for(lambda: old not in cloud.names(), "the dead server to be deleted", timeout=60)
    new = wait_for(lambda: action(cluster, reboot["id"])["new_server_id"], "the replacement boot", timeout=60)
    assert action(cluster, reboot["id"])["kind"] == "replace"
    wait_for(lambda: cloud.status(new) == "ACTIVE", "the replacement server", timeout=60)
    play_cloud_init(cloud, cluster, new)
    done = wait_for(lambda: (a := action(cluster, reboot["id"]))["outcome"] != "running" and a, "the replacement",
                    timeout=60)
    assert done["outcome"] == "done" and "replaced by" in done["message"], done
    assert "not back" in done["reason"]
    human = gpudctl(cluster, "openstack", "actions")
    assert human.returncode == 0 and "replace" in human.stdout and all(len(x) <= 80 for x in human.stdout.splitlines())


def test_scaling_boots_up_to_min_workers_recognised_by_tags(cloud: Cloud) -> None:
    """A second pool in the same project, told apart by a tag and its own metadata: the scaler
    boots servers until min_workers have one, and a server that Nova cannot place (more GPUs than
    the host has) fails its boot with Nova's answer."""
    pool = {"gpud:pool": "scale"}
    args = cloud.broker_args("scale", worker_metadata=pool, worker_tags=["gpu-pool"], brokers=["tcp://127.0.0.1:5556"],
                             scale=True, min_workers=1, max_workers=2, name_prefix="gpud-scale")
    # A server with the metadata but not the tag is not this pool's.
    untagged = cloud.boot("scale-untagged", cloud.flavor(FLAVOR, {}), pool)
    with LocalCluster(workers=0, heartbeat_ms=300, liveness=3, broker_args=args, env=cloud.daemon_env()) as c:
        booted = wait_for(lambda: next((a for a in openstack(c, "actions")["actions"] if a["kind"] == "boot"), None),
                          "the scaler to boot", timeout=60)
        assert "scale" in booted["reason"] and "min_workers" in booted["reason"], booted
        sid = wait_for(lambda: action(c, booted["id"])["new_server_id"], "the boot's server", timeout=60)
        wait_for(lambda: cloud.status(sid) == "ACTIVE", "the scaled server to go ACTIVE", timeout=60)
        server = cloud.admin.servers.get(sid)
        assert server.name.startswith("gpud-scale-") and server.metadata.get("gpud:pool") == "scale"
        assert "gpu-pool" in cloud.admin.servers.tag_list(sid)
        name = play_cloud_init(cloud, c, sid)
        wait_for(lambda: action(c, booted["id"])["outcome"] == "done", "the scaled worker to be matched")
        view = openstack(c, "list")
        assert [s["id"] for s in view["servers"]] == [sid] and untagged not in {s["id"] for s in view["servers"]}
        assert view["servers"][0]["worker"] == name
        # One pool member is enough: no second boot.
        assert [a["kind"] for a in openstack(c, "actions")["actions"]].count("boot") == 1

    # More GPUs than the compute host has (GPUS): Nova's scheduler finds no valid host.
    big = cloud.flavor("g9.gpu", {"pci_passthrough:alias": f"{ALIAS}:{GPUS + 1}"})
    s = cloud.user.servers.create("too-big", image=cloud.image, flavor=big, nics=[{"net-id": cloud.network}])
    wait_for(lambda: cloud.status(s.id) == "ERROR", "the unschedulable server to fail")
    assert "No valid host" in cloud.admin.servers.get(s.id).fault["message"]
