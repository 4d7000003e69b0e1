"""Configuration: one TOML file, ``GPUD_<SECTION>_<KEY>`` variables and flags, as frozen dataclasses.

Precedence, highest first: command-line flags, the environment, the file, the defaults (the
dataclass fields below). Every value is converted and checked in the layer it comes from, so a bad
value is refused even where a higher layer overrides it, and every error names the key and where it
came from (the file, the variable or the command line). ``load`` collects all errors of a file and
raises one ``ConfigError`` listing them.

The file (default ``/etc/gpud/gpud.toml``; ``systemd/gpud.toml.example`` documents every key) has
one table per section: ``[broker]`` (with ``[broker.tenants.NAME]``), ``[standby]``, ``[worker]``,
``[security]``, ``[metrics]``, ``[openstack]`` and ``[logging]``. In the environment, lists are
comma-separated (``GPUD_WORKER_BROKERS=tcp://a:5556,tcp://b:5556``), tables are ``k=v,k2=v2``,
booleans are true/false/1/0/yes/no, and tenants can only be set in the file.

The ``[broker]`` and ``[worker]`` dataclasses are called sections: the daemons build their runtime
configs (``gpud_broker.config.BrokerConfig``, ``gpud_worker.worker.WorkerConfig``) from them.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar, cast, get_type_hints

from gpud.errors import ConfigError
from gpud.heartbeat import DEFAULT_INTERVAL_S, DEFAULT_LIVENESS

DEFAULT_PATH = "/etc/gpud/gpud.toml"
ENV_PREFIX = "GPUD_"
ENV_ALIASES = {"GPUD_LOG_LEVEL": "GPUD_LOGGING_LEVEL"}
"""Older variable names, used where the new name is not set."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_HEARTBEAT_MS = int(DEFAULT_INTERVAL_S * 1000)

Check = Callable[[Any], "str | None"]
"""A value check: says what is wrong with a value (``"must be >= 10"``), or None when it is good."""

T = TypeVar("T")


def _key(default: T, check: Check | None = None) -> T:
    """A configuration key: its default, and the check every value of it must pass."""
    if isinstance(default, dict):
        return cast(T, field(default_factory=dict, metadata={"check": check}))
    return field(default=default, metadata={"check": check})


# --------------------------------------------------------------------------- checks


def _at_least(lo: int | float) -> Check:
    return lambda v: None if v >= lo else f"must be >= {lo}, got {v!r}"


def _above(lo: int | float) -> Check:
    return lambda v: None if v > lo else f"must be > {lo}, got {v!r}"


def _one_of(*names: str) -> Check:
    return lambda v: None if v in names else f"must be one of {', '.join(names)}; got {v!r}"


def _share(v: float) -> str | None:
    return None if 0 < v <= 1 else f"must be a fraction above 0 and at most 1, got {v!r}"


def _nonempty(v: str) -> str | None:
    return None if v else "must not be empty"


_ENDPOINT_RE = re.compile(r"(tcp|ipc|inproc)://.+\Z")


def _endpoint(v: str) -> str | None:
    return None if _ENDPOINT_RE.match(v) else f"must be an endpoint like tcp://HOST:PORT or ipc:///PATH; got {v!r}"


def _optional_endpoint(v: str) -> str | None:
    return _endpoint(v) if v else None


_PORT_RANGE_RE = re.compile(r"(\d{1,5})-(\d{1,5})\Z")


def _port_range(v: str) -> str | None:
    m = _PORT_RANGE_RE.match(v)
    if not v or (m and 1 <= int(m[1]) <= int(m[2]) <= 65535):
        return None
    return f"must be LOW-HIGH, ports within 1..65535 (empty = any free port); got {v!r}"


def _endpoints(v: tuple[str, ...]) -> str | None:
    if not v:
        return "must name at least one endpoint"
    return next((p for p in map(_endpoint, v) if p), None)


def _host_port(v: str) -> str | None:
    host, _, port = v.rpartition(":")
    if not v or (host and port.isdigit() and int(port) < 65536):
        return None
    return f"must be HOST:PORT (empty = off); got {v!r}"


def _log_level(v: str) -> str | None:
    return None if v.upper() in LOG_LEVELS else f"must be one of {', '.join(LOG_LEVELS)}; got {v!r}"


def _instance_id(v: str) -> str | None:
    """A Nova server id as a worker reports it in READY (at most 64 characters), or "auto"."""
    ok = len(v) <= 64 and all(c.isalnum() or c in "-_." for c in v)
    return None if ok else f"must be a Nova server id (at most 64 of [A-Za-z0-9._-]), \"auto\" or empty; got {v!r}"


def _absolute_or_empty(v: str) -> str | None:
    return None if not v or v.startswith("/") else f"must be an absolute path or empty; got {v!r}"


def uid_range(text: str) -> range | None:
    """``"FIRST-LAST"`` as a range of unprivileged uids; None for ``""``. ValueError if malformed."""
    if not text:
        return None
    first_s, sep, last_s = text.partition("-")
    if not (sep and first_s.isdigit() and last_s.isdigit()):
        raise ValueError(f"must be FIRST-LAST, e.g. 61184-61199; got {text!r}")
    first, last = int(first_s), int(last_s)
    if not 1000 <= first <= last < 2**31:
        raise ValueError(f"must be a range of unprivileged uids (>= 1000); got {text!r}")
    return range(first, last + 1)


def _uids(v: str) -> str | None:
    try:
        uid_range(v)
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """``[broker.tenants.NAME]``: a tenant's fair-share weight and limits (0 = unlimited)."""

    weight: float = _key(1.0, _above(0))
    max_milli: int = _key(0, _at_least(0))  # milli-GPU granted at once
    max_mem: int = _key(0, _at_least(0))  # bytes of device memory granted at once
    max_sessions: int = _key(0, _at_least(0))
    max_queued: int = _key(0, _at_least(0))
    # Budgets: what the broker holds for the tenant (0: the [broker] tenant_* default).
    max_outstanding: int = _key(0, _at_least(0))  # requests and calls accepted, not yet answered
    max_bytes: int = _key(0, _at_least(0))  # payload bytes of those
    max_deadline_ms: int = _key(0, _at_least(0))  # the longest deadline a request may ask for
    reply_bytes: int = _key(0, _at_least(0))  # its share of the reply store


_TENANT_RE = re.compile(r"[A-Za-z0-9._@-]{1,64}\Z")  # as a request's 'tenant' field (PROTOCOL.md)


@dataclass(frozen=True, slots=True)
class BrokerSection:
    """``[broker]``."""

    name: str = _key("broker", _nonempty)
    frontend: str = _key("tcp://127.0.0.1:5555", _endpoint)
    backend: str = _key("tcp://127.0.0.1:5556", _endpoint)
    admin: str = _key("", _optional_endpoint)  # empty: no admin socket
    policy: str = _key("fgd-balanced", _nonempty)  # load(policies=...) checks the name
    heartbeat_ms: int = _key(DEFAULT_HEARTBEAT_MS, _at_least(10))
    liveness: int = _key(DEFAULT_LIVENESS, _at_least(1))
    max_queue: int = _key(10_000, _at_least(1))
    session_lease: float = _key(30.0, _above(0))
    result_ttl: float = _key(60.0, _above(0))
    aging: float = _key(60.0, _above(0))
    reserve_after: float = _key(30.0, _at_least(0))
    data_path: str = _key("auto", _one_of("auto", "direct", "broker"))  # broker: no session goes direct; direct: no CALL is relayed
    # Budgets of every tenant (0: sized from max_queue and this machine's memory; see the example).
    tenant_max_queued: int = _key(0, _at_least(0))
    tenant_max_outstanding: int = _key(0, _at_least(0))
    tenant_max_bytes: int = _key(0, _at_least(0))
    tenant_max_sessions: int = _key(0, _at_least(0))
    tenant_max_deadline_ms: int = _key(0, _at_least(0))
    tenant_reply_bytes: int = _key(0, _at_least(0))
    max_held_bytes: int = _key(0, _at_least(0))  # payload bytes held for all tenants together
    result_bytes: int = _key(0, _at_least(0))  # the reply store, all tenants together
    max_message_bytes: int = _key(0, _at_least(0))  # one message at most (0: 1 GiB, or memory/8 if less)
    max_connections: int = _key(0, _at_least(0))  # frontend connections at once (0: sized from the descriptor limit)
    max_connections_per_source: int = _key(0, _at_least(0))  # of those from one address (0: sized likewise)
    io_threads: int = _key(0, _at_least(0))  # libzmq I/O threads (0: half the CPUs, 2 to 4)
    tenant_echo_bytes_in_flight: int = _key(0, _at_least(0))  # a tenant's echo payload in flight (0: max_echo_bytes)
    tenant_echo_bytes_per_s: int = _key(8 << 20, _at_least(0))  # a tenant's echo payload a second (0: no bound)
    max_job_input_bytes: int = _key(4 << 30, _at_least(0))  # a job's input files together (staged, PROTOCOL.md §11)
    max_echo_bytes: int = _key(64 << 10, _at_least(0))  # an echo's payload (a probe: small)
    spool_dir: str = _key("", _absolute_or_empty)  # staged inputs over spool_ram_bytes (empty: a temporary directory)
    spool_ram_bytes: int = _key(64 << 20, _at_least(0))  # staged bytes of small files kept in memory
    spool_keep_bytes: int = _key(1 << 30, _at_least(0))  # files of ended uploads kept for reuse (0: removed at once)
    spool_quota_bytes: int = _key(16 << 30, _at_least(0))  # staged bytes in the spool, all tenants together
    tenant_max_spool_bytes: int = _key(8 << 30, _at_least(0))  # staged bytes of one tenant
    stage_ttl: float = _key(60.0, _above(0))  # seconds an upload no job claims is kept after its last PUT
    stage_idle_s: float = _key(10.0, _above(0))  # seconds a placed staged job's worker may wait for its upload
    bad_log_s: float = _key(10.0, _above(0))  # per sender, one bad-message line in full per this many seconds (the rest counted)
    worker_resume_periods: int = _key(3, _at_least(0))  # liveness periods a silent worker may come back in (0: none)
    tenants: Mapping[str, TenantLimits] = _key({})
    tenant_pool_share: float = _key(0.5, _share)  # most of a worker's pool users one tenant may hold


@dataclass(frozen=True, slots=True)
class StandbyConfig:
    """``[standby]``: the broker pair (Binary Star, PROTOCOL.md §9)."""

    role: str = _key("standalone", _one_of("standalone", "primary", "backup"))
    peer: str = _key("", _optional_endpoint)  # the peer's state endpoint
    peer_bind: str = _key("", _optional_endpoint)  # where this broker publishes its state
    peer_heartbeat_ms: int = _key(250, _at_least(10))  # a failover in about a second
    peer_expiry_ms: int = _key(750, _at_least(10))


@dataclass(frozen=True, slots=True)
class WorkerSection:
    """``[worker]``."""

    name: str = _key("")  # empty: the host name
    brokers: tuple[str, ...] = _key(("tcp://127.0.0.1:5556",), _endpoints)
    simulate: int = _key(0, _at_least(0))
    gpu_model: str = _key("SIM-GPU", _nonempty)
    gpu_mem: int = _key(16 << 30, _at_least(1))
    slots: int = _key(64, _at_least(1))
    heartbeat_ms: int = _key(DEFAULT_HEARTBEAT_MS, _at_least(10))
    liveness: int = _key(DEFAULT_LIVENESS, _at_least(1))
    workdir: str = _key("")  # empty: /var/lib/gpud/jobs as root, else under $TMPDIR
    job_user_prefix: str = _key("gpud-job", _nonempty)
    job_uids: str = _key("", _uids)  # "FIRST-LAST": dynamic uids instead of pool users
    session_idle: float = _key(600.0, _above(0))
    session_processes: str = _key("auto", _one_of("auto", "on", "off"))  # auto: on for real GPUs
    session_staging: int = _key(8 << 20, _at_least(4096))  # a session process's shared copy buffer
    compile_user: str = _key("nobody", _nonempty)  # as root, nvcc runs as this user
    drain_timeout: float = _key(30.0, _at_least(0))
    reconnect_max: float = _key(5.0, _above(0))  # seconds: the longest wait between reconnects to a silent broker
    replica_of: str = _key("")  # the worker whose work this one takes first when it is lost
    data_bind: str = _key("", _optional_endpoint)  # where clients send session CALLs directly; empty: nowhere
    data_advertise: str = _key("", _optional_endpoint)  # the endpoint clients are told (empty: from data_bind)
    data_ports: str = _key("", _port_range)  # "LOW-HIGH": the ports of direct sessions' own sockets (empty: any free)
    max_job_output_bytes: int = _key(1 << 30, _at_least(0))  # a job's output files together (PROTOCOL.md §11.5)
    max_held_output_bytes: int = _key(16 << 30, _at_least(0))  # finished jobs' staged outputs held on disk, together
    probation_s: float = _key(300.0, _at_least(0))  # a failed GPU's checks pass this long before it serves
    fault_file: str = _key("")  # SIMULATED GPU faults, read on SIGUSR2; empty: none
    instance_id: str = _key("", _instance_id)  # its Nova server id; "auto": the metadata service
    cgroups: str = _key("auto", _one_of("auto", "off"))  # a cgroup v2 per job where usable
    cgroup_parent: str = _key("", _absolute_or_empty)  # empty: the worker's own (delegated) cgroup
    job_memory: int = _key(0, _at_least(0))  # memory.max of a job whose grant has no host_mem; 0: none
    mps: bool = _key(False)  # CUDA MPS runs here: jobs and sessions get their grant's MPS limits
    mps_pipe_dir: str = _key("", _absolute_or_empty)  # empty: $CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps
    mps_log_dir: str = _key("", _absolute_or_empty)  # empty: $CUDA_MPS_LOG_DIRECTORY, else /var/log/nvidia-mps
    job_network: str = _key("none", _one_of("none", "host"))  # none: jobs get loopback only; host: the VM's network
    job_tmp_size: int = _key(256 << 20, _at_least(1 << 20))  # bytes of a job's private /tmp, /var/tmp and /dev/shm each
    job_dir_size: int = _key(1 << 30, _at_least(0))  # bytes a job's directory may hold (its own tmpfs); 0: no limit


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """``[security]``. Key paths are as given: ``for_role`` makes them the files a daemon uses
    (an empty path is a name in ``keys_dir``, a relative one is taken inside ``keys_dir``)."""

    mode: str = _key("curve", _one_of("curve", "none"))
    allow_public_bind: bool = _key(False)  # with mode "none": bind beyond loopback
    keys_dir: str = _key("/etc/gpud/keys", _nonempty)
    secret_key_file: str = _key("")
    public_key_file: str = _key("")
    broker_public_key_file: str = _key("")
    worker_keys_dir: str = _key("")
    client_keys_dir: str = _key("")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """``[metrics]``."""

    listen: str = _key("", _host_port)  # empty: no metrics endpoint


_SERVER_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,39}\Z")


def _server_metadata(v: Mapping[str, str]) -> str | None:
    """Nova's limits on server metadata: keys 1-255 characters, values at most 255."""
    bad = next((k for k, val in v.items() if not 0 < len(k) <= 255 or len(val) > 255), None)
    return None if bad is None else f"keys must be 1-255 characters and values at most 255; see {bad!r}"


def _server_tags(v: tuple[str, ...]) -> str | None:
    """Nova's rules for server tags: 1-60 characters, neither ',' nor '/'."""
    bad = next((t for t in v if not 0 < len(t) <= 60 or "," in t or "/" in t), None)
    return None if bad is None else f"a tag is 1-60 characters without ',' or '/'; got {bad!r}"


def _server_prefix(v: str) -> str | None:
    return None if _SERVER_PREFIX_RE.match(v) else f"must be 1-40 of [A-Za-z0-9-], not starting with '-'; got {v!r}"


def _optional_endpoints(v: tuple[str, ...]) -> str | None:
    return _endpoints(v) if v else None


@dataclass(frozen=True, slots=True)
class OpenStackConfig:
    """``[openstack]``: GPU VMs through Nova (``gpud_broker.openstack``). The broker talks to Nova
    only when ``enabled``; healing and scaling are off unless ``heal`` and ``scale`` are on."""

    enabled: bool = _key(False)
    cloud: str = _key("")  # a cloud of clouds.yaml; empty: the OS_* variables
    region: str = _key("")  # empty: the cloud's (or $OS_REGION_NAME)
    image: str = _key("")  # name or id
    flavor: str = _key("")  # name or id; one with a pci_passthrough:alias (or vGPU) extra spec
    network: str = _key("")  # name or id; empty: Nova's automatic network
    key_name: str = _key("")
    worker_metadata: Mapping[str, str] = field(default_factory=lambda: {"gpud:role": "worker"},
                                               metadata={"check": _server_metadata})
    worker_tags: tuple[str, ...] = _key((), _server_tags)
    name_prefix: str = _key("gpud-worker", _server_prefix)  # booted servers: PREFIX-RANDOM
    brokers: tuple[str, ...] = _key((), _optional_endpoints)  # backend endpoints booted workers use
    install: str = _key("gpud[worker,daemon]", _nonempty)  # what booted workers pip install
    user_data: str = _key("")  # a cloud-init template file; empty: the built-in one
    min_workers: int = _key(0, _at_least(0))
    max_workers: int = _key(0, _at_least(0))
    heal: bool = _key(False)
    heal_after: float = _key(120.0, _above(0))  # seconds without a worker, server ERROR/SHUTOFF
    reboot_timeout: float = _key(300.0, _above(0))  # seconds to come back, or it is replaced
    scale: bool = _key(False)
    grow_after: float = _key(300.0, _above(0))  # seconds of a backlogged queue per extra worker
    shrink_after: float = _key(1800.0, _above(0))  # seconds idle before a worker is retired
    boot_timeout: float = _key(900.0, _above(0))  # seconds from boot to a connected worker
    retire_timeout: float = _key(600.0, _at_least(0))  # seconds a draining worker may finish its work
    poll_interval: float = _key(30.0, _above(0))  # seconds between two server lists
    api_timeout: float = _key(30.0, _above(0))  # seconds per Nova request
    api_retries: int = _key(3, _at_least(0))  # retries of a failed Nova request that may succeed later


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """``[logging]``."""

    level: str = _key("INFO", _log_level)
    file: str = _key("")  # a path, or "syslog"; empty: stderr


@dataclass(frozen=True, slots=True)
class GpudConfig:
    """The whole configuration. ``path`` is the file that was read ("" when none was)."""

    path: str = ""
    broker: BrokerSection = field(default_factory=BrokerSection)
    standby: StandbyConfig = field(default_factory=StandbyConfig)
    worker: WorkerSection = field(default_factory=WorkerSection)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    openstack: OpenStackConfig = field(default_factory=OpenStackConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type[Any]] = {
    "broker": BrokerSection,
    "standby": StandbyConfig,
    "worker": WorkerSection,
    "security": SecurityConfig,
    "metrics": MetricsConfig,
    "openstack": OpenStackConfig,
    "logging": LoggingConfig,
}
"""Section name -> its dataclass (and its field in GpudConfig), in file order."""

ROLE_SECTIONS = {
    "broker": ("broker", "standby", "security", "metrics", "openstack", "logging"),
    "worker": ("worker", "security", "logging"),
}
"""The sections each daemon reads."""

_TENANTS = Mapping[str, TenantLimits]


# --------------------------------------------------------------------------- conversion


def _typed(hint: object, value: object) -> object:
    """``value`` as TOML or argparse gives it, as type ``hint``; ValueError says what is wrong."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and number and isinstance(value, int):
        return value
    if hint is float and number and math.isfinite(cast(float, value)):
        return float(cast(float, value))
    if hint is str and isinstance(value, str):
        return value
    if hint == tuple[str, ...] and isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if hint == Mapping[str, str] and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    want: dict[object, str] = {bool: "true or false", int: "an integer", float: "a finite number",
                               str: "a string", tuple[str, ...]: "a list of strings",
                               Mapping[str, str]: "a table of strings"}
    raise ValueError(f"must be {want.get(hint, 'a table')}, got {value!r}")


def _from_text(hint: object, text: str) -> object:
    """An environment variable's ``text`` as type ``hint``."""
    if hint is bool:
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
        if text.strip().lower() not in words:
            raise ValueError(f"must be true or false, got {text!r}")
        return words[text.strip().lower()]
    if hint is int or hint is float:
        try:
            return _typed(hint, int(text) if hint is int else float(text))
        except ValueError:
            raise ValueError(f"must be {'an integer' if hint is int else 'a number'}, got {text!r}") from None
    if hint == tuple[str, ...]:
        return tuple(s.strip() for s in text.split(",") if s.strip())
    if hint == Mapping[str, str]:
        pairs = [p.partition("=") for p in text.split(",") if p.strip()]
        if not all(sep and k.strip() for k, sep, _ in pairs):
            raise ValueError(f"must be KEY=VALUE,KEY=VALUE; got {text!r}")
        return {k.strip(): v.strip() for k, _, v in pairs}
    if hint == _TENANTS:
        raise ValueError("tenants can be set only in the file ([broker.tenants.NAME])")
    return text


Where = Callable[[str], str]
"""Key -> how an error names it and its origin, e.g. ``/etc/gpud/gpud.toml: [broker] policy``."""


def _named(prefix: str, suffix: str = "") -> Where:
    return lambda key: f"{prefix}{key}{suffix}"


def _check_table(cls: type[Any], table: Mapping[str, object], where: Where, errors: list[str],
                 text: bool = False, extra: Mapping[str, Check] | None = None) -> dict[str, Any]:
    """The good values of ``table`` for dataclass ``cls``; what is wrong goes to ``errors``.
    ``text``: the values are strings from the environment. ``extra``: more checks by key."""
    hints = get_type_hints(cls)
    checks = {f.name: f.metadata.get("check") for f in fields(cls)}
    good: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in hints:
            errors.append(f"{where(key)}: unknown key (known: {', '.join(hints)})")
            continue
        try:
            value = _from_text(hints[key], raw) if text and isinstance(raw, str) else _typed(hints[key], raw)
        except ValueError as exc:
            errors.append(f"{where(key)}: {exc}")
            continue
        problem = next((p for c in (checks[key], (extra or {}).get(key)) if c and (p := c(value))), None)
        if problem:
            errors.append(f"{where(key)}: {problem}")
        else:
            good[key] = value
    return good


KEY_FILES = {
    "secret_key_file": "{role}.key_secret",
    "public_key_file": "{role}.key",
    "broker_public_key_file": "broker.key",
    "worker_keys_dir": "workers",
    "client_keys_dir": "clients",
}
"""[security] path key -> its file in ``keys_dir`` where it is empty; ``{role}``: broker or worker."""
ROLE_KEY_FILES = {
    "broker": ("secret_key_file", "public_key_file", "worker_keys_dir", "client_keys_dir"),
    "worker": ("secret_key_file", "public_key_file", "broker_public_key_file"),
}
"""The [security] paths each daemon uses: its own pair, and the broker's allow-lists or public key."""


def for_role(sec: SecurityConfig, role: str) -> SecurityConfig:
    """``sec`` with every key path as the ``broker`` or ``worker`` uses it: an empty one is its
    ``KEY_FILES`` name in ``keys_dir`` (``worker.key_secret`` for a worker), a relative one is
    inside ``keys_dir``; an absolute one stays. An empty public key file beside a chosen secret
    one is its ``NAME.key``."""
    paths: dict[str, Any] = {key: os.path.join(sec.keys_dir, getattr(sec, key) or name.format(role=role))
                             for key, name in KEY_FILES.items()}
    if sec.secret_key_file and not sec.public_key_file and paths["secret_key_file"].endswith(".key_secret"):
        paths["public_key_file"] = paths["secret_key_file"].removesuffix("_secret")  # NAME.key beside NAME.key_secret
    return replace(sec, **paths)


def key_file_problems(sec: SecurityConfig, role: str) -> list[str]:
    """What is wrong with the key files a ``broker`` or ``worker`` would use (``for_role``): each
    must exist; a secret key file must be its owner's alone, and nothing else writable by others
    (who could write a key directory could add a key and be admitted). Nothing with mode none."""
    if sec.mode == "none":
        return []
    sec = for_role(sec, role)
    problems: list[str] = []
    for key in ROLE_KEY_FILES[role]:
        path = getattr(sec, key)
        is_dir = key.endswith("_dir")
        try:
            st = os.stat(path)
        except OSError as exc:
            if key == "public_key_file" and isinstance(exc, FileNotFoundError):
                continue  # optional: checked against the secret key only where it exists
            problems.append(f"[security] {key}: {path}: {exc.strerror}")
            continue
        mode = stat.S_IMODE(st.st_mode)
        if is_dir != stat.S_ISDIR(st.st_mode):
            problems.append(f"[security] {key}: {path} is not a {'directory' if is_dir else 'file'}")
        elif key == "secret_key_file" and mode & 0o077:
            problems.append(f"[security] {key}: {path} has mode {mode:04o}; a secret key must be its "
                            f"owner's alone: chmod 600 {path}")
        elif mode & 0o022:
            problems.append(f"[security] {key}: {path} has mode {mode:04o}: others may change it "
                            f"(and so choose who is admitted); chmod go-w {path}")
    return problems


# --------------------------------------------------------------------------- layers

Layer = dict[str, dict[str, tuple[object, str]]]
"""Section -> key -> (checked value, where it came from)."""


def _put(layer: Layer, section: str, good: Mapping[str, object], where: Where) -> None:
    layer[section].update({k: (v, where(k)) for k, v in good.items()})


def _read(path: str, explicit: bool) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: no such configuration file") from None
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _file_layer(path: str, doc: Mapping[str, object], errors: list[str], extra: Mapping[str, Mapping[str, Check]]) -> Layer:
    layer: Layer = {s: {} for s in SECTIONS}
    for section, table in doc.items():
        if section not in SECTIONS:
            errors.append(f"{path}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
            continue
        if not isinstance(table, dict):
            errors.append(f"{path}: {section} must be a table [{section}]")
            continue
        table = dict(table)
        tenants = table.pop("tenants", None) if section == "broker" else None
        where = _named(f"{path}: [{section}] ")
        _put(layer, section, _check_table(SECTIONS[section], table, where, errors, extra=extra.get(section)), where)
        if tenants is not None:
            _put(layer, "broker", {"tenants": _tenants(path, tenants, errors)}, where)
    return layer


def _tenants(path: str, tables: object, errors: list[str]) -> dict[str, TenantLimits]:
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        errors.append(f"{path}: [broker] tenants: must be tables [broker.tenants.NAME]")
        return {}
    out: dict[str, TenantLimits] = {}
    for name, table in tables.items():
        where = _named(f"{path}: [broker.tenants.{name}] ")
        if not _TENANT_RE.match(name):
            errors.append(f"{path}: [broker.tenants.{name}]: a tenant name is 1-64 of [A-Za-z0-9._@-]")
        else:
            out[name] = TenantLimits(**_check_table(TenantLimits, table, where, errors))
    return out


def _env_layer(env: Mapping[str, str], errors: list[str], extra: Mapping[str, Mapping[str, Check]]) -> Layer:
    layer: Layer = {s: {} for s in SECTIONS}
    names = {**{new: old for old, new in ENV_ALIASES.items() if old in env and new not in env},
             **{n: n for n in env if n.startswith(ENV_PREFIX)}}
    for name, source in sorted(names.items()):
        section, _, key = name[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS or not key:
            continue  # not ours (GPUD_ADMIN, GPUD_JOB_ID, ...)
        where = _named(f"environment {source} ([{section}] ", ")")
        good = _check_table(SECTIONS[section], {key: env[source]}, where, errors, text=True, extra=extra.get(section))
        _put(layer, section, good, where)
    return layer


def _flag_layer(flags: Mapping[str, Mapping[str, object]], errors: list[str],
                extra: Mapping[str, Mapping[str, Check]]) -> Layer:
    layer: Layer = {s: {} for s in SECTIONS}
    for section, values in flags.items():
        where = _named(f"command line ([{section}] ", ")")
        given = {k: v for k, v in values.items() if v is not None}
        _put(layer, section, _check_table(SECTIONS[section], given, where, errors, extra=extra.get(section)), where)
    return layer


def _cross_checks(cfg: GpudConfig, origin: Callable[[str, str], str]) -> list[str]:
    """Checks that involve more than one key."""
    errors = []
    s = cfg.standby
    if s.role != "standalone" and not (s.peer and s.peer_bind):
        errors.append(f"{origin('standby', 'role')}: role {s.role!r} needs [standby] peer and peer_bind")
    if s.peer_expiry_ms <= s.peer_heartbeat_ms:
        errors.append(f"{origin('standby', 'peer_expiry_ms')}: must be more than peer_heartbeat_ms ({s.peer_heartbeat_ms})")
    o = cfg.openstack
    if o.max_workers < o.min_workers:
        errors.append(f"{origin('openstack', 'max_workers')}: must be >= min_workers ({o.min_workers})")
    if o.enabled and not (o.worker_metadata or o.worker_tags):
        errors.append(f"{origin('openstack', 'worker_metadata')}: with [openstack] enabled, worker_metadata "
                      "or worker_tags must say which servers are gpud workers")
    if o.enabled and o.scale and o.max_workers < 1:
        errors.append(f"{origin('openstack', 'max_workers')}: [openstack] scale needs max_workers >= 1")
    return errors


def load(path: str | None = None, env: Mapping[str, str] = os.environ, *,
         flags: Mapping[str, Mapping[str, object]] | None = None,
         policies: Collection[str] | None = None, default_path: str = DEFAULT_PATH) -> GpudConfig:
    """The configuration from ``flags``, then ``env``, then the file, then the defaults.

    Args:
        path: the file; None reads ``default_path`` where it exists (a missing ``path`` is an error).
        env: the environment; ``GPUD_<SECTION>_<KEY>`` variables set keys.
        flags: section -> key -> value from the command line; None values count as not given.
        policies: the placement policy names ``[broker] policy`` may take (None: not checked).
    Raises:
        ConfigError: listing every unknown section or key and bad value, each with its origin.
    """
    read = path or default_path
    doc = _read(read, explicit=path is not None)
    extra = {"broker": {"policy": _one_of(*sorted(policies))}} if policies is not None else {}
    errors: list[str] = []
    layers = [_file_layer(read, doc or {}, errors, extra), _env_layer(env, errors, extra),
              _flag_layer(flags or {}, errors, extra)]
    merged = {s: {k: v for layer in layers for k, v in layer[s].items()} for s in SECTIONS}
    if errors:
        raise ConfigError("\n".join(errors))
    built: dict[str, Any] = {s: cls(**{k: v for k, (v, _) in merged[s].items()}) for s, cls in SECTIONS.items()}
    cfg = GpudConfig(path=read if doc is not None else "", **built)

    def origin(section: str, key: str) -> str:
        return merged[section][key][1] if key in merged[section] else f"[{section}] {key} (default)"

    errors = _cross_checks(cfg, origin)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def flag_values(namespace: object, names: Mapping[str, str] | Iterable[str]) -> dict[str, object]:
    """Key -> flag value from an argparse namespace, for ``load(flags=...)``. ``names`` maps keys
    to argparse dests (or lists keys that are their own dests); flags left at None are not given."""
    dests = names if isinstance(names, Mapping) else {n: n for n in names}
    return {key: getattr(namespace, dest, None) for key, dest in dests.items()}


# --------------------------------------------------------------------------- output


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def dump(cfg: GpudConfig, sections: Iterable[str] = SECTIONS) -> str:
    """``cfg`` (the named sections) as TOML that ``load`` reads back to the same values."""
    lines: list[str] = []
    for name in sections:
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        tables: list[tuple[str, TenantLimits]] = []
        for f in fields(section):
            value = getattr(section, f.name)
            if f.name == "tenants":
                tables += [(f"{name}.tenants.{json.dumps(t)}", limits) for t, limits in value.items()]
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        for header, table in tables:
            lines += ["", f"[{header}]", *(f"{f.name} = {_toml_value(getattr(table, f.name))}" for f in fields(table))]
        lines.append("")
    return "\n".join(lines)
