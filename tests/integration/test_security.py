"""CURVE and tenants with real keys, real daemons and real sockets.

Workers and clients are admitted by key (ZAP), a client's tenant is its key's, tenants cannot touch
each other's work, the queue is shared fairly, per-tenant limits hold, and security ``none`` keeps
to loopback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys, apply_client_keys
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Busy, Client, Session, Timeout

GPUD = [sys.executable, "-m", "gpud_cli"]


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def in_log(cluster: LocalCluster, name: str, *needles: str) -> Callable[[], bool]:
    return lambda: all(n in cluster.log_tail(name, 2000) for n in needles)


class Raw:
    """A bare CURVE DEALER speaking the client protocol: for requests the library would not send
    (another tenant's ids). ``routing_id``: the one to claim (default: 16 fresh random bytes, as a
    client's, PROTOCOL.md §2); ``auto_id``: none at all, libzmq's automatic one."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: CurveKeys, routing_id: bytes | None = None,
                 auto_id: bool = False) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        if not auto_id:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id if routing_id is not None else os.urandom(16))
        self.sock.setsockopt(zmq.LINGER, 0)
        apply_client_keys(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, cmd: Command, header: dict[str, Any]) -> None:
        self.sock.send_multipart(P.encode(Peer.CLIENT, cmd, header))

    def recv(self, timeout: float = 10.0) -> P.Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return P.decode(self.sock.recv_multipart(), Peer.CLIENT)

    def replies(self, timeout: float = 10.0) -> list[P.Message]:
        """The next message, a BATCH's inner messages one by one (empty: nothing came)."""
        msg = self.recv(timeout)
        if msg is None:
            return []
        return [one for one, _ in P.unbatch(msg)] if msg.command is Command.BATCH else [msg]

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """CURVE on; one worker with one GPU (so a job can keep another one queued)."""
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO") as c:
        yield c


# ----------------------------------------------------------------------------- admission


def test_worker_with_an_allowed_key_registers_and_one_with_an_unknown_key_cannot(cluster: LocalCluster) -> None:
    assert cluster.status()["counts"]["workers"] == 1  # w0, whose key is in workers/
    cluster.add_worker("intruder", allowed=False)
    try:
        wait_for("the broker to log the refusal",
                 in_log(cluster, "broker", "refused a connection on gpud-backend", "unknown worker key"))
        wait_for("the worker to log it", in_log(cluster, "intruder", "CURVE handshake failed", "our key was refused"))
        st = cluster.status()
        assert st["counts"]["workers"] == 1 and [w["name"] for w in st["workers"]] == ["w0"]
    finally:
        cluster.kill_worker("intruder")
        del cluster.worker_procs["intruder"]


# What a refused client is told instead of a bare "no reply": its socket monitor saw the handshake fail.
KEY_REFUSED = ("the broker did not accept our key (wrong broker key, or this client's key is not in the "
               "broker's allow-list)")


def test_client_without_a_key_gets_nothing_through(cluster: LocalCluster) -> None:
    with (Client(cluster.frontend, timeout=1.5, ping_interval=0.5) as c,
          pytest.raises(Timeout, match=r"no reply within 1.5s from .*: the broker did not accept our connection: "
                                       r"it uses CURVE and this client has no keys")):
        c.echo(b"hello")
    wait_for("the broker to log the handshake failure",
             in_log(cluster, "broker", "frontend", "CURVE handshake failed"))


def test_client_with_an_unknown_key_gets_nothing_through(cluster: LocalCluster) -> None:
    stranger = cluster.client_keys("mallory", allowed=False)
    with (Client(cluster.frontend, timeout=1.5, ping_interval=0.5, curve=stranger) as c,
          pytest.raises(Timeout, match=r"no reply within 1.5s from .*: " + re.escape(KEY_REFUSED))):
        c.echo(b"hello")
    wait_for("the broker to log the refusal",
             in_log(cluster, "broker", "refused a connection on gpud-frontend", "unknown client key",
                    stranger.public[:8].decode()))


def test_client_with_the_wrong_broker_key_gets_nothing_through(cluster: LocalCluster, alice: CurveKeys) -> None:
    wrong = CurveKeys(alice.public, alice.secret, zmq.curve_keypair()[0])
    with (Client(cluster.frontend, timeout=1.5, ping_interval=0.5, curve=wrong) as c,
          pytest.raises(Timeout, match=r"no reply within 1.5s from .*: " + re.escape(KEY_REFUSED))):
        c.echo(b"hello")


def test_a_tenants_key_works_and_its_requests_are_that_tenants(cluster: LocalCluster, alice: CurveKeys) -> None:
    # The declared tenant is ignored: the key says alice.
    with Client(cluster.frontend, timeout=20, tenant="bob", curve=alice) as c:
        assert c.echo(b"x" * 100) == b"x" * 100
        r = c.run(["sh", "-c", "echo ran"])
        assert r.exit_code == 0 and r.stdout == b"ran\n"
    rows = admin_call(cluster.admin, "tasks", {"tenant": "alice"})["tasks"]
    assert {row["kind"] for row in rows} >= {"echo", "job"}
    assert admin_call(cluster.admin, "tasks", {"tenant": "bob"})["matched"] == 0


# ----------------------------------------------------------------------------- tenants apart


def test_a_tenant_cannot_cancel_read_or_attach_to_another_tenants_work(
        cluster: LocalCluster, alice: CurveKeys, bob: CurveKeys) -> None:
    ctx = zmq.Context()
    evil = Raw(ctx, cluster.frontend, bob)
    try:
        with Client(cluster.frontend, timeout=30, curve=alice) as a:
            busy = a.submit(["sleep", "1.5"])  # holds the only GPU
            queued = a.submit(["sh", "-c", "echo secret-output"])
            wait_for("alice's second job to queue",
                     lambda: admin_call(cluster.admin, "tasks", {"tenant": "alice", "state": "queued"})["matched"] == 1)

            # Cancel: ignored (no answer, still queued, runs to the end).
            evil.send(Command.CANCEL, {"id": queued.id})
            evil.send(Command.PING, {})
            pong = evil.recv()
            assert pong is not None and pong.command is Command.PONG  # the CANCEL was handled first
            assert admin_call(cluster.admin, "tasks", {"tenant": "alice", "state": "queued"})["matched"] == 1
            assert busy.wait().exit_code == 0
            result = queued.wait()
            assert result.exit_code == 0 and result.stdout == b"secret-output\n"

            # Read: a REQUEST under alice's finished id gets nothing of hers.
            evil.send(Command.REQUEST, {"id": queued.id, "kind": "job", "argv": ["true"]})
            reply = evil.recv()
            assert reply is not None and reply.header["ok"] is False and reply.header["code"] == "INVALID_REQUEST"
            assert "secret" not in repr(reply.header) and "exit_code" not in reply.header and not reply.frames

            # Attach: a CALL on alice's session is SESSION_LOST, as for an unknown one; a PING of it
            # does not renew it.
            with a.session(mem=1 << 20) as s:
                evil.send(Command.CALL, {"id": P.new_id(), "session": s.id, "op": "info"})
                reply = evil.recv()
                assert reply is not None and reply.header["code"] == "SESSION_LOST"
                assert "unknown or has ended" in reply.header["message"]
                assert s.device_info()["mem_granted"] == 1 << 20  # still alice's, still working
            sessions = admin_call(cluster.admin, "sessions", {"tenant": "bob"})
            assert sessions == []
    finally:
        evil.close()
        ctx.term()


# ----------------------------------------------------------------------------- fair share and limits


@pytest.fixture(scope="module")
def shared() -> Iterator[LocalCluster]:
    """CURVE on; one worker with two GPUs; alice and bob weigh the same; carol has limits."""
    with LocalCluster(workers=1, gpus_per_worker=2, heartbeat_ms=200, security="curve",
                      broker_args=["--tenant-weight", "alice=1", "--tenant-weight", "bob=1",
                                   "--tenant-limit", "carol:max_sessions=1,max_queued=1"]) as c:
        yield c


STAMP = ["sh", "-c", "date +%s.%N"]  # when the job ran, on the worker's clock (this host)


def test_one_tenant_flooding_the_queue_does_not_starve_another(shared: LocalCluster) -> None:
    with Client(shared.frontend, timeout=120, curve=shared.client_keys("alice")) as a, \
            Client(shared.frontend, timeout=120, curve=shared.client_keys("bob")) as b:
        flood = [a.submit(STAMP, timeout=120) for _ in range(200)]
        wait_for("alice's backlog", lambda: admin_call(shared.admin, "status")["counts"]["queued"] >= 100)
        submitted = time.time()
        few = [b.submit(STAMP, timeout=120) for _ in range(10)]
        ran_a = sorted(float(j.wait().stdout) for j in flood)
        ran_b = sorted(float(j.wait().stdout) for j in few)
    assert ran_b[-1] < ran_a[-1]
    # Bob's ten were done well before alice's last: within the next few dozen grants, not after 200.
    after = [t for t in ran_a if submitted <= t <= ran_b[-1]]
    assert len([t for t in ran_a if t > ran_b[-1]]) >= 100, "bob waited behind alice's backlog"
    # While both were backlogged, bob had about his share (weights 1:1).
    share = len(ran_b) / (len(ran_b) + len(after))
    assert 0.3 <= share <= 0.75, (share, len(after))


def test_tenant_limits_sessions_wait_and_queue_overflow_is_busy(shared: LocalCluster) -> None:
    keys = shared.client_keys("carol")
    opened: list[Session] = []
    errors: list[BaseException] = []
    c1 = Client(shared.frontend, timeout=30, curve=keys)
    c2 = Client(shared.frontend, timeout=30, curve=keys)
    c3 = Client(shared.frontend, timeout=30, curve=keys)
    try:
        first = c1.session(mem=1 << 20)

        def second() -> None:
            try:
                opened.append(c2.session(mem=1 << 20))
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=second)
        t.start()
        wait_for("carol's second session to queue",
                 lambda: admin_call(shared.admin, "tasks", {"tenant": "carol", "state": "queued"})["matched"] == 1)
        assert not opened  # max_sessions 1: it waits although GPUs are free
        with pytest.raises(Busy):  # max_queued 1: the next one is refused at once
            c3.session(mem=1 << 20, timeout=5)
        with Client(shared.frontend, timeout=10, curve=shared.client_keys("dave")) as d, d.session(mem=1 << 20):
            pass  # other tenants are not held back
        first.close()
        t.join(timeout=20)
        assert not errors and len(opened) == 1
        opened[0].close()
    finally:
        for c in (c1, c2, c3):
            c.close()


# ----------------------------------------------------------------------------- start-up refusals


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUD, *args, "--ready-file", str(tmp_path / "r.json")] if args[0] == "broker" else
                          [*GPUD, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_security_none_refuses_a_public_bind_without_allow_public_bind(tmp_path: Path) -> None:
    r = _run(["broker", "--security", "none", "--frontend", "tcp://0.0.0.0:*", "--backend", "tcp://127.0.0.1:*"],
             tmp_path)
    assert r.returncode == 2 and "allow_public_bind" in r.stderr and "0.0.0.0" in r.stderr
    assert not (tmp_path / "r.json").exists()
    r = _run(["broker", "--security", "none", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
              "--admin", "tcp://127.0.0.1:*"], tmp_path)
    assert r.returncode == 2 and "admin endpoint" in r.stderr
    ready = tmp_path / "r.json"
    with open(tmp_path / "b.log", "wb") as log:
        proc = subprocess.Popen([*GPUD, "broker", "--security", "none", "--allow-public-bind",
                                 "--frontend", "tcp://0.0.0.0:*", "--backend", "tcp://127.0.0.1:*",
                                 "--ready-file", str(ready)], stderr=log, stdout=subprocess.DEVNULL)
    try:
        wait_for("the broker", lambda: ready.exists() or proc.poll() is not None)
        assert proc.poll() is None, (tmp_path / "b.log").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = (tmp_path / "b.log").read_text()
    assert "without encryption or authentication" in text and "security none" in text


def test_curve_is_the_default_and_needs_keys(tmp_path: Path) -> None:
    r = _run(["broker", "--keys-dir", str(tmp_path / "keys"), "--frontend", "tcp://127.0.0.1:*",
              "--backend", "tcp://127.0.0.1:*"], tmp_path)
    assert r.returncode == 2 and "gpud keygen" in r.stderr and "--security none" in r.stderr
    r = _run(["worker", "--keys-dir", str(tmp_path / "keys"), "--simulate", "1", "--broker", "tcp://127.0.0.1:1"],
             tmp_path)
    assert r.returncode == 2 and "broker.key" in r.stderr
    r = _run(["keygen", "--dir", str(tmp_path / "keys"), "--name", "broker"], tmp_path)
    assert r.returncode == 0 and (tmp_path / "keys" / "broker.key_secret").stat().st_mode & 0o777 == 0o600
    r = _run(["worker", "--keys-dir", str(tmp_path / "keys"), "--simulate", "1", "--broker", "tcp://127.0.0.1:1"],
             tmp_path)
    assert r.returncode == 2 and "worker.key_secret" in r.stderr
