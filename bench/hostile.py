"""A's echo latency while a hostile tenant (B) or an outsider floods the broker, as a ratio to A's
idle figures in the same run; and the broker's RSS under a queue flood at B's budgets.

Real daemons (``LocalCluster``, CURVE on, one worker with one simulated GPU); each flood runs in a
process of its own while A, an honest tenant with a connected ``Client``, makes sequential echoes.
The target (issue "The broker under hostile tenants") is A's p99 under each flood at most 3x idle.
The payload flood sends the largest echo the broker takes (``max_echo_bytes``; a larger
``--payload-bytes`` raises the broker's limit to it). Each flood's own rate is shown beside it.

Two setups, each with its own idle figures: ``raw``, everything on all CPUs (on a 2-core machine
the flood's process takes CPU from the broker, which a real attacker, running elsewhere, does not);
and ``pinned``, the flood processes on the last CPU and the system under test (broker, worker, A)
on the others (``os.sched_setaffinity``). The flood is the same in both: it runs as fast as its CPU
lets it.

A's figures are p50, p99, p99.9 and the largest of ``--echoes`` echoes (2,000 by default: with
300, p99 was the 3rd-worst sample and one scheduler hiccup moved it); each setup runs ``--runs``
times (default 2), alternating, each run with a cluster and idle figures of its own. The broker's
CPU during each flood is shown in all and for its loop (the main thread) and libzmq's I/O threads
(TCP and CURVE) apart, and per flood unit (less what A's echoes cost it idle).

Usage (about 3.5 minutes on 2 quiet cores with the defaults)::

    .venv/bin/python bench/hostile.py [--echoes 2000] [--runs 2] [--setup both|raw|pinned] [--only NAME]

The last line is one JSON object; the tables before it are what BENCHMARKS.md shows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
for _d in (".", "broker", "worker", "standby", "libclient", "cli"):
    sys.path.insert(0, str(ROOT / _d))

from bench.dispatch import seconds_each  # noqa: E402
from gpud import protocol as P  # noqa: E402
from gpud.protocol import Command, Peer  # noqa: E402
from gpud.security import CurveKeys, apply_client_keys  # noqa: E402
from gpud_broker.broker import BAD_CUT  # noqa: E402
from gpud_broker.config import DEFAULT_MAX_ECHO_BYTES  # noqa: E402
from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402

OUTSIDER = "127.0.0.3"  # the outsiders' address (A and B connect from 127.0.0.1)


def _dealer(ctx: zmq.Context[Any], endpoint: str, keys: CurveKeys | None, immediate: bool = False) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if immediate:
        s.setsockopt(zmq.IMMEDIATE, 1)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    if keys is not None:
        apply_client_keys(s, keys)
    s.connect(endpoint)
    return s


def _drain(s: zmq.Socket[bytes]) -> None:
    while s.poll(0):
        s.recv_multipart()


# --------------------------------------------------------------------------- floods (child processes)


def flood_queue(stop: Any, sent: Any, endpoint: str, keys: CurveKeys, n: int) -> None:
    """B: ``n`` jobs that cannot all run (each wants 90% of the one GPU), past its queue budget."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = _dealer(ctx, endpoint, keys)
    ids = [P.new_id() for _ in range(n)]
    for rid in ids:
        s.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": "job", "argv": ["sleep", "30"],
                                                                 "need": {"gpu_milli": 900}, "time_limit": 40}))
    sent.value = n
    while not stop.is_set():
        _drain(s)
        time.sleep(0.05)
    for rid in ids:
        s.send_multipart(P.encode(Peer.CLIENT, Command.CANCEL, {"id": rid}))
    time.sleep(0.5)
    s.close(0)
    ctx.term()


def flood_payload(stop: Any, sent: Any, endpoint: str, keys: CurveKeys, size: int) -> None:
    """B: echoes of ``size`` bytes, 4 outstanding, as fast as the broker takes them (its replies
    fill B's share of the reply store as well)."""
    ctx: zmq.Context[Any] = zmq.Context()
    s = _dealer(ctx, endpoint, keys)
    chunk = os.urandom(size)
    out = 0
    while not stop.is_set():
        while out < 4:
            s.send_multipart([*P.encode(Peer.CLIENT, Command.REQUEST, {"id": P.new_id(), "kind": "echo"}), chunk])
            out += 1
            sent.value += 1
        if s.poll(100):  # replies may come as a BATCH: count the messages in it
            out -= len(P.messages(P.decode(s.recv_multipart(), Peer.CLIENT)))
    s.close(0)
    ctx.term()


def flood_garbage(stop: Any, sent: Any, endpoint: str, keys: list[CurveKeys], rate: float = 0.0) -> None:
    """B: malformed messages (bad signature, bad msgpack, unknown commands), as fast as it can
    (``rate``: that many a second at most); when the broker closes its connection (and refuses
    that key), it connects again at once with the next of its ``keys``."""
    ctx: zmq.Context[Any] = zmq.Context()
    junk = [[b"GPUDC1", b"\x01", b"\xc1"], [b"XXXXXX", b"\x01", b"\x80"], [b"GPUDC1", b"\x7f", b"\x80"], [b"GPUDC1"]]
    i = k = 0

    def connect() -> zmq.Socket[bytes]:
        s = _dealer(ctx, endpoint, keys[k % len(keys)], immediate=True)  # no connection: sends fail
        s.poll(1000, zmq.POLLOUT)
        return s

    s = connect()
    while not stop.is_set():
        try:
            for _ in range(100):
                s.send_multipart(junk[i % len(junk)], zmq.NOBLOCK)
                i += 1
        except zmq.Again:
            s.close(0)
            k += 1
            s = connect()
        sent.value = i
        _drain(s)
        time.sleep(100 / rate if rate else 0.001)
    s.close(0)
    ctx.term()


def flood_handshakes(stop: Any, sent: Any, endpoint: str, server_key: bytes) -> None:
    """An outsider on OUTSIDER: a fresh CURVE key per connection, each refused by ZAP."""
    ctx: zmq.Context[Any] = zmq.Context()
    host_port = endpoint.removeprefix("tcp://")
    while not stop.is_set():
        socks = []
        for _ in range(20):
            public, secret = zmq.curve_keypair()
            socks.append(_dealer(ctx, f"tcp://{OUTSIDER}:0;{host_port}", CurveKeys(public, secret, server_key)))
        sent.value += len(socks)
        time.sleep(0.05)
        for s in socks:
            s.close(0)
    ctx.term()


def flood_connections(stop: Any, sent: Any, endpoint: str, n: int) -> None:
    """An outsider on OUTSIDER: ``n`` idle TCP connections, opened again as the broker closes them."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    held: list[socket.socket] = []
    while not stop.is_set():
        while len(held) < n and not stop.is_set():
            try:
                held.append(socket.create_connection((host, int(port)), timeout=0.5, source_address=(OUTSIDER, 0)))
            except OSError:
                break
        time.sleep(0.2)
        alive = []
        for c in held:
            try:
                c.setblocking(False)
                if c.recv(1) == b"":
                    c.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                c.close()
                continue
            alive.append(c)
        held = alive
        sent.value = len(held)
    for c in held:
        c.close()


# --------------------------------------------------------------------------- measuring


def echo_latencies(client: Client, n: int) -> list[float]:
    return seconds_each(lambda: client.echo(b"a" * 64), n)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has used so far, all its threads (user and system)."""
    return _cpu_of(Path(f"/proc/{pid}/stat"))


def _cpu_of(stat: Path) -> float:
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s main thread (``loop``: the broker's loop) and of its libzmq
    I/O threads (``io``: TCP, CURVE), and of all its threads (``all``)."""
    out = {"loop": 0.0, "io": 0.0, "all": cpu_s(pid)}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if task.name == str(pid):
                out["loop"] = _cpu_of(task / "stat")
            elif (task / "comm").read_text().startswith("ZMQbg/IO"):
                out["io"] += _cpu_of(task / "stat")
        except OSError:
            pass  # gone meanwhile
    return out


def _less(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pin_tree(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` and of its descendants to ``cpus`` (what they start later inherits)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except (OSError, ValueError):
                pass  # gone meanwhile


def _flood(fn: Callable[..., None], cpus: set[int] | None, *args: Any) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    fn(*args)


def _figures(xs: list[float]) -> dict[str, float]:
    """p50, p99, p99.9 and the largest of ``xs`` (seconds), in ms."""
    return {"p50": pct(xs, 0.5) * 1e3, "p99": pct(xs, 0.99) * 1e3, "p999": pct(xs, 0.999) * 1e3, "max": max(xs) * 1e3}


def measure(args: argparse.Namespace, pinned: bool) -> dict[str, Any]:
    """One setup: a cluster of its own, A's idle figures, then each flood in turn."""
    mp_ctx = mp.get_context("fork")
    extra = ["--io-threads", str(args.io_threads)] if args.io_threads else []
    if args.payload_bytes > DEFAULT_MAX_ECHO_BYTES:
        extra += ["--max-echo-bytes", str(args.payload_bytes)]  # the flood stays legal
    ncpu = len(os.sched_getaffinity(0))
    flood_cpus = {max(os.sched_getaffinity(0))} if pinned and ncpu > 1 else None
    sut_cpus = os.sched_getaffinity(0) - flood_cpus if flood_cpus else None
    mine = os.sched_getaffinity(0)
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=500, security="curve", log_level="WARNING",
                      broker_args=extra, dynamic_uid_base=61184 + 16 * 200) as c:
        alice, bob = c.client_keys("alice"), c.client_keys("bob")
        assert c.broker is not None
        pid = c.broker.pid
        if sut_cpus is not None:
            for proc in (c.broker, *c.worker_procs.values()):
                pin_tree(proc.pid, sut_cpus)
        budgets = c.status()["budgets"]
        queued = budgets["default"]["max_queued"]
        server_key = alice.server_public
        floods: list[tuple[str, str, Callable[..., None], tuple[Any, ...]]] = [
            (f"queue flood ({queued + 2000} jobs, budget {queued})", "jobs", flood_queue, (c.frontend, bob, queued + 2000)),
            (f"payload flood ({args.payload_bytes >> 10} KiB echoes)", "echoes", flood_payload,
             (c.frontend, bob, args.payload_bytes)),
            ("malformed messages (B has 8 keys)", "messages", flood_garbage,
             (c.frontend, [bob, *(c.client_keys("bob") for _ in range(7))])),
            (f"malformed messages under the cut ({BAD_CUT - 200:,}/s)", "messages", flood_garbage,
             (c.frontend, [c.client_keys("bob")], BAD_CUT - 200)),
            ("handshake spam (a fresh key each)", "handshakes", flood_handshakes, (c.frontend, server_key)),
            ("idle TCP connections (500)", "connections", flood_connections, (c.frontend, 500)),
        ]
        floods = [f for f in floods if args.only in f[0]]
        rows: list[dict[str, Any]] = []
        try:
            if sut_cpus is not None:
                pin_tree(os.getpid(), sut_cpus)  # A: this process (its client's threads are made below)
            with Client(c.frontend, timeout=60, curve=alice) as a:
                if sut_cpus is not None:
                    pin_tree(os.getpid(), sut_cpus)
                echo_latencies(a, 200)  # warm
                t0, c0 = time.monotonic(), cpu_by_thread(pid)
                idle = echo_latencies(a, args.echoes)
                took = time.monotonic() - t0
                # The broker's CPU for A's echoes alone, per thread kind.
                idle_share = {k: v / took for k, v in _less(cpu_by_thread(pid), c0).items()}
                base = _figures(idle)
                rss_idle = rss_mb(pid)
                for name, unit, fn, fargs in floods:
                    stop, sent = mp_ctx.Event(), mp_ctx.Value("d", 0.0, lock=False)
                    proc = mp_ctx.Process(target=_flood, args=(fn, flood_cpus, stop, sent, *fargs), daemon=True)
                    proc.start()
                    # The flood's own cost: the broker's CPU per flood unit over the last second of
                    # the settling time, before A measures (A's echoes cost nothing then).
                    time.sleep(max(0.0, args.settle - 1.0))
                    t0, n0, c0 = time.monotonic(), sent.value, cpu_by_thread(pid)
                    time.sleep(min(1.0, args.settle))
                    alone_s, alone_n, alone = time.monotonic() - t0, sent.value - n0, _less(cpu_by_thread(pid), c0)
                    t0, n0, c0 = time.monotonic(), sent.value, cpu_by_thread(pid)
                    k0 = c.status()["counters"]
                    during = echo_latencies(a, args.echoes)
                    took, n = time.monotonic() - t0, sent.value - n0
                    used = _less(cpu_by_thread(pid), c0)
                    k1 = c.status()["counters"]
                    rss = rss_mb(pid)
                    stop.set()
                    proc.join(20)
                    if proc.is_alive():
                        proc.kill()
                    fig = _figures(during)
                    counted = n > 0 and unit not in ("jobs", "connections")
                    rows.append({
                        "flood": name, **{f"{k}_ms": round(v, 2) for k, v in fig.items()},
                        **{f"{k}_ratio": round(fig[k] / base[k], 2) for k in fig},
                        "flood_rate": f"{n / took:,.0f} {unit}/s" if unit not in ("jobs", "connections")
                                      else f"{sent.value:,.0f} {unit} held",
                        # what of it the broker saw: bad messages read, connections it closed or refused
                        "broker_saw": {k: k1.get(k, 0) - k0.get(k, 0) for k in
                                       ("bad_messages", "bad_unanswered", "cut_connections", "refused_connections")},
                        "broker_cpu": {k: round(v / took, 2) for k, v in used.items()},
                        "broker_cpu_alone": {k: round(v / alone_s, 2) for k, v in alone.items()},
                        # the flood alone: the broker's CPU per flood unit (messages, handshakes, echoes)
                        "broker_cpu_us_each": ({k: round(v / alone_n * 1e6, 1) for k, v in alone.items()}
                                               if counted and alone_n > 0 else None),
                        "broker_rss_mb": round(rss, 1), "alive": c.broker.poll() is None})
                    time.sleep(1.0)
                    echo_latencies(a, 20)
        finally:
            os.sched_setaffinity(0, mine)
            for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), mine)
                except OSError:
                    pass
        return {"setup": "pinned" if flood_cpus else "raw", "flood_cpus": sorted(flood_cpus or ()),
                "sut_cpus": sorted(sut_cpus or mine), **{f"idle_{k}_ms": round(v, 2) for k, v in base.items()},
                "idle_rss_mb": round(rss_idle, 1), "idle_broker_cpu": {k: round(v, 2) for k, v in idle_share.items()},
                "load": round(os.getloadavg()[0], 1),
                "budgets": budgets["default"], "max_held_bytes": budgets["max_held_bytes"], "floods": rows}


def show(r: dict[str, Any]) -> None:
    where = (f"floods on CPU {r['flood_cpus']}, broker, worker and A on CPUs {r['sut_cpus']}" if r["flood_cpus"]
             else f"everything on CPUs {r['sut_cpus']}")
    cpu = r["idle_broker_cpu"]
    print(f"\n{r['setup']} run {r['run']} ({where}; load {r['load']}). A's echo, idle: p50 {r['idle_p50_ms']} ms, "
          f"p99 {r['idle_p99_ms']} ms, p99.9 {r['idle_p999_ms']} ms, max {r['idle_max_ms']} ms; broker RSS "
          f"{r['idle_rss_mb']} MB, CPU {cpu['all']} cores (loop {cpu['loop']}, I/O threads {cpu['io']})")
    print("| flood | its rate (bad messages read, connections closed or refused by the broker) | broker CPU, cores: all (loop, I/O) | flood alone: cores; us each (loop, I/O) | A p50 ms | p99 ms "
          "| p99.9 ms | max ms | p50 / idle | p99 / idle | p99.9 / idle | broker RSS MB | alive |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in r["floods"]:
        c, e, al = f["broker_cpu"], f["broker_cpu_us_each"], f["broker_cpu_alone"]
        each = f"{al['all']}; {e['all']} ({e['loop']}, {e['io']})" if e is not None else f"{al['all']}"
        saw = f["broker_saw"]
        rate = f"{f['flood_rate']} ({saw['bad_messages']:,}; {saw['cut_connections']}, {saw['refused_connections']:,})"
        print(f"| {f['flood']} | {rate} | {c['all']} ({c['loop']}, {c['io']}) | {each} | {f['p50_ms']} "
              f"| {f['p99_ms']} | {f['p999_ms']} | {f['max_ms']} | {f['p50_ratio']} | {f['p99_ratio']} "
              f"| {f['p999_ratio']} | {f['broker_rss_mb']} | {f['alive']} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--echoes", type=int, default=2000, help="A's sequential echoes per figure (default %(default)s)")
    p.add_argument("--runs", type=int, default=2, help="runs of each setup, alternating (default %(default)s)")
    p.add_argument("--settle", type=float, default=1.5, help="seconds a flood runs before A measures (default %(default)s)")
    p.add_argument("--payload-bytes", type=int, default=DEFAULT_MAX_ECHO_BYTES,
                   help="size of B's echoes in the payload flood (default %(default)s: the broker's max_echo_bytes)")
    p.add_argument("--io-threads", type=int, default=0, help="the broker's libzmq I/O threads (default: its own default)")
    p.add_argument("--only", default="", help="run only the floods whose name contains this (e.g. payload)")
    p.add_argument("--setup", choices=("both", "raw", "pinned"), default="both",
                   help="raw: all on all CPUs; pinned: floods on the last CPU, the rest on the others (default %(default)s)")
    args = p.parse_args(argv)
    setups = (False, True) if args.setup == "both" else (args.setup == "pinned",)
    results = []
    for run in range(1, args.runs + 1):
        for pinned in setups:
            r = measure(args, pinned)
            r["run"] = run
            show(r)
            results.append(r)
    print("\nA's echo p99 / idle (p99.9 / idle), every run:")
    names = [f["flood"] for f in results[0]["floods"]]
    print("| flood | " + " | ".join(f"{r['setup']} {r['run']}" for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for i, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{r['floods'][i]['p99_ratio']} ({r['floods'][i]['p999_ratio']})"
                                          for r in results) + " |")
    print("| idle p99 ms (p99.9) | " + " | ".join(f"{r['idle_p99_ms']} ({r['idle_p999_ms']})" for r in results) + " |")
    print(json.dumps({"setups": results, "cpus": os.cpu_count(), "payload_bytes": args.payload_bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
