"""``gpud broker`` / ``python -m gpud_broker``: parse options, build the config, serve."""

from __future__ import annotations

import argparse
import sys

from gpud.heartbeat import DEFAULT_INTERVAL_S, DEFAULT_LIVENESS, HeartbeatPolicy
from gpud.log import setup_logging
from gpud_broker.policies import POLICIES

DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"
DEFAULT_BACKEND = "tcp://127.0.0.1:5556"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frontend", default=DEFAULT_FRONTEND, help="endpoint clients connect to (default %(default)s)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, help="endpoint workers connect to (default %(default)s)")
    p.add_argument("--admin", default=None, help="admin endpoint for gpudctl, e.g. ipc:///run/gpud/admin.sock")
    p.add_argument("--name", default="broker", help="this broker's name in logs and status")
    p.add_argument("--policy", default="balanced", choices=sorted(POLICIES), help="placement policy")
    p.add_argument("--heartbeat-ms", type=int, default=int(DEFAULT_INTERVAL_S * 1000), help="heartbeat interval proposed to workers, ms")
    p.add_argument("--liveness", type=int, default=DEFAULT_LIVENESS, help="heartbeats missed before a worker is gone")
    p.add_argument("--max-queue", type=int, default=10_000, help="queued requests at most (then BUSY)")
    p.add_argument("--session-lease", type=float, default=30.0, help="seconds a session survives a silent client")
    p.add_argument("--result-ttl", type=float, default=60.0, help="seconds finished replies are kept for retries")
    p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                   help="fair-share weight of a tenant (default 1); repeat for each tenant")
    p.add_argument("--aging", type=float, default=60.0, help="seconds of waiting worth one priority level")
    p.add_argument("--reserve-after", type=float, default=30.0,
                   help="seconds after which a request that does not fit reserves a worker (bounds backfill)")
    p.add_argument("--ready-file", default=None, help="write the bound endpoints as JSON here once serving")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO or $GPUD_LOG_LEVEL)")


def run(args: argparse.Namespace) -> int:
    from gpud_broker.broker import Endpoints, serve
    from gpud_broker.core import BrokerConfig

    setup_logging(args.log_level, "gpud-broker")
    if args.heartbeat_ms < 10 or args.liveness < 1 or args.max_queue < 1:
        print("gpud broker: --heartbeat-ms must be >= 10, --liveness >= 1, --max-queue >= 1", file=sys.stderr)
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
    config = BrokerConfig(
        name=args.name,
        heartbeat=HeartbeatPolicy(args.heartbeat_ms / 1000.0, args.liveness),
        policy=args.policy,
        max_queue=args.max_queue,
        session_lease=args.session_lease,
        result_ttl=args.result_ttl,
        tenant_weights=weights,
        aging_s=args.aging,
        reserve_after=args.reserve_after,
    )
    try:
        return serve(config, Endpoints(args.frontend, args.backend, args.admin), args.ready_file)
    except Exception as exc:  # zmq bind errors and the like: say what failed
        print(f"gpud broker: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpud broker", description="Run the gpud broker.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
