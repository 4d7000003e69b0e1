"""gpud: the shared core (wire protocol, resource model, errors, clocks). No sockets, no loops."""

__version__ = "0.1.0"
