"""Bulk transfer benchmark: session copies through gpud against a bare pyzmq chain, in one run.

Both sides get the same hops: a client DEALER in this process, one forwarding process (ROUTER
frontend, ROUTER backend) and one worker process (DEALER) that answers.

- gpud: a LocalCluster (one broker, one worker with one simulated GPU); ``memcpy_htod`` of a host
  numpy array into a device allocation, and ``memcpy_dtoh`` of it back into a host numpy array
  (``out=``), with the client's default ``chunk_bytes`` (copies larger than that travel as a window
  of chunk CALLs) unless ``--chunk-bytes`` says otherwise. The simulated GPU's device memory is
  host memory: its copy into or out of it stands for the PCIe transfer of a real GPU.
- bare, two ways, both with ``copy=False`` everywhere; the forwarder only moves frames (its
  routing by identity is the least a broker does) and the bare worker copies nothing:

  - one message: htod sends ``[rid, "h", payload]`` and the worker answers ``[rid, "ok"]``; dtoh
    sends ``[rid, "d", nbytes]`` and the worker answers ``[rid, payload]`` from a buffer it holds;
    the client keeps the received frame as it is (no copy into a destination buffer);
  - chunked: the same messages for chunks of gpud's ``chunk_bytes``, gpud's ``chunk_window`` of
    them outstanding; dtoh copies each chunk into its place in the destination array (as gpud).

Rates are GB/s (1e9 bytes per second) of the median copy time over several copies per size. The
systems alternate round by round (all of them stay up), and the figures are from the round with the
median ratio. ``ratio`` is gpud over the faster bare way, at the largest size (256 MiB), in the
direction where gpud does worse (the smaller of the htod and dtoh ratios);
``ratio_vs_one_message`` is the same against the one-message bare send alone.

The last line of output is one JSON object (for scripts); everything above it is for people.

Usage::

    .venv/bin/python bench/transfer.py [--sizes 1,64,256] [--rounds 3] [--reps 5]
                                       [--chunk-bytes N] [--chunk-window N]

The script also runs its own baseline processes: ``--role bare-forwarder`` and
``--role bare-worker`` (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dispatch  # noqa: E402  (start_ready, stop_all, seconds_each: shared with bench/dispatch.py)

MIB = 1 << 20
Figures = dict[str, dict[int, float]]  # direction -> size -> GB/s
POLL_TIMEOUT_MS = 60_000  # no answer for this long is a failure of the run, not a slow result
READY = b"READY"


# --------------------------------------------------------------------------- baseline processes


def _sock(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.DEALER:
        s.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    return s


class FileWriter:
    """Writes chunks into one file on a thread of its own, in order, as gpud's spool and job
    threads do (``put(offset, frame)``; offset 0 starts the file afresh): the page-cache copies a
    staged input must take, for the bare chain that does what gpud must (``--spool``, ``--sink``).
    ``drain`` waits until every chunk put is written: a transfer is over once its bytes are in
    their files (gpud's job starts only then), not when the last chunk was handed to the thread.
    Then the sink's file is emptied, as the worker removes a job's directory when the job ends:
    the next transfer writes into memory freed as long ago as gpud's next job does, not into pages
    freed a moment before (which some machines charge far less for, ``write_costs`` in
    bench/staging.py). The spool's (``keep``) is written over in place, as gpud's spool keeps an
    ended upload's file for the next one."""

    def __init__(self, path: str, keep: bool = False) -> None:
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.keep = keep
        self.chunks: queue.Queue[tuple[int, Any]] = queue.Queue()
        threading.Thread(target=self._run, name="bare-writer", daemon=True).start()

    def put(self, offset: int, frame: Any) -> None:
        self.chunks.put((offset, frame))

    def drain(self) -> None:
        self.chunks.join()
        self.chunks.put((-1, None))  # the job ended: its bytes are let go (not waited for)

    def _run(self) -> None:
        while True:
            offset, frame = self.chunks.get()
            if offset <= 0 and not self.keep:
                os.ftruncate(self.fd, 0)  # a transfer ended, or a new one begins afresh
            if offset < 0:
                self.chunks.task_done()
                continue
            view = frame.buffer
            done = 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
            self.chunks.task_done()


def bare_forwarder(spool: str | None = None) -> int:
    """ROUTER frontend -> ROUTER backend -> one worker DEALER, and back. Prints its endpoints as one
    JSON line, then serves until killed. Frames are moved without a copy (``copy=False``). With
    ``spool``, each chunk that names its offset is also written to that file (``FileWriter``)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    writer = FileWriter(spool, keep=True) if spool else None
    ctx: zmq.Context[Any] = zmq.Context()
    front, back = _sock(ctx, zmq.ROUTER), _sock(ctx, zmq.ROUTER)
    front.bind("tcp://127.0.0.1:*")
    back.bind("tcp://127.0.0.1:*")
    print(json.dumps({"frontend": front.getsockopt_string(zmq.LAST_ENDPOINT),
                      "backend": back.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    worker: bytes | None = None
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(1000))
            if back in ready:
                msg = back.recv_multipart(copy=False)
                if msg[1].bytes == READY:
                    worker = msg[0].bytes
                else:  # [worker, client, *reply]
                    front.send_multipart(msg[1:], copy=False)
            if front in ready and worker is not None:
                msg = front.recv_multipart(copy=False)  # [client, *request]
                if writer is not None and len(msg) == 5:  # [client, rid, "h", chunk, offset]
                    writer.put(int(msg[4].bytes), msg[3])
                elif writer is not None and msg[2].bytes == b"f":  # the end of a transfer: its bytes
                    writer.drain()  # are in the spool before the sink is asked for its own
                back.send_multipart([worker, *msg], copy=False)
    finally:
        front.close(0)
        back.close(0)
        ctx.term()


def bare_worker(backend: str, max_bytes: int, sink: str | None = None) -> int:
    """htod: ``[client, rid, "h", payload]`` -> ``[client, rid, "ok"]``; dtoh: ``[client, rid,
    "d", nbytes]`` -> ``[client, rid, payload]`` (a slice of a buffer it holds, sent without a copy).
    With ``sink``, each htod chunk that names its offset is also written to that file."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    writer = FileWriter(sink) if sink else None
    ctx: zmq.Context[Any] = zmq.Context()
    sock = _sock(ctx, zmq.DEALER)
    sock.connect(backend)
    sock.send(READY)
    held = np.random.default_rng(1).integers(0, 255, max_bytes, np.uint8).data
    try:
        while True:
            msg = sock.recv_multipart(copy=False)
            client, rid, op = msg[0], msg[1], msg[2].bytes
            if op == b"h":
                if writer is not None and len(msg) == 5:
                    writer.put(int(msg[4].bytes), msg[3])
                sock.send_multipart([client, rid, b"ok"], copy=False)
            elif op == b"f":  # the end of a transfer: answered once its bytes are in the sink
                if writer is not None:
                    writer.drain()
                sock.send_multipart([client, rid, b"ok"], copy=False)
            else:
                n = int(msg[3].bytes)
                sock.send_multipart([client, rid, held[:n]], copy=False)
    finally:
        sock.close(0)
        ctx.term()


class Bare:
    """The bare chain: forwarder and worker as child processes, a DEALER client here. With
    ``spool`` and ``sink`` (file paths), the forwarder and the worker also write every chunk of
    ``htod_chunked`` to those files: the two copies a staged input takes in gpud (the broker's
    spool, the job's directory), on the same hops, the floor of what any design can reach."""

    def __init__(self, max_bytes: int, spool: str | None = None, sink: str | None = None) -> None:
        me = [sys.executable, os.path.abspath(__file__)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.writes = bool(spool or sink)
        ends = dispatch.start_ready(self.procs, [*me, "--role", "bare-forwarder", *(("--spool", spool) if spool else ())],
                                    "the bare forwarder", self.stop)
        self.procs.append(subprocess.Popen(
            [*me, "--role", "bare-worker", "--backend", ends["backend"], "--max-bytes", str(max_bytes),
             *(("--sink", sink) if sink else ())],
            stdin=subprocess.DEVNULL))
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = _sock(self.ctx, zmq.DEALER)
        self.sock.connect(ends["frontend"])
        self.seq = 0
        self.kept: Any = None

    def _recv(self, rid: bytes) -> list[Any]:
        while True:
            if not self.sock.poll(POLL_TIMEOUT_MS):
                raise TimeoutError(f"bare: no reply within {POLL_TIMEOUT_MS} ms")
            msg = self.sock.recv_multipart(copy=False)
            if msg[0].bytes == rid:
                return msg

    def htod(self, view: memoryview) -> None:
        self.seq += 1
        rid = self.seq.to_bytes(8, "little")
        self.sock.send_multipart([rid, b"h", view], copy=False)
        self._recv(rid)

    def _windowed(self, nbytes: int, chunk: int, window: int, request: Any, reply: Any) -> None:
        """One copy as chunk messages, ``window`` of them outstanding (as gpud's client does)."""
        spans = [(a, min(chunk, nbytes - a)) for a in range(0, nbytes, chunk)]
        outstanding: dict[bytes, tuple[int, int]] = {}
        sent = 0
        while sent < len(spans) or outstanding:
            while sent < len(spans) and len(outstanding) < window:
                self.seq += 1
                rid = self.seq.to_bytes(8, "little")
                self.sock.send_multipart([rid, *request(*spans[sent])], copy=False)
                outstanding[rid] = spans[sent]
                sent += 1
            if not self.sock.poll(POLL_TIMEOUT_MS):
                raise TimeoutError(f"bare: no reply within {POLL_TIMEOUT_MS} ms")
            msg = self.sock.recv_multipart(copy=False)
            reply(*outstanding.pop(msg[0].bytes), msg)

    def htod_chunked(self, view: memoryview, chunk: int, window: int) -> None:
        if self.writes:  # the chunk names its offset: the writers put it in its place
            self._windowed(view.nbytes, chunk, window, lambda a, n: (b"h", view[a : a + n], str(a).encode()),
                           lambda a, n, msg: None)
            self.seq += 1  # then wait until both files hold every byte
            rid = self.seq.to_bytes(8, "little")
            self.sock.send_multipart([rid, b"f"])
            self._recv(rid)
        else:
            self._windowed(view.nbytes, chunk, window, lambda a, n: (b"h", view[a : a + n]),
                           lambda a, n, msg: None)

    def dtoh_chunked(self, out: memoryview, chunk: int, window: int) -> None:
        def reply(a: int, n: int, msg: list[Any]) -> None:
            out[a : a + n] = msg[1].buffer  # each chunk lands in its place in the destination

        self._windowed(out.nbytes, chunk, window, lambda a, n: (b"d", str(n).encode()), reply)

    def dtoh(self, nbytes: int) -> None:
        self.seq += 1
        rid = self.seq.to_bytes(8, "little")
        self.sock.send_multipart([rid, b"d", str(nbytes).encode()], copy=False)
        msg = self._recv(rid)
        if len(msg[1]) != nbytes:
            raise RuntimeError("bare: dtoh size mismatch")
        self.kept = msg[1]  # held as the caller would hold it, dropped at the next copy

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:  # the worker may not have said READY yet: retry a tiny dtoh until answered
            self.seq += 1
            rid = self.seq.to_bytes(8, "little")
            self.sock.send_multipart([rid, b"d", b"1"])
            if self.sock.poll(200):
                self._recv(rid)
                return
            if time.monotonic() > deadline:
                raise RuntimeError("bare: the worker did not come up")

    def stop(self) -> None:
        if hasattr(self, "sock"):
            self.sock.close(0)
            self.ctx.term()
        dispatch.stop_all(self.procs)


class Gpud:
    """A LocalCluster (one broker, one worker, one simulated GPU) and one session on it."""

    def __init__(self, max_bytes: int, chunk_bytes: int | None, chunk_window: int | None) -> None:
        from gpud_cli.cluster import LocalCluster
        from gpud_client import Client

        self.cluster = LocalCluster(workers=1, gpus_per_worker=1, log_level="WARNING")
        self.cluster.start()
        kw: dict[str, Any] = {}
        if chunk_bytes is not None:
            kw["chunk_bytes"] = chunk_bytes
        if chunk_window is not None:
            kw["chunk_window"] = chunk_window
        self.client = Client(self.cluster.frontend, timeout=POLL_TIMEOUT_MS / 1000, **kw)
        self.session = self.client.session(gpu_milli=1000, mem=max_bytes)
        self.ptr = self.session.mem_alloc(max_bytes)

    def htod(self, view: memoryview) -> None:
        self.session.memcpy_htod(self.ptr, view)

    def dtoh(self, out: np.ndarray) -> None:
        self.session.memcpy_dtoh(self.ptr, out=out)

    def stop(self) -> None:
        try:
            self.session.close()
            self.client.close()
        finally:
            self.cluster.stop()


# --------------------------------------------------------------------------- measurement


def _reps(nbytes: int, args: argparse.Namespace) -> int:
    reps: int = args.reps
    return max(reps, min(200, (256 * MIB) // max(nbytes, 1) * reps // 8))


def _time(fn: Any, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (after one warm-up call)."""
    return statistics.median(dispatch.seconds_each(fn, reps, warmup=1))


def _round_gpud(g: Gpud, host: np.ndarray, out: np.ndarray, sizes: list[int],
                args: argparse.Namespace) -> Figures:
    res: Figures = {"htod": {}, "dtoh": {}}
    for n in sizes:
        src, dst = host.data[:n], out[:n]
        res["htod"][n] = n / _time(lambda: g.htod(src), _reps(n, args)) / 1e9  # noqa: B023
        res["dtoh"][n] = n / _time(lambda: g.dtoh(dst), _reps(n, args)) / 1e9  # noqa: B023
        if not np.array_equal(dst, host[:n]):
            raise RuntimeError(f"gpud: dtoh of {n} bytes does not match what htod copied")
    return res


def _round_bare(b: Bare, host: np.ndarray, out: np.ndarray, sizes: list[int], args: argparse.Namespace,
                chunk: int, window: int) -> tuple[Figures, Figures]:
    one: Figures = {"htod": {}, "dtoh": {}}
    chunked: Figures = {"htod": {}, "dtoh": {}}
    for n in sizes:
        src, dst = host.data[:n], out.data[:n]
        reps = _reps(n, args)
        one["htod"][n] = n / _time(lambda: b.htod(src), reps) / 1e9  # noqa: B023
        one["dtoh"][n] = n / _time(lambda: b.dtoh(n), reps) / 1e9  # noqa: B023
        b.kept = None
        chunked["htod"][n] = n / _time(lambda: b.htod_chunked(src, chunk, window), reps) / 1e9  # noqa: B023
        chunked["dtoh"][n] = n / _time(lambda: b.dtoh_chunked(dst, chunk, window), reps) / 1e9  # noqa: B023
    return one, chunked


def _best(a: Figures, b: Figures) -> Figures:
    return {d: {n: max(a[d][n], b[d][n]) for n in a[d]} for d in a}


def _ratio(g: Figures, bare: Figures, n: int) -> float:
    """gpud over bare at ``n`` bytes, in the direction where gpud does worse."""
    return min(g["htod"][n] / bare["htod"][n], g["dtoh"][n] / bare["dtoh"][n])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,64,256", help="copy sizes in MiB, comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating gpud/bare rounds; figures from the round with the median ratio (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed copies of the largest size per round (default %(default)s)")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="the client's chunk_bytes, and the bare chunks' size (default: the client's default)")
    p.add_argument("--chunk-window", type=int, default=None,
                   help="the client's chunk_window, and the bare chunks' window (default: the client's default)")
    p.add_argument("--role", choices=["bench", "bare-forwarder", "bare-worker"], default="bench",
                   help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--spool", help=argparse.SUPPRESS)
    p.add_argument("--sink", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "bare-forwarder":
        return bare_forwarder(args.spool)
    if args.role == "bare-worker":
        return bare_worker(args.backend, args.max_bytes, args.sink)
    try:
        sizes = sorted({int(s) * MIB for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        p.error("--sizes must be comma-separated integers (MiB)")
    if not sizes or sizes[0] <= 0 or args.rounds < 1 or args.reps < 1:
        p.error("--sizes, --rounds and --reps must be positive")
    top = sizes[-1]
    host = np.random.default_rng(0).integers(0, 255, top, np.uint8)
    out = np.zeros(top, np.uint8)
    t_start = time.perf_counter()
    g = Gpud(top, args.chunk_bytes, args.chunk_window)
    try:
        b = Bare(top)
        try:
            b.wait_ready()
            chunk, window = g.client.chunk_bytes, g.client.chunk_window
            rounds = []
            for i in range(args.rounds):
                gr = _round_gpud(g, host, out, sizes, args)
                one, chunked = _round_bare(b, host, out, sizes, args, chunk, window)
                rounds.append((_ratio(gr, _best(one, chunked), top), gr, one, chunked))
                print(f"round {i + 1}: ratio at {top // MIB} MiB {rounds[-1][0]:.2f}", flush=True)
        finally:
            b.stop()
    finally:
        g.stop()
    rounds.sort(key=lambda r: r[0])
    ratio, gr, one, chunked = rounds[len(rounds) // 2]
    best = _best(one, chunked)

    print(f"session copies through the broker to a simulated GPU, against bare pyzmq over the same "
          f"hops (GB/s, median copy time; chunk_bytes {chunk}, chunk_window {window}; {os.cpu_count()} CPUs)")
    print(f"{'':>9}{'gpud':>8}{'bare 1 msg':>12}{'bare chunked':>14}{'gpud/best bare':>16}")
    for d in ("htod", "dtoh"):
        for n in sizes:
            print(f"{d} {n // MIB:>5}{gr[d][n]:>8.2f}{one[d][n]:>12.2f}{chunked[d][n]:>14.2f}"
                  f"{gr[d][n] / best[d][n]:>16.2f}")
    print("ratios by round: " + ", ".join(f"{r[0]:.2f}" for r in rounds))
    summary: dict[str, Any] = {}
    for side, r in (("gpud", gr), ("bare", one), ("bare_chunked", chunked)):
        for d in ("htod", "dtoh"):
            for n in sizes:
                summary[f"{side}_{d}_{n // MIB}mib_gbps"] = round(r[d][n], 3)
    summary.update({
        "htod_ratio": round(gr["htod"][top] / best["htod"][top], 3),
        "dtoh_ratio": round(gr["dtoh"][top] / best["dtoh"][top], 3),
        "ratio": round(ratio, 3),
        "ratio_vs_one_message": round(_ratio(gr, one, top), 3),
        "ratio_size_mib": top // MIB,
        "ratios": [round(r[0], 3) for r in rounds],
        "chunk_bytes": chunk,
        "chunk_window": window,
        "rounds": args.rounds,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - t_start, 1),
    })
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
