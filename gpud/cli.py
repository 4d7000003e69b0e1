"""The ``gpud`` command: ``broker``, ``worker``, ``up`` (a local all-in-one cluster), ``config check``, ``keygen``, ``replay`` and ``version``.

Subcommands import their component lazily, so ``gpud version`` works on a host with only the core.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading

import gpud


def _up(args: argparse.Namespace) -> int:
    from gpud.cluster import LocalCluster
    from gpud.log import setup_logging

    setup_logging(args.log_level, "gpud-up")
    simulate = True
    if not args.simulate:
        from gpud_worker.gpu import NvmlProbe

        simulate = not NvmlProbe.available()
    kind = "simulated" if simulate else "real"
    brokers = "1 broker" if args.single else "a broker pair (primary, backup)"
    print(f"gpud up: starting {brokers} and {args.workers} worker(s) with {args.gpus_per_worker} {kind} GPU(s) each")
    if os.geteuid() == 0:
        print("  as root: each worker runs jobs under 16 dynamic uids of its own, never as root")
    # CURVE on, with a throwaway key set in the cluster's run directory (making keys takes ms).
    security = "none" if args.no_curve else "curve"
    cluster = LocalCluster(workers=args.workers, gpus_per_worker=args.gpus_per_worker, simulate=simulate,
                           security=security, pair=not args.single)
    try:
        cluster.start()
    except RuntimeError as exc:
        print(f"gpud up: could not start the cluster: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    try:
        if cluster.pair:
            cluster.wait_active()
        for role in cluster.roles:
            ep = cluster.broker_endpoints[role]
            print(f"  {role:8} frontend {ep['frontend']}  backend {ep['backend']}  admin {cluster.admin_of(role)}")
        if security == "curve":
            print(f"  CURVE on: keys in {cluster.keys} (broker.key is the broker's public key;"
                  " a client key goes in clients/TENANT/)")
        else:
            print("  security none: no encryption, no authentication (loopback only)")
        if args.demo:
            from gpud.demo import run_demo

            return run_demo(cluster)
        print("running; Ctrl-C stops it")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(0.5):
                for name, proc in list(cluster.worker_procs.items()):
                    if proc.poll() is not None:
                        print(f"gpud up: {name} exited with {proc.returncode}", file=sys.stderr)
                        return 1
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        codes = cluster.stop()
        bad = {n: c for n, c in codes.items() if c not in (0, None)}
        if bad:
            print(f"gpud up: children exited with errors: {bad}", file=sys.stderr)


def _keygen(args: argparse.Namespace) -> int:
    from gpud.errors import ConfigError
    from gpud.security import keygen

    try:
        public, secret = keygen(args.dir, args.name, overwrite=args.force)
    except (ConfigError, OSError) as exc:
        print(f"gpud keygen: {exc}", file=sys.stderr)
        return 2
    print(f"public key {public}\nsecret key {secret} (mode 0600: keep it on this host only)")
    return 0


def _config_check(args: argparse.Namespace) -> int:
    from gpud import config
    from gpud.errors import ConfigError
    from gpud_broker.policies import FACTORIES

    try:
        cfg = config.load(args.config, os.environ, policies=FACTORIES)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"gpud config check: {line}", file=sys.stderr)
        return 2
    problems: list[str] = []
    if args.role:  # the key files as that daemon uses them, and whether they are there and safe
        cfg = dataclasses.replace(cfg, security=config.for_role(cfg.security, args.role))
        problems = config.key_file_problems(cfg.security, args.role)
    print(f"# effective configuration ({cfg.path or 'no file'}, then GPUD_* variables, then defaults)")
    print(config.dump(cfg, config.ROLE_SECTIONS.get(args.role, config.SECTIONS)), end="")
    if not args.role:
        print("# key files not checked: add --role broker or --role worker\nOK")
        return 0
    for line in problems:
        print(f"gpud config check: {line}", file=sys.stderr)
    if problems:
        return 2
    print("OK")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gpud_broker.__main__ import add_arguments as broker_args
    from gpud_broker.replay import add_arguments as replay_args
    from gpud_worker.__main__ import add_arguments as worker_args

    p = argparse.ArgumentParser(prog="gpud", description="gpud: a shared GPU service for OpenStack clouds.")
    sub = p.add_subparsers(dest="command", required=True)
    broker_args(sub.add_parser("broker", help="run the broker (control node)"))
    worker_args(sub.add_parser("worker", help="run a worker (GPU VM)"))
    up = sub.add_parser("up", help="run a local cluster: a broker pair and N workers as child processes")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default %(default)s)")
    up.add_argument("--gpus-per-worker", type=int, default=2, help="GPUs per worker when simulated (default %(default)s)")
    up.add_argument("--simulate", action="store_true", help="simulate GPUs even where NVML finds real ones")
    up.add_argument("--demo", action="store_true", help="run a demo workload through the client library, then stop")
    up.add_argument("--single", action="store_true", help="one broker instead of a Binary Star pair")
    up.add_argument("--log-level", default="WARNING", help="log level of gpud up itself")
    up.add_argument("--no-curve", action="store_true", help="run without CURVE (security none) instead of a throwaway key set")
    keys = sub.add_parser("keygen", help="write a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    keys.add_argument("--dir", default="/etc/gpud/keys", help="where to write the pair (default %(default)s)")
    keys.add_argument("--name", required=True, help="broker, worker, or a client's name (the files' stem)")
    keys.add_argument("--force", action="store_true", help="replace an existing pair of that name")
    replay_args(sub.add_parser("replay", help="replay a GPU trace through the scheduler (static or dynamic)"))
    sub.add_parser("version", help="print the version")
    config = sub.add_parser("config", help="configuration tools")
    check = config.add_subparsers(dest="config_command", required=True).add_parser(
        "check", help="validate a configuration file and GPUD_* variables; print the effective configuration")
    check.add_argument("--config", default=None, metavar="PATH", help="the file (default /etc/gpud/gpud.toml, where it exists)")
    check.add_argument("--role", choices=("broker", "worker"), help="print only the sections this daemon reads, with its key files, and check those files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"gpud {gpud.__version__}")
        return 0
    if args.command == "broker":
        from gpud_broker.__main__ import run as run_broker

        return run_broker(args)
    if args.command == "worker":
        from gpud_worker.__main__ import run as run_worker

        return run_worker(args)
    if args.command == "config":
        return _config_check(args)
    if args.command == "keygen":
        return _keygen(args)
    if args.command == "replay":
        from gpud_broker.replay import run as run_replay

        return run_replay(args)
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
