"""The frontend's door (``gpud_broker.gate``) and the rate limit of repeated log lines
(``gpud.ratelog``), with a fake clock: connections counted per source and in all against their
bounds, descriptors reused, sources held off for refused handshakes; one line per source and
interval, the rest counted and reported."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.utils.z85

from gpud.clock import FakeClock
from gpud.ratelog import OTHERS, RateLimit, TokenBucket, WindowCount
from gpud.security import load_public_key
from gpud_broker.gate import ConnectionGate, ConnectionLimits, default_limits, source_of


def test_a_source_at_its_bound_is_refused_and_another_source_is_not() -> None:
    gate = ConnectionGate(ConnectionLimits(total=10, per_source=3))
    assert [gate.accept(fd, "192.0.2.1", 0.0) for fd in (10, 11, 12)] == [None] * 3
    why = gate.accept(13, "192.0.2.1", 0.0)
    assert why is not None and "max_connections_per_source" in why
    assert gate.accept(14, "192.0.2.2", 0.0) is None  # another source: admitted
    gate.closed(10)
    gate.closed(13)  # never admitted: nothing changes
    assert gate.accept(15, "192.0.2.1", 0.0) is None  # one of its own went: room again
    assert gate.per_source == {"192.0.2.1": 3, "192.0.2.2": 1} and len(gate) == 4
    assert gate.refused_by["per_source"] == 1


def test_the_total_bound_holds_for_every_source() -> None:
    gate = ConnectionGate(ConnectionLimits(total=4, per_source=3))
    for fd, src in ((1, "a"), (2, "a"), (3, "b"), (4, "c")):
        assert gate.accept(fd, src, 0.0) is None
    why = gate.accept(5, "d", 0.0)
    assert why is not None and "max_connections" in why and len(gate) == 4


def test_a_reused_descriptor_counts_once() -> None:
    gate = ConnectionGate(ConnectionLimits(total=10, per_source=2))
    gate.accept(7, "a", 0.0)
    gate.accept(7, "b", 0.0)  # its disconnect was not seen before the descriptor came back
    assert gate.per_source == {"b": 1} and len(gate) == 1


def test_refused_handshakes_hold_a_source_off_for_a_while() -> None:
    limits = ConnectionLimits(total=100, per_source=100, refusals=3, hold_off_s=10.0, held_off_rate=2.0)
    gate = ConnectionGate(limits)
    for t in (0.0, 1.0):
        gate.handshake_refused("192.0.2.9", t)
    assert not gate.is_held_off("192.0.2.9", 1.0)
    gate.handshake_refused("192.0.2.9", 2.0)
    assert gate.is_held_off("192.0.2.9", 2.0) and not gate.is_held_off("192.0.2.8", 2.0)
    assert gate.shown(5.0)["held_off"] == ["192.0.2.9"]
    # It may open held_off_rate connections a second (their keys decide); the rest are refused.
    got = [gate.accept(fd, "192.0.2.9", 5.0) for fd in range(100, 110)]
    assert got[:2] == [None, None] and all(why is not None and "held off" in why for why in got[2:])
    assert gate.accept(200, "192.0.2.8", 5.0) is None  # another source: not held off
    assert gate.accept(201, "192.0.2.9", 5.5) is None  # half a second later: one more
    assert gate.refused_by["held_off"] == 8
    assert not gate.is_held_off("192.0.2.9", 12.0)  # its time is over
    assert all(gate.accept(fd, "192.0.2.9", 12.0) is None for fd in range(300, 305))
    # Refusals spread wider than the window never add up to a hold-off.
    for t in (20.0, 29.0, 39.5, 49.0):
        gate.handshake_refused("192.0.2.7", t)
    assert not gate.is_held_off("192.0.2.7", 49.0)


def test_the_sources_held_off_now_and_a_count_of_their_changes_for_the_listeners_filter() -> None:
    gate = ConnectionGate(ConnectionLimits(refusals=1, hold_off_s=10.0))
    assert gate.held_now(0.0) == [] and gate.held_changes == 0
    gate.handshake_refused("192.0.2.9", 0.0)
    gate.handshake_refused("2001:db8::1", 5.0)
    assert gate.held_now(6.0) == ["192.0.2.9", "2001:db8::/64"] and gate.held_changes == 2
    assert gate.held_now(6.0) == ["192.0.2.9", "2001:db8::/64"] and gate.held_changes == 2  # asking changes nothing
    assert gate.held_now(11.0) == ["2001:db8::/64"] and gate.held_changes == 3  # the first let go
    assert gate.held_now(16.0) == [] and gate.held_changes == 4


def test_a_held_off_source_keeps_its_known_keys_and_its_unknown_ones_cost_no_directory_read(tmp_path: Path) -> None:
    from gpud.security import FRONTEND_DOMAIN, KeyStore, ZapHandler, client_user, keygen

    (tmp_path / "clients" / "alice").mkdir(parents=True)
    public, _ = keygen(tmp_path / "clients" / "alice", "a1")
    known = zmq.utils.z85.decode(load_public_key(public))
    clock = FakeClock(0.0)
    gate = ConnectionGate(ConnectionLimits(refusals=5, hold_off_s=10.0))
    store = KeyStore(tmp_path / "workers", tmp_path / "clients")
    zap = ZapHandler(store, clock=clock.monotonic, gate=gate)
    for _ in range(5):  # an outsider's fresh keys
        assert zap.decide(FRONTEND_DOMAIN, "192.0.2.9", "CURVE", [bytes(32)])[0] == "400"
    assert gate.is_held_off("192.0.2.9", clock.monotonic())
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.9", "CURVE", [known]) == ("200", "OK", client_user("alice", known))
    # A key added while the source is held off is not read for it, until the hold-off ends.
    new, _ = keygen(tmp_path / "clients" / "alice", "a2")
    added = zmq.utils.z85.decode(load_public_key(new))
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.9", "CURVE", [added])[0] == "400"
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.10", "CURVE", [added])[0] == "200"  # another source reads it
    clock.advance(10.0)
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.9", "CURVE", [added])[0] == "200"


def test_a_held_off_client_key_is_refused_until_its_time_is_up_and_other_keys_are_not(tmp_path: Path) -> None:
    from gpud.security import FRONTEND_DOMAIN, KeyStore, ZapHandler, keygen

    (tmp_path / "clients" / "bob").mkdir(parents=True)
    keys = [zmq.utils.z85.decode(load_public_key(keygen(tmp_path / "clients" / "bob", f"b{i}")[0])) for i in (1, 2)]
    clock = FakeClock(0.0)
    zap = ZapHandler(KeyStore(tmp_path / "workers", tmp_path / "clients"), clock=clock.monotonic)
    zap.hold_off(keys[0], 10.0)
    code, why, user = zap.decide(FRONTEND_DOMAIN, "192.0.2.1", "CURVE", [keys[0]])
    assert (code, user) == ("400", "") and "held off" in why
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.1", "CURVE", [keys[1]])[0] == "200"  # the tenant's other key
    clock.advance(10.0)
    assert zap.decide(FRONTEND_DOMAIN, "192.0.2.1", "CURVE", [keys[0]])[0] == "200"
    assert zap.held_keys == {}


@pytest.mark.parametrize(("address", "source"), [
    ("192.0.2.1", "192.0.2.1"), ("::ffff:192.0.2.1", "192.0.2.1"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::2", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"), ("ipc", "ipc"),
])
def test_sources(address: str, source: str) -> None:
    assert source_of(address) == source


def test_defaults_are_sized_from_the_descriptor_limit() -> None:
    assert default_limits(65536) == ConnectionLimits(total=32640, per_source=1024)
    assert default_limits(1024) == ConnectionLimits(total=384, per_source=64)


def test_rate_limit_logs_each_source_once_per_interval_and_reports_the_rest() -> None:
    clock = FakeClock(0.0)
    limit = RateLimit(10.0, clock.monotonic)
    assert limit("a") == 0 and limit("b") == 0
    assert [limit("a") for _ in range(5)] == [None] * 5
    clock.advance(5.0)
    assert limit.due() == []  # a's interval is not over
    clock.advance(5.0)
    assert limit.due() == [("a", 5)]  # reported once
    assert limit.due() == []
    assert limit("a") == 0  # a starts afresh: its next one is logged in full
    limit("a")
    clock.advance(11.0)
    assert limit("a") == 1  # or the count rides on the next full line, and is not reported twice
    assert limit.due() == []


def test_a_window_count_numbers_each_sources_events_within_its_window() -> None:
    clock = FakeClock(0.0)
    count = WindowCount(1.0, clock.monotonic)
    assert [count("b") for _ in range(5)] == [1, 2, 3, 4, 5]
    assert count("a") == 1  # another source counts apart
    clock.advance(0.99)
    assert count("b") == 6
    clock.advance(0.01)  # b's window is over: a new one begins with its next event
    assert [count("b") for _ in range(2)] == [1, 2]
    clock.advance(0.5)
    assert count("b") == 3 and count("a") == 1


def test_rate_limit_bounds_the_sources_logged_in_full_per_interval() -> None:
    clock = FakeClock(0.0)
    limit = RateLimit(10.0, clock.monotonic, max_new=3)
    got = [limit(n) for n in range(100)]  # a fresh source per event
    assert got[:3] == [0, 0, 0] and got[3] == 0 and got[4:] == [None] * 96  # the 4th is others' line
    clock.advance(10.0)
    assert limit.due() == [(OTHERS, 96)]
    assert limit(1000) == 0  # a new interval: new sources are logged again


def test_a_token_bucket_fills_at_its_rate_up_to_its_burst_and_may_be_overdrawn() -> None:
    b = TokenBucket(rate=2.0, burst=4.0)
    assert b.level("s", 0.0) == 4.0  # never seen: full
    assert [b.take("s", 1.0, 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert b.level("s", 0.0) == 0.0 and b.level("other", 0.0) == 4.0  # each sender its own
    assert not b.take("s", 1.0, 0.4) and b.take("s", 1.0, 0.5)  # 2 a second: one after half a second
    assert b.level("s", 100.0) == 4.0  # never past the burst
    b.spend("s", 10.0, 100.0)  # an overdraft: nothing left until it is paid back
    assert b.level("s", 100.0) == -6.0 and not b.take("s", 1.0, 103.0)
    assert b.take("s", 1.0, 103.5)  # 7 back after 3.5 s: -6 + 7 = 1
    b.forget("s")
    assert b.level("s", 103.5) == 4.0


def test_a_token_bucket_forgets_the_least_recently_used_sender_only() -> None:
    b = TokenBucket(rate=1.0, burst=1.0, max_senders=3)
    for s in ("a", "b", "c"):
        b.spend(s, 5.0, 0.0)
    b.spend("a", 1.0, 0.0)  # a is the most recent now; b the least
    b.spend("d", 1.0, 0.0)  # a fourth: b is forgotten, nobody else
    assert len(b) == 3
    assert b.level("b", 0.0) == 1.0  # forgotten: full again
    assert (b.level("a", 0.0), b.level("c", 0.0), b.level("d", 0.0)) == (-5.0, -4.0, 0.0)
