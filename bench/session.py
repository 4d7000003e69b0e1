"""Session calls and copies: relayed through the broker, direct to the worker, and bare pyzmq, in one run.

- relay: a session of a client with ``data_path="broker"`` (every CALL client -> broker -> worker
  and back); direct: one with ``data_path="auto"`` on a worker with a data socket (client -> the
  session's own socket on the worker, answered by the session's thread, PROTOCOL.md §10). One LocalCluster (one broker, one worker, one SIMULATED GPU: device
  memory is host memory) serves both.
- bare: a pyzmq DEALER here and a ROUTER in another process, one hop, ``copy=False``: a small
  message answered at once (the call), and the copy as chunks of the client's ``chunk_bytes``,
  ``chunk_window`` outstanding, the ROUTER copying each htod chunk into a buffer it holds and
  answering each dtoh chunk from it (what the simulated GPU does), the client copying each dtoh
  chunk into its place.

Figures: ``*_call_p50_us``, the median of ``--calls`` ``sync`` calls (``bare``: round trips);
``*_copy_gbps``, 2 x ``--copy-mib`` bytes (htod then dtoh) over the median time of ``--reps``
copies, in 1e9 bytes per second; ``broker_cpu_us_per_call_*``, the broker process's CPU time
(user + system, /proc, 10 ms ticks) over the calls, per call; ``server_cpu_us_per_call_*``, the
same for the process that answers the calls (the worker; bare: the ROUTER process), a figure that
a loaded machine moves far less than a latency. The three systems alternate for
``--rounds`` rounds; each figure is the median over the rounds (``*_rounds``: every round's).
The last line of output is one JSON object: every figure above, with each round's, and the
ratios ``direct_over_relay_call``, ``direct_over_bare_call``, ``direct_over_relay_copy``,
``direct_over_bare_copy`` and ``direct_over_bare_server_cpu``. About a minute with the defaults on a quiet 2-core VM (at most 4).

Usage::

    .venv/bin/python bench/session.py [--json] [--calls 2000] [--copy-mib 256] [--reps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

from gpud_cli.cluster import LocalCluster
from gpud_client import Client, Session
from gpud_client.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW

MIB = 1 << 20

_BARE_SERVER = r"""
import sys, zmq, numpy as np
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1")
buf = np.empty(int(sys.argv[1]), dtype=np.uint8)
print(port, flush=True)
while True:
    ident, op, arg, *rest = s.recv_multipart(copy=False)
    o = op.bytes
    if o == b"c":
        s.send_multipart([ident, b"ok"])
    elif o == b"h":
        off = int(arg.bytes)
        data = np.frombuffer(rest[0].buffer, dtype=np.uint8)
        buf[off:off + data.size] = data
        s.send_multipart([ident, b"ok"])
    elif o == b"d":
        off, n = (int(x) for x in arg.bytes.split(b","))
        s.send_multipart([ident, memoryview(buf[off:off + n])], copy=False)
    else:
        break
"""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calls_p50(s: Session, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        s.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def copy_gbps(s: Session, nbytes: int, reps: int) -> float:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    ptr = s.mem_alloc(nbytes)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        s.memcpy_htod(ptr, src)
        s.memcpy_dtoh(ptr, out=dst)
        times.append(time.perf_counter() - t)
    assert np.array_equal(src, dst)
    s.mem_free(ptr)
    return 2 * nbytes / statistics.median(times) / 1e9


class Bare:
    """The bare baseline: a ROUTER process, one hop, and a DEALER here."""

    def __init__(self, nbytes: int, chunk: int, window: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _BARE_SERVER, str(nbytes)], stdout=subprocess.PIPE)
        self.ctx = zmq.Context()
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.d = self.ctx.socket(zmq.DEALER)
        self.d.setsockopt(zmq.LINGER, 0)
        self.d.connect(f"tcp://127.0.0.1:{port}")
        self.nbytes, self.window = nbytes, window
        self.spans = [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]

    def close(self) -> None:
        self.ctx.destroy(0)
        self.proc.kill()
        self.proc.wait()

    def call_p50(self, calls: int) -> float:
        d, times = self.d, []
        for _ in range(calls):
            t = time.perf_counter()
            d.send_multipart([b"c", b""])
            d.recv_multipart()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    def copy_gbps(self, reps: int) -> float:
        d, spans, window = self.d, self.spans, self.window
        src = np.random.default_rng(1).integers(0, 255, self.nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        copies = []
        for _ in range(reps):
            t = time.perf_counter()
            for op in ("h", "d"):
                out = 0
                for i, (off, n) in enumerate(spans):
                    if op == "h":
                        d.send_multipart([b"h", str(off).encode(), memoryview(src[off:off + n])], copy=False)
                    else:
                        d.send_multipart([b"d", f"{off},{n}".encode()])
                    if i - out + 1 >= window:
                        _bare_answer(d, op, dst, spans[out])
                        out += 1
                while out < len(spans):
                    _bare_answer(d, op, dst, spans[out])
                    out += 1
            copies.append(time.perf_counter() - t)
        assert np.array_equal(src, dst)
        return 2 * self.nbytes / statistics.median(copies) / 1e9


def _bare_answer(d: zmq.Socket[Any], op: str, dst: np.ndarray, span: tuple[int, int]) -> None:
    frames = d.recv_multipart(copy=False)
    if op == "d":
        off, n = span
        dst[off:off + n] = np.frombuffer(frames[0].buffer, dtype=np.uint8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="end with the JSON line (always printed)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="copies per round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    nbytes = a.copy_mib * MIB
    out: dict[str, Any] = {"calls": a.calls, "copy_mib": a.copy_mib, "reps": a.reps, "rounds": a.rounds,
                           "chunk_bytes": DEFAULT_CHUNK_BYTES, "chunk_window": DEFAULT_CHUNK_WINDOW}
    rounds: dict[str, list[float]] = {}
    with LocalCluster(workers=1, log_level="WARNING") as c, \
            Client(c.frontend, timeout=120, data_path="broker") as relay_client, \
            Client(c.frontend, timeout=120, data_path="auto") as direct_client:
        c.wait_workers(1)
        broker = c.broker.pid if c.broker is not None else None
        worker = next(iter(c.worker_procs.values())).pid
        sessions = {"relay": relay_client.session(mem=nbytes + MIB), "direct": direct_client.session(mem=nbytes + MIB)}
        assert sessions["relay"].info()["path"] == "broker" and sessions["direct"].info()["path"] == "direct"
        bare = Bare(nbytes, DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW)
        try:
            for s in sessions.values():
                calls_p50(s, 200)  # warm up
            # The three alternate round by round; each figure is the median over the rounds.
            for r in range(a.rounds):
                for path, s in sessions.items():
                    before = cpu_s(broker) if broker else 0.0
                    served = cpu_s(worker)
                    rounds.setdefault(f"{path}_call_p50_us", []).append(calls_p50(s, a.calls))
                    rounds.setdefault(f"server_cpu_us_per_call_{path}", []).append((cpu_s(worker) - served) / a.calls * 1e6)
                    if broker:
                        rounds.setdefault(f"broker_cpu_us_per_call_{path}", []).append((cpu_s(broker) - before) / a.calls * 1e6)
                    rounds.setdefault(f"{path}_copy_gbps", []).append(copy_gbps(s, nbytes, a.reps))
                served = cpu_s(bare.proc.pid)
                rounds.setdefault("bare_call_p50_us", []).append(bare.call_p50(a.calls))
                rounds.setdefault("server_cpu_us_per_call_bare", []).append((cpu_s(bare.proc.pid) - served) / a.calls * 1e6)
                rounds.setdefault("bare_copy_gbps", []).append(bare.copy_gbps(a.reps))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in rounds.items()), flush=True)
        finally:
            bare.close()
            for s in sessions.values():
                s.close()
    for key, values in rounds.items():
        out[key] = round(statistics.median(values), 3)
        out[f"{key}_rounds"] = [round(v, 3) for v in values]
    for path in ("relay", "direct", "bare"):
        print(f"{path:6}  call p50 {out[f'{path}_call_p50_us']:8.1f} us   copy {out[f'{path}_copy_gbps']:6.3f} GB/s"
              f"   server CPU {out[f'server_cpu_us_per_call_{path}']:6.1f} us/call"
              + (f"   broker CPU {out[f'broker_cpu_us_per_call_{path}']:7.2f} us/call" if path != "bare" and broker else ""))
    out["direct_over_relay_call"] = round(out["direct_call_p50_us"] / out["relay_call_p50_us"], 3)
    out["direct_over_bare_call"] = round(out["direct_call_p50_us"] / out["bare_call_p50_us"], 3)
    out["direct_over_relay_copy"] = round(out["direct_copy_gbps"] / out["relay_copy_gbps"], 3)
    out["direct_over_bare_copy"] = round(out["direct_copy_gbps"] / out["bare_copy_gbps"], 3)
    out["direct_over_bare_server_cpu"] = round(out["server_cpu_us_per_call_direct"] / out["server_cpu_us_per_call_bare"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
