"""The broker's part in the direct data path (docs/PROTOCOL.md §10): what a session's DISPATCH
tells its worker about the direct path, which relayed CALLs ``data_path`` refuses, and the session leases that the worker's heartbeats
renew while its client calls the worker directly. Pure: no sockets, the caller passes the time.
"""

from __future__ import annotations

from typing import Any

from gpud_broker.tasks import Session

DATA_PATHS = ("auto", "direct", "broker")


def session_body(data_path: str, client_key: str) -> dict[str, Any]:
    """The kind-specific fields of a session's DISPATCH: whether the worker may offer the direct
    path, whether the broker relays its CALLs too (not under ``direct``) and, under CURVE, the
    only client key the worker may admit there (the authenticated key of the REQUEST's
    connection, never a field the client wrote)."""
    if data_path == "broker":
        return {"direct": False}
    body: dict[str, Any] = {"direct": True}
    if data_path == "direct":
        body["relay"] = False
    if client_key:
        body["client_key"] = client_key
    return body


RELAY_REFUSED = ("this broker's data_path is direct: a session's CALLs go straight to its worker's data "
                 "socket (PROTOCOL.md §10); only close comes through the broker")


def refuses_relay(data_path: str, op: str) -> bool:
    """Whether a relayed CALL of ``op`` is refused (INVALID_REQUEST ``RELAY_REFUSED``): under
    ``direct``, every one but ``close``, which ends the session here."""
    return data_path == "direct" and op != "close"


def renew_leases(sessions: dict[bytes, Session], worker: str, running: list[dict[str, Any]], now: float) -> None:
    """A HEARTBEAT of ``worker`` listed ``running`` (unchecked wire input): the sessions it holds
    that were used ``idle`` seconds ago count as heard from their client then."""
    for r in running:
        idle, sid = r.get("idle"), r.get("id")
        if r.get("kind") != "session" or type(sid) is not bytes or not isinstance(idle, (int, float)):
            continue
        if not 0 <= idle < 1e9:  # NaN fails this too
            continue
        s = sessions.get(sid)
        used = now - float(idle)
        if s is not None and s.worker == worker and used > s.last_seen:
            s.last_seen = used


def silent_worker(sessions: dict[bytes, Session], replaces: Any, tenant: str | None) -> str | None:
    """The worker of the session that a session REQUEST ``replaces`` (unchecked wire input) when
    this broker still holds it open: its client found it silent on the direct path before the
    broker found the worker lost. The replacement goes to that worker's replica first (not away
    from it: the worker may be alive, only its data endpoint out of reach). None for a session
    this broker does not hold, or another tenant's."""
    old = sessions.get(replaces) if type(replaces) is bytes else None
    if old is None or (tenant is not None and old.tenant != tenant):
        return None
    return old.worker
