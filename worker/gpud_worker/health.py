"""GPU health: which GPUs failed a check, why, and when they may serve again.

A ``HealthTracker`` keeps, per GPU, the outcome of its health checks (NVML's on real GPUs, injected
ones on simulated GPUs; see ``gpud_worker.gpu``). A GPU that fails a check (a ``Fault``) is
``failed`` at once and stays out of service until its checks have passed continuously for
``probation_s`` seconds (its probation); a fault during probation starts it over. XIDs that
applications cause (``APPLICATION_XIDS``: a bad kernel, not a bad GPU) are not faults.

Pure: no NVML, no I/O; the time comes from the clock the caller passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpud.clock import Clock, SystemClock

log = logging.getLogger(__name__)

DEFAULT_PROBATION_S = 300.0

FAULT_KINDS = ("xid", "ecc_dbe", "retired_pages_pending", "thermal", "lost")
"""What a GPU check can find: a critical XID event, a double-bit (uncorrectable) ECC error, retired
pages (or remapped rows) waiting for a GPU reset, a temperature at the shutdown threshold, a GPU
that fell off the bus."""

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by the application, not the GPU (graphics engine exception, MMU fault, channel
stopped, preemptive cleanup, video processor exception, context switch timeout): never faults."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One failed GPU check."""

    kind: str  # one of FAULT_KINDS
    xid: int | None = None  # the XID number, for kind "xid"
    detail: str = ""  # what was measured, for people

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown GPU fault kind {self.kind!r} (known: {', '.join(FAULT_KINDS)})")
        if (self.kind == "xid") != (self.xid is not None):
            raise ValueError("an XID number goes with, and only with, fault kind 'xid'")

    @property
    def reason(self) -> str:
        """A short text for the heartbeat and ``gpudctl``: ``xid 79``, ``thermal (95 C)``."""
        text = f"xid {self.xid}" if self.xid is not None else self.kind
        return f"{text} ({self.detail})" if self.detail else text

    @property
    def ignored(self) -> bool:
        """An application XID: the work's fault, not the GPU's."""
        return self.xid in APPLICATION_XIDS


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """What a heartbeat says about one GPU's health."""

    health: str = "ok"  # "ok" | "failed" (a GpuState.health value)
    reason: str = ""  # the last fault, while failed
    probation_left_s: float = 0.0  # while failed and passing its checks: seconds until it serves again


OK = GpuHealth()


@dataclass(slots=True)
class _Record:
    fault: Fault  # the last one
    passing_since: float | None = None  # start of the probation; None while checks still fail
    seen: set[Fault] = field(default_factory=set)  # faults logged since the GPU failed


class HealthTracker:
    """Per-GPU health from check outcomes, with probation before a failed GPU returns.

    Parameters
    ----------
    probation_s:
        Seconds a failed GPU's checks must pass without a break before it serves again.
    clock:
        Where the time comes from (a ``FakeClock`` in tests).
    """

    def __init__(self, probation_s: float = DEFAULT_PROBATION_S, clock: Clock | None = None) -> None:
        if probation_s < 0:
            raise ValueError(f"probation_s must be >= 0, got {probation_s!r}")
        self.probation_s = probation_s
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._failed: dict[str, _Record] = {}

    def fault(self, uuid: str, fault: Fault) -> bool:
        """Record that ``fault`` was found on GPU ``uuid``: it is failed from now on, and a
        probation under way starts over. Returns False (and records nothing) for an application XID."""
        if fault.ignored:
            log.debug("GPU %s: %s is an application error, not a GPU fault; ignored", uuid, fault.reason)
            return False
        rec = self._failed.get(uuid)
        if rec is None or rec.passing_since is not None:
            if rec is None:
                log.error("GPU %s failed: %s; out of service", uuid, fault.reason)
            else:
                log.error("GPU %s failed again during its probation: %s; probation starts over", uuid, fault.reason)
            rec = self._failed[uuid] = _Record(fault)
        elif fault not in rec.seen:
            log.error("GPU %s: also %s", uuid, fault.reason)
        rec.fault = fault
        rec.seen.add(fault)
        return True

    def passed(self, uuid: str) -> None:
        """Record that every check of GPU ``uuid`` passed: a failed GPU starts its probation (if it
        has not already), and serves again once the probation is over."""
        rec = self._failed.get(uuid)
        if rec is None:
            return
        if rec.passing_since is None:
            rec.passing_since = self.clock.monotonic()
            log.warning("GPU %s passes its checks again; on probation for %gs", uuid, self.probation_s)
        self.status(uuid)

    def check(self, uuid: str, faults: Iterable[Fault]) -> None:
        """Record one round of checks of GPU ``uuid``: its faults, or ``passed`` when there were none
        (application XIDs do not count)."""
        found = [f for f in faults if self.fault(uuid, f)]
        if not found:
            self.passed(uuid)

    def status(self, uuid: str) -> GpuHealth:
        """GPU ``uuid``'s health now. A GPU whose probation is over serves again from here on."""
        rec = self._failed.get(uuid)
        if rec is None:
            return OK
        if rec.passing_since is None:
            return GpuHealth("failed", rec.fault.reason)
        left = rec.passing_since + self.probation_s - self.clock.monotonic()
        if left <= 0:
            del self._failed[uuid]
            log.warning("GPU %s passed its checks for %gs: back in service", uuid, self.probation_s)
            return OK
        return GpuHealth("failed", rec.fault.reason, max(round(left, 3), 0.001))

    def failed(self) -> dict[str, str]:
        """The GPUs out of service now, by uuid, with the reason."""
        out: dict[str, str] = {}
        for uuid in list(self._failed):
            h = self.status(uuid)
            if h.health == "failed":
                out[uuid] = h.reason
        return out
