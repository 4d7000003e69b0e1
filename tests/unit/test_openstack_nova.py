"""gpud_broker.openstack.nova, the real python-novaclient and keystoneauth1 over HTTP, against the
fault server (tests/compute_api.py): what real Nova cannot be made to show on demand. Nova's errors
(401 on a revoked token, 403, 409, 413, 5xx, 400) as kinds, retried with backoff only where a retry
may help, 429 after its Retry-After, timeouts, a boot whose answer was lost, a list sent while a
boot's image look-up is held, an unreachable cloud. Also the worker's ``instance_id = "auto"``
against the same server's metadata endpoint (404, a bad or slow answer).

Listing, boot, reboot, delete, credentials and look-ups against real Nova and Keystone:
tests/integration/test_openstack_nova.py.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
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
from openstack_harness import Waits  # noqa: E402

WORKER = {"gpud:role": "worker"}


@pytest.fixture()
def api() -> Iterator[ComputeAPI]:
    with ComputeAPI() as cloud:
        cloud.add_flavor("g2.a100x2", {"pci_passthrough:alias": "a100:2"})
        cloud.add_image("ubuntu-gpu")
        yield cloud


def cfg(**over: object) -> OpenStackConfig:
    base = dict(enabled=True, image="ubuntu-gpu", flavor="g2.a100x2", api_timeout=5.0, api_retries=2)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


def nova(api: ComputeAPI, waits: Waits | None = None, **over: object) -> Nova:
    return Nova(cfg(**over), api.auth_env(), clouds_files=[], wait=waits or Waits())


def test_a_list_during_a_boot_s_image_look_up_goes_to_nova(api: ComputeAPI) -> None:
    """novaclient switches a client to the image service during the look-up: each thread has its own."""
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


def test_nova_answering_401_is_authenticated_again_once(api: ComputeAPI) -> None:
    """Nova itself answering 401 (a token revoked under the client): keystoneauth1 authenticates
    again once; a second 401 is the error, not retried."""
    waits = Waits()
    n = nova(api, waits)
    api.fail("GET", r"/servers/detail", 401, "The request you have made requires authentication.", times=1)
    assert n.list_servers() == [] and api.count("POST", r"/identity/v3/auth/tokens") == 2
    api.fail("GET", r"/servers/detail", 401, "The request you have made requires authentication.", times=2)
    with pytest.raises(NovaError, match="credentials refused") as e:
        n.list_servers()
    assert e.value.kind == "auth" and e.value.status == 401 and waits.delays == []


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


def test_over_quota_413_is_not_retried(api: ComputeAPI) -> None:
    """Nova before Queens answered 413 when over quota (today's 403: the integration tests)."""
    api.fail("POST", r"/compute/v2.1/servers$", 413, "Quota exceeded for instances: Requested 1, but already used 0 "
                                                     "of 0 instances")
    waits = Waits()
    with pytest.raises(NovaError, match="Quota exceeded for instances") as e:
        nova(api, waits).boot("gpud-worker-q", "", WORKER, [])
    assert e.value.kind == "over_quota" and e.value.status == 413 and waits.delays == []
    assert api.names() == {}


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


def test_unreachable_cloud() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound and not listening: connections are refused
        env = {"OS_AUTH_URL": f"http://127.0.0.1:{port}/identity/v3", "OS_USERNAME": "gpud", "OS_PASSWORD": "x",
               "OS_PROJECT_NAME": "gpu", "OS_USER_DOMAIN_NAME": "Default", "OS_PROJECT_DOMAIN_NAME": "Default"}
        waits = Waits()
        with pytest.raises(NovaError, match="cannot reach the cloud") as e:
            Nova(cfg(api_retries=1), env, clouds_files=[], wait=waits).list_servers()
    assert e.value.kind == "unreachable" and waits.delays == [1.0]


def test_server_info_reads_a_server_as_nova_lists_it() -> None:
    """A server of ``GET /servers/detail`` at microversion 2.61 (its flavor embedded with extra
    specs), as Nova's API reference shows it; and one listed without extra specs (an older policy),
    whose flavor's specs come from the flavor list."""
    raw = {"id": "5f0c", "name": "gpu-a", "status": "ACTIVE", "OS-EXT-STS:task_state": None,
           "OS-EXT-SRV-ATTR:host": "compute-1", "created": "2026-12-01T13:52:29Z", "metadata": {"gpud:role": "worker"},
           "tags": ["gpu"], "fault": {"code": 500, "message": "boom"},
           "addresses": {"private": [{"addr": "192.168.1.3", "version": 4, "OS-EXT-IPS:type": "fixed"},
                                     {"addr": "fd00::3", "version": 6, "OS-EXT-IPS:type": "fixed"}]},
           "flavor": {"original_name": "g2.a100x2", "vcpus": 8, "ram": 65536, "disk": 40,
                      "extra_specs": {"pci_passthrough:alias": "a100:2", "resources:VGPU": "1"}}}
    s = N.server_info(raw)
    assert (s.id, s.name, s.status, s.task_state, s.host, s.created) == ("5f0c", "gpu-a", "ACTIVE", "", "compute-1",
                                                                         "2026-12-01T13:52:29Z")
    assert s.addresses == ("192.168.1.3", "fd00::3") and s.metadata == {"gpud:role": "worker"} and s.tags == ("gpu",)
    assert (s.flavor, s.pci_alias, s.vgpu, s.fault) == ("g2.a100x2", "a100:2", "VGPU=1", "boom")
    bare = {**raw, "flavor": {"original_name": "g2.a100x2"}, "addresses": {}, "OS-EXT-SRV-ATTR:host": None}
    s = N.server_info(bare, {"g2.a100x2": {"pci_passthrough:alias": "a100:4"}})
    assert (s.pci_alias, s.vgpu, s.addresses, s.host) == ("a100:4", "", (), "")


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
