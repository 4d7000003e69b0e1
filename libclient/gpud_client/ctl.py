"""gpudctl: the admin command line. It owns the admin dialog's client side (ADMIN -> REPLY), the
human rendering of what the broker reports, and ``gpudctl top``, the live view.

Its subcommands are generated from the broker's command table (``gpud.admin_commands``): one per
admin command, with the command's docstring as help and its argument schema as options, each with
``--json`` for the raw result. Each request declares who asks (user and pid) for the broker's log;
the admin socket's file permissions decide who may ask at all.

Exit status: 0 success, 1 the broker answered with an error (or an unusable reply), 2 usage error,
3 the broker did not answer in time (or its admin socket is not there, or not ours to use).
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import os
import stat
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
from gpud_client import _request

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
        sock.send_multipart(_request.admin_frames(rid, cmd, args, _who() if who is None else who), flags=zmq.NOBLOCK)
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
                    raise _request.error_from(msg.header)
                log.debug("dropped a reply for another request %r", got)
                continue
            log.debug("admin %s %s answered", cmd, id_text(rid))
            header = _request.check_reply(msg)
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
WIDTH = 80  # columns of the human output where the terminal's width is unknown
_GAP = "  "  # between two columns


def _role(broker: Mapping[str, Any]) -> str:
    """``standalone``, or a pair member's role, state and epoch (``backup active e3``)."""
    role = str(broker.get("role", "?"))
    state = broker.get("state")
    if role == "standalone" or not isinstance(state, str):
        return role
    epoch = broker.get("epoch")
    return f"{role} {state}" + (f" e{epoch}" if isinstance(epoch, int) else "")


def _budget_lines(budgets: Mapping[str, Any]) -> list[str]:
    """The budgets lines of ``status`` (none when the broker does not say)."""
    if not budgets:
        return []
    d = _map(budgets.get("default"))
    own = _map(budgets.get("tenants"))
    return ["budgets per tenant: queued {} outstanding {} bytes {} sessions {} deadline {} replies {}{}".format(
        int(_num(d.get("max_queued"))), int(_num(d.get("max_outstanding"))), _bytes(_num(d.get("max_bytes"))),
        int(_num(d.get("max_sessions"))), _duration(_num(d.get("max_deadline_ms")) / 1000),
        _bytes(_num(d.get("reply_bytes"))), f" ({len(own)} tenant(s) with their own)" if own else ""),
        f"held {_bytes(_num(budgets.get('held_bytes')))} of {_bytes(_num(budgets.get('max_held_bytes')))} payload"]


def _connection_lines(conns: Mapping[str, Any]) -> list[str]:
    """The frontend connections line of ``status`` (none when the broker does not say)."""
    if not conns:
        return []
    refused = _map(conns.get("refused"))
    held = conns.get("held_off")
    held_off = [str(h) for h in held] if isinstance(held, list) else []
    return ["connections {} of {} ({} per source) from {} source(s); refused {} over a source's bound, {} over "
            "the total{}".format(
                int(_num(conns.get("connections"))), int(_num(conns.get("max_connections"))),
                int(_num(conns.get("max_connections_per_source"))), int(_num(conns.get("sources"))),
                int(_num(refused.get("per_source"))), int(_num(refused.get("total"))),
                f"; held off for refused handshakes: {', '.join(held_off)}" if held_off else "")]


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.0f}{unit}"
    return f"{n:.0f}B"


def _wrap(text: Any, first: str, width: int | None) -> list[str]:
    """``text`` after ``first`` in lines of at most ``width`` columns (None: one line), the rest
    indented under it: a sentence is wrapped, never cut."""
    import textwrap

    if not isinstance(text, str) or not text:
        return []
    if width is None:
        return [first + text]
    return textwrap.wrap(text, max(20, width), initial_indent=first, subsequent_indent=" " * (len(first) + 2),
                         break_on_hyphens=False)


def _fit(line: str, width: int | None) -> str:
    line = line.rstrip()
    return line if width is None or len(line) <= width else line[: max(0, width - 1)] + "~"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None, empty: str,
           right: Sequence[int] = (), notes: Mapping[int, list[str]] | None = None) -> list[str]:
    """Rows under ``header``, each column as wide as its widest cell. Only where that is wider
    than ``width`` (the terminal's) do the widest columns give up characters (cut with ``~``),
    down to their header's width. ``right``: columns aligned right. ``notes``: lines printed
    under row I (sentences: wrapped, never cut)."""
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    if width is not None:
        over = sum(widths) + len(_GAP) * (len(widths) - 1) - width
        while over > 0:
            i = max(range(len(widths)), key=lambda i: widths[i] - max(len(header[i]), 3))
            if widths[i] <= max(len(header[i]), 3):
                break
            widths[i] -= 1
            over -= 1

    def line(row: Sequence[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(row, widths, strict=True)):
            text = cell if len(cell) <= w else cell[: max(0, w - 1)] + "~"
            out.append(text.rjust(w) if i in right else text.ljust(w))
        return _fit(_GAP.join(out), width)

    lines = [line(header)]
    for i, row in enumerate(cells):
        lines.append(line(row))
        lines += (notes or {}).get(i, [])
    if not rows:
        lines.append(empty)
    return lines


def _by_position(gpus: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(gpus, key=lambda g: (str(g.get("worker", "")), int(_num(g.get("index")))))


def _gpu_name(g: Mapping[str, Any]) -> str:
    """WORKER/INDEX, as the broker names GPUs (cordon takes it)."""
    return str(g.get("name") or f"{g.get('worker')}/{int(_num(g.get('index')))}")


def _mem(g: Mapping[str, Any]) -> str:
    return f"{_num(g.get('mem_used')) / GIB:.1f}/{_num(g.get('mem')) / GIB:.1f}"


def format_status(status: Mapping[str, Any], width: int | None = WIDTH) -> str:
    """The ``status`` result for people: who this broker is, its peer (endpoint and state), the
    counts, then one row per GPU. Tolerates missing or odd fields (``--json`` gives the exact data)."""
    broker = _map(status.get("broker"))
    pair = _map(status.get("pair"))
    counts = _map(status.get("counts"))
    head = "broker {} ({}, {}) up {}  policy {}".format(
        broker.get("name", "?"), _role(broker), broker.get("version", "?"),
        _duration(_num(broker.get("uptime_s"))), broker.get("policy", "?"))
    lines = _wrap(head, "", width)
    peer = broker.get("peer")
    if peer is not None:
        state = pair.get("peer_state")
        heard = pair.get("peer_silent_s")
        said = f"{state}, heard {_duration(_num(heard))} ago" if isinstance(state, str) else "not heard from yet"
        if pair.get("synced") is False:
            said += "; not in sync"
        lines += _wrap(f"peer {peer}: {said}", "", width)
    lines += _wrap("  ".join(f"{k} {int(_num(counts.get(k)))}" for k in _COUNTS), "", width)
    for line in [*_budget_lines(_map(status.get("budgets"))), *_connection_lines(_map(status.get("connections")))]:
        lines += _wrap(line, "", width)
    lines.append("")
    gpus = _by_position(_rows(status.get("gpus")))
    rows = [(g.get("worker"), int(_num(g.get("index"))), g.get("model"), "SIM" if g.get("simulated") is True else "",
             f"{_num(g.get('util')):.0f}%", _mem(g), int(_num(g.get("granted_milli"))), int(_num(g.get("tasks"))),
             g.get("health", "?")) for g in gpus]
    lines += _table(("WORKER", "IDX", "MODEL", "", "UTIL", "MEM GiB", "MILLI", "TASKS", "HEALTH"), rows, width,
                    "(no GPUs connected)", right=(1, 4, 5, 6, 7))
    lines += _health_notes(gpus, width)
    return "\n".join(lines)


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


def _isolation_text(w: Mapping[str, Any]) -> str:
    """A worker's isolation: ``namespaces``, ``ns, host net`` (job_network host) or ``RLIMITS ONLY``
    (no namespaces: shouted, it is the weaker one); ``?`` when it did not say."""
    level = w.get("isolation")
    if level == "namespaces":
        return "ns, host net" if w.get("job_network") == "host" else "namespaces"
    return "RLIMITS ONLY" if level == "rlimits only" else "?"


def _worker_state(w: Mapping[str, Any]) -> str:
    """``SUSPENDED 7s left`` (silent, its grace window running out: shouted), ``draining`` or ``ok``."""
    if w.get("suspended") is True:
        return f"SUSPENDED {_duration(_num(w.get('grace_left_s')))} left"
    return "draining" if w.get("draining") is True else "ok"


def _format_workers(result: Any, width: int | None) -> list[str]:
    rows = [
        (w.get("name"), w.get("hostname") or "-", int(_num(w.get("gpus"))),
         f"{int(_num(w.get('inflight')))}/{int(_num(w.get('slots')))}", _worker_state(w),
         len(w.get("running") or []) if isinstance(w.get("running"), list) else 0,
         _duration(_num(w.get("last_heard_s"))), _isolation_text(w), "SIM" if w.get("simulated") is True else "")
        for w in _rows(result)
    ]
    return _table(("WORKER", "HOST", "GPUS", "INFLIGHT", "STATE", "RUN", "HEARD", "ISOLATION", ""), rows, width,
                  "(no workers connected)", right=(2, 3, 5, 6))


def _health_notes(gpus: Sequence[Mapping[str, Any]], width: int | None) -> list[str]:
    """One line per GPU that its worker counts failed: why, and when its probation ends."""
    notes = []
    for g in _by_position(gpus):
        reason = g.get("health_reason")
        if g.get("measured_health", g.get("health")) != "failed" and not reason:
            continue
        line = f"{_gpu_name(g)} failed: {reason or 'unknown'}"
        left = _num(g.get("probation_left_s"))
        if left > 0:
            line += f"; on probation, serves again in {_duration(math.ceil(left))}"
        notes += _wrap(line, "", width)
    return ["", *notes] if notes else []


def _format_gpus(result: Any, width: int | None) -> list[str]:
    rows = [(_gpu_name(g), g.get("model"), "SIM" if g.get("simulated") is True else "", f"{_num(g.get('util')):.0f}%",
             _mem(g), f"{_num(g.get('temp')):.0f}C", int(_num(g.get("granted_milli"))), _work_text(g), g.get("health", "?"))
            for g in _rows(result)]
    return _table(("GPU", "MODEL", "", "UTIL", "MEM GiB", "TEMP", "MILLI", "RUNNING", "HEALTH"), rows, width,
                  "(no GPUs connected)", right=(3, 4, 5, 6)) + _health_notes(_rows(result), width)


def _needs_text(needs: Any) -> str:
    """``2 GPUs 16G``, ``250 milli 1.0G sm>=8.0``: what a queued request asks for."""
    n = _map(needs)
    parts = [f"{int(_num(n['gpus']))} GPU{'s' if _num(n['gpus']) != 1 else ''}" if "gpus" in n
             else f"{int(_num(n.get('gpu_milli')))} milli" if "gpu_milli" in n else "-"]
    if n.get("mem"):
        parts.append(_gib(n["mem"]))
    if n.get("cpu_milli"):
        parts.append(f"cpu {int(_num(n['cpu_milli']))}")
    if n.get("host_mem"):
        parts.append(f"host {_gib(n['host_mem'])}")
    if isinstance(n.get("models"), list):
        parts.append("/".join(map(str, n["models"])))
    if isinstance(n.get("min_cc"), list) and len(n["min_cc"]) == 2:
        parts.append(f"sm>={n['min_cc'][0]}.{n['min_cc'][1]}")
    if n.get("exclusive") is True:
        parts.append("exclusive")
    return " ".join(parts)


def _format_queue(result: Any, width: int | None) -> list[str]:
    queued = _rows(result)
    rows = [(_short_id(t.get("id")), t.get("kind"), t.get("tenant"), int(_num(t.get("priority"))),
             _duration(_num(t.get("waited_s"))), _needs_text(t.get("needs")), t.get("wait") or "-") for t in queued]
    notes = {i: _wrap(t.get("why"), "    why: ", width) for i, t in enumerate(queued)}
    return _table(("ID", "KIND", "TENANT", "PRIO", "WAITED", "NEEDS", "WAIT"), rows, width, "(nothing queued)",
                  right=(3, 4), notes=notes)


def _format_tasks(result: Any, width: int | None) -> list[str]:
    res = _map(result)
    tasks = _rows(res.get("tasks"))
    rows = []
    for t in tasks:
        names = t.get("gpu_names") if isinstance(t.get("gpu_names"), list) and t.get("gpu_names") else t.get("gpus")
        gpus = [str(u) for u in names if isinstance(u, str)] if isinstance(names, list) else []
        rows.append((_short_id(t.get("id")), t.get("state"), t.get("kind"), t.get("tenant"), t.get("worker") or "-",
                     ",".join(gpus) or "-", _duration(_num(t.get("age_s")))))
    lines = [f"{int(_num(res.get('matched')))} matching, {len(rows)} shown (newest first)"]
    return lines + _table(("ID", "STATE", "KIND", "TENANT", "WORKER", "GPU", "AGE"), rows, width, "(none)", right=(6,))


def _format_sessions(result: Any, width: int | None) -> list[str]:
    rows = [(_short_id(s.get("id")), s.get("tenant"), s.get("worker"), s.get("gpu_name") or s.get("gpu"),
             int(_num(s.get("gpu_milli"))), _gib(s.get("mem")), _duration(_num(s.get("age_s"))),
             _duration(_num(s.get("last_seen_s"))))
            for s in _rows(result)]
    return _table(("ID", "TENANT", "WORKER", "GPU", "MILLI", "MEM", "AGE", "SEEN"), rows, width,
                  "(no open sessions)", right=(4, 5, 6, 7))


def _format_openstack(result: Any, width: int | None) -> list[str]:
    """``gpudctl openstack``: list, actions, or the message of a change."""
    res = _map(result)
    action = res.get("action")
    if action == "actions":
        return _openstack_actions(_rows(res.get("actions")), width)
    if action != "list":
        return _wrap(res.get("message"), "", width)
    listed = res.get("listed_s")
    lines = _wrap("pool {} server(s), min {} max {}; heal {}, scale {}; {}".format(
        int(_num(res.get("size"))), int(_num(res.get("min_workers"))), int(_num(res.get("max_workers"))),
        "on" if res.get("heal") is True else "off", "on" if res.get("scale") is True else "off",
        "Nova not listed yet" if listed is None else f"listed {_duration(_num(listed))} ago"), "", width)
    lines += _wrap(res.get("list_error"), "Nova: ", width)
    lines += _wrap(res.get("boot_problem"), "cannot boot: ", width)
    servers = _rows(res.get("servers"))
    rows = []
    for s in servers:
        addresses = [a for a in s.get("addresses") or [] if isinstance(a, str)] if isinstance(s.get("addresses"), list) else []
        worker = f"{s.get('worker')} ({s.get('worker_state')})" if s.get("worker") else "NO WORKER"
        rows.append((s.get("name"), s.get("status"), s.get("host") or "-", addresses[0] if addresses else "-",
                     s.get("pci_alias") or s.get("vgpu") or "-", worker))
    lines += _table(("SERVER", "STATUS", "HOST", "ADDRESS", "GPU", "WORKER"), rows, width,
                    "(no gpud servers)" if listed is not None else "(none yet)")
    for s in servers:
        lines += _wrap(s.get("action"), f"{s.get('name')}: action ", width)
        lines += _wrap(s.get("fault"), f"{s.get('name')}: fault: ", width)
    lonely = _rows(res.get("workers_without_server"))
    if lonely:
        lines += ["", "workers without a server:"]
        for w in lonely:
            lines += _wrap(f"{w.get('name')} {w.get('instance_id') or '-'}: {w.get('why')}", "  ", width)
    return lines


def _openstack_actions(actions: list[Mapping[str, Any]], width: int | None) -> list[str]:
    rows = [(int(_num(a.get("id"))), a.get("kind"), a.get("step"), a.get("server_name") or "-",
             a.get("worker") or a.get("new_server_name") or "-", _duration(_num(a.get("age_s")))) for a in actions]
    notes = {i: [x for key in ("reason", "message") for x in _wrap(a.get(key), f"     {key}: ", width)]
             for i, a in enumerate(actions)}
    return _table(("ID", "KIND", "STEP", "SERVER", "WORKER/NEW", "AGE"), rows, width, "(no actions yet)",
                  right=(0, 5), notes=notes)


_FORMATS: dict[str, Callable[[Any, int | None], list[str]]] = {
    "status": lambda r, width: format_status(_map(r), width).splitlines(),
    "workers": _format_workers,
    "gpus": _format_gpus,
    "queue": _format_queue,
    "tasks": _format_tasks,
    "sessions": _format_sessions,
    "openstack": _format_openstack,
}


def render_result(cmd: str, result: Any, width: int | None = WIDTH) -> str:
    """A command's result for people: tables sized to their content, within ``width`` columns
    (the terminal's; None: no limit), sentences wrapped, never cut (``--json`` gives the exact
    data). Commands that change state answer with a ``message``; unknown shapes fall back to JSON.
    """
    fmt = _FORMATS.get(cmd)
    if fmt is not None:
        lines = fmt(result, width)
    elif isinstance(result, dict) and isinstance(result.get("message"), str):
        lines = _wrap(result["message"], "", width)
    else:
        lines = json.dumps(result, indent=2, sort_keys=True, default=_jsonable).splitlines()
    return "\n".join(lines)


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
        peer_state = _map(status.get("pair")).get("peer_state")
        shown_peer = "none" if peer is None else f"{peer} ({peer_state})" if isinstance(peer_state, str) else str(peer)
        first = "gpud top  {}  role {}  peer {}  up {}".format(
            name, _text(_role(broker), 22), shown_peer, _duration(_num(broker.get("uptime_s"))))
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
    if spec.operand is not None:
        p.add_argument("operand", nargs="?", metavar=spec.operand.metavar, help=spec.operand.help)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudctl",
        description="Ask a gpud broker how it is doing, and steer it, through its admin socket.",
        epilog="exit status: 0 ok, 1 error reply, 2 usage, 3 no answer from the broker (or no socket, or permission denied). "
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
    try:
        args = spec.with_operand(args, getattr(ns, "operand", None))
    except ValueError as exc:
        print(f"gpudctl: {ns.cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problem = endpoint_problem(ns.admin)
    if problem is not None:
        print(f"gpudctl: {problem}", file=sys.stderr)
        return EXIT_TIMEOUT
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
    if not ns.json and ns.cmd == "status" and not isinstance(result, dict):
        print(f"gpudctl: {ns.cmd}: the broker's result is not a map", file=sys.stderr)
        return EXIT_ERROR
    if ns.json:
        text = json.dumps(result, indent=2, sort_keys=True, default=_jsonable)
    else:
        text = render_result(ns.cmd, result, _width(stdout))
    try:
        print(text, file=stdout)
        stdout.flush()
    except BrokenPipeError:  # `gpudctl status --json | head`: the reader has what it wanted
        if stdout is sys.stdout:
            _quiet_stdout()
    return EXIT_OK


def _width(out: TextIO) -> int:
    """The terminal's width where ``out`` is one; else ``$COLUMNS``, else ``WIDTH`` (80)."""
    try:
        if out.isatty():
            return os.get_terminal_size(out.fileno()).columns or WIDTH
    except (OSError, ValueError, AttributeError):
        pass
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) >= 20 else WIDTH


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's own flush at exit
    does not fail again (Python's documented recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def endpoint_problem(endpoint: str) -> str | None:
    """What stops this process from reaching an ``ipc://`` admin socket at all, said at once
    rather than after a timeout: no file there, not a socket, or no permission. None for
    other endpoints (TCP: only an answer tells)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    if path.startswith("@"):  # Linux abstract namespace: no file to look at
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        where = os.path.dirname(path) or "."
        extra = "" if os.path.isdir(where) else f" (nor the directory {where})"
        return (f"no admin socket at {path}{extra}: is the broker running, with admin = {endpoint!r}? "
                "(--admin or $GPUD_ADMIN choose another)")
    except PermissionError:
        return f"permission denied: {path} (a directory above it may not be searched by this user)"
    except OSError as exc:
        return f"cannot use {path}: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket: is this the broker's admin endpoint?"
    if not os.access(path, os.R_OK | os.W_OK):
        return (f"permission denied: {path} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, "
                f"group gid {st.st_gid}): the admin socket's permissions decide who may use gpudctl")
    return None


if __name__ == "__main__":
    sys.exit(main())
