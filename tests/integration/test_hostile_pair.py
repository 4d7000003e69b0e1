"""Replies bound to their owner across a failover of a real broker pair (CURVE, SIGKILL).

The pure pair (``tests/unit/test_replication.py``) shows the owners and the RESULT_EXPIRED marks
reach the passive broker's tables; this runs it with real daemons: alice's work is answered by
the primary, the primary is killed, and at the new active broker bob, holding alice's routing id,
gets nothing of hers (not a finished reply, not the result of her job still running during the
takeover), while alice's own retries get their replies, or RESULT_EXPIRED for the one dropped
early, and nothing runs twice.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command
from gpud_cli.cluster import LocalCluster
from tests.integration.test_security import Raw
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

REPLY_SHARE = 64 << 10  # each tenant's share of the reply store: a 300 KB stdout cannot be kept
UIDS = 61184 + 16 * random.randrange(40, 200)
RANDOM_LINE = ["sh", "-c", "od -An -tx8 -N8 /dev/urandom"]  # what a second run would tell apart


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, pair=True, heartbeat_ms=250, rundir=tmp_path, security="curve",
                      log_level="INFO", dynamic_uid_base=UIDS,
                      env={"GPUD_BROKER_TENANT_REPLY_BYTES": str(REPLY_SHARE)}) as c:
        c.wait_active()
        yield c


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def job(rid: bytes, argv: list[str]) -> dict[str, Any]:
    return {"id": rid, "kind": "job", "argv": argv, "need": {"gpu_milli": 10}, "time_limit": 30}


def one_reply(conn: Raw, rid: bytes, timeout: float = 20.0) -> P.Message:
    """The next reply to ``rid`` on ``conn`` (others are skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        for msg in conn.replies(timeout=left):
            if msg.header.get("id") == rid:
                return msg
    raise AssertionError(f"no reply to {P.id_text(rid)} within {timeout:g}s")


def test_after_a_failover_replies_go_to_their_owner_only_and_expired_ones_stay_expired(
        pair: LocalCluster, ctx: zmq.Context[Any]) -> None:
    alice, bob = pair.client_keys("alice"), pair.client_keys("bob")
    primary, backup = (str(pair.broker_endpoints[r]["frontend"]) for r in ("primary", "backup"))
    route = os.urandom(16)
    big, done, running = P.new_id(), P.new_id(), P.new_id()
    a = Raw(ctx, primary, alice, route)
    try:
        # Over alice's share of the reply store: answered, then dropped early (marked expired).
        a.send(Command.REQUEST, job(big, ["sh", "-c", "head -c 300000 /dev/zero"]))
        assert one_reply(a, big).header["ok"] is True
        wait_for(lambda: pair.status(role="primary")["budgets"]["reply_store"]["dropped_early"] >= 1,
                 "the primary to drop the oversize reply early")
        a.send(Command.REQUEST, job(done, RANDOM_LINE))
        first = one_reply(a, done)
        assert first.header["ok"] is True and first.frames[0].strip()
        # Still running when the primary dies: its result reaches the new active broker.
        a.send(Command.REQUEST, job(running, ["sh", "-c", "sleep 3; od -An -tx8 -N8 /dev/urandom"]))
        time.sleep(1.0)  # dispatched, and replicated with the rest
    finally:
        a.close()
    wait_for(lambda: pair.pair_state("backup").get("synced"), "the backup to be in sync")
    pair.kill_broker("primary")

    b = Raw(ctx, backup, bob, route)  # alice's routing id, bob's key
    try:
        # Alice's id of a finished job; with the primary gone, this request is also the backup's
        # vote to take over (PROTOCOL.md §9).
        deadline = time.monotonic() + 30
        while True:
            b.send(Command.REQUEST, job(done, RANDOM_LINE))
            refused = one_reply(b, done)
            if refused.header.get("code") != "NOT_ACTIVE" or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # until the backup finds its peer gone (as a client retries)
        assert refused.header["ok"] is False and refused.header["code"] == "INVALID_REQUEST", refused.header
        assert pair.wait_active() == "backup"
        # Alice's running job ends meanwhile (3 s in): its reply must not come to bob's connection.
        got: list[P.Message] = []
        deadline = time.monotonic() + 6.0
        while (left := deadline - time.monotonic()) > 0:
            got += b.replies(timeout=left)
        assert got == [], [(m.command.name, m.header) for m in got]
        assert pair.status(role="backup")["counts"]["running"] == 0, "alice's job did not end while bob held her route"
    finally:
        b.close()
    time.sleep(0.5)  # bob's connection is gone: the routing id is free again

    a = Raw(ctx, backup, alice, route)
    try:
        a.send(Command.REQUEST, job(done, RANDOM_LINE))
        again = one_reply(a, done)
        assert again.header["ok"] is True and again.frames[0] == first.frames[0]  # the same run's output
        a.send(Command.REQUEST, job(big, ["sh", "-c", "head -c 300000 /dev/zero"]))
        expired = one_reply(a, big)
        assert expired.header["ok"] is False and expired.header["code"] == "RESULT_EXPIRED", expired.header
        a.send(Command.REQUEST, job(running, ["sh", "-c", "sleep 3; od -An -tx8 -N8 /dev/urandom"]))
        last = one_reply(a, running, timeout=30)
        assert last.header["ok"] is True and last.header["exit_code"] == 0 and last.frames[0].strip()
    finally:
        a.close()
    assert pair.brokers["backup"].poll() is None, pair.log_tail("backup")
