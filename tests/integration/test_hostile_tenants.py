"""The broker under a hostile tenant (bob) and outsiders, with CURVE on and an honest tenant (alice):
real broker and worker daemons, real keys. Each attack is a test that ends with alice's requests
accepted and answered by the same broker process."""

from __future__ import annotations

import ctypes
import os
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys
from gpud_broker.config import DEFAULT_MAX_ECHO_BYTES
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.integration import test_hostile
from tests.integration.test_security import Raw
from tests.unit.test_synfilter import tcp_connects
from tests.waiting import wait_for

ctx = test_hostile.ctx  # the fixture: one zmq context for the module

# Job uids of our own: other suites' clusters, run at the same time, use the range's start.
UIDS = 61184 + 16 * random.randrange(40, 200)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """No echo byte rate (``tenant_echo_bytes_per_s`` 0): the reply store's flood pushes hundreds
    of MiB of echoes through it; the rate has a test and a cluster of its own."""
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      dynamic_uid_base=UIDS, broker_args=["--tenant-echo-bytes-per-s", "0"]) as c:
        yield c


def assert_alice_served(cluster: LocalCluster, alice: CurveKeys) -> None:
    """The broker process is the one started, and alice's echo and job are accepted and answered."""
    assert cluster.broker is not None and cluster.broker.poll() is None, cluster.log_tail("broker")
    with Client(cluster.frontend, timeout=20, curve=alice) as a:
        assert a.echo(b"still here") == b"still here"
        assert a.run(["true"], gpu_milli=10).exit_code == 0


# ----------------------------------------------------------------------------- replies to their owner


def test_a_routing_id_taken_over_by_another_key_gets_no_reply(cluster: LocalCluster, ctx: zmq.Context[Any],
                                                              alice: CurveKeys, bob: CurveKeys) -> None:
    route, rid = os.urandom(16), P.new_id()
    a = Raw(ctx, cluster.frontend, alice, route)
    sent = time.monotonic()
    a.send(Command.REQUEST, {"id": rid, "kind": "job", "argv": ["sleep", "6"], "need": {"gpu_milli": 10}})
    a.send(Command.PING, {})
    pong = a.recv()
    assert pong is not None and pong.command is Command.PONG  # the request reached the broker
    a.close()
    # Bob claims alice's routing id once she is gone (libzmq ignores a second connection of an id
    # in use: bob tries again until the broker has seen alice's go).
    for _ in range(50):
        b = Raw(ctx, cluster.frontend, bob, route)
        b.send(Command.PING, {})
        got = b.recv(timeout=1.0)
        if got is not None:
            break
        b.close()
    try:
        assert got is not None and got.command is Command.PONG
        assert time.monotonic() - sent < 5.5, "bob took the routing id only after alice's job had ended"
        assert b.recv(timeout=6.0) is None, "bob received alice's reply"
    finally:
        b.close()
    a2 = Raw(ctx, cluster.frontend, alice, os.urandom(16))  # alice's retry, from a new connection
    try:
        a2.send(Command.REQUEST, {"id": rid, "kind": "job", "argv": ["sleep", "6"], "need": {"gpu_milli": 10}})
        reply = a2.recv()
        assert reply is not None and reply.header["ok"] is True and reply.header["exit_code"] == 0, reply
    finally:
        a2.close()
    assert_alice_served(cluster, alice)


def _unseeded_automatic_ids(n: int) -> list[int]:
    """The first automatic routing ids libzmq hands out in a process that never seeded rand()
    (libzmq draws each ROUTER's first id from two rand() calls)."""
    libc = ctypes.CDLL(None)
    libc.srand(1)
    out = [(libc.rand() | (libc.rand() << 31)) & 0xFFFFFFFF for _ in range(n)]
    libc.srand(int.from_bytes(os.urandom(4), "big"))
    return out


def test_claimed_automatic_routing_ids_abort_nothing(cluster: LocalCluster, ctx: zmq.Context[Any],
                                                     alice: CurveKeys, bob: CurveKeys) -> None:
    # Bob claims the ids libzmq would hand out next if its counters were predictable, then
    # connects without ids: libzmq asserts when an automatic id is already taken.
    claims = [Raw(ctx, cluster.frontend, bob, b"\0" + (base + k).to_bytes(4, "big"))
              for base in _unseeded_automatic_ids(8) for k in range(3)]
    anonymous = [Raw(ctx, cluster.frontend, bob, auto_id=True) for _ in range(6)]
    try:
        for r in (*claims, *anonymous):
            r.send(Command.REQUEST, {"id": P.new_id(), "kind": "echo"})
        # Neither kind of connection is served: their ids are not 16 random bytes.
        assert all(r.recv(timeout=0.2) is None for r in (*claims, *anonymous))
        wait_for(lambda: "routing id is not 16 random bytes" in cluster.log_tail("broker", 2000), "the broker to log the dropped messages")
        assert_alice_served(cluster, alice)
    finally:
        for r in (*claims, *anonymous):
            r.close()
    assert_alice_served(cluster, alice)


# ----------------------------------------------------------------------------- worker identity


def test_a_worker_key_admits_its_own_name_only(cluster: LocalCluster, alice: CurveKeys) -> None:
    with Client(cluster.frontend, timeout=30, curve=alice) as a:
        running = a.submit(["sleep", "2"], gpu_milli=10)
        # An allowed key, workers/imp.key, announcing itself as the connected worker w0.
        cluster.add_worker("imp", extra=["--name", "w0"])
        try:
            wait_for(lambda: "this worker's key is workers/imp.key, which admits "
                     "worker imp only, not w0" in cluster.log_tail("broker", 2000), "the broker to refuse the impostor")
            wait_for(lambda: "workers/imp.key" in cluster.log_tail("imp", 200), "the impostor to be told")
            assert running.wait().exit_code == 0  # w0 kept its job: no WORKER_LOST
            st = cluster.status()
            assert [w["name"] for w in st["workers"]] == ["w0"]
            assert st["counters"]["worker_losses"] == 0
        finally:
            cluster.kill_worker("imp")
            del cluster.worker_procs["imp"]
    assert_alice_served(cluster, alice)


def test_two_workers_of_one_name_do_not_flap(tmp_path: Any) -> None:
    """Security none (the name check is then the only one): two workers started under one name."""
    with LocalCluster(workers=0, gpus_per_worker=1, heartbeat_ms=200, log_level="INFO", dynamic_uid_base=UIDS + 32) as c:
        c.add_worker("d1", extra=["--name", "dup"])
        c.wait_workers(1)
        c.add_worker("d2", extra=["--name", "dup"])
        wait_for(lambda: "worker dup is already connected from host"
                 in c.log_tail("d2", 200) and "already connected" in c.log_tail("broker", 500), "the second to be refused")
        first = c.status()["workers"]
        time.sleep(2.0)  # ten heartbeat intervals: the first is never evicted
        then = c.status()
        assert [w["name"] for w in then["workers"]] == ["dup"]
        assert then["workers"][0]["connected_s"] > first[0]["connected_s"] + 1.5
        assert then["counters"]["worker_losses"] == 0
        with Client(c.frontend, timeout=20) as client:
            assert client.echo(b"one of them serves") == b"one of them serves"


# ----------------------------------------------------------------------------- budgets


def test_queue_flood_holds_bob_at_his_budget_and_alice_is_served(cluster: LocalCluster, ctx: zmq.Context[Any],
                                                                 alice: CurveKeys, bob: CurveKeys) -> None:
    budget = cluster.status()["budgets"]["default"]["max_queued"]
    b = Raw(ctx, cluster.frontend, bob, os.urandom(16))
    ids = [P.new_id() for _ in range(budget + 300)]
    try:
        # One of bob's jobs holds 90% of the one GPU; the rest cannot run yet and queue.
        for rid in ids:
            b.send(Command.REQUEST, {"id": rid, "kind": "job", "argv": ["sleep", "6"], "need": {"gpu_milli": 900},
                                     "time_limit": 10})
        busy = []
        while len(busy) < 299:
            got = b.replies(timeout=20)
            assert got, f"only {len(busy)} BUSY answers"
            for msg in got:
                assert msg.header.get("code") == "BUSY", msg.header
                busy.append(msg.header["message"])
        assert all("max_queued" in m for m in busy)
        st = cluster.status()
        assert st["counts"]["queued"] == budget
        # Alice: echo, job and session are all accepted and answered meanwhile.
        with Client(cluster.frontend, timeout=20, curve=alice) as a:
            assert a.echo(b"through the flood") == b"through the flood"
            assert a.run(["true"], gpu_milli=10).exit_code == 0
            with a.session(gpu_milli=100, mem=1 << 20) as s:
                assert s.worker == "w0"
    finally:
        for rid in ids:
            b.send(Command.CANCEL, {"id": rid})
        wait_for(lambda: cluster.status()["counts"]["queued"] == 0, "bob's queue to be cancelled")
        b.close()
    assert_alice_served(cluster, alice)


def test_bobs_echoes_past_his_share_wait_in_order_and_past_their_bound_get_busy(
        cluster: LocalCluster, ctx: zmq.Context[Any], alice: CurveKeys, bob: CurveKeys) -> None:
    """Bob sends 40 of the largest echoes at once: one is in flight at a time (his share), 16
    shares of bytes wait behind it, and the rest are answered BUSY naming the share. Each one is
    answered exactly once, the others with their own payload; alice's echo is not held meanwhile."""
    share = cluster.status()["intake"]["echo_bytes_in_flight_share"]
    assert share == DEFAULT_MAX_ECHO_BYTES
    before = cluster.status()["intake"]
    b = Raw(ctx, cluster.frontend, bob, os.urandom(16))
    payloads = {P.new_id(): os.urandom(DEFAULT_MAX_ECHO_BYTES) for _ in range(40)}
    try:
        for rid, payload in payloads.items():
            b.sock.send_multipart([*P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": "echo"}), payload])
        with Client(cluster.frontend, timeout=20, curve=alice) as a:
            assert a.echo(b"alice meanwhile") == b"alice meanwhile"
        answers: dict[bytes, P.Message] = {}
        while len(answers) < len(payloads):
            got = b.replies(timeout=20)
            assert got, f"{len(answers)} of {len(payloads)} echoes answered"
            for msg in got:
                assert msg.header["id"] not in answers, "answered twice"
                answers[msg.header["id"]] = msg
        ok = [rid for rid, m in answers.items() if m.header["ok"] is True]
        busy = [m.header for m in answers.values() if m.header["ok"] is False]
        assert all(answers[rid].frames[0] == payloads[rid] for rid in ok)
        assert busy and all(h["code"] == "BUSY" and "tenant_echo_bytes_in_flight" in h["message"] for h in busy), busy
        assert len(ok) >= 17, len(ok)  # one in flight and 16 shares waiting, at least
        after = cluster.status()["intake"]
        assert after["waited"] - before["waited"] >= 16 and after["refused"] - before["refused"] == len(busy)
        assert after["echo_bytes_in_flight"] == 0 and after["messages_waiting"] == 0
    finally:
        b.close()
    assert_alice_served(cluster, alice)


def test_bobs_echoes_past_his_rate_wait_and_alices_do_not() -> None:
    """With ``tenant_echo_bytes_per_s`` 1 MiB, bob sends the largest echoes as fast as they come
    back for 2 s: he gets about 1 MiB a second through (his bucket's second, then the rate), never
    more, every one answered with its own payload; alice's echoes meanwhile are not held
    (``waited`` counts bob's alone)."""
    rate = 1 << 20
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      dynamic_uid_base=UIDS + 32, broker_args=["--tenant-echo-bytes-per-s", str(rate)]) as c:
        assert c.status()["intake"]["echo_bytes_per_s"] == rate
        with Client(c.frontend, timeout=20, curve=c.client_keys("bob")) as b, \
                Client(c.frontend, timeout=20, curve=c.client_keys("alice")) as a:
            chunk = os.urandom(DEFAULT_MAX_ECHO_BYTES)
            t0 = time.monotonic()
            sent = 0
            while time.monotonic() - t0 < 2.0:
                assert b.echo(chunk) == chunk
                sent += len(chunk)
            took = time.monotonic() - t0
            waited = c.status()["intake"]["waited"]
            for _ in range(20):
                assert a.echo(b"alice") == b"alice"
            after = c.status()["intake"]
        # One second's burst plus the rate (and one echo's overdraft), however fast the machine.
        assert sent <= rate + rate * took + len(chunk), (sent, took)
        assert waited > 0 and after["waited"] == waited, after
        assert after["echo_bytes_in_flight"] == 0 and after["messages_waiting"] == 0


# ----------------------------------------------------------------------------- the reply store


def test_a_reply_flood_does_not_evict_alices_reply(cluster: LocalCluster, ctx: zmq.Context[Any],
                                                  alice: CurveKeys, bob: CurveKeys) -> None:
    budgets = cluster.status()["budgets"]
    flood = max(2 * budgets["default"]["reply_bytes"], budgets["reply_store"]["max_bytes"]) + (16 << 20)
    job = {"kind": "job", "argv": ["sh", "-c", "od -An -tx8 -N8 /dev/urandom"], "need": {"gpu_milli": 10}}
    a = Raw(ctx, cluster.frontend, alice, os.urandom(16))
    b = Raw(ctx, cluster.frontend, bob, os.urandom(16))
    try:
        rid = P.new_id()
        a.send(Command.REQUEST, {"id": rid, **job})
        first = a.replies(timeout=20)
        assert first and first[0].header["ok"] is True
        # Bob pushes more than the whole reply store through it (and twice his share), in the
        # largest echoes the broker takes.
        chunk = os.urandom(DEFAULT_MAX_ECHO_BYTES)
        for _ in range(flood // len(chunk)):
            b.sock.send_multipart([*P.encode(Peer.CLIENT, Command.REQUEST, {"id": P.new_id(), "kind": "echo"}), chunk])
            got = b.replies(timeout=20)
            assert got and got[0].header["ok"] is True, got
        time.sleep(0.3)  # a few broker ticks: eviction runs
        # Alice's retry of her non-idempotent job: the very same output, so it did not run again.
        a.send(Command.REQUEST, {"id": rid, **job})
        again = a.replies(timeout=20)
        assert again and again[0].header["ok"] is True and again[0].frames[0] == first[0].frames[0]
    finally:
        a.close()
        b.close()
    assert_alice_served(cluster, alice)


# ----------------------------------------------------------------------------- results


def test_an_oversize_result_fails_its_job_and_costs_the_worker_nothing() -> None:
    from gpud.errors import TooLarge

    limit = 8 << 20
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      broker_args=["--max-message-bytes", str(limit)], dynamic_uid_base=UIDS + 64,
                      worker_args=["--max-job-output-bytes", str(20 << 20)]) as c:
        with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as a:
            other = a.submit(["sleep", "2"], gpu_milli=10)
            # Output files travel staged, in chunks (PROTOCOL.md §11.5); stdout stays in the RESULT.
            big = a.submit(["sh", "-c", "head -c 12000000 /dev/zero"], output_cap=12_000_000, gpu_milli=10)
            with pytest.raises(TooLarge) as info:
                big.wait()
            assert "over the" in info.value.message and "maximum message size" in info.value.message
            files = a.submit(["sh", "-c", "head -c 25000000 /dev/zero > out"], outputs=["out"], gpu_milli=10)
            with pytest.raises(TooLarge) as info:
                files.wait()
            assert "max_job_output_bytes (20971520)" in info.value.message
            assert other.wait().exit_code == 0  # the worker kept its connection and its other job
            assert a.run(["true"], gpu_milli=10).exit_code == 0
        st = c.status()
        assert st["counters"]["worker_losses"] == 0 and [w["name"] for w in st["workers"]] == ["w0"]


# ----------------------------------------------------------------------------- sockets and descriptors


_OUT_OF_DESCRIPTORS = """
import os, resource, sys, zmq
ctx = zmq.Context()
admin = ctx.socket(zmq.ROUTER)
admin.setsockopt(zmq.LINGER, 0)
admin.bind(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
while True:  # every descriptor in use, as a broker without a reserve ends up under a flood
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
print("full", flush=True)
while True:  # an admin socket's loop: answer what comes
    if admin.poll(100):
        admin.send_multipart(admin.recv_multipart())
"""


def test_without_free_descriptors_a_zmq_process_cannot_take_an_admin_connection(tmp_path: Any) -> None:
    """Why the broker keeps descriptors in reserve: a process with a ROUTER on an IPC socket (the
    admin socket's shape) and no descriptor free either aborts inside libzmq when a connection
    comes (an assertion on EMFILE) or never accepts it. The broker with its reserve answers its
    admin socket under a descriptor flood (the test below)."""
    import subprocess
    import sys

    endpoint = f"ipc://{tmp_path}/admin.sock"
    ctx: zmq.Context[Any] = zmq.Context()
    with subprocess.Popen([sys.executable, "-c", _OUT_OF_DESCRIPTORS, endpoint], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"full\n"
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(b"status?")
            answered = bool(s.poll(3000))
            s.close(0)
            aborted = proc.poll() is not None
            assert aborted or not answered, "a process without free descriptors took a connection"
            assert proc.stderr is not None
            why = proc.stderr.read().decode(errors="replace") if aborted else "it never accepted the connection"
            print(f"without free descriptors: {why.strip()} (exit {proc.returncode})")
        finally:
            proc.kill()
            proc.wait()
            ctx.term()


def test_a_descriptor_flood_neither_aborts_the_broker_nor_silences_admin_or_connected_clients() -> None:
    import resource
    import socket

    c = LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                     dynamic_uid_base=UIDS + 96)
    c.start()
    assert c.broker is not None
    resource.prlimit(c.broker.pid, resource.RLIMIT_NOFILE, (400, 400))  # a small limit, to reach it
    try:
        host, port = c.frontend.removeprefix("tcp://").rsplit(":", 1)
        with Client(c.frontend, timeout=20, curve=c.client_keys("alice")) as a:
            assert a.echo(b"before") == b"before"
            flood: list[socket.socket] = []
            try:
                # An outsider's idle TCP connections, past the broker's limit, opened faster than the
                # broker closes them for not finishing a handshake.
                deadline = time.monotonic() + 60
                while "stops accepting connections" not in c.log_tail("broker", 500):
                    assert time.monotonic() < deadline, "the broker never stopped accepting"
                    for _ in range(100):
                        try:
                            flood.append(socket.create_connection((host, int(port)), timeout=1))
                        except OSError:
                            break
                assert c.broker is not None and c.broker.poll() is None, c.log_tail("broker")
                assert c.status()["counters"]["fd_pauses"] >= 1  # the admin socket answers
                assert a.echo(b"during") == b"during"  # a connected client is served
            finally:
                for s in flood:
                    s.close()
            wait_for(lambda: "accepts connections again" in c.log_tail("broker", 500), "the frontend to accept again")
        with Client(c.frontend, timeout=20, curve=c.client_keys("alice")) as a:
            assert a.echo(b"after") == b"after"
        assert c.broker.poll() is None
    except AssertionError:
        print(c.log_tail("broker", 60))
        raise
    finally:
        c.stop()


def _open(host: str, port: int, n: int, source: str = "127.0.0.1") -> list[Any]:
    """Up to ``n`` idle TCP connections from ``source`` (as many as connect within a second each)."""
    import socket

    out = []
    for _ in range(n):
        try:
            out.append(socket.create_connection((host, port), timeout=1, source_address=(source, 0)))
        except OSError:
            break
    return out


def test_one_source_holding_many_connections_keeps_no_other_source_out() -> None:
    per_source, total = 16, 40
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      broker_args=["--max-connections-per-source", str(per_source), "--max-connections", str(total)],
                      dynamic_uid_base=UIDS + 128) as c:
        host, port = c.frontend.removeprefix("tcp://").rsplit(":", 1)
        alice = c.client_keys("alice")
        elsewhere = f"tcp://127.0.0.2:0;{host}:{port}"  # alice connects from another loopback address
        flood: list[Any] = []
        try:
            # An outsider on 127.0.0.1: 120 idle connections. All but its bound are shut down as
            # they are accepted, long before the handshake timeout would close them.
            flood = _open(host, int(port), 120)
            assert len(flood) >= 100
            wait_for(lambda: c.status()["connections"]["refused"]["per_source"] >= len(flood) - per_source,
                     "the broker to refuse the outsider's connections past its bound")
            st = c.status()["connections"]
            assert st["max_connections_per_source"] == per_source and st["max_connections"] == total
            assert st["busiest"].get("127.0.0.1", 0) <= per_source
            with Client(elsewhere, timeout=20, curve=alice) as a:
                assert a.echo(b"from another address") == b"from another address"
                assert a.run(["true"], gpu_milli=10).exit_code == 0
            assert "refused a frontend connection from 127.0.0.1" in c.log_tail("broker", 5000)
            # Outsiders on three more addresses fill the total: it holds, for everyone.
            for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
                flood += _open(host, int(port), per_source, source)
            wait_for(lambda: c.status()["connections"]["refused"]["total"] > 0, "the total bound to refuse some")
            assert c.status()["connections"]["connections"] <= total
        finally:
            for s in flood:
                s.close()
        assert c.broker is not None and c.broker.poll() is None, c.log_tail("broker")
        wait_for(lambda: c.status()["connections"]["connections"] == 0, "the outsiders' connections to be forgotten")
        with Client(elsewhere, timeout=20, curve=alice) as a:
            assert a.echo(b"after") == b"after"


def test_handshakes_refused_again_and_again_hold_their_source_off_and_known_keys_in() -> None:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      dynamic_uid_base=UIDS + 160) as c:
        host, port = c.frontend.removeprefix("tcp://").rsplit(":", 1)
        ctx: zmq.Context[Any] = zmq.Context()
        alice = c.client_keys("alice")
        server = alice.server_public
        assert server is not None
        strangers = []
        try:
            # An outsider on 127.0.0.3 with a fresh key per connection: each refused by ZAP, until
            # its address is held off.
            for _ in range(40):
                public, secret = zmq.curve_keypair()
                strangers.append(Raw(ctx, f"tcp://127.0.0.3:0;{host}:{port}", CurveKeys(public, secret, server), os.urandom(16)))
            wait_for(lambda: c.status()["connections"]["held_off"] == ["127.0.0.3"], "the outsider's address to be held off",
                     timeout=10)
            # Held off at the listener: the kernel drops most of its SYNs (one in KEEP_ONE_IN gets
            # through), before libzmq accepts them or spends a CURVE handshake on them.
            wait_for(lambda: sum(tcp_connects(int(port), "127.0.0.3", host=host) for _ in range(16)) <= 8,
                     "the outsider's SYNs to be dropped at the listener", timeout=5)
            assert sum(tcp_connects(int(port), "127.0.0.2", host=host) for _ in range(16)) == 16
            # A known key is admitted from that very address (more slowly: its SYNs are retried,
            # and the hold-off ends hold_off_s after the last refusal), and from any other at once.
            for source in ("127.0.0.3", "127.0.0.2"):
                with Client(f"tcp://{source}:0;{host}:{port}", timeout=30, curve=alice) as a:
                    assert a.echo(b"a known key") == b"a known key"
        finally:
            for r in strangers:
                r.close()
            ctx.term()
        assert c.broker is not None and c.broker.poll() is None, c.log_tail("broker")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


PAYLOAD_COPIES = 2  # a queued payload is held once; a second copy lives while CURVE decrypts it
REQUEST_BYTES = 16 << 10  # what one queued request costs the broker besides its payload, at most


def test_a_queue_flood_at_the_budgets_limits_keeps_the_brokers_memory_under_their_bound() -> None:
    """Bob fills his payload budget (max_bytes) with 256 KiB inputs, then his queue budget
    (max_queued) with small jobs. The broker's RSS grows by at most PAYLOAD_COPIES x max_bytes
    plus REQUEST_BYTES a queued request, the bound the budgets set (docs/OPERATIONS.md)."""
    max_queued, max_bytes = 400, 32 << 20
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      broker_args=["--tenant-max-queued", str(max_queued), "--tenant-max-bytes", str(max_bytes)],
                      dynamic_uid_base=UIDS + 192) as c:
        assert c.broker is not None
        ctx: zmq.Context[Any] = zmq.Context()
        b = Raw(ctx, c.frontend, c.client_keys("bob"), os.urandom(16))
        try:
            b.send(Command.PING, {})
            assert b.recv() is not None
            before = _rss(c.broker.pid)
            blob = os.urandom(256 << 10)
            job = {"kind": "job", "argv": ["sleep", "20"], "need": {"gpu_milli": 900}, "time_limit": 30}
            busy: dict[str, int] = {}
            ids = []
            for files in ([b"in"],) * (max_bytes // len(blob) + 20) + ([],) * (max_queued + 50):
                rid = P.new_id()
                ids.append(rid)
                header = {"id": rid, **job, "files": ["in"] if files else []}
                b.sock.send_multipart([*P.encode(Peer.CLIENT, Command.REQUEST, header), *([blob] if files else [])])
            deadline = time.monotonic() + 60
            while (busy.get("max_bytes", 0) < 20 or busy.get("max_queued", 0) < 50) and time.monotonic() < deadline:
                for msg in b.replies(timeout=5):
                    assert msg.header.get("code") == "BUSY", msg.header
                    which = "max_bytes" if "max_bytes" in msg.header["message"] else "max_queued"
                    busy[which] = busy.get(which, 0) + 1
            st = c.status()
            load = st["budgets"]["load"]["bob"]
            assert busy.get("max_bytes", 0) >= 20 and busy.get("max_queued", 0) >= 50, busy
            assert load["bytes"] <= max_bytes and st["counts"]["queued"] <= max_queued
            grown = _rss(c.broker.pid) - before
            bound = PAYLOAD_COPIES * max_bytes + max_queued * REQUEST_BYTES
            print(f"broker RSS grew {grown >> 20} MiB under the flood, bound {bound >> 20} MiB "
                  f"(bob holds {load['bytes'] >> 20} MiB in {st['counts']['queued']} queued)")
            assert grown <= bound, f"RSS grew {grown} bytes, over the budgets' bound {bound}"
        finally:
            for rid in ids:
                b.send(Command.CANCEL, {"id": rid})
            b.close()
            ctx.term()
        assert c.broker.poll() is None
        # The test is over: the close would wait for the worker's drain of its 20 s job (cut at the
        # close's 15 s), and the broker's for its answer.
        c.kill_worker("w0")
        c.kill_broker("broker")
