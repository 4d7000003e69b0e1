"""GPU figures of ``make gpu-check``: gpud's remote session beside the same operations done locally
with pycuda, in one run, on the same GPU.

- kernel launch round trip: the built-in ``vector_add`` on 1024 elements (one block of 256 threads),
  launched and waited for: through gpud, ``Session.launch`` (client -> broker -> worker -> pycuda
  launch + synchronize -> back); locally, pycuda's ``prepared_call`` + ``Context.synchronize``.
  Also gpud's ``sync`` round trip (no kernel): what the service itself costs.
- memcpy bandwidth: ``--mib`` MiB host -> device and device -> host from pageable numpy memory,
  through gpud (``memcpy_htod`` / ``memcpy_dtoh``, chunked by the client) and with pycuda
  (``memcpy_htod`` / ``memcpy_dtoh``).
- both through gpud two ways, with the session in a process of its own (the worker's default on
  a real GPU, ``gpud``) and in the worker's process (``--session-processes off``,
  ``gpud_in_worker``), to show what the session process costs: each way twice, in the order
  A B B A, each figure the mean of its two runs.

Medians (and p90 for round trips) over ``--launches`` launches and ``--repeat`` copies after a
warm-up. The last line of output is one JSON object (with the test counts of ``--junit`` when
given); everything above it is for people.

Usage (what scripts/gpu-check.sh runs)::

    python bench/gpu_check.py [--launches 300] [--mib 64] [--repeat 5] [--junit FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in ("libclient", "standby", "worker", "broker", "cli", "."):
    sys.path.insert(0, str(ROOT / p))

import numpy as np  # noqa: E402

from bench.dispatch import seconds_each  # noqa: E402

F32 = np.float32
N = 1024  # elements of the timed vector_add


def _times(fn: Callable[[], Any], count: int, warmup: int = 10) -> list[float]:
    return seconds_each(fn, count, warmup)


def _us(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": round(statistics.median(s) * 1e6, 1), "p90": round(s[int(0.9 * (len(s) - 1))] * 1e6, 1)}


def _gbps(nbytes: int, samples: list[float]) -> float:
    return round(nbytes / statistics.median(samples) / 1e9, 2)


def local_pycuda(launches: int, nbytes: int, repeat: int) -> dict[str, Any]:
    """The operations with pycuda in this process, on GPU 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pycuda.driver as drv
    from gpud_worker.kernels import CUDA_SOURCE
    from gpud_worker.modules import arch_of
    from gpud_worker.nvcc import NvccCompiler

    drv.init()
    dev = drv.Device(0)
    cubin = NvccCompiler().compile(CUDA_SOURCE, arch_of(dev.compute_capability()), [])
    ctx = dev.make_context()
    try:
        f = drv.module_from_buffer(cubin).get_function("vector_add")
        f.prepare("PPPi")
        a, b, out = (drv.mem_alloc(4 * N) for _ in range(3))
        host = np.ones(N, F32)
        drv.memcpy_htod(a, host)
        drv.memcpy_htod(b, host)

        def launch() -> None:
            f.prepared_call((1, 1, 1), (256, 1, 1), int(a), int(b), int(out), np.int32(N))
            ctx.synchronize()

        rtt = _times(launch, launches)
        back = np.empty(N, F32)
        drv.memcpy_dtoh(back, out)
        assert (back == 2).all(), "local vector_add gave a wrong result"
        big = drv.mem_alloc(nbytes)
        src = np.random.default_rng(0).standard_normal(nbytes // 4).astype(F32)
        dst = np.empty_like(src)
        htod = _times(lambda: drv.memcpy_htod(big, src), repeat, warmup=2)
        dtoh = _times(lambda: drv.memcpy_dtoh(dst, big), repeat, warmup=2)
        assert (dst == src).all(), "local copies gave a wrong result"
        return {"launch_rtt_us": _us(rtt), "htod_GBps": _gbps(nbytes, htod), "dtoh_GBps": _gbps(nbytes, dtoh),
                "gpu": dev.name(), "driver": drv.get_driver_version(), "cuda": ".".join(map(str, drv.get_version()))}
    finally:
        ctx.pop()
        ctx.detach()


def remote_gpud(launches: int, nbytes: int, repeat: int, processes: str = "auto") -> dict[str, Any]:
    """The same operations through a broker and a worker on this machine's GPU; ``processes``:
    the worker's ``--session-processes`` ("auto": the session in a process of its own)."""
    from gpud_cli.cluster import LocalCluster
    from gpud_client import BUILTIN, Client

    paths = os.pathsep.join(str(ROOT / p) for p in (".", "cli", "broker", "worker", "standby", "libclient"))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [paths, os.environ.get("PYTHONPATH")])), "GPUD_LOG_LEVEL": "WARNING"}
    with LocalCluster(workers=1, simulate=False, env=env, log_level="WARNING",
                      worker_args=["--session-processes", processes]) as cluster, \
            Client(cluster.frontend, timeout=60, journal_bytes=0) as client, \
            client.session(mem=nbytes + (64 << 20)) as s:
        assert s.device_info()["simulated"] is False
        a, b, out = (s.mem_alloc(4 * N) for _ in range(3))
        host = np.ones(N, F32)
        s.memcpy_htod(a, host)
        s.memcpy_htod(b, host)
        s.launch(BUILTIN, "vector_add", (1,), (256,), [a, b, out, np.int32(N)])  # compiles the built-ins
        rtt = _times(lambda: s.launch(BUILTIN, "vector_add", (1,), (256,), [a, b, out, np.int32(N)]), launches)
        assert (np.frombuffer(s.memcpy_dtoh(out), F32) == 2).all(), "remote vector_add gave a wrong result"
        sync = _times(s.synchronize, launches)
        big = s.mem_alloc(nbytes)
        src = np.random.default_rng(0).standard_normal(nbytes // 4).astype(F32)
        dst = np.empty_like(src)
        htod = _times(lambda: s.memcpy_htod(big, src), repeat, warmup=2)
        dtoh = _times(lambda: s.memcpy_dtoh(big, out=dst), repeat, warmup=2)
        assert (dst == src).all(), "remote copies gave a wrong result"
        return {"launch_rtt_us": _us(rtt), "sync_rtt_us": _us(sync), "htod_GBps": _gbps(nbytes, htod),
                "dtoh_GBps": _gbps(nbytes, dtoh), "worker": s.worker}


def test_counts(junit: Path) -> dict[str, int]:
    """passed/failed/errors/skipped of a pytest junit XML file."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=300)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--junit", type=Path, default=None, help="pytest junit XML of tests/gpu, for the counts")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    nbytes = args.mib << 20
    t0 = time.monotonic()
    result: dict[str, Any] = {}
    ok = True
    if args.junit is not None:
        try:
            result["tests"] = test_counts(args.junit)
        except (OSError, ET.ParseError) as exc:
            result["tests"] = {"error": f"no test results: {exc}"}
            ok = False
    # The two remote ways in the order A B B A, each figure the mean of its two runs: neither gets
    # the first run's (or the machine's drifting) advantage.
    sides: list[tuple[str, Callable[[int, int, int], dict[str, Any]]]] = [
        ("local", local_pycuda), ("gpud", remote_gpud),
        ("gpud_in_worker", lambda n, b, r: remote_gpud(n, b, r, "off")),
        ("gpud_in_worker", lambda n, b, r: remote_gpud(n, b, r, "off")), ("gpud", remote_gpud)]
    runs: dict[str, list[dict[str, Any]]] = {}
    for side, fn in sides:
        try:
            runs.setdefault(side, []).append(fn(args.launches, nbytes, args.repeat))
        except Exception as exc:
            traceback.print_exc()
            result[side] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
    for side, got in runs.items():
        result.setdefault(side, _mean(got))
    loc, rem, inw = result.get("local", {}), result.get("gpud", {}), result.get("gpud_in_worker", {})
    print(f"GPU: {loc.get('gpu', '?')} (driver {loc.get('driver', '?')}, CUDA {loc.get('cuda', '?')})")
    print(f"{'':28} {'gpud (remote)':>16} {'pycuda (local)':>16} {'gpud, in worker':>16}")
    for label, key, unit in (("launch round trip p50", "launch_rtt_us", "us"), ("launch round trip p90", "launch_rtt_us", "us")):
        q = "p50" if "p50" in label else "p90"
        print(f"{label:28} {_fmt(rem.get(key, {}).get(q), unit):>16} {_fmt(loc.get(key, {}).get(q), unit):>16}"
              f" {_fmt(inw.get(key, {}).get(q), unit):>16}")
    print(f"{'sync round trip p50':28} {_fmt(rem.get('sync_rtt_us', {}).get('p50'), 'us'):>16} {'-':>16}"
          f" {_fmt(inw.get('sync_rtt_us', {}).get('p50'), 'us'):>16}")
    for label, key in ((f"htod {args.mib} MiB", "htod_GBps"), (f"dtoh {args.mib} MiB", "dtoh_GBps")):
        print(f"{label:28} {_fmt(rem.get(key), 'GB/s'):>16} {_fmt(loc.get(key), 'GB/s'):>16} {_fmt(inw.get(key), 'GB/s'):>16}")
    if "tests" in result:
        print(f"tests/gpu: {result['tests']}")
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    line = json.dumps(result, sort_keys=True)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0 if ok else 1


def _mean(runs: list[dict[str, Any]], top: bool = True) -> dict[str, Any]:
    """The runs' figures averaged (numbers, and numbers in nested maps); other values from the
    first run. One run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _mean([r[key] for r in runs], top=False)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(statistics.fmean(r[key] for r in runs), 2)
        else:
            out[key] = value
    if top and len(runs) > 1:
        out["runs"] = len(runs)
    return out


def _fmt(v: Any, unit: str) -> str:
    return "-" if v is None else f"{v} {unit}"


if __name__ == "__main__":
    sys.exit(main())
