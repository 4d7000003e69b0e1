"""The replication stream's content (PROTOCOL.md §9.3): tasks, sessions and updates as msgpack-ready
lists; the ``Journal`` an active broker of a pair writes them to (``NULL_JOURNAL`` when it has no
peer to write for); and how a passive broker's BrokerCore takes a snapshot and applies updates.
Pure: no sockets.

Times travel as ages and remaining times (seconds), never as clock readings, so two brokers need
not share a clock. Routes (ROUTER identities of clients) do not travel: a client's retry after a
failover attaches to its task on the new broker. What comes from the peer is checked as any wire
input is: a malformed entry raises ProtocolError (the pair then re-syncs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpud import protocol
from gpud.errors import ProtocolError
from gpud.resources import Grant
from gpud_broker.tasks import Session, State, Task

if TYPE_CHECKING:
    from gpud_broker.core import BrokerCore

log = logging.getLogger(__name__)

# Update tags (the first item of each update).
TASK, RUN, QUEUE, DONE, FORGET, SESSION, END, MARKS, START, EXPIRED = (
    "task", "run", "queue", "done", "forget", "session", "end", "marks", "start", "expired")
STAGE, CHUNK, UNSTAGE = ("stage", "chunk", "unstage")  # staged job inputs (PROTOCOL.md §11.4)


class Journal:
    """The updates of an active broker of a pair, numbered from 1, until the pair sends them
    (``take``); ``durable``: the last one the passive peer holds (what ACKs wait for)."""

    def __init__(self) -> None:
        self.updates: list[list[Any]] = []
        self.seq = 0  # seq of the last update journalled
        self.durable = 0

    @property
    def lag(self) -> int:
        """Updates journalled that the passive peer does not hold yet."""
        return self.seq - self.durable

    def _add(self, update: list[Any]) -> None:
        self.seq += 1
        self.updates.append(update)

    def task(self, t: Task, now: float) -> None:
        self._add([TASK, task_to_wire(t, now)])

    def run(self, rid: bytes, worker: str, grant: Grant | None) -> None:
        self._add([RUN, rid, worker, grant_to_wire(grant)])

    def queued(self, t: Task) -> None:
        self._add([QUEUE, t.id, sorted(t.avoid)])

    def done(self, rid: bytes, reply: list[Any]) -> None:
        self._add([DONE, rid, frames_bytes(reply)])

    def forget(self, rid: bytes) -> None:
        self._add([FORGET, rid])

    def session(self, s: Session) -> None:
        self._add([SESSION, session_to_wire(s)])

    def end(self, sid: bytes) -> None:
        self._add([END, sid])

    def marks(self, drained: set[str], cordoned: set[str]) -> None:
        self._add([MARKS, sorted(drained), sorted(cordoned)])

    def start(self, rid: bytes) -> None:
        self._add([START, rid])

    def expired(self, rid: bytes, left: float, tenant: str) -> None:
        self._add([EXPIRED, rid, left, tenant])

    def stage(self, job: bytes, tenant: str, owner: str | None, sizes: tuple[int, ...]) -> None:
        self._add([STAGE, job, tenant, owner, list(sizes)])

    def chunk(self, job: bytes, index: int, offset: int, data: memoryview) -> None:
        self._add([CHUNK, job, index, offset, data])

    def unstage(self, job: bytes) -> None:
        self._add([UNSTAGE, job])

    def take(self) -> list[list[Any]]:
        """The updates journalled since the last ``take`` (the pair sends them as one UPDATES)."""
        updates, self.updates = self.updates, []
        return updates


class _NullJournal(Journal):
    """The journal of a broker with no peer to replicate to (standalone, or passive): keeps nothing."""

    def _add(self, update: list[Any]) -> None:
        pass

    def task(self, t: Task, now: float) -> None:
        pass

    def run(self, rid: bytes, worker: str, grant: Grant | None) -> None:
        pass

    def queued(self, t: Task) -> None:
        pass

    def done(self, rid: bytes, reply: list[Any]) -> None:
        pass

    def forget(self, rid: bytes) -> None:
        pass

    def session(self, s: Session) -> None:
        pass

    def end(self, sid: bytes) -> None:
        pass

    def marks(self, drained: set[str], cordoned: set[str]) -> None:
        pass

    def start(self, rid: bytes) -> None:
        pass

    def expired(self, rid: bytes, left: float, tenant: str) -> None:
        pass

    def stage(self, job: bytes, tenant: str, owner: str | None, sizes: tuple[int, ...]) -> None:
        pass

    def chunk(self, job: bytes, index: int, offset: int, data: memoryview) -> None:
        pass

    def unstage(self, job: bytes) -> None:
        pass


NULL_JOURNAL: Journal = _NullJournal()


# --------------------------------------------------------------------------- wire forms


def _fields(raw: Any, n: int, what: str) -> list[Any]:
    if type(raw) is not list or len(raw) != n:
        raise ProtocolError(f"a replicated {what} must be a list of {n} items")
    return raw


def grant_to_wire(grant: Grant | None) -> list[Any] | None:
    if grant is None:
        return None
    wire = [grant.worker, list(grant.gpus), grant.gpu_milli, grant.mem, grant.cpu_milli, grant.host_mem, grant.exclusive]
    return [*wire, grant.pool_tenant] if grant.pool_tenant else wire  # the eighth item is optional


def grant_from_wire(raw: Any) -> Grant | None:
    if raw is None:
        return None
    if type(raw) is not list or len(raw) not in (7, 8):
        raise ProtocolError("a replicated grant must be a list of 7 or 8 items")
    worker, gpus, milli, mem, cpu, host_mem, exclusive, *pool = raw
    return Grant(worker=worker, gpus=tuple(gpus), gpu_milli=milli, mem=mem, cpu_milli=cpu,
                 host_mem=host_mem, exclusive=bool(exclusive), pool_tenant=str(pool[0]) if pool else "")


def frames_bytes(frames: list[Any]) -> list[bytes]:
    """Frames (bytes or zmq.Frame) as bytes, for msgpack."""
    return [f if type(f) is bytes else protocol.as_bytes(f) for f in frames]


def task_to_wire(t: Task, now: float) -> list[Any]:
    return [
        t.id, t.kind, protocol.need_to_wire(t.need) if t.need is not None else None, t.body, frames_bytes(t.frames),
        now - t.created, t.deadline - now, t.tenant, t.retryable, t.attempts, sorted(t.avoid), t.session,
        t.state.value, t.worker, grant_to_wire(t.grant), frames_bytes(t.reply) if t.reply is not None else None,
        t.started, t.owner,
    ]


def task_from_wire(raw: Any, now: float) -> Task:
    if type(raw) is not list or len(raw) not in (16, 17, 18):
        raise ProtocolError("a replicated task must be a list of 16 to 18 items")
    (rid, kind, need, body, frames, age, left, tenant, retryable, attempts, avoid, session,
     state, worker, grant, reply) = raw[:16]
    owner = raw[17] if len(raw) > 17 else None
    if owner is not None and type(owner) is not str:
        raise ProtocolError("a replicated task's owner must be a string or nil")
    parsed = protocol.parse_need(kind, need) if need is not None else None
    return Task(
        id=rid, kind=kind, need=parsed, body=body, frames=frames, route=None,
        created=now - age, deadline=now + left, state=State(state),
        priority=parsed.priority if parsed is not None else 0, tenant=tenant, grant=grant_from_wire(grant),
        worker=worker, attempts=attempts, avoid=set(avoid), retryable=retryable, session=session, reply=reply,
        started=len(raw) > 16 and raw[16] is True, owner=owner,
    )


def session_to_wire(s: Session) -> list[Any]:
    return [s.id, s.worker, s.gpu, grant_to_wire(s.grant), s.tenant, s.closing]


def session_from_wire(raw: Any, now: float) -> Session:
    sid, worker, gpu, grant, tenant, closing = _fields(raw, 6, "session")
    granted = grant_from_wire(grant)
    if granted is None:
        raise ProtocolError("a replicated session must have a grant")
    return Session(id=sid, worker=worker, gpu=gpu, grant=granted, tenant=tenant, route=b"", last_seen=now,
                   closing=bool(closing), opened=now)


# --------------------------------------------------------------------------- a core's tables


def snapshot(core: BrokerCore) -> dict[str, Any]:
    """Everything a passive broker needs: every task the core knows, and every session."""
    now = core.now
    return {
        "tasks": [task_to_wire(t, now) for t in core.tasks.tasks.values()],
        "sessions": [session_to_wire(s) for s in core.sessions.values()],
        "marks": [sorted(core.registry.drained), sorted(core.registry.cordoned)],
        "expired": [[rid, until - now, tenant] for rid, (until, tenant) in core.tasks.expired.items()],
        "uploads": core.staging.to_wire(),
    }


def load(core: BrokerCore, snap: Any) -> None:
    """Replace the passive core's tables with a snapshot."""
    if type(snap) is not dict or type(snap.get("tasks")) is not list or type(snap.get("sessions")) is not list:
        raise ProtocolError("a snapshot must be a map with 'tasks' and 'sessions' lists")
    core.clear_work()
    now = core.now
    for raw in snap["tasks"]:
        t = task_from_wire(raw, now)
        core.tasks.add(t)
        if t.state is State.DONE and t.reply is not None:
            core.tasks.finish(t, t.reply, now)
    for raw in snap["sessions"]:
        s = session_from_wire(raw, now)
        core.sessions[s.id] = s
    drained, cordoned = _fields(snap.get("marks", [[], []]), 2, "set of marks")
    core.workers.set_marks(drained, cordoned)
    core.staging.load(core, snap.get("uploads", []))
    expired = snap.get("expired", [])
    if type(expired) is not list:
        raise ProtocolError("a snapshot's 'expired' must be a list")
    for raw in expired:
        _expire(core, raw)


def _expire(core: BrokerCore, raw: Any) -> None:
    """``[id, left, tenant]``: a reply the active broker dropped early; a retry gets RESULT_EXPIRED."""
    rid, left, tenant = _fields(raw, 3, "expired id")
    if type(rid) is not bytes or type(left) not in (int, float) or type(tenant) is not str:
        raise ProtocolError("a replicated expired id must be [id, seconds left, tenant]")
    core.tasks.mark_expired(rid, core.now + left, tenant)


def apply(core: BrokerCore, update: Any) -> None:
    """Apply one update to a passive core's tables."""
    if type(update) is not list or not update:
        raise ProtocolError("an update must be a non-empty list")
    tag = update[0]
    now = core.now
    tasks = core.tasks
    if tag == TASK:
        learnt = task_from_wire(_fields(update, 2, "task update")[1], now)
        tasks.add(learnt)
        if type(learnt.body) is dict and "staged" in learnt.body:
            core.staging.claim(learnt.id)
        return
    if tag == STAGE:
        _, job, tenant, owner, sizes = _fields(update, 5, "stage update")
        core.staging.apply_stage(core, job, tenant, owner, sizes)
        return
    if tag == CHUNK:
        _, job, index, offset, data = _fields(update, 5, "chunk update")
        core.staging.apply_chunk(core, job, index, offset, data)
        return
    if tag == UNSTAGE:
        core.staging.release(core, _fields(update, 2, "unstage update")[1])
        return
    if tag == SESSION:
        s = session_from_wire(_fields(update, 2, "session update")[1], now)
        core.sessions[s.id] = s
        return
    if tag == END:
        core.sessions.pop(_fields(update, 2, "end update")[1], None)
        return
    if tag == MARKS:
        _, drained, cordoned = _fields(update, 3, "marks update")
        core.workers.set_marks(drained, cordoned)
        return
    if tag == EXPIRED:
        _expire(core, update[1:])
        return
    if len(update) < 2:
        raise ProtocolError(f"update {tag!r} names no task")
    t = tasks.get(update[1])
    if tag == DONE:
        _, rid, reply = _fields(update, 3, "done update")
        if t is None:  # a result of work this broker never heard of (an orphan): keep it
            t = Task(id=rid, kind="echo", need=None, body={}, frames=[], route=None, created=now, deadline=now)
            tasks.add(t)
        tasks.finish(t, reply, now)
        core.staging.release(core, rid)
        return
    if t is None:
        log.debug("update %s for unknown task %s ignored", tag, protocol.id_text(update[1]))
        return
    if tag == RUN:
        _, _, worker, grant = _fields(update, 4, "run update")
        t.state, t.worker, t.grant, t.started = State.RUNNING, worker, grant_from_wire(grant), False
    elif tag == START:
        t.started = True
    elif tag == QUEUE:
        _, _, avoid = _fields(update, 3, "queue update")
        t.state, t.worker, t.grant, t.avoid, t.started = State.QUEUED, None, None, set(avoid), False
    elif tag == FORGET:
        tasks.forget(t)
        core.staging.release(core, t.id)
    else:
        raise ProtocolError(f"unknown update {tag!r}")
