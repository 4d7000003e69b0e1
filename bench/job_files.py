"""Job files on disk against job files in memory: the same staged job, its input given as
``bytes`` or as a ``pathlib.Path`` (mapped, sent from the page cache) and its output returned
in ``JobResult.files`` or written into a directory (``outputs_to``), in alternating rounds on
one local cluster (one broker, one worker with simulated GPUs, labelled simulated).

For each way, per round: the job's wall time from submit to result (``--mib`` MiB in, half of
it back out), as a rate (input plus output bytes over that time), and the client process's
anonymous memory growth over the job (``RssAnon``, sampled every 5 ms; the client runs in a
process of its own per job, so that one way's memory does not hide the other's). The input
file is written once and stays in the page cache, as a dataset that was just made or read
would. The summary gives path / bytes ratios of the median rates and the growths. The last line
is one JSON object.

Usage::

    .venv/bin/python bench/job_files.py [--mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
MiB = 1 << 20

CLIENT = """
import json, sys, threading, time
from pathlib import Path
from gpud_client import Client

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

endpoint, way, src, out, half = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
peak, stop = [0], threading.Event()
def sample():
    while not stop.wait(0.005):
        peak[0] = max(peak[0], anon())
with Client(endpoint, timeout=120) as c:
    c.echo(b"warm")
    base = anon()
    t = threading.Thread(target=sample)
    t.start()
    t0 = time.perf_counter()
    if way == "path":
        res = c.run(["sh", "-c", f"head -c {half} in > out"], files={"in": src}, outputs=["out"], outputs_to=out,
                    gpu_milli=100, time_limit=120, timeout=180)
        got = (out / "out").stat().st_size
    else:
        res = c.run(["sh", "-c", f"head -c {half} in > out"], files={"in": src.read_bytes()}, outputs=["out"],
                    gpu_milli=100, time_limit=120, timeout=180)
        got = len(res.files["out"])
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
print(json.dumps({"s": dt, "growth": peak[0] - base, "ok": res.exit_code == 0 and got == half}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="input size in MiB (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both ways (default %(default)s)")
    args = p.parse_args()
    from gpud_cli.cluster import LocalCluster

    nbytes, half = args.mib * MiB, args.mib * MiB // 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(HERE / d) for d in ("", "libclient"))}
    got: dict[str, list[dict[str, Any]]] = {"bytes": [], "path": []}
    with tempfile.TemporaryDirectory(prefix="gpud-jobfiles-") as tmp, \
            LocalCluster(workers=1, gpus_per_worker=2) as cluster:
        src, out = Path(tmp, "in"), Path(tmp, "out")
        src.write_bytes(os.urandom(MiB) * args.mib)
        out.mkdir()
        for r in range(args.rounds + 1):  # round 0 warms the daemons (their first memory), not counted
            for way in (("bytes", "path") if r % 2 else ("path", "bytes")):
                proc = subprocess.run([sys.executable, "-c", CLIENT, cluster.frontend, way, str(src), str(out), str(half)],
                                      capture_output=True, text=True, timeout=300, env=env)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                one = json.loads(proc.stdout)
                if not one["ok"]:
                    print(f"round {r} {way}: the job's output came back wrong", file=sys.stderr)
                    return 1
                one["gb_s"] = (nbytes + half) / one["s"] / 1e9
                if r:
                    got[way].append(one)
                    print(f"round {r} {way:5}: {one['gb_s']:.2f} GB/s, client anonymous memory +{one['growth'] >> 20} MiB")
    summary: dict[str, Any] = {"mib": args.mib, "rounds": args.rounds}
    for way, runs in got.items():
        summary[f"{way}_gb_s"] = round(statistics.median(o["gb_s"] for o in runs), 3)
        summary[f"{way}_growth_mib"] = max(o["growth"] for o in runs) >> 20
    summary["rate_ratio"] = round(summary["path_gb_s"] / summary["bytes_gb_s"], 3)
    print(f"{args.mib} MiB in, {args.mib // 2} MiB out: path / bytes rate {summary['rate_ratio']:.2f}x; "
          f"client memory growth {summary['bytes_growth_mib']} MiB as bytes, {summary['path_growth_mib']} MiB as files")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
