"""A worker silent past its liveness whose process still lives (PROTOCOL.md §4.2): suspended, not
removed; resumed on its connection or, by its READY's incarnation, on a new one; reconciled with
what its READY holds; lost as before when another process comes or its grace window ends.

BrokerCore driven directly on a fake clock (the harness of ``test_broker_core``): heartbeat 1 s x 3,
so silence is judged after 3 s and the grace window (3 periods) lasts 9 s more.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpud import protocol as P
from gpud.errors import ProtocolError
from gpud.protocol import Command, Message, Peer
from tests.unit.test_broker_core import C1, C2, W1, W2, W3, Harness, error_code, open_session, rid

INC = b"\x01" * 16  # w1's process
OTHER = b"\x02" * 16  # a new process of w1
JOB, IDEM = rid(1), rid(2)


def two_workers(**config: Any) -> Harness:
    """w1 (incarnation INC, 2 GPUs, sorted first by the spreading policy) and w2 ready."""
    h = Harness(policy="balanced", **config)
    h.ready(W1, "w1", ngpus=2, incarnation=INC)
    h.ready(W2, "w2")
    h.take_worker()
    return h


def started_jobs_on_w1(h: Harness) -> None:
    """A plain job JOB and an idempotent one IDEM dispatched to w1 and told GO: both may have begun."""
    h.request(C1, JOB, kind="job", argv=["train.py"])
    h.request(C2, IDEM, kind="job", argv=["render.py"], idempotent=True)
    assert [(i, m.header["id"]) for i, m, _ in h.take_worker()] == [(W1, JOB), (W1, IDEM)]
    h.worker(W1, Command.START, {"ids": [JOB, IDEM]})
    assert [m.command for _, m, _ in h.take_worker()] == [Command.GO]


def silence_w1(h: Harness) -> None:
    """w1 says nothing for 3.5 s (w2 keeps beating): past its liveness."""
    h.advance(3.0)
    h.heartbeat(W2, 1)
    h.tick(0.5)


def resume_ready(h: Harness, ident: bytes, holds: list[bytes], incarnation: bytes = INC, user: str | None = None) -> Message:
    """w1's READY on connection ``ident``; returns the one message it got back."""
    header = {"name": "w1", "gpus": [{"uuid": f"GPU-w1-{i}", "index": i, "model": "A100", "mem": 16 << 30, "cc": [8, 0]}
                                     for i in range(2)],
              "cpu_milli": 8000, "host_mem": 64 << 30, "slots": 8, "incarnation": incarnation, "holds": holds}
    enc = P.encode(Peer.WORKER, Command.READY, header)
    h.core.now = h.clock.monotonic()
    h.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2], user)
    out = [(i, m) for i, m, _ in h.take_worker()]
    welcome = [m for i, m in out if i == ident]
    assert len(welcome) == 1, out
    return welcome[0]


def test_a_silent_worker_is_suspended_its_safe_work_placed_again_and_the_rest_kept() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    w1 = h.core.registry.by_name["w1"]
    assert h.core.registry.get(W1) is w1 and w1.suspended_at and h.core.counters["worker_losses"] == 0
    # The idempotent job runs again elsewhere at once; the plain one waits for w1, unanswered.
    d = h.one_dispatch(W2)
    assert d.header["id"] == IDEM
    assert list(w1.assigned) == [JOB] and h.take_client() == []
    # Nothing new goes to a suspended worker, though it has a free GPU (w2's is taken): it waits.
    h.request(C1, rid(3), kind="job", argv=["x"])
    assert h.take_worker() == [] and len(h.core.queue) == 1
    h.heartbeat(W1, 1)  # heard again: live, told to stop its copy of IDEM, and what waited goes to it
    out = h.take_worker()
    assert [(i, m.command) for i, m, _ in out] == [(W1, Command.WELCOME), (W1, Command.DISPATCH)]
    assert out[0][1].header["stop"] == [IDEM] and out[1][1].header["id"] == rid(3)


def test_heard_again_on_its_connection_it_resumes_and_its_result_is_taken_once() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)  # IDEM again
    h.result(W1, JOB, exit_code=7)  # the stalled process wakes: its RESULT on the same connection
    [(who, welcome, _)] = h.take_worker()  # its copy of IDEM must not run on
    assert who == W1 and welcome.command is Command.WELCOME and welcome.header["resumed"] is True
    assert welcome.header["stop"] == [IDEM]
    reply = h.one_reply(C1)
    assert reply.header["id"] == JOB and reply.header["exit_code"] == 7
    w1 = h.core.registry.by_name["w1"]
    assert not w1.suspended_at and not w1.draining and h.core.counters["worker_losses"] == 0
    h.result(W1, JOB, exit_code=7)
    assert h.take_client() == []  # once
    h.result(W1, IDEM, exit_code=0)  # its copy of the job placed again: stale, dropped
    assert h.take_client() == []
    h.result(W2, IDEM, exit_code=0)
    assert h.one_reply(C2).header["id"] == IDEM
    h.request(C1, rid(4), kind="job", argv=["x"])  # placeable again (two free GPUs: it comes first)
    assert h.one_dispatch(W1).header["id"] == rid(4)
    h.result(W1, rid(4), exit_code=0)
    h.take_client()
    h.assert_idle()


def test_a_ready_of_the_same_process_resumes_on_the_new_connection_and_stops_what_went_elsewhere() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)  # IDEM again, on w2
    welcome = resume_ready(h, W3, holds=[JOB, IDEM])
    assert welcome.command is Command.WELCOME and welcome.header["resumed"] is True
    assert welcome.header["stop"] == [IDEM]  # the retry's result is the one: w1 kills its copy
    w1 = h.core.registry.by_name["w1"]
    assert h.core.registry.get(W3) is w1 and h.core.registry.get(W1) is None
    assert list(w1.assigned) == [JOB] and h.core.counters["worker_losses"] == 0
    h.result(W3, JOB, exit_code=0)
    assert h.one_reply(C1).header["id"] == JOB
    h.result(W3, JOB, exit_code=0)
    assert h.take_client() == []
    h.result(W2, IDEM, exit_code=0)
    assert h.one_reply(C2).header["id"] == IDEM
    h.assert_idle()


def test_work_the_returning_process_no_longer_holds_ends_as_lost() -> None:
    h = Harness()
    h.ready(W1, "w1", incarnation=INC)  # alone: its session and job share its GPU
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    h.request(C1, JOB, kind="job", argv=["train.py"], need={"gpu_milli": 500})
    assert h.one_dispatch(W1).header["id"] == JOB
    h.worker(W1, Command.START, {"ids": [JOB]})
    h.take_worker()
    silence_w1(h)
    welcome = resume_ready(h, W3, holds=[])
    assert welcome.header["resumed"] is True and welcome.header["stop"] == []
    [(_, reply, _)] = h.take_client()
    assert reply.header["id"] == JOB and error_code(reply) == "WORKER_LOST"
    assert sid not in h.core.sessions
    h.client(C1, Command.CALL, {"id": rid(101), "session": sid, "op": "info"})
    assert error_code(h.one_reply(C1)) == "SESSION_LOST"
    h.assert_idle()


def test_a_session_kept_through_a_suspension_takes_its_next_call_on_the_new_connection() -> None:
    h = Harness()
    h.ready(W1, "w1", incarnation=INC)
    h.ready(W2, "w2")
    h.take_worker()
    sid = rid(100)
    open_session(h, sid)
    silence_w1(h)
    assert sid in h.core.sessions
    h.client(C1, Command.CALL, {"id": rid(101), "session": sid, "op": "info"})
    call = h.one_dispatch(W1)  # the old connection: a stalled process reads it once it wakes
    assert call.header["session"] == sid
    holds = [sid]  # that call was lost with the old connection: it is not held
    welcome = resume_ready(h, W3, holds=holds)
    assert welcome.header["resumed"] is True
    reply = h.one_reply(C1)
    assert reply.header["id"] == rid(101) and error_code(reply) == "WORKER_LOST"
    h.client(C1, Command.CALL, {"id": rid(102), "session": sid, "op": "info"})
    assert h.one_dispatch(W3).header["id"] == rid(102)
    h.result(W3, rid(102), info={})
    assert h.one_reply(C1).header["ok"] is True and sid in h.core.sessions


def test_a_cut_connection_the_same_process_replaced_resumes_at_once_not_after_its_silence() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    h.advance(0.5)  # w1 live; its TCP connection is cut, it reconnects and says READY
    welcome = resume_ready(h, W3, holds=[JOB, IDEM])
    assert welcome.command is Command.WELCOME and welcome.header["resumed"] is True and welcome.header["stop"] == []
    w1 = h.core.registry.by_name["w1"]
    assert h.core.registry.get(W3) is w1 and sorted(w1.assigned) == [JOB, IDEM]
    # Another process of the name while w1 is live is still refused (PROTOCOL.md §4.2).
    refused = resume_ready(h, W2 + b"x", holds=[], incarnation=OTHER)
    assert refused.command is Command.DISCONNECT and "already connected" in refused.header["reason"]
    for r in (JOB, IDEM):
        h.result(W3, r, exit_code=0)
    assert sorted(m.header["id"] for _, m, _ in h.take_client()) == [JOB, IDEM]
    h.assert_idle()


def test_a_passive_broker_rebinds_a_returning_process_and_ends_nothing() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    h.core.become_passive()
    welcome = resume_ready(h, W3, holds=[])
    assert welcome.header["resumed"] is True and welcome.header["stop"] == []
    assert sorted(h.core.registry.by_name["w1"].assigned) == [JOB, IDEM] and h.take_client() == []


def test_another_incarnation_is_a_restart_its_begun_work_lost_at_once() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)
    welcome = resume_ready(h, W3, holds=[JOB], incarnation=OTHER)
    assert welcome.command is Command.WELCOME and "resumed" not in welcome.header
    [(_, reply, _)] = h.take_client()
    assert reply.header["id"] == JOB and error_code(reply) == "WORKER_LOST"
    assert h.core.counters["worker_losses"] == 1
    assert h.core.registry.by_name["w1"].incarnation == OTHER and h.core.registry.by_name["w1"].assigned == {}


def test_a_worker_that_said_no_incarnation_never_resumes_by_ready() -> None:
    h = Harness(policy="balanced")
    h.ready(W1, "w1", ngpus=2)
    h.ready(W2, "w2")
    h.take_worker()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)
    welcome = resume_ready(h, W3, holds=[JOB], incarnation=b"")
    assert "resumed" not in welcome.header
    assert error_code(h.take_client()[0][1]) == "WORKER_LOST"


def test_past_its_grace_window_the_worker_is_lost_as_before() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)
    for _ in range(8):  # 8 s of the 9 s window: still suspended, JOB unanswered
        h.advance(1.0)
        h.heartbeat(W2, 2)
        h.tick()
    assert h.core.registry.get(W1) is not None and h.take_client() == []
    h.advance(1.0)
    h.heartbeat(W2, 3)
    h.tick(0.5)
    assert h.core.registry.get(W1) is None and "GPU-w1-0" not in h.core.registry.gpus
    [(_, reply, _)] = h.take_client()
    assert reply.header["id"] == JOB and error_code(reply) == "WORKER_LOST"
    welcome = resume_ready(h, W3, holds=[JOB])  # too late: a plain admission, its job gone
    assert "resumed" not in welcome.header and h.core.registry.by_name["w1"].assigned == {}


def test_no_grace_window_configured_removes_at_once() -> None:
    h = two_workers(worker_resume_periods=0)
    started_jobs_on_w1(h)
    silence_w1(h)
    assert h.core.registry.get(W1) is None
    assert error_code(h.take_client()[0][1]) == "WORKER_LOST"


def test_an_operator_undrain_of_a_suspended_worker_waits_for_it_to_resume() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    h.core.workers.mark_drained("w1", True)
    silence_w1(h)
    h.core.workers.mark_drained("w1", False)
    w1 = h.core.registry.by_name["w1"]
    assert w1.draining and not w1.has_slot  # still suspended: nothing goes to it
    assert h.core.dispatcher.open_workers == h.core.dispatcher.count_open_workers()
    h.heartbeat(W1, 1)
    assert not w1.draining and w1.has_slot
    assert h.core.dispatcher.open_workers == h.core.dispatcher.count_open_workers()


def test_a_passive_broker_removes_a_silent_worker_at_once() -> None:
    h = Harness()
    h.core.become_passive()
    h.ready(W1, "w1", incarnation=INC)
    h.tick(3.5)
    assert h.core.registry.get(W1) is None and h.core.counters["worker_suspensions"] == 0


def test_a_resume_under_curve_needs_the_key_of_its_name() -> None:
    h = Harness(policy="balanced")
    h.core.worker_names_bound = True
    enc = P.encode(Peer.WORKER, Command.READY, {
        "name": "w1", "gpus": [{"uuid": f"GPU-w1-{i}", "index": i, "model": "A100", "mem": 16 << 30, "cc": [8, 0]}
                               for i in range(2)], "slots": 8, "incarnation": INC})
    h.core.on_worker(W1, P.decode(enc, Peer.WORKER), enc[2], "w1")
    h.take_worker()
    h.request(C1, JOB, kind="job", argv=["train.py"])
    h.one_dispatch(W1)
    h.worker(W1, Command.START, {"ids": [JOB]})
    h.take_worker()
    h.tick(3.5)
    # Another key's holder that learned w1's incarnation cannot take its work.
    refused = resume_ready(h, W3, holds=[JOB], user="w9")
    assert refused.command is Command.DISCONNECT and "workers/w9.key" in refused.header["reason"]
    w1 = h.core.registry.by_name["w1"]
    assert w1.identity == W1 and w1.suspended_at and list(w1.assigned) == [JOB]
    assert resume_ready(h, W3, holds=[JOB], user="w1").header["resumed"] is True


def test_while_worker_messages_wait_unread_no_worker_is_judged_silent() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    h.advance(3.0)
    h.heartbeat(W2, 1)
    h.clock.advance(0.5)
    h.core.tick(h.clock.monotonic(), caught_up=False)  # a backlog: w1's messages may be in it
    w1 = h.core.registry.by_name["w1"]
    assert not w1.suspended_at and h.take_worker() == []
    h.heartbeat(W1, 1)  # read from the backlog: live
    h.tick()
    assert not w1.suspended_at


def test_time_the_broker_itself_stood_still_is_no_workers_silence() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    h.advance(0.5)
    h.heartbeat(W1, 1)
    h.clock.advance(5.0)  # the broker's loop stood still for 5 s (frozen): it heard nobody
    h.core.workers.stalled(5.0, h.clock.monotonic())
    h.tick(0.5)  # 5.5 s since w1 was heard, 0.5 s of them listened through
    assert not h.core.registry.by_name["w1"].suspended_at and h.core.counters["worker_suspensions"] == 0
    h.tick(2.6)  # 3.1 s listened through: past its liveness now
    w1 = h.core.registry.by_name["w1"]
    assert w1.suspended_at
    h.clock.advance(20.0)  # stood still again: its grace window does not run out meanwhile
    h.core.workers.stalled(20.0, h.clock.monotonic())
    h.tick(0.5)
    assert h.core.registry.get(W1) is w1 and w1.suspended_at


TURN_S = 0.3  # a slow loop turn: past STALL_S, each one reported to ``stalled``


def slow_turn(h: Harness, seconds: float, heard: tuple[bytes, ...]) -> None:
    """One loop turn of ``seconds`` as the socket shell makes it: the stall told first, then the
    messages of the workers ``heard`` read, then the tick."""
    h.clock.advance(seconds)
    now = h.clock.monotonic()
    h.core.workers.stalled(seconds, now)
    h.core.now = now
    for ident in heard:
        h.heartbeat(ident, 1)
    h.core.tick(now)


def test_a_broker_whose_every_turn_is_slow_still_loses_a_silent_worker_in_bounded_time() -> None:
    from gpud_broker.broker import STALL_S

    assert TURN_S > STALL_S
    h = two_workers()
    started_jobs_on_w1(h)
    w1 = h.core.registry.by_name["w1"]
    expiry, periods = w1.liveness.policy.expiry, h.core.config.worker_resume_periods
    start = h.clock.monotonic()
    suspended = lost = None
    while lost is None and h.clock.monotonic() - start < 60.0:
        slow_turn(h, TURN_S, heard=(W2,))  # w2 is heard every turn, w1 never again
        if suspended is None and w1.suspended_at:
            suspended = h.clock.monotonic() - start
        if h.core.registry.get(W1) is None:
            lost = h.clock.monotonic() - start
    # Credit per silence: its longest stall (one turn) plus one expiry; then its liveness, its grace.
    assert suspended is not None and expiry < suspended <= 2 * expiry + 2 * TURN_S + 1e-6
    assert lost is not None and lost <= (2 + periods) * expiry + 3 * TURN_S + 1e-6
    assert error_code(h.take_client()[0][1]) == "WORKER_LOST"
    w2 = h.core.registry.by_name["w2"]
    assert not w2.suspended_at and h.core.counters["worker_suspensions"] == 1  # heard each turn: live


def test_long_stalls_one_after_another_lose_no_worker_heard_between_them() -> None:
    h = two_workers(worker_resume_periods=0)  # no grace window: a silence judged is a loss
    started_jobs_on_w1(h)
    for stall in (20.0, 20.0, 7.0, 20.0):
        # The tick comes before the backlog is handed over (a freeze: libzmq's I/O thread stood
        # still too): the stall alone must not make anyone silent. Then both are read.
        slow_turn(h, stall, heard=())
        slow_turn(h, TURN_S, heard=(W1, W2))
    for _ in range(20):
        slow_turn(h, TURN_S, heard=(W1, W2))
    assert h.core.registry.get(W1) is not None and h.core.counters["worker_losses"] == 0
    assert h.take_client() == []


def test_the_workers_command_shows_a_suspended_worker_and_its_grace_left_and_resumes_are_counted() -> None:
    from gpud_broker.commands import ADMIN

    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)  # suspended 0.5 s after its silence passed 3 s
    h.advance(2.0)
    rows = {r["name"]: r for r in ADMIN.dispatch(h.core, "workers", {})}
    window = h.core.config.worker_resume_periods * h.core.registry.by_name["w1"].liveness.policy.expiry
    assert rows["w1"]["suspended"] is True and rows["w1"]["grace_left_s"] == pytest.approx(window - 2.0)
    assert rows["w2"]["suspended"] is False and rows["w2"]["grace_left_s"] is None
    assert h.core.counters["worker_suspensions"] == 1 and h.core.counters["worker_resumes"] == 0
    h.heartbeat(W1, 1)
    rows = {r["name"]: r for r in ADMIN.dispatch(h.core, "workers", {})}
    assert rows["w1"]["suspended"] is False and rows["w1"]["grace_left_s"] is None
    assert h.core.counters["worker_resumes"] == 1
    silence_w1(h)  # again, and back by a READY of its process this time
    resume_ready(h, W3, holds=[JOB])
    assert (h.core.counters["worker_suspensions"], h.core.counters["worker_resumes"]) == (2, 2)


def test_a_result_sent_on_a_connection_the_broker_does_not_know_yet_reaches_its_client() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    # libzmq reconnected w1's socket by itself (a cut connection): a new routing id, W3, that the
    # broker does not know. The job ends and its RESULT goes there before w1 hears it must reconnect.
    h.result(W3, JOB, exit_code=0)
    [(who, told, _)] = h.take_worker()
    assert who == W3 and told.command is Command.DISCONNECT and told.header["reason"] == "unknown worker"
    assert h.take_client() == [] and h.core.take_acks() == {}  # dropped: not taken, so not ACKed
    # Its process says READY on a new socket. Told that this broker ACKs results, it kept JOB's
    # RESULT (no ACK came): READY holds it with IDEM, which still runs (PROTOCOL.md §4.2, §9.4).
    again = b"conn-w1-again"
    welcome = resume_ready(h, again, holds=[IDEM, JOB])
    assert welcome.header["acks"] is True and welcome.header["stop"] == []
    w1 = h.core.registry.by_name["w1"]
    assert sorted(w1.assigned) == sorted([JOB, IDEM]) and h.take_client() == []  # JOB stays bound
    h.result(again, JOB, exit_code=0)  # re-sent after the WELCOME
    reply = h.one_reply(C1)
    assert reply.header["id"] == JOB and reply.header.get("exit_code") == 0, reply.header
    assert h.core.take_acks() == {again: [JOB]}


def test_any_message_not_only_a_heartbeat_keeps_a_worker_live() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    for n in range(5):  # 5 s without a HEARTBEAT from w1, but START again each second
        h.advance(1.0)
        h.heartbeat(W2, n)
        h.worker(W1, Command.START, {"ids": [JOB]})
        h.tick()
    assert not h.core.registry.by_name["w1"].suspended_at
    assert h.core.counters["worker_suspensions"] == 0


# --------------------------------------------------------------------------- READY's new fields


def test_ready_incarnation_and_holds_are_read() -> None:
    base: dict[str, Any] = {"name": "w1", "gpus": []}
    ready = P.parse_ready({**base, "incarnation": INC, "holds": [JOB, IDEM]})
    assert ready.incarnation == INC and ready.holds == {JOB, IDEM}
    assert P.parse_ready(base).incarnation == b"" and P.parse_ready(base).holds == frozenset()


@pytest.mark.parametrize("bad", [{"incarnation": b"short"}, {"incarnation": "not bytes"}, {"holds": [b"x"]},
                                 {"holds": "ids"}, {"holds": [JOB] * (P.MAX_HOLDS + 1)}])
def test_a_ready_with_a_bad_incarnation_or_holds_is_malformed(bad: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        P.parse_ready({"name": "w1", "gpus": [], **bad})


def test_a_malformed_ready_of_a_suspended_worker_changes_nothing() -> None:
    h = two_workers()
    started_jobs_on_w1(h)
    silence_w1(h)
    h.one_dispatch(W2)
    h.worker(W3, Command.READY, {"name": "w1", "gpus": [], "incarnation": INC, "holds": "everything"})
    [(who, msg, _)] = h.take_worker()
    assert who == W3 and msg.command is Command.ERROR
    w1 = h.core.registry.by_name["w1"]
    assert w1.identity == W1 and w1.suspended_at and list(w1.assigned) == [JOB] and h.take_client() == []
