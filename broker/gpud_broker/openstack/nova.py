"""Nova through python-novaclient and keystoneauth1: credentials, the calls gpud makes, and Nova's
errors as clear messages, retried with backoff where a retry may help.

Credentials come from a cloud of ``clouds.yaml`` (``[openstack] cloud``; the files openstacksdk
reads: ``$OS_CLIENT_CONFIG_FILE``, ``./clouds.yaml``, ``~/.config/openstack/clouds.yaml``,
``/etc/openstack/clouds.yaml``, each with its ``secure.yaml``) or, without a cloud name, from the
usual ``OS_*`` variables of an openrc file. Either way keystoneauth1 loads the auth plugin
(``password`` by default, ``v3applicationcredential`` when an application credential is given, or
``auth_type``/``OS_AUTH_TYPE``), and keystoneauth1 authenticates, finds Nova in the catalog and
re-authenticates once on a 401.

Every call is made with the microversion ``API_VERSION`` (tags at boot, flavor extra specs in the
server). What can fail, and how it ends:

| Nova answers | NovaError.kind | retried |
| --- | --- | --- |
| 401 (Keystone or Nova) | auth | no |
| 403 | forbidden (over_quota when Nova says "Quota exceeded") | no |
| 404 | not_found | no |
| 409 | conflict (the server is busy with another task) | yes |
| 413 | over_quota | no |
| 429 | rate_limited (after Retry-After) | yes |
| 400 | bad_request | no |
| 5xx | server_error | yes |
| no answer within ``api_timeout`` | timeout | yes |
| cannot connect | unreachable | yes |
| no compute endpoint, bad credentials setup | config | no |

A boot that times out may have created its server: the retry first looks for a server of that
(unique, random) name and adopts it instead of booting a second one.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gpud.errors import RemoteError
from gpud_broker.openstack.pool import ServerInfo, recognised

log = logging.getLogger(__name__)

API_VERSION = "2.61"  # 2.26 tags, 2.37 nics "auto", 2.47 flavor extra specs in servers, 2.52 tags at boot
BACKOFF_S = 1.0  # first retry delay, doubled each time
BACKOFF_MAX_S = 30.0
CLOUDS_FILES = ("clouds.yaml", "~/.config/openstack/clouds.yaml", "/etc/openstack/clouds.yaml")
VGPU_PREFIX = "resources:"

T = TypeVar("T")


class NovaError(RemoteError):
    """A Nova (or Keystone) call that failed, with a message for people. ``kind`` says how
    (see the module docstring), ``status`` the HTTP status when there was one, ``retryable``
    whether trying again later may succeed."""

    def __init__(self, message: str, *, kind: str, status: int | None = None, retryable: bool = False,
                 retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


# --------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credentials:
    """What keystoneauth1 needs: an auth plugin, and where and how to reach the cloud."""

    auth: Any
    region: str = ""
    interface: str = "public"
    verify: bool | str = True
    cert: str | tuple[str, str] | None = None
    source: str = ""  # where they came from, for messages


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path) -> dict[str, Any] | None:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise NovaError(f"cannot read {path}: {exc.strerror}", kind="config") from None
    except yaml.YAMLError as exc:
        raise NovaError(f"{path} is not valid YAML: {exc}", kind="config") from None
    if not isinstance(doc, dict):
        raise NovaError(f"{path}: expected a mapping with 'clouds'", kind="config")
    return doc


def find_cloud(name: str, env: Mapping[str, str], files: Sequence[str] | None = None) -> tuple[dict[str, Any], str]:
    """The settings of cloud ``name`` from the first clouds.yaml that has it (merged with the
    secure.yaml next to it), and that file's path."""
    paths = list(files) if files is not None else ([env["OS_CLIENT_CONFIG_FILE"]] if env.get("OS_CLIENT_CONFIG_FILE") else []) + list(CLOUDS_FILES)
    looked = []
    for p in paths:
        path = Path(os.path.expanduser(p))
        looked.append(str(path))
        doc = _read_yaml(path)
        clouds = doc.get("clouds") if doc else None
        if not isinstance(clouds, dict) or name not in clouds:
            continue
        cloud = clouds[name]
        if not isinstance(cloud, dict):
            raise NovaError(f"{path}: cloud {name!r} must be a mapping", kind="config")
        secure = _read_yaml(path.with_name("secure.yaml"))
        extra = (secure or {}).get("clouds", {}).get(name) if isinstance((secure or {}).get("clouds"), dict) else None
        if isinstance(extra, dict):
            cloud = _deep_merge(cloud, extra)
        return cloud, str(path)
    raise NovaError(f"no cloud {name!r} in {', '.join(looked)} ([openstack] cloud)", kind="config")


def _loader(auth_type: str) -> Any:
    from keystoneauth1 import exceptions as ksa_exc
    from keystoneauth1 import loading

    try:
        return loading.get_plugin_loader(auth_type)
    except ksa_exc.NoMatchingPlugin:
        raise NovaError(f"unknown auth_type {auth_type!r} (keystoneauth1 has no such plugin)", kind="config") from None


def _missing(exc: Exception, where: str) -> NovaError:
    names = ", ".join(getattr(o, "dest", str(o)) for o in getattr(exc, "options", []))
    return NovaError(f"{where}: missing {names or exc}", kind="config")


def credentials(cloud: str, region: str, env: Mapping[str, str], files: Sequence[str] | None = None) -> Credentials:
    """Credentials from clouds.yaml cloud ``cloud``, or from the ``OS_*`` variables in ``env``."""
    from keystoneauth1 import exceptions as ksa_exc

    if cloud:
        settings, path = find_cloud(cloud, env, files)
        auth = settings.get("auth") or {}
        if not isinstance(auth, dict):
            raise NovaError(f"{path}: cloud {cloud!r}: 'auth' must be a mapping", kind="config")
        auth_type = str(settings.get("auth_type") or ("v3applicationcredential" if "application_credential_id" in auth
                                                      or "application_credential_secret" in auth else "password"))
        loader = _loader(auth_type)
        known = {o.dest for o in loader.get_options()}
        unknown = sorted(set(auth) - known)
        if unknown:
            log.warning("openstack: %s: cloud %r: auth keys ignored by auth_type %s: %s", path, cloud, auth_type, ", ".join(unknown))
        try:
            plugin = loader.load_from_options(**{k: v for k, v in auth.items() if k in known})
        except ksa_exc.MissingRequiredOptions as exc:
            raise _missing(exc, f"{path}: cloud {cloud!r}") from None
        verify: bool | str = settings.get("cacert") or bool(settings.get("verify", True))
        cert = (str(settings["cert"]), str(settings["key"])) if settings.get("cert") and settings.get("key") else settings.get("cert")
        return Credentials(plugin, region or str(settings.get("region_name") or ""),
                           str(settings.get("interface") or "public"), verify, cert, f"cloud {cloud!r} of {path}")
    auth_type = env.get("OS_AUTH_TYPE") or ("v3applicationcredential" if env.get("OS_APPLICATION_CREDENTIAL_ID") else "password")
    loader = _loader(auth_type)
    if not env.get("OS_AUTH_URL"):
        raise NovaError("no credentials: set [openstack] cloud (a clouds.yaml cloud) or the OS_* variables "
                        "(OS_AUTH_URL, OS_USERNAME, OS_PASSWORD, OS_PROJECT_NAME, ...)", kind="config")

    def getter(opt: Any) -> Any:
        return next((env[e] for e in opt.argparse_envvars if env.get(e)), None)

    try:
        plugin = loader.load_from_options_getter(getter)
    except ksa_exc.MissingRequiredOptions as exc:
        raise _missing(exc, "the OS_* variables") from None
    insecure = env.get("OS_INSECURE", "").lower() in ("1", "true", "yes")
    verify = False if insecure else (env.get("OS_CACERT") or True)
    cert = (env["OS_CERT"], env["OS_KEY"]) if env.get("OS_CERT") and env.get("OS_KEY") else (env.get("OS_CERT") or None)
    return Credentials(plugin, region or env.get("OS_REGION_NAME", ""),
                       (env.get("OS_INTERFACE") or "public").removesuffix("URL"), verify, cert, "the OS_* variables")


# --------------------------------------------------------------------------- errors


def classify(exc: BaseException, what: str) -> NovaError:
    """``exc``, raised while doing ``what``, as a NovaError with a message for people."""
    from keystoneauth1 import exceptions as ksa
    from novaclient import exceptions as nc

    if isinstance(exc, NovaError):
        return exc
    if isinstance(exc, nc.ClientException):
        code = int(exc.code) if isinstance(exc.code, int) else 0
        text = f"{what}: Nova answered {code or '?'}: {exc.message}"
        if code == 401:
            return NovaError(f"{text} (credentials refused; check [openstack] cloud or the OS_* variables)", kind="auth", status=401)
        if code == 403:
            quota = "quota" in str(exc.message).lower()
            return NovaError(text, kind="over_quota" if quota else "forbidden", status=403)
        if code == 404:
            return NovaError(text, kind="not_found", status=404)
        if code == 409:
            return NovaError(text, kind="conflict", status=409, retryable=True)
        if code == 413:
            return NovaError(f"{text} (over quota)", kind="over_quota", status=413)
        if code == 429:
            return NovaError(text, kind="rate_limited", status=429, retryable=True,
                             retry_after=float(getattr(exc, "retry_after", 0) or 0))
        if code == 400:
            return NovaError(text, kind="bad_request", status=400)
        if code >= 500:
            return NovaError(text, kind="server_error", status=code, retryable=True)
        return NovaError(text, kind="error", status=code or None)
    if isinstance(exc, (nc.NoUniqueMatch, nc.CommandError)):
        return NovaError(f"{what}: {exc}", kind="config")
    if isinstance(exc, ksa.ConnectTimeout):
        return NovaError(f"{what}: no answer in time ({exc})", kind="timeout", retryable=True)
    if isinstance(exc, ksa.SSLError):
        return NovaError(f"{what}: TLS failed ({exc}); check the CA certificate (cacert, OS_CACERT)", kind="unreachable")
    if isinstance(exc, (ksa.ConnectFailure, ksa.UnknownConnectionError, ksa.DiscoveryFailure)):
        return NovaError(f"{what}: cannot reach the cloud: {exc}", kind="unreachable", retryable=True)
    if isinstance(exc, (ksa.EndpointNotFound, ksa.EmptyCatalog, ksa.CatalogException)):
        return NovaError(f"{what}: no compute endpoint in the catalog ({exc}); check the region and interface", kind="config")
    if isinstance(exc, ksa.Unauthorized):
        return NovaError(f"{what}: Keystone refused the credentials ({exc}); check [openstack] cloud or the OS_* variables",
                         kind="auth", status=401)
    if isinstance(exc, ksa.HttpError):
        status = int(getattr(exc, "http_status", 0) or 0)
        return NovaError(f"{what}: the cloud answered {status}: {exc}", kind="server_error" if status >= 500 else "error",
                         status=status or None, retryable=status >= 500)
    if isinstance(exc, (ksa.AuthPluginException, ksa.OptionError, ksa.MissingRequiredOptions)):
        return NovaError(f"{what}: {exc}", kind="config")
    log.exception("openstack: unexpected error while %s", what)
    return NovaError(f"{what}: unexpected {type(exc).__name__}: {exc}", kind="internal")


def retrying(call: Callable[[], T], what: str, retries: int, wait: Callable[[float], bool],
             before_retry: Callable[[], T | None] | None = None) -> T:
    """``call()``, tried again up to ``retries`` times with backoff while it fails in a way that
    may pass. ``wait(seconds)`` sleeps and returns True when the caller is stopping (then the last
    error is raised). ``before_retry()`` may return a result that makes the retry needless."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:  # every failure becomes a NovaError
            err = classify(exc, what)
        if not err.retryable or attempt >= retries:
            raise err
        delay = max(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** attempt), err.retry_after)
        attempt += 1
        log.warning("openstack: %s; retry %d of %d in %.0fs", err.message, attempt, retries, delay)
        if wait(delay):
            raise err
        if before_retry is not None:
            try:
                found = before_retry()
            except Exception as exc:
                log.warning("openstack: %s", classify(exc, f"checking before retrying {what}").message)
                found = None
            if found is not None:
                return found


# --------------------------------------------------------------------------- the client


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def server_info(raw: Mapping[str, Any], flavors: Mapping[str, Mapping[str, str]] | None = None) -> ServerInfo:
    """A server as Nova lists it (microversion 2.47+: the flavor with its extra specs)."""
    flavor = _dict(raw.get("flavor"))
    name = str(flavor.get("original_name") or flavor.get("id") or "")
    specs = flavor.get("extra_specs")
    if not isinstance(specs, dict):
        specs = dict((flavors or {}).get(name, {}))
    vgpu = ",".join(f"{k.removeprefix(VGPU_PREFIX)}={v}" for k, v in sorted(specs.items())
                    if k.startswith(VGPU_PREFIX) and "GPU" in k.upper())
    addresses = []
    for net in _dict(raw.get("addresses")).values():
        for a in net if isinstance(net, list) else []:
            if isinstance(a, dict) and a.get("addr"):
                addresses.append(str(a["addr"]))
    tags = raw.get("tags")
    return ServerInfo(
        id=str(raw.get("id", "")), name=str(raw.get("name", "")), status=str(raw.get("status", "UNKNOWN")),
        task_state=str(raw.get("OS-EXT-STS:task_state") or ""), host=str(raw.get("OS-EXT-SRV-ATTR:host") or ""),
        addresses=tuple(addresses), flavor=name, pci_alias=str(specs.get("pci_passthrough:alias", "")), vgpu=vgpu,
        fault=str(_dict(raw.get("fault")).get("message") or ""), created=str(raw.get("created") or ""),
        metadata={str(k): str(v) for k, v in _dict(raw.get("metadata")).items()},
        tags=tuple(str(t) for t in tags) if isinstance(tags, list) else (),
    )


def is_uuid(value: str) -> bool:
    """Whether ``value`` is a UUID, written as Glance and Neutron write ids (with or without dashes)."""
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class Nova:
    """The Nova calls gpud makes, for the servers it recognises as workers (``worker_metadata``
    and ``worker_tags``). Safe to use from the controller's threads: one keystoneauth1 session,
    a novaclient client per thread. ``stop`` (an Event) cuts retry waits short; ``wait`` replaces
    the sleep between retries (it returns True to stop retrying)."""

    def __init__(self, cfg: Any, env: Mapping[str, str] | None = None, clouds_files: Sequence[str] | None = None,
                 stop: threading.Event | None = None, wait: Callable[[float], bool] | None = None) -> None:
        from keystoneauth1 import session as ksa_session
        from novaclient import client as nova_client

        self.cfg = cfg
        self.creds = credentials(cfg.cloud, cfg.region, os.environ if env is None else env, clouds_files)
        self.session = ksa_session.Session(auth=self.creds.auth, timeout=cfg.api_timeout, verify=self.creds.verify,
                                           cert=self.creds.cert, user_agent="gpud")
        self._client_class = nova_client.Client
        # One novaclient client per thread, sharing the session (its token): novaclient is not
        # thread-safe (the image and network look-ups switch a client's service type for a while).
        self._local = threading.local()
        self.stop = stop or threading.Event()
        self.wait = wait or self.stop.wait  # sleeps between retries; True: stop retrying
        self._refs: dict[str, str] = {}  # image/flavor/network as configured -> its id
        self._refs_lock = threading.Lock()

    @property
    def client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._client_class(
                API_VERSION, session=self.session, endpoint_type=self.creds.interface, region_name=self.creds.region or None)
        return client

    def _call(self, what: str, call: Callable[[], T], before_retry: Callable[[], T | None] | None = None) -> T:
        return retrying(call, what, self.cfg.api_retries, self.wait, before_retry)

    # ------------------------------------------------------------------ reads

    def _flavor_specs(self) -> dict[str, dict[str, str]]:
        """Extra specs by flavor name, for servers listed without them (older policies)."""
        out = {}
        for f in self.client.flavors.list():
            specs = getattr(f, "extra_specs", None)
            out[f.name] = dict(specs) if isinstance(specs, dict) else dict(f.get_keys())
        return out

    def list_servers(self) -> list[ServerInfo]:
        """Every server recognised as a gpud worker, with its flavor's GPU (PCI alias, vGPU)."""
        cfg = self.cfg
        opts = {"tags": ",".join(cfg.worker_tags)} if cfg.worker_tags else {}

        def listing() -> list[ServerInfo]:
            raws = [s.to_dict() for s in self.client.servers.list(search_opts=opts, limit=-1)]
            raws = [r for r in raws if recognised(r.get("metadata") or {}, r.get("tags") or [],
                                                  cfg.worker_metadata, cfg.worker_tags)]
            flavors = self._flavor_specs() if any(not isinstance((r.get("flavor") or {}).get("extra_specs"), dict)
                                                  for r in raws) else None
            return [server_info(r, flavors) for r in raws]

        return self._call("listing servers", listing)

    def get_server(self, server_id: str) -> ServerInfo | None:
        """One server, or None when Nova does not know it."""
        from novaclient import exceptions as nc

        def get() -> ServerInfo | None:
            try:
                return server_info(self.client.servers.get(server_id).to_dict())
            except nc.NotFound:
                return None

        return self._call(f"getting server {server_id}", get)

    def find_by_name(self, name: str) -> ServerInfo | None:
        for s in self.client.servers.list(search_opts={"name": f"^{name}$"}):
            if s.name == name:
                return server_info(s.to_dict())
        return None

    # ------------------------------------------------------------------ references

    def _ref(self, kind: str, value: str) -> str:
        """The id of the configured image, flavor or network (looked up by name once). An image
        or network given as an id (a UUID, which is what Glance and Neutron ids are) is used as
        it is: only names are looked up, which needs the Image or Network service in the catalog."""
        if kind in ("image", "network") and is_uuid(value):
            return value
        with self._refs_lock:
            if f"{kind}:{value}" in self._refs:
                return self._refs[f"{kind}:{value}"]
        from novaclient import exceptions as nc

        def look_up() -> str:
            if kind == "image":
                return str(self.client.glance.find_image(value).id)
            if kind == "network":
                return str(self.client.neutron.find_network(value).id)
            try:
                return str(self.client.flavors.get(value).id)
            except nc.NotFound:
                matches = [f for f in self.client.flavors.list() if f.name == value]
                if len(matches) != 1:
                    raise NovaError(f"[openstack] flavor {value!r}: {'no' if not matches else 'more than one'} "
                                    "flavor of that name or id", kind="config") from None
                return str(matches[0].id)

        found = self._call(f"looking up the {kind} {value!r}", look_up)
        with self._refs_lock:
            self._refs[f"{kind}:{value}"] = found
        return found

    # ------------------------------------------------------------------ changes

    def boot(self, name: str, user_data: str, metadata: Mapping[str, str], tags: Sequence[str]) -> ServerInfo:
        """Create server ``name``; returns it as Nova lists it right after (status BUILD)."""
        cfg = self.cfg
        for key in ("image", "flavor"):
            if not getattr(cfg, key):
                raise NovaError(f"[openstack] {key} is not set: cannot boot", kind="config")
        image, flavor = self._ref("image", cfg.image), self._ref("flavor", cfg.flavor)
        nics: Any = [{"net-id": self._ref("network", cfg.network)}] if cfg.network else "auto"

        def create() -> ServerInfo:
            s = self.client.servers.create(name, image=image, flavor=flavor, meta=dict(metadata), userdata=user_data,
                                           key_name=cfg.key_name or None, nics=nics, tags=list(tags) or None)
            return self.get_server(str(s.id)) or ServerInfo(id=str(s.id), name=name, status="BUILD")

        return self._call(f"booting server {name}", create, before_retry=lambda: self.find_by_name(name))

    def reboot(self, server_id: str) -> None:
        """Hard reboot (it also starts a SHUTOFF server and resets one in ERROR)."""
        from novaclient.v2 import servers

        self._call(f"rebooting server {server_id}", lambda: self.client.servers.reboot(server_id, servers.REBOOT_HARD))

    def delete(self, server_id: str) -> bool:
        """Delete a server; False when Nova did not know it (already gone)."""
        from novaclient import exceptions as nc

        def delete() -> bool:
            try:
                self.client.servers.delete(server_id)
            except nc.NotFound:
                return False
            return True

        return self._call(f"deleting server {server_id}", delete)

