"""The broker core's own cost per request: CPU microseconds for one echo REQUEST and its RESULT,
decoded and handled by a ``BrokerCore`` in this process (no sockets, no client, no worker).

What ``bench/dispatch.py`` measures end to end is mostly sockets and three processes sharing two
cores; this isolates the core, so a change to its hot path shows even on a noisy VM (CPU time, not
wall time; the best of ``--repeat`` runs). By default one worker of 4 GPUs takes every request
(slots enough for a batch of 500 in flight); requests and results alternate in batches of 500, as
the broker's loop reads them, each batch of results ending with the ACKs the loop's turn owes. ``--shape dispatch`` is ``bench/dispatch.py``'s cluster instead: two
workers of one GPU and 32 slots each, batches of 32 (a placement then weighs two workers, as there).
Prints one JSON object.

Usage::

    .venv/bin/python bench/core_path.py [--requests 30000] [--repeat 5] [--policy NAME] [--shape dispatch]
                                        [--opcodes]

``--policy`` places with another policy than the broker's default (``balanced``, say, for what the
default's placement costs over the cheapest). ``--opcodes`` counts the Python bytecodes per echo
instead, in all and by function (exact on any machine; use a few thousand requests, tracing is slow).

To compare two commits, run it with each tree's packages first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from types import FrameType
from typing import Any

from gpud import protocol
from gpud.protocol import Command, Peer
from gpud_broker.core import BrokerConfig, BrokerCore

SHAPES = {  # (workers, GPUs per worker, slots per worker, messages per batch)
    "one": (1, 4, 100_000, 500),
    "dispatch": (2, 1, 32, 32),
}


def _setup(n: int, policy: str | None, shape: str) -> tuple[BrokerCore, list[bytes], list[list[Any]], list[list[Any]], int]:
    """A fresh core placing with ``policy`` (None: the broker's default) on a cluster of ``shape``
    (``SHAPES``), ``n`` echo requests and their results, the list its DISPATCHes' workers are
    written to (in order), and the batch size."""
    workers, per_worker, slots, batch = SHAPES[shape]
    config = BrokerConfig() if policy is None else BrokerConfig(policy=policy)
    dispatched: list[bytes] = []  # the worker of each DISPATCH, in order: its RESULT comes from there
    core = BrokerCore(config, 0.0, lambda ident, frames: None, lambda ident, frames: dispatched.append(ident))
    for w in range(workers):
        gpus = [{"uuid": f"GPU-{w}-{i}", "index": i, "model": "A100", "mem": 1 << 34, "cc": [8, 0]} for i in range(per_worker)]
        ready = protocol.encode(Peer.WORKER, Command.READY, {"name": f"w{w}", "gpus": gpus, "cpu_milli": 8000,
                                                             "host_mem": 1 << 36, "slots": slots})
        core.on_worker(f"w{w}".encode(), protocol.decode(ready, Peer.WORKER), ready[2])
    dispatched.clear()  # (what READY was answered)
    ids = [i.to_bytes(16, "big") for i in range(n)]
    requests = [protocol.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": "echo", "need": {"gpu_milli": 1}},
                                [b"x" * 64]) for rid in ids]
    results = [protocol.encode(Peer.WORKER, Command.RESULT, {"id": rid, "ok": True}, [b"x" * 64]) for rid in ids]
    return core, dispatched, requests, results, batch


def _echoes(core: BrokerCore, dispatched: list[bytes], requests: list[list[Any]], results: list[list[Any]],
            batch: int) -> None:
    """Hand the core every request and its result, alternating in batches."""
    for start in range(0, len(requests), batch):
        for frames in requests[start:start + batch]:
            core.on_client(b"c1", protocol.decode(frames, Peer.CLIENT))
        for ident, frames in zip(dispatched, results[start:start + batch], strict=True):
            core.on_worker(ident, protocol.decode(frames, Peer.WORKER), frames[2])
        dispatched.clear()
        if core.unacked:  # the ACKs the loop's turn ends with (the shell sends one per worker)
            core.take_acks()


def run(n: int, policy: str | None = None, shape: str = "one") -> float:
    """CPU seconds per request and result over ``n`` of them (``_setup``)."""
    setup = _setup(n, policy, shape)
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        _echoes(*setup)
        return (time.process_time() - t0) / n
    finally:
        gc.enable()


def opcodes(n: int, policy: str | None = None, shape: str = "one", top: int = 25) -> dict[str, Any]:
    """Python bytecodes executed per request and result (``sys.settrace`` opcode events), in all
    and by function, the ``top`` most first: exact and the same on a loaded machine as on a quiet
    one, unlike CPU time (but blind to the cost of C calls such as msgpack's)."""
    setup = _setup(n, policy, shape)
    counts: collections.Counter[str] = collections.Counter()

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return trace

    sys.settrace(trace)
    try:
        _echoes(*setup)
    finally:
        sys.settrace(None)
    return {"opcodes_per_echo": round(sum(counts.values()) / n, 1),
            "by_function": {name: round(c / n, 1) for name, c in counts.most_common(top)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--policy", default=None, help="placement policy (default: the broker's default)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="one",
                   help="one worker of 4 GPUs, or dispatch.py's two of one GPU (default %(default)s)")
    p.add_argument("--opcodes", action="store_true",
                   help="count the Python bytecodes per echo instead of timing (exact whatever the load)")
    args = p.parse_args()
    if args.opcodes:
        print(json.dumps({"requests": args.requests, "policy": args.policy or BrokerConfig().policy,
                          "shape": args.shape, **opcodes(args.requests, args.policy, args.shape)}))
        return
    runs = [run(args.requests, args.policy, args.shape) * 1e6 for _ in range(args.repeat)]
    print(json.dumps({"requests": args.requests, "policy": args.policy or BrokerConfig().policy, "shape": args.shape,
                      "best_us": round(min(runs), 2), "runs_us": [round(r, 2) for r in runs]}))


if __name__ == "__main__":
    main()
