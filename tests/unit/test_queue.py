"""gpud_broker.queue.PendingQueue: order, fairness, bounds, cancel, expiry and skipping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from gpud_broker.queue import PendingQueue


@dataclass(eq=False)
class Item:
    name: str
    priority: int = 0
    tenant: str = "default"
    deadline: float = 1e9
    queued: bool = False
    size: int = 1
    created: float = 0.0
    reserved: str | None = None


def drain(q: PendingQueue[Item]) -> list[str]:
    """Place everything, in order, and return the names (checking len() after every placement)."""
    order: list[str] = []

    def take(item: Item, _excluded: object = None) -> bool:
        order.append(item.name)
        return True

    before = len(q)
    assert q.place(take, scan_limit=1000) == before
    assert len(q) == 0
    return order


def names(q: PendingQueue[Item]) -> list[str]:
    return [x.name for x in q.in_order()]


def small_ones(placed: list[str]) -> Callable[[Item, object], bool]:
    """A ``fits`` for ``place()``: items of size up to 4 fit, and their names go to ``placed``."""

    def fits(item: Item, _excluded: object = None) -> bool:
        if item.size > 4:
            return False
        placed.append(item.name)
        return True

    return fits


def test_priority_first() -> None:
    q: PendingQueue[Item] = PendingQueue()
    for name, prio in [("low", -5), ("mid", 0), ("high", 10), ("mid2", 0), ("top", 100)]:
        assert q.push(Item(name, priority=prio))
    assert len(q) == 5
    assert names(q) == ["top", "high", "mid", "mid2", "low"]
    assert drain(q) == ["top", "high", "mid", "mid2", "low"]


def test_round_robin_between_tenants() -> None:
    q: PendingQueue[Item] = PendingQueue()
    for i in range(5):
        q.push(Item(f"A{i}", tenant="A"))
    for i in range(2):
        q.push(Item(f"B{i}", tenant="B"))
    assert len(q) == 7
    assert names(q) == ["A0", "B0", "A1", "B1", "A2", "A3", "A4"]
    assert drain(q) == ["A0", "B0", "A1", "B1", "A2", "A3", "A4"]


def test_round_robin_one_at_a_time_and_fifo_within_tenant() -> None:
    q: PendingQueue[Item] = PendingQueue()
    for i in range(3):
        q.push(Item(f"A{i}", tenant="A"))
        q.push(Item(f"B{i}", tenant="B"))
        q.push(Item(f"C{i}", tenant="C"))
    order: list[str] = []
    budget = [0]

    def one(item: Item, _excluded: object = None) -> bool:  # accept one item per place() call
        if budget[0]:
            return False
        budget[0] = 1
        order.append(item.name)
        return True

    for expected_len in range(8, -1, -1):
        budget[0] = 0
        assert q.place(one, scan_limit=1000) == 1
        assert len(q) == expected_len
    assert order == ["A0", "B0", "C0", "A1", "B1", "C1", "A2", "B2", "C2"]
    # the served tenant goes to the back even across calls: FIFO per tenant, fair between them
    for tenant in "ABC":
        assert [n for n in order if n[0] == tenant] == [f"{tenant}{i}" for i in range(3)]


def test_max_len() -> None:
    q: PendingQueue[Item] = PendingQueue(max_len=3)
    items = [Item(f"x{i}") for i in range(4)]
    assert [q.push(x) for x in items] == [True, True, True, False]
    assert len(q) == 3
    assert not items[3].queued
    assert q.remove(items[0])
    assert q.push(items[3])
    assert len(q) == 3 and names(q) == ["x1", "x2", "x3"]


def test_remove() -> None:
    q: PendingQueue[Item] = PendingQueue()
    a, b, c = Item("a", tenant="t1"), Item("b", tenant="t1"), Item("c", tenant="t2")
    for x in (a, b, c):
        q.push(x)
    assert q.remove(b)
    assert not b.queued and len(q) == 2
    assert not q.remove(b)
    assert len(q) == 2
    assert not q.remove(Item("never-queued"))
    assert names(q) == ["a", "c"]
    assert q.remove(a) and q.remove(c)
    assert len(q) == 0 and names(q) == []
    assert q.place(lambda x, _=None: True) == 0


def test_remove_does_not_confuse_equal_looking_items() -> None:
    q: PendingQueue[Item] = PendingQueue()
    first, second = Item("same"), Item("same")
    q.push(first)
    q.push(second)
    assert q.remove(second)
    assert first.queued and not second.queued
    assert next(q.in_order()) is first


def test_expire() -> None:
    q: PendingQueue[Item] = PendingQueue()
    early = Item("early", deadline=10.0)
    exact = Item("exact", deadline=20.0, tenant="t2")
    late = Item("late", deadline=30.0)
    cancelled = Item("cancelled", deadline=5.0)
    for x in (late, early, exact, cancelled):
        q.push(x)
    q.remove(cancelled)
    assert len(q) == 3
    assert q.expire(9.9) == []
    assert len(q) == 3
    got = q.expire(20.0)
    assert [x.name for x in got] == ["early", "exact"]  # deadline order; <= now counts as passed
    assert not early.queued and not exact.queued and not cancelled.queued
    assert len(q) == 1 and names(q) == ["late"]
    assert q.expire(20.0) == []
    assert [x.name for x in q.expire(100.0)] == ["late"]
    assert len(q) == 0


def test_expire_after_placement_and_requeue() -> None:
    q: PendingQueue[Item] = PendingQueue()
    placed = Item("placed", deadline=10.0)
    keep = Item("keep", deadline=10.0, tenant="t2")
    q.push(placed)
    q.push(keep)
    assert q.place(lambda x, _=None: x is placed) == 1
    assert len(q) == 1
    # a placed item that comes back (its worker was lost) is expired once, not twice
    assert q.push(placed, front=True)
    assert len(q) == 2
    got = q.expire(10.0)
    assert sorted(x.name for x in got) == ["keep", "placed"]
    assert len(q) == 0


def test_place_skips_what_does_not_fit() -> None:
    q: PendingQueue[Item] = PendingQueue()
    q.push(Item("big", size=8))
    q.push(Item("small1"))
    q.push(Item("big2", size=8, tenant="t2"))
    q.push(Item("small2", tenant="t2"))
    q.push(Item("small3"))
    placed: list[str] = []
    fits = small_ones(placed)
    assert q.place(fits) == 3
    assert placed == ["small1", "small2", "small3"]
    assert len(q) == 2
    # the big ones stay queued; "default" was served last, so tenant t2 is next in turn
    assert names(q) == ["big2", "big"]
    assert q.place(fits) == 0
    assert len(q) == 2


def test_place_lower_priority_when_higher_does_not_fit() -> None:
    q: PendingQueue[Item] = PendingQueue()
    q.push(Item("big-high", priority=5, size=8))
    q.push(Item("small-low", priority=-5))
    placed: list[str] = []
    fits = small_ones(placed)
    assert q.place(fits) == 1
    assert placed == ["small-low"] and names(q) == ["big-high"]


def test_place_respects_scan_limit() -> None:
    q: PendingQueue[Item] = PendingQueue()
    for i in range(5):
        q.push(Item(f"big{i}", size=8))
    q.push(Item("small"))
    offered: list[str] = []

    def fits(item: Item, _excluded: object = None) -> bool:
        offered.append(item.name)
        return item.size <= 4

    assert q.place(fits, scan_limit=3) == 0
    assert offered == ["big0", "big1", "big2"]
    assert len(q) == 6
    offered.clear()
    assert q.place(fits, scan_limit=5) == 0  # five skips used up before "small" is reached
    assert len(offered) == 5 and len(q) == 6
    offered.clear()
    assert q.place(fits, scan_limit=6) == 1
    assert offered[:6] == ["big0", "big1", "big2", "big3", "big4", "small"] and len(q) == 5


def test_push_front() -> None:
    q: PendingQueue[Item] = PendingQueue()
    q.push(Item("a1", tenant="a"))
    q.push(Item("a2", tenant="a"))
    q.push(Item("b1", tenant="b"))
    assert q.push(Item("retry", tenant="a"), front=True)
    assert len(q) == 4
    assert names(q) == ["retry", "b1", "a1", "a2"]
    assert drain(q) == ["retry", "b1", "a1", "a2"]


def test_len_consistent_through_mixed_operations() -> None:
    q: PendingQueue[Item] = PendingQueue(max_len=50)
    items: list[Item] = []
    expected = 0
    for i in range(40):
        x = Item(f"i{i}", priority=i % 3, tenant=f"t{i % 4}", deadline=float(i))
        items.append(x)
        assert q.push(x)
        expected += 1
        assert len(q) == expected == sum(1 for _ in q.in_order())
    for x in items[::5]:
        assert q.remove(x)
        expected -= 1
        assert len(q) == expected == sum(1 for _ in q.in_order())
    gone = q.expire(9.5)  # i1..i9 minus the removed i5
    assert len(gone) == 8
    expected -= len(gone)
    assert len(q) == expected == sum(1 for _ in q.in_order())
    n = q.place(lambda x, _=None: x.priority == 2)
    expected -= n
    assert n > 0 and len(q) == expected == sum(1 for _ in q.in_order())
    assert all(x.priority != 2 for x in q.in_order())
    assert sum(x.queued for x in items) == expected


@pytest.mark.parametrize("front", [False, True])
def test_push_marks_queued(front: bool) -> None:
    q: PendingQueue[Item] = PendingQueue()
    x = Item("x")
    assert q.push(x, front=front) and x.queued
    assert q.place(lambda _, __=None: True) == 1 and not x.queued
