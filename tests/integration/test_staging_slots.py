"""Staged jobs and the worker slots they hold, with real daemons (PROTOCOL.md §11.1, §11.3): a
tenant whose upload trickles does not hold a GPU slot for long (its job is taken off its worker
while the worker waits for bytes, and placed again once the upload is complete); inputs that do
not fit the worker's job directory get TOO_LARGE at once, naming job_dir_size; an upload that the
broker's spool disk has no room for gets BUSY at once, naming the room; and a spool that lost a
job's bytes fails the job with an error that says so, not as a lost worker.

Real daemons (one broker, one worker with one simulated GPU, labelled simulated) as subprocesses
on loopback; the well-behaved tenant is the real client, the trickling one speaks the protocol
on a raw DEALER (the client library never trickles).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.errors import Busy, InternalError, TooLarge
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from gpud_client import _request as rq
from tests.integration.test_large_inputs import MiB, payload

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

DIR_SIZE = 96 * MiB  # the worker's job_dir_size
STAGE_IDLE_S = 2.0  # the broker's stage_idle_s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    rundir = tmp_path_factory.mktemp("staging-slots")
    conf = rundir / "broker.toml"
    conf.write_text(f"[broker]\nstage_idle_s = {STAGE_IDLE_S}\n")
    with LocalCluster(workers=1, gpus_per_worker=1, rundir=rundir, broker_args=["--config", str(conf)],
                      worker_args=["--job-dir-size", str(DIR_SIZE)]) as c:
        yield c


class RawTenant:
    """A tenant that speaks the protocol itself, on a DEALER of its own (security none)."""

    def __init__(self, endpoint: str, tenant: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
        self.sock.connect(endpoint)
        self.tenant = tenant
        self.replies: dict[bytes, P.Message] = {}

    def send(self, command: Command, header: dict[str, Any], frames: list[Any] | None = None) -> None:
        self.sock.send_multipart(P.encode(Peer.CLIENT, command, header, frames or []))

    def put(self, job: bytes, **fields: Any) -> bytes:
        rid = P.new_id()
        frames = [fields.pop("data")] if "data" in fields else []
        self.send(Command.PUT, {"id": rid, "job": job, "tenant": self.tenant, **fields}, frames)
        return rid

    def wait(self, rid: bytes, timeout: float) -> P.Message:
        deadline = time.monotonic() + timeout
        while rid not in self.replies:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to {rid.hex()} within {timeout}s"
            if self.sock.poll(int(left * 1000)):
                msg = P.decode(self.sock.recv_multipart())
                self.replies[msg.header.get("id", b"")] = msg
        return self.replies.pop(rid)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_a_trickling_upload_gives_up_its_gpu_slot_and_its_job_runs_once_it_is_complete(cluster: LocalCluster) -> None:
    data = payload(4 * MiB, 11)
    slow = RawTenant(cluster.frontend, "slow")
    try:
        job = P.new_id()
        opened = slow.wait(slow.put(job, sizes=[len(data)]), 10)
        assert opened.header["ok"] is True
        body, _ = rq.job_body(["md5sum", "a"], {"a": data}, [], None, 60.0, 1 << 20, False)
        body["staged"] = [len(data)]
        slow.sock.send_multipart(rq.request_frames(job, "job", {"tenant": "slow", "gpu_milli": 1000}, 120_000, body))
        sent = 0
        stop = threading.Event()

        def trickle() -> None:  # a few bytes every 0.2 s: the upload never stalls, but crawls
            nonlocal sent
            while not stop.is_set() and sent < 64:
                slow.put(job, file=0, offset=sent, data=data[sent : sent + 4])
                sent += 4
                stop.wait(0.2)

        thread = threading.Thread(target=trickle)
        thread.start()
        try:
            time.sleep(1.0)  # its job is placed on the one GPU and fetches (pipelined)
            t = time.monotonic()
            with Client(cluster.frontend, timeout=60) as c:  # another tenant's job needs the whole GPU
                out = c.run(["echo", "other"], gpu_milli=1000, timeout=60)
            took = time.monotonic() - t
            assert out.exit_code == 0 and out.stdout == b"other\n", out
            assert took < STAGE_IDLE_S + 10, f"the other tenant waited {took:.1f}s for the GPU"
        finally:
            stop.set()
            thread.join()
        log = (Path(str(cluster.rundir)) / "broker.log").read_text()
        assert "the job waits for it off the worker" in log
        # The rest comes: the job is placed again and runs with every byte.
        offset = sent
        while offset < len(data):
            slow.put(job, file=0, offset=offset, data=data[offset : offset + MiB])
            offset += MiB
        reply = slow.wait(job, 60)
        assert reply.header["ok"] is True, reply.header
        assert P.as_bytes(reply.frames[0]).split()[0].decode() == hashlib.md5(data).hexdigest()
    finally:
        slow.close()


def test_inputs_over_the_job_directory_size_get_too_large_at_once(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=60) as c:
        t = time.monotonic()
        with pytest.raises(TooLarge, match=f"over the worker's job_dir_size \\({DIR_SIZE}\\)"):
            c.run(["true"], files={"a": bytes(DIR_SIZE + MiB)}, gpu_milli=100, timeout=60)
        assert time.monotonic() - t < 30  # not after max_attempts, nor at the deadline
        assert c.run(["echo", "fine"], gpu_milli=100).stdout == b"fine\n"  # its slot is free


def test_a_spool_that_lost_a_jobs_bytes_fails_it_saying_so(cluster: LocalCluster) -> None:
    data = payload(80 * MiB, 12)
    with Client(cluster.frontend, timeout=60) as c:
        blocker = c.submit(["sleep", "4"], gpu_milli=1000, timeout=60)  # the GPU is busy: the staged job queues
        time.sleep(0.5)
        job = c.submit(["md5sum", "a"], files={"a": data}, gpu_milli=1000, timeout=60)  # every byte is spooled
        time.sleep(1.0)  # and on disk (the last chunks were answered before their write was done)
        spool = Path(str(cluster.rundir)) / "spool-broker"
        (name,) = [n for n in os.listdir(spool) if n.startswith(job.id.hex())]
        os.truncate(spool / name, 0)  # the spool lost it (a disk fault, an operator)
        assert blocker.wait().exit_code == 0
        with pytest.raises(InternalError, match="the broker lost the job's staged inputs"):  # not WorkerLost
            job.wait()
        assert c.run(["echo", "fine"], gpu_milli=100).stdout == b"fine\n"


def test_an_upload_the_spool_disk_has_no_room_for_gets_busy_before_its_bytes_are_sent(
        small_fs: Path, tmp_path: Path) -> None:
    """The broker's spool_dir on a 64 MiB file system, its quota the default 16 GiB: an upload
    of 100 MiB is answered BUSY at its opening (not ENOSPC half-way), another tenant's jobs run
    meanwhile, and uploads that fit, one after the other, all do."""
    with LocalCluster(workers=1, gpus_per_worker=1, rundir=tmp_path, broker_args=["--spool-dir", str(small_fs)]) as c, \
            Client(c.frontend, timeout=60, tenant="acme") as alice, Client(c.frontend, timeout=60, tenant="bob") as bob:
        other = bob.submit(["sh", "-c", "sleep 1; echo other"], gpu_milli=100, timeout=60)
        t = time.monotonic()
        with pytest.raises(Busy, match="the broker's spool disk has room for [0-9]+ more bytes now"):
            alice.run(["true"], files={"a": bytes(100 * MiB)}, gpu_milli=100, timeout=60)
        assert time.monotonic() - t < 10
        assert os.listdir(small_fs) == []  # not a byte of it written
        for seed in range(3):  # 40 MiB fit (48 past the headroom), again and again
            data = payload(40 * MiB, seed)
            out = alice.run(["md5sum", "a"], files={"a": data}, gpu_milli=100, timeout=60)
            assert out.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
        assert other.wait().stdout == b"other\n"
        assert "ERROR" not in (tmp_path / "broker.log").read_text()
