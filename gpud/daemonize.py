"""How ``gpud broker`` and ``gpud worker`` start: their shared flags, their configuration and
logging, and ``--daemon``: run a daemon detached from its terminal, for hosts without systemd.

Uses python-daemon (extra ``daemon``): double fork, new session, standard streams to ``/dev/null``
(or to the log file, so a crash's last words are kept), a PID file, and SIGTERM as a clean exit
until the daemon installs its own handler (which drains). The PID file is python-daemon's
``TimeoutPIDLockFile`` (created with ``O_EXCL`` by its ``lockfile`` dependency, removed at exit);
a stale one, whose process is gone, is removed first, and a live one refuses the start while the
command still has its terminal to say so. Under systemd none of this is wanted: use the units in
``systemd/`` (``Type=notify``), which log to journald through stderr.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpud.errors import ConfigError
from gpud.log import SYSLOG, setup_logging

if TYPE_CHECKING:
    from gpud.config import GpudConfig


def main(
    prog: str,
    description: str,
    add_daemon_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """A daemon command's ``main``: parse ``argv`` with the daemon's flags and ``run`` it."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_daemon_arguments(p)
    return run(p.parse_args(argv))


def configure(
    args: argparse.Namespace, load: Callable[[argparse.Namespace], GpudConfig], program: str
) -> tuple[GpudConfig, str | None]:
    """The daemon's configuration, ``load(args)`` (ConfigError), and its ``log_target``, with
    logging set up for the start: there, or to stderr while a ``--daemon`` has its terminal."""
    cfg = load(args)
    target = log_target(args, cfg.logging.file)
    setup_logging(cfg.logging.level, program, None if args.daemon else target)
    return cfg, target


def start(args: argparse.Namespace, program: str, level: str, target: str | None) -> None:
    """Check the flags (``check``); with ``--daemon``, detach (only the grandchild returns) and log
    to ``target`` from then on. Call it before NVML, threads or sockets. Raises ConfigError."""
    check(args)
    if args.daemon:
        detach(args.pid_file, target)
        setup_logging(level, program, target)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``gpud broker`` and ``gpud worker`` share: ``--daemon``, ``--pid-file``, ``--log-file``."""
    p.add_argument("--daemon", action="store_true",
                   help="detach from the terminal and run in the background (hosts without systemd; needs the extra 'daemon')")
    p.add_argument("--pid-file", default=None, metavar="PATH", help="with --daemon: write the daemon's PID here; removed at exit")
    p.add_argument("--log-file", default=None, metavar="PATH|syslog",
                   help="log to this file (reopened after logrotate moves it), or to syslog with 'syslog' "
                        "(default stderr; with --daemon, syslog)")


def log_target(args: argparse.Namespace, configured: str = "") -> str | None:
    """Where logs go: ``--log-file``, else ``configured`` (``[logging] file``), else stderr (None),
    except that a daemon has no stderr: it logs to syslog then."""
    target = args.log_file or configured or None
    if target is None and args.daemon:
        return SYSLOG
    if target is not None and target != SYSLOG:
        return os.path.abspath(target)
    return target


def check(args: argparse.Namespace) -> None:
    """Refuse flag combinations that cannot work, before anything starts (``ConfigError``)."""
    if args.pid_file and not args.daemon:
        raise ConfigError("--pid-file needs --daemon (under systemd the manager tracks the PID)")


def _running_pid(path: str) -> int | None:
    """The PID in an existing PID file when that process is alive; removes a stale file."""
    try:
        with open(path) as f:
            pid = int(f.read().strip() or "0")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        pid = 0
    if pid > 0:
        try:
            os.kill(pid, 0)
            return pid
        except PermissionError:
            return pid  # alive, another user's
        except ProcessLookupError:
            pass
    os.unlink(path)  # stale: its process is gone (or the file is garbage)
    return None


def detach(pid_file: str | None, log_file: str | None) -> Any:
    """Become a daemon now; returns the open ``daemon.DaemonContext`` (closed at exit).

    Call it before any socket, thread or ZeroMQ context exists: only the grandchild returns, and
    the parent exits 0 at once. The working directory is kept, so relative paths given on the
    command line keep their meaning; the umask is kept too.

    Args:
        pid_file: where to write the daemon's PID (None: no PID file).
        log_file: the log file (the daemon's stdout and stderr go there too), ``"syslog"`` or None.

    Raises:
        ConfigError: python-daemon is missing, or ``pid_file`` names a live process.
    """
    try:
        import daemon
        import daemon.pidfile
    except ImportError:
        raise ConfigError("--daemon needs python-daemon: pip install 'gpud[daemon]'") from None
    pidfile = None
    if pid_file:
        pid_file = os.path.abspath(pid_file)
        pid = _running_pid(pid_file)
        if pid is not None:
            raise ConfigError(f"PID file {pid_file}: gpud is already running as PID {pid}")
        pidfile = daemon.pidfile.TimeoutPIDLockFile(pid_file, acquire_timeout=0)
    stream = None
    if log_file and log_file != SYSLOG:
        stream = open(os.path.abspath(log_file), "a", buffering=1, encoding="utf-8")
    umask = os.umask(0o022)
    os.umask(umask)
    context = daemon.DaemonContext(
        detach_process=True,
        working_directory=os.getcwd(),
        umask=umask,
        pidfile=pidfile,
        stdout=stream,
        stderr=stream,
    )
    context.open()
    return context
