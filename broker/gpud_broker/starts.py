"""Which of a worker's jobs may have begun (PROTOCOL.md §4.4), and what a worker's loss does to
each task it held. Pure: no sockets, no clock.

A worker asks START before it starts a job's program and starts it only on GO. The broker marks the
job started (``Task.started``, replicated as update ``start``) and sends the GO once the mark is
durable: held by the passive peer, or at once without one. So a job *may have begun* exactly when
it is marked and its GO is no longer waiting here; on the passive broker, which never sends a GO,
every mark counts (the active one sent the GO, or may have). A job that has not begun is placed
again when its worker is lost, idempotent or not; one that may have begun fails unless idempotent.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Any

from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.tasks import State, Task

MAX_IDS = 10_000  # ids read from one START; the rest are ignored (the worker asks again)


class Loss(enum.Enum):
    """What happens to a task when its worker is lost."""

    REPLACE = "replace"  # placed again, never on that worker (its replica first)
    WORKER_LOST = "worker_lost"  # it may have begun and may not run twice: WORKER_LOST
    SESSION_LOST = "session_lost"  # a session's CALL: the session went with the worker


class StartGate:
    """The GOs that wait for their START marks to be durable: ``(seq, worker identity, id)`` in
    journal order, and by id the identity each waits for (one id waits for one worker at most)."""

    def __init__(self) -> None:
        self.pending: deque[tuple[int, bytes, bytes]] = deque()
        self.waiting: dict[bytes, bytes] = {}

    def clear(self) -> None:
        self.pending.clear()
        self.waiting.clear()

    def on_start(self, worker: WorkerRecord, ids: Any, mark: Callable[[Task], int], now_seq: int,
                 durable: bool) -> tuple[list[bytes], list[bytes]]:
        """A START from ``worker`` naming ``ids`` (unchecked wire input). Each job that runs there
        is marked (``mark`` journals it and returns the seq of its update) unless marked already.
        Returns ``(go, refused)``: the ids to answer GO at once (``durable``: no peer to wait for),
        and those refused; with a peer the GOs wait in ``pending`` for ``due``."""
        go: list[bytes] = []
        refused: list[bytes] = []
        if type(ids) is not list:
            return go, refused
        for rid in ids[:MAX_IDS]:
            if type(rid) is not bytes:
                continue
            task = worker.assigned.get(rid)
            if not isinstance(task, Task) or task.state is not State.RUNNING or task.kind != "job":
                refused.append(rid)
                continue
            seq = now_seq
            if not task.started:
                task.started = True
                seq = mark(task)
            if durable:
                go.append(rid)
            elif self.waiting.get(rid) != worker.identity:
                self.waiting[rid] = worker.identity
                self.pending.append((seq, worker.identity, rid))
        return go, refused

    def due(self, durable_seq: int, registry: WorkerRegistry) -> dict[bytes, list[bytes]]:
        """The GOs whose marks are durable now (``durable_seq``), by worker identity; a job no
        longer running on the worker that asked (lost, answered, placed again) gets none."""
        pending, waiting = self.pending, self.waiting
        out: dict[bytes, list[bytes]] = {}
        while pending and pending[0][0] <= durable_seq:
            _, ident, rid = pending.popleft()
            if waiting.get(rid) != ident:
                continue  # its worker was lost meanwhile, or it waits for another worker's START
            del waiting[rid]
            worker = registry.by_identity.get(ident)
            task = worker.assigned.get(rid) if worker is not None else None
            if isinstance(task, Task) and task.state is State.RUNNING and task.started:
                out.setdefault(ident, []).append(rid)
        return out

    def may_have_begun(self, task: Task) -> bool:
        """Marked started, and its GO is not still waiting here (so it was sent, or, on a broker
        that took over, the previous one may have sent it)."""
        return task.started and task.id not in self.waiting


def on_loss(gate: StartGate, task: Task) -> Loss:
    """What a worker's loss does to ``task``, which ran on it. A job whose GO still waited is
    unmarked (it never began: its placement again, journalled, clears the mark at the peer)."""
    if task.kind == "call":
        return Loss.SESSION_LOST
    if task.retryable or not gate.may_have_begun(task):
        gate.waiting.pop(task.id, None)
        task.started = False
        # A task known only from a worker's heartbeat after a failover has no content to place.
        return Loss.REPLACE if task.need is not None else Loss.WORKER_LOST
    return Loss.WORKER_LOST
