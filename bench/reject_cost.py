"""The broker loop's CPU per bad client message, the cost a flood of them puts on everyone else.

One real ``Broker`` (security none, loopback TCP) in this process; a DEALER sends ``--messages``
malformed messages (the bench/hostile.py junk, in turn) at once; the broker's loop reads them
(``_drain_clients``, ``_flush``) until all are read. Measured: the main thread's CPU time
(``time.thread_time``: robust to load, and without libzmq's I/O threads) per message, in two
phases of each window of the broker's allowance (PROTOCOL.md §7): the first BAD_ANSWERED
(answered with an ERROR) and those past it (counted only). The cut (BAD_CUT) is set out of reach
here, so that every message is read: the figure is what a flood just under the cut costs.
Under load these swing (the socket reads share the CPU with libzmq's I/O thread); the robust one
is the third: the handler alone (``_on_client`` of a message already read, past the allowance),
the best of 7 passes over the same messages.

Usage (about 20 s)::

    .venv/bin/python bench/reject_cost.py [--messages 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
for _d in (".", "broker", "worker", "standby", "libclient", "cli"):
    sys.path.insert(0, str(ROOT / _d))

import gpud_broker.broker as broker_mod  # noqa: E402
from gpud import protocol  # noqa: E402
from gpud.security import SecuritySettings  # noqa: E402
from gpud_broker.broker import Broker, Endpoints  # noqa: E402
from gpud_broker.core import BrokerConfig  # noqa: E402

JUNK = [[b"GPUDC1", b"\x01", b"\xc1"], [b"XXXXXX", b"\x01", b"\x80"], [b"GPUDC1", b"\x7f", b"\x80"], [b"GPUDC1"]]


def one_round(n: int) -> tuple[float, float]:
    """(us per answered message, us per counted message) of one round."""
    broker_mod.BAD_CUT = 1 << 60
    broker = Broker(BrokerConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    security=SecuritySettings(mode="none"))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(protocol.ROUTING_ID_BYTES))
    s.connect(broker.endpoints.frontend)
    try:
        answered = broker_mod.BAD_ANSWERED
        for i in range(n):
            s.send_multipart(JUNK[i % len(JUNK)])
        counters = broker.core.counters
        cpu = [0.0, 0.0]
        deadline = time.monotonic() + 60
        while counters["bad_messages"] < n and time.monotonic() < deadline:
            if not broker.frontend.poll(1000):
                continue
            phase = 0 if counters["bad_messages"] < answered else 1
            t0 = time.thread_time()
            broker._drain_clients(broker.frontend)
            broker._flush()
            cpu[phase] += time.thread_time() - t0
        got = counters["bad_messages"]
        if got < n:
            raise SystemExit(f"read {got} of {n} bad messages")
        unanswered = counters["bad_unanswered"]
        return cpu[0] / (n - unanswered) * 1e6, cpu[1] / max(1, unanswered) * 1e6
    finally:
        s.close(0)
        ctx.term()
        broker.close()


def handler_only(n: int) -> float:
    """us of the loop's CPU per bad message past the allowance, the handler alone (best of 7)."""
    broker_mod.BAD_CUT = 1 << 60
    broker = Broker(BrokerConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    security=SecuritySettings(mode="none"))
    logging.disable(logging.WARNING)
    try:
        ident = os.urandom(protocol.ROUTING_ID_BYTES)
        msgs = [[ident, *JUNK[i % len(JUNK)]] for i in range(n)]
        for m in msgs[:broker_mod.BAD_ANSWERED + 1]:
            broker._on_client(m, None)
        broker._bad_count.window = float("inf")  # one window: every message past its allowance
        best = float("inf")
        for _ in range(7):
            t0 = time.thread_time()
            for m in msgs:
                broker._on_client(m, None)
            best = min(best, (time.thread_time() - t0) / n * 1e6)
        return best
    finally:
        logging.disable(logging.NOTSET)
        broker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rounds = [one_round(args.messages) for _ in range(args.rounds)]
    ans = [r[0] for r in rounds]
    cnt = [r[1] for r in rounds]
    print(f"broker loop CPU per bad message, {args.rounds} rounds of {args.messages}:")
    print(f"  answered (the first {broker_mod.BAD_ANSWERED} a second): median {statistics.median(ans):.1f} us "
          f"({', '.join(f'{x:.1f}' for x in ans)})")
    print(f"  counted (past the allowance): median {statistics.median(cnt):.1f} us ({', '.join(f'{x:.1f}' for x in cnt)})")
    handler = handler_only(args.messages)
    print(f"  counted, the handler alone (no socket read): {handler:.2f} us (best of 7)")
    print(json.dumps({"answered_us": ans, "counted_us": cnt, "handler_us": handler}))


if __name__ == "__main__":
    main()
