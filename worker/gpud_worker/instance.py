"""This GPU VM's Nova server id, as the worker reports it in READY (``instance_id``).

``[worker] instance_id`` (``--instance-id``) gives it, or ``"auto"`` asks OpenStack's metadata
service: ``uuid`` in ``/openstack/latest/meta_data.json``. The question has a short deadline and
never stops the worker from starting: without an answer the id is unknown ("") and the broker
cannot match this worker to its server (``gpudctl openstack list`` shows both unmatched).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

METADATA_URL = "http://169.254.169.254/openstack/latest/meta_data.json"
AUTO = "auto"
TIMEOUT_S = 2.0  # seconds for the whole question, at most
MAX_BYTES = 1 << 20  # of meta_data.json read at most


def resolve(value: str, url: str = METADATA_URL, timeout: float = TIMEOUT_S) -> str:
    """``value`` itself, or for ``"auto"`` the server id the metadata service at ``url`` tells
    ("" when it does not answer in ``timeout`` seconds, or answers nonsense; logged)."""
    if value != AUTO:
        return value
    deadline = time.monotonic() + timeout
    try:
        # A proxy must not answer for the link-local metadata service.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=timeout) as resp:
            body = resp.read(MAX_BYTES + 1)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete answer within {timeout:g}s")
        if len(body) > MAX_BYTES:
            raise ValueError("the answer is larger than 1 MiB")
        doc = json.loads(body)
        uuid = doc.get("uuid") if isinstance(doc, dict) else None
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 64 or not all(c.isalnum() or c in "-_." for c in uuid):
            raise ValueError(f"no usable 'uuid' in it ({str(uuid)[:40]!r})")
    except (OSError, urllib.error.URLError, ValueError, TimeoutError) as exc:
        log.warning("instance_id auto: the metadata service %s did not tell this server's id (%s); "
                    "reporting none, so the broker cannot match this worker to its Nova server", url, exc)
        return ""
    log.info("instance_id auto: this is Nova server %s", uuid)
    return uuid
