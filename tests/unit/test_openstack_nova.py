"""gpud_broker.openstack.nova: the real python-novaclient and keystoneauth1 over HTTP against the
local Compute API (tests/compute_api.py): credentials from OS_* variables and clouds.yaml, listing
with the flavor's PCI alias, boot then list then delete, Nova's errors as clear messages, retries
with backoff, timeouts, and a boot whose answer was lost. Also the worker's ``instance_id = "auto"``
against the same server's metadata endpoint.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import OpenStackConfig
from gpud_broker.openstack import nova as N
from gpud_broker.openstack.nova import Nova, NovaError
from gpud_worker import instance

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compute_api import ComputeAPI  # noqa: E402

GPU = {"pci_passthrough:alias": "a100:2"}
WORKER = {"gpud:role": "worker"}


@pytest.fixture()
def api() -> Iterator[ComputeAPI]:
    with ComputeAPI() as cloud:
        cloud.add_flavor("g2.a100x2", GPU)
        cloud.add_flavor("g1.vgpu", {"resources:VGPU": "1"})
        cloud.add_image("ubuntu-gpu")
        cloud.add_network("gpu-net")
        yield cloud


def flavor(api: ComputeAPI, name: str = "g2.a100x2") -> str:
    return str(next(f["id"] for f in api.flavors.values() if f["name"] == name))


class Waits:
    """Records the retry delays instead of sleeping them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.delays.append(seconds)
        return False


def cfg(**over: object) -> OpenStackConfig:
    base = dict(enabled=True, image="ubuntu-gpu", flavor="g2.a100x2", network="gpu-net", api_timeout=5.0, api_retries=2)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


def nova(api: ComputeAPI, waits: Waits | None = None, **over: object) -> Nova:
    return Nova(cfg(**over), api.auth_env(), clouds_files=[], wait=waits or Waits())


def test_list_shows_gpud_servers_with_their_gpus_status_host_and_addresses(api: ComputeAPI) -> None:
    a = api.add_server("gpu-a", flavor(api), metadata=WORKER)
    b = api.add_server("gpu-b", flavor(api, "g1.vgpu"), status="SHUTOFF", metadata=WORKER, tags=["gpu"])
    api.add_server("web-1", flavor(api), metadata={"role": "web"})
    servers = {s.id: s for s in nova(api).list_servers()}
    assert set(servers) == {a, b}  # web-1 is not a gpud worker
    sa, sb = servers[a], servers[b]
    assert (sa.name, sa.status, sa.pci_alias, sa.flavor, sa.host) == ("gpu-a", "ACTIVE", "a100:2", "g2.a100x2", "compute-1")
    assert sa.addresses and sa.addresses[0].startswith("10.0.0.")
    assert (sb.status, sb.vgpu, sb.pci_alias) == ("SHUTOFF", "VGPU=1", "")
    # Tags narrow it further, on Nova's side.
    tagged = nova(api, worker_tags=("gpu",)).list_servers()
    assert [s.id for s in tagged] == [b]
    assert any("tags=gpu" in p for m, p in api.requests if m == "GET" and "/servers/detail" in p)


def test_boot_then_list_then_delete(api: ComputeAPI) -> None:
    n = nova(api, key_name="ops")
    s = n.boot("gpud-worker-abc123", "#cloud-config\nhostname: x\n", {**WORKER, "gpud:broker": "b1"}, ["gpu"])
    assert s.name == "gpud-worker-abc123" and s.status == "ACTIVE" and s.pci_alias == "a100:2"
    stored = api.servers[s.id]
    assert stored.metadata == {**WORKER, "gpud:broker": "b1"} and stored.tags == ["gpu"] and stored.key_name == "ops"
    assert stored.user_data == "#cloud-config\nhostname: x\n" and stored.network == "gpu-net"
    assert api.images[stored.image_id] == "ubuntu-gpu"  # found by name through the image API
    assert [x.id for x in n.list_servers()] == [s.id]
    assert n.delete(s.id) is True
    assert n.list_servers() == [] and n.get_server(s.id) is None
    assert n.delete(s.id) is False  # already gone: not an error
    # The image, flavor and network were looked up once, not per boot.
    n.boot("gpud-worker-def456", "", WORKER, [])
    assert api.count("GET", r"/image/v2/images\?name=") == 1 and api.count("GET", r"/network/v2.0/networks") == 1


def test_an_image_and_network_given_by_id_are_not_looked_up(api: ComputeAPI) -> None:
    """An id is used as it is: a cloud whose catalog has no Image or Network service still boots."""
    image = next(iter(api.images))
    network = next(iter(api.networks))
    s = nova(api, image=image, network=network).boot("gpud-worker-id0001", "", WORKER, [])
    stored = api.servers[s.id]
    assert stored.image_id == image and stored.network == "gpu-net"
    assert api.count("GET", r"/image/") == 0 and api.count("GET", r"/network/") == 0
    # A name still is looked up.
    nova(api, network="gpu-net", image=image).boot("gpud-worker-id0002", "", WORKER, [])
    assert api.count("GET", r"/network/v2.0/networks") == 1 and api.count("GET", r"/image/") == 0


def test_a_list_during_a_boot_s_image_look_up_goes_to_nova(api: ComputeAPI) -> None:
    """novaclient switches a client to the image service during the look-up: each thread has its own."""
    import threading

    n = nova(api)
    api.slow("GET", r"/image/v2/images", 0.5)
    booted: list[object] = []
    t = threading.Thread(target=lambda: booted.append(n.boot("gpud-worker-img", "", WORKER, [])))
    t.start()
    deadline = time.monotonic() + 10
    while api.count("GET", r"/image/v2/images") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert n.list_servers() == []  # while the look-up is held: still Nova's server list
    t.join(10)
    assert len(booted) == 1 and api.count("GET", r"/image/servers") == 0


def test_reboot_brings_a_shutoff_server_back(api: ComputeAPI) -> None:
    api.reboot_s = 0.0
    sid = api.add_server("gpu-a", flavor(api), status="SHUTOFF", metadata=WORKER)
    nova(api).reboot(sid)
    assert api.status(sid) == "ACTIVE" and api.actions(sid) == ["reboot"]
    with pytest.raises(NovaError) as e:
        nova(api).reboot("no-such-server")
    assert e.value.kind == "not_found" and "404" in e.value.message


def test_credentials_from_clouds_yaml_with_secure_yaml(api: ComputeAPI, tmp_path: Path) -> None:
    (tmp_path / "clouds.yaml").write_text(
        f"clouds:\n  lab:\n    auth:\n      auth_url: {api.auth_url}\n      username: gpud\n"
        "      project_name: gpu\n      user_domain_name: Default\n      project_domain_name: Default\n"
        "    region_name: RegionOne\n")
    (tmp_path / "secure.yaml").write_text("clouds:\n  lab:\n    auth:\n      password: s3cret\n")
    n = Nova(cfg(cloud="lab"), {}, clouds_files=[str(tmp_path / "absent.yaml"), str(tmp_path / "clouds.yaml")])
    assert "lab" in n.creds.source and n.list_servers() == []
    with pytest.raises(NovaError, match="no cloud 'other' in .*clouds.yaml") as e:
        Nova(cfg(cloud="other"), {}, clouds_files=[str(tmp_path / "clouds.yaml")])
    assert e.value.kind == "config"


def test_missing_or_wrong_credentials_are_clear_and_not_retried(api: ComputeAPI) -> None:
    with pytest.raises(NovaError, match="set \\[openstack\\] cloud .* or the OS_\\* variables") as e:
        Nova(cfg(), {}, clouds_files=[])
    assert e.value.kind == "config"
    waits = Waits()
    n = Nova(cfg(), {**api.auth_env(), "OS_PASSWORD": "wrong"}, clouds_files=[], wait=waits)
    with pytest.raises(NovaError, match="Keystone refused the credentials") as e:
        n.list_servers()
    assert e.value.kind == "auth" and waits.delays == []
    # Nova itself answering 401 (a revoked token): keystoneauth1 authenticates again once; a
    # second 401 is the error.
    n = nova(api)
    api.fail("GET", r"/servers/detail", 401, "The request you have made requires authentication.", times=2)
    with pytest.raises(NovaError, match="credentials refused") as e:
        n.list_servers()
    assert e.value.kind == "auth" and e.value.status == 401


def test_a_wrong_region_says_there_is_no_compute_endpoint(api: ComputeAPI) -> None:
    with pytest.raises(NovaError, match="no compute endpoint in the catalog") as e:
        nova(api, region="Elsewhere").list_servers()
    assert e.value.kind == "config"


@pytest.mark.parametrize(("status", "kind", "retried"), [
    (403, "forbidden", False), (409, "conflict", True), (500, "server_error", True), (503, "server_error", True),
    (400, "bad_request", False),
])
def test_nova_errors_become_kinds_and_only_passing_ones_are_retried(api: ComputeAPI, status: int, kind: str,
                                                                    retried: bool) -> None:
    waits = Waits()
    n = nova(api, waits)
    api.fail("GET", r"/servers/detail", status, f"injected {status}", times=10)
    with pytest.raises(NovaError) as e:
        n.list_servers()
    assert e.value.kind == kind and e.value.status == status and f"injected {status}" in e.value.message
    assert "listing servers" in e.value.message
    assert waits.delays == ([1.0, 2.0] if retried else [])  # api_retries 2, backoff doubling
    assert api.count("GET", r"/servers/detail") == (3 if retried else 1)


def test_a_passing_error_is_retried_until_it_works(api: ComputeAPI) -> None:
    waits = Waits()
    api.fail("GET", r"/servers/detail", 503, "try later", times=1)
    assert nova(api, waits).list_servers() == []
    assert waits.delays == [1.0]


def test_over_quota_413_and_403_are_not_retried(api: ComputeAPI) -> None:
    api.max_servers = 0
    for quota_status in (413, 403):
        api.quota_status = quota_status
        waits = Waits()
        with pytest.raises(NovaError, match="Quota exceeded for instances") as e:
            nova(api, waits).boot("gpud-worker-q", "", WORKER, [])
        assert e.value.kind == "over_quota" and waits.delays == []
    assert api.servers == {}


def test_rate_limit_waits_for_retry_after(api: ComputeAPI) -> None:
    waits = Waits()
    api.fail("GET", r"/servers/detail", 429, "slow down", headers={"Retry-After": "7"})
    assert nova(api, waits).list_servers() == []
    assert waits.delays == [7.0]


def test_a_slow_nova_is_a_timeout_then_a_retry(api: ComputeAPI) -> None:
    waits = Waits()
    api.slow("GET", r"/servers/detail", 5.0)
    assert nova(api, waits, api_timeout=0.3).list_servers() == []
    assert waits.delays == [1.0]
    api.slow("GET", r"/servers/detail", 5.0, times=3)
    with pytest.raises(NovaError, match="no answer in time") as e:
        nova(api, Waits(), api_timeout=0.3).list_servers()
    assert e.value.kind == "timeout" and e.value.retryable


def test_a_boot_whose_answer_was_lost_is_adopted_not_booted_twice(api: ComputeAPI) -> None:
    api.slow("POST", r"/compute/v2.1/servers$", 3.0, after=True)
    n = nova(api, api_timeout=0.5)
    s = n.boot("gpud-worker-lost", "", WORKER, [])
    assert s.name == "gpud-worker-lost"
    assert list(api.names().values()) == ["gpud-worker-lost"]  # one server, not two
    assert api.count("POST", r"/compute/v2.1/servers$") == 1


def test_unreachable_cloud(api: ComputeAPI) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound and not listening: connections are refused
        env = {**api.auth_env(), "OS_AUTH_URL": f"http://127.0.0.1:{port}/identity/v3"}
        waits = Waits()
        with pytest.raises(NovaError, match="cannot reach the cloud") as e:
            Nova(cfg(api_retries=1), env, clouds_files=[], wait=waits).list_servers()
    assert e.value.kind == "unreachable" and waits.delays == [1.0]


def test_boot_needs_image_and_flavor(api: ComputeAPI) -> None:
    with pytest.raises(NovaError, match="\\[openstack\\] image is not set"):
        nova(api, image="").boot("x", "", WORKER, [])
    with pytest.raises(NovaError, match="flavor 'g9': no flavor of that name"):
        nova(api, flavor="g9").boot("x", "", WORKER, [])
    with pytest.raises(NovaError, match="No Image matching nope") as e:
        nova(api, image="nope").boot("x", "", WORKER, [])
    assert e.value.kind == "not_found"


def test_classify_keeps_retry_after_and_names_the_call() -> None:
    from novaclient import exceptions as nc

    err = N.classify(nc.RateLimit(429, "slow", retry_after="12"), "doing x")
    assert err.kind == "rate_limited" and err.retry_after == 12 and err.message.startswith("doing x: ")


# --------------------------------------------------------------------------- the worker's instance id


def test_worker_instance_id_auto_from_the_metadata_service(api: ComputeAPI) -> None:
    url = f"{api.url}/openstack/latest/meta_data.json"
    assert instance.resolve("1234-abcd", url) == "1234-abcd"  # given: no question asked
    assert instance.resolve("auto", url) == ""  # 404: unknown, and the worker starts anyway
    api.metadata_uuid = "5f0c0e0a-93a5-4c64-9d43-1a2b3c4d5e6f"
    assert instance.resolve("auto", url) == api.metadata_uuid
    api.metadata_uuid = "not a/uuid"
    assert instance.resolve("auto", url) == ""
    api.metadata_uuid = "5f0c0e0a-93a5-4c64-9d43-1a2b3c4d5e6f"
    api.slow("GET", r"/openstack/latest/meta_data\.json", 5.0)
    assert instance.resolve("auto", url, timeout=0.3) == ""  # gave up rather than wait for the good answer
