"""Tasks and sessions: every accepted request by id (for de-duplication), and open device sessions.

A task is QUEUED, RUNNING (dispatched to a worker) or DONE (its reply kept for ``result_ttl`` so a
retry with the same id gets the same answer instead of running again). Pure.
"""

from __future__ import annotations

import enum
from collections import deque
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


class TaskTable:
    """Tasks by id, with finished replies evicted after ``result_ttl`` or past ``max_bytes``."""

    def __init__(self, result_ttl: float = 60.0, max_bytes: int = 256 << 20) -> None:
        self.result_ttl = result_ttl
        self.max_bytes = max_bytes
        self.tasks: dict[bytes, Task] = {}
        self._done: deque[tuple[float, Task]] = deque()
        self._done_bytes = 0
        self.finished_total = 0

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
        task.reply_bytes = ENTRY_OVERHEAD + sum([len(f) for f in reply])
        task.frames = []
        task.body = {}
        self.finished_total += 1
        self._done.append((now + self.result_ttl, task))
        self._done_bytes += task.reply_bytes

    def forget(self, task: Task) -> None:
        """Drop a task that never ran (e.g. refused at the door)."""
        if self.tasks.get(task.id) is task:
            del self.tasks[task.id]

    def evict(self, now: float) -> int:
        """Forget finished tasks past their TTL, and the oldest while over the byte budget."""
        n = 0
        done = self._done
        while done and (done[0][0] <= now or self._done_bytes > self.max_bytes):
            _, task = done.popleft()
            self._done_bytes -= task.reply_bytes
            if self.tasks.get(task.id) is task:
                del self.tasks[task.id]
            n += 1
        return n
