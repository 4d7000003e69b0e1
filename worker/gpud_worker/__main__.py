"""``gpud worker`` / ``python -m gpud_worker``: find the GPUs (or simulate them), then serve."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
from pathlib import Path

from gpud.heartbeat import DEFAULT_INTERVAL_S, DEFAULT_LIVENESS, HeartbeatPolicy
from gpud.log import setup_logging

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", action="append", default=None, help="broker backend endpoint (repeat for the broker pair; default tcp://127.0.0.1:5556)")
    p.add_argument("--name", default=None, help="worker name (default: the host name)")
    p.add_argument("--simulate", type=int, default=0, metavar="N", help="serve N SIMULATED GPUs (no NVIDIA driver needed; for tests and laptops)")
    p.add_argument("--gpu-model", default="SIM-GPU", help="model name of simulated GPUs")
    p.add_argument("--gpu-mem", type=int, default=16 << 30, metavar="BYTES", help="memory of each simulated GPU")
    p.add_argument("--slots", type=int, default=64, help="requests this worker runs at once")
    p.add_argument("--heartbeat-ms", type=int, default=int(DEFAULT_INTERVAL_S * 1000), help="heartbeat interval proposed to the broker, ms")
    p.add_argument("--liveness", type=int, default=DEFAULT_LIVENESS, help="heartbeats missed before the broker counts as gone")
    p.add_argument("--workdir", default=None, help="root of the jobs' private working directories")
    p.add_argument("--job-user-prefix", default="gpud-job", help="pool users for jobs when running as root: names starting with this")
    p.add_argument("--job-uids", default=None, metavar="FIRST-LAST", help="as root, run jobs under these numeric uids that belong to no account (dynamic users) instead of named pool users")
    p.add_argument("--session-idle", type=float, default=600.0, help="seconds without operations before a session is reclaimed")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running work may take to finish on SIGTERM")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO or $GPUD_LOG_LEVEL)")


def _host_mem() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def run(args: argparse.Namespace) -> int:
    from gpud_worker.device import Device, SimulatedDevice
    from gpud_worker.gpu import GpuProbe, NvmlProbe, SimulatedProbe, simulated_gpus
    from gpud_worker.jobs import JobRunner, UserPool
    from gpud_worker.worker import Worker, WorkerConfig, default_workroot, install_signal_handlers

    setup_logging(args.log_level, "gpud-worker")
    name = args.name or socket.gethostname()
    if args.slots < 1 or args.heartbeat_ms < 10 or args.liveness < 1 or args.simulate < 0:
        print("gpud worker: --slots, --heartbeat-ms (>= 10), --liveness must be positive", file=sys.stderr)
        return 2
    probe: GpuProbe
    devices: dict[str, Device] = {}
    if args.simulate:
        gpus = simulated_gpus(args.simulate, model=args.gpu_model, mem=args.gpu_mem, worker_name=name)
        sims = [SimulatedDevice(g) for g in gpus]
        devices = {d.gpu.uuid: d for d in sims}
        probe = SimulatedProbe(sims)
        log.warning("serving %d SIMULATED GPU(s): device memory is host memory, kernels run on the CPU", len(sims))
    elif NvmlProbe.available():
        probe = NvmlProbe()
        log.info("found %d NVIDIA GPU(s) through NVML", len(probe.inventory()))
    else:
        print(
            "gpud worker: no NVIDIA driver found (NVML could not be loaded).\n"
            "Install the driver on this GPU VM, or run with --simulate N to serve N simulated GPUs.",
            file=sys.stderr,
        )
        return 2
    root = os.geteuid() == 0
    pool = None
    if root:
        uids = None
        if args.job_uids:
            try:
                first, last = (int(x) for x in args.job_uids.split("-"))
            except ValueError:
                print("gpud worker: --job-uids must be FIRST-LAST, e.g. 61184-61199", file=sys.stderr)
                return 2
            if not 1000 <= first <= last < 2**31:
                print("gpud worker: --job-uids must be a range of unprivileged uids (>= 1000)", file=sys.stderr)
                return 2
            uids = range(first, last + 1)
        pool = UserPool("gpud-dyn-" if uids else args.job_user_prefix, uids)
    if root and pool is not None and not len(pool):
        log.warning("running as root with no pool users named %s*: jobs will be refused (see systemd/gpud-sysusers.conf)", args.job_user_prefix)
    runner = JobRunner(Path(args.workdir) if args.workdir else default_workroot(), pool)
    config = WorkerConfig(
        name=name,
        brokers=tuple(args.broker or ["tcp://127.0.0.1:5556"]),
        heartbeat=HeartbeatPolicy(args.heartbeat_ms / 1000.0, args.liveness),
        slots=args.slots,
        cpu_milli=(os.cpu_count() or 1) * 1000,
        host_mem=_host_mem(),
        session_idle=args.session_idle,
        drain_timeout=args.drain_timeout,
    )
    worker = Worker(config, probe, devices, runner)
    gc.freeze()  # as in the broker: few cycles, many small short-lived objects per message
    gc.set_threshold(70_000, 20, 20)
    install_signal_handlers(worker)
    worker.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpud worker", description="Run a gpud worker on this GPU VM.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
