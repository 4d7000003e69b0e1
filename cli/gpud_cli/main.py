"""The ``gpud`` command: ``broker``, ``worker``, ``up`` (a local all-in-one cluster), ``config check``, ``keygen`` and ``version``.

A subcommand imports its component, and fills in its flags, only when it is the one that runs, so
``gpud version`` and ``gpud --help`` work on a host with only the core. A subcommand whose optional
dependency is missing says which extra to install (:data:`EXTRAS`) instead of a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import gpud

EXTRAS = {
    "pynvml": "worker",
    "psutil": "worker",
    "numpy": "worker",
    "pycuda": "cuda",
    "novaclient": "openstack",
    "keystoneauth1": "openstack",
    "yaml": "openstack",
    "daemon": "daemon",
    "prometheus_client": "metrics",
}
"""Top-level module of an optional dependency -> the extra of ``gpud`` that installs it (setup.cfg)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop ``gpud up`` and its children (SIGINT too, as KeyboardInterrupt): SIGHUP is a
terminal that closes, which must not leave the cluster's daemons running, orphaned."""


class _Stopped(Exception):
    """A stop signal reached ``gpud up``."""


def _up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--workers", type=int, default=2, help="number of workers (default %(default)s)")
    up.add_argument("--gpus-per-worker", type=int, default=2, help="GPUs per worker when simulated (default %(default)s)")
    up.add_argument("--simulate", action="store_true", help="simulate GPUs even where NVML finds real ones")
    up.add_argument("--demo", action="store_true", help="run a demo workload through the client library, then stop")
    up.add_argument("--single", action="store_true", help="one broker instead of a Binary Star pair")
    up.add_argument("--log-level", default="WARNING", help="log level of gpud up itself")
    up.add_argument("--no-curve", action="store_true", help="run without CURVE (security none) instead of a throwaway key set")


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def _up(args: argparse.Namespace) -> int:
    import gpud_worker.worker  # noqa: F401  (its extra missing: say so now, not in each worker's log)
    from gpud.log import setup_logging
    from gpud_cli.cluster import LocalCluster

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
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        try:
            cluster.start()
        except RuntimeError as exc:
            print(f"gpud up: could not start the cluster: {exc}", file=sys.stderr)
            return 1
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
            from gpud_cli.demo import run_demo

            return run_demo(cluster)
        print("running; Ctrl-C stops it", flush=True)
        while True:
            time.sleep(0.5)
            for name, proc in list(cluster.worker_procs.items()):
                if proc.poll() is not None:
                    print(f"gpud up: {name} exited with {proc.returncode}", file=sys.stderr)
                    return 1
    except (KeyboardInterrupt, _Stopped):
        return 0
    finally:
        # Stop the children whatever ended the run; a second signal must not cut that short.
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        codes = cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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


def _keygen_arguments(keys: argparse.ArgumentParser) -> None:
    keys.add_argument("--dir", default="/etc/gpud/keys", help="where to write the pair (default %(default)s)")
    keys.add_argument("--name", required=True, help="broker, worker, or a client's name (the files' stem)")
    keys.add_argument("--force", action="store_true", help="replace an existing pair of that name")


def _config_arguments(config: argparse.ArgumentParser) -> None:
    check = config.add_subparsers(dest="config_command", required=True).add_parser(
        "check", help="validate a configuration file and GPUD_* variables; print the effective configuration")
    check.add_argument("--config", default=None, metavar="PATH", help="the file (default /etc/gpud/gpud.toml, where it exists)")
    check.add_argument("--role", choices=("broker", "worker"), help="print only the sections this daemon reads, with its key files, and check those files")


def _version(args: argparse.Namespace) -> int:
    print(f"gpud {gpud.__version__}")
    return 0


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


_Arguments = Callable[[argparse.ArgumentParser], None]
_Run = Callable[[argparse.Namespace], int]

COMMANDS: dict[str, tuple[str, str | tuple[_Arguments, _Run]]] = {
    "broker": ("run the broker (control node)", "gpud_broker.__main__"),
    "worker": ("run a worker (GPU VM)", "gpud_worker.__main__"),
    "up": ("run a local cluster: a broker pair and N workers as child processes", (_up_arguments, _up)),
    "keygen": ("write a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret (0600)",
               (_keygen_arguments, _keygen)),
    "version": ("print the version", (_no_arguments, _version)),
    "config": ("configuration tools", (_config_arguments, _config_check)),
}
"""Subcommand -> (help, where it lives): a module with ``add_arguments(parser)`` and ``run(args)``,
imported only when that subcommand runs, or those two functions here."""


class MissingExtra(Exception):
    """A subcommand needs an optional dependency that is not installed."""

    def __init__(self, command: str, module: str, extra: str) -> None:
        super().__init__(f"gpud {command} needs the extra {extra!r} (module {module!r} is not installed):"
                         f" pip install 'gpud[{extra}]'")


def _extra_of(exc: ModuleNotFoundError) -> tuple[str, str] | None:
    top = (exc.name or "").split(".")[0]
    return (top, EXTRAS[top]) if top in EXTRAS else None


def _load(command: str) -> tuple[_Arguments, _Run]:
    """The subcommand's ``(add_arguments, run)``, importing its module now."""
    where = COMMANDS[command][1]
    if not isinstance(where, str):
        return where
    try:
        module: Any = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        missing = _extra_of(exc)
        if missing is None:
            raise
        raise MissingExtra(command, *missing) from None
    return module.add_arguments, module.run


def _chosen(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the top-level parser has no options of its own but -h)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, _Run | None]:
    """The parser, with the flags of the subcommand ``argv`` names (only that one's module is
    imported), and that subcommand's run function (None when ``argv`` names none)."""
    chosen = _chosen(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="gpud", description="gpud: a shared GPU service for OpenStack clouds.")
    sub = p.add_subparsers(dest="command", required=True)
    run: _Run | None = None
    for name, (text, _) in COMMANDS.items():
        parser = sub.add_parser(name, help=text)
        if name == chosen:
            add_arguments, run = _load(name)
            add_arguments(parser)
    return p, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, run = build_parser(argv)
        args = parser.parse_args(argv)
        if run is None:  # unreachable: parse_args exits unless argv names a subcommand
            parser.error("no subcommand")
        return run(args)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional dependency imported as the subcommand runs
        missing = _extra_of(exc)
        if missing is None:
            raise
        print(MissingExtra(_chosen(argv) or "", *missing), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
