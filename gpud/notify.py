"""The service manager's notification protocol (``sd_notify(3)``), without libsystemd.

A daemon started by systemd with ``Type=notify`` finds ``$NOTIFY_SOCKET`` in its environment: an
``AF_UNIX`` datagram socket (a path, or ``@name`` in the abstract namespace) to which it sends
newline-separated ``KEY=VALUE`` states: ``READY=1`` once it serves, ``WATCHDOG=1`` at least every
``$WATCHDOG_USEC`` microseconds while it is healthy, ``STOPPING=1`` and ``RELOADING=1``. Without
``$NOTIFY_SOCKET`` (run by hand, by ``gpud up`` or under ``--daemon``) every call does nothing.
Standard library only.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or addr[0] not in "/@":
        return None  # unset, or a vsock address (not used here)
    return "\0" + addr[1:] if addr[0] == "@" else addr


def enabled() -> bool:
    """Whether a service manager listens (``$NOTIFY_SOCKET`` is set)."""
    return _address() is not None


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, lines separated by ``\\n``); True when it was sent.

    Never raises: a service manager that went away must not take the daemon with it.
    """
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), addr)
        return True
    except OSError as exc:
        log.debug("sd_notify %r to %s failed: %s", state, addr.replace("\0", "@"), exc)
        return False


def ready(status: str | None = None) -> bool:
    """The daemon serves: its sockets are bound (``READY=1``, optionally with a ``STATUS=`` line)."""
    return notify("READY=1" if status is None else f"READY=1\nSTATUS={status}")


def status(text: str) -> bool:
    """A free-form one-line status shown by ``systemctl status``."""
    return notify(f"STATUS={text}")


def stopping() -> bool:
    """The daemon has begun to stop (``STOPPING=1``)."""
    return notify("STOPPING=1")


def reloading() -> bool:
    """The daemon reloads its configuration; send ``ready()`` when done (``RELOADING=1``).

    ``MONOTONIC_USEC`` is what ``Type=notify-reload`` (systemd 253+) expects alongside; older
    managers ignore it.
    """
    return notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def watchdog() -> bool:
    """The daemon is alive and its loop turns (``WATCHDOG=1``)."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """The watchdog timeout in seconds (``$WATCHDOG_USEC``), or None when there is none for this
    process (unset, invalid, or ``$WATCHDOG_PID`` names another process). Ping at half of it."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not enabled():
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
