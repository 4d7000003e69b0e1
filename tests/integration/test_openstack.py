"""OpenStack end to end against real Nova: a real broker and workers (LocalCluster) with
``[openstack]`` on, talking through python-novaclient and keystoneauth1 to nova-api, whose real
conductor, scheduler and compute services (a fake virt driver with two NVIDIA PCI devices) and
placement run on 127.0.0.1 (tests/realnova), and gpudctl.

The broker's credentials are an operator's: a clouds.yaml cloud (``auth_type: admin_token``,
``auth: {endpoint, token}``) named by ``[openstack] cloud``; the image and network are given by id
(such a cloud has no catalog). gpud's Nova client is also run with a password, in OS_* and in
clouds.yaml, through real Keystone, its catalog's Image and Network services finding the image and
network by name.

The test plays cloud-init: when the broker boots a server, the test reads the server's user data
from Nova (as admin) and starts the worker it names, with that server's id, as the VM would. The
healing test kills a worker (SIGKILL) and stops its server through Nova: the broker reboots it, and
replaces it when the worker does not come back. Faults real Nova cannot be made to show on demand
(429, 5xx, slow answers) are tested against tests/compute_api.py in tests/unit.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpud_cli.cluster import LocalCluster, admin_call
from tests.realnova import ALIAS, GPUS, RealNova
from tests.realnova.fixture import real_nova  # noqa: F401 (the fixture)
from tests.waiting import wait_for

# The first test starts Nova: from nothing (no database template yet, a fresh machine) that is a
# minute or two of migrations on a loaded machine.
pytestmark = pytest.mark.timeout(600)

GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]
WORKER = {"gpud:role": "worker"}
FLAVOR = "g1.gpu"


class Cloud:
    """Real Nova as the tests use it: an admin client, the project's user client, its servers."""

    def __init__(self, nova: RealNova, tmp: Path) -> None:
        self.nova = nova
        self.admin = nova.admin()
        self.user = nova.client(nova.user_token())
        self.image = next(iter(nova.images))
        self.network = next(i for i, name in nova.networks.items() if name == "private")
        self.clouds_yaml = tmp / "clouds.yaml"
        self.clouds_yaml.write_text(yaml.safe_dump({"clouds": {"gpu": {
            "auth_type": "admin_token", "auth": {"endpoint": nova.url, "token": nova.user_token()}}}}))

    def flavor(self, name: str, specs: dict[str, str]) -> str:
        found = [f for f in self.admin.flavors.list(is_public=None) if f.name == name]
        f = found[0] if found else self.admin.flavors.create(name, 1024, 1, 10)
        f.set_keys(specs)
        return str(f.id)

    def boot(self, name: str, flavor: str, metadata: dict[str, str] | None = None, tags: list[str] | None = None) -> str:
        s = self.user.servers.create(name, image=self.image, flavor=flavor, meta=metadata or {},
                                     nics=[{"net-id": self.network}], tags=tags)
        wait_for(lambda: self.status(s.id) == "ACTIVE", f"server {name} to go ACTIVE", timeout=60)
        return str(s.id)

    def servers(self) -> dict[str, Any]:
        """Every server of the project, by id, as Nova lists it to an admin."""
        return {s.id: s for s in self.admin.servers.list(search_opts={"all_tenants": True})}

    def names(self) -> dict[str, str]:
        return {i: s.name for i, s in self.servers().items()}

    def status(self, sid: str) -> str | None:
        s = self.servers().get(sid)
        return None if s is None else str(s.status)

    def actions(self, sid: str) -> list[str]:
        return [a.action for a in self.admin.instance_action.list(sid)]

    def user_data(self, sid: str) -> str:
        raw = getattr(self.admin.servers.get(sid), "OS-EXT-SRV-ATTR:user_data")
        return base64.b64decode(raw).decode()

    def env(self) -> dict[str, str]:
        return {"OS_CLIENT_CONFIG_FILE": str(self.clouds_yaml), "GPUD_OPENSTACK_CLOUD": "gpu",
                "GPUD_OPENSTACK_ENABLED": "true", "GPUD_OPENSTACK_IMAGE": self.image,
                "GPUD_OPENSTACK_NETWORK": self.network, "GPUD_OPENSTACK_FLAVOR": FLAVOR,
                "GPUD_OPENSTACK_POLL_INTERVAL": "0.2", "GPUD_OPENSTACK_API_RETRIES": "1"}


@pytest.fixture(scope="module")
def cloud(real_nova: RealNova, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:  # noqa: F811
    c = Cloud(real_nova, tmp_path_factory.mktemp("openstack"))
    gpu = c.flavor(FLAVOR, {"pci_passthrough:alias": f"{ALIAS}:1"})
    plain = c.flavor("m1.small", {})
    c.ids = {n: c.boot(n, gpu, WORKER) for n in ("gpu-0", "gpu-1", "gpu-lonely")}  # type: ignore[attr-defined]
    c.ids["web-1"] = c.boot("web-1", plain, {"role": "web"})  # type: ignore[attr-defined]
    yield c
    for sid in c.servers():
        c.admin.servers.delete(sid)


@pytest.fixture(scope="module")
def cluster(cloud: Cloud) -> Iterator[LocalCluster]:
    env = {
        **cloud.env(),
        "GPUD_OPENSTACK_BROKERS": "tcp://127.0.0.1:5556",
        "GPUD_OPENSTACK_MAX_WORKERS": "5",
        "GPUD_OPENSTACK_HEAL": "true",
        "GPUD_OPENSTACK_HEAL_AFTER": "0.5",
        "GPUD_OPENSTACK_REBOOT_TIMEOUT": "3",
        "GPUD_OPENSTACK_RETIRE_TIMEOUT": "5",
    }
    # Short heartbeats (a killed worker is gone after 0.9 s); healing acts only on servers that Nova
    # shows ERROR or SHUTOFF, so a worker a loaded machine loses for a moment triggers nothing.
    with LocalCluster(workers=0, heartbeat_ms=300, liveness=3, env=env) as c:
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
    # Nova scheduled it on the GPU host (the PCI alias of the flavor), with gpud's metadata.
    wait_for(lambda: cloud.status(sid) == "ACTIVE", "the new server to go ACTIVE")
    server = cloud.admin.servers.get(sid)
    assert server.metadata.get("gpud:role") == "worker" and getattr(server, "OS-EXT-SRV-ATTR:host") == "compute-1"
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
    env = {**cloud.env(), "GPUD_OPENSTACK_WORKER_METADATA": "gpud:pool=scale", "GPUD_OPENSTACK_WORKER_TAGS": "gpu-pool",
           "GPUD_OPENSTACK_BROKERS": "tcp://127.0.0.1:5556", "GPUD_OPENSTACK_SCALE": "true",
           "GPUD_OPENSTACK_MIN_WORKERS": "1", "GPUD_OPENSTACK_MAX_WORKERS": "2", "GPUD_OPENSTACK_NAME_PREFIX": "gpud-scale"}
    # A server with the metadata but not the tag is not this pool's.
    untagged = cloud.boot("scale-untagged", cloud.flavor(FLAVOR, {"pci_passthrough:alias": f"{ALIAS}:1"}), pool)
    with LocalCluster(workers=0, heartbeat_ms=300, liveness=3, env=env) as c:
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


def _config(**over: object) -> Any:
    import dataclasses

    from gpud.config import OpenStackConfig

    base = dict(enabled=True, flavor=FLAVOR, api_timeout=30.0, api_retries=1)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


@pytest.mark.parametrize("source", ["os_env", "clouds_yaml"])
def test_keystone_credentials_and_look_ups_by_name(cloud: Cloud, tmp_path: Path, source: str) -> None:
    """What an operator configures: a password in OS_* (an openrc) or a clouds.yaml cloud, real
    Keystone issuing the token and the catalog, the image and network by name (found through the
    catalog's Image and Network services). gpud's Nova boots a server that Nova schedules by the
    flavor's PCI alias, lists it as a worker, reboots it and deletes it."""
    from gpud_broker.openstack.nova import Nova, NovaError

    nova = cloud.nova
    env = nova.os_env()
    image = "fakeimage7"
    assert list(nova.images.values()).count(image) == 1
    if source == "os_env":
        make = lambda **over: Nova(_config(**over), env, clouds_files=[])  # noqa: E731
    else:
        auth = {"auth_url": env["OS_AUTH_URL"], "username": "gpud", "password": env["OS_PASSWORD"], "project_name": "gpu",
                "user_domain_name": "Default", "project_domain_name": "Default"}
        (tmp_path / "clouds.yaml").write_text(yaml.safe_dump({"clouds": {"prod": {"auth": auth, "region_name": "RegionOne"}}}))
        make = lambda **over: Nova(_config(cloud="prod", **over), {}, clouds_files=[str(tmp_path / "clouds.yaml")])  # noqa: E731
    n = make(image=image, network="private", worker_tags=("gpu-kst",))
    s = n.boot(f"gpud-kst-{source}", "#cloud-config\n", {"gpud:role": "worker"}, ["gpu-kst"])
    try:
        wait_for(lambda: (g := n.get_server(s.id)) is not None and g.status == "ACTIVE", "the server to go ACTIVE", timeout=60)
        raw = cloud.admin.servers.get(s.id)
        assert raw.image["id"] == next(i for i, name in nova.images.items() if name == image)
        assert cloud.network in {p.net_id for p in cloud.admin.servers.interface_list(s.id)}
        assert raw.tenant_id == nova.keystone_project  # Keystone's project, not the test's
        listed = n.list_servers()
        assert [x.id for x in listed] == [s.id] and listed[0].pci_alias == f"{ALIAS}:1"
        n.reboot(s.id)
        wait_for(lambda: "reboot" in cloud.actions(s.id), "Nova to record the reboot")
        wait_for(lambda: (g := n.get_server(s.id)) is not None and g.status == "ACTIVE", "the reboot", timeout=60)
    finally:
        assert n.delete(s.id) is True
    wait_for(lambda: n.get_server(s.id) is None, "the server to be deleted", timeout=60)
    # A name that more than one image has is refused with a clear message, not guessed.
    with pytest.raises(NovaError, match="fakeimage123456") as exc:
        make(image="fakeimage123456").boot("gpud-kst-ambiguous", "", {}, [])
    assert exc.value.kind == "config"
    # Wrong password: Keystone refuses, and gpud says so.
    bad = {**env, "OS_PASSWORD": "wrong"}
    with pytest.raises(NovaError) as exc:
        Nova(_config(), bad, clouds_files=[]).list_servers()
    assert exc.value.kind == "auth", exc.value.message
