"""The one exception tree of gpud, and the one table from exceptions to wire error codes.

Every reply path (broker, worker, client library) maps errors through ``CODES``/``error_for``;
no other module invents code strings.
"""

from __future__ import annotations

import errno


class GpudError(Exception):
    """Root of every gpud error. ``code`` is the stable wire code (docs/PROTOCOL.md §7)."""

    code = "INTERNAL"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message or self.__class__.__name__)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])

    @property
    def errno(self) -> int:
        return ERRNO.get(self.code, errno.EIO)


class InvalidRequest(GpudError):
    code = "INVALID_REQUEST"


class ProtocolError(GpudError):
    code = "PROTOCOL"


class VersionError(ProtocolError):
    code = "VERSION"


class UnknownCommand(ProtocolError):
    code = "UNKNOWN_COMMAND"


class TooLarge(ProtocolError):
    code = "TOO_LARGE"


class Busy(GpudError):
    code = "BUSY"


class Timeout(GpudError):
    code = "TIMEOUT"


class NoCapacity(GpudError):
    code = "NO_CAPACITY"


class Cancelled(GpudError):
    code = "CANCELLED"


class WorkerLost(GpudError):
    code = "WORKER_LOST"


class SessionLost(GpudError):
    code = "SESSION_LOST"


class OutOfMemory(GpudError):
    code = "OUT_OF_MEMORY"


class RemoteError(GpudError):
    code = "REMOTE_ERROR"


class ShuttingDown(GpudError):
    code = "SHUTTING_DOWN"


class NotActive(GpudError):
    """This broker is the passive one of a Binary Star pair: the client should use the other."""

    code = "NOT_ACTIVE"


class GpuFault(GpudError):
    """The GPU failed (XID, ECC, fell off the bus) while running the work."""

    code = "GPU_FAULT"


class ResultExpired(GpudError):
    """A retry of work that ran, whose reply had to be dropped early: it is not run again."""

    code = "RESULT_EXPIRED"


class InternalError(GpudError):
    code = "INTERNAL"


class ConfigError(GpudError):
    """A configuration or command-line value is wrong; never sent on the wire."""

    code = "INVALID_REQUEST"


class AuthError(GpudError):
    code = "INVALID_REQUEST"


class ConflictError(GpudError):
    code = "INVALID_REQUEST"


# code -> (exception class, errno). The order is the table in docs/PROTOCOL.md §7.
CODES: dict[str, tuple[type[GpudError], int]] = {
    "INVALID_REQUEST": (InvalidRequest, errno.EINVAL),
    "PROTOCOL": (ProtocolError, errno.EPROTO),
    "VERSION": (VersionError, errno.EPROTONOSUPPORT),
    "UNKNOWN_COMMAND": (UnknownCommand, errno.EOPNOTSUPP),
    "TOO_LARGE": (TooLarge, errno.EMSGSIZE),
    "BUSY": (Busy, errno.EBUSY),
    "TIMEOUT": (Timeout, errno.ETIMEDOUT),
    "NO_CAPACITY": (NoCapacity, errno.ENOSPC),
    "CANCELLED": (Cancelled, errno.ECANCELED),
    "WORKER_LOST": (WorkerLost, errno.EHOSTDOWN),
    "SESSION_LOST": (SessionLost, errno.ENOTCONN),
    "OUT_OF_MEMORY": (OutOfMemory, errno.ENOMEM),
    "REMOTE_ERROR": (RemoteError, errno.EREMOTEIO),
    "SHUTTING_DOWN": (ShuttingDown, errno.ESHUTDOWN),
    "NOT_ACTIVE": (NotActive, errno.EAGAIN),
    "GPU_FAULT": (GpuFault, errno.ENODEV),
    "RESULT_EXPIRED": (ResultExpired, errno.ESTALE),
    "INTERNAL": (InternalError, errno.ENOTRECOVERABLE),
}

ERRNO: dict[str, int] = {code: num for code, (_, num) in CODES.items()}


def error_for(code: str, message: str) -> GpudError:
    """Build the exception for a wire ``code``; an unknown code becomes a generic GpudError."""
    entry = CODES.get(code)
    if entry is None:
        return GpudError(f"{message} (unknown error code {code!r})", code=code)
    return entry[0](message)
