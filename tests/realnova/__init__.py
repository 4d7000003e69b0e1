"""Real OpenStack for the tests: nova 34, placement and keystone from PyPI (in .venv-nova, which
``make test`` makes), run as in a small deployment on 127.0.0.1 (see cloud.py for the processes).

``RealNova(state_dir).start()`` writes nova.conf, api-paste.ini, placement.conf and keystone.conf,
starts MariaDB, makes the databases with the operators' commands (``placement-manage db sync``,
``nova-manage api_db sync``, ``cell_v2 map_cell0``, ``cell_v2 create_cell``, ``db sync``,
``keystone-manage db_sync``, ``fernet_setup``, ``bootstrap``, each tool's in one process of its own:
manage.py; cached as a template in .venv-nova/db-template, keyed by the configuration, so later
runs copy them), starts keystone,
placement and nova, and registers compute, image and network in Keystone's catalog. Then:

- ``url``: the Compute API endpoint; ``token(user, project, roles)``: a token the paste filter in
  nova_parts.py accepts (``admin_token`` credentials: endpoint and token, as a clouds.yaml cloud
  with ``auth_type: admin_token`` says);
- ``add_project(name)``: a Keystone project with user ``gpud`` as its member; ``os_env(name)``: the
  OS_* variables (password) of ``gpud`` in it, whose tokens keystonemiddleware validates in nova
  (project.py: a project as a test module uses it);
- ``catalog``: the Image (``/v2/images``) and Network (``/v2.0/networks``) APIs over nova's
  GlanceFixture and NeutronFixture data; ``images`` and ``networks``: id -> name;
- ``admin()``: a python-novaclient client as admin (flavors, server state changes);
  ``keystone_admin()``: one with Keystone's admin token (a project's quota).

Nova's configuration: fifteen NVIDIA PCI devices on the one compute host (``[pci] device_spec``),
the alias ``gpu`` for them, PciPassthroughFilter on, quota defaults high (a project's own quota is
set through ``keystone_admin()``: ``os-quota-sets`` asks Keystone about the project), MariaDB
databases on a private socket (mariadb.py; sqlite locks).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.realnova.mariadb import MariaDB

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-nova"
PY = VENV / "bin" / "python"
CLOUD = Path(__file__).resolve().parent / "cloud.py"
MANAGE = CLOUD.with_name("manage.py")
ALIAS = "gpu"
GPUS = 15  # NVIDIA PCI devices on the compute host (nova_parts.GPU_ADDRESSES)
PCI_SPEC = {"vendor_id": "10de", "product_id": "20b5"}
ADMIN = "admin:admin:admin,member,reader"


class Unavailable(Exception):
    """No Nova to run (.venv-nova missing); the message says how to get it."""


NOVA_CONF = """\
[DEFAULT]
transport_url = fake://
compute_driver = gpu_fake.GpuFakeDriver
host = compute-1
state_path = {state}
instances_path = {state}/instances
log_dir = {state}/log
log_file = nova.log
debug = false
use_stderr = false
report_interval = 5
service_down_time = 60
periodic_enable = true
heal_instance_info_cache_interval = -1

[api]
auth_strategy = keystone

[wsgi]
api_paste_config = {state}/api-paste.ini

[api_database]
connection = {db_api}

[database]
connection = {db_cell1}

[placement]
auth_type = admin_token
endpoint = {placement}
token = admin

[pci]
device_spec = {spec}
alias = {alias}

[filter_scheduler]
enabled_filters = ComputeFilter,ComputeCapabilitiesFilter,ImagePropertiesFilter,PciPassthroughFilter

[scheduler]
discover_hosts_in_cells_interval = -1

[quota]
instances = 1000
cores = 100000
ram = 100000000
server_groups = 1000
server_group_members = 1000
key_pairs = 1000
metadata_items = 128

[oslo_concurrency]
lock_path = {state}/lock

[oslo_messaging_notifications]
driver = noop

[oslo_policy]
enforce_scope = true
enforce_new_defaults = true

[cinder]
os_region_name = RegionOne

[glance]
api_servers = http://127.0.0.1:9292

[os_vif_ovs]
ovsdb_connection = unix:/nonexistent

[keystone_authtoken]
www_authenticate_uri = {keystone}/v3
auth_url = {keystone}/v3
auth_type = password
username = admin
password = {admin_password}
project_name = admin
user_domain_name = Default
project_domain_name = Default
interface = public
"""

API_PASTE = """\
[composite:osapi_compute]
use = call:nova.api.openstack.urlmap:urlmap_factory
/: oscomputeversions
/v2.1: openstack_compute_api_v21

[pipeline:oscomputeversions]
pipeline = faultwrap request_log http_proxy_to_wsgi oscomputeversionapp

[app:oscomputeversionapp]
paste.app_factory = nova.api.openstack.compute.versions:Versions.factory

[pipeline:openstack_compute_api_v21]
pipeline = compute_req_id faultwrap request_log sizelimit http_proxy_to_wsgi tokenauth keystonecontext osapi_compute_app_v21

[app:osapi_compute_app_v21]
paste.app_factory = nova.api.openstack.compute:APIRouterV21.factory

[filter:compute_req_id]
paste.filter_factory = nova.api.compute_req_id:ComputeReqIdMiddleware.factory

[filter:faultwrap]
paste.filter_factory = nova.api.openstack:FaultWrapper.factory

[filter:request_log]
paste.filter_factory = nova.api.openstack.requestlog:RequestLog.factory

[filter:sizelimit]
paste.filter_factory = oslo_middleware:RequestBodySizeLimiter.factory

[filter:http_proxy_to_wsgi]
paste.filter_factory = oslo_middleware.http_proxy_to_wsgi:HTTPProxyToWSGI.factory

[filter:tokenauth]
paste.filter_factory = nova_parts:token_filter

[filter:keystonecontext]
paste.filter_factory = nova.api.auth:NovaKeystoneContext.factory
"""

PLACEMENT_CONF = """\
[DEFAULT]
debug = false
log_file = {state}/log/placement.log

[api]
auth_strategy = noauth2

[placement_database]
connection = {db_placement}
"""

KEYSTONE_CONF = """\
[DEFAULT]
log_file = {state}/log/keystone.log

[database]
connection = {db_keystone}

[token]
provider = fernet

[fernet_tokens]
key_repository = {state}/fernet-keys

[fernet_receipts]
key_repository = {state}/fernet-keys

[credential]
key_repository = {state}/credential-keys

[cache]
enabled = false
"""

DATABASES = ("nova_api", "nova_cell0", "nova_cell1", "placement", "keystone")
KEYS = ("fernet-keys", "credential-keys")
REGION = "RegionOne"
ADMIN_PASSWORD = "admin-secret"


def token(user: str, project: str, roles: str = "") -> str:
    return f"{user}:{project}" + (f":{roles}" if roles else "")


class RealNova:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.db = MariaDB(state / "mysql")
        self.url = self.catalog = self.project = self.keystone = ""
        self.user_password = "gpud-secret"
        self._gpud_user = ""
        self._keystone_admin: Any = None
        self.images: dict[str, str] = {}
        self.networks: dict[str, str] = {}

    # ------------------------------------------------------------------ set-up

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OS_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(OS_NOVA_DISABLE_EVENTLET_PATCHING="1", PYTHONPATH=str(CLOUD.parent))
        return env

    def _manage(self, module: str, commands: list[list[str]]) -> None:
        """The operator's commands of one tool (``module``'s main), in order, in one process."""
        r = subprocess.run([str(PY), str(MANAGE), module, json.dumps(commands)], capture_output=True, text=True,
                           timeout=300, env=self._env(), cwd=self.state)
        if r.returncode != 0:
            raise RuntimeError(f"{module} {commands} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-3000:]}")

    def _configure(self, placement: str, keystone: str = "http://127.0.0.1:0") -> None:
        (self.state / "log").mkdir(parents=True, exist_ok=True)
        (self.state / "lock").mkdir(exist_ok=True)
        spec = json.dumps(PCI_SPEC)
        alias = json.dumps({**PCI_SPEC, "device_type": "type-PCI", "name": ALIAS})
        (self.state / "nova.conf").write_text(NOVA_CONF.format(
            state=self.state, placement=placement, spec=spec, alias=alias, db_api=self.db.url("nova_api"),
            db_cell1=self.db.url("nova_cell1"), keystone=keystone, admin_password=ADMIN_PASSWORD))
        (self.state / "keystone.conf").write_text(KEYSTONE_CONF.format(state=self.state, db_keystone=self.db.url("keystone")))
        (self.state / "api-paste.ini").write_text(API_PASTE)
        (self.state / "placement.conf").write_text(PLACEMENT_CONF.format(state=self.state, db_placement=self.db.url("placement")))

    def _databases(self) -> None:
        """The databases, from the template when there is one for this nova and configuration."""
        version = (VENV / ".installed").read_text() if (VENV / ".installed").exists() else ""
        key = hashlib.sha256((version + NOVA_CONF + PLACEMENT_CONF + KEYSTONE_CONF).encode()).hexdigest()[:16]
        template = VENV / "db-template" / key
        if (template / "done").exists():
            shutil.copytree(template / "mysql", self.db.datadir)
            for keys in KEYS:
                shutil.copytree(template / keys, self.state / keys)
            self.db.start()
            # The cell mappings name their databases by URL, with the template's socket.
            old = (template / "socket").read_text()
            self.db.sql(f"UPDATE nova_api.cell_mappings SET database_connection = "
                        f"REPLACE(database_connection, '{old}', '{self.db.socket}')")
            return
        self.db.start()
        self.db.sql("; ".join(f"CREATE DATABASE {d} CHARACTER SET utf8" for d in DATABASES))
        conf = ["--config-file", str(self.state / "nova.conf")]
        kconf = ["--config-file", str(self.state / "keystone.conf")]
        keystone_id = ["--keystone-user", "root", "--keystone-group", "root"]
        # Three chains on databases of their own, run side by side, each tool's commands one after
        # another in one process (manage.py): a command is mostly its interpreter's imports.
        chains = [
            ("placement.cmd.manage", [["placement-manage", "--config-file", str(self.state / "placement.conf"), "db", "sync"]]),
            ("nova.cmd.manage", [
                ["nova-manage", *conf, "api_db", "sync"],
                ["nova-manage", *conf, "cell_v2", "map_cell0", "--database_connection", self.db.url("nova_cell0")],
                ["nova-manage", *conf, "cell_v2", "create_cell", "--name", "cell1", "--transport-url", "fake://",
                 "--database_connection", self.db.url("nova_cell1")],
                ["nova-manage", *conf, "db", "sync"]]),
            ("keystone.cmd.manage", [
                ["keystone-manage", *kconf, "db_sync"],
                ["keystone-manage", *kconf, "fernet_setup", *keystone_id],
                ["keystone-manage", *kconf, "credential_setup", *keystone_id],
                ["keystone-manage", *kconf, "bootstrap", "--bootstrap-password", ADMIN_PASSWORD,
                 "--bootstrap-region-id", REGION, "--bootstrap-public-url", "http://127.0.0.1:0/v3"]]),
        ]
        with ThreadPoolExecutor(len(chains)) as pool:
            for done in [pool.submit(self._manage, module, commands) for module, commands in chains]:
                done.result()  # the first failure, with its command's output
        self.db.stop()
        tmp = template.with_name(key + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copytree(self.db.datadir, tmp / "mysql", ignore=shutil.ignore_patterns("mysqld.sock", "*.pid", "server.log"))
        for keys in KEYS:
            shutil.copytree(self.state / keys, tmp / keys)
        (tmp / "socket").write_text(str(self.db.socket))
        (tmp / "done").touch()
        for old in template.parent.iterdir():  # templates of other configurations or versions
            if old != tmp:
                shutil.rmtree(old, ignore_errors=True)
        tmp.rename(template)
        self.db.start()

    def _spawn(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        self._launch(name)
        return self._ready(name, timeout)

    def _launch(self, name: str) -> None:
        (self.state / f"{name}.ready").unlink(missing_ok=True)
        log = open(self.state / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen([str(PY), str(CLOUD), name, str(self.state)], env=self._env(), cwd=self.state,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _ready(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        """What service ``name`` (launched) wrote in its ready file, once it has."""
        ready = self.state / f"{name}.ready"
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {self.log(name)[-4000:]}")
            time.sleep(0.1)
        info: dict[str, Any] = json.loads(ready.read_text())
        return info

    def start(self) -> RealNova:
        if not PY.exists():
            raise Unavailable(f"{VENV} is missing: `make test` makes it (make .venv-nova/.installed)")
        if why := MariaDB.available():
            raise Unavailable(why)
        self.state.mkdir(parents=True, exist_ok=True)
        try:
            self._configure("http://127.0.0.1:0")  # the manage commands call no service
            self._databases()
            self._launch("keystone")  # keystone and placement read only configuration files of their own
            self._launch("placement")
            self.keystone = self._ready("keystone")["url"]
            self._configure(self._ready("placement")["url"], self.keystone)
            info = self._spawn("nova", timeout=180)
        except BaseException:
            self.close()
            raise
        self.url, self.catalog, self.project = info["url"], info["catalog"], info["project"]
        self.images, self.networks = info["images"], info["networks"]
        self._catalog()
        return self

    def _catalog(self) -> None:
        """Keystone's catalog: identity, compute, image and network on RegionOne."""
        self.db.sql(f"UPDATE keystone.endpoint SET url = '{self.keystone}/v3'")
        self._keystone_admin = self._admin_session()
        for kind, name, url in (("compute", "nova", self.url), ("image", "glance", self.catalog),
                                ("network", "neutron", self.catalog)):
            sid = self._keystone_post("services", {"service": {"type": kind, "name": name}})["service"]["id"]
            self._keystone_post("endpoints", {"endpoint": {"service_id": sid, "interface": "public", "url": url,
                                                           "region_id": REGION}})

    def _admin_session(self) -> Any:
        """A keystoneauth1 session of Keystone's admin (its token, once asked for, has the catalog
        of that moment)."""
        from keystoneauth1 import session
        from keystoneauth1.identity import v3

        return session.Session(auth=v3.Password(auth_url=f"{self.keystone}/v3", username="admin", password=ADMIN_PASSWORD,
                                                project_name="admin", user_domain_id="default", project_domain_id="default"))

    def _keystone_post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._keystone_admin.post(f"{self.keystone}/v3/{path}", json=body).json()
        return out

    def add_project(self, name: str) -> str:
        """A Keystone project ``name`` with user ``gpud`` as its member (the user made with the
        first one); its id. Each test module that boots servers takes a project of its own, so
        that what it lists is only its own."""
        ks = self._keystone_admin
        project = self._keystone_post("projects", {"project": {"name": name, "domain_id": "default"}})["project"]["id"]
        if not self._gpud_user:
            self._gpud_user = self._keystone_post("users", {"user": {
                "name": "gpud", "password": self.user_password, "domain_id": "default",
                "default_project_id": project}})["user"]["id"]
        role = ks.get(f"{self.keystone}/v3/roles?name=member").json()["roles"][0]["id"]
        ks.put(f"{self.keystone}/v3/projects/{project}/users/{self._gpud_user}/roles/{role}")
        return str(project)

    def os_env(self, project: str = "gpu") -> dict[str, str]:
        """The OS_* variables of an openrc file for user gpud of ``project``."""
        return {"OS_AUTH_URL": f"{self.keystone}/v3", "OS_USERNAME": "gpud", "OS_PASSWORD": self.user_password,
                "OS_PROJECT_NAME": project, "OS_USER_DOMAIN_NAME": "Default", "OS_PROJECT_DOMAIN_NAME": "Default",
                "OS_REGION_NAME": REGION, "OS_IDENTITY_API_VERSION": "3", "OS_INTERFACE": "public"}

    def keystone_admin(self) -> Any:
        """A python-novaclient client as Keystone's admin (a real token, with its catalog): for
        what Nova checks with Keystone, such as a project's quota."""
        from novaclient import client

        return client.Client("2.61", session=self._admin_session(), region_name=REGION)

    def log(self, name: str) -> str:
        out = ""
        for path in (self.state / "log" / f"{name}.out", self.state / "log" / f"{name}.log"):
            if path.exists():
                out += path.read_text(errors="replace")
        return out

    def close(self) -> None:
        self._stop_procs()
        self.db.stop()

    def _stop_procs(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()

    def __enter__(self) -> RealNova:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ use

    def session(self, tok: str = ADMIN) -> Any:
        from keystoneauth1 import session
        from keystoneauth1.token_endpoint import Token

        return session.Session(auth=Token(self.url, tok))

    def client(self, tok: str = ADMIN) -> Any:
        from novaclient import client

        return client.Client("2.61", session=self.session(tok), endpoint_override=self.url)

    def admin(self) -> Any:
        return self.client(ADMIN)

    def user_token(self, project: str = "") -> str:
        """A stand-in token of user gpud, a member of ``project`` (an id; default nova's own test
        project, which Keystone does not know)."""
        return token("gpud", project or self.project, "member,reader")


def main() -> None:
    """``python -m tests.realnova DIR``: run it by hand until Ctrl-C."""
    with RealNova(Path(sys.argv[1]).resolve()) as n:
        print(json.dumps({"url": n.url, "catalog": n.catalog, "token": n.user_token()}), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
