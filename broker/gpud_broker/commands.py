"""The broker's admin commands (answered on its admin socket, used by ``gpudctl``)."""

from __future__ import annotations

from typing import Any

import gpud
from gpud.admin import Registry
from gpud.protocol import id_text
from gpud_broker.core import BrokerCore
from gpud_broker.tasks import State

ADMIN = Registry()


@ADMIN.command("status")
def status(core: BrokerCore, args: dict[str, Any]) -> dict[str, Any]:
    """The broker, its workers and every GPU with its live state and grants.

    Example: ``gpudctl --admin ipc:///run/gpud/admin.sock status --json``
    """
    now = core.now
    workers = []
    gpus = []
    running = 0
    for w in core.registry:
        running += len(w.assigned)
        workers.append(
            {
                "name": w.name,
                "hostname": w.hostname,
                "slots": w.slots,
                "inflight": w.inflight,
                "cpu_milli": w.cpu_milli,
                "host_mem": w.host_mem,
                "simulated": w.simulated,
                "last_heard_s": round(w.liveness.silence(now), 3),
                "running": [
                    {"id": r["id"].hex() if isinstance(r.get("id"), bytes) else str(r.get("id")),
                     "kind": str(r.get("kind", "")),
                     "since": float(r["since"]) if isinstance(r.get("since"), (int, float)) else 0.0}
                    for r in w.running
                ],
            }
        )
        for g in w.gpus:
            s = g.state
            gpus.append(
                {
                    "worker": w.name,
                    "uuid": g.uuid,
                    "index": g.info.index,
                    "model": g.info.model,
                    "mem": g.info.mem,
                    "cc": list(g.info.cc),
                    "simulated": g.info.simulated,
                    "util": s.util,
                    "mem_used": s.mem_used,
                    "temp": s.temp,
                    "power": s.power,
                    "health": "cordoned" if g.cordoned else s.health,
                    "granted_milli": g.granted_milli,
                    "granted_mem": g.granted_mem,
                    "tasks": g.tasks,
                }
            )
    return {
        "broker": {
            "name": core.config.name,
            "version": gpud.__version__,
            "uptime_s": round(now - core.started, 3),
            "role": "standalone",
            "policy": core.config.policy,
        },
        "counts": {
            "workers": len(workers),
            "gpus": len(gpus),
            "queued": len(core.queue),
            "running": running,
            "sessions": len(core.sessions),
            "done": core.tasks.finished_total,
        },
        "counters": dict(core.counters),
        "workers": workers,
        "gpus": gpus,
    }


@ADMIN.command("queue")
def queue(core: BrokerCore, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Queued requests in placement order: id, kind, tenant, priority, seconds waited."""
    return [
        {"id": id_text(t.id), "kind": t.kind, "tenant": t.tenant, "priority": t.priority,
         "waited_s": round(core.now - t.created, 3)}
        for t in core.queue.in_order()
        if t.state is State.QUEUED
    ]
