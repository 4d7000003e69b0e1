"""The broker's side of OpenStack: Nova calls on threads of their own, never on the broker's loop.

The broker's loop calls ``on_tick`` once per tick: it takes the results the threads have put on a
queue (never waiting), feeds them to the ``Pool``, and every ``DECIDE_S`` seconds hands the pool a
``Snapshot`` of the registry and the queue; the Nova ops the pool asks for go on the threads' queue,
the broker ops (drain a worker) are applied there and then. ``gpudctl openstack ...`` reaches
``admin`` on the loop too. So the pool and the broker's tables are only ever touched by the loop's
thread, and a Nova that is slow, down or misconfigured only makes the actions wait or fail, with
the reason in ``gpudctl openstack list`` and ``actions``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpud.errors import ConflictError, InvalidRequest
from gpud_broker.openstack import userdata
from gpud_broker.openstack.pool import (
    NOVA_OPS,
    Op,
    Pool,
    PoolConfig,
    Result,
    ServerInfo,
    Snapshot,
    WorkerView,
)

log = logging.getLogger(__name__)

THREADS = 4  # Nova calls at once: a slow boot does not hold up the server list
DECIDE_S = 0.5  # seconds between two looks of the pool at the broker's tables
KEY_MARK = "booted by the broker"  # in allow-list files this module wrote (and only those it removes)


def snapshot(core: Any) -> Snapshot:
    """The registry and the queue as the pool needs them (O(workers + sessions))."""
    with_sessions = {s.worker for s in core.sessions.values()}
    workers = tuple(
        WorkerView(w.name, w.instance_id,
                   busy=bool(w.assigned) or w.inflight > 0 or bool(w.running) or w.name in with_sessions,
                   draining=w.draining)
        for w in core.registry.workers
    )
    return Snapshot(workers, len(core.queue))


class Controller:
    """The pool, its Nova threads, and the queues between them and the broker's loop."""

    def __init__(self, cfg: Any, *, security: Any = None, env: Mapping[str, str] | None = None,
                 clouds_files: Sequence[str] | None = None, nova: Callable[[], Any] | None = None,
                 rng: random.Random | None = None, threads: int = THREADS,
                 active: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.active = active or (lambda: True)  # False: the passive broker of a pair, which decides nothing
        self.security = security
        self.env = os.environ if env is None else env
        self.clouds_files = clouds_files
        self._stop = threading.Event()
        self._factory = nova or self._new_nova
        self._nova: Any = None
        self._nova_lock = threading.Lock()
        self._ops: queue.Queue[Op | None] = queue.Queue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"gpud-nova-{i}", daemon=True) for i in range(threads)]
        self._next_decide = 0.0
        self.unavailable = ""  # why Nova cannot be used at all
        if importlib.util.find_spec("novaclient") is None or importlib.util.find_spec("keystoneauth1") is None:
            self.unavailable = "python-novaclient is not installed: pip install 'gpud[openstack]'"
        self.template = ""
        problem = ""
        try:
            self.template = userdata.load(cfg.user_data)
        except userdata.TemplateError as exc:
            problem = str(exc)
        missing = [k for k in ("image", "flavor", "brokers") if not getattr(cfg, k)]
        if missing:
            problem = f"[openstack] {', '.join(missing)} not set"
        self.pool = Pool(PoolConfig.from_config(cfg), boot_problem=problem, rng=rng)

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        for t in self._threads:
            t.start()
        cfg = self.cfg
        log.info("openstack: on (heal %s, scale %s, %d-%d workers)%s%s", "on" if cfg.heal else "off",
                 "on" if cfg.scale else "off", cfg.min_workers, cfg.max_workers,
                 f"; cannot boot: {self.pool.boot_problem}" if self.pool.boot_problem else "",
                 f"; {self.unavailable}" if self.unavailable else "")
        if self.unavailable:
            log.error("openstack: %s", self.unavailable)

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the threads: retry waits end at once; a Nova call under way is abandoned (the
        threads are daemons)."""
        self._stop.set()
        for _ in self._threads:
            self._ops.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout / len(self._threads))

    # ------------------------------------------------------------------ the broker's loop

    def on_tick(self, core: Any, now: float) -> None:
        """Take the threads' results, and every DECIDE_S let the pool decide. Never waits."""
        while True:
            try:
                r = self._results.get_nowait()
            except queue.Empty:
                break
            self._apply(core, self.pool.on_result(r, now))
        if now >= self._next_decide and self.active():
            self._next_decide = now + DECIDE_S
            self._apply(core, self.pool.step(now, snapshot(core)))

    def _apply(self, core: Any, ops: list[Op]) -> None:
        for op in ops:
            if op.kind in NOVA_OPS:
                self._ops.put(op)
            elif op.kind == "drain":
                if op.name not in core.registry.drained:
                    log.warning("openstack: worker %s drained: its server is to be deleted (action %d)", op.name, op.action)
                core.workers.mark_drained(op.name, True)
            elif op.kind == "forget":
                core.workers.mark_drained(op.name, False)

    def admin(self, core: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        """``gpudctl openstack ACTION``: list and actions read; boot, replace and retire start actions
        and answer at once (``actions`` follows them)."""
        action, worker, count = args.get("action"), args.get("worker"), args.get("count")
        now = core.now
        if action in ("list", "actions") and (worker is not None or count is not None):
            raise InvalidRequest(f"openstack {action} takes neither a worker nor a count")
        if action == "list":
            self.pool.refresh_soon(now)
            view = self.pool.view(now, snapshot(core))
            if self.unavailable:
                view["list_error"] = self.unavailable
            return {"action": "list", **view}
        if action == "actions":
            return {"action": "actions", "actions": self.pool.actions(now)}
        if not self.active():
            raise ConflictError("this broker is the passive one of its pair: ask the active broker")
        if action == "boot":
            if worker is not None:
                raise InvalidRequest("openstack boot takes a count (N), not a worker")
            actions, ops = self.pool.boot(1 if count is None else int(count), now, "gpudctl")
            self._apply(core, ops)
            names = ", ".join(a.new_name for a in actions)
            return {"action": "boot", "actions": [a.row(now) for a in actions],
                    "message": f"booting {len(actions)} server(s): {names}; follow them with gpudctl openstack actions"}
        if action in ("replace", "retire"):
            if worker is None or count is not None:
                raise InvalidRequest(f"openstack {action} takes one WORKER (a worker, or a server's name or id)")
            snap = snapshot(core)
            start = self.pool.replace if action == "replace" else self.pool.retire
            a, ops = start(str(worker), now, snap, "gpudctl")
            self._apply(core, ops)
            what = f"worker {a.worker} (server {a.server_name})" if a.worker else f"server {a.server_name}"
            then = ("boots a new server, then retires the old one" if a.steps[0] == "create" else
                    "deletes it, then boots a new one") if action == "replace" else "drains it, then deletes its server"
            return {"action": action, "actions": [a.row(now)],
                    "message": f"action {a.id}: {action} {what}: {then}; follow it with gpudctl openstack actions"}
        raise InvalidRequest(f"openstack: unknown action {action!r}")

    # ------------------------------------------------------------------ the Nova threads

    def _new_nova(self) -> Any:
        from gpud_broker.openstack.nova import Nova

        return Nova(self.cfg, self.env, self.clouds_files, stop=self._stop)

    def _client(self) -> Any:
        from gpud_broker.openstack.nova import NovaError

        if self.unavailable:
            raise NovaError(self.unavailable, kind="config")
        with self._nova_lock:
            if self._nova is None:
                self._nova = self._factory()
            return self._nova

    def _serve(self) -> None:
        while True:
            op = self._ops.get()
            if op is None or self._stop.is_set():
                return
            self._results.put(self._execute(op))

    def _execute(self, op: Op) -> Result:
        from gpud_broker.openstack.nova import NovaError  # imports novaclient only when used

        try:
            nova = self._client()
            if op.kind == "list":
                return Result(op, True, servers=tuple(nova.list_servers()))
            if op.kind == "boot":
                return Result(op, True, server=self._boot(nova, op))
            if op.kind == "reboot":
                nova.reboot(op.server_id)
                return Result(op, True)
            if op.kind == "delete":
                existed = nova.delete(op.server_id)
                self._disallow(op.name)
                return Result(op, True) if existed else Result(op, False, error="already gone", kind="not_found")
            return Result(op, False, error=f"unknown op {op.kind}", kind="internal")
        except NovaError as exc:
            if op.kind != "list":  # a failing list is logged by the pool, once per new error
                log.error("openstack: %s", exc.message)
            return Result(op, False, error=exc.message, kind=exc.kind)
        except userdata.TemplateError as exc:
            return Result(op, False, error=str(exc), kind="config")
        except Exception as exc:  # a bug here must not kill the thread
            log.exception("openstack: %s failed", op.kind)
            return Result(op, False, error=f"internal error: {type(exc).__name__}: {exc}", kind="internal")

    # ------------------------------------------------------------------ boot's keys

    def _curve(self) -> bool:
        return self.security is not None and getattr(self.security, "curve", False)

    def _keys_dir(self) -> Path:
        sec = self.security
        return Path(sec.worker_keys_dir) if sec.worker_keys_dir else Path(sec.keys_dir) / "workers"

    def _boot(self, nova: Any, op: Op) -> ServerInfo:
        from gpud.security import load_public_key
        from gpud_broker.openstack.nova import NovaError

        cfg = self.cfg
        broker_public = ""
        if self._curve():
            sec = self.security
            path = Path(sec.public_key_file) if sec.public_key_file else Path(sec.keys_dir) / "broker.key"
            try:
                broker_public = load_public_key(path).decode()
            except Exception as exc:
                raise NovaError(f"cannot boot {op.name}: {exc}", kind="config") from None
        keys = userdata.new_keys(broker_public)
        mode = "curve" if self._curve() else "none"
        text = userdata.render(self.template, userdata.values(op.name, cfg.brokers, cfg.install, mode, keys))
        key_file = self._allow(op.name, keys.public) if self._curve() else None
        try:
            server: ServerInfo = nova.boot(op.name, text, cfg.worker_metadata, cfg.worker_tags)
        except BaseException:
            if key_file is not None:
                key_file.unlink(missing_ok=True)
            raise
        return server

    def _allow(self, name: str, public: str) -> Path:
        """Put the new worker's public key into the broker's allow-list."""
        from gpud_broker.openstack.nova import NovaError

        d = self._keys_dir()
        path = d / f"{name}.key"
        tmp = d / f".{name}.key.tmp"
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp.write_text(userdata.public_certificate(public, name))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise NovaError(f"cannot boot {name}: cannot write its key into the worker allow-list {d}: {exc.strerror}",
                            kind="config") from None
        return path

    def _disallow(self, name: str) -> None:
        """Take a deleted server's key out of the allow-list, if this module put it there."""
        if not name or not self._curve():
            return
        path = self._keys_dir() / f"{name}.key"
        try:
            if KEY_MARK in path.read_text(errors="replace"):
                path.unlink()
                log.info("openstack: removed %s from the worker allow-list", path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("openstack: cannot remove %s from the worker allow-list: %s", path, exc.strerror)


def start(broker: Any, cfg: Any) -> Controller | None:
    """A started Controller for ``broker`` when ``[openstack] enabled``; None otherwise. Never
    raises for Nova's sake: what is wrong shows in ``gpudctl openstack list``."""
    if cfg is None or not getattr(cfg, "enabled", False):
        return None
    controller = Controller(cfg, security=getattr(broker, "security", None), active=lambda: _is_active(broker))
    controller.start()
    return controller


def _is_active(broker: Any) -> bool:
    """Whether ``broker`` serves: standalone, or the active one of a Binary Star pair (only that
    one may boot and delete servers)."""
    pair = getattr(broker, "pair", None)
    return pair is None or getattr(getattr(pair, "state", None), "name", "") == "ACTIVE"
