"""gpud_broker.openstack.nova against real Nova 34 (tests/realnova): the real python-novaclient and
keystoneauth1 over HTTP, with the credentials operators give (a password in OS_* or in clouds.yaml
with its secure.yaml, Keystone issuing the token and the catalog; a clouds.yaml cloud with
``auth_type: admin_token``, no catalog): listing with the flavor's PCI alias or vGPU, the server's
status, host and addresses; boot (Nova schedules the PCI-alias flavor, the server goes ACTIVE with
gpud's metadata, tags, key and user data), reboot, delete; the image and network by name, looked
up once, or by id, not looked up; and what Nova and Keystone refuse (a wrong password, a region
with no compute endpoint, an image or flavor that is not there, a project over its quota).

Faults real Nova cannot be made to show on demand (429, 5xx, 409, slow or lost answers) are in
tests/unit/test_openstack_nova.py, against tests/compute_api.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.config import OpenStackConfig
from gpud_broker.openstack.nova import Nova, NovaError
from tests.openstack_harness import Waits
from tests.realnova import ALIAS, RealNova
from tests.realnova.project import IMAGE, NETWORK, Project, wait_for

pytest_plugins = ["tests.realnova.fixture"]
pytestmark = pytest.mark.timeout(600)  # the first test of the session may start Nova

WORKER = {"gpud:role": "worker"}
GPU_FLAVOR = "g2.client"
VGPU_FLAVOR = "g1.client-vgpu"


@pytest.fixture(scope="module")
def cloud(real_nova: RealNova) -> Project:
    p = Project(real_nova, "gpu-client")
    p.flavor(GPU_FLAVOR, {"pci_passthrough:alias": f"{ALIAS}:2"})
    return p


@pytest.fixture()
def project(cloud: Project) -> Iterator[Project]:
    """The module's project, emptied of servers after each test."""
    yield cloud
    cloud.clear()


class Requests(logging.Handler):
    """The HTTP requests keystoneauth1 sends, as its debug log writes them: (method, URL)."""

    LINE = re.compile(r'^REQ: curl .*?-X (GET|POST|PUT|DELETE) "?([^" ]+)')

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self.LINE.match(record.getMessage())
        if m:
            self.seen.append((m[1], m[2]))

    def count(self, method: str, url: str) -> int:
        rx = re.compile(url)
        return sum(1 for m, u in self.seen if m == method and rx.search(u))


@pytest.fixture()
def sent() -> Iterator[Requests]:
    """What python-novaclient (its own logger) and keystoneauth1 (Keystone, the catalog's Image and
    Network services) send during the test."""
    handler = Requests()
    loggers = [logging.getLogger(name) for name in ("novaclient.v2.client", "keystoneauth.session")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    yield handler
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


def cfg(**over: object) -> OpenStackConfig:
    base = dict(enabled=True, image=IMAGE, flavor=GPU_FLAVOR, network=NETWORK, api_timeout=30.0, api_retries=2)
    return dataclasses.replace(OpenStackConfig(), **{**base, **over})  # type: ignore[arg-type]


def nova(project: Project, waits: Waits | None = None, **over: object) -> Nova:
    """gpud's Nova for ``project``, with the OS_* variables of an openrc (Keystone, password)."""
    return Nova(cfg(**over), project.env(), clouds_files=[], wait=waits or Waits())


def active(n: Nova, sid: str) -> bool:
    s = n.get_server(sid)
    return s is not None and s.status == "ACTIVE"


def test_list_shows_gpud_servers_with_their_gpus_status_host_and_addresses(project: Project,
                                                                             sent: Requests) -> None:
    gpu = project.flavor(GPU_FLAVOR, {})
    a = project.boot("gpu-a", gpu, WORKER)
    b = project.boot("gpu-b", project.flavor(VGPU_FLAVOR, {"resources:VGPU": "1"}), WORKER, tags=["gpu"])
    project.user.servers.stop(b)
    wait_for(lambda: project.status(b) == "SHUTOFF", "gpu-b to stop")
    project.boot("web-1", gpu, {"role": "web"})
    servers = {s.id: s for s in nova(project).list_servers()}
    assert set(servers) == {a, b}  # web-1 is not a gpud worker
    sa, sb = servers[a], servers[b]
    assert (sa.name, sa.status, sa.pci_alias, sa.flavor) == ("gpu-a", "ACTIVE", f"{ALIAS}:2", GPU_FLAVOR)
    # Nova's policy shows a server's host to its admins only: gpud, a member of the project, sees none.
    raw = project.admin.servers.get(a)
    assert sa.host == "" and getattr(raw, "OS-EXT-SRV-ATTR:host") == "compute-1"
    # As Nova gives them (none here: nova's NeutronFixture network has no subnet; the reading of
    # addresses is tests/unit/test_openstack_nova.py's).
    assert list(sa.addresses) == [x["addr"] for net in raw.addresses.values() for x in net]
    assert (sb.status, sb.vgpu, sb.pci_alias, sb.flavor) == ("SHUTOFF", "VGPU=1", "", VGPU_FLAVOR)
    # Tags narrow it further, on Nova's side.
    tagged = nova(project, worker_tags=("gpu",)).list_servers()
    assert [s.id for s in tagged] == [b]
    assert sent.count("GET", r"/servers/detail\?(.*&)?tags=gpu(&|$)") >= 1  # every page asked with it


@pytest.mark.parametrize("source", ["os_env", "clouds_yaml"])
def test_boot_then_list_reboot_and_delete(project: Project, sent: Requests, tmp_path: Path, source: str) -> None:
    """What an operator configures: a password in OS_* (an openrc), or a clouds.yaml cloud with
    the password in its secure.yaml; Keystone issues the token and the catalog, in whose Image and
    Network services the image and network are found by name."""
    if source == "os_env":
        n = Nova(cfg(key_name="ops"), project.env(), clouds_files=[], wait=Waits())
    else:
        clouds = project.clouds_yaml(tmp_path / "clouds.yaml", "lab", secure=True)
        n = Nova(cfg(cloud="lab", key_name="ops"), {}, clouds_files=[str(tmp_path / "absent.yaml"), str(clouds)], wait=Waits())
        assert "lab" in n.creds.source and str(clouds) in n.creds.source
    if "ops" not in {k.name for k in n.client.keypairs.list()}:
        n.client.keypairs.create("ops")  # the user's key pair, as `openstack keypair create` makes it
    s = n.boot(f"gpud-worker-{source}", "#cloud-config\nhostname: x\n", {**WORKER, "gpud:broker": "b1"}, ["gpu"])
    assert s.name == f"gpud-worker-{source}" and s.status in ("BUILD", "ACTIVE") and s.pci_alias == f"{ALIAS}:2"
    wait_for(lambda: active(n, s.id), "the server to go ACTIVE", timeout=60)
    raw = project.admin.servers.get(s.id)
    # Scheduled on the GPU host by the flavor's PCI alias, in Keystone's project, as gpud asked.
    assert getattr(raw, "OS-EXT-SRV-ATTR:host") == "compute-1" and raw.tenant_id == project.id
    assert raw.metadata == {**WORKER, "gpud:broker": "b1"} and project.admin.servers.tag_list(s.id) == ["gpu"]
    assert raw.key_name == "ops" and project.user_data(s.id) == "#cloud-config\nhostname: x\n"
    assert raw.image["id"] == project.image  # found by name through the Image service
    assert {p.net_id for p in project.admin.servers.interface_list(s.id)} == {project.network}
    listed = n.list_servers()
    assert [x.id for x in listed] == [s.id] and listed[0].status == "ACTIVE"
    n.reboot(s.id)
    wait_for(lambda: "reboot" in project.actions(s.id), "Nova to record the reboot")
    wait_for(lambda: active(n, s.id), "the reboot", timeout=60)
    assert n.delete(s.id) is True
    wait_for(lambda: n.get_server(s.id) is None, "the server to be deleted", timeout=60)
    assert n.list_servers() == []
    assert n.delete(s.id) is False  # already gone: not an error
    # The image, flavor and network were looked up once, not per boot.
    n.boot(f"gpud-worker-{source}-2", "", WORKER, [])
    assert sent.count("GET", r"/v2/images\?name=") == 1 and sent.count("GET", r"/v2\.0/networks\?name=") == 1


def test_an_image_and_network_given_by_id_are_not_looked_up(project: Project, sent: Requests, tmp_path: Path) -> None:
    """An id is used as it is: a cloud with no catalog (``auth_type: admin_token``, a token
    straight to Nova) still boots."""
    clouds = project.admin_token_yaml(tmp_path / "clouds.yaml", "direct")
    n = Nova(cfg(cloud="direct", image=project.image, network=project.network), {}, clouds_files=[str(clouds)])
    s = n.boot("gpud-worker-id0001", "", WORKER, [])
    wait_for(lambda: active(n, s.id), "the server to go ACTIVE", timeout=60)
    raw = project.admin.servers.get(s.id)
    assert raw.image["id"] == project.image and raw.tenant_id == project.id
    assert {p.net_id for p in project.admin.servers.interface_list(s.id)} == {project.network}
    assert [x.id for x in n.list_servers()] == [s.id]
    assert sent.count("GET", r"/v2/images") == 0 and sent.count("GET", r"/v2\.0/networks") == 0
    # A name still is looked up (in Keystone's catalog).
    nova(project, image=project.image, network=NETWORK).boot("gpud-worker-id0002", "", WORKER, [])
    assert sent.count("GET", r"/v2\.0/networks\?name=") == 1 and sent.count("GET", r"/v2/images") == 0


def test_reboot_brings_a_shutoff_server_back(project: Project) -> None:
    sid = project.boot("gpu-a", project.flavor(GPU_FLAVOR, {}), WORKER)
    project.user.servers.stop(sid)
    wait_for(lambda: project.status(sid) == "SHUTOFF", "the server to stop")
    nova(project).reboot(sid)
    wait_for(lambda: project.status(sid) == "ACTIVE", "the reboot to bring it back", timeout=60)
    assert project.actions(sid) == ["create", "stop", "reboot"]
    with pytest.raises(NovaError) as e:
        nova(project).reboot("no-such-server")
    assert e.value.kind == "not_found" and "404" in e.value.message


def test_missing_or_wrong_credentials_are_clear_and_not_retried(project: Project, tmp_path: Path) -> None:
    with pytest.raises(NovaError, match="set \\[openstack\\] cloud .* or the OS_\\* variables") as e:
        Nova(cfg(), {}, clouds_files=[])
    assert e.value.kind == "config"
    clouds = project.clouds_yaml(tmp_path / "clouds.yaml", "lab")
    with pytest.raises(NovaError, match="no cloud 'other' in .*clouds.yaml") as e:
        Nova(cfg(cloud="other"), {}, clouds_files=[str(clouds)])
    assert e.value.kind == "config"
    waits = Waits()
    n = Nova(cfg(), {**project.env(), "OS_PASSWORD": "wrong"}, clouds_files=[], wait=waits)
    with pytest.raises(NovaError, match="Keystone refused the credentials") as e:
        n.list_servers()
    assert e.value.kind == "auth" and e.value.status == 401 and waits.delays == []


def test_a_wrong_region_says_there_is_no_compute_endpoint(project: Project) -> None:
    with pytest.raises(NovaError, match="no compute endpoint in the catalog") as e:
        nova(project, region="Elsewhere").list_servers()
    assert e.value.kind == "config"


def test_boot_needs_an_image_and_flavor_that_are_there(project: Project) -> None:
    with pytest.raises(NovaError, match="\\[openstack\\] image is not set"):
        nova(project, image="").boot("x", "", WORKER, [])
    with pytest.raises(NovaError, match="flavor 'g9': no flavor of that name"):
        nova(project, flavor="g9").boot("x", "", WORKER, [])
    with pytest.raises(NovaError, match="No Image matching nope") as e:
        nova(project, image="nope").boot("x", "", WORKER, [])
    assert e.value.kind == "not_found"
    # A name that more than one image has is refused with a clear message, not guessed.
    assert list(project.nova.images.values()).count("fakeimage123456") > 1
    with pytest.raises(NovaError, match="fakeimage123456") as e:
        nova(project, image="fakeimage123456").boot("x", "", WORKER, [])
    assert e.value.kind == "config"
    assert project.servers() == {}


def test_over_quota_is_refused_and_not_retried(cloud: Project) -> None:
    """A project whose instances quota (set by Nova's admin, checked with Keystone) is used up:
    Nova answers 403 "Quota exceeded"; gpud does not retry."""
    full = Project(cloud.nova, "gpu-quota")
    cloud.nova.keystone_admin().quotas.update(full.id, instances=0)
    waits = Waits()
    with pytest.raises(NovaError, match="Quota exceeded for instances") as e:
        nova(full, waits).boot("gpud-worker-q", "", WORKER, [])
    assert e.value.kind == "over_quota" and e.value.status == 403 and waits.delays == []
    assert full.servers() == {}
