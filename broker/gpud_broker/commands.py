"""The broker's admin commands (answered on its admin socket, used by ``gpudctl``).

Each handler implements one entry of ``gpud.admin_commands.COMMANDS``, which holds its docstring
(the help) and argument schema: ``ADMIN.dispatch`` has checked the arguments before a handler runs,
and ``ADMIN.verify()`` below refuses to import a broker whose commands differ from the table.

Handlers get the ``Broker`` (the socket shell) as their target and work on its ``BrokerCore``; a
bare ``BrokerCore`` works as a target too. The broker runs them on its single loop thread, between
two messages, so a command never sees the core half-way through an event; commands that change
state are in addition serialized and logged with who asked by the registry.
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict
from typing import Any

import gpud
from gpud.admin import Registry
from gpud.admin_commands import COMMANDS
from gpud.errors import ConflictError, InternalError, InvalidRequest
from gpud.resources import Need
from gpud_broker.core import BrokerCore
from gpud_broker.policies import balanced, could_ever_fit
from gpud_broker.queue import WaitFacts, why_waiting
from gpud_broker.registry import GpuRecord, WorkerRecord
from gpud_broker.tasks import State, Task

ADMIN = Registry(COMMANDS)

MIN_ID_PREFIX = 8  # hex digits of a request id that ``cancel`` accepts as a prefix
_HEX_RE = re.compile(r"[0-9a-f]{1,32}\Z")


def _core(target: Any) -> BrokerCore:
    core = getattr(target, "core", target)
    if not isinstance(core, BrokerCore):
        raise InternalError(f"admin command target {type(target).__name__} has no broker core")
    return core


def _gpu_name(g: GpuRecord) -> str:
    return f"{g.worker.name}/{g.info.index}"


def _gpu_work(core: BrokerCore) -> dict[str, dict[str, int]]:
    """Running work by GPU uuid: how many requests of each kind hold a grant there (open sessions
    count as ``session``)."""
    work: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for w in core.registry:
        for t in w.assigned.values():
            if t.state is State.RUNNING and t.grant is not None:
                for uuid in t.grant.gpus:
                    work[uuid][t.kind] += 1
    for s in core.sessions.values():
        work[s.gpu]["session"] += 1
    return work


def _gpu_row(gpu: GpuRecord, work: dict[str, dict[str, int]]) -> dict[str, Any]:
    state = gpu.state
    return {
        "worker": gpu.worker.name,
        "name": _gpu_name(gpu),
        "uuid": gpu.uuid,
        "index": gpu.info.index,
        "model": gpu.info.model,
        "mem": gpu.info.mem,
        "cc": list(gpu.info.cc),
        "simulated": gpu.info.simulated,
        "util": state.util,
        "mem_used": state.mem_used,
        "temp": state.temp,
        "power": state.power,
        "health": "cordoned" if gpu.cordoned else state.health,
        "measured_health": state.health,
        "health_reason": state.health_reason,  # why the worker counts it failed; empty when ok
        "probation_left_s": state.probation_left_s,  # failed, passing its checks: seconds until it serves
        "cordoned": gpu.cordoned,
        "granted_milli": gpu.granted_milli,
        "granted_mem": gpu.granted_mem,
        "tasks": gpu.tasks,
        "work": dict(work.get(gpu.uuid, {})),
    }


def _grace_window(core: BrokerCore, w: WorkerRecord) -> float:
    """Seconds a suspended worker has, from its suspension, to be heard again before it is lost."""
    return core.config.worker_resume_periods * w.liveness.policy.expiry


def _worker_row(core: BrokerCore, w: WorkerRecord) -> dict[str, Any]:
    now = core.now
    return {
        "name": w.name,
        "hostname": w.hostname,
        "gpus": len(w.gpus),
        "slots": w.slots,
        "inflight": w.inflight,
        "cpu_milli": w.cpu_milli,
        "host_mem": w.host_mem,
        "simulated": w.simulated,
        "draining": w.draining,
        # Silent past its liveness and not yet lost (PROTOCOL.md §4.2): the seconds left of its grace window.
        "suspended": bool(w.suspended_at),
        "grace_left_s": round(max(0.0, w.suspended_at + _grace_window(core, w) - now), 3) if w.suspended_at else None,
        "replica_of": w.replica_of or None,
        "isolation": w.isolation or None,
        "job_network": w.job_network or None,
        "pool_users": w.pool_users,
        "pool_free": max(0, w.pool_users - sum(w.pool_held.values())) if w.pool_users else None,
        "held_outputs": w.held_outputs,  # staged outputs it holds until fetched (PROTOCOL.md §11.5)
        "connected_s": round(now - w.connected_at, 3),
        "last_heard_s": round(w.liveness.silence(now), 3),
        "running": [
            {"id": r["id"].hex() if isinstance(r.get("id"), bytes) else str(r.get("id")),
             "kind": str(r.get("kind", "")),
             "since": float(r["since"]) if isinstance(r.get("since"), (int, float)) else 0.0}
            for r in w.running
        ],
    }


@ADMIN.command("status")
def status(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core = _core(target)
    now = core.now
    work = _gpu_work(core)
    worker_rows: list[dict[str, Any]] = []
    gpu_rows: list[dict[str, Any]] = []
    running = 0
    for w in core.registry:
        running += len(w.assigned)
        worker_rows.append(_worker_row(core, w))
        gpu_rows.extend(_gpu_row(gpu, work) for gpu in w.gpus)
    pair = getattr(target, "pair", None)
    return {
        "broker": {
            "name": core.config.name,
            "version": gpud.__version__,
            "uptime_s": round(now - core.started, 3),
            "role": pair.cfg.role if pair is not None else "standalone",
            "state": pair.state.value if pair is not None else "active",
            "epoch": core.epoch,
            "peer": pair.cfg.peer if pair is not None else None,
            "policy": core.config.policy,
        },
        "pair": pair.status(now) if pair is not None else None,
        "counts": {
            "workers": len(worker_rows),
            "gpus": len(gpu_rows),
            "queued": len(core.queue),
            "running": running,
            "sessions": len(core.sessions),
            "done": core.tasks.finished_total,
        },
        "counters": dict(core.counters),
        # What the broker holds for each tenant at most (and for all), and what it holds now.
        "budgets": {**core.accounts.budgets.shown(), "held_bytes": core.accounts.held_bytes,
                    "reply_store": {"max_bytes": core.tasks.max_bytes, "bytes": core.tasks.bytes,
                                    "dropped_early": core.tasks.dropped_early},
                    "load": {t: {"outstanding": v.outstanding, "bytes": v.bytes} for t, v in sorted(core.accounts.load.items())}},
        # Frontend connections against their bounds (the socket shell's gate; None without one).
        "connections": target.gate.shown(now) if hasattr(target, "gate") else None,
        # Echo bytes in flight against each sender's share, and messages waiting behind them (the shell's).
        "intake": target.intake.shown() if hasattr(target, "intake") else None,
        # Staged job inputs (PROTOCOL.md §11): uploads held, bytes reserved and written, in memory.
        "spool": {"uploads": len(core.staging.spool), "reserved": core.staging.spool.reserved,
                  "stored": core.staging.spool.stored, "ram": core.staging.spool.ram_used,
                  "room": core.staging.spool.room(), "peer_room": core.staging.peer_room},
        # How long placement decisions take: count and max since start, p50/p99 of recent ones.
        "placement": core.dispatcher.placement_times.summary(),
        "workers": worker_rows,
        "gpus": gpu_rows,
    }


@ADMIN.command("workers")
def workers(target: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    core = _core(target)
    return [_worker_row(core, w) for w in sorted(core.registry, key=lambda w: w.name)]


def _worker(core: BrokerCore, name: str) -> WorkerRecord:
    w = core.registry.by_name.get(name)
    if w is None:
        known = ", ".join(sorted(core.registry.by_name)) or "none"
        raise InvalidRequest(f"no connected worker named {name!r} (connected: {known})")
    return w


@ADMIN.command("gpus")
def gpus(target: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    core = _core(target)
    chosen = [_worker(core, args["worker"])] if args["worker"] is not None else core.registry
    work = _gpu_work(core)
    rows = [_gpu_row(g, work) for w in chosen for g in w.gpus]
    return sorted(rows, key=lambda r: (r["worker"], r["index"]))


def _needs(need: Need | None) -> dict[str, Any]:
    """What a request asks for, as ``gpudctl queue`` shows it."""
    if need is None:
        return {}
    out: dict[str, Any] = {"gpus": need.gpus} if need.gpus else {"gpu_milli": need.gpu_milli}
    for key in ("mem", "cpu_milli", "host_mem"):
        if getattr(need, key):
            out[key] = getattr(need, key)
    if need.models:
        out["models"] = sorted(need.models)
    if need.min_cc:
        out["min_cc"] = list(need.min_cc)
    if need.exclusive:
        out["exclusive"] = True
    return out


def _wait_facts(core: BrokerCore, t: Task, ahead: list[tuple[float, str]], reserved: dict[str, Task]) -> WaitFacts:
    """What decides whether ``t`` is placed now (``ahead``: effective priority and tenant of each
    entry before it in placement order). Whether it fits is asked of the balanced policy, which
    places wherever any policy could (feasibility does not depend on the policy)."""
    need = t.need
    held = ("it is passive, or settling after a takeover" if core.hold
            else "no connected worker has a free slot" if core.dispatcher.open_workers <= 0 else None)
    effective = core.queue.effective_priority(t, core.now)
    workers = list(core.registry.by_identity.values())
    others = {name for name, holder in reserved.items() if holder is not t}
    fits_now = need is not None and balanced(need, workers, t.avoid) is not None
    return WaitFacts(
        held=held,
        within_limits=need is None or core.accounts.within_limits(t.tenant, need, t.kind == "session"),
        ever_fits=need is not None and could_ever_fit(need, workers),
        fits_now=fits_now,
        fits_unreserved=fits_now and need is not None and balanced(need, workers, t.avoid | others) is not None,
        ahead_higher=sum(1 for p, _ in ahead if p > effective),
        ahead_same=sum(1 for p, tenant in ahead if p == effective and tenant != t.tenant),
        reserved=t.reserved,
    )


@ADMIN.command("queue")
def queue(target: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    core = _core(target)
    rows = []
    ahead: list[tuple[float, str]] = []
    reserved = core.queue.reservations
    for t in core.queue.in_order(core.now):
        if t.state is not State.QUEUED:
            continue
        code, why = why_waiting(_wait_facts(core, t, ahead, reserved))
        rows.append({"id": t.id.hex(), "kind": t.kind, "tenant": t.tenant, "priority": t.priority,
                     "waited_s": round(core.now - t.created, 3), "needs": _needs(t.need),
                     "reserved": t.reserved, "wait": code, "why": why})
        ahead.append((core.queue.effective_priority(t, core.now), t.tenant))
    return rows


def _task_row(core: BrokerCore, t: Task) -> dict[str, Any]:
    g = t.grant
    return {
        "id": t.id.hex(),
        "state": t.state.value,
        "kind": t.kind,
        "tenant": t.tenant,
        "priority": t.priority,
        "worker": t.worker,
        "gpus": list(g.gpus) if g is not None else [],
        "gpu_names": [_gpu_name(core.registry.gpus[u]) if u in core.registry.gpus else u for u in g.gpus] if g is not None else [],
        "gpu_milli": g.gpu_milli if g is not None else 0,
        "mem": g.mem if g is not None else 0,
        "age_s": round(core.now - t.created, 3),
        "running_s": round(core.now - t.dispatched_at, 3) if t.state is State.RUNNING else None,
        "attempts": t.attempts,
        "started": t.started,  # it may have begun (PROTOCOL.md §4.4): never placed again
        "session": t.session.hex() if t.session is not None else None,
    }


@ADMIN.command("tasks")
def tasks(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core = _core(target)
    tenant, state, kind, worker = args["tenant"], args["state"], args["kind"], args["worker"]
    matched = [
        t for t in core.tasks.tasks.values()
        if (tenant is None or t.tenant == tenant)
        and (state is None or t.state.value == state)
        and (kind is None or t.kind == kind)
        and (worker is None or t.worker == worker)
    ]
    newest = heapq.nlargest(args["limit"], matched, key=lambda t: t.created)
    return {"matched": len(matched), "tasks": [_task_row(core, t) for t in newest]}


@ADMIN.command("sessions")
def sessions(target: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    core = _core(target)
    now = core.now
    rows = []
    for s in core.sessions.values():
        if (args["tenant"] is not None and s.tenant != args["tenant"]) or (
            args["worker"] is not None and s.worker != args["worker"]
        ):
            continue
        g = core.registry.gpus.get(s.gpu)
        rows.append({
            "id": s.id.hex(),
            "tenant": s.tenant,
            "worker": s.worker,
            "gpu": s.gpu,
            "gpu_name": _gpu_name(g) if g is not None else s.gpu,
            "gpu_milli": s.grant.gpu_milli,
            "mem": s.grant.mem,
            "age_s": round(now - s.opened, 3),
            "last_seen_s": round(now - s.last_seen, 3),
            "closing": s.closing,
        })
    return sorted(rows, key=lambda r: -r["age_s"])


# ---------------------------------------------------------------------- commands that change state


@ADMIN.command("drain")
def drain(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core = _active_core(target)
    w = _worker(core, args["worker"])
    was = w.draining
    core.workers.mark_drained(w.name, True)
    n = len(w.assigned)
    if was:
        message = f"worker {w.name} was already draining; {n} request(s) still running there"
    else:
        message = f"worker {w.name} drained: no new work goes there; {n} running request(s) finish"
    return {"worker": w.name, "draining": True, "running": n, "message": message}


@ADMIN.command("undrain")
def undrain(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core = _active_core(target)
    name = args["worker"]
    if name not in core.registry.by_name and name in core.registry.drained:
        core.workers.mark_drained(name, False)
        return {"worker": name, "draining": False, "placed": 0,
                "message": f"worker {name} is not connected; it takes work when it connects"}
    _worker(core, name)
    core.workers.mark_drained(name, False)
    placed = core.dispatcher.place_queued()
    return {"worker": name, "draining": False, "placed": placed,
            "message": f"worker {name} takes new work again; {placed} queued request(s) placed"}


def _active_core(target: Any) -> BrokerCore:
    """The core, for a command that changes state: only the active broker of a pair takes them
    (the passive one's tables are the active one's copy)."""
    core = _core(target)
    if not core.active:
        raise ConflictError("this broker is the passive one of its pair: send this to the active broker")
    return core


def _gpu(core: BrokerCore, text: str) -> GpuRecord:
    g = core.registry.gpus.get(text)
    if g is None and "/" in text:
        worker, _, index = text.rpartition("/")
        w = core.registry.by_name.get(worker)
        if w is not None and index.isdigit():
            g = next((x for x in w.gpus if x.info.index == int(index)), None)
    if g is None:
        raise InvalidRequest(f"no connected GPU {text!r}: give a uuid or WORKER/INDEX (see gpudctl gpus)")
    return g


def _set_cordoned(target: Any, args: dict[str, Any], cordoned: bool) -> tuple[BrokerCore, GpuRecord]:
    """Mark (or unmark) the GPU ``args`` names as cordoned, on its record and in the replicated
    marks; the core and the GPU, for the answer."""
    core = _active_core(target)
    g = _gpu(core, args["gpu"])
    g.cordoned = cordoned
    if cordoned:
        core.registry.cordoned.add(g.uuid)
    else:
        core.registry.cordoned.discard(g.uuid)
    core.workers.marks_changed()
    return core, g


@ADMIN.command("cordon")
def cordon(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    _, g = _set_cordoned(target, args, True)
    return {"gpu": g.uuid, "name": _gpu_name(g), "cordoned": True, "grants": g.tasks,
            "message": f"GPU {_gpu_name(g)} ({g.uuid}) cordoned: no new work; {g.tasks} grant(s) run on"}


@ADMIN.command("uncordon")
def uncordon(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core, g = _set_cordoned(target, args, False)
    placed = core.dispatcher.place_queued()
    return {"gpu": g.uuid, "name": _gpu_name(g), "cordoned": False, "placed": placed,
            "message": f"GPU {_gpu_name(g)} ({g.uuid}) takes new work again; {placed} queued request(s) placed"}


def _find_task(core: BrokerCore, text: str) -> Task:
    wanted = text.strip().lower()
    if not _HEX_RE.match(wanted) or len(wanted) < MIN_ID_PREFIX:
        raise InvalidRequest(f"cancel: {text!r} is not a request id (hex, at least {MIN_ID_PREFIX} digits)")
    if len(wanted) == 32:
        task = core.tasks.tasks.get(bytes.fromhex(wanted))
        found = [task] if task is not None else []
    else:
        found = [t for rid, t in core.tasks.tasks.items() if rid.hex().startswith(wanted)]
    if not found:
        raise InvalidRequest(f"no request with id {wanted} (finished requests are forgotten after the result TTL)")
    if len(found) > 1:
        raise InvalidRequest(f"{len(found)} requests have ids starting {wanted}; give more digits")
    return found[0]


@ADMIN.command("cancel")
def cancel(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    core = _active_core(target)
    task = _find_task(core, args["id"])
    rid = task.id.hex()
    if task.state is State.RUNNING:
        raise ConflictError(
            f"request {rid} ({task.kind}) is running on worker {task.worker}: running work cannot be "
            "cancelled yet; it runs until it finishes or reaches its time limit"
        )
    if task.state is State.DONE:
        raise ConflictError(f"request {rid} ({task.kind}) has already finished")
    if not core.cancel(task.id, "cancelled by an administrator"):
        raise ConflictError(f"request {rid} is being placed and could not be cancelled; try again")
    return {"id": rid, "cancelled": True, "kind": task.kind, "tenant": task.tenant,
            "message": f"request {rid} ({task.kind}, tenant {task.tenant}) cancelled; its client gets CANCELLED"}


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as msgpack-safe plain data (a hook may return anything)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if depth < 8 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, depth + 1) for v in value]
    return str(value)


@ADMIN.command("failover")
def failover(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    hook = getattr(target, "failover", None)
    if not callable(hook):
        raise ConflictError("this broker has no peer (standalone)")
    result = _plain(hook())
    return {"failover": True, "result": result, "message": "the active role goes to the peer"}


@ADMIN.command("reload")
def reload(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    hook = getattr(target, "reload", None)
    if not callable(hook):
        return {"reloaded": False, "result": None,
                "message": "this broker reads no configuration file: nothing to re-read"}
    result = _plain(hook())
    changed = result.get("changed") if isinstance(result, dict) else None
    if isinstance(changed, list):
        message = f"configuration re-read; changed: {', '.join(map(str, changed)) or 'nothing'}"
    else:
        message = "configuration re-read"
    return {"reloaded": True, "result": result, "message": message}


# openstack ------------------------------------------------------------------------------------------


@ADMIN.command("openstack")
def openstack(target: Any, args: dict[str, Any]) -> dict[str, Any]:
    controller = getattr(target, "openstack", None)
    if controller is None:
        raise ConflictError("OpenStack is not enabled on this broker: set [openstack] enabled = true and "
                            "restart it (docs/OPERATIONS.md, OpenStack)")
    result: dict[str, Any] = controller.admin(_core(target), args)
    return result


ADMIN.verify()
