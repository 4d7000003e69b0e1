"""gpud_client: the client library that user VMs link to run GPU work through a gpud broker.

Needs only pyzmq and msgpack; numpy arrays and scalars are accepted, never required::

    import array
    from gpud_client import BUILTIN, Client, CurveKeys

    keys = CurveKeys.from_files("alice.key_secret", "broker.key")
    with Client(["tcp://gpud-a:5555", "tcp://gpud-b:5555"], curve=keys) as client:
        print(client.run(["nvidia-smi", "-L"]).stdout.decode())
        with client.session(mem=64 << 20) as s:
            x = s.mem_alloc(4 * 1024)
            s.memcpy_htod(x, array.array("f", [1.0] * 1024))
            s.launch(BUILTIN, "saxpy", 4, 256, (("f32", 2.0), x, x, ("i32", 1024)))
            ...

A :class:`Client` is not thread-safe: a call while another thread is inside one raises
:class:`~gpud.errors.GpudError` (use one Client per thread). Errors are the :mod:`gpud.errors`
classes, re-exported here.

The library logs to the ``gpud_client`` and ``gpud`` loggers and, as a library, configures no
output: with no logging configured by the application, nothing is printed; an application's
``logging`` configuration decides what is.
"""

import logging

from gpud import __version__
from gpud.errors import (
    AuthError,
    Busy,
    Cancelled,
    ConfigError,
    ConflictError,
    GpudError,
    GpuFault,
    InternalError,
    InvalidRequest,
    NoCapacity,
    NotActive,
    OutOfMemory,
    ProtocolError,
    RemoteError,
    SessionLost,
    ShuttingDown,
    Timeout,
    TooLarge,
    UnknownCommand,
    VersionError,
    WorkerLost,
)
from gpud.security import CurveKeys
from gpud_client._request import BUILTIN, DevicePtr, JobResult, Need
from gpud_client.client import Client
from gpud_client.connection import Job, Pending
from gpud_client.session import Session

__all__ = [
    "BUILTIN",
    "AuthError",
    "Busy",
    "Cancelled",
    "Client",
    "ConfigError",
    "ConflictError",
    "CurveKeys",
    "DevicePtr",
    "GpudError",
    "GpuFault",
    "InternalError",
    "InvalidRequest",
    "Job",
    "JobResult",
    "Need",
    "NoCapacity",
    "NotActive",
    "OutOfMemory",
    "Pending",
    "ProtocolError",
    "RemoteError",
    "Session",
    "SessionLost",
    "ShuttingDown",
    "Timeout",
    "TooLarge",
    "UnknownCommand",
    "VersionError",
    "WorkerLost",
    "__version__",
]

# Not Python's last-resort handler (WARNING and up to stderr) in applications that set up no
# logging: a library leaves its output to the application's logging configuration.
for _name in ("gpud_client", "gpud"):
    logging.getLogger(_name).addHandler(logging.NullHandler())
del _name
