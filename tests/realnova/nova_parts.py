"""Pieces the real Nova of the tests loads by name (run in .venv-nova, never in gpud's venv):

- ``token_filter``: keystonemiddleware's auth_token (Keystone's tokens validated, identity headers
  a caller sent stripped, 401 for a bad token), with one addition, since Nova 34 has no noauth2:
  a stand-in token ``USER:PROJECT[:ROLE,ROLE]`` (no Keystone token has a colon) becomes the
  X-User-Id, X-Project-Id and X-Roles headers that auth_token would set, without asking Keystone.
  Nova's own policy still decides what each caller may do.
- ``GpuFakeDriver``: nova's MediumFakeDriver (servers go ACTIVE at once, stop and reboot for
  real) reporting fifteen NVIDIA A100 PCI devices, which ``[pci] device_spec`` and ``alias`` match and
  the PciPassthroughFilter schedules, and four VGPU in placement, which a flavor's
  ``resources:VGPU`` asks for.
"""

from __future__ import annotations

import json
from typing import Any

from nova.virt import fake

GPU_VENDOR = "10de"
GPU_PRODUCT = "20b5"
GPU_ADDRESSES = tuple(f"0000:{bus:02x}:00.0" for bus in range(0x10, 0x100, 0x10))  # 15
VGPUS = 4


def _stand_in(token: str) -> tuple[str, str, str] | None:
    """(user, project, roles) of a stand-in token, None for any other (a Keystone token)."""
    parts = token.split(":")
    if len(parts) not in (2, 3) or not all(parts[:2]):
        return None
    return parts[0], parts[1], parts[2] if len(parts) == 3 and parts[2] else "member,reader"


def token_filter(global_conf: dict[str, Any], **local_conf: Any) -> Any:
    from keystonemiddleware import auth_token

    def make(app: Any) -> Any:
        keystone = auth_token.filter_factory(global_conf, **local_conf)(app)

        def middleware(environ: dict[str, Any], start_response: Any) -> Any:
            found = _stand_in(environ.get("HTTP_X_AUTH_TOKEN", ""))
            if found is None:
                return keystone(environ, start_response)  # validated by Keystone, or 401
            for header in list(environ):  # whatever the caller sent: only the token speaks
                if header.startswith(("HTTP_X_USER", "HTTP_X_PROJECT", "HTTP_X_ROLE", "HTTP_X_IDENTITY",
                                      "HTTP_X_SERVICE", "HTTP_X_TENANT", "HTTP_X_DOMAIN")):
                    del environ[header]
            user, project, roles = found
            environ.update({"HTTP_X_USER_ID": user, "HTTP_X_USER_NAME": user, "HTTP_X_PROJECT_ID": project,
                            "HTTP_X_PROJECT_NAME": project, "HTTP_X_ROLES": roles, "HTTP_X_IDENTITY_STATUS": "Confirmed"})
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

    def update_provider_tree(self, provider_tree: Any, nodename: str, allocations: Any = None) -> None:
        super().update_provider_tree(provider_tree, nodename, allocations)
        inventory = dict(provider_tree.data(nodename).inventory)
        inventory["VGPU"] = {"total": VGPUS, "min_unit": 1, "max_unit": VGPUS, "step_size": 1, "allocation_ratio": 1.0,
                             "reserved": 0}
        provider_tree.update_inventory(nodename, inventory)
