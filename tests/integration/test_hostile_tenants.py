"""The broker under a hostile tenant (bob) and outsiders, with CURVE on and an honest tenant (alice):
real broker and worker daemons, real keys. Each attack is a test that ends with alice's requests
accepted and answered by the same broker process."""

from __future__ import annotations

import ctypes
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud.security import CurveKeys
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.integration import test_hostile
from tests.integration.test_security import Raw
from tests.waiting import wait_for

ctx = test_hostile.ctx  # the fixture: one zmq context for the module

# Job uids of our own: other suites' clusters, run at the same time, use the range's start.
UIDS = 61184 + 16 * random.randrange(40, 200)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=200, security="curve", log_level="INFO",
                      dynamic_uid_base=UIDS) as c:
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
        # Bob pushes more than the whole reply store through it (and twice his share), 4 MiB at a time.
        chunk = os.urandom(4 << 20)
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
                      broker_args=["--max-message-bytes", str(limit)], dynamic_uid_base=UIDS + 64) as c:
        with Client(c.frontend, timeout=30, curve=c.client_keys("alice")) as a:
            other = a.submit(["sleep", "2"], gpu_milli=10)
            big = a.submit(["sh", "-c", "head -c 12000000 /dev/zero > out"], outputs=["out"], gpu_milli=10)
            with pytest.raises(TooLarge) as info:
                big.wait()
            assert "over the" in info.value.message and "maximum message size" in info.value.message
            assert other.wait().exit_code == 0  # the worker kept its connection and its other job
            assert a.run(["true"], gpu_milli=10).exit_code == 0
        st = c.status()
        assert st["counters"]["worker_losses"] == 0 and [w["name"] for w in st["workers"]] == ["w0"]


# ----------------------------------------------------------------------------- sockets and descriptors


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
