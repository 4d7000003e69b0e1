"""A hand-written stand-in for OpenStack, kept for what real Nova cannot be made to show on demand:
429 with Retry-After, 5xx, 409 while busy, slow answers and answers lost to a timeout, servers stuck
in BUILD or REBOOT. What Nova really answers (policy, scheduling by PCI alias, task states, user
data, Keystone and its catalog) is tested against real Nova: tests/realnova, used by
tests/integration/test_openstack.py. The unit tests of gpud's Nova client and OpenStack controller
(tests/unit/test_openstack_*.py) use this server, in-process and fast, to inject those faults.

It serves the subset of the Compute API (Nova) that gpud uses, a minimal Identity v3 (Keystone) so
that keystoneauth1 authenticates for real, the image and network look-ups python-novaclient makes by
name, and the metadata service's ``meta_data.json``.

It is a stateful ``http.server`` on 127.0.0.1 (port chosen by the kernel), run in a thread of the
test process; the real python-novaclient and keystoneauth1 talk to it over HTTP. Servers have
metadata, tags, a flavor with extra specs (embedded as microversion 2.47+ does), addresses, a host,
and a status that moves on by itself (BUILD -> ACTIVE after ``build_s``, REBOOT -> ACTIVE after
``reboot_s``, or stuck with ``None``). Tests inject errors (``fail``) and slow answers (``slow``),
change a server's status (``set_status``) and read what was asked (``requests``, ``actions``).

Not a Nova: no scheduling, no policy, one project.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MICROVERSION = "2.61"
REGION = "RegionOne"


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    message: str
    times: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Delay:
    method: str
    path: re.Pattern[str]
    seconds: float
    times: int
    after: bool = False  # do the work first, then hold the answer back (a reply lost to a timeout)


@dataclass
class Server:
    id: str
    name: str
    flavor_id: str
    image_id: str
    status: str = "BUILD"
    metadata: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    key_name: str | None = None
    user_data: str = ""  # decoded
    network: str = "gpu-net"
    addr: str = ""
    host: str = "compute-1"
    task_state: str | None = None
    fault: str = ""
    created: str = ""
    # A transition under way: ``then`` at ``until`` (monotonic); None: none.
    until: float | None = None
    then: str = ""
    actions: list[str] = field(default_factory=list)


_ERROR_KEYS = {400: "badRequest", 403: "forbidden", 404: "itemNotFound", 409: "conflictingRequest",
               413: "overLimit", 429: "overLimit", 500: "computeFault", 503: "serviceUnavailable"}


class ComputeAPI:
    """The fake cloud. ``start()`` returns its base URL; ``auth_env()`` the OS_* variables for it."""

    def __init__(self, username: str = "gpud", password: str = "s3cret", project: str = "gpu") -> None:
        self.username, self.password, self.project = username, password, project
        self.lock = threading.Lock()
        self.servers: dict[str, Server] = {}
        self.deleted: dict[str, Server] = {}  # still good as a list marker, as in Nova
        self.flavors: dict[str, dict[str, Any]] = {}
        self.images: dict[str, str] = {}  # id -> name
        self.networks: dict[str, str] = {}  # id -> name
        self.tokens: set[str] = set()
        self.faults: list[Fault] = []
        self.delays: list[Delay] = []
        self.requests: list[tuple[str, str]] = []  # (method, path with query), in order
        self.max_servers: int | None = None  # the instances quota; None: unlimited
        self.quota_status = 403  # what going over it answers (Nova: 403; before Queens: 413)
        self.build_s: float | None = 0.0  # seconds in BUILD; None: stuck in BUILD
        self.reboot_s: float | None = 0.0  # seconds in REBOOT; None: stuck
        self.metadata_uuid = ""  # what meta_data.json says ("" : 404)
        self._released = threading.Event()  # set at stop: slow answers return at once
        self._next_ip = 10
        self.httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> str:
        api = self

        class Handler(_Handler):
            cloud = api

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="compute-api", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self._released.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ComputeAPI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.httpd is not None
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def auth_url(self) -> str:
        return f"{self.url}/identity/v3"

    def auth_env(self) -> dict[str, str]:
        """The OS_* variables of an openrc file for this cloud."""
        return {
            "OS_AUTH_URL": self.auth_url,
            "OS_USERNAME": self.username,
            "OS_PASSWORD": self.password,
            "OS_PROJECT_NAME": self.project,
            "OS_USER_DOMAIN_NAME": "Default",
            "OS_PROJECT_DOMAIN_NAME": "Default",
            "OS_REGION_NAME": REGION,
            "OS_INTERFACE": "public",
        }

    # ------------------------------------------------------------------ set-up and inspection

    def add_flavor(self, name: str, extra_specs: dict[str, str] | None = None, vcpus: int = 8,
                   ram: int = 65536) -> str:
        fid = str(len(self.flavors) + 1)
        self.flavors[fid] = {"id": fid, "name": name, "vcpus": vcpus, "ram": ram, "disk": 40,
                             "extra_specs": dict(extra_specs or {})}
        return fid

    def add_image(self, name: str) -> str:
        iid = str(uuid.uuid4())
        self.images[iid] = name
        return iid

    def add_network(self, name: str) -> str:
        nid = str(uuid.uuid4())
        self.networks[nid] = name
        return nid

    def add_server(self, name: str, flavor_id: str, status: str = "ACTIVE", metadata: dict[str, str] | None = None,
                   tags: list[str] | None = None, image_id: str = "") -> str:
        with self.lock:
            s = self._new_server(name, flavor_id, image_id, metadata or {}, tags or [])
            s.status = status
            return s.id

    def set_status(self, server_id: str, status: str, fault: str = "") -> None:
        with self.lock:
            s = self.servers[server_id]
            s.status, s.fault, s.until, s.task_state = status, fault, None, None

    def status(self, server_id: str) -> str | None:
        with self.lock:
            s = self.servers.get(server_id)
            if s is None:
                return None
            self._advance(s)
            return s.status

    def actions(self, server_id: str) -> list[str]:
        with self.lock:
            s = self.servers.get(server_id)
            return list(s.actions) if s is not None else []

    def names(self) -> dict[str, str]:
        """Live servers: id -> name."""
        with self.lock:
            return {s.id: s.name for s in self.servers.values()}

    def fail(self, method: str, path: str, status: int, message: str = "injected", times: int = 1,
             headers: dict[str, str] | None = None) -> None:
        """The next ``times`` requests ``method`` on a path matching regex ``path`` get ``status``."""
        with self.lock:
            self.faults.append(Fault(method, re.compile(path), status, message, times, dict(headers or {})))

    def slow(self, method: str, path: str, seconds: float, times: int = 1, after: bool = False) -> None:
        """The next ``times`` such requests are answered only after ``seconds`` (or at stop);
        ``after``: carried out at once, only the answer is late."""
        with self.lock:
            self.delays.append(Delay(method, re.compile(path), seconds, times, after))

    def release(self) -> None:
        """Answer every held request now (and those ``slow`` holds from now on)."""
        self._released.set()

    def count(self, method: str, path: str) -> int:
        rx = re.compile(path)
        with self.lock:
            return sum(1 for m, p in self.requests if m == method and rx.search(p))

    # ------------------------------------------------------------------ internals (under lock)

    def _new_server(self, name: str, flavor_id: str, image_id: str, metadata: dict[str, str],
                    tags: list[str]) -> Server:
        self._next_ip += 1
        s = Server(id=str(uuid.uuid4()), name=name, flavor_id=flavor_id, image_id=image_id, metadata=dict(metadata),
                   tags=list(tags), addr=f"10.0.0.{self._next_ip}",
                   created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.servers[s.id] = s
        return s

    def _advance(self, s: Server) -> None:
        if s.until is not None and time.monotonic() >= s.until:
            s.status, s.until, s.task_state = s.then, None, None

    def _move(self, s: Server, now_status: str, seconds: float | None, then: str, task: str | None) -> None:
        s.status, s.task_state = now_status, task
        if seconds is None:
            s.until = None  # stuck
        elif seconds <= 0:
            s.status, s.task_state, s.until = then, None, None
        else:
            s.until, s.then = time.monotonic() + seconds, then

    def _server_json(self, s: Server) -> dict[str, Any]:
        self._advance(s)
        f = self.flavors.get(s.flavor_id, {"name": "?", "vcpus": 0, "ram": 0, "disk": 0, "extra_specs": {}})
        out: dict[str, Any] = {
            "id": s.id,
            "name": s.name,
            "status": s.status,
            "tenant_id": "p1",
            "user_id": "u1",
            "metadata": dict(s.metadata),
            "tags": list(s.tags),
            "created": s.created,
            "updated": s.created,
            "hostId": "h" + s.host,
            "key_name": s.key_name,
            "image": {"id": s.image_id},
            "flavor": {"original_name": f["name"], "vcpus": f["vcpus"], "ram": f["ram"], "disk": f["disk"],
                       "ephemeral": 0, "swap": 0, "extra_specs": dict(f["extra_specs"])},
            "addresses": {s.network: [{"addr": s.addr, "version": 4, "OS-EXT-IPS:type": "fixed"}]}
            if s.status != "BUILD" else {},
            "OS-EXT-SRV-ATTR:host": s.host if s.status != "BUILD" else None,
            "OS-EXT-STS:task_state": s.task_state,
            "OS-EXT-STS:vm_state": s.status.lower(),
            "links": [{"rel": "self", "href": f"{self.url}/compute/v2.1/servers/{s.id}"}],
        }
        if s.status == "ERROR":
            out["fault"] = {"code": 500, "message": s.fault or "failed", "created": s.created}
        return out


def _flavor_json(f: dict[str, Any]) -> dict[str, Any]:
    return {"id": f["id"], "name": f["name"], "vcpus": f["vcpus"], "ram": f["ram"], "disk": f["disk"],
            "OS-FLV-EXT-DATA:ephemeral": 0, "swap": "", "rxtx_factor": 1.0, "os-flavor-access:is_public": True,
            "extra_specs": dict(f["extra_specs"]), "links": []}


class _Handler(BaseHTTPRequestHandler):
    cloud: ComputeAPI
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart
    late = 0.0  # seconds to hold the answer back (Delay.after)
    _answer: tuple[int, Any, dict[str, str] | None] = (500, None, None)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    # ------------------------------------------------------------------ plumbing

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        """Keep the answer: ``_handle`` writes it once the cloud's lock is released."""
        self._answer = (status, body, headers)

    def _write(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        if self.late:
            self.cloud._released.wait(self.late)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("OpenStack-API-Version", f"compute {MICROVERSION}")
        self.send_header("X-OpenStack-Nova-API-Version", MICROVERSION)
        self.send_header("X-Compute-Request-Id", "req-" + uuid.uuid4().hex)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        if status == 401:
            body: dict[str, Any] = {"error": {"code": 401, "title": "Unauthorized", "message": message}}
        else:
            body = {_ERROR_KEYS.get(status, "computeFault"): {"code": status, "message": message}}
        self._send(status, body, headers)

    def _handle(self, method: str) -> None:
        self._answer = (500, None, None)
        try:
            self._route(method)
        finally:
            try:
                self._write(*self._answer)
            except OSError:  # the client gave up (a timeout): nobody to answer
                self.close_connection = True

    def _route(self, method: str) -> None:
        cloud = self.cloud
        path = urlsplit(self.path).path.rstrip("/") or "/"
        query = parse_qs(urlsplit(self.path).query)
        body = self._body() if method in ("POST", "PUT") else {}
        with cloud.lock:
            cloud.requests.append((method, self.path))
            fault = next((f for f in cloud.faults if f.method == method and f.path.search(path) and f.times > 0), None)
            if fault is not None:
                fault.times -= 1
            delay = next((d for d in cloud.delays if d.method == method and d.path.search(path) and d.times > 0), None)
            if delay is not None:
                delay.times -= 1
        self.late = delay.seconds if delay is not None and delay.after else 0.0
        if delay is not None and not delay.after:
            cloud._released.wait(delay.seconds)
        if fault is not None:
            self._error(fault.status, fault.message, fault.headers)
            return
        if body is None:
            self._error(400, "Malformed request body")
            return
        routes: list[tuple[str, str, Callable[..., None]]] = [
            ("GET", r"/identity", self._identity_versions),
            ("GET", r"/identity/v3", self._identity_version),
            ("POST", r"/identity/v3/auth/tokens", self._token),
            ("GET", r"/openstack/latest/meta_data\.json", self._meta_data),
            ("GET", r"/image/v2/images", self._images),
            ("GET", r"/image/v2/images/(?P<id>[^/]+)", self._image),
            ("GET", r"/network/v2\.0/networks", self._networks),
        ]
        for m, rx, fn in routes:
            match = re.fullmatch(rx, path)
            if m == method and match:
                if not path.startswith(("/identity", "/openstack")) and not self._authorized():
                    return
                fn(body=body, query=query, **match.groupdict())
                return
        if path.startswith("/compute/v2.1"):
            if not self._authorized():
                return
            self._compute(method, path[len("/compute/v2.1"):] or "/", body, query)
            return
        self._error(404, f"no route {method} {path}")

    def _authorized(self) -> bool:
        if self.headers.get("X-Auth-Token") in self.cloud.tokens:
            return True
        self._error(401, "The request you have made requires authentication.")
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    # ------------------------------------------------------------------ identity

    def _v3(self) -> dict[str, Any]:
        return {"id": "v3.14", "status": "stable", "updated": "2020-04-07T00:00:00Z",
                "links": [{"rel": "self", "href": f"{self.cloud.url}/identity/v3/"}],
                "media-types": [{"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}]}

    def _identity_versions(self, **_: Any) -> None:
        self._send(300, {"versions": {"values": [self._v3()]}})

    def _identity_version(self, **_: Any) -> None:
        self._send(200, {"version": self._v3()})

    def _token(self, body: Any, **_: Any) -> None:
        cloud = self.cloud
        ident = body.get("auth", {}).get("identity", {}) if isinstance(body, dict) else {}
        user = ident.get("password", {}).get("user", {}) if "password" in ident.get("methods", []) else {}
        if user.get("name") != cloud.username or user.get("password") != cloud.password:
            self._error(401, "The request you have made requires authentication.")
            return
        token = uuid.uuid4().hex
        base = cloud.url
        catalog = [
            {"type": t, "name": n, "id": n, "endpoints": [
                {"id": n + "-public", "interface": "public", "region": REGION, "region_id": REGION, "url": url}]}
            for t, n, url in (("compute", "nova", f"{base}/compute/v2.1"), ("image", "glance", f"{base}/image"),
                              ("network", "neutron", f"{base}/network"))
        ]
        with cloud.lock:
            cloud.tokens.add(token)
        doc = {"token": {
            "methods": ["password"], "expires_at": "2999-01-01T00:00:00.000000Z",
            "issued_at": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
            "user": {"id": "u1", "name": cloud.username, "domain": {"id": "default", "name": "Default"}},
            "project": {"id": "p1", "name": cloud.project, "domain": {"id": "default", "name": "Default"}},
            "roles": [{"id": "r1", "name": "member"}], "catalog": catalog}}
        self._send(201, doc, {"X-Subject-Token": token})

    def _meta_data(self, **_: Any) -> None:
        if not self.cloud.metadata_uuid:
            self._error(404, "no metadata here")
            return
        self._send(200, {"uuid": self.cloud.metadata_uuid, "name": "gpu-vm", "meta": {}})

    # ------------------------------------------------------------------ image and network look-ups

    def _images(self, query: dict[str, list[str]], **_: Any) -> None:
        name = (query.get("name") or [""])[0]
        rows = [{"id": i, "name": n, "status": "active"} for i, n in self.cloud.images.items() if not name or n == name]
        self._send(200, {"images": rows})

    def _image(self, id: str, **_: Any) -> None:  # noqa: A002 - the route's group
        name = self.cloud.images.get(id)
        if name is None:
            self._error(404, f"No image found with ID {id}")
        else:
            self._send(200, {"id": id, "name": name, "status": "active"})

    def _networks(self, query: dict[str, list[str]], **_: Any) -> None:
        name = (query.get("name") or [""])[0]
        rows = [{"id": i, "name": n} for i, n in self.cloud.networks.items() if not name or n == name]
        self._send(200, {"networks": rows})

    # ------------------------------------------------------------------ compute

    def _compute(self, method: str, path: str, body: Any, query: dict[str, list[str]]) -> None:
        cloud = self.cloud
        parts = [p for p in path.split("/") if p]
        with cloud.lock:
            if method == "GET" and parts in (["servers"], ["servers", "detail"]):
                self._list_servers(query)
            elif method == "GET" and len(parts) == 2 and parts[0] == "servers":
                s = cloud.servers.get(parts[1])
                if s is None:
                    self._error(404, f"Instance {parts[1]} could not be found.")
                else:
                    self._send(200, {"server": cloud._server_json(s)})
            elif method == "POST" and parts == ["servers"]:
                self._create(body)
            elif method == "DELETE" and len(parts) == 2 and parts[0] == "servers":
                s = cloud.servers.pop(parts[1], None)
                if s is None:
                    self._error(404, f"Instance {parts[1]} could not be found.")
                else:
                    cloud.deleted[s.id] = s
                    self._send(204)
            elif method == "POST" and len(parts) == 3 and parts[0] == "servers" and parts[2] == "action":
                self._action(parts[1], body)
            elif method == "GET" and len(parts) == 3 and parts[0] == "servers" and parts[2] == "os-instance-actions":
                s = cloud.servers.get(parts[1])
                if s is None:
                    self._error(404, f"Instance {parts[1]} could not be found.")
                else:
                    self._send(200, {"instanceActions": [
                        {"action": a, "instance_uuid": s.id, "request_id": "req-1", "message": None}
                        for a in s.actions]})
            elif method == "GET" and parts in (["flavors"], ["flavors", "detail"]):
                self._send(200, {"flavors": [_flavor_json(f) for f in cloud.flavors.values()]})
            elif method == "GET" and len(parts) == 2 and parts[0] == "flavors":
                f = cloud.flavors.get(parts[1])
                if f is None:
                    self._error(404, f"Flavor {parts[1]} could not be found.")
                else:
                    self._send(200, {"flavor": _flavor_json(f)})
            elif method == "GET" and len(parts) == 3 and parts[0] == "flavors" and parts[2] == "os-extra_specs":
                f = cloud.flavors.get(parts[1])
                if f is None:
                    self._error(404, f"Flavor {parts[1]} could not be found.")
                else:
                    self._send(200, {"extra_specs": dict(f["extra_specs"])})
            else:
                self._error(404, f"no route {method} /compute/v2.1{path}")

    def _list_servers(self, query: dict[str, list[str]]) -> None:
        cloud = self.cloud
        rows = sorted(cloud.servers.values(), key=lambda s: s.created + s.id)
        tags = [t for t in (query.get("tags") or [""])[0].split(",") if t]
        if tags:
            rows = [s for s in rows if all(t in s.tags for t in tags)]
        marker = (query.get("marker") or [""])[0]
        if marker:
            m = cloud.servers.get(marker) or cloud.deleted.get(marker)
            if m is None:
                self._error(400, f"marker [{marker}] not found")
                return
            rows = [s for s in rows if s.created + s.id > m.created + m.id]
        limit = int((query.get("limit") or ["1000"])[0])
        self._send(200, {"servers": [cloud._server_json(s) for s in rows[:limit]]})

    def _create(self, body: dict[str, Any]) -> None:
        cloud = self.cloud
        req = body.get("server")
        if not isinstance(req, dict) or not req.get("name"):
            self._error(400, "Invalid input for field/attribute server: 'name' is a required property")
            return
        if req.get("flavorRef") not in cloud.flavors:
            self._error(400, f"Flavor {req.get('flavorRef')} could not be found.")
            return
        if req.get("imageRef") not in cloud.images:
            self._error(400, f"Image {req.get('imageRef')} could not be found.")
            return
        nets = req.get("networks")
        if nets != "auto" and not (isinstance(nets, list) and all(n.get("uuid") in cloud.networks for n in nets)):
            self._error(400, f"Network {nets!r} could not be found.")
            return
        if cloud.max_servers is not None and len(cloud.servers) >= cloud.max_servers:
            self._error(cloud.quota_status, f"Quota exceeded for instances: Requested 1, but already used "
                                            f"{len(cloud.servers)} of {cloud.max_servers} instances")
            return
        user_data = ""
        if req.get("user_data"):
            try:
                user_data = base64.b64decode(req["user_data"], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                self._error(400, "User data needs to be valid base 64.")
                return
        s = cloud._new_server(req["name"], req["flavorRef"], req["imageRef"], req.get("metadata") or {},
                              req.get("tags") or [])
        s.key_name, s.user_data = req.get("key_name"), user_data
        if isinstance(nets, list) and nets:
            s.network = cloud.networks[nets[0]["uuid"]]
        s.actions.append("create")
        cloud._move(s, "BUILD", cloud.build_s, "ACTIVE", "spawning")
        self._send(202, {"server": {"id": s.id, "links": [], "adminPass": "x", "OS-DCF:diskConfig": "AUTO",
                                    "security_groups": [{"name": "default"}]}})

    def _action(self, server_id: str, body: dict[str, Any]) -> None:
        cloud = self.cloud
        s = cloud.servers.get(server_id)
        if s is None:
            self._error(404, f"Instance {server_id} could not be found.")
            return
        cloud._advance(s)
        if s.task_state is not None:
            self._error(409, f"Cannot '{next(iter(body), '?')}' instance {s.id} while it is in task_state {s.task_state}")
            return
        if "reboot" in body:
            kind = (body["reboot"] or {}).get("type", "SOFT")
            if kind not in ("SOFT", "HARD"):
                self._error(400, f"Invalid reboot type {kind}")
                return
            if s.status == "BUILD" or (kind == "SOFT" and s.status != "ACTIVE"):
                self._error(409, f"Cannot 'reboot' instance {s.id} while it is in vm_state {s.status.lower()}")
                return
            s.actions.append("reboot")
            cloud._move(s, "HARD_REBOOT" if kind == "HARD" else "REBOOT", cloud.reboot_s, "ACTIVE",
                        "reboot_started_hard" if kind == "HARD" else "reboot_started")
        elif "os-stop" in body:
            s.actions.append("stop")
            cloud._move(s, "SHUTOFF", 0, "SHUTOFF", None)
        elif "os-start" in body:
            if s.status != "SHUTOFF":
                self._error(409, f"Cannot 'start' instance {s.id} while it is in vm_state {s.status.lower()}")
                return
            s.actions.append("start")
            cloud._move(s, "ACTIVE", 0, "ACTIVE", None)
        else:
            self._error(400, f"unsupported action {sorted(body)!r}")
            return
        self._send(202)
