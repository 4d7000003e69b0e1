"""Clocks: the monotonic clock the daemons use, and a FakeClock that tests move by hand."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...


class SystemClock:
    """The real monotonic clock, in seconds."""

    monotonic = staticmethod(time.monotonic)


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
