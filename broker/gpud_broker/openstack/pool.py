"""The pool of GPU VMs: what Nova lists matched to the workers the broker knows, the actions on
them (boot, reboot, replace, retire) as step machines, and the healing and scaling rules.

Pure: no I/O and no clock of its own. The caller (``controller``) passes the time, a ``Snapshot``
of the broker's workers and queue, and the ``Result`` of every ``Op`` this module asked for; it
carries the Nova ops out on its threads and applies the broker ops (drain) on the broker's loop.

Rules:

- One action at a time per server (and so per worker): a second one, asked by ``gpudctl`` or by a
  rule, is refused or waits.
- Heal (``heal``): a server listed as ERROR or SHUTOFF whose worker has been gone ``heal_after``
  seconds (since it was last connected, or since the server was first listed) is hard-rebooted; if
  its worker is not back ``reboot_timeout`` seconds later, the server is deleted and a new one
  booted (delete first: a dead GPU VM still holds its passthrough GPUs and its quota).
- Scale (``scale``): below ``min_workers`` servers, one is booted; a queue that stayed backlogged
  ``grow_after`` seconds boots one more server, up to ``max_workers``; a worker idle ``shrink_after``
  seconds, with nothing queued, is retired while more than ``min_workers`` remain. One boot and one
  retire at a time.
- ``gpudctl openstack boot`` is bounded by ``max_workers`` too; ``replace`` of a connected worker
  boots the new server first and retires the old one once the new worker is connected.
- A boot fails when its server goes to ERROR, stays in BUILD, or has no connected worker after
  ``boot_timeout`` seconds; a server that went to ERROR or stayed in BUILD is deleted.
- Retire drains the worker (no new work), waits until it runs nothing (at most
  ``retire_timeout`` seconds), then deletes its server.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpud.errors import ConflictError, InvalidRequest

log = logging.getLogger(__name__)

DEAD = ("ERROR", "SHUTOFF")  # statuses that healing reboots
GONE = ("DELETED", "SOFT_DELETED")  # listed, but not part of the pool any more
HISTORY = 200  # finished actions kept for ``gpudctl openstack actions``
ACTION_POLL_S = 5.0  # seconds between server lists while actions run (poll_interval when less)
MAX_BOOT = 100  # servers one ``gpudctl openstack boot`` asks for at most


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The ``[openstack]`` keys the decisions use (``gpud.config.OpenStackConfig``)."""

    name_prefix: str = "gpud-worker"
    min_workers: int = 0
    max_workers: int = 0
    heal: bool = False
    heal_after: float = 120.0
    reboot_timeout: float = 300.0
    scale: bool = False
    grow_after: float = 300.0
    shrink_after: float = 1800.0
    boot_timeout: float = 900.0
    retire_timeout: float = 600.0
    poll_interval: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any) -> PoolConfig:
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """One Nova server as listed (only servers recognised as gpud workers are kept)."""

    id: str
    name: str
    status: str
    task_state: str = ""
    host: str = ""  # its compute host, where the cloud shows it (admins)
    addresses: tuple[str, ...] = ()
    flavor: str = ""
    pci_alias: str = ""  # the flavor's pci_passthrough:alias, e.g. "a100:1"
    vgpu: str = ""  # the flavor's vGPU resources, e.g. "VGPU=1"
    fault: str = ""  # why it is in ERROR
    created: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()

    def row(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "status": self.status, "task_state": self.task_state,
                "host": self.host, "addresses": list(self.addresses), "flavor": self.flavor,
                "pci_alias": self.pci_alias, "vgpu": self.vgpu, "fault": self.fault, "created": self.created}


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One connected worker as the pool sees it."""

    name: str
    instance_id: str = ""  # its Nova server id ("" if it reported none)
    busy: bool = False  # running work or holding sessions
    draining: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The broker's side at one moment: connected workers, and how many requests wait."""

    workers: tuple[WorkerView, ...] = ()
    queued: int = 0


@dataclass(frozen=True, slots=True)
class Op:
    """Something the pool asks for. Nova ops (``list``, ``boot``, ``reboot``, ``delete``) run on
    the controller's threads and come back as a ``Result``; broker ops (``drain``, ``forget``: drop
    a retired worker's drain mark) are applied on the broker's loop and have none."""

    kind: str
    action: int = 0  # the action it belongs to (0: the periodic server list)
    server_id: str = ""
    name: str = ""  # boot: the new server's name; delete: the server's name; drain, forget: the worker
    issued: float = 0.0


NOVA_OPS = ("list", "boot", "reboot", "delete")


@dataclass(frozen=True, slots=True)
class Result:
    """How a Nova op ended. ``kind`` names the error (``nova.NovaError.kind``) when not ``ok``."""

    op: Op
    ok: bool
    server: ServerInfo | None = None  # boot
    servers: tuple[ServerInfo, ...] = ()  # list
    error: str = ""
    kind: str = ""


# Steps of each action, in order. A step waits for its op's result, for Nova's list, or for the
# broker's snapshot; ``_advance`` moves on.
STEPS = {
    "boot": ("create", "build", "join"),
    "reboot": ("reboot", "return"),
    "replace-live": ("create", "build", "join", "drain", "settle", "delete", "gone"),
    "replace-dead": ("delete", "gone", "create", "build", "join"),
    "retire": ("drain", "settle", "delete", "gone"),
}


@dataclass(slots=True, eq=False)
class Action:
    """One action on the pool, from its start to done or failed."""

    id: int
    kind: str  # boot, reboot, replace, retire
    reason: str
    started: float
    steps: tuple[str, ...]
    server_id: str = ""  # the server acted on (reboot, replace: the old one, retire)
    server_name: str = ""
    worker: str = ""  # its worker, when it has one
    new_id: str = ""  # boot, replace: the server booted
    new_name: str = ""
    index: int = 0
    step_since: float = 0.0
    boot_since: float = 0.0  # when its create step began (boot_timeout counts from there)
    waiting: bool = False  # an op of it is in flight
    finished: float | None = None
    outcome: str = "running"  # running, done, failed
    message: str = ""

    @property
    def step(self) -> str:
        return self.steps[self.index] if self.outcome == "running" else self.outcome

    @property
    def key(self) -> str:
        """What it holds: its server (one action per server at a time)."""
        return self.server_id or f"new:{self.new_name}"

    def row(self, now: float) -> dict[str, Any]:
        end = self.finished if self.finished is not None else now
        return {"id": self.id, "kind": self.kind, "reason": self.reason, "step": self.step,
                "outcome": self.outcome, "message": self.message, "worker": self.worker,
                "server_id": self.server_id, "server_name": self.server_name, "new_server_id": self.new_id,
                "new_server_name": self.new_name, "age_s": round(now - self.started, 3),
                "took_s": round(end - self.started, 3)}


class Pool:
    """The decisions. Call ``step`` every so often and ``on_result`` for every Nova op's result;
    ``boot``, ``replace`` and ``retire`` are ``gpudctl``'s (they raise ConflictError or
    InvalidRequest with the reason when refused). All methods return the ops to carry out."""

    def __init__(self, config: PoolConfig, *, boot_problem: str = "", rng: random.Random | None = None) -> None:
        self.config = config
        self.boot_problem = boot_problem  # why no server can be booted ("" : none)
        self.rng = rng or random.Random()
        self.servers: dict[str, ServerInfo] = {}
        self.listed_at: float | None = None  # when the last good list was asked for
        self.list_error = ""  # why the last list failed
        self.list_pending = False
        self.next_list = 0.0
        self.first_listed: dict[str, float] = {}  # server id -> when it was first listed
        self.last_seen: dict[str, float] = {}  # server id -> when a worker of it was last connected
        self.idle_since: dict[str, float] = {}  # worker name -> since when it runs nothing
        self.backlog_since: float | None = None
        self.active: dict[int, Action] = {}
        self.history: deque[Action] = deque(maxlen=HISTORY)
        self._ids = 0
        self._cleanups: dict[int, Action] = {}  # failed actions deleting the server they booted
        self._boot_problem_logged = False

    # ------------------------------------------------------------------ the periodic step

    def step(self, now: float, snap: Snapshot) -> list[Op]:
        """Observe the broker's side, move the actions on, list servers when due, apply the rules."""
        self._observe(now, snap)
        ops: list[Op] = []
        for a in list(self.active.values()):
            ops += self._advance(a, now, snap)
        if not self.list_pending and now >= self.next_list:
            ops.append(self._list(now))
        if self.listed_at is not None:
            if self.config.heal:
                ops += self._heal(now, snap)
            if self.config.scale:
                ops += self._scale(now, snap)
        return ops

    def refresh_soon(self, now: float) -> None:
        """List the servers at the next step (``gpudctl openstack list`` asks for a fresh view)."""
        self.next_list = min(self.next_list, now)

    def _list(self, now: float) -> Op:
        self.list_pending = True
        return Op("list", issued=now)

    def _list_interval(self) -> float:
        return min(self.config.poll_interval, ACTION_POLL_S) if self.active else self.config.poll_interval

    def _observe(self, now: float, snap: Snapshot) -> None:
        names = set()
        for w in snap.workers:
            names.add(w.name)
            if w.instance_id in self.servers:
                self.last_seen[w.instance_id] = now
            if w.busy or w.draining:
                self.idle_since.pop(w.name, None)
            else:
                self.idle_since.setdefault(w.name, now)
        for name in [n for n in self.idle_since if n not in names]:
            del self.idle_since[name]
        if snap.queued > 0:
            if self.backlog_since is None:
                self.backlog_since = now
        else:
            self.backlog_since = None

    # ------------------------------------------------------------------ results

    def on_result(self, r: Result, now: float) -> list[Op]:
        op = r.op
        if op.kind == "list":
            self.list_pending = False
            self.next_list = now + self._list_interval()
            if r.ok:
                self.servers = {s.id: s for s in r.servers}
                self.listed_at = op.issued
                if self.list_error:
                    log.info("openstack: Nova answers again (%d gpud server(s))", len(self.servers))
                self.list_error = ""
                for s in r.servers:
                    self.first_listed.setdefault(s.id, op.issued)
                for sid in [sid for sid in self.first_listed if sid not in self.servers]:
                    del self.first_listed[sid]
                    self.last_seen.pop(sid, None)
            else:
                if r.error != self.list_error:
                    log.error("openstack: cannot list servers: %s", r.error)
                self.list_error = r.error
            return []
        a = self.active.get(op.action) or self._cleanups.pop(op.action, None)
        if a is None or not a.waiting:
            return []
        a.waiting = False
        if op.kind == "boot":
            if not r.ok or r.server is None:
                return self._fail(a, now, f"boot of {a.new_name} failed: {r.error}")
            a.new_id = r.server.id
            self.servers[r.server.id] = r.server
            self.first_listed.setdefault(r.server.id, now)
            log.info("openstack: action %d (%s): server %s (%s) created", a.id, a.kind, a.new_name, a.new_id)
            return self._next(a, now)
        if op.kind == "reboot":
            if r.ok:
                log.info("openstack: action %d: server %s (%s) rebooting", a.id, a.server_name, a.server_id)
                return self._next(a, now)
            if r.kind == "not_found":
                return self._fail(a, now, f"server {a.server_name} ({a.server_id}) no longer exists")
            return self._escalate(a, now, f"the reboot failed ({r.error})")
        if op.kind == "delete":
            sid = op.server_id
            gone = r.ok or r.kind == "not_found"
            if a.outcome != "running":  # deleting the server of a failed boot
                a.message += "; deleted it" if gone else f"; deleting it failed: {r.error}"
                (log.info if gone else log.error)("openstack: action %d: %s", a.id, a.message)
                return []
            if not gone:
                return self._fail(a, now, f"deleting server {op.name} ({sid}) failed: {r.error}")
            log.info("openstack: action %d: server %s (%s) deleted", a.id, op.name, sid)
            return self._next(a, now)
        return []

    # ------------------------------------------------------------------ actions

    def _start(self, kind: str, steps: str, now: float, reason: str, **fields: Any) -> tuple[Action, list[Op]]:
        self._ids += 1
        a = Action(id=self._ids, kind=kind, reason=reason, started=now, steps=STEPS[steps], step_since=now, **fields)
        if "create" in a.steps:
            a.new_name = self._new_name()
        self.active[a.id] = a
        what = a.server_name or a.new_name
        if a.worker:
            what += f", worker {a.worker}"
        if a.server_name and a.new_name:
            what += f", new server {a.new_name}"
        log.warning("openstack: action %d: %s %s (%s)", a.id, kind, what, reason)
        self.next_list = min(self.next_list, now + self._list_interval())
        return a, self._enter(a, now)

    def _finish(self, a: Action, now: float, outcome: str, message: str) -> None:
        a.outcome, a.message, a.finished = outcome, message, now
        self.active.pop(a.id, None)
        self.history.append(a)
        (log.warning if outcome == "failed" else log.info)("openstack: action %d (%s) %s: %s", a.id, a.kind, outcome, message)

    def _fail(self, a: Action, now: float, message: str) -> list[Op]:
        self._finish(a, now, "failed", message)
        return []

    def _fail_and_delete(self, a: Action, now: float, message: str) -> list[Op]:
        """Fail a boot whose server is of no use, and delete that server."""
        self._finish(a, now, "failed", message + "; deleting it")
        a.waiting = True
        self._cleanups[a.id] = a
        return [Op("delete", a.id, server_id=a.new_id, name=a.new_name, issued=now)]

    def _next(self, a: Action, now: float) -> list[Op]:
        a.index += 1
        a.step_since = now
        if a.index >= len(a.steps):
            self._finish(a, now, "done", self._done_message(a))
            return [Op("forget", a.id, name=a.worker)] if a.kind in ("retire", "replace") and a.worker else []
        return self._enter(a, now)

    def _done_message(self, a: Action) -> str:
        if a.kind == "boot":
            return f"server {a.new_name} ({a.new_id}) is up and its worker connected"
        if a.kind == "reboot":
            return f"server {a.server_name} rebooted and its worker is back"
        if a.kind == "replace":
            return f"server {a.server_name} replaced by {a.new_name} ({a.new_id}), whose worker connected"
        return f"server {a.server_name} ({a.server_id}) deleted"

    def _enter(self, a: Action, now: float) -> list[Op]:
        """The op a step begins with, if any."""
        step = a.steps[a.index]
        if step == "create":
            a.boot_since = now
            a.waiting = True
            return [Op("boot", a.id, name=a.new_name, issued=now)]
        if step == "reboot":
            a.waiting = True
            return [Op("reboot", a.id, server_id=a.server_id, name=a.server_name, issued=now)]
        if step == "delete":
            a.waiting = True
            return [Op("delete", a.id, server_id=a.server_id, name=a.server_name, issued=now)]
        if step == "drain":
            ops = [Op("drain", a.id, name=a.worker)] if a.worker else []
            return ops + self._next(a, now)
        return []

    def _advance(self, a: Action, now: float, snap: Snapshot) -> list[Op]:
        """Move ``a`` on as far as the snapshot and the last server list allow."""
        if a.waiting:
            return []
        step = a.steps[a.index]
        by_instance = {w.instance_id: w for w in snap.workers if w.instance_id}
        listed_since_step = self.listed_at is not None and self.listed_at >= a.step_since
        cfg = self.config
        if step in ("build", "join"):
            server = self.servers.get(a.new_id)
            late = now - a.boot_since >= cfg.boot_timeout
            if a.new_id in by_instance:
                w = by_instance[a.new_id]
                log.info("openstack: action %d: worker %s of server %s connected", a.id, w.name, a.new_name)
                a.index = a.steps.index("join")
                return self._next(a, now)
            if server is None:
                if listed_since_step:
                    return self._fail(a, now, f"server {a.new_name} ({a.new_id}) disappeared from Nova's list")
                return []
            if server.status == "ERROR":
                return self._fail_and_delete(a, now, f"server {a.new_name} ({a.new_id}) went to ERROR: "
                                                     f"{server.fault or 'no fault given'}")
            if step == "build":
                if server.status == "ACTIVE":
                    return self._next(a, now)
                if late:
                    return self._fail_and_delete(a, now, f"server {a.new_name} ({a.new_id}) stuck in {server.status} "
                                                         f"for {now - a.boot_since:.0f}s (boot_timeout {cfg.boot_timeout:g}s)")
                return []
            if late:
                return self._fail(a, now, f"server {a.new_name} ({a.new_id}) is {server.status} but no worker "
                                          f"reported its id within boot_timeout ({cfg.boot_timeout:g}s); "
                                          "the server is left for inspection")
            return []
        if step == "return":
            if a.server_id in by_instance:
                return self._next(a, now)
            if now - a.step_since >= cfg.reboot_timeout:
                return self._escalate(a, now, f"its worker was not back {cfg.reboot_timeout:g}s after the reboot")
            return []
        if step == "settle":
            worker = next((w for w in snap.workers if w.name == a.worker), None) if a.worker else None
            if worker is None or not worker.busy:
                return self._next(a, now)
            if now - a.step_since >= cfg.retire_timeout:
                log.warning("openstack: action %d: worker %s still runs work after retire_timeout (%gs); "
                            "deleting its server anyway", a.id, a.worker, cfg.retire_timeout)
                return self._next(a, now)
            return []
        if step == "gone":
            if listed_since_step and a.server_id not in self.servers:
                return self._next(a, now)
            if now - a.step_since >= cfg.boot_timeout:
                return self._fail(a, now, f"server {a.server_name} ({a.server_id}) still listed "
                                          f"{now - a.step_since:.0f}s after it was deleted")
            return []
        return []

    def _escalate(self, a: Action, now: float, why: str) -> list[Op]:
        """A reboot that did not bring the worker back becomes a replacement (delete first)."""
        log.warning("openstack: action %d: %s; replacing server %s", a.id, why, a.server_name)
        a.kind = "replace"
        a.reason = f"{a.reason}; {why}"
        a.steps = STEPS["replace-dead"]
        a.new_name = a.new_name or self._new_name()
        a.index = 0
        a.step_since = now
        self.next_list = min(self.next_list, now)
        return self._enter(a, now)

    def _new_name(self) -> str:
        taken = {s.name for s in self.servers.values()} | {a.new_name for a in self.active.values()}
        while True:
            name = f"{self.config.name_prefix}-{self.rng.getrandbits(24):06x}"
            if name not in taken:
                return name

    # ------------------------------------------------------------------ who is what

    def _busy(self) -> set[str]:
        keys = set()
        for a in [*self.active.values(), *self._cleanups.values()]:
            keys.add(a.key)
            if a.new_id:
                keys.add(a.new_id)
            if a.worker:
                keys.add("worker:" + a.worker)
        return keys

    def size(self) -> int:
        """Servers in the pool, counting boots under way and not counting servers being retired."""
        live = {s.id for s in self.servers.values() if s.status not in GONE}
        going = {a.server_id for a in self.active.values() if a.kind in ("retire", "replace") and a.server_id}
        coming = sum(1 for a in self.active.values() if a.kind in ("boot", "replace") and a.new_id not in live)
        return len(live - going) + coming

    def _resolve(self, target: str, snap: Snapshot) -> tuple[str, ServerInfo | None]:
        """(worker name, its server) for a worker name, a server id or a server name."""
        w = next((w for w in snap.workers if w.name == target), None)
        if w is not None:
            if not w.instance_id:
                raise InvalidRequest(f"worker {target} reported no Nova instance id: it is not a known GPU VM "
                                     "(set [worker] instance_id = \"auto\" on it)")
            s = self.servers.get(w.instance_id)
            if s is None:
                raise InvalidRequest(f"worker {target} says it is server {w.instance_id}, which Nova does not list "
                                     "among the gpud servers (see gpudctl openstack list)")
            return w.name, s
        s = self.servers.get(target) or next((s for s in self.servers.values() if s.name == target), None)
        if s is None:
            if self.listed_at is None:
                raise ConflictError(f"no connected worker {target!r}, and Nova has not been listed yet"
                                    + (f" ({self.list_error})" if self.list_error else ""))
            raise InvalidRequest(f"no connected worker and no gpud server named {target!r} (see gpudctl openstack list)")
        worker = next((w.name for w in snap.workers if w.instance_id == s.id), "")
        return worker, s

    def _check_free(self, server: ServerInfo, worker: str) -> None:
        busy = self._busy()
        if server.id in busy or (worker and "worker:" + worker in busy):
            a = next(a for a in self.active.values() if server.id in (a.server_id, a.new_id) or (worker and a.worker == worker))
            raise ConflictError(f"action {a.id} ({a.kind}, step {a.step}) is under way on server {server.name}; "
                                "one action per worker at a time (see gpudctl openstack actions)")

    # ------------------------------------------------------------------ gpudctl

    def boot(self, count: int, now: float, reason: str) -> tuple[list[Action], list[Op]]:
        if self.boot_problem:
            raise ConflictError(f"cannot boot: {self.boot_problem}")
        if not 1 <= count <= MAX_BOOT:
            raise InvalidRequest(f"boot: count must be 1-{MAX_BOOT}")
        size = self.size()
        if size + count > self.config.max_workers:
            raise ConflictError(f"cannot boot {count}: the pool has {size} server(s) (with boots under way) "
                                f"and [openstack] max_workers is {self.config.max_workers}")
        actions, ops = [], []
        for _ in range(count):
            a, more = self._start("boot", "boot", now, reason)
            actions.append(a)
            ops += more
        return actions, ops

    def replace(self, target: str, now: float, snap: Snapshot, reason: str) -> tuple[Action, list[Op]]:
        if self.boot_problem:
            raise ConflictError(f"cannot replace: {self.boot_problem}")
        worker, server = self._resolve(target, snap)
        assert server is not None
        self._check_free(server, worker)
        live = any(w.name == worker for w in snap.workers) if worker else False
        return self._start("replace", "replace-live" if live else "replace-dead", now, reason,
                           server_id=server.id, server_name=server.name, worker=worker)

    def retire(self, target: str, now: float, snap: Snapshot, reason: str) -> tuple[Action, list[Op]]:
        worker, server = self._resolve(target, snap)
        assert server is not None
        self._check_free(server, worker)
        return self._start("retire", "retire", now, reason, server_id=server.id, server_name=server.name, worker=worker)

    # ------------------------------------------------------------------ rules

    def _heal(self, now: float, snap: Snapshot) -> list[Op]:
        cfg = self.config
        connected = {w.instance_id for w in snap.workers if w.instance_id}
        busy = self._busy()
        ops: list[Op] = []
        for s in list(self.servers.values()):
            if s.status not in DEAD or s.id in connected or s.id in busy:
                continue
            gone_since = max(self.last_seen.get(s.id, 0.0), self.first_listed.get(s.id, now))
            if now - gone_since < cfg.heal_after:
                continue
            why = (f"heal: no worker for {now - gone_since:.0f}s and server {s.status}"
                   + (f" ({s.fault})" if s.fault else ""))
            _, more = self._start("reboot", "reboot", now, why, server_id=s.id, server_name=s.name)
            ops += more
        return ops

    def _scale(self, now: float, snap: Snapshot) -> list[Op]:
        cfg = self.config
        booting = any(a.kind == "boot" for a in self.active.values())
        size = self.size()
        if not booting:
            why = ""
            if size < cfg.min_workers:
                why = f"scale: {size} server(s), below min_workers {cfg.min_workers}"
            elif (self.backlog_since is not None and now - self.backlog_since >= cfg.grow_after
                  and size < cfg.max_workers):
                why = f"scale: requests queued for {now - self.backlog_since:.0f}s ({snap.queued} now)"
            if why:
                if self.boot_problem:
                    if not self._boot_problem_logged:
                        log.error("openstack: %s, but cannot boot: %s", why, self.boot_problem)
                        self._boot_problem_logged = True
                else:
                    if size >= cfg.min_workers:  # grown for the backlog: the next one needs another grow_after
                        self.backlog_since = now
                    return self._start("boot", "boot", now, why)[1]
        if snap.queued or size <= cfg.min_workers or any(a.kind == "retire" for a in self.active.values()):
            return []
        busy = self._busy()
        idle = sorted(
            (since, w) for w in snap.workers
            if w.instance_id in self.servers and (since := self.idle_since.get(w.name)) is not None
            and now - since >= cfg.shrink_after and w.instance_id not in busy and "worker:" + w.name not in busy
        )
        if not idle:
            return []
        since, w = idle[0]
        s = self.servers[w.instance_id]
        return self._start("retire", "retire", now, f"scale: idle for {now - since:.0f}s",
                           server_id=s.id, server_name=s.name, worker=w.name)[1]

    # ------------------------------------------------------------------ views

    def view(self, now: float, snap: Snapshot) -> dict[str, Any]:
        """The server list matched to the workers (``gpudctl openstack list``)."""
        by_instance = {w.instance_id: w for w in snap.workers if w.instance_id}
        acting = {}
        for a in self.active.values():
            for sid in (a.server_id, a.new_id):
                if sid:
                    acting[sid] = a
        servers = []
        for s in sorted(self.servers.values(), key=lambda s: s.name):
            w = by_instance.get(s.id)
            act = acting.get(s.id)
            servers.append({**s.row(), "worker": w.name if w else "",
                            "worker_state": ("draining" if w.draining else "busy" if w.busy else "idle") if w else "",
                            "action": f"{act.id} {act.kind} {act.step}" if act else ""})
        unmatched = [{"name": w.name, "instance_id": w.instance_id,
                      "why": "reported no instance id" if not w.instance_id else "its server is not among Nova's gpud servers"}
                     for w in sorted(snap.workers, key=lambda w: w.name) if w.instance_id not in self.servers]
        return {
            "listed_s": round(now - self.listed_at, 3) if self.listed_at is not None else None,
            "list_error": self.list_error,
            "servers": servers,
            "workers_without_server": unmatched if self.listed_at is not None else [],
            "size": self.size(),
            "min_workers": self.config.min_workers,
            "max_workers": self.config.max_workers,
            "heal": self.config.heal,
            "scale": self.config.scale,
            "boot_problem": self.boot_problem,
            "actions_running": len(self.active),
        }

    def actions(self, now: float, limit: int = HISTORY) -> list[dict[str, Any]]:
        """Running actions, then finished ones, newest first."""
        rows = [a.row(now) for a in sorted(self.active.values(), key=lambda a: -a.id)]
        rows += [a.row(now) for a in reversed(self.history)]
        return rows[:limit]


def recognised(metadata: Mapping[str, str], tags: Iterable[str], want_metadata: Mapping[str, str],
               want_tags: Iterable[str]) -> bool:
    """Whether a server with ``metadata`` and ``tags`` is a gpud worker: every wanted pair and tag."""
    have = set(tags)
    return all(metadata.get(k) == v for k, v in want_metadata.items()) and all(t in have for t in want_tags)


__all__ = ["Action", "Op", "Pool", "PoolConfig", "Result", "ServerInfo", "Snapshot", "WorkerView", "recognised"]
