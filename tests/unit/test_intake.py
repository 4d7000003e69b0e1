"""intake.EchoShare: each sender's echo bytes in flight against its share; what waits, in order."""

from __future__ import annotations

from gpud_broker.intake import MAX_BUCKETS, EchoShare

KiB = 1 << 10
A, B = "alice", "bob"


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def msg(name: str) -> list[bytes]:
    return [b"route", name.encode()]


def test_a_sender_over_its_share_waits_and_another_sender_never_does() -> None:
    s = EchoShare(share=256 * KiB, max_waiting_bytes=4096 * KiB)
    assert s.take(B, msg("b1"), None, (rid(1), 256 * KiB), 0.0) is True  # one echo always goes
    assert s.take(B, msg("b2"), None, (rid(2), 256 * KiB), 0.0) is False  # over bob's share: waits
    assert s.take(B, msg("b-cancel"), None, None, 0.0) is False  # behind it, in order, whatever it is
    assert s.take(A, msg("a1"), None, (rid(3), 200 * KiB), 0.0) is True  # alice has her own share
    assert s.take(A, msg("a-small"), None, None, 0.0) is True
    assert s.ready(0.1) == []
    s.answered(rid(1))
    assert [w.frames[1] for w in s.ready(0.1)] == [b"b2", b"b-cancel"]
    assert s.bytes_of == {B: 256 * KiB, A: 200 * KiB} and s.waiting == {}


def test_small_echoes_share_the_bytes_and_a_waiting_one_goes_after_max_wait() -> None:
    s = EchoShare(share=100, max_waiting_bytes=1000, max_wait_s=1.0)
    assert [s.take(B, msg(f"e{i}"), None, (rid(i), 40), 0.0) for i in range(4)] == [True, True, False, False]
    assert s.ready(0.5) == []
    s.answered(rid(0))  # 40 in flight: one more fits, the other still waits
    assert [w.frames[1] for w in s.ready(0.6)] == [b"e2"]
    assert [w.frames[1] for w in s.ready(1.0)] == [b"e3"]  # waited its second: it goes anyway
    assert s.bytes_of[B] == 120


def test_too_much_waiting_is_refused_and_a_retry_in_flight_counts_once() -> None:
    s = EchoShare(share=100, max_waiting_bytes=150, max_waiting=3)
    assert s.take(B, msg("e0"), None, (rid(0), 100), 0.0) is True
    assert s.take(B, msg("e1"), None, (rid(1), 100), 0.0) is False
    assert s.take(B, msg("e2"), None, (rid(2), 100), 0.0) is None  # past max_waiting_bytes
    assert s.take(B, msg("p1"), None, None, 0.0) is False
    assert s.take(B, msg("p2"), None, None, 0.0) is False
    assert s.take(B, msg("p3"), None, None, 0.0) is None  # past max_waiting messages
    assert s.refused == 2
    s.answered(rid(0))
    s.answered(rid(0))  # a second reply (a retry answered again) lets nothing more go
    assert [w.frames[1] for w in s.ready(0.0)] == [b"e1", b"p1", b"p2"]
    assert s.take(B, msg("e1 again"), None, (rid(1), 100), 0.0) is True  # a retry: 100, not 200, in flight
    assert s.bytes_of[B] == 100
    s.answered(rid(1))
    assert s.bytes_of == {} and s.in_flight == {}


def test_an_echo_whose_reply_was_never_seen_is_forgotten() -> None:
    s = EchoShare(share=100, max_waiting_bytes=1000)
    s.take(B, msg("e0"), None, (rid(0), 100), 0.0)
    assert s.forget_old(599.0) == 0 and s.bytes_of[B] == 100
    assert s.forget_old(600.0) == 1 and s.bytes_of == {}


def test_empty_echoes_hold_no_share_and_every_reply_lands_cleanly() -> None:
    s = EchoShare(share=100, max_waiting_bytes=1000)
    for i in range(3):
        assert s.take(B, msg(f"empty{i}"), None, (rid(i), 0), 0.0) is True
    assert s.take(B, msg("full"), None, (rid(9), 100), 0.0) is True
    for i in (0, 1, 2, 9, 9, 42):  # empty ones, the full one twice, an unknown id
        s.answered(rid(i))
    assert s.bytes_of == {} and s.in_flight == {}


def test_routes_with_echoes_in_flight_follow_a_retry_and_empty_when_answered() -> None:
    s = EchoShare(share=100, max_waiting_bytes=1000)
    assert s.take(B, [b"r1", b"e0"], None, (rid(0), 60), 0.0) is True
    assert s.take(A, [b"r9", b"a0"], None, (rid(9), 60), 0.0) is True
    assert s.routes == {b"r1": 1, b"r9": 1}
    assert s.take(B, [b"r2", b"e0 again"], None, (rid(0), 60), 0.0) is True  # in flight: counted once, its reply goes to r2
    assert s.routes == {b"r2": 1, b"r9": 1} and s.bytes_of == {B: 60, A: 60}
    assert s.take(B, [b"r2", b"e1"], None, (rid(1), 60), 0.0) is False  # over bob's share: waits
    s.answered(rid(0))
    assert [w.frames[1] for w in s.ready(0.0)] == [b"e1"]
    assert s.routes == {b"r2": 1, b"r9": 1}
    s.answered(rid(1))
    s.answered(rid(9))
    assert s.routes == {} and s.bytes_of == {} and s.in_flight == {}


def test_a_sender_past_its_rate_waits_for_its_bucket_and_another_sender_does_not() -> None:
    # share 100 bytes in flight, 200 bytes a second: the bucket holds one second's (200).
    s = EchoShare(share=100, max_waiting_bytes=1000, rate=200.0)
    for i in range(2):
        assert s.take(B, msg(f"e{i}"), None, (rid(i), 100), 0.0) is True
        s.answered(rid(i))
    assert s.take(B, msg("e2"), None, (rid(2), 100), 0.0) is False  # nothing in flight, but 200 of 200 spent
    assert s.take(A, msg("a0"), None, (rid(9), 100), 0.0) is True  # alice's bucket is her own
    assert s.ready(0.0) == []
    assert [w.frames[1] for w in s.ready(0.01)] == [b"e2"]  # some bytes back: it goes (owing 98)
    s.answered(rid(2))
    assert s.take(B, msg("e3"), None, (rid(3), 100), 0.01) is False
    assert s.ready(0.45) == []  # 88 of the 98 owed are back
    assert [w.frames[1] for w in s.ready(0.52)] == [b"e3"]
    assert s.shown()["echo_bytes_per_s"] == 200.0


def test_past_its_rate_a_sender_is_slowed_never_stalled() -> None:
    s = EchoShare(share=100, max_waiting_bytes=1000, max_wait_s=1.0, rate=1.0)  # the bucket: one share
    assert s.take(B, msg("e0"), None, (rid(0), 100), 0.0) is True
    s.answered(rid(0))
    assert s.take(B, msg("e1"), None, (rid(1), 100), 0.0) is False
    assert [w.frames[1] for w in s.ready(0.01)] == [b"e1"]  # owing 99.99 bytes: 100 s at this rate
    s.answered(rid(1))
    assert s.take(B, msg("e2"), None, (rid(2), 100), 0.01) is False
    assert s.ready(0.9) == []
    assert [w.frames[1] for w in s.ready(1.01)] == [b"e2"]  # waited max_wait_s: it goes anyway


def test_an_echo_may_overdraw_the_bucket_and_an_empty_echo_costs_nothing() -> None:
    s = EchoShare(share=1000, max_waiting_bytes=10_000, max_wait_s=60.0, rate=100.0)  # the bucket: one share
    assert s.take(B, msg("big"), None, (rid(0), 1000), 0.0) is True
    s.answered(rid(0))
    assert s.take(B, msg("empty"), None, (rid(1), 0), 0.0) is True  # no payload: no rate
    assert s.take(B, msg("big again"), None, (rid(2), 1000), 0.0) is False
    assert [w.frames[1] for w in s.ready(0.001)] == [b"big again"]  # a little back: it goes, owing 999.9
    s.answered(rid(2))
    assert s.take(B, msg("next"), None, (rid(3), 10), 0.001) is False
    assert s.ready(9.9) == []  # its debt: 10 s at this rate
    assert [w.frames[1] for w in s.ready(10.1)] == [b"next"]


def test_a_flood_of_routing_ids_does_not_reset_another_senders_rate() -> None:
    # security none: each routing id is a sender. B overdraws its bucket and goes on sending; a
    # flood of fresh routing ids, each with one echo, passes MAX_BUCKETS three times meanwhile:
    # B's bucket is never forgotten (it was used more recently than the flood's oldest), so B's
    # debt stays its own.
    s = EchoShare(share=100, max_waiting_bytes=10_000, max_wait_s=0.0, rate=1.0)  # the bucket: one share
    t = 0.0
    assert s.take(B, msg("b0"), None, (rid(0), 100), t) is True
    s.answered(rid(0))
    n = 1
    for i in range(3 * MAX_BUCKETS):
        t += 1e-6
        flooder = b"flood-%d" % i
        assert s.take(flooder, [flooder, b"x"], None, (rid(10**6 + i), 10), t) is True
        s.answered(rid(10**6 + i))
        if i % (MAX_BUCKETS // 4) == 0:  # B's next echo: it waits (its bucket is spent) or goes
            s.take(B, msg(f"b{n}"), None, (rid(n), 10), t)
            s.ready(t)  # max_wait_s 0: it goes, spending its 10 bytes
            s.answered(rid(n))
            n += 1
    assert len(s.buckets) == MAX_BUCKETS  # bounded
    assert n > 10
    assert s.buckets.level(B, t) < -10 * (n - 2)  # every echo of B's spent: never reset to a full bucket
