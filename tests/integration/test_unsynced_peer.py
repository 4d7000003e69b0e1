"""A primary whose backup is heard but holds none of its updates yet says no GO (PROTOCOL.md §9.3,
*Durable*): were it to, a job could begin that the backup, taking over now, would know nothing of,
and the client's retry would run it a second time. Once the peer holds the snapshot, the job
begins; once the peer is gone (silent past the expiry), the primary stands alone and serves on.

A real pair's primary and a real worker (one simulated GPU, labelled simulated) as subprocesses on
loopback, the real client library, real jobs under a restricted user. The backup is killed, and
the test then speaks its side of the peer link: a passive broker that is heard and, until the
test says so, never asks for a snapshot (as one just started, or one whose SYNC is on its way).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client
from tests.integration.chaos import executions
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

BEAT = 0.1  # the fake peer's STATE interval (the pair's expiry is 0.75 s)


class FakePassivePeer:
    """The backup's side of the peer link: it binds where the primary connects and connects where
    the primary binds. It says ``passive`` every BEAT; once ``sync`` is set it sends SYNC, takes
    the SNAPSHOT and the UPDATES after it, and reports them applied. ``silent`` stops it."""

    def __init__(self, ctx: zmq.Context[Any], bind: str, connect: str) -> None:
        self.inbound = ctx.socket(zmq.ROUTER)
        self.inbound.setsockopt(zmq.LINGER, 0)
        self.inbound.bind(bind)
        self.outbound = ctx.socket(zmq.DEALER)
        self.outbound.setsockopt(zmq.LINGER, 0)
        self.outbound.connect(connect)
        self.sync = threading.Event()
        self.silent = threading.Event()
        self.applied = 0
        self.held: list[list[Any]] = []  # the snapshot's tasks, then every update, as received
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, cmd: Command, header: dict[str, Any]) -> None:
        self.outbound.send_multipart(P.encode(Peer.BROKER, cmd, header))

    def _run(self) -> None:
        synced = asked = False
        while not self.silent.is_set():
            if self.sync.is_set() and not asked:
                self._send(Command.SYNC, {})
                asked = True
            self._send(Command.STATE, {"state": "passive", "epoch": 0, "applied": self.applied,
                                       "name": "fake-backup", "streaming": False})
            while self.inbound.poll(int(BEAT * 1000)):
                frames = self.inbound.recv_multipart()
                msg = P.decode(frames[1:], Peer.BROKER)
                if msg.command is Command.SNAPSHOT and asked:
                    self.held += [["task", t] for t in P.unpackb(msg.frames[0])["tasks"]]
                    self.applied, synced = msg.header["seq"], True
                elif msg.command is Command.UPDATES and synced:
                    self.held += P.unpackb(msg.frames[0])
                    self.applied = msg.header["seq"] + msg.header["count"] - 1
                if not self.inbound.poll(0):
                    break

    def has_started(self, rid: bytes) -> bool:
        """Whether what it holds marks job ``rid`` started: a task (PROTOCOL.md §9.3: id first,
        ``started`` 17th) or a ``start`` update."""
        return any((u[0] == "start" and u[1] == rid) or (u[0] == "task" and u[1][0] == rid and u[1][16] is True)
                   for u in self.held)

    def close(self) -> None:
        self.silent.set()
        self._thread.join(5)
        self.inbound.close(0)
        self.outbound.close(0)


def started(c: LocalCluster, rid: bytes) -> bool:
    """Whether the primary marked the job started: its worker asked START (PROTOCOL.md §4.4)."""
    rows = admin_call(c.admin_of("primary"), "tasks", {"tenant": None, "state": None, "kind": None,
                                                       "worker": None, "limit": 100})["tasks"]
    return any(r["id"] == rid.hex() and r["started"] for r in rows)


def argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def primary_and_fake(tmp_path: Path) -> Iterator[tuple[LocalCluster, FakePassivePeer]]:
    with LocalCluster(workers=1, gpus_per_worker=1, pair=True, rundir=tmp_path,
                      worker_args=["--log-level", "DEBUG"]) as c:
        assert c.wait_active() == "primary"
        c.kill_broker("backup")
        wait_for(lambda: not c.pair_state("primary").get("streaming"), "the primary to count its backup gone")
        argv = c._broker_argv["primary"]
        ctx = zmq.Context()
        fake = FakePassivePeer(ctx, bind=argv_value(argv, "--peer"), connect=argv_value(argv, "--peer-bind"))
        try:
            wait_for(lambda: c.pair_state("primary").get("peer_state") == "passive"
                     and c.pair_state("primary")["peer_silent_s"] < 0.5, "the primary to hear the fake backup")
            yield c, fake
        finally:
            fake.close()
            ctx.term()


def test_no_job_begins_while_the_heard_backup_holds_nothing_and_it_begins_once_the_backup_does(
        primary_and_fake: tuple[LocalCluster, FakePassivePeer]) -> None:
    c, fake = primary_and_fake
    assert c.rundir is not None
    logs = [c.rundir / "w0.log"]
    with Client(c.frontends[:1], timeout=60) as client:
        job = client.submit(["sh", "-c", "echo once"], gpu_milli=100)
        short = job.id.hex()[:12]
        wait_for(lambda: started(c, job.id), "the worker to ask START for the job", timeout=20)
        # Heard, holding nothing: for eight expiries no GO comes, and the job does not begin.
        for _ in range(30):
            assert executions(logs)[1][short] == 0, "the job began while the backup held nothing of it"
            assert c.pair_state("primary")["peer_silent_s"] < 0.75
            threading.Event().wait(0.2)
        fake.sync.set()  # the backup asks for the snapshot, loads it, and says so
        assert job.wait().stdout == b"once\n"
        assert fake.has_started(job.id), "the job began before the backup held its START mark"
        assert executions(logs)[1][short] == 1

        fake.close()  # the backup is gone: once it has been silent for the expiry, the primary runs alone
        second = client.submit(["sh", "-c", "echo alone"], gpu_milli=100)
        assert second.wait().stdout == b"alone\n"
