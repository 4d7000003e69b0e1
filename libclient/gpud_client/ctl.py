"""gpudctl: the admin command line. It owns the admin dialog's client side (ADMIN -> REPLY) and the
human rendering of what the broker reports.

Exit status: 0 success, 1 the broker answered with an error (or an unusable reply), 2 usage error,
3 the broker did not answer in time.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from time import monotonic
from typing import Any, TextIO

import zmq

from gpud.errors import GpudError, Timeout
from gpud.log import setup_logging
from gpud.protocol import Command, Peer, decode, id_text, new_id
from gpud_client import _request as rq

__all__ = ["DEFAULT_ADMIN_ENDPOINT", "admin_call", "format_status", "main"]

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
        sock.send_multipart(rq.admin_frames(rid, cmd, args), flags=zmq.NOBLOCK)
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


def format_status(status: Mapping[str, Any]) -> str:
    """The ``status`` result as a table of at most 80 columns: one summary line, one row per GPU.

    Tolerates missing or odd fields (it is for people; ``--json`` gives the exact data).
    """
    broker = _map(status.get("broker"))
    counts = _map(status.get("counts"))
    lines = [
        "broker {} ({}, {}) up {}  policy {}".format(
            _text(broker.get("name", "?"), 20),
            _text(broker.get("role", "?"), 10),
            _text(broker.get("version", "?"), 10),
            _duration(_num(broker.get("uptime_s"))),
            _text(broker.get("policy", "?"), 14),
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
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudctl",
        description="Ask a gpud broker how it is doing, through its admin socket.",
        epilog="exit status: 0 ok, 1 error reply, 2 usage, 3 no answer from the broker",
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
    status = sub.add_parser("status", help="the broker, its workers and GPUs, and the work counts")
    status.add_argument("--json", action="store_true", help="print the raw result as JSON")
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
    try:
        result = admin_call(ns.admin, ns.cmd, {}, timeout=ns.timeout)
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
    elif not isinstance(result, dict):
        print(f"gpudctl: {ns.cmd}: the broker's result is not a map", file=sys.stderr)
        return EXIT_ERROR
    else:
        print(format_status(result), file=stdout)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
