"""The real OpenStack services of the tests, one per process, run with .venv-nova's Python:

    python cloud.py placement DIR   placement's WSGI app (placement.wsgi), DIR/placement.conf
    python cloud.py nova DIR        nova-api's WSGI app (nova.wsgi.osapi_compute's init) with the
                                    real conductor, scheduler and compute services in this process
    python cloud.py keystone DIR    keystone's public WSGI app, DIR/keystone.conf

Each serves HTTP on 127.0.0.1 (a port the kernel picks) and writes ``{"url": ...}`` to
DIR/NAME.ready once it answers. Nova's services talk over oslo.messaging's ``fake://`` transport,
one for every cell (as nova's RPCFixture does); Glance and Neutron are nova's in-tree GlanceFixture
and NeutronFixture, and the nova process also serves their images and networks over HTTP (Image
API ``/v2/images``, Network API ``/v2.0/networks``, read only) for the catalog's image and network
endpoints. SIGTERM stops the process (at once: it keeps nothing the databases do not have).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger("realnova")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve(app: Any) -> str:
    server = make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def ready(state: Path, name: str, **info: Any) -> None:
    tmp = state / f"{name}.ready.tmp"
    tmp.write_text(json.dumps(info))
    tmp.rename(state / f"{name}.ready")


def wait_for_term() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


# --------------------------------------------------------------------------- placement


def placement(state: Path) -> None:
    os.environ["OS_PLACEMENT_CONFIG_DIR"] = str(state)
    from placement import wsgi

    ready(state, "placement", url=serve(wsgi.init_application()))
    wait_for_term()


# --------------------------------------------------------------------------- keystone


def keystone(state: Path) -> None:
    os.environ["OS_KEYSTONE_CONFIG_FILES"] = "keystone.conf"
    os.environ["OS_KEYSTONE_CONFIG_DIR"] = str(state)
    from keystone.server.wsgi import initialize_public_application

    sys.argv = [sys.argv[0]]  # keystone parses them

    ready(state, "keystone", url=serve(initialize_public_application()))
    wait_for_term()


# --------------------------------------------------------------------------- nova


class _Harness:
    """What nova's fixtures ask of the test case that uses them."""

    def __init__(self) -> None:
        import fixtures

        self._fixtures = fixtures

    def useFixture(self, fixture: Any) -> Any:  # noqa: N802 (the testtools name)
        fixture.setUp()
        return fixture

    def stub_out(self, old: str, new: Any) -> None:
        self._fixtures.MonkeyPatch(old, new).setUp()

    def flags(self, **kw: Any) -> None:
        from nova import conf

        group = kw.pop("group", None)
        for k, v in kw.items():
            conf.CONF.set_override(k, v, group)


def _catalog_app(glance: Any, neutron: Any) -> Any:
    """The Image and Network APIs' read calls over the fixtures' data."""

    def image(i: dict[str, Any]) -> dict[str, Any]:
        return {"id": i["id"], "name": i.get("name"), "status": i.get("status", "active"),
                "visibility": "public" if i.get("is_public", True) else "private",
                "container_format": i.get("container_format"), "disk_format": i.get("disk_format"),
                "min_ram": i.get("min_ram", 0), "min_disk": i.get("min_disk", 0), "size": i.get("size"),
                "created_at": str(i.get("created_at", "")), "updated_at": str(i.get("updated_at", "")),
                "self": f"/v2/images/{i['id']}", "file": f"/v2/images/{i['id']}/file", "schema": "/v2/schemas/image"}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ.get("PATH_INFO", "").rstrip("/")
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        body: Any = None
        if environ["REQUEST_METHOD"] != "GET":
            body, status = {"error": "read only"}, "405 Method Not Allowed"
        elif path == "/v2/images":
            rows = [image(i) for i in glance.images.values()]
            body = {"images": [r for r in rows if "name" not in query or r["name"] == query["name"]]}
        elif path.startswith("/v2/images/"):
            found = glance.images.get(path.rsplit("/", 1)[1])
            body = image(found) if found else None
        elif path == "/v2.0/networks":
            nets = [dict(n) for n in neutron._networks.values()]
            body = {"networks": [n for n in nets if all(str(n.get(k)) == v for k, v in query.items()
                                                        if k in ("name", "id"))]}
        elif path.startswith("/v2.0/networks/"):
            found = neutron._networks.get(path.rsplit("/", 1)[1])
            body = {"network": dict(found)} if found else None
        if body is None:
            body, status = {"itemNotFound": {"code": 404, "message": f"{path} not found"}}, "404 Not Found"
        elif "status" not in locals():
            status = "200 OK"
        data = json.dumps(body, default=str).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    return app


def nova(state: Path) -> None:
    os.environ["OS_NOVA_DISABLE_EVENTLET_PATCHING"] = "1"
    os.environ["OS_NOVA_CONFIG_DIR"] = str(state)
    from nova import monkey_patch

    monkey_patch.patch(backend="threading")

    import oslo_messaging as messaging
    from nova import conf, context, rpc, service
    from nova.api.openstack import wsgi_app
    from nova.compute import rpcapi as compute_rpcapi
    from nova.objects import host_mapping
    from nova.tests import fixtures as nova_fixtures

    # One fake:// bus for every cell: fake transports are per process and per URL.
    buses: dict[None, Any] = {}

    def create_transport(url: Any) -> Any:
        if None not in buses:
            buses[None] = messaging.get_rpc_transport(conf.CONF, allowed_remote_exmods=rpc.get_allowed_exmods())
        return buses[None]

    rpc.create_transport = create_transport
    # nova loads compute_driver from the nova.virt package only.
    import nova_parts

    sys.modules["nova.virt.gpu_fake"] = nova_parts
    sys.argv = [sys.argv[0]]
    app = wsgi_app.init_application("osapi_compute", "nova-api-os-compute")
    harness = _Harness()
    glance = harness.useFixture(nova_fixtures.GlanceFixture(harness))
    neutron = harness.useFixture(nova_fixtures.NeutronFixture(harness))
    for binary in ("nova-conductor", "nova-scheduler"):
        service.Service.create(binary=binary).start()
    service.Service.create(binary="nova-compute", host=conf.CONF.host, topic_alt=compute_rpcapi.RPC_TOPIC_ALT).start()
    host_mapping.discover_hosts(context.get_admin_context())
    ready(state, "nova", url=serve(app) + "/v2.1", catalog=serve(_catalog_app(glance, neutron)),
          images={i["id"]: i["name"] for i in glance.images.values()},
          networks={n["id"]: n["name"] for n in neutron._networks.values()},
          project=nova_fixtures.PROJECT_ID)
    wait_for_term()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    {"placement": placement, "nova": nova, "keystone": keystone}[sys.argv[1]](Path(sys.argv[2]))
    # Now, not once the libraries' worker threads have timed out (seconds): nothing is left to save.
    logging.shutdown()
    os._exit(0)
