"""``gpud.ratelog`` when its tables are full: a flood of new sources forgets only the least
recently seen ones, never the count of a source that keeps coming (a flooder of bad messages
towards its cut, or its log lines held back)."""

from __future__ import annotations

from gpud.clock import FakeClock
from gpud.ratelog import OTHERS, RateLimit, WindowCount, remember


def test_remember_forgets_the_least_recently_seen_source_only() -> None:
    table: dict[object, int] = {}
    assert [remember(table, s, 1, 3) for s in "abc"] == [None, None, None]
    assert remember(table, "a", 2, 3) is None  # seen again: the most recent now, nothing forgotten
    assert remember(table, "d", 1, 3) == ("b", 1)  # b is the least recently seen
    assert list(table) == ["c", "a", "d"] and table["a"] == 2


def test_a_window_count_keeps_a_busy_sources_count_through_a_flood_of_new_sources() -> None:
    clock = FakeClock(0.0)
    count = WindowCount(1.0, clock.monotonic, max_sources=8)
    fresh = iter(range(10_000))
    for i in range(1, 101):
        assert count("flooder") == i  # never reset: each of its events is the latest seen
        for _ in range(5):  # more new sources in all than the table holds
            assert count(next(fresh)) == 1
    assert len(count.used) == 8
    assert count(0) == 1  # a forgotten new source counts afresh


def test_a_window_count_forgets_a_quiet_source_once_the_new_ones_fill_its_table() -> None:
    clock = FakeClock(0.0)
    count = WindowCount(1.0, clock.monotonic, max_sources=4)
    assert [count("a") for _ in range(3)] == [1, 2, 3]
    for s in range(3):
        count(s)
    assert count("a") == 4  # still remembered: 4 sources
    for s in range(3, 7):
        count(s)
    assert count("a") == 1  # four newer ones since: forgotten, it counts afresh


def test_a_rate_limit_keeps_a_busy_sources_interval_through_a_flood_of_new_sources() -> None:
    clock = FakeClock(0.0)
    limit = RateLimit(10.0, clock.monotonic, max_sources=8)
    assert limit("flooder") == 0
    for s in range(1000):
        assert limit("flooder") is None  # held back: its line was logged this interval
        assert limit(s) == 0  # each new source logs its first line
    clock.advance(10.0)
    due = dict(limit.due())
    assert due["flooder"] == 1000  # its count survived the flood
    # 1000 new sources each logged and forgotten with nothing held back: nothing else to report
    assert set(due) == {"flooder"}


def test_a_forgotten_sources_held_back_count_is_reported_as_others() -> None:
    clock = FakeClock(0.0)
    limit = RateLimit(10.0, clock.monotonic, max_sources=2)
    assert limit("a") == 0
    assert [limit("a") for _ in range(3)] == [None] * 3
    assert limit("b") == 0 and limit("c") == 0  # a, seen least recently, is forgotten
    clock.advance(10.0)
    assert sorted(limit.due(), key=str) == [(OTHERS, 3)]  # never silent: its 3 as others'
