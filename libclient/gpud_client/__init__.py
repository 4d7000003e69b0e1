"""gpud_client: the client library that user VMs link to run GPU work through a gpud broker.

Needs only pyzmq and msgpack (numpy arrays and scalars are accepted, never required)::

    from gpud_client import Client, BUILTIN
    import numpy as np

    with Client(["tcp://gpud-a:5555", "tcp://gpud-b:5555"]) as client:
        print(client.run(["nvidia-smi", "-L"]).stdout.decode())
        with client.session(mem=64 << 20) as s:
            x = s.mem_alloc(4 * 1024)
            s.memcpy_htod(x, np.ones(1024, np.float32))
            ...

A :class:`Client` is not thread-safe: use one per thread. Errors are the :mod:`gpud.errors` classes,
re-exported here.
"""

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
from gpud_client._request import BUILTIN, DevicePtr, JobResult
from gpud_client.client import Client, Job, Pending, Session

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
