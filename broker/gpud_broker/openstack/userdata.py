"""The cloud-init user data of a GPU VM the broker boots.

The template (``cloud-init-worker.yaml.in`` next to this module, or ``[openstack] user_data``) has
``{{ name }}`` placeholders for single-line values: the server's ``name``, the ``brokers`` it
connects to (a TOML list), the ``security_mode``, what pip should ``install`` (shell-quoted), and
the worker's CURVE key pair and the broker's public key. Each boot gets a key pair of its own,
made here; its public key goes into the broker's worker allow-list (``worker_keys_dir``) as
``NAME.key`` so that the broker admits the new worker, and is removed with the server.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).with_name("cloud-init-worker.yaml.in")
FIELDS = ("name", "brokers", "install", "security_mode", "worker_public_key", "worker_secret_key", "broker_public_key")
MAX_BYTES = 49_000  # Nova takes at most 65535 bytes of base64, which this is 4/3 of
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class TemplateError(ValueError):
    """The template cannot be used: unreadable, an unknown placeholder, or too large."""


def load(path: str = "") -> str:
    """The template: the file ``path``, or the built-in one; checked by rendering it once."""
    source = Path(path) if path else TEMPLATE
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(f"cannot read the cloud-init template {source}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TemplateError(f"the cloud-init template {source} is not UTF-8 text") from None
    render(text, {f: "x" for f in FIELDS}, where=str(source))
    return text


def render(template: str, values: Mapping[str, str], where: str = "the cloud-init template") -> str:
    """``template`` with each ``{{ key }}`` replaced by ``values[key]`` (single lines only)."""
    unknown = sorted({m.group(1) for m in _PLACEHOLDER.finditer(template)} - set(values))
    if unknown:
        raise TemplateError(f"{where}: unknown placeholder(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    bad = next((k for k, v in values.items() if "\n" in v or "\r" in v), None)
    if bad is not None:
        raise TemplateError(f"{where}: the value of {bad} must be one line")
    out = _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
    if len(out.encode()) > MAX_BYTES:
        raise TemplateError(f"{where}: the user data is {len(out.encode())} bytes; Nova takes at most {MAX_BYTES}")
    return out


@dataclass(frozen=True)
class WorkerKeys:
    """A new worker's CURVE pair (Z85 text) and the broker's public key ("" with security none)."""

    public: str
    secret: str
    broker_public: str


def new_keys(broker_public: str) -> WorkerKeys:
    import zmq

    public, secret = zmq.curve_keypair()
    return WorkerKeys(public.decode(), secret.decode(), broker_public)


def values(name: str, brokers: Sequence[str], install: str, security_mode: str, keys: WorkerKeys) -> dict[str, str]:
    """The placeholders' values for server ``name``."""
    return {
        "name": name,
        "brokers": json.dumps(list(brokers)),  # a TOML array of basic strings
        "install": shlex.quote(install),
        "security_mode": security_mode,
        "worker_public_key": keys.public,
        "worker_secret_key": keys.secret,
        "broker_public_key": keys.broker_public,
    }


def public_certificate(public: str, name: str) -> str:
    """A ``NAME.key`` file for the broker's worker allow-list (as ``gpud keygen`` writes them)."""
    return (f"#   ZeroMQ CURVE Public Certificate of gpud worker {name}, booted by the broker\n"
            f'metadata\ncurve\n    public-key = "{public}"\n')
