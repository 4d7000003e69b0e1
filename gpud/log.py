"""Logging setup. Called only from a daemon's or tool's main(); library modules never configure logging.

One event is one line, ``time level component[pid] logger: message``, wherever it goes (stderr and
so journald by default, a file, or syslog): newlines inside a message and an exception's traceback
are folded into the line as ``\\n`` (the traceback as a trailing ``exc=`` field), so ``grep`` and
journald see whole events. When stderr is journald's stream (``$JOURNAL_STREAM``), each line also
starts with its ``<N>`` syslog priority, so ``journalctl -p warning`` works.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

SYSLOG = "syslog"  # the ``--log-file`` value that means "to syslog"

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def fold(text: str) -> str:
    """Make ``text`` one line: line breaks become the two characters ``\\n``."""
    return text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n")


class OneLineFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose every record is exactly one line.

    An exception (``log.exception``) or stack (``stack_info=True``) follows the message as an
    ``exc=`` or ``stack=`` field, folded like the message. With ``priority_prefix`` each line
    starts with ``<N>``, the record's syslog priority, as journald's stream reader expects.
    """

    def __init__(self, fmt: str, datefmt: str | None = None, priority_prefix: bool = False) -> None:
        super().__init__(fmt, datefmt)
        self.priority_prefix = priority_prefix

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # ISO 8601 with milliseconds and no space inside, so the time is one field.
        return super().formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        exc_info, exc_text, stack_info = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = exc_info, exc_text, stack_info
        if exc_info:
            line += " exc=" + self.formatException(exc_info)
        elif exc_text:
            line += " exc=" + exc_text
        if stack_info:
            line += " stack=" + self.formatStack(stack_info)
        line = fold(line)
        if self.priority_prefix:
            line = f"<{_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)}>{line}"
        return line


def _stderr_is_journal() -> bool:
    """Whether stderr is connected to journald (``$JOURNAL_STREAM`` is its ``device:inode``)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(level: str | int | None = None, name: str = "gpud", target: str | None = None) -> None:
    """Send every log record, one line each, to ``target``; level from argument or ``GPUD_LOG_LEVEL``.

    Args:
        level: a level name or number; default ``$GPUD_LOG_LEVEL`` or INFO.
        name: the component written in each line (``gpud-broker``), and the syslog ident.
        target: None for stderr; ``"syslog"`` for the local syslog socket (facility daemon); else
            a file path, opened for appending (a ``WatchedFileHandler``: it reopens the file when
            logrotate moves it).
    """
    chosen = level if level is not None else os.environ.get("GPUD_LOG_LEVEL", "INFO")
    if isinstance(chosen, str):
        chosen = chosen.upper()
    handler: logging.Handler
    if target == SYSLOG:
        address = "/dev/log" if os.path.exists("/dev/log") else ("localhost", logging.handlers.SYSLOG_UDP_PORT)
        handler = logging.handlers.SysLogHandler(address, facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        handler.ident = f"{name}[{os.getpid()}]: "
        handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        if target:
            handler = logging.handlers.WatchedFileHandler(target, encoding="utf-8")
        else:
            handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            OneLineFormatter(
                f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s",
                priority_prefix=not target and _stderr_is_journal(),
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)
