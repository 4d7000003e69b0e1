"""The ``gpud`` command: ``broker``, ``worker``, ``up`` (a local all-in-one cluster) and ``version``.

Subcommands import their component lazily, so ``gpud version`` works on a host with only the core.
"""

from __future__ import annotations

import argparse
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
    print(f"gpud up: starting 1 broker and {args.workers} worker(s) with {args.gpus_per_worker} {kind} GPU(s) each")
    if os.geteuid() == 0:
        print("  as root: each worker runs jobs under 16 dynamic uids of its own, never as root")
    cluster = LocalCluster(workers=args.workers, gpus_per_worker=args.gpus_per_worker, simulate=simulate)
    try:
        cluster.start()
    except RuntimeError as exc:
        print(f"gpud up: could not start the cluster: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    try:
        print(f"  frontend {cluster.frontend}\n  backend  {cluster.backend}\n  admin    {cluster.admin}")
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


def build_parser() -> argparse.ArgumentParser:
    from gpud_broker.__main__ import add_arguments as broker_args
    from gpud_worker.__main__ import add_arguments as worker_args

    p = argparse.ArgumentParser(prog="gpud", description="gpud: a shared GPU service for OpenStack clouds.")
    sub = p.add_subparsers(dest="command", required=True)
    broker_args(sub.add_parser("broker", help="run the broker (control node)"))
    worker_args(sub.add_parser("worker", help="run a worker (GPU VM)"))
    up = sub.add_parser("up", help="run a local cluster: one broker and N workers as child processes")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default %(default)s)")
    up.add_argument("--gpus-per-worker", type=int, default=2, help="GPUs per worker when simulated (default %(default)s)")
    up.add_argument("--simulate", action="store_true", help="simulate GPUs even where NVML finds real ones")
    up.add_argument("--demo", action="store_true", help="run a demo workload through the client library, then stop")
    up.add_argument("--log-level", default="WARNING", help="log level of gpud up itself")
    sub.add_parser("version", help="print the version")
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
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
