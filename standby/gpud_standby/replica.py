"""The replication stream's content: tasks, sessions and updates as msgpack-ready lists, and how a
passive broker applies them to its BrokerCore (PROTOCOL.md §9.3). Pure: no sockets.

Times travel as ages and remaining times (seconds), never as clock readings, so two brokers need
not share a clock. Routes (ROUTER identities of clients) do not travel: a client's retry after a
failover attaches to its task on the new broker.
"""

from __future__ import annotations

import logging
from typing import Any

from gpud import protocol as P
from gpud.resources import Grant
from gpud_broker.tasks import Session, State, Task

log = logging.getLogger(__name__)

# Update tags (the first item of each update).
TASK, RUN, QUEUE, DONE, FORGET, SESSION, END, MARKS = "task", "run", "queue", "done", "forget", "session", "end", "marks"


def grant_to_wire(g: Grant | None) -> list[Any] | None:
    if g is None:
        return None
    wire = [g.worker, list(g.gpus), g.gpu_milli, g.mem, g.cpu_milli, g.host_mem, g.exclusive]
    return [*wire, g.pool_tenant] if g.pool_tenant else wire


def grant_from_wire(raw: Any) -> Grant | None:
    if raw is None:
        return None
    worker, gpus, milli, mem, cpu, host_mem, exclusive, *pool = raw
    return Grant(worker=worker, gpus=tuple(gpus), gpu_milli=milli, mem=mem, cpu_milli=cpu,
                 host_mem=host_mem, exclusive=bool(exclusive), pool_tenant=str(pool[0]) if pool else "")


def frames_bytes(frames: list[Any]) -> list[bytes]:
    """Frames (bytes or zmq.Frame) as bytes, for msgpack."""
    return [f if type(f) is bytes else bytes(f) for f in frames]


def task_to_wire(t: Task, now: float) -> list[Any]:
    return [
        t.id, t.kind, P.need_to_wire(t.need) if t.need is not None else None, t.body, frames_bytes(t.frames),
        now - t.created, t.deadline - now, t.tenant, t.retryable, t.attempts, sorted(t.avoid), t.session,
        t.state.value, t.worker, grant_to_wire(t.grant), frames_bytes(t.reply) if t.reply is not None else None,
    ]


def task_from_wire(raw: list[Any], now: float) -> Task:
    (rid, kind, need, body, frames, age, left, tenant, retryable, attempts, avoid, session,
     state, worker, grant, reply) = raw
    parsed = P.parse_need(kind, need) if need is not None else None
    return Task(
        id=rid, kind=kind, need=parsed, body=body, frames=frames, route=None,
        created=now - age, deadline=now + left, state=State(state),
        priority=parsed.priority if parsed is not None else 0, tenant=tenant, grant=grant_from_wire(grant),
        worker=worker, attempts=attempts, avoid=set(avoid), retryable=retryable, session=session, reply=reply,
    )


def session_to_wire(s: Session) -> list[Any]:
    return [s.id, s.worker, s.gpu, grant_to_wire(s.grant), s.tenant, s.closing]


def session_from_wire(raw: list[Any], now: float) -> Session:
    sid, worker, gpu, grant, tenant, closing = raw
    g = grant_from_wire(grant)
    assert g is not None
    return Session(id=sid, worker=worker, gpu=gpu, grant=g, tenant=tenant, route=b"", last_seen=now,
                   closing=bool(closing), opened=now)


def snapshot(core: Any) -> dict[str, Any]:
    """Everything a passive broker needs: every task the core knows, and every session."""
    now = core.now
    return {
        "tasks": [task_to_wire(t, now) for t in core.tasks.tasks.values()],
        "sessions": [session_to_wire(s) for s in core.sessions.values()],
        "marks": [sorted(core.registry.drained), sorted(core.registry.cordoned)],
    }


def load(core: Any, snap: dict[str, Any]) -> None:
    """Replace the passive core's tables with a snapshot."""
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
    core.set_marks(*snap.get("marks", ([], [])))


def apply(core: Any, update: list[Any]) -> None:
    """Apply one update to a passive core's tables."""
    tag = update[0]
    now = core.now
    tasks = core.tasks
    if tag == TASK:
        tasks.add(task_from_wire(update[1], now))
        return
    if tag == SESSION:
        s = session_from_wire(update[1], now)
        core.sessions[s.id] = s
        return
    if tag == END:
        core.sessions.pop(update[1], None)
        return
    if tag == MARKS:
        core.set_marks(update[1], update[2])
        return
    t = tasks.get(update[1])
    if tag == DONE:
        if t is None:  # a result of work this broker never heard of (an orphan): keep it
            t = Task(id=update[1], kind="echo", need=None, body={}, frames=[], route=None, created=now, deadline=now)
            tasks.add(t)
        tasks.finish(t, update[2], now)
        return
    if t is None:
        log.debug("update %s for unknown task %s ignored", tag, P.id_text(update[1]))
        return
    if tag == RUN:
        t.state, t.worker, t.grant = State.RUNNING, update[2], grant_from_wire(update[3])
    elif tag == QUEUE:
        t.state, t.worker, t.grant, t.avoid = State.QUEUED, None, None, set(update[2])
    elif tag == FORGET:
        tasks.forget(t)
    else:
        raise ValueError(f"unknown update {tag!r}")
