"""A stand-in broker of the client tests: a ROUTER served by a thread of the test process."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod


class RouterThread(ABC):
    """Serves ``_run`` (the subclass's: bind, set ``endpoint``, set ``_ready``, then answer until
    ``_stop`` is set) in a daemon thread, from ``_start`` until ``stop``."""

    endpoint: str

    def _start(self, name: str) -> None:
        """Start the thread ``name`` and wait for its socket to be bound."""
        self.endpoint = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        assert self._ready.wait(5), f"{name} did not start"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive()

    @abstractmethod
    def _run(self) -> None:
        """Bind, set ``endpoint`` and ``_ready``, then answer until ``_stop`` is set."""
