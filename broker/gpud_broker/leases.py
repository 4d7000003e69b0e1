"""Session leases: the device sessions open on workers, by id, and what keeps each one open.

A session is held while its client is heard (any CALL, or a PING naming it) within the lease and
while its worker's heartbeats still list it; a session a worker's heartbeat lists that is not held
here (``strays``) is the worker's to close. The sessions lost recently are remembered with the
worker they were lost with, so that the session opened to replace one goes to that worker's
replica first. Pure: the caller passes the time and ends what is found here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpud.protocol import ID_BYTES
from gpud_broker.registry import WorkerRegistry
from gpud_broker.tasks import Session, State, Task

SWEEP_S = 1.0  # how often sessions are checked against their workers' heartbeats
MAX_LOST = 10_000  # lost sessions remembered at most (then forgotten all at once)
MAX_PING_SESSIONS = 10_000  # session ids one PING may name


class SessionLeases:
    """Open sessions by id, and the ones lost recently (session id -> the worker it was lost with)."""

    def __init__(self, lease: float) -> None:
        self.lease = lease  # seconds without hearing from a session's client
        self.sessions: dict[bytes, Session] = {}
        self.lost: dict[bytes, str] = {}
        self._sweep_at = 0.0  # next look for sessions their workers no longer list

    def clear(self) -> None:
        self.sessions.clear()

    def heard(self, sids: Any, tenant: str | None, now: float) -> None:
        """A PING named ``sids`` (unchecked wire input): renew the leases of those its sender holds
        (``tenant`` None: no scoping)."""
        if type(sids) is not list:
            return
        sessions = self.sessions
        for sid in sids[:MAX_PING_SESSIONS]:
            s = sessions.get(sid) if type(sid) is bytes else None
            if s is not None and (tenant is None or s.tenant == tenant):
                s.last_seen = now

    def lapsed(self, now: float) -> list[Session]:
        """Sessions not closing whose client has been silent past the lease."""
        lease = self.lease
        return [s for s in self.sessions.values() if not s.closing and now - s.last_seen > lease]

    def on_worker(self, name: str) -> list[bytes]:
        """The ids of the sessions open on worker ``name``."""
        return [sid for sid, s in self.sessions.items() if s.worker == name]

    def gone(self, registry: WorkerRegistry, now: float) -> list[Session]:
        """Once per ``SWEEP_S``: the sessions their workers' last heartbeat no longer lists (the
        worker closed them: a GPU fault, its idle timeout). A session opened after that heartbeat
        was sent is not judged: the worker lists a session before it answers its opening, and on
        the same connection."""
        if not self.sessions or now < self._sweep_at:
            return []
        self._sweep_at = now + SWEEP_S
        listed: dict[str, set[Any]] = {}
        out = []
        for s in self.sessions.values():
            w = registry.by_name.get(s.worker)
            if w is None or s.closing or s.opened >= w.running_at:
                continue
            ids = listed.get(w.name)
            if ids is None:
                ids = listed[w.name] = {r.get("id") for r in w.running if r.get("kind") == "session"}
            if s.id not in ids:
                out.append(s)
        return out

    def strays(self, worker: str, running: list[dict[str, Any]], tasks: Mapping[bytes, Task]) -> list[tuple[bytes, str]]:
        """The sessions that ``worker``'s heartbeat lists (``running``, unchecked wire input) and
        that are not held open here on that worker, each with the tenant the worker names for it
        ("default" when none): ended by this broker (the worker was lost and came back) or never
        known to it. A session whose opening REQUEST still runs there is not one (PROTOCOL.md §9.4)."""
        out: dict[bytes, str] = {}
        sessions = self.sessions
        for r in running:
            sid = r.get("id")
            if r.get("kind") != "session" or type(sid) is not bytes or len(sid) != ID_BYTES or sid in out:
                continue
            s = sessions.get(sid)
            if s is not None and s.worker == worker:
                continue
            t = tasks.get(sid)
            if t is not None and t.kind == "session" and t.state is State.RUNNING and t.worker == worker:
                continue
            tenant = r.get("tenant")
            out[sid] = tenant if type(tenant) is str and 0 < len(tenant) <= 64 else "default"
        return list(out.items())

    def forget_lost(self) -> None:
        if len(self.lost) > MAX_LOST:
            self.lost.clear()
