"""Pieces the real Nova of the tests loads by name (run in .venv-nova, never in gpud's venv):

- ``token_filter``: the paste filter that stands in for keystonemiddleware (Nova 34 has no
  noauth2): the token ``USER:PROJECT[:ROLE,ROLE]`` becomes the X-User-Id, X-Project-Id and X-Roles
  headers that keystonemiddleware would set after validating a token; Nova's own policy still
  decides what each caller may do. No token, or one of another shape: 401.
- ``GpuFakeDriver``: nova's MediumFakeDriver (servers go ACTIVE at once, stop and reboot for
  real) reporting eight NVIDIA A100 PCI devices, which ``[pci] device_spec`` and ``alias`` match and
  the PciPassthroughFilter schedules.
"""

from __future__ import annotations

import json
from typing import Any

from nova.virt import fake

GPU_VENDOR = "10de"
GPU_PRODUCT = "20b5"
GPU_ADDRESSES = tuple(f"0000:{bus:02x}:00.0" for bus in (0x17, 0x31, 0x4b, 0x65, 0x81, 0x98, 0xb1, 0xca))


def token_filter(global_conf: dict[str, Any], **local_conf: Any) -> Any:
    def make(app: Any) -> Any:
        def middleware(environ: dict[str, Any], start_response: Any) -> Any:
            token = environ.get("HTTP_X_AUTH_TOKEN", "")
            parts = token.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]):
                start_response("401 Unauthorized", [("Content-Type", "application/json")])
                return [b'{"error": {"code": 401, "message": "The request you have made requires authentication."}}']
            roles = parts[2] if len(parts) == 3 and parts[2] else "member,reader"
            for header in list(environ):  # whatever the caller sent: only the token speaks
                if header.startswith(("HTTP_X_USER", "HTTP_X_PROJECT", "HTTP_X_ROLE", "HTTP_X_IDENTITY",
                                      "HTTP_X_SERVICE", "HTTP_X_TENANT")):
                    del environ[header]
            environ.update({"HTTP_X_USER_ID": parts[0], "HTTP_X_USER_NAME": parts[0],
                            "HTTP_X_PROJECT_ID": parts[1], "HTTP_X_PROJECT_NAME": parts[1],
                            "HTTP_X_ROLES": roles, "HTTP_X_IDENTITY_STATUS": "Confirmed"})
            return app(environ, start_response)
        return middleware
    return make


class GpuFakeDriver(fake.MediumFakeDriver):
    def get_available_resource(self, nodename: str) -> dict[str, Any]:
        status: dict[str, Any] = super().get_available_resource(nodename)
        status["pci_passthrough_devices"] = json.dumps([
            {"address": a, "vendor_id": GPU_VENDOR, "product_id": GPU_PRODUCT, "status": "available",
             "dev_type": "type-PCI", "parent_addr": None, "numa_node": None, "label": "label_10de_20b5"}
            for a in GPU_ADDRESSES])
        return status
