"""A worker that stops gracefully says goodbye (DISCONNECT, PROTOCOL.md §4) and the goodbye
leaves before its connection closes: the broker drops it at once, not a liveness later. Real
daemons as subprocesses, on loopback, with a liveness far longer than the test."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import zmq

import tests.integration.test_result_acks_worker as acks_worker
from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.sockets import recv_frames
from gpud_cli.cluster import admin_call
from gpud_worker.worker import Worker
from tests.integration.test_daemons import GPUD, _start_broker, _wait_workers
from tests.integration.test_result_acks_worker import FakeBroker

setup = acks_worker.setup  # a real Worker in a thread, and the broker's side on a ROUTER

SLOW_LIVENESS = ["--heartbeat-ms", "1000", "--liveness", "60"]  # silence would take a minute to notice


def _workers(admin: str) -> int:
    return int(admin_call(admin, "status", timeout=2)["counts"]["workers"])


def test_a_worker_stopped_gracefully_is_dropped_by_the_broker_at_once(tmp_path: Path) -> None:
    admin = f"ipc://{tmp_path}/admin.sock"
    broker, ep = _start_broker(tmp_path, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", admin, SLOW_LIVENESS)
    try:
        # On one CPU, the worker's loop and its ZeroMQ I/O thread take turns: a goodbye followed
        # at once by a close that drops what is unsent never leaves.
        cpu = min(os.sched_getaffinity(0))
        with open(tmp_path / "worker.log", "ab") as log:
            worker = subprocess.Popen([*GPUD, "worker", "--security", "none", "--broker", ep["backend"], "--name", "wg",
                                       "--simulate", "1", *SLOW_LIVENESS], stdout=subprocess.DEVNULL, stderr=log,
                                      preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        _wait_workers(admin, 1)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
        deadline = time.monotonic() + 5.0  # a liveness is 60 s: only the goodbye can do it this soon
        while _workers(admin) != 0:
            assert time.monotonic() < deadline, "the broker still counts the worker: its goodbye never came"
            time.sleep(0.05)
        assert "worker wg said goodbye" in (tmp_path / "broker.log").read_text()
    finally:
        broker.send_signal(signal.SIGKILL)
        broker.wait()


def test_the_goodbye_waits_a_moment_for_a_broker_connection_that_is_coming_back(
        setup: tuple[Worker, FakeBroker]) -> None:
    """The worker stops while its connection to the broker is down (the broker restarting, or
    a connection backed up): its DISCONNECT is not dropped with the socket at once, but waits
    for the connection, a moment at most. A real Worker in a thread on real sockets; the
    broker's side is a ROUTER, closed, then bound again on the same port."""
    worker, broker = setup
    again: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    again.setsockopt(zmq.LINGER, 0)
    try:
        ident, _ = broker.next(Command.READY)
        broker.welcome(ident)  # liveness 10 s: the worker does not notice the broker is gone
        broker.sock.close(0)  # the broker goes; the worker's connection waits to connect again
        time.sleep(0.2)
        worker.stop()
        deadline = time.monotonic() + 15
        while worker.links[0].sock is not None:  # its goodbye sent, its socket closed
            assert time.monotonic() < deadline, "the worker did not stop"
            time.sleep(0.01)
        again.bind(broker.endpoint)  # back within the goodbye's linger
        got: list[Command] = []
        deadline = time.monotonic() + 3.0
        while Command.DISCONNECT not in got and (left := deadline - time.monotonic()) > 0:
            if again.poll(int(left * 1000) + 1):
                _, *frames = recv_frames(again)
                msg = P.decode(frames, Peer.WORKER)
                got += [one.command for one, _ in P.unbatch(msg)] if msg.command is Command.BATCH else [msg.command]
        assert Command.DISCONNECT in got, f"the goodbye never came: {got}"
    finally:
        again.close(0)
