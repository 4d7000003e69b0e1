"""A Keystone project of the session's real Nova as a test module uses it: its own servers (so
that what gpud lists there is only that module's), booted and inspected through python-novaclient
as its member and as Nova's admin; the image and network every test boots with; the OS_* variables
and clouds.yaml clouds an operator would write for it. Runs in gpud's venv (python-novaclient),
against the services that tests/realnova starts."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests import waiting
from tests.realnova import REGION, RealNova

IMAGE = "fakeimage7"  # a name one image of nova's GlanceFixture has
NETWORK = "private"  # a name one network of its NeutronFixture has
POLL_S = 0.2  # between two questions to Nova while waiting: nova-api and the services share one process


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """tests.waiting.wait_for, asking less often: what ``pred`` asks Nova takes CPU from the
    services that are to make it true."""
    return waiting.wait_for(pred, what, timeout, interval=POLL_S)


class Project:
    def __init__(self, nova: RealNova, name: str) -> None:
        self.nova = nova
        self.name = name
        self.id = nova.add_project(name)
        self.admin = nova.admin()
        self.user = nova.client(nova.user_token(self.id))  # a member of the project, no Keystone round trip
        self.image = next(i for i, n in nova.images.items() if n == IMAGE)
        self.network = next(i for i, n in nova.networks.items() if n == NETWORK)

    # ------------------------------------------------------------------ credentials

    def env(self) -> dict[str, str]:
        """The OS_* variables (an openrc) of user gpud in this project: Keystone, password."""
        return self.nova.os_env(self.name)

    def clouds_yaml(self, path: Path, cloud: str, secure: bool = False) -> Path:
        """A clouds.yaml with cloud ``cloud`` for this project (Keystone, password; with ``secure``
        the password in the secure.yaml next to it), as an operator writes it."""
        env = self.env()
        auth: dict[str, str] = {"auth_url": env["OS_AUTH_URL"], "username": env["OS_USERNAME"], "project_name": self.name,
                                "user_domain_name": "Default", "project_domain_name": "Default"}
        if secure:
            (path.parent / "secure.yaml").write_text(yaml.safe_dump({"clouds": {cloud: {"auth": {"password": env["OS_PASSWORD"]}}}}))
        else:
            auth["password"] = env["OS_PASSWORD"]
        path.write_text(yaml.safe_dump({"clouds": {cloud: {"auth": auth, "region_name": REGION}}}))
        return path

    def admin_token_yaml(self, path: Path, cloud: str) -> Path:
        """A clouds.yaml cloud with ``auth_type: admin_token`` (``auth: {endpoint, token}``): a token
        straight to Nova, a member of this project, no Keystone and no catalog."""
        path.write_text(yaml.safe_dump({"clouds": {cloud: {"auth_type": "admin_token", "auth": {
            "endpoint": self.nova.url, "token": self.nova.user_token(self.id)}}}}))
        return path

    # ------------------------------------------------------------------ servers

    def flavor(self, name: str, specs: dict[str, str], ram: int = 512) -> str:
        """Flavor ``name`` (made once; flavors are Nova's, not a project's) with extra specs ``specs``."""
        found = [f for f in self.admin.flavors.list(is_public=None) if f.name == name]
        f = found[0] if found else self.admin.flavors.create(name, ram, 1, 10)
        if specs:
            f.set_keys(specs)
        return str(f.id)

    def boot(self, name: str, flavor: str, metadata: dict[str, str] | None = None, tags: list[str] | None = None,
             status: str = "ACTIVE") -> str:
        """A server booted as the project's member; returns once Nova shows it ``status``."""
        s = self.user.servers.create(name, image=self.image, flavor=flavor, meta=metadata or {},
                                     nics=[{"net-id": self.network}], tags=tags)
        wait_for(lambda: self.status(s.id) == status, f"server {name} to go {status}")
        return str(s.id)

    def servers(self) -> dict[str, Any]:
        """Every server of the project, by id, as Nova lists it to its admin."""
        return {s.id: s for s in self.admin.servers.list(search_opts={"all_tenants": True, "project_id": self.id})}

    def names(self) -> dict[str, str]:
        return {i: s.name for i, s in self.servers().items()}

    def status(self, sid: str) -> str | None:
        """What Nova says the server's status is; None once it is gone."""
        from novaclient import exceptions as nc

        try:
            return str(self.admin.servers.get(sid).status)
        except nc.NotFound:
            return None

    def actions(self, sid: str) -> list[str]:
        """Nova's instance action log of the server, oldest first: Nova lists it newest first by
        (created_at, id), and its times have whole seconds, so two actions in one second are told
        apart only by that order (sorting by start_time put a stop before its create)."""
        return [a.action for a in reversed(self.admin.instance_action.list(sid))]

    def user_data(self, sid: str) -> str:
        raw = getattr(self.admin.servers.get(sid), "OS-EXT-SRV-ATTR:user_data")
        return base64.b64decode(raw).decode()

    def clear(self) -> None:
        """Delete every server of the project, and wait until Nova lists none."""
        for sid in self.servers():
            self.admin.servers.delete(sid)
        wait_for(lambda: not self.servers(), f"the servers of project {self.name} to be deleted")
