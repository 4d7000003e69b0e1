"""OpenStack end to end: a real broker and workers (LocalCluster) with ``[openstack]`` on, talking
through the real python-novaclient to the local Compute API (tests/compute_api.py), and gpudctl.

The test plays cloud-init: when the broker boots a server, the test starts a worker with that
server's instance id, as the user data would on a GPU VM. The healing test kills a worker
(SIGKILL) and shuts its server off: the broker reboots the server, and replaces it when the worker
does not come back.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compute_api import ComputeAPI  # noqa: E402

from tests.waiting import wait_for

GPUDCTL = [sys.executable, "-m", "gpud_client.ctl"]
WORKER = {"gpud:role": "worker"}


@pytest.fixture(scope="module")
def cloud() -> Iterator[ComputeAPI]:
    with ComputeAPI() as api:
        api.add_image("ubuntu-gpu")
        flavor = api.add_flavor("g1.a100", {"pci_passthrough:alias": "a100:1"})
        api.ids = {n: api.add_server(n, flavor, metadata=WORKER) for n in ("gpu-0", "gpu-1", "gpu-lonely")}  # type: ignore[attr-defined]
        yield api


@pytest.fixture(scope="module")
def cluster(cloud: ComputeAPI) -> Iterator[LocalCluster]:
    env = {
        **cloud.auth_env(),
        "GPUD_OPENSTACK_ENABLED": "true",
        "GPUD_OPENSTACK_IMAGE": "ubuntu-gpu",
        "GPUD_OPENSTACK_FLAVOR": "g1.a100",
        "GPUD_OPENSTACK_BROKERS": "tcp://127.0.0.1:5556",
        "GPUD_OPENSTACK_MAX_WORKERS": "5",
        "GPUD_OPENSTACK_HEAL": "true",
        "GPUD_OPENSTACK_HEAL_AFTER": "0.5",
        "GPUD_OPENSTACK_REBOOT_TIMEOUT": "2",
        "GPUD_OPENSTACK_POLL_INTERVAL": "0.2",
        "GPUD_OPENSTACK_API_RETRIES": "1",
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


def play_cloud_init(cloud: ComputeAPI, cluster: LocalCluster, server_id: str) -> str:
    """Start the worker that the user data of ``server_id`` would start; returns its name."""
    name = cloud.names()[server_id]
    data = cloud.servers[server_id].user_data
    assert f'name = "{name}"' in data and 'instance_id = "auto"' in data
    cluster.add_worker(name, ["--instance-id", server_id])
    return name


def test_list_matches_servers_and_workers_then_boot_and_retire(cloud: ComputeAPI, cluster: LocalCluster) -> None:
    ids = cloud.ids  # type: ignore[attr-defined]
    view = wait_for(lambda: (v := openstack(cluster, "list"))["listed_s"] is not None and v, "the first server list")
    rows = {s["name"]: s for s in view["servers"]}
    assert rows["gpu-0"]["worker"] == "w0" and rows["gpu-1"]["worker"] == "w1" and rows["gpu-lonely"]["worker"] == ""
    assert rows["gpu-0"]["pci_alias"] == "a100:1" and rows["gpu-0"]["status"] == "ACTIVE"
    assert [w["name"] for w in view["workers_without_server"]] == ["w-anon"]
    human = gpudctl(cluster, "openstack", "list")
    assert human.returncode == 0, human.stderr
    assert "NO WORKER" in human.stdout and "w-anon" in human.stdout
    assert all(len(line) <= 80 for line in human.stdout.splitlines())

    booted = gpudctl(cluster, "openstack", "boot", "1", "--json")
    assert booted.returncode == 0, booted.stderr
    boot = json.loads(booted.stdout)["actions"][0]
    sid = wait_for(lambda: next((i for i, n in cloud.names().items() if n == boot["new_server_name"]), None), "the boot")
    assert sid not in ids.values()
    name = play_cloud_init(cloud, cluster, sid)
    wait_for(lambda: action(cluster, boot["id"])["outcome"] == "done", "the new worker to be matched")

    r = gpudctl(cluster, "openstack", "retire", name)
    assert r.returncode == 0 and "drains it, then deletes its server" in " ".join(r.stdout.split()), r.stderr
    r = gpudctl(cluster, "openstack", "retire", name)
    assert r.returncode == 1 and "one action per worker" in r.stderr
    wait_for(lambda: sid not in cloud.names(), "the retired server to be deleted")
    cluster.kill_worker(name)  # its VM is gone
    retire = next(a for a in openstack(cluster, "actions")["actions"] if a["kind"] == "retire")
    wait_for(lambda: action(cluster, retire["id"])["outcome"] == "done", "the retire")
    assert gpudctl(cluster, "workers", "--json").returncode == 0
    log = cluster.log_tail("broker", 400)
    assert f"admin openstack action=retire worker={name} by" in log and "openstack: action" in log


def test_a_killed_worker_is_rebooted_then_replaced(cloud: ComputeAPI, cluster: LocalCluster) -> None:
    ids = cloud.ids  # type: ignore[attr-defined]
    old = ids["gpu-1"]
    cluster.kill_worker("w1", signal.SIGKILL)
    cloud.set_status(old, "SHUTOFF")
    reboot = wait_for(lambda: next((a for a in openstack(cluster, "actions")["actions"]
                                    if a["server_id"] == old), None), "healing to start")
    assert reboot["reason"].startswith("heal: no worker for") and "SHUTOFF" in reboot["reason"]
    # Rebooted (Nova shows it ACTIVE again) but its worker stays dead: replaced, deleting it first.
    wait_for(lambda: "reboot" in cloud.actions(old) or old not in cloud.names(), "the reboot")
    wait_for(lambda: old not in cloud.names(), "the dead server to be deleted")
    new = wait_for(lambda: action(cluster, reboot["id"])["new_server_id"], "the replacement boot")
    assert action(cluster, reboot["id"])["kind"] == "replace"
    wait_for(lambda: new in cloud.names(), "the replacement server")
    play_cloud_init(cloud, cluster, new)
    done = wait_for(lambda: (a := action(cluster, reboot["id"]))["outcome"] != "running" and a, "the replacement")
    assert done["outcome"] == "done" and "replaced by" in done["message"], done
    assert "not back" in done["reason"]
    human = gpudctl(cluster, "openstack", "actions")
    assert human.returncode == 0 and "replace" in human.stdout and all(len(x) <= 80 for x in human.stdout.splitlines())
