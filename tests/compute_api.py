"""A hand-written stand-in for OpenStack, kept only for what real Nova cannot be made to show on
demand: an error status on any call (429 with Retry-After, 5xx, 409, a 401 from Nova itself, 413),
slow answers and answers lost to a timeout, a server stuck in BUILD, and the metadata service's
answers to a VM (which real Nova gives only through Neutron's metadata proxy). Everything else,
listing, boot, reboot, delete, policy, scheduling by PCI alias, quota, Keystone and its catalog,
is tested against real Nova: tests/realnova, used by tests/integration/test_openstack*.py. The unit
tests tests/unit/test_openstack_nova.py and test_openstack_controller.py use this server,
in-process and fast, to inject those faults.

It serves what those tests make gpud call: a minimal Identity v3 (Keystone) so that keystoneauth1
authenticates for real, Nova's server list (paged by marker, as python-novaclient asks), get,
create and delete, flavors, the image look-up by name, and the metadata service's
``meta_data.json``. It is a stateful ``http.server`` on 127.0.0.1 (port chosen by the kernel), run
in a thread of the test process; the real python-novaclient and keystoneauth1 talk to it over HTTP.
A server is ACTIVE once created, or stays in BUILD with ``stuck_in_build``. Tests inject errors
(``fail``) and slow answers (``slow``) and read what was asked (``requests``, ``count``).

Not a Nova: no scheduling, no policy, no quota, one project.
"""

from __future__ import annotations

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
    status: str
    metadata: dict[str, str]
    tags: list[str]
    created: str


_ERROR_KEYS = {400: "badRequest", 403: "forbidden", 404: "itemNotFound", 409: "conflictingRequest",
               413: "overLimit", 429: "overLimit", 500: "computeFault", 503: "serviceUnavailable"}


class ComputeAPI:
    """The fault server. ``start()`` returns its base URL; ``auth_env()`` the OS_* variables for it."""

    def __init__(self, username: str = "gpud", password: str = "s3cret", project: str = "gpu") -> None:
        self.username, self.password, self.project = username, password, project
        self.lock = threading.Lock()
        self.servers: dict[str, Server] = {}
        self.deleted: dict[str, Server] = {}  # still good as a list marker, as in Nova
        self.flavors: dict[str, dict[str, Any]] = {}
        self.images: dict[str, str] = {}  # id -> name
        self.tokens: set[str] = set()
        self.faults: list[Fault] = []
        self.delays: list[Delay] = []
        self.requests: list[tuple[str, str]] = []  # (method, path with query), in order
        self.stuck_in_build = False  # True: a new server stays in BUILD; else it is ACTIVE at once
        self.metadata_uuid = ""  # what meta_data.json says ("" : 404)
        self._released = threading.Event()  # set at stop: slow answers return at once
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

    def add_flavor(self, name: str, extra_specs: dict[str, str] | None = None) -> str:
        fid = str(len(self.flavors) + 1)
        self.flavors[fid] = {"id": fid, "name": name, "vcpus": 8, "ram": 65536, "disk": 40,
                             "extra_specs": dict(extra_specs or {})}
        return fid

    def add_image(self, name: str) -> str:
        iid = str(uuid.uuid4())
        self.images[iid] = name
        return iid

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

    def _server_json(self, s: Server) -> dict[str, Any]:
        f = self.flavors[s.flavor_id]
        return {
            "id": s.id, "name": s.name, "status": s.status, "tenant_id": "p1", "user_id": "u1",
            "metadata": dict(s.metadata), "tags": list(s.tags), "created": s.created, "updated": s.created,
            "flavor": {"original_name": f["name"], "vcpus": f["vcpus"], "ram": f["ram"], "disk": f["disk"],
                       "ephemeral": 0, "swap": 0, "extra_specs": dict(f["extra_specs"])},
            "addresses": {}, "OS-EXT-STS:task_state": "spawning" if s.status == "BUILD" else None,
            "links": [{"rel": "self", "href": f"{self.url}/compute/v2.1/servers/{s.id}"}],
        }


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
        ]
        for m, rx, fn in routes:
            if m == method and re.fullmatch(rx, path):
                if not path.startswith(("/identity", "/openstack")) and not self._authorized():
                    return
                fn(body=body, query=query)
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
            for t, n, url in (("compute", "nova", f"{base}/compute/v2.1"), ("image", "glance", f"{base}/image"))
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

    def _images(self, query: dict[str, list[str]], **_: Any) -> None:
        name = (query.get("name") or [""])[0]
        rows = [{"id": i, "name": n, "status": "active"} for i, n in self.cloud.images.items() if not name or n == name]
        self._send(200, {"images": rows})

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
            elif method == "GET" and parts in (["flavors"], ["flavors", "detail"]):
                self._send(200, {"flavors": [_flavor_json(f) for f in cloud.flavors.values()]})
            elif method == "GET" and len(parts) == 2 and parts[0] == "flavors":
                f = cloud.flavors.get(parts[1])
                if f is None:
                    self._error(404, f"Flavor {parts[1]} could not be found.")
                else:
                    self._send(200, {"flavor": _flavor_json(f)})
            else:
                self._error(404, f"no route {method} /compute/v2.1{path}")

    def _list_servers(self, query: dict[str, list[str]]) -> None:
        cloud = self.cloud
        rows = sorted(cloud.servers.values(), key=lambda s: s.created + s.id)
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
        s = Server(id=str(uuid.uuid4()), name=req["name"], flavor_id=req["flavorRef"],
                   status="BUILD" if cloud.stuck_in_build else "ACTIVE", metadata=dict(req.get("metadata") or {}),
                   tags=list(req.get("tags") or []), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        cloud.servers[s.id] = s
        self._send(202, {"server": {"id": s.id, "links": [], "adminPass": "x", "OS-DCF:diskConfig": "AUTO",
                                    "security_groups": [{"name": "default"}]}})
