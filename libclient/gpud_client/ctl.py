"""gpudctl: the admin command line. It owns the admin dialog's client side (ADMIN -> REPLY), the
human rendering of what the broker reports, and ``gpudctl top``, the live view.

Its subcommands are generated from the broker's command table (``gpud.admin_commands``): one per
admin command, with the command's docstring as help and its argument schema as options, each with
``--json`` for the raw result. Each request declares who asks (user and pid) for the broker's log;
the admin socket's file permissions decide who may ask at all.

Exit status: 0 success, 1 the broker answered with an error (or an unusable reply), 2 usage error,
3 the broker did not answer in time.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from time import monotonic
from typing import Any, TextIO

import zmq

from gpud.admin import CommandSpec
from gpud.admin_commands import COMMANDS
from gpud.errors import GpudError, Timeout
from gpud.log import setup_logging
from gpud.protocol import Command, Peer, decode, id_text, new_id
from gpud_client import _request as rq

__all__ = ["DEFAULT_ADMIN_ENDPOINT", "admin_call", "format_status", "main", "render", "render_result"]

log = logging.getLogger(__name__)

DEFAULT_ADMIN_ENDPOINT = "ipc:///run/gpud/admin.sock"
"""The broker's admin socket under systemd (RuntimeDirectory=gpud); ``$GPUD_ADMIN`` overrides it."""
DEFAULT_TIMEOUT_S = 5.0

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3

GIB = float(1 << 30)


def admin_call(
    endpoint: str,
    cmd: str,
    args: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    context: zmq.Context[Any] | None = None,
    who: Mapping[str, Any] | None = None,
) -> Any:
    """Send one ADMIN command and return the ``result`` of its REPLY.

    Parameters
    ----------
    endpoint:
        The broker's admin endpoint (``ipc://...`` or ``tcp://...``).
    cmd:
        Command name, e.g. ``"status"``.
    args:
        The command's arguments.
    timeout:
        Seconds to wait for the reply, in all.
    context:
        A zmq context to use; by default a private one, terminated before returning.
    who:
        Who asks, for the broker's log of commands that change state: ``user`` and ``pid``; by
        default this process's.

    Raises
    ------
    gpud.errors.Timeout
        Nothing usable came back in time.
    gpud.errors.GpudError
        The broker answered with an error (the subclass for its code), or with a malformed reply
        (ProtocolError).
    """
    ctx: zmq.Context[Any] = zmq.Context() if context is None else context
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        rid = new_id()
        sock.send_multipart(rq.admin_frames(rid, cmd, args, _who() if who is None else who), flags=zmq.NOBLOCK)
        deadline = monotonic() + timeout
        dropped = ""
        while True:
            left = deadline - monotonic()
            if left <= 0 or not sock.poll(max(1, math.ceil(left * 1000)), zmq.POLLIN):
                hint = f"; last dropped message: {dropped}" if dropped else ""
                raise Timeout(f"admin {cmd}: no reply within {timeout:g}s from {endpoint}{hint}")
            frames = sock.recv_multipart()
            try:
                msg = decode(frames, expect=Peer.ADMIN)
            except GpudError as exc:
                dropped = f"malformed message ({exc.code}: {exc.message})"
                log.warning("dropped %s", dropped)
                continue
            if msg.command not in (Command.REPLY, Command.ERROR):
                dropped = f"unexpected {msg.command.name}"
                log.warning("dropped %s", dropped)
                continue
            got = msg.header.get("id")
            if got != rid:
                if msg.command is Command.ERROR and got is None:
                    raise rq.error_from(msg.header)
                log.debug("dropped a reply for another request %r", got)
                continue
            log.debug("admin %s %s answered", cmd, id_text(rid))
            header = rq.check_reply(msg)
            return header.get("result")
    finally:
        sock.close(linger=0)
        if context is None:
            ctx.term()


# --------------------------------------------------------------------------- rendering


def _who() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry and no $USER: getpass raises OSError or KeyError
        user = str(os.getuid())
    return {"user": user, "pid": os.getpid()}


def _num(value: Any, default: float = 0.0) -> float:
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    return default


def _text(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else ("" if value is None else str(value))
    return text if len(text) <= width else text[: width - 1] + "~"


def _duration(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _rows(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


_COUNTS = ("workers", "gpus", "queued", "running", "sessions", "done")
_COLUMNS = "{:<12} {:>3} {:<18} {:<3} {:>4} {:>11} {:>5} {:>5} {:<8}"


def _role(broker: Mapping[str, Any]) -> str:
    """``standalone``, or a pair member's role, state and epoch (``backup active e3``)."""
    role = str(broker.get("role", "?"))
    state = broker.get("state")
    if role == "standalone" or not isinstance(state, str):
        return role
    epoch = broker.get("epoch")
    return f"{role} {state}" + (f" e{epoch}" if isinstance(epoch, int) else "")


def format_status(status: Mapping[str, Any]) -> str:
    """The ``status`` result as a table of at most 80 columns: one summary line, one row per GPU.

    Tolerates missing or odd fields (it is for people; ``--json`` gives the exact data).
    """
    broker = _map(status.get("broker"))
    counts = _map(status.get("counts"))
    peer = broker.get("peer")
    lines = [
        "broker {} ({}, {}) up {}  policy {}{}".format(
            _text(broker.get("name", "?"), 20),
            _text(_role(broker), 22),
            _text(broker.get("version", "?"), 10),
            _duration(_num(broker.get("uptime_s"))),
            _text(broker.get("policy", "?"), 14),
            f"  peer {_text(peer, 10)}" if peer is not None else "",
        ),
        "  ".join(f"{k} {int(_num(counts.get(k)))}" for k in _COUNTS),
        "",
        _COLUMNS.format(
            "WORKER", "IDX", "MODEL", "", "UTIL", "MEM GiB", "MILLI", "TASKS", "HEALTH"
        ).rstrip(),
    ]
    gpus = _rows(status.get("gpus"))
    for g in sorted(gpus, key=lambda g: (str(g.get("worker", "")), int(_num(g.get("index"))))):
        mem = f"{_num(g.get('mem_used')) / GIB:.1f}/{_num(g.get('mem')) / GIB:.1f}"
        lines.append(
            _COLUMNS.format(
                _text(g.get("worker"), 12),
                int(_num(g.get("index"))),
                _text(g.get("model"), 18),
                "SIM" if g.get("simulated") is True else "",
                f"{_num(g.get('util')):.0f}%",
                _text(mem, 11),
                int(_num(g.get("granted_milli"))),
                int(_num(g.get("tasks"))),
                _text(g.get("health", "?"), 8),
            ).rstrip()
        )
    if not gpus:
        lines.append("(no GPUs connected)")
    lines += _health_notes(gpus)
    return "\n".join(_fit(line, WIDTH) for line in lines)


WIDTH = 80  # columns of the human output


def _fit(line: str, width: int) -> str:
    line = line.rstrip()
    return line if len(line) <= width else line[: max(0, width - 1)] + "~"


def _table(columns: str, header: Sequence[str], rows: Sequence[Sequence[Any]], empty: str) -> list[str]:
    lines = [columns.format(*header)]
    lines += [columns.format(*row) for row in rows]
    if not rows:
        lines.append(empty)
    return lines


def _short_id(value: Any) -> str:
    return _text(value, 32)[:12]


def _gib(value: Any) -> str:
    n = _num(value) / GIB
    return f"{n:.0f}G" if n >= 100 else f"{n:.1f}G"


def _work_text(g: Mapping[str, Any]) -> str:
    """A GPU's running work: ``2 job 1 ses`` (grants held, when the broker names no kind)."""
    work = _map(g.get("work"))
    parts = [f"{int(_num(n))} {str(k)[:4] if k != 'session' else 'ses'}" for k, n in sorted(work.items())]
    if parts:
        return " ".join(parts)
    tasks = int(_num(g.get("tasks")))
    return f"{tasks} grant{'s' if tasks != 1 else ''}" if tasks else "-"


def _format_workers(result: Any) -> list[str]:
    cols = "{:<12} {:<16} {:>4} {:>9} {:<8} {:>4} {:>6} {:<3}"
    rows = [
        (
            _text(w.get("name"), 12),
            _text(w.get("hostname") or "-", 16),
            int(_num(w.get("gpus"))),
            f"{int(_num(w.get('inflight')))}/{int(_num(w.get('slots')))}",
            "draining" if w.get("draining") is True else "ok",
            len(w.get("running") or []) if isinstance(w.get("running"), list) else 0,
            _duration(_num(w.get("last_heard_s"))),
            "SIM" if w.get("simulated") is True else "",
        )
        for w in _rows(result)
    ]
    return _table(cols, ("WORKER", "HOST", "GPUS", "INFLIGHT", "STATE", "RUN", "HEARD", ""), rows,
                  "(no workers connected)")


def _health_notes(gpus: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per GPU that its worker counts failed: why, and when its probation ends."""
    notes = []
    for g in sorted(gpus, key=lambda g: (str(g.get("worker", "")), int(_num(g.get("index"))))):
        reason = g.get("health_reason")
        if g.get("measured_health", g.get("health")) != "failed" and not reason:
            continue
        name = g.get("name") or f"{g.get('worker')}/{int(_num(g.get('index')))}"
        line = f"{_text(name, 16)} failed: {_text(reason or 'unknown', 48)}"
        left = _num(g.get("probation_left_s"))
        if left > 0:
            line += f"; on probation, serves again in {_duration(math.ceil(left))}"
        notes.append(line)
    return ["", *notes] if notes else []


def _format_gpus(result: Any) -> list[str]:
    cols = "{:<10} {:<14} {:<3} {:>4} {:>11} {:>4} {:>5} {:<11} {:<9}"
    rows = []
    for g in _rows(result):
        mem = f"{_num(g.get('mem_used')) / GIB:.1f}/{_num(g.get('mem')) / GIB:.1f}"
        name = g.get("name") or f"{g.get('worker')}/{int(_num(g.get('index')))}"
        rows.append((
            _text(name, 10),
            _text(g.get("model"), 14),
            "SIM" if g.get("simulated") is True else "",
            f"{_num(g.get('util')):.0f}%",
            _text(mem, 11),
            f"{_num(g.get('temp')):.0f}C",
            int(_num(g.get("granted_milli"))),
            _text(_work_text(g), 11),
            _text(g.get("health", "?"), 9),
        ))
    return _table(cols, ("GPU", "MODEL", "", "UTIL", "MEM GiB", "TEMP", "MILLI", "RUNNING", "HEALTH"), rows,
                  "(no GPUs connected)") + _health_notes(_rows(result))


def _format_queue(result: Any) -> list[str]:
    cols = "{:<12} {:<8} {:<24} {:>5} {:>8}"
    rows = [
        (_short_id(t.get("id")), _text(t.get("kind"), 8), _text(t.get("tenant"), 24),
         int(_num(t.get("priority"))), _duration(_num(t.get("waited_s"))))
        for t in _rows(result)
    ]
    return _table(cols, ("ID", "KIND", "TENANT", "PRIO", "WAITED"), rows, "(nothing queued)")


def _format_tasks(result: Any) -> list[str]:
    res = _map(result)
    tasks = _rows(res.get("tasks"))
    cols = "{:<12} {:<7} {:<7} {:<16} {:<10} {:<14} {:>7}"
    rows = []
    for t in tasks:
        gpus = [str(u) for u in t.get("gpus") or [] if isinstance(u, str)] if isinstance(t.get("gpus"), list) else []
        gpu = (_text(gpus[0], 11) + (f"+{len(gpus) - 1}" if len(gpus) > 1 else "")) if gpus else "-"
        rows.append((
            _short_id(t.get("id")), _text(t.get("state"), 7), _text(t.get("kind"), 7),
            _text(t.get("tenant"), 16), _text(t.get("worker") or "-", 10), _text(gpu, 14),
            _duration(_num(t.get("age_s"))),
        ))
    lines = [f"{int(_num(res.get('matched')))} matching, {len(rows)} shown (newest first)"]
    return lines + _table(cols, ("ID", "STATE", "KIND", "TENANT", "WORKER", "GPU", "AGE"), rows, "(none)")


def _format_sessions(result: Any) -> list[str]:
    cols = "{:<12} {:<16} {:<10} {:<10} {:>5} {:>7} {:>7} {:>6}"
    rows = [
        (_short_id(s.get("id")), _text(s.get("tenant"), 16), _text(s.get("worker"), 10),
         _text(s.get("gpu_name") or s.get("gpu"), 10), int(_num(s.get("gpu_milli"))), _gib(s.get("mem")),
         _duration(_num(s.get("age_s"))), _duration(_num(s.get("last_seen_s"))))
        for s in _rows(result)
    ]
    return _table(cols, ("ID", "TENANT", "WORKER", "GPU", "MILLI", "MEM", "AGE", "SEEN"), rows,
                  "(no open sessions)")


# openstack (issue 7) ------------------------------------------------------------------------------


def _format_openstack(result: Any) -> list[str]:
    """``gpudctl openstack``: list, actions, or the message of a change."""
    res = _map(result)
    action = res.get("action")
    if action == "actions":
        return _openstack_actions(_rows(res.get("actions")))
    if action != "list":
        return _wrap(res.get("message"), "")
    listed = res.get("listed_s")
    lines = [
        "pool {} server(s), min {} max {}; heal {}, scale {}; {}".format(
            int(_num(res.get("size"))), int(_num(res.get("min_workers"))), int(_num(res.get("max_workers"))),
            "on" if res.get("heal") is True else "off", "on" if res.get("scale") is True else "off",
            "Nova not listed yet" if listed is None else f"listed {_duration(_num(listed))} ago"),
    ]
    if res.get("list_error"):
        lines.append(f"Nova: {_text(res.get('list_error'), 200)}")
    if res.get("boot_problem"):
        lines.append(f"cannot boot: {_text(res.get('boot_problem'), 200)}")
    cols = "{:<20} {:<8} {:<10} {:<15} {:<9} {:<13}"
    servers = _rows(res.get("servers"))
    rows = []
    for s in servers:
        addresses = [a for a in s.get("addresses") or [] if isinstance(a, str)] if isinstance(s.get("addresses"), list) else []
        gpu = s.get("pci_alias") or s.get("vgpu") or "-"
        worker = f"{s.get('worker')} ({s.get('worker_state')})" if s.get("worker") else "NO WORKER"
        rows.append((_text(s.get("name"), 20), _text(s.get("status"), 8), _text(s.get("host") or "-", 10),
                     _text(addresses[0] if addresses else "-", 15), _text(gpu, 9), _text(worker, 13)))
    lines += _table(cols, ("SERVER", "STATUS", "HOST", "ADDRESS", "GPU", "WORKER"), rows,
                    "(no gpud servers)" if listed is not None else "(none yet)")
    for s in servers:
        if s.get("action"):
            lines.append(f"{_text(s.get('name'), 20)}: action {_text(s.get('action'), 50)}")
        if s.get("fault"):
            lines.append(f"{_text(s.get('name'), 20)}: fault: {_text(s.get('fault'), 200)}")
    lonely = _rows(res.get("workers_without_server"))
    if lonely:
        lines += ["", "workers without a server:"]
        lines += [f"  {_text(w.get('name'), 20)} {_text(w.get('instance_id') or '-', 36)} {_text(w.get('why'), 60)}"
                  for w in lonely]
    return lines


def _openstack_actions(actions: list[Mapping[str, Any]]) -> list[str]:
    cols = "{:>4} {:<8} {:<8} {:<22} {:<22} {:>8}"
    lines = [cols.format("ID", "KIND", "STEP", "SERVER", "WORKER/NEW", "AGE")]
    for a in actions:
        lines.append(cols.format(
            int(_num(a.get("id"))), _text(a.get("kind"), 8), _text(a.get("step"), 8),
            _text(a.get("server_name") or "-", 22), _text(a.get("worker") or a.get("new_server_name") or "-", 22),
            _duration(_num(a.get("age_s")))))
        for key in ("reason", "message"):
            lines += _wrap(a.get(key), f"     {key}: ")
    if not actions:
        lines.append("(no actions yet)")
    return lines


def _wrap(text: Any, first: str) -> list[str]:
    """``text`` in lines of at most WIDTH columns, the first after ``first``, the rest indented."""
    import textwrap

    if not isinstance(text, str) or not text:
        return []
    return textwrap.wrap(_text(text, 1000), WIDTH, initial_indent=first, subsequent_indent=" " * (len(first) + 2))


def _openstack_args(operand: str | None, args: dict[str, Any]) -> dict[str, Any]:
    """``gpudctl openstack boot N`` / ``replace WORKER``: the operand as --count / --worker."""
    if operand is None:
        return args
    action = args.get("action")
    key = "count" if action == "boot" else "worker" if action in ("replace", "retire") else None
    if key is None:
        raise ValueError(f"{action} takes nothing after it")
    if key in args:
        raise ValueError(f"give {'N' if key == 'count' else 'WORKER'} or --{key}, not both")
    if key == "count":
        if not operand.isdigit():
            raise ValueError(f"boot N: N is a number of servers, not {operand!r}")
        return {**args, "count": int(operand)}
    return {**args, "worker": operand}


_FORMATS: dict[str, Callable[[Any], list[str]]] = {
    "status": lambda r: format_status(_map(r)).splitlines(),
    "workers": _format_workers,
    "gpus": _format_gpus,
    "queue": _format_queue,
    "tasks": _format_tasks,
    "sessions": _format_sessions,
    "openstack": _format_openstack,
}


def render_result(cmd: str, result: Any) -> str:
    """A command's result for people, at most 80 columns wide (``--json`` gives the exact data).

    Commands that change state answer with a ``message``; unknown shapes fall back to JSON.
    """
    fmt = _FORMATS.get(cmd)
    if fmt is not None:
        lines = fmt(result)
    elif isinstance(result, dict) and isinstance(result.get("message"), str):
        lines = [result["message"]]
    else:
        lines = json.dumps(result, indent=2, sort_keys=True, default=_jsonable).splitlines()
    return "\n".join(_fit(line, WIDTH) for line in lines)


# --------------------------------------------------------------------------- gpudctl top

TOP_MIN_WIDTH = 40
TOP_MIN_HEIGHT = 4


def _bar(fraction: float, inner: int) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(round(fraction * inner))
    return "[" + "#" * full + " " * (inner - full) + "]"


def _rate(status: Mapping[str, Any], prev: Mapping[str, Any] | None) -> str:
    """Requests per second between two status results (their uptimes are the clock)."""
    if prev is None:
        return "-"
    dt = _num(_map(status.get("broker")).get("uptime_s")) - _num(_map(prev.get("broker")).get("uptime_s"))
    dn = _num(_map(status.get("counters")).get("requests")) - _num(_map(prev.get("counters")).get("requests"))
    if dt <= 0 or dn < 0:  # the same sample, or the broker restarted
        return "-"
    return f"{dn / dt:.1f}"


def render(
    status: Mapping[str, Any] | None, prev: Mapping[str, Any] | None, width: int, height: int
) -> list[str]:
    """The ``gpudctl top`` screen: at most ``height`` lines of at most ``width`` characters.

    ``status`` is the latest ``status`` result, or None when the broker did not answer (then the
    last one known, ``prev``, is shown under a "broker not answering" header); ``prev`` is the one
    before, for requests per second. Pure: tests call it without a terminal.
    """
    if width < TOP_MIN_WIDTH or height < TOP_MIN_HEIGHT:
        return [_fit(f"window too small ({width}x{height}); need {TOP_MIN_WIDTH}x{TOP_MIN_HEIGHT}", width)][:height]
    shown = status if status is not None else prev
    broker = _map(shown.get("broker")) if shown is not None else {}
    counts = _map(shown.get("counts")) if shown is not None else {}
    name = _text(broker.get("name", "?"), 20)
    if status is None:
        first = f"gpud top  {name}  broker not answering; retrying every second"
        rate = "-"
    else:
        peer = broker.get("peer")
        first = "gpud top  {}  role {}  peer {}  up {}".format(
            name, _text(_role(broker), 22), _text(peer if peer is not None else "none", 12),
            _duration(_num(broker.get("uptime_s"))),
        )
        rate = _rate(status, prev)
    if shown is None:
        return [_fit(line, width) for line in (first, "no answer yet", "q quits")[:height]]
    lines = [
        first,
        "queue {}  running {}  sessions {}  workers {}  gpus {}  req/s {}".format(
            *(int(_num(counts.get(k))) for k in ("queued", "running", "sessions", "workers", "gpus")), rate
        ),
        "q quits" if status is not None else "q quits; the rows are from the last answer",
    ]
    # Columns: GPU, utilization bar and %, memory bar and GiB, granted milli, health, running work.
    # Wider windows get longer bars; 80 columns leave 16 for the running work.
    extra = max(0, width - 80)
    inner = 8 + extra // 4
    cols = "{:<10} {} {:>4} {} {:>10} {:>5} {:<8} {}"
    lines.append(_fit(cols.format("GPU", "UTIL".ljust(inner + 2), "", "MEM".ljust(inner + 2), "GiB",
                                  "GRANT", "HEALTH", "RUNNING"), width))
    gpus = sorted(_rows(shown.get("gpus")), key=lambda g: (str(g.get("worker", "")), int(_num(g.get("index")))))
    room = height - len(lines)
    if len(gpus) > room:
        gpus, hidden = gpus[: max(0, room - 1)], len(gpus) - max(0, room - 1)
    else:
        hidden = 0
    for g in gpus:
        util = _num(g.get("util"))
        total = _num(g.get("mem"))
        used = _num(g.get("mem_used"))
        mem_text = f"{used / GIB:.0f}/{total / GIB:.0f}" if total >= 100 * GIB else f"{used / GIB:.1f}/{total / GIB:.1f}"
        name_text = g.get("name") or f"{g.get('worker')}/{int(_num(g.get('index')))}"
        health = str(g.get("health", "?"))
        if g.get("simulated") is True and health == "ok":
            health = "ok (sim)"
        lines.append(_fit(cols.format(
            _text(name_text, 10), _bar(util / 100.0, inner), f"{util:.0f}%",
            _bar(used / total if total > 0 else 0.0, inner), _text(mem_text, 10),
            int(_num(g.get("granted_milli"))), _text(health, 8), _work_text(g),
        ), width))
    if not _rows(shown.get("gpus")):
        lines.append("(no GPUs connected)")
    if hidden:
        lines.append(f"... {hidden} more GPU(s): enlarge the window")
    return [_fit(line, width) for line in lines[:height]]


def _top_screen(stdscr: Any, fetch: Callable[[], Any], interval: float) -> int:
    import curses

    try:
        curses.curs_set(0)
    except curses.error:  # terminals without cursor control
        pass
    status: Mapping[str, Any] | None = None
    prev: Mapping[str, Any] | None = None
    next_fetch = 0.0
    while True:
        now = monotonic()
        if now >= next_fetch:
            next_fetch = now + interval
            try:
                result = fetch()
            except (GpudError, zmq.ZMQError) as exc:
                log.debug("top: status failed: %s", exc)
                result = None
            if isinstance(result, dict):
                if status is not None:
                    prev = status
                status = result
            elif status is not None:
                prev, status = status, None
        height, width = stdscr.getmaxyx()
        stdscr.erase()
        for y, line in enumerate(render(status, prev, width, height)):
            try:
                stdscr.addstr(y, 0, line)
            except curses.error:  # the bottom-right cell cannot be written; the rest is there
                pass
        stdscr.refresh()
        stdscr.timeout(max(1, int((next_fetch - monotonic()) * 1000)))
        key = stdscr.getch()
        if key in (ord("q"), ord("Q")):
            return EXIT_OK


def top(endpoint: str, interval: float = 1.0, timeout: float = 1.0) -> int:
    """Run the live view until ``q`` or Ctrl-C; the terminal is restored either way."""
    import curses

    ctx: zmq.Context[Any] = zmq.Context()
    try:
        return curses.wrapper(
            _top_screen, lambda: admin_call(endpoint, "status", timeout=timeout, context=ctx), interval
        )
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        ctx.term()


# --------------------------------------------------------------------------- command line


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _add_command(sub: Any, spec: CommandSpec) -> None:
    p = sub.add_parser(
        spec.name,
        help=spec.summary,
        description=spec.doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for a in spec.args:
        kw: dict[str, Any] = {"help": a.help, "type": a.type}
        if a.choices:
            kw["choices"] = a.choices
        else:
            kw["metavar"] = a.metavar or a.name.upper()
        if a.positional:
            p.add_argument(a.name, **kw)
        else:
            p.add_argument(a.flag, dest=a.name, default=None, **kw)
    p.add_argument("--json", action="store_true", help="print the raw result as JSON")
    if spec.name == "openstack":  # openstack (issue 7): `boot N`, `replace WORKER` without the flags
        p.add_argument("operand", nargs="?", metavar="N|WORKER",
                       help="boot: how many (as --count); replace, retire: the worker (as --worker)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudctl",
        description="Ask a gpud broker how it is doing, and steer it, through its admin socket.",
        epilog="exit status: 0 ok, 1 error reply, 2 usage, 3 no answer from the broker. "
        "Who may use the admin socket is decided by its file permissions (0600 IPC by default).",
    )
    parser.add_argument(
        "--admin",
        metavar="EP",
        default=os.environ.get("GPUD_ADMIN", DEFAULT_ADMIN_ENDPOINT),
        help="the broker's admin endpoint (default: $GPUD_ADMIN or %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for the broker (default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="WARNING",
        help="logging level (default %(default)s)",
    )
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    for spec in COMMANDS.values():
        _add_command(sub, spec)
    view = sub.add_parser(
        "top",
        help="A live view of every GPU, refreshed every second (q quits).",
        description="A live view: the broker's role and peer, uptime, queue depth and requests per "
        "second, then one row per GPU with utilization and memory bars, grants, health and running "
        "work. Quits on q or Ctrl-C; keeps trying while the broker does not answer.",
    )
    view.add_argument("--interval", metavar="S", type=float, default=1.0,
                      help="seconds between refreshes (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of ``gpudctl``; returns the exit status."""
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    setup_logging(ns.log_level, name="gpudctl")
    stdout = sys.stdout if out is None else out
    if not ns.timeout > 0:
        print("gpudctl: --timeout must be positive", file=sys.stderr)
        return EXIT_USAGE
    if ns.cmd == "top":
        if not ns.interval > 0:
            print("gpudctl: --interval must be positive", file=sys.stderr)
            return EXIT_USAGE
        return top(ns.admin, ns.interval, min(ns.timeout, max(ns.interval, 1.0)))
    spec = COMMANDS[ns.cmd]
    args = {a.name: getattr(ns, a.name) for a in spec.args if getattr(ns, a.name) is not None}
    if ns.cmd == "openstack":  # openstack (issue 7)
        try:
            args = _openstack_args(ns.operand, args)
        except ValueError as exc:
            print(f"gpudctl: openstack: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        result = admin_call(ns.admin, ns.cmd, args, timeout=ns.timeout)
    except Timeout:
        print(
            f"gpudctl: the broker at {ns.admin} did not answer within {ns.timeout:g}s "
            "(is it running, and is this its admin endpoint?)",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    except GpudError as exc:
        print(f"gpudctl: {ns.cmd} failed: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except zmq.ZMQError as exc:
        print(f"gpudctl: cannot use endpoint {ns.admin!r}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if ns.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=_jsonable), file=stdout)
    elif ns.cmd == "status" and not isinstance(result, dict):
        print(f"gpudctl: {ns.cmd}: the broker's result is not a map", file=sys.stderr)
        return EXIT_ERROR
    else:
        print(render_result(ns.cmd, result), file=stdout)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
