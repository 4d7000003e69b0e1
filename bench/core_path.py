"""The broker core's own cost per request: CPU microseconds for one echo REQUEST and its RESULT,
decoded and handled by a ``BrokerCore`` in this process (no sockets, no client, no worker).

What ``bench/dispatch.py`` measures end to end is mostly sockets and three processes sharing two
cores; this isolates the core, so a change to its hot path shows even on a noisy VM (CPU time, not
wall time; the best of ``--repeat`` runs). By default one worker of 4 GPUs takes every request
(slots enough for a batch of 500 in flight); requests and results alternate in batches of 500, as
the broker's loop reads them. ``--shape dispatch`` is ``bench/dispatch.py``'s cluster instead: two
workers of one GPU and 32 slots each, batches of 32 (a placement then weighs two workers, as there).
Prints one JSON object.

Usage::

    .venv/bin/python bench/core_path.py [--requests 30000] [--repeat 5] [--policy NAME] [--shape dispatch]

``--policy`` places with another policy than the broker's default (``balanced``, say, for what the
default's placement costs over the cheapest).

To compare two commits, run it with each tree's packages first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from gpud import protocol
from gpud.protocol import Command, Peer
from gpud_broker.core import BrokerConfig, BrokerCore

SHAPES = {  # (workers, GPUs per worker, slots per worker, messages per batch)
    "one": (1, 4, 100_000, 500),
    "dispatch": (2, 1, 32, 32),
}


def run(n: int, policy: str | None = None, shape: str = "one") -> float:
    """CPU seconds per request and result over ``n`` of them, on a fresh core placing with ``policy``
    (None: the broker's default) on a cluster of ``shape`` (``SHAPES``)."""
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
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for start in range(0, n, batch):
            for frames in requests[start:start + batch]:
                core.on_client(b"c1", protocol.decode(frames, Peer.CLIENT))
            for ident, frames in zip(dispatched, results[start:start + batch], strict=True):
                core.on_worker(ident, protocol.decode(frames, Peer.WORKER), frames[2])
            dispatched.clear()
        return (time.process_time() - t0) / n
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--policy", default=None, help="placement policy (default: the broker's default)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="one",
                   help="one worker of 4 GPUs, or dispatch.py's two of one GPU (default %(default)s)")
    args = p.parse_args()
    runs = [run(args.requests, args.policy, args.shape) * 1e6 for _ in range(args.repeat)]
    print(json.dumps({"requests": args.requests, "policy": args.policy or BrokerConfig().policy, "shape": args.shape,
                      "best_us": round(min(runs), 2), "runs_us": [round(r, 2) for r in runs]}))


if __name__ == "__main__":
    main()
