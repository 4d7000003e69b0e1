"""Staged job inputs benchmark (PROTOCOL.md §11): the upload rate of a large job input through
gpud against a bare pyzmq chunked send over the same hops, and another client's echo latency
during the upload as a ratio to idle, in one run.

- gpud: a LocalCluster (one broker, or a Binary Star pair with ``--pair``; one worker with two
  simulated GPUs, labelled simulated). A client runs ``true`` with one input file of ``--mib``
  MiB (staged: PUT chunks to the broker's spool, FETCHed by the worker, copied into the job's
  directory); its rate is the size over the job's time less that of the same job without input
  (the job's own start-up). The upload and the worker's fetch are pipelined (the job is placed
  once its upload opens): ``stage_gbps`` is the size over the time until ``submit`` returns (every
  chunk is in the broker's spool, durable), while the worker fetches behind it. A second client
  meanwhile sends 64-byte echoes one after another;
  their p99 during the upload is compared with their p99 while nothing else runs, and so is their
  p99 during the bare transfer (``bare_p99_ratio``): gpud carries none of its bytes, so that ratio
  is what the machine's busy cores alone cost the echo, the least any design reaches here.
- bare: the forwarder and worker of ``bench/transfer.py`` (ROUTER frontend and backend, one
  DEALER worker that answers each chunk; ``copy=False`` everywhere), the same bytes sent in
  chunks of gpud's staging chunk size (``gpud.transfer.CHUNK_BYTES``), its window outstanding.

- floor: the same bare chain whose forwarder also writes each chunk to a file on the file system
  of the broker's spool, and whose sink writes it into a file where the worker puts a job's
  inputs (as root a tmpfs mounted as a job directory is, else a plain directory), each on a
  thread of its own: the two page-cache copies gpud's design takes (the spool bounds the broker's
  memory, the job reads its input from its directory), over the same hops. Its transfer ends when
  both files hold every byte (as gpud's job starts only then); then the sink's file is emptied (the
  job's directory goes with its job) and the spool's is kept to be written over (as gpud's spool
  keeps an ended upload's file). ``floor_ratio``
  (floor / bare) is the most any design with those copies reaches against bare on this machine;
  ``gpud_vs_floor`` (gpud / floor) is what gpud's own work costs beyond them.

Before the rounds, ``write_costs`` measures what a chunked write costs here into fresh memory
(a new file) and over pages already cached, on the spool's file system and in a job directory:
on a VM that hands freed pages back to its host, fresh memory is several times dearer, and each
upload's spool file and each job directory is fresh memory.

Each system's transfer starts ``--settle`` seconds after the one before ended, so that none
writes into memory the one before it freed a moment ago (which such a VM charges far less for).

Each round also gives the CPU seconds per GiB of every process on the path during its transfer
(from /proc: robust to the machine's load, unlike the rates): gpud's client (this process; the
echo client runs in a process of its own), broker and worker, and the bare client, forwarder and
sink, so that the gap shows per process.

Targets: gpud at least 0.7x bare, echo p99 during the upload at most 3x idle.

Usage::

    .venv/bin/python bench/staging.py [--mib 1024] [--rounds 2] [--pair]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transfer import Bare  # noqa: E402  (the bare chain, shared with the session-copy benchmark)

from gpud.transfer import CHUNK_BYTES, WINDOW  # noqa: E402
from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402
from gpud_worker.jobs import HUGE_DIR_OPTIONS  # noqa: E402
from gpud_worker.sandbox import mount_tmpfs, unmount  # noqa: E402

MIB = 1 << 20


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


class Echoes:
    """Another client, in a process of its own (its CPU is not the uploading client's): it sends
    small echoes one after another and, when stopped, says when each was sent and how long it took
    (``time.perf_counter``, CLOCK_MONOTONIC: the same clock in every process)."""

    def __init__(self, endpoints: list[str]) -> None:
        me = [sys.executable, os.path.abspath(__file__), "--role", "echoes", *(a for e in endpoints for a in ("--endpoint", e))]
        self.proc = subprocess.Popen(me, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.samples: list[tuple[float, float]] = []
        self.errors = 0

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # end of input: the child stops and prints its samples
        out = json.loads(self.proc.stdout.read() or b"{}")
        self.proc.wait(timeout=30)
        self.samples = [tuple(x) for x in out.get("samples", [])]
        self.errors = out.get("errors", 0)

    def p99(self, t0: float, t1: float) -> float:
        """p99 of the echoes sent between ``t0`` and ``t1``."""
        return p99([lat for t, lat in self.samples if t0 <= t < t1])


def echoes_child(endpoints: list[str]) -> int:
    """The echo client's process: echoes until its stdin ends, then its samples as one JSON line."""
    client = Client(endpoints, timeout=30)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    samples: list[tuple[float, float]] = []
    errors = 0
    payload = b"e" * 64
    while not stop.is_set():
        t = time.perf_counter()
        try:
            client.echo(payload)
        except Exception:
            errors += 1
            continue
        samples.append((t, time.perf_counter() - t))
        time.sleep(0.002)
    client.close()
    sys.stdout.write(json.dumps({"samples": samples, "errors": errors}))
    return 0


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` so far, every thread, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process ``pid`` so far, by thread name (threads of one name
    summed; ZeroMQ's I/O threads are "ZMQbg/IO/0" and so on), from /proc."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        name = head.split("(", 1)[1]
        fields = rest.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class CpuMeter:
    """CPU seconds spent by each of some processes between ``start`` and ``stop``, by name, and
    by each of their threads (``threads``: a thread that ended meanwhile is not counted there)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.used: dict[str, float] = {}
        self.threads: dict[str, dict[str, float]] = {}
        self._at: dict[str, float] = {}
        self._threads_at: dict[str, dict[str, float]] = {}

    def start(self) -> None:
        self._threads_at = {name: thread_cpu_s(pid) for name, pid in self.pids.items()}
        self._at = {name: cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        self.used = {name: cpu_s(pid) - self._at[name] for name, pid in self.pids.items()}
        for name, pid in self.pids.items():
            at = self._threads_at[name]
            self.threads[name] = {t: v - at.get(t, 0.0) for t, v in thread_cpu_s(pid).items() if v - at.get(t, 0.0) > 0}
        return self.used


def gpud_round(c: Client, data: bytes, idle_s: float, cpu: CpuMeter) -> dict[str, float]:
    """One upload through gpud: net seconds to the job's end (less a job without input), seconds
    staging to the broker's spool, the windows of idle and upload time (for the echoes), and the
    CPU seconds of each process during the upload."""
    t_idle = time.perf_counter()
    time.sleep(idle_s)
    t_idle_end = time.perf_counter()
    empty = []
    cpu.start()
    for _ in range(3):
        t = time.perf_counter()
        c.run(["true"], gpu_milli=100)
        empty.append(time.perf_counter() - t)
    empty_cpu = {k: v / 3 for k, v in cpu.stop().items()}
    cpu.start()
    t = time.perf_counter()
    job = c.submit(["true"], files={"a": data}, gpu_milli=100, time_limit=300, timeout=300)
    staged = time.perf_counter() - t  # submit returns once the input is in the broker's spool
    out = job.wait()
    t_end = time.perf_counter()
    used = cpu.stop()
    if out.exit_code != 0:
        raise RuntimeError(f"the job failed: {out.stderr!r}")
    return {"net_s": t_end - t - statistics.median(empty), "staged_s": staged, "idle0": t_idle,
            "idle1": t_idle_end, "up0": t, "up1": t_end, **{f"cpu_{k}": v for k, v in used.items()},
            **{f"empty_job_cpu_{k}": v for k, v in empty_cpu.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the job's input in MiB (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="gpud and bare rounds, alternating (default %(default)s)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of idle echoes per round (default %(default)s)")
    p.add_argument("--pair", action="store_true", help="a Binary Star pair instead of one broker")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds of quiet before each system's transfer (default %(default)s): memory the one before "
                        "freed is handed back, as between uploads apart in time, not taken warm by the next one")
    p.add_argument("--role", choices=["bench", "echoes"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "echoes":
        return echoes_child(args.endpoint)
    nbytes = args.mib * MIB
    gib = nbytes / (1 << 30)
    data = os.urandom(MIB) * args.mib
    t_start = time.perf_counter()
    with LocalCluster(workers=1, gpus_per_worker=2, pair=args.pair, log_level="WARNING") as cluster:
        if args.pair:
            cluster.wait_active()
        with FloorFiles() as files:
            floor = Bare(1, spool=files.spool, sink=files.sink)
            try:
                floor.wait_ready()
                costs = {"spool_fs": write_costs(files.top), "job_dir": write_costs(files.sink_dir)}
                return _run(args, cluster, floor, data, nbytes, gib, t_start, costs)
            finally:
                floor.stop()


def _run(args: argparse.Namespace, cluster: LocalCluster, floor: Bare, data: bytes, nbytes: int, gib: float,
         t_start: float, costs: dict[str, dict[str, float]]) -> int:
    """The rounds: gpud, then bare, then floor, each round; then the figures."""
    rounds: list[dict[str, float]] = []
    windows = []
    threads: list[dict[str, dict[str, float]]] = []  # per round: CPU s/GiB of each thread, by process
    view = memoryview(data)
    bare = Bare(1)
    try:
        bare.wait_ready()
        echoes = Echoes(cluster.frontends)
        try:
            with Client(cluster.frontends, timeout=60) as c:
                broker = cluster.brokers["primary" if args.pair else "broker"]
                gpud_cpu = CpuMeter({"client": os.getpid(), "broker": broker.pid,
                                     "worker": next(iter(cluster.worker_procs.values())).pid})
                bare_cpu = CpuMeter({"client": os.getpid(), "forwarder": bare.procs[0].pid, "sink": bare.procs[1].pid})
                floor_cpu = CpuMeter({"client": os.getpid(), "forwarder": floor.procs[0].pid,
                                      "sink": floor.procs[1].pid})
                for _ in range(args.rounds):
                    time.sleep(args.settle)
                    g = gpud_round(c, data, args.idle, gpud_cpu)
                    time.sleep(args.settle)
                    bare_at = time.perf_counter()
                    bare_s, b = _bare_round(bare, view, bare_cpu)
                    g["bare0"], g["bare1"] = bare_at, bare_at + bare_s
                    time.sleep(args.settle)
                    floor_s, f = _bare_round(floor, view, floor_cpu)
                    windows.append(g)
                    r = {"gpud_gbps": nbytes / g["net_s"] / 1e9, "stage_gbps": nbytes / g["staged_s"] / 1e9,
                         "bare_gbps": nbytes / bare_s / 1e9, "floor_gbps": nbytes / floor_s / 1e9}
                    r["ratio"] = r["gpud_gbps"] / r["bare_gbps"]
                    r["floor_ratio"] = r["floor_gbps"] / r["bare_gbps"]
                    r["gpud_vs_floor"] = r["gpud_gbps"] / r["floor_gbps"]
                    for k in ("client", "broker", "worker"):
                        r[f"{k}_cpu_s_per_gib"] = g[f"cpu_{k}"] / gib
                    for k in ("client", "broker", "worker"):
                        r[f"empty_job_{k}_cpu_s"] = g[f"empty_job_cpu_{k}"]
                    for k, v in b.items():
                        r[f"bare_{k}_cpu_s_per_gib"] = v / gib
                    r["cpu_s_per_gib"] = sum(g[f"cpu_{k}"] for k in ("client", "broker", "worker")) / gib
                    r["bare_cpu_s_per_gib"] = sum(b.values()) / gib
                    r["floor_cpu_s_per_gib"] = sum(f.values()) / gib
                    threads.append({p: {t: round(v / gib, 2) for t, v in sorted(ts.items(), key=lambda x: -x[1])}
                                    for p, ts in gpud_cpu.threads.items() if p != "client"})
                    rounds.append(r)
        finally:
            echoes.stop()
    finally:
        bare.stop()
    for i, (r, g) in enumerate(zip(rounds, windows, strict=True)):
        idle, busy = echoes.p99(g["idle0"], g["idle1"]), echoes.p99(g["up0"], g["up1"])
        during_bare = echoes.p99(g["bare0"], g["bare1"])
        r.update({"echo_p99_idle_ms": idle * 1e3, "echo_p99_upload_ms": busy * 1e3, "p99_ratio": busy / idle,
                  "echo_p99_bare_ms": during_bare * 1e3, "bare_p99_ratio": during_bare / idle})
        print(f"round {i + 1}: gpud {r['gpud_gbps']:.2f} GB/s (client to spool {r['stage_gbps']:.2f}), bare "
              f"{r['bare_gbps']:.2f} GB/s (ratio {r['ratio']:.2f}); echo p99 {r['echo_p99_idle_ms']:.2f} ms idle, "
              f"{r['echo_p99_upload_ms']:.2f} ms during the upload ({r['p99_ratio']:.2f}x), "
              f"{r['echo_p99_bare_ms']:.2f} ms during the bare transfer ({r['bare_p99_ratio']:.2f}x)")
        print(f"  floor (bare with the spool's and the job directory's writes) {r['floor_gbps']:.2f} GB/s: "
              f"{r['floor_ratio']:.2f}x bare; gpud {r['gpud_vs_floor']:.2f}x the floor")
        print(f"  CPU s/GiB: gpud {r['cpu_s_per_gib']:.2f} (client {r['client_cpu_s_per_gib']:.2f}, broker "
              f"{r['broker_cpu_s_per_gib']:.2f}, worker {r['worker_cpu_s_per_gib']:.2f}); bare "
              f"{r['bare_cpu_s_per_gib']:.2f} (client {r['bare_client_cpu_s_per_gib']:.2f}, forwarder "
              f"{r['bare_forwarder_cpu_s_per_gib']:.2f}, sink {r['bare_sink_cpu_s_per_gib']:.2f}); floor "
              f"{r['floor_cpu_s_per_gib']:.2f}", flush=True)
        print(f"  CPU s/GiB by thread: {json.dumps(threads[i])}; CPU s of a job without input: client "
              f"{r['empty_job_client_cpu_s']:.3f}, broker {r['empty_job_broker_cpu_s']:.3f}, worker "
              f"{r['empty_job_worker_cpu_s']:.3f}")
    rounds.sort(key=lambda r: r["ratio"])
    mid = rounds[len(rounds) // 2]
    print(f"staged job input of {args.mib} MiB through {'a broker pair' if args.pair else 'one broker'} "
          f"to a simulated GPU's worker, against bare pyzmq chunks over the same hops "
          f"(chunk {CHUNK_BYTES >> 20} MiB, window {WINDOW}; {os.cpu_count()} CPUs)")
    print(f"writing in chunks, CPU s/GiB: into the spool's file system {costs['spool_fs']['fresh']:.2f} fresh, "
          f"{costs['spool_fs']['rewrite']:.2f} over cached pages; into a job directory {costs['job_dir']['fresh']:.2f} "
          f"fresh, {costs['job_dir']['rewrite']:.2f} over cached pages")
    summary: dict[str, Any] = {k: round(v, 3) for k, v in mid.items()}
    summary["write_cpu_s_per_gib"] = costs
    summary.update({"mib": args.mib, "pair": args.pair, "rounds": args.rounds, "echo_errors": echoes.errors,
                    "ratios": [round(r["ratio"], 3) for r in rounds],
                    "floor_ratios": [round(r["floor_ratio"], 3) for r in rounds],
                    "p99_ratios": [round(r["p99_ratio"], 3) for r in rounds],
                    "bare_p99_ratios": [round(r["bare_p99_ratio"], 3) for r in rounds],
                    "cpus": os.cpu_count(), "seconds": round(time.perf_counter() - t_start, 1)})
    print(json.dumps(summary))
    return 0


def _bare_round(chain: Bare, view: memoryview, cpu: CpuMeter) -> tuple[float, dict[str, float]]:
    """One chunked send of ``view`` through a bare chain: its seconds and its processes' CPU."""
    cpu.start()
    t = time.perf_counter()
    chain.htod_chunked(view, CHUNK_BYTES, WINDOW)
    return time.perf_counter() - t, cpu.stop()


def write_costs(directory: str, mib: int = 256, settle_s: float = 3.0) -> dict[str, float]:
    """CPU seconds per GiB (this thread's, kernel included) of writing ``mib`` MiB in chunks into
    ``directory``: ``rewrite`` over pages the file already has in the page cache, ``fresh`` into
    a new file written ``settle_s`` after the last one was removed. The two differ by what the
    machine charges for memory just freed and taken again (a VM that hands free pages back to its
    host pays a host fault on each one's next use): every staged upload's spool file and every
    job directory is fresh memory of this kind, the bare chain's few reused buffers are not."""
    chunk = os.urandom(CHUNK_BYTES)
    path = os.path.join(directory, "write-cost")

    def one() -> float:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            t = time.thread_time()
            for i in range(mib * MIB // CHUNK_BYTES):
                os.pwrite(fd, chunk, i * CHUNK_BYTES)
            return (time.thread_time() - t) / (mib / 1024)
        finally:
            os.close(fd)

    one()
    rewrite = one()
    os.unlink(path)
    time.sleep(settle_s)
    fresh = one()
    os.unlink(path)
    return {"fresh": round(fresh, 2), "rewrite": round(rewrite, 2)}


class FloorFiles:
    """The floor chain's two files: the spool's on the file system of the broker's (the temporary
    directory's, where LocalCluster keeps its state), the sink's where a job directory would be
    (as root a tmpfs mounted as the worker mounts one, huge pages included where it can; else a
    plain directory). Removed, and the tmpfs unmounted, on exit."""

    def __init__(self) -> None:
        self.top = tempfile.mkdtemp(prefix="gpud-floor-")
        self.spool = os.path.join(self.top, "spool")
        sink_dir = os.path.join(self.top, "job")
        os.mkdir(sink_dir, 0o700)
        self.mounted = ""
        if os.geteuid() == 0:
            for extra in (HUGE_DIR_OPTIONS, ""):
                try:
                    mount_tmpfs(sink_dir, f"size={4 << 30},mode=0700{extra}")
                except OSError:
                    continue
                self.mounted = sink_dir
                break
        self.sink = os.path.join(sink_dir, "input")
        self.sink_dir = sink_dir

    def __enter__(self) -> FloorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            unmount(self.mounted)
        shutil.rmtree(self.top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
