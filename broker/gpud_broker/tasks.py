"""Tasks and sessions: every accepted request by id (for de-duplication), and open device sessions.

A task is QUEUED, RUNNING (dispatched to a worker) or DONE (its reply kept for ``result_ttl`` so a
retry with the same id gets the same answer instead of running again). The replies kept are the
reply store: each tenant has its share of it (``share``), and past that share a tenant's oldest
replies go first, so one tenant's flood pushes out only its own. A reply dropped early for room,
of work that may not run twice, leaves its id in ``expired`` until its time would have come: a
retry then gets RESULT_EXPIRED. Pure.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpud.resources import Grant, Need


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Task:
    id: bytes
    kind: str  # echo | job | session | call
    need: Need | None  # None for calls (not placed)
    body: dict[str, Any]  # kind-specific header fields forwarded in DISPATCH
    frames: list[Any]  # payload frames forwarded in DISPATCH
    route: bytes | None  # client identity that gets the REPLY; None for the broker's own tasks
    created: float
    deadline: float
    state: State = State.QUEUED
    priority: int = 0
    tenant: str = "default"
    queued: bool = False
    reserved: str | None = None  # worker reserved for it after a long wait (queue backfill)
    grant: Grant | None = None
    worker: str | None = None  # name of the worker running it
    attempts: int = 0
    avoid: set[str] = field(default_factory=set)  # workers that failed it
    retryable: bool = False
    session: bytes | None = None  # for calls: the session they act on
    reply: list[Any] | None = None  # [signature, command, header, *payload] once DONE
    reply_bytes: int = 0  # what keeping ``reply`` costs, counted against the table's budget
    dispatched_at: float = 0.0
    started: bool = False  # marked started: its worker asked START and may have been told GO (starts.py)
    owner: str | None = None  # CURVE: the User-Id (tenant and key) that sent it; its reply goes only there
    held: int = -1  # payload bytes counted against its tenant's budgets until answered (-1: not counted)


@dataclass(slots=True, eq=False)
class Session:
    id: bytes
    worker: str
    gpu: str  # uuid
    grant: Grant
    tenant: str
    route: bytes
    last_seen: float
    closing: bool = False
    opened: float = 0.0  # when the broker granted it


ENTRY_OVERHEAD = 1536  # bytes a finished task costs the broker besides its reply frames


MAX_EXPIRED = 1 << 20  # ids of replies dropped early remembered at most (about 100 bytes each)


class TaskTable:
    """Tasks by id, with finished replies evicted after ``result_ttl``, past their tenant's
    ``share(tenant)`` bytes, or past ``max_bytes`` in all (then from the tenant holding most)."""

    def __init__(self, result_ttl: float = 60.0, max_bytes: int = 256 << 20,
                 share: Callable[[str], int] | None = None) -> None:
        self.result_ttl = result_ttl
        self.max_bytes = max_bytes
        self.share: Callable[[str], int] = share if share is not None else (lambda _tenant: self.max_bytes)
        self.tasks: dict[bytes, Task] = {}
        self._done: dict[str, deque[tuple[float, Task]]] = {}  # by tenant, oldest first
        self._tenant_bytes: dict[str, int] = {}
        self._done_bytes = 0
        self.expired: dict[bytes, tuple[float, str]] = {}  # id -> (until, tenant) of replies dropped early
        self._expired_order: deque[tuple[float, bytes]] = deque()
        self.finished_total = 0
        self.dropped_early = 0
        # Told of each reply dropped early (id, until, tenant): a pair's active broker journals it.
        self.on_expired: Callable[[bytes, float, str], None] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def get(self, rid: bytes) -> Task | None:
        return self.tasks.get(rid)

    def add(self, task: Task) -> None:
        self.tasks[task.id] = task

    def finish(self, task: Task, reply: list[Any], now: float) -> None:
        """Mark done and keep the reply for retries."""
        task.state = State.DONE
        task.reply = reply
        # Frames (bytes or zmq.Frame) plus the entry's own bookkeeping, which dominates for small
        # replies (an echo's task and its table slots cost about 1.5 KiB).
        task.reply_bytes = size = ENTRY_OVERHEAD + sum(map(len, reply))
        task.frames = []
        task.body = {}
        self.finished_total += 1
        tenant = task.tenant
        done = self._done.get(tenant)
        if done is None:
            done = self._done[tenant] = deque()
            self._tenant_bytes[tenant] = 0
        done.append((now + self.result_ttl, task))
        self._tenant_bytes[tenant] += size
        self._done_bytes += size

    def forget(self, task: Task) -> None:
        """Drop a task that never ran (e.g. refused at the door)."""
        if self.tasks.get(task.id) is task:
            del self.tasks[task.id]

    def mark_expired(self, rid: bytes, until: float, tenant: str) -> None:
        """Until ``until``, a retry of ``rid`` by ``tenant`` gets RESULT_EXPIRED; a task of that id
        still kept (a passive broker's copy) is forgotten."""
        task = self.tasks.get(rid)
        if task is not None and task.state is State.DONE:
            del self.tasks[rid]  # its entry in _done goes at its own time (_drop skips a forgotten task)
        if rid not in self.expired:
            self._expired_order.append((until, rid))
        self.expired[rid] = (until, tenant)

    @property
    def bytes(self) -> int:
        """Bytes of all replies kept now."""
        return self._done_bytes

    def held_by(self, tenant: str) -> int:
        """Bytes of ``tenant``'s replies kept now."""
        return self._tenant_bytes.get(tenant, 0)

    def evict(self, now: float) -> int:
        """Forget finished tasks past their TTL; then each tenant's oldest while it is over its
        share, and the oldest of the tenant holding most while the store is over ``max_bytes``."""
        n = 0
        for tenant in list(self._done):
            done = self._done[tenant]
            share = self.share(tenant)
            while done and (done[0][0] <= now or self._tenant_bytes[tenant] > share):
                n += self._drop(tenant, now)
        while self._done_bytes > self.max_bytes and self._done:
            n += self._drop(max(self._tenant_bytes, key=self._tenant_bytes.__getitem__), now)
        expired, order = self.expired, self._expired_order
        while order and (order[0][0] <= now or len(order) > MAX_EXPIRED):
            _, rid = order.popleft()
            expired.pop(rid, None)
        return n

    def _drop(self, tenant: str, now: float) -> int:
        done = self._done[tenant]
        until, task = done.popleft()
        self._tenant_bytes[tenant] -= task.reply_bytes
        self._done_bytes -= task.reply_bytes
        if not done:
            del self._done[tenant], self._tenant_bytes[tenant]
        if self.tasks.get(task.id) is task:
            del self.tasks[task.id]
            if until > now and not task.retryable:  # dropped early: a retry must not run it again
                self.dropped_early += 1
                self.mark_expired(task.id, until, tenant)
                if self.on_expired is not None:
                    self.on_expired(task.id, until, tenant)
        return 1
