"""``gpud up --demo``: a mixed workload through the real client library against a local cluster.

Runs echo requests, jobs with input and output files (one of them large: staged from a file on
disk, its output written into a directory), and device sessions with every built-in
kernel; checks every result (kernels against numpy); prints where each piece of work was placed and
a per-GPU summary. Returns 0 only when every result was right.
"""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpud_cli.cluster import LocalCluster


def run_demo(cluster: LocalCluster, echoes: int = 500, jobs: int = 8, sessions: int = 4) -> int:
    from gpud_client import BUILTIN, Client

    failures: list[str] = []
    placed: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    curve = cluster.client_keys("demo") if cluster.security == "curve" else None
    with Client(cluster.frontends, timeout=30.0, tenant="demo", curve=curve) as client:
        # Echo: a window of requests in flight, every payload checked.
        t0 = time.perf_counter()
        payloads = [os.urandom(64) for _ in range(echoes)]
        pending = [client.submit_echo(p) for p in payloads]
        wrong = sum(1 for p, q in zip(payloads, pending, strict=True) if q.wait() != p)
        dt = time.perf_counter() - t0
        print(f"echo     {echoes} requests, {echoes / dt:,.0f}/s, {wrong} wrong")
        if wrong:
            failures.append(f"{wrong} echo payloads came back wrong")

        # Jobs: a program with an input file, an output file and its GPU in the environment.
        submitted = []
        for i in range(jobs):
            text = f"hello from job {i}\n".encode()
            submitted.append((text, client.submit(
                ["sh", "-c", 'echo "gpu=$CUDA_VISIBLE_DEVICES"; tr a-z A-Z < in.txt > out.txt'],
                files={"in.txt": text}, outputs=["out.txt"], gpu_milli=250, time_limit=30,
            )))
        for text, job in submitted:
            r = job.wait()
            where = f"{r.worker}/{','.join(r.gpus)}"
            placed["job"][where] += 1
            if r.exit_code != 0 or r.files.get("out.txt") != text.upper() or not r.stdout.startswith(b"gpu="):
                failures.append(f"job on {where} returned exit {r.exit_code}, stderr {r.stderr[:200]!r}")
        print(f"jobs     {jobs} run as user(s) {sorted({r.user for _, j in submitted for r in [j.wait()]})}")
        failures += _large_job(client)

        # Sessions: every built-in kernel, checked against numpy.
        rng = np.random.default_rng(7)
        paths: collections.Counter[str] = collections.Counter()
        for i in range(sessions):
            with client.session(gpu_milli=250, mem=64 << 20) as s:
                where = f"{s.worker}/{s.gpu.get('uuid')}"
                placed["session"][where] += 1
                info = s.info()
                paths[f"{info['path']} {info.get('endpoint') or info.get('why')}"] += 1
                for name, err in _check_kernels(s, BUILTIN, rng).items():
                    if err is not None:
                        failures.append(f"session {i} kernel {name}: {err}")
        print(f"sessions {sessions} x 4 built-in kernels checked against numpy")
        print("         their calls went " + "; ".join(
            f"{n} session(s) {'straight to the worker at' if p.startswith('direct') else 'through the broker:'} "
            f"{p.split(' ', 1)[1]}" for p, n in sorted(paths.items())))
        if cluster.pair:
            failures += _failover(cluster, client)

    print("\nwhere the work was placed (worker/GPU: count)")
    for kind, counter in placed.items():
        print(f"  {kind:8} " + ", ".join(f"{k}: {v}" for k, v in sorted(counter.items())))
    _print_gpus(cluster.status(role=cluster.wait_active() if cluster.pair else None))
    if failures:
        print("\nDEMO FAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("\ndemo OK: every result checked")
    return 0


def _large_job(client: Any, mib: int = 64) -> list[str]:
    """A job with a dataset from a file on disk (staged in 1 MiB chunks through the broker's
    spool, never whole in this process's memory) and half of it back as an output written into
    a directory as it comes; both checked."""
    with tempfile.TemporaryDirectory(prefix="gpud-demo-") as tmp:
        data, results = Path(tmp, "data.bin"), Path(tmp, "results")
        data.write_bytes(os.urandom(mib << 20))
        results.mkdir()
        half = mib << 19
        t0 = time.perf_counter()
        r = client.run(["sh", "-c", f"md5sum data.bin; head -c {half} data.bin > head.bin"], files={"data.bin": data},
                       outputs=["head.bin"], outputs_to=results, gpu_milli=250, time_limit=60)
        dt = time.perf_counter() - t0
        content = data.read_bytes()
        print(f"staged   a job with {mib} MiB in from a file and {mib // 2} MiB out into a directory: {dt:.1f}s")
        if r.exit_code != 0 or r.stdout.split()[:1] != [hashlib.md5(content).hexdigest().encode()]:
            return [f"the large job saw other bytes: exit {r.exit_code}, {r.stdout[:100]!r}, {r.stderr[:200]!r}"]
        if r.paths.get("head.bin") != results / "head.bin" or (results / "head.bin").read_bytes() != content[:half]:
            return ["the large job's output came back wrong"]
    return []


def _failover(cluster: LocalCluster, client: Any) -> list[str]:
    """Kill the active broker (SIGKILL) with jobs running and a session open, and send echoes
    right after: every result must still come back right, through the other broker. Then restart
    the killed one (it comes back passive and re-syncs)."""
    active = cluster.wait_active()
    payloads = [os.urandom(64) for _ in range(300)]
    jobs = [client.submit(["sh", "-c", f"sleep 0.5; echo {i}"], gpu_milli=50, time_limit=30) for i in range(6)]
    s = client.session(gpu_milli=100, mem=1 << 20)
    x = s.mem_alloc(16)
    s.memcpy_htod(x, np.arange(4, dtype=np.float32))
    time.sleep(0.3)  # the passive broker has all of it now
    t0 = time.perf_counter()
    cluster.kill_broker(active)
    echoes = [client.submit_echo(p) for p in payloads]
    wrong = sum(1 for p, q in zip(payloads, echoes, strict=True) if q.wait() != p)
    bad_jobs = sum(1 for i, j in enumerate(jobs) if (r := j.wait()).exit_code != 0 or r.stdout.strip() != str(i).encode())
    s.launch("builtin", "saxpy", (1,), (4,), (np.float32(2), x, x, np.int32(4)))
    got = np.frombuffer(s.memcpy_dtoh(x), np.float32)
    s.close()
    dt = time.perf_counter() - t0
    now = cluster.wait_active()
    print(f"failover {active} killed (SIGKILL) with 6 jobs running and a session open, 300 echoes sent "
          f"after it: {now} took over; all answered in {dt:.1f}s, {wrong + bad_jobs} wrong")
    cluster.restart_broker(active)
    print(f"         {active} restarted: it comes back passive and re-syncs from {now}")
    out = []
    if wrong or bad_jobs:
        out.append(f"after the failover {wrong} echo(es) and {bad_jobs} job(s) came back wrong")
    if not np.allclose(got, 3 * np.arange(4, dtype=np.float32)):
        out.append(f"the session's saxpy after the failover gave {got}")
    return out


def _check_kernels(s: Any, builtin: str, rng: np.random.Generator) -> dict[str, str | None]:
    """Run each built-in kernel on the session; return kernel -> None (right) or what was wrong."""
    out: dict[str, str | None] = {}
    n = 4096
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    da, db, dc = s.mem_alloc(a.nbytes), s.mem_alloc(b.nbytes), s.mem_alloc(a.nbytes)
    s.memcpy_htod(da, a)
    s.memcpy_htod(db, b)
    s.launch(builtin, "vector_add", (16,), (256,), (da, db, dc, np.int32(n)))
    got = np.frombuffer(s.memcpy_dtoh(dc), dtype=np.float32)
    out["vector_add"] = None if np.allclose(got, a + b) else "wrong result"
    s.launch(builtin, "saxpy", (16,), (256,), (np.float32(2.5), da, db, np.int32(n)))
    got = np.empty(n, dtype=np.float32)
    s.memcpy_dtoh(db, out=got)
    out["saxpy"] = None if np.allclose(got, 2.5 * a + b, rtol=1e-5) else "wrong result"
    m, k, nn = 33, 17, 29
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = rng.standard_normal((k, nn), dtype=np.float32)
    dA, dB, dC = s.mem_alloc(A.nbytes), s.mem_alloc(B.nbytes), s.mem_alloc(m * nn * 4)
    s.memcpy_htod(dA, A)
    s.memcpy_htod(dB, B)
    s.launch(builtin, "sgemm", (2, 2), (16, 16), (dA, dB, dC, np.int32(m), np.int32(nn), np.int32(k)))
    C = np.frombuffer(s.memcpy_dtoh(dC), dtype=np.float32).reshape(m, nn)
    out["sgemm"] = None if np.allclose(C, A @ B, rtol=1e-4, atol=1e-4) else "wrong result"
    dsum = s.mem_alloc(4)
    s.launch(builtin, "reduce_sum", (1,), (256,), (da, dsum, np.int32(n)))
    s.synchronize()
    total = np.frombuffer(s.memcpy_dtoh(dsum), dtype=np.float32)[0]
    out["reduce_sum"] = None if abs(total - a.sum(dtype=np.float64)) < 1e-2 else f"{total} != {a.sum()}"
    return out


def _print_gpus(st: dict[str, Any]) -> None:
    b, c = st["broker"], st["counts"]
    print(f"\nbroker {b['name']} ({b['policy']}): {c['workers']} workers, {c['gpus']} GPUs, "
          f"{c['done']} requests done, {c['queued']} queued")
    print(f"  {'worker':8} {'gpu':>3} {'model':10} {'util%':>5} {'mem used':>9} {'granted':>7} {'health':8}")
    for g in st["gpus"]:
        sim = " (simulated)" if g["simulated"] else ""
        print(f"  {g['worker']:8} {g['index']:>3} {g['model']:10} {g['util']:5.0f} "
              f"{g['mem_used'] / 2**20:7.0f}Mi {g['granted_milli']:7} {g['health']:8}{sim}")
