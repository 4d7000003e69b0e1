"""``gpud broker`` / ``python -m gpud_broker``: parse options, build the config, serve."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpud import config, daemonize
from gpud.errors import ConfigError
from gpud.heartbeat import HeartbeatPolicy
from gpud.security import SecuritySettings, add_security_arguments, security_flags
from gpud_broker.policies import FACTORIES

if TYPE_CHECKING:
    from gpud.config import OpenStackConfig
    from gpud.resources import TenantLimits
    from gpud_broker.accounts import Budgets
    from gpud_broker.broker import Endpoints
    from gpud_broker.config import BrokerConfig
    from gpud_broker.gate import ConnectionLimits
    from gpud_standby.pair import PairConfig

_D = config.BrokerSection()  # the defaults, for the help texts
DEFAULT_FRONTEND = _D.frontend
DEFAULT_BACKEND = _D.backend
FLAGS = ("name", "frontend", "backend", "admin", "policy", "heartbeat_ms", "liveness", "max_queue",
         "session_lease", "result_ttl", "aging", "reserve_after", "data_path", "max_message_bytes",
         "max_job_input_bytes", "max_echo_bytes", "spool_dir",
         "tenant_max_queued", "tenant_max_bytes", "max_held_bytes", "max_connections", "max_connections_per_source",
         "io_threads", "tenant_echo_bytes_in_flight", "tenant_echo_bytes_per_s")
"""The [broker] keys that have a flag of the same name (--heartbeat-ms for heartbeat_ms)."""
LIMIT_KEYS = ("max_milli", "max_mem", "max_sessions", "max_queued")
STANDBY_FLAGS = ("role", "peer", "peer_bind", "peer_heartbeat_ms", "peer_expiry_ms")
"""The [standby] keys that have a flag of the same name."""
LOG_FLAGS = {"level": "log_level", "file": "log_file"}
"""[logging] key -> its flag's argparse dest (a flag that this parser lacks counts as not given)."""
METRICS_FLAGS = {"listen": "metrics"}
"""[metrics] key -> its flag's argparse dest."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Flags default to None ("not given"): then GPUD_BROKER_*, the file and gpud.config's defaults decide.
    p.add_argument("--config", default=None, metavar="PATH",
                   help=f"configuration file (default {config.DEFAULT_PATH}, where it exists)")
    p.add_argument("--frontend", help=f"endpoint clients connect to (default {_D.frontend})")
    p.add_argument("--backend", help=f"endpoint workers connect to (default {_D.backend})")
    p.add_argument("--admin", help="admin endpoint for gpudctl, e.g. ipc:///run/gpud/admin.sock (default none)")
    p.add_argument("--name", help=f"this broker's name in logs and status (default {_D.name})")
    p.add_argument("--policy", choices=sorted(FACTORIES), help=f"placement policy (default {_D.policy})")
    p.add_argument("--heartbeat-ms", type=int, help=f"heartbeat interval proposed to workers, ms (default {_D.heartbeat_ms})")
    p.add_argument("--liveness", type=int, help=f"heartbeats missed before a worker is gone (default {_D.liveness})")
    p.add_argument("--max-queue", type=int, help=f"queued requests at most, then BUSY (default {_D.max_queue})")
    p.add_argument("--session-lease", type=float, help=f"seconds a session survives a silent client (default {_D.session_lease:g})")
    p.add_argument("--data-path", choices=("auto", "direct", "broker"),
                   help=f"broker: every session CALL is relayed here; direct: none is (sessions call their worker directly); auto: both (default {_D.data_path})")
    p.add_argument("--result-ttl", type=float, help=f"seconds finished replies are kept for retries (default {_D.result_ttl:g})")
    p.add_argument("--max-message-bytes", type=int, help="bytes of one message at most (default: 1 GiB, or memory/8 if less)")
    p.add_argument("--max-job-input-bytes", type=int, help="bytes of one job's input files together (default 4 GiB)")
    p.add_argument("--max-echo-bytes", type=int, help="bytes of one echo's payload (default 64 KiB)")
    p.add_argument("--spool-dir", help="where staged job inputs are spooled (default: a temporary directory)")
    p.add_argument("--tenant-max-queued", type=int, help="requests of one tenant queued at once (default: max_queue/4)")
    p.add_argument("--tenant-max-bytes", type=int, help="payload bytes held for one tenant (default: memory/16, at most 4 GiB)")
    p.add_argument("--max-held-bytes", type=int, help="payload bytes held for all tenants (default: memory/4)")
    p.add_argument("--max-connections", type=int,
                   help="frontend connections at once, from all sources (default: sized from the descriptor limit)")
    p.add_argument("--max-connections-per-source", type=int,
                   help="frontend connections at once from one address (default: max_connections/16, 64 to 1024)")
    p.add_argument("--io-threads", type=int, help="libzmq I/O threads (default: half the CPUs, 2 to 4)")
    p.add_argument("--tenant-echo-bytes-in-flight", type=int,
                   help="a tenant's echo payload bytes in flight; its later messages wait (default: max_echo_bytes)")
    p.add_argument("--tenant-echo-bytes-per-s", type=int,
                   help="a tenant's echo payload bytes a second; past it its later messages wait (default 8 MiB, 0: no bound)")
    p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                   help="fair-share weight of a tenant (default 1); repeat for each tenant")
    p.add_argument("--aging", type=float, help=f"seconds of waiting worth one priority level (default {_D.aging:g})")
    p.add_argument("--reserve-after", type=float,
                   help=f"seconds after which a request that does not fit reserves a worker, bounding backfill (default {_D.reserve_after:g})")
    p.add_argument("--tenant-limit", action="append", default=[], metavar="TENANT:KEY=N[,KEY=N]",
                   help=f"limits of a tenant, KEY one of {', '.join(LIMIT_KEYS)} (0: none); repeat for each tenant")
    add_security_arguments(p, worker=False)
    p.add_argument("--role", choices=("standalone", "primary", "backup"),
                   help="standalone, or this broker's role in a Binary Star pair (default standalone)")
    p.add_argument("--peer", help="the other broker's peer endpoint, e.g. tcp://control-2:5557 (pair only)")
    p.add_argument("--peer-bind", help="where the other broker reaches this one, e.g. tcp://0.0.0.0:5557 (pair only)")
    p.add_argument("--peer-heartbeat-ms", type=int, help="ms between state messages to the peer (default 250)")
    p.add_argument("--peer-expiry-ms", type=int, help="ms of peer silence before it counts as gone (default 750)")
    p.add_argument("--ready-file", default=None, help="write the bound endpoints as JSON here once serving")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free one, see --ready-file; "
                        "default [metrics] listen, else off; needs the extra 'metrics')")
    daemonize.add_arguments(p)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO, or [logging] level)")


def parse_tenant_limits(items: list[str]) -> dict[str, dict[str, int]]:
    """``--tenant-limit TENANT:KEY=N[,KEY=N]`` values as tenant -> key -> N."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        tenant, _, rest = item.partition(":")
        limits = out.setdefault(tenant, {})
        for pair in filter(None, rest.split(",")):
            key, _, value = pair.partition("=")
            if key not in LIMIT_KEYS or not value.isdigit():
                raise ConfigError(f"--tenant-limit {item!r}: use TENANT:KEY=N with KEY one of {', '.join(LIMIT_KEYS)}")
            limits[key] = int(value)
        if not tenant or not limits:
            raise ConfigError(f"--tenant-limit {item!r}: use TENANT:KEY=N[,KEY=N]")
    return out


def tenant_limits(tenants: dict[str, object], flags: dict[str, dict[str, int]]) -> dict[str, TenantLimits]:
    """[broker.tenants.NAME] limits (0: none) merged with --tenant-limit, as the core takes them."""
    from gpud.resources import TenantLimits

    out: dict[str, TenantLimits] = {}
    for name in {*tenants, *flags}:
        values = {k: int(getattr(tenants[name], k, 0) or 0) for k in LIMIT_KEYS} if name in tenants else {}
        values.update(flags.get(name, {}))
        if any(values.values()):
            out[name] = TenantLimits(**{k: v or None for k, v in values.items()})
    return out


def load_config(args: argparse.Namespace) -> config.GpudConfig:
    """The configuration: flags, then GPUD_* variables, then the file, then the defaults."""
    flags = {"broker": config.flag_values(args, FLAGS), "logging": config.flag_values(args, LOG_FLAGS),
             "standby": config.flag_values(args, STANDBY_FLAGS), "metrics": config.flag_values(args, METRICS_FLAGS),
             "security": config.flag_values(args, security_flags(worker=False))}
    return config.load(args.config, os.environ, flags=flags, policies=FACTORIES)


def broker_config(cfg: config.GpudConfig, tenant_weights: dict[str, float] | None = None,
                  limits: dict[str, dict[str, int]] | None = None) -> BrokerConfig:
    """The broker's runtime config from [broker]; ``tenant_weights`` and ``limits`` (from flags)
    override the file's."""
    from gpud_broker.config import DEFAULT_RESULT_BYTES, BrokerConfig, default_max_message_bytes

    b = cfg.broker
    own = budgets(b)
    return BrokerConfig(
        budgets=own if own != budgets(config.BrokerSection(max_queue=b.max_queue, result_bytes=b.result_bytes)) else None,
        max_message_bytes=b.max_message_bytes or default_max_message_bytes(),
        result_bytes=b.result_bytes or DEFAULT_RESULT_BYTES,
        name=b.name,
        heartbeat=HeartbeatPolicy(b.heartbeat_ms / 1000.0, b.liveness),
        policy=b.policy,
        max_queue=b.max_queue,
        session_lease=b.session_lease,
        result_ttl=b.result_ttl,
        tenant_weights={**{name: t.weight for name, t in b.tenants.items()}, **(tenant_weights or {})},
        tenant_limits=tenant_limits(dict(b.tenants), limits or {}),
        aging_s=b.aging,
        reserve_after=b.reserve_after,
        tenant_pool_share=b.tenant_pool_share,
        data_path=b.data_path,
        connection_limits=connection_limits(b),
        io_threads=b.io_threads,
        echo_bytes_in_flight=b.tenant_echo_bytes_in_flight,
        echo_bytes_per_s=b.tenant_echo_bytes_per_s,
        max_job_input_bytes=b.max_job_input_bytes,
        max_echo_bytes=b.max_echo_bytes,
        spool_dir=spool_directory(b.spool_dir, os.environ),
        spool_ram_bytes=b.spool_ram_bytes,
        spool_keep_bytes=b.spool_keep_bytes,
        stage_ttl=b.stage_ttl,
        stage_idle_s=b.stage_idle_s,
        bad_log_s=b.bad_log_s,
        worker_resume_periods=b.worker_resume_periods,
    )


def spool_directory(configured: str, environ: Mapping[str, str]) -> str:
    """``[broker] spool_dir``, else ``spool`` in the state directory systemd made for the unit
    (``$STATE_DIRECTORY``, its first entry), else "" (a temporary directory of the broker's). Under
    systemd the spool then survives a crash where the next start clears it, instead of in /tmp
    for good."""
    if configured:
        return configured
    state = environ.get("STATE_DIRECTORY", "").split(":")[0]
    return os.path.join(state, "spool") if os.path.isabs(state) else ""


def connection_limits(b: config.BrokerSection) -> ConnectionLimits | None:
    """``[broker] max_connections`` and ``max_connections_per_source`` over the defaults sized
    from the descriptor limit the broker raises itself to; None when neither is set (the broker
    sizes them at start)."""
    import resource
    from dataclasses import replace

    from gpud_broker.gate import default_limits

    if not b.max_connections and not b.max_connections_per_source:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = default_limits(hard if hard != resource.RLIM_INFINITY else soft)
    return replace(base, total=b.max_connections or base.total, per_source=b.max_connections_per_source or base.per_source)


def budgets(b: config.BrokerSection) -> Budgets:
    """Every tenant's budgets: ``[broker] tenant_*`` over the defaults sized from the machine, and
    each ``[broker.tenants.NAME]``'s own over those (0: not set)."""
    from gpud_broker.accounts import Budgets, default_budget, default_held_bytes, with_overrides
    from gpud_broker.config import DEFAULT_RESULT_BYTES

    base = default_budget(b.max_queue, result_bytes=b.result_bytes or DEFAULT_RESULT_BYTES)
    if b.tenant_max_queued and not b.tenant_max_outstanding:
        base = with_overrides(base, {"max_outstanding": max(base.max_outstanding, 2 * b.tenant_max_queued)})
    base = with_overrides(base, {
        "max_queued": b.tenant_max_queued, "max_outstanding": b.tenant_max_outstanding, "max_bytes": b.tenant_max_bytes,
        "max_sessions": b.tenant_max_sessions, "max_deadline_ms": b.tenant_max_deadline_ms,
        "reply_bytes": b.tenant_reply_bytes, "max_spool_bytes": b.tenant_max_spool_bytes})
    own = {name: with_overrides(base, {
        "max_queued": t.max_queued, "max_outstanding": t.max_outstanding, "max_bytes": t.max_bytes,
        "max_sessions": t.max_sessions, "max_deadline_ms": t.max_deadline_ms, "reply_bytes": t.reply_bytes})
        for name, t in b.tenants.items()}
    return Budgets(default=base, tenants={n: t for n, t in own.items() if t != base},
                   max_held_bytes=b.max_held_bytes or default_held_bytes(), max_spool_bytes=b.spool_quota_bytes)


def pair_config(cfg: config.GpudConfig) -> PairConfig | None:
    """The Binary Star settings from [standby]; None for a standalone broker."""
    from gpud_standby.pair import PairConfig

    s = cfg.standby
    if s.role == "standalone":
        return None
    if not s.peer or not s.peer_bind:
        raise ConfigError(f"role {s.role} needs both peer and peer_bind ([standby] or --peer/--peer-bind)")
    try:
        return PairConfig(role=s.role, peer=s.peer, bind=s.peer_bind, heartbeat=s.peer_heartbeat_ms / 1000.0,
                          expiry=s.peer_expiry_ms / 1000.0, settle=max(2.0, 2 * cfg.broker.heartbeat_ms / 1000.0))
    except ValueError as exc:
        raise ConfigError(f"[standby]: {exc}") from None


@dataclass(frozen=True, slots=True)
class BrokerPlan:
    """Everything a broker runs with, made from the configuration alone (``plan``): ``run`` takes
    nothing else from it, so a key that changes no field of this has no effect."""

    config: BrokerConfig
    endpoints: Endpoints
    security: SecuritySettings
    metrics: str | None  # HOST:PORT of the Prometheus endpoint; None: none
    pair: PairConfig | None
    openstack: OpenStackConfig
    log_level: str
    log_file: str


def plan(cfg: config.GpudConfig, tenant_weights: dict[str, float] | None = None,
         limits: dict[str, dict[str, int]] | None = None) -> BrokerPlan:
    """The broker's plan from ``cfg`` (and the tenant flags). Raises ConfigError."""
    from gpud_broker.broker import Endpoints

    b = cfg.broker
    return BrokerPlan(config=broker_config(cfg, tenant_weights, limits),
                      endpoints=Endpoints(b.frontend, b.backend, b.admin or None),
                      security=SecuritySettings.from_config(cfg.security, "broker"),
                      metrics=cfg.metrics.listen or None, pair=pair_config(cfg), openstack=cfg.openstack,
                      log_level=cfg.logging.level, log_file=cfg.logging.file)


def run(args: argparse.Namespace) -> int:
    from gpud_broker.broker import serve

    try:
        cfg, log_target = daemonize.configure(args, load_config, "gpud-broker")
    except ConfigError as exc:
        print(f"gpud broker: {exc}", file=sys.stderr)
        return 2
    weights: dict[str, float] = {}
    for item in args.tenant_weight:
        name, _, value = item.partition("=")
        try:
            weights[name] = float(value)
        except ValueError:
            weights[name] = -1.0
        if not name or weights[name] <= 0:
            print(f"gpud broker: --tenant-weight {item!r}: use TENANT=W with W > 0", file=sys.stderr)
            return 2
    try:
        limits = parse_tenant_limits(args.tenant_limit)
        p = plan(cfg, weights, limits)
        daemonize.start(args, "gpud-broker", p.log_level, log_target)  # from here on only a --daemon's grandchild runs
    except ConfigError as exc:
        print(f"gpud broker: {exc}", file=sys.stderr)
        return 2
    try:
        def reloader() -> BrokerConfig:
            # The same layers as at start: the file and GPUD_* variables again, flags still win.
            return broker_config(load_config(args), weights, limits)

        return serve(p.config, p.endpoints, args.ready_file, p.security, metrics=p.metrics, reloader=reloader,
                     pair=p.pair, openstack=p.openstack)
    except ConfigError as exc:  # keys missing or unreadable, a public bind without CURVE
        print(f"gpud broker: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # zmq bind errors and the like: say what failed
        print(f"gpud broker: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    return daemonize.main("gpud broker", "Run the gpud broker.", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
