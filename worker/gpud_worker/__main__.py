"""``gpud worker`` / ``python -m gpud_worker``: find the GPUs (or simulate them), then serve."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
from pathlib import Path

from gpud import daemonize
from gpud.config import DEFAULT_PATH, GpudConfig, WorkerSection, flag_values, load, uid_range
from gpud.errors import ConfigError
from gpud.heartbeat import HeartbeatPolicy
from gpud.security import SecuritySettings, add_security_arguments, security_flags

log = logging.getLogger(__name__)

_D = WorkerSection()  # the defaults, for the help texts
FLAGS = {"brokers": "broker", **{key: key for key in (
    "name", "simulate", "gpu_model", "gpu_mem", "slots", "heartbeat_ms", "liveness", "workdir",
    "job_user_prefix", "job_uids", "session_idle", "session_processes", "session_staging", "compile_user", "drain_timeout", "reconnect_max", "fault_file", "instance_id", "replica_of", "data_bind", "data_advertise", "data_ports",
    "cgroups", "cgroup_parent", "job_memory", "mps", "mps_pipe_dir", "mps_log_dir", "job_network", "job_tmp_size",
    "job_dir_size", "max_job_output_bytes", "max_held_output_bytes")}, "probation_s": "probation"}
"""[worker] key -> its flag's argparse dest (--broker, repeated, gives brokers)."""
LOG_FLAGS = {"level": "log_level", "file": "log_file"}
"""[logging] key -> its flag's argparse dest (a flag that this parser lacks counts as not given)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Flags default to None ("not given"): then GPUD_WORKER_*, the file and gpud.config's defaults decide.
    p.add_argument("--config", default=None, metavar="PATH",
                   help=f"configuration file (default {DEFAULT_PATH}, where it exists)")
    p.add_argument("--broker", action="append", default=None, help=f"broker backend endpoint (repeat for the broker pair; default {','.join(_D.brokers)})")
    p.add_argument("--name", default=None, help="worker name (default: the host name)")
    p.add_argument("--simulate", type=int, metavar="N", help="serve N SIMULATED GPUs (no NVIDIA driver needed; for tests and laptops)")
    p.add_argument("--gpu-model", help=f"model name of simulated GPUs (default {_D.gpu_model})")
    p.add_argument("--gpu-mem", type=int, metavar="BYTES", help=f"memory of each simulated GPU (default {_D.gpu_mem})")
    p.add_argument("--slots", type=int, help=f"requests this worker runs at once (default {_D.slots})")
    p.add_argument("--heartbeat-ms", type=int, help=f"heartbeat interval proposed to the broker, ms (default {_D.heartbeat_ms})")
    p.add_argument("--liveness", type=int, help=f"heartbeats missed before the broker counts as gone (default {_D.liveness})")
    p.add_argument("--workdir", default=None, help="root of the jobs' private working directories")
    p.add_argument("--job-user-prefix", help=f"pool users for jobs when running as root: names starting with this (default {_D.job_user_prefix})")
    p.add_argument("--job-uids", default=None, metavar="FIRST-LAST", help="as root, run jobs under these numeric uids that belong to no account (dynamic users) instead of named pool users")
    p.add_argument("--cgroups", choices=("auto", "off"), default=None,
                   help=f"auto: a cgroup v2 per job (memory, CPU, pids limits) where the worker can make them; off: none (default {_D.cgroups})")
    p.add_argument("--cgroup-parent", default=None, metavar="DIR",
                   help="cgroup v2 directory to make job cgroups in (default: the worker's own cgroup)")
    p.add_argument("--job-memory", type=int, default=None, metavar="BYTES",
                   help="memory.max of a job whose grant names no host_mem (default 0: none)")
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA MPS runs here: give jobs and sessions their grant's MPS thread percentage and memory limit")
    p.add_argument("--mps-pipe-dir", default=None, metavar="DIR",
                   help="the MPS control daemon's pipe directory (default $CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps)")
    p.add_argument("--mps-log-dir", default=None, metavar="DIR",
                   help="the MPS control daemon's log directory (default $CUDA_MPS_LOG_DIRECTORY, else /var/log/nvidia-mps)")
    p.add_argument("--job-network", choices=("none", "host"), default=None,
                   help=f"none: each job and session process has a network namespace with loopback only; host: the VM's network (default {_D.job_network})")
    p.add_argument("--job-tmp-size", type=int, default=None, metavar="BYTES",
                   help=f"size of a job's private /tmp, /var/tmp and /dev/shm each (default {_D.job_tmp_size})")
    p.add_argument("--job-dir-size", type=int, default=None, metavar="BYTES",
                   help=f"as root, bytes a job's directory may hold (a tmpfs of its own); 0: no limit (default {_D.job_dir_size})")
    p.add_argument("--session-idle", type=float, help=f"seconds without operations before a session is reclaimed (default {_D.session_idle:g})")
    p.add_argument("--session-processes", choices=("auto", "on", "off"), default=None,
                   help=f"on: each session in a process of its own, as a pool user; off: in the worker; auto: on for real GPUs (default {_D.session_processes})")
    p.add_argument("--session-staging", type=int, metavar="BYTES", help=f"shared copy buffer of a session process (default {_D.session_staging})")
    p.add_argument("--max-job-output-bytes", type=int, metavar="BYTES",
                   help=f"a job's output files together (default {_D.max_job_output_bytes})")
    p.add_argument("--max-held-output-bytes", type=int, metavar="BYTES",
                   help="finished jobs' staged outputs held on the job root's disk until the broker has them, "
                        f"together (default {_D.max_held_output_bytes})")
    p.add_argument("--compile-user", default=None, metavar="USER", help=f"as root, compile CUDA C as this unprivileged user (default {_D.compile_user})")
    p.add_argument("--drain-timeout", type=float, help=f"seconds running work may take to finish on SIGTERM (default {_D.drain_timeout:g})")
    p.add_argument("--reconnect-max", type=float, metavar="SECONDS",
                   help=f"longest wait before reconnecting to a silent broker; the wait doubles from 0.1 s (default {_D.reconnect_max:g})")
    p.add_argument("--replica-of", default=None, metavar="WORKER",
                   help="take the work of worker WORKER first when it is lost (its replica)")
    p.add_argument("--data-bind", default=None, metavar="ENDPOINT",
                   help="bind a socket here for clients' session calls, straight to this worker (e.g. tcp://*:5557; default none)")
    p.add_argument("--data-advertise", default=None, metavar="ENDPOINT",
                   help="the data endpoint clients are told to connect to (default: --data-bind, the host name for a wildcard)")
    p.add_argument("--data-ports", default=None, metavar="LOW-HIGH",
                   help="the ports direct sessions' own sockets bind, on --data-bind's host (e.g. 5560-5659; default any free one)")
    p.add_argument("--probation", type=float, metavar="SECONDS", help=f"seconds a GPU that failed a health check must pass its checks again before it serves (default {_D.probation_s:g})")
    p.add_argument("--fault-file", default=None, metavar="PATH", help="SIMULATED GPUs only: JSON file of GPU faults to inject, read on SIGUSR2 (e.g. [{\"gpu\": 0, \"fault\": \"xid\", \"xid\": 79}]; [] clears them)")
    p.add_argument("--instance-id", default=None, metavar="ID",
                   help='this VM\'s Nova server id, reported to the broker; "auto": ask the metadata service (default none)')
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO, or [logging] level)")
    add_security_arguments(p, worker=True)
    daemonize.add_arguments(p)


def load_config(args: argparse.Namespace) -> GpudConfig:
    """The configuration: flags, then GPUD_* variables, then the file, then the defaults."""
    return load(args.config, os.environ, flags={"worker": flag_values(args, FLAGS), "logging": flag_values(args, LOG_FLAGS),
                                                "security": flag_values(args, security_flags(worker=True))})


def _host_mem() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _compile_user(name: str) -> tuple[int, int] | None:
    """As root: the (uid, gid) nvcc runs as (``compile_user``); None otherwise. Refuses root."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"compile_user {name!r} does not exist: create it or name another unprivileged user") from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ConfigError(f"compile_user {name!r} is root: name an unprivileged user")
    return entry.pw_uid, entry.pw_gid


def run(args: argparse.Namespace) -> int:
    from gpud_worker.cgroups import setup_job_cgroups
    from gpud_worker.device import Device, SimulatedDevice
    from gpud_worker.gpu import GpuProbe, NvmlProbe, SimulatedProbe, simulated_gpus
    from gpud_worker.held_outputs import OutputHold
    from gpud_worker.instance import resolve as resolve_instance_id
    from gpud_worker.jobs import JobLimits, JobRunner, MpsSettings, UserPool, mps_settings
    from gpud_worker.sandbox import Sandbox, private_mounts
    from gpud_worker.worker import Worker, WorkerConfig, default_workroot, install_signal_handlers

    try:
        cfg, log_target = daemonize.configure(args, load_config, "gpud-worker")
    except ConfigError as exc:
        print(f"gpud worker: {exc}", file=sys.stderr)
        return 2
    try:
        # Before NVML, threads or sockets: from here on only a --daemon's grandchild runs.
        daemonize.start(args, "gpud-worker", cfg.logging.level, log_target)
    except ConfigError as exc:
        print(f"gpud worker: {exc}", file=sys.stderr)
        return 2
    w = cfg.worker
    name = w.name or socket.gethostname()
    probe: GpuProbe
    devices: dict[str, Device] = {}
    if w.simulate:
        from gpud_worker.nvcc import NvccCompiler

        try:  # nvcc, where it is here, compiles loaded modules only to show their errors
            compiler = NvccCompiler(user=_compile_user(w.compile_user))
        except ConfigError as exc:
            print(f"gpud worker: {exc}", file=sys.stderr)
            return 2
        gpus = simulated_gpus(w.simulate, model=w.gpu_model, mem=w.gpu_mem, worker_name=name)
        sims = [SimulatedDevice(g, compiler=compiler) for g in gpus]
        devices = {d.gpu.uuid: d for d in sims}
        probe = SimulatedProbe(sims, probation_s=w.probation_s, fault_file=w.fault_file or None)
        log.warning("serving %d SIMULATED GPU(s): device memory is host memory, kernels run on the CPU", len(sims))
    elif NvmlProbe.available():
        probe = NvmlProbe(probation_s=w.probation_s)
        if w.fault_file:
            log.error("fault_file %s ignored: faults can be injected only into simulated GPUs (--simulate)", w.fault_file)
        log.info("found %d NVIDIA GPU(s) through NVML", len(probe.inventory()))
        from gpud_worker.cuda import cuda_devices  # imports pycuda only now, on a GPU host

        try:
            compile_as = _compile_user(w.compile_user)
        except ConfigError as exc:
            print(f"gpud worker: {exc}", file=sys.stderr)
            return 2
        cuda, why = cuda_devices(probe.inventory(), compile_user=compile_as)
        devices.update(cuda)
        if why:
            log.error("sessions are refused on the GPUs without a CUDA device: %s; jobs run on every GPU", why)
        if cuda:
            log.info("sessions on %d GPU(s) through pycuda", len(cuda))
    else:
        print(
            "gpud worker: no NVIDIA driver found (NVML could not be loaded).\n"
            "Install the driver on this GPU VM, or run with --simulate N to serve N simulated GPUs.",
            file=sys.stderr,
        )
        return 2
    try:
        security = SecuritySettings.from_config(cfg.security, "worker")
        curve = security.worker_keys() if security.curve else None
    except ConfigError as exc:
        print(f"gpud worker: {exc}", file=sys.stderr)
        return 2
    if curve is None:
        log.warning("security none: the connection to the broker is neither encrypted nor authenticated")
        if w.job_network == "host":
            print("gpud worker: job_network \"host\" with security \"none\" is refused: a job could reach the "
                  "broker's backend and register itself as a worker, receiving other tenants' jobs and files. "
                  "Use security \"curve\", or job_network \"none\".", file=sys.stderr)
            return 2
    root = os.geteuid() == 0
    pool = None
    if root:
        uids = uid_range(w.job_uids)  # checked by load()
        pool = UserPool("gpud-dyn-" if uids else w.job_user_prefix, uids)
    cgroups = None
    if w.cgroups == "off":
        log.info("cgroups off: jobs run with their rlimits only")
    elif root or w.cgroup_parent:
        cgroups = setup_job_cgroups(w.cgroup_parent)
    else:
        log.info("not root and no cgroup_parent: jobs run without cgroups")
    mps: MpsSettings | None = mps_settings(w.mps_pipe_dir, w.mps_log_dir, os.environ) if w.mps else None
    if mps is not None:
        log.info("CUDA MPS: jobs and sessions get their grant's MPS limits (pipes in %s)", mps.pipe_dir)
    limits = JobLimits(memory=w.job_memory or None)
    workroot = Path(w.workdir) if w.workdir else default_workroot()
    hidden = [str(workroot), os.path.abspath(args.config or DEFAULT_PATH), cfg.security.keys_dir,
              os.path.abspath(security.secret_key_file) if curve is not None else "",
              os.environ.get("RUNTIME_DIRECTORY", "/run/gpud")]
    shared = [mps.pipe_dir, mps.log_dir] if mps is not None else []
    sandbox = Sandbox(w.job_network, w.job_tmp_size, hidden, shared, enabled=root)
    if root and w.job_dir_size:
        why = private_mounts()
        if why:
            log.warning("cannot keep the job directories' mounts to the worker (%s): a crash leaves them mounted "
                        "until the next start", why)
    if sandbox.active:
        log.info("%s", sandbox.describe())
        if w.job_network == "host":
            log.warning("job_network host: jobs and session processes share this GPU VM's network (the operator's choice)")
    else:
        log.warning("%s", sandbox.describe())
        if curve is None:
            log.warning("isolation %s with security none: a job can reach the broker's backend and register as a worker", sandbox.level)
    minors = probe.minor_numbers() if isinstance(probe, NvmlProbe) else {g.uuid: g.index for g in probe.inventory()}
    runner = JobRunner(workroot, pool, limits=limits, cgroups=cgroups, mps=mps, sandbox=sandbox, gpu_minors=minors,
                       dir_size=w.job_dir_size, max_output_file=w.max_job_output_bytes,
                       max_outputs=w.max_job_output_bytes, hold=OutputHold(workroot, w.max_held_output_bytes))
    if runner.hold.tenant_limit < w.max_job_output_bytes:
        log.warning("max_held_output_bytes (%d) holds less than max_job_output_bytes (%d) per tenant (half of it): "
                    "jobs with staged outputs over %d bytes end TOO_LARGE", w.max_held_output_bytes,
                    w.max_job_output_bytes, runner.hold.tenant_limit)
    if w.session_processes == "on" or (w.session_processes == "auto" and not w.simulate and devices):
        from gpud_worker.session_host import HostedDevice, SessionHosts

        hosts = SessionHosts(runner.lease_user, runner.end_lease, cuda=not w.simulate, staging=w.session_staging,
                             sandbox=runner.sandbox, gpu_minors=minors, make_cgroup=runner.make_cgroup)
        runner.pooled_sessions = root
        devices = {uuid: HostedDevice(d, hosts) for uuid, d in devices.items()}  # type: ignore[arg-type]
        log.info("sessions run in processes of their own%s, %s", ", as pool users" if root else "",
                 "each in a cgroup of its own as a job" if cgroups is not None else "without cgroups (as jobs)")
    config = WorkerConfig(
        name=name,
        brokers=w.brokers,
        heartbeat=HeartbeatPolicy(w.heartbeat_ms / 1000.0, w.liveness),
        slots=w.slots,
        cpu_milli=(os.cpu_count() or 1) * 1000,
        host_mem=_host_mem(),
        session_idle=w.session_idle,
        drain_timeout=w.drain_timeout,
        reconnect_max=w.reconnect_max,
        curve=curve,
        instance_id=resolve_instance_id(w.instance_id),
        replica_of=w.replica_of,
        data_bind=w.data_bind,
        data_advertise=w.data_advertise,
        data_ports=w.data_ports,
        max_job_output_bytes=w.max_job_output_bytes,
    )
    worker = Worker(config, probe, devices, runner)
    gc.freeze()  # as in the broker: few cycles, many small short-lived objects per message
    gc.set_threshold(70_000, 20, 20)
    install_signal_handlers(worker)
    worker.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    return daemonize.main("gpud worker", "Run a gpud worker on this GPU VM.", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
