"""GPU discovery and live GPU state for the worker.

This module owns what the worker announces on READY (``GpuProbe.inventory``) and the per-GPU state
its heartbeats carry (``GpuProbe.states``): ``NvmlProbe`` asks the NVIDIA driver through NVML
(package ``nvidia-ml-py``, imported lazily so that machines without it still run), and
``SimulatedProbe`` models the state of ``SimulatedDevice`` GPUs from the work running on them.

Each ``states()`` also runs the GPUs' health checks and feeds a ``HealthTracker``: on real GPUs
NVML's critical XID and double-bit ECC events, new uncorrectable ECC errors, retired pages or
remapped rows pending, the shutdown temperature, a GPU lost; on simulated GPUs only the faults
injected from the fault file (``--fault-file``, read on SIGUSR2), which is SIMULATED fault injection
for tests.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpud.clock import Clock
from gpud.errors import ConfigError
from gpud.resources import GpuInfo, GpuState
from gpud_worker.device import SimulatedDevice
from gpud_worker.health import DEFAULT_PROBATION_S, FAULT_KINDS, Fault, HealthTracker

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# NVML's C ABI values (nvml.h), so that bindings lacking a name still work.
NVML_EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
NVML_EVENT_DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0  # counts since the driver loaded
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_FEATURE_ENABLED = 1
MAX_EVENTS_PER_POLL = 256  # NVML events read in one states(); the rest wait for the next one


class GpuProbe(Protocol):
    """Where the worker learns which GPUs it has and what they are doing."""

    simulated: bool

    def inventory(self) -> list[GpuInfo]:
        """The GPUs, in index order. Static for the life of the probe."""
        ...

    def states(self) -> dict[str, GpuState]:
        """Current state of each GPU, by uuid; runs the GPUs' health checks."""
        ...

    def failed(self) -> dict[str, str]:
        """The GPUs out of service (failed a health check, or still on probation), by uuid, with
        the reason, as the last ``states()`` left them. Makes no GPU calls."""
        ...

    def request_faults(self) -> None:
        """SIMULATED fault injection: read the fault file at the next ``states()`` (refused, with an
        error logged, on real GPUs). Only sets a flag: safe from a signal handler."""
        ...

    def close(self) -> None:
        """Release the probe's resources. Idempotent."""
        ...


class NvmlProbe:
    """GPUs seen through NVML.

    Parameters
    ----------
    nvml:
        The NVML binding module; ``pynvml`` by default (given for tests).
    probation_s:
        Seconds a failed GPU's checks must pass again before it serves (``HealthTracker``).
    clock:
        The health tracker's clock (the system's monotonic clock by default).

    Raises
    ------
    ConfigError
        NVML cannot be loaded or initialized (no NVIDIA driver); see ``available()``.
    """

    simulated = False

    def __init__(self, nvml: Any = None, probation_s: float = DEFAULT_PROBATION_S, clock: Clock | None = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise ConfigError(f"NVML unavailable: {exc} (install nvidia-ml-py)") from None
            nvml = pynvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise ConfigError(f"NVML unavailable (no NVIDIA driver?): {exc}") from None
        self._open = True
        self._handles: dict[str, Any] | None = None
        self.health = HealthTracker(probation_s, clock)
        self._events: Any = None  # the NVML event set (critical XIDs, double-bit ECC), once created
        self._ecc_seen: dict[str, int] = {}  # volatile uncorrectable ECC count at the last check
        self._shutdown_temp: dict[str, float] = {}  # degrees C, per GPU that reports it
        self._faults_requested = False

    @staticmethod
    def available() -> bool:
        """Whether NVML loads and initializes here. Never raises."""
        try:
            import pynvml
        except ImportError:
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            log.debug("NVML not available: %s", exc)
            return False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("NVML shutdown failed: %s", exc)
        return True

    def inventory(self) -> list[GpuInfo]:
        gpus, self._handles = self._discover()
        if self._events is None:
            self._events = self._register_events(self._handles)
        return gpus

    def _register_events(self, handles: Mapping[str, Any]) -> Any:
        """An event set receiving the critical XID and double-bit ECC events of every GPU that
        supports them; None when NVML has no events here."""
        nv = self._nvml
        create = getattr(nv, "nvmlEventSetCreate", None)
        if create is None or not handles:
            return None
        try:
            events = create()
        except nv.NVMLError as exc:
            log.warning("NVML events unavailable (%s): XID errors are not watched", exc)
            return None
        for uuid, handle in handles.items():
            wanted = NVML_EVENT_XID_CRITICAL | NVML_EVENT_DOUBLE_BIT_ECC
            try:
                wanted &= int(nv.nvmlDeviceGetSupportedEventTypes(handle))
                if wanted:
                    nv.nvmlDeviceRegisterEvents(handle, wanted, events)
            except nv.NVMLError as exc:
                log.warning("GPU %s: NVML events unavailable (%s): its XID errors are not watched", uuid, exc)
                continue
            if not wanted & NVML_EVENT_XID_CRITICAL:
                log.warning("GPU %s does not report XID events: its XID errors are not watched", uuid)
        return events

    def _poll_events(self) -> dict[str, list[Fault]]:
        """Faults from the NVML events that arrived since the last poll, by GPU. Never waits."""
        nv = self._nvml
        found: dict[str, list[Fault]] = defaultdict(list)
        if self._events is None:
            return found
        # Timeout: no more events. GPU is lost: the per-GPU checks find which one.
        quiet = tuple(c for c in (getattr(nv, "NVMLError_Timeout", None), getattr(nv, "NVMLError_GpuIsLost", None)) if c)
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError as exc:
                if not isinstance(exc, quiet):
                    log.warning("reading NVML events failed: %s", exc)
                break
            uuid = self._uuid_of(data.device)
            if uuid is None:
                continue
            if data.eventType & NVML_EVENT_XID_CRITICAL:
                xid = int(data.eventData)
                log.warning("GPU %s: NVML reports XID %d", uuid, xid)
                found[uuid].append(Fault("xid", xid=xid))
            elif data.eventType & NVML_EVENT_DOUBLE_BIT_ECC:
                found[uuid].append(Fault("ecc_dbe", detail="double-bit ECC error event"))
        return found

    def _uuid_of(self, handle: Any) -> str | None:
        """The uuid of the GPU an event came from, when it is one of ours."""
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError as exc:
            log.warning("an NVML event names a GPU whose uuid cannot be read: %s", exc)
            return None
        return uuid if self._handles is not None and uuid in self._handles else None

    def minor_numbers(self) -> dict[str, int]:
        """GPU uuid -> the minor number of its ``/dev/nvidiaN`` (which need not be its index);
        GPUs whose number NVML cannot tell are left out (they get no device node in a sandbox)."""
        gpus = self.inventory()
        minor_of = getattr(self._nvml, "nvmlDeviceGetMinorNumber", None)
        if minor_of is None:
            log.warning("this NVML binding cannot tell device minor numbers: jobs get /dev/nvidiaN by GPU index")
            return {g.uuid: g.index for g in gpus}
        out: dict[str, int] = {}
        for uuid, handle in (self._handles or {}).items():
            try:
                out[uuid] = int(minor_of(handle))
            except self._nvml.NVMLError as exc:
                log.warning("GPU %s: NVML cannot tell its device minor number (%s): jobs get no node for it", uuid, exc)
        return out

    def _discover(self) -> tuple[list[GpuInfo], dict[str, Any]]:
        nv = self._nvml
        gpus: list[GpuInfo] = []
        handles: dict[str, Any] = {}
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
                model = _text(nv.nvmlDeviceGetName(handle))
                mem = int(nv.nvmlDeviceGetMemoryInfo(handle).total)
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
            except nv.NVMLError as exc:
                log.warning("GPU %d left out: NVML error %s", index, exc)
                continue
            handles[uuid] = handle
            gpus.append(GpuInfo(uuid, index, model, mem, (int(major), int(minor))))
        return gpus, handles

    def states(self) -> dict[str, GpuState]:
        if self._faults_requested:
            self._faults_requested = False
            log.error("fault injection refused: this worker serves real GPUs (NVML); faults can be "
                      "injected only into simulated GPUs (--simulate)")
        if self._handles is None:
            self.inventory()
        handles = self._handles if self._handles is not None else {}
        events = self._poll_events()
        return {uuid: self._state(uuid, h, events.get(uuid, [])) for uuid, h in handles.items()}

    def failed(self) -> dict[str, str]:
        return self.health.failed()

    def request_faults(self) -> None:
        self._faults_requested = True

    def _state(self, uuid: str, handle: Any, events: list[Fault]) -> GpuState:
        nv = self._nvml
        lost = False

        def field(read: Callable[[], _T], default: _T) -> _T:
            nonlocal lost
            try:
                return read()
            except nv.NVMLError_GpuIsLost:
                lost = True
            except nv.NVMLError as exc:
                log.debug("GPU %s: NVML error %s", uuid, exc)
            return default

        util = field(lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu), 0.0)
        mem_used = field(lambda: int(nv.nvmlDeviceGetMemoryInfo(handle).used), 0)
        temp = field(
            lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)), 0.0
        )
        power = field(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0, 0.0)
        faults = [*events, *self._check(uuid, handle, temp, field)]
        if lost:
            faults.append(Fault("lost", detail="NVML: GPU is lost"))
        self.health.check(uuid, faults)
        h = self.health.status(uuid)
        return GpuState(util, mem_used, temp, power, h.health, h.reason, h.probation_left_s)

    def _check(self, uuid: str, handle: Any, temp: float, field: Callable[[Callable[[], Any], Any], Any]) -> list[Fault]:
        """The faults GPU ``uuid``'s counters and sensors show now; ``field`` reads one value
        (a default when unsupported; it notes a lost GPU). A binding that lacks a function (older
        nvidia-ml-py) counts as not supported."""
        nv = self._nvml
        faults: list[Fault] = []
        if hasattr(nv, "nvmlDeviceGetTotalEccErrors"):
            count = field(lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)), None)
            if count is not None:
                before = self._ecc_seen.get(uuid)
                self._ecc_seen[uuid] = count
                if before is not None and count > before:
                    faults.append(Fault("ecc_dbe", detail=f"{count - before} new uncorrectable ECC error(s)"))
        if hasattr(nv, "nvmlDeviceGetRetiredPagesPendingStatus"):
            if field(lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)), 0) == NVML_FEATURE_ENABLED:
                faults.append(Fault("retired_pages_pending", detail="retired pages wait for a GPU reset"))
        if hasattr(nv, "nvmlDeviceGetRemappedRows"):
            rows = field(lambda: tuple(nv.nvmlDeviceGetRemappedRows(handle)), None)
            if rows is not None and rows[2]:
                faults.append(Fault("retired_pages_pending", detail="remapped rows wait for a GPU reset"))
            if rows is not None and rows[3]:
                faults.append(Fault("retired_pages_pending", detail="row remapping failed"))
        if hasattr(nv, "nvmlDeviceGetTemperatureThreshold"):
            if uuid not in self._shutdown_temp:
                limit = field(lambda: float(nv.nvmlDeviceGetTemperatureThreshold(
                    handle, NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)), None)
                if limit is not None and limit > 0:
                    self._shutdown_temp[uuid] = limit
            limit = self._shutdown_temp.get(uuid)
            if limit is not None and temp >= limit:
                faults.append(Fault("thermal", detail=f"{temp:.0f} C, shutdown at {limit:.0f} C"))
        return faults

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._events is not None and hasattr(self._nvml, "nvmlEventSetFree"):
            try:
                self._nvml.nvmlEventSetFree(self._events)
            except self._nvml.NVMLError as exc:
                log.warning("freeing the NVML event set failed: %s", exc)
            self._events = None
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)


class SimulatedProbe:
    """State of simulated GPUs, modelled from the work running on each ``SimulatedDevice``.

    Utilization is the device's busy fraction; temperature and power rise linearly with it. Their
    health checks fail only with SIMULATED faults: those ``inject`` was given last (from the fault
    file on ``request_faults``), which every check finds again until they are replaced.

    Parameters
    ----------
    devices:
        The simulated GPUs.
    probation_s, clock:
        As for ``NvmlProbe``.
    fault_file:
        The JSON file of SIMULATED faults that ``request_faults`` reads (``parse_faults``); None: none.
    """

    simulated = True

    def __init__(self, devices: Sequence[SimulatedDevice], probation_s: float = DEFAULT_PROBATION_S,
                 clock: Clock | None = None, fault_file: str | Path | None = None) -> None:
        self.devices = list(devices)
        self.health = HealthTracker(probation_s, clock)
        self.fault_file = Path(fault_file) if fault_file else None
        self.injected: dict[str, list[Fault]] = {}  # SIMULATED faults by uuid, found by every check
        self._faults_requested = False

    def inventory(self) -> list[GpuInfo]:
        return [d.gpu for d in self.devices]

    def states(self) -> dict[str, GpuState]:
        if self._faults_requested:
            self._faults_requested = False
            self._read_fault_file()
        out: dict[str, GpuState] = {}
        for d in self.devices:
            busy = d.busy_fraction(d.clock.monotonic())
            self.health.check(d.gpu.uuid, self.injected.get(d.gpu.uuid, []))
            h = self.health.status(d.gpu.uuid)
            out[d.gpu.uuid] = GpuState(
                util=100.0 * busy,
                mem_used=d.mem_used(),
                temp=30.0 + 50.0 * busy,
                power=50.0 + 250.0 * busy,
                health=h.health,
                health_reason=h.reason,
                probation_left_s=h.probation_left_s,
            )
        return out

    def failed(self) -> dict[str, str]:
        return self.health.failed()

    def request_faults(self) -> None:
        self._faults_requested = True

    def inject(self, faults: Mapping[str, Sequence[Fault]]) -> None:
        """SIMULATED: from now on the checks of each GPU find exactly ``faults[uuid]`` (none for a
        GPU not named), until the next ``inject``."""
        known = {d.gpu.uuid for d in self.devices}
        unknown = set(faults) - known
        if unknown:
            raise ValueError(f"no simulated GPU {sorted(unknown)[0]!r} here")
        self.injected = {uuid: list(f) for uuid, f in faults.items() if f}
        for uuid, found in sorted(self.injected.items()):
            log.warning("SIMULATED faults injected into GPU %s: %s", uuid, ", ".join(
                f"{f.reason} (an application XID: ignored)" if f.ignored else f.reason for f in found))
        if not self.injected:
            log.warning("SIMULATED faults cleared: every simulated GPU passes its checks")

    def _read_fault_file(self) -> None:
        """Inject the faults the fault file lists; a missing or malformed file changes nothing."""
        if self.fault_file is None:
            log.error("fault injection requested (SIGUSR2), but no fault file is configured (--fault-file)")
            return
        try:
            faults = parse_faults(self.fault_file.read_text(encoding="utf-8"), self.inventory())
            self.inject(faults)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.error("fault file %s refused: %s", self.fault_file, exc)

    def close(self) -> None:
        pass


def simulated_gpus(
    n: int,
    model: str = "SIM-GPU",
    mem: int = 16 << 30,
    cc: tuple[int, int] = (8, 0),
    worker_name: str = "w",
) -> list[GpuInfo]:
    """``n`` simulated GPUs with uuids ``SIM-<worker_name>-<index>``, unique per worker."""
    return [GpuInfo(f"SIM-{worker_name}-{i}", i, model, mem, cc, simulated=True) for i in range(n)]


def parse_faults(text: str, gpus: Sequence[GpuInfo]) -> dict[str, list[Fault]]:
    """The SIMULATED faults a fault file lists, by GPU uuid.

    The file is JSON: one entry or a list of them (empty, ``[]`` or ``null``: no faults). An entry
    is ``{"gpu": INDEX or "UUID", "fault": KIND}``, with ``"xid": N`` when KIND is ``"xid"`` and an
    optional ``"detail"`` text; KIND is one of ``FAULT_KINDS``.

    Raises
    ------
    ValueError
        Not JSON, or an entry is malformed or names a GPU not in ``gpus``.
    """
    raw = json.loads(text) if text.strip() else None
    entries = [] if raw is None else raw if isinstance(raw, list) else [raw]
    by_index = {g.index: g.uuid for g in gpus}
    uuids = {g.uuid for g in gpus}
    out: dict[str, list[Fault]] = defaultdict(list)
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ValueError(f"entry {i} is not a JSON object")
        extra = set(e) - {"gpu", "fault", "xid", "detail"}
        if extra:
            raise ValueError(f"entry {i} has unknown key(s) {', '.join(sorted(extra))}")
        gpu = e.get("gpu")
        if type(gpu) is int and gpu in by_index:
            uuid = by_index[gpu]
        elif type(gpu) is str and gpu in uuids:
            uuid = gpu
        else:
            raise ValueError(f"entry {i}: 'gpu' must be the index or uuid of a GPU here, got {gpu!r}")
        kind, xid, detail = e.get("fault"), e.get("xid"), e.get("detail", "")
        if kind not in FAULT_KINDS:
            raise ValueError(f"entry {i}: 'fault' must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        if kind == "xid" and (type(xid) is not int or xid <= 0):
            raise ValueError(f"entry {i}: fault 'xid' needs 'xid', a positive int, got {xid!r}")
        if kind != "xid" and xid is not None:
            raise ValueError(f"entry {i}: only fault 'xid' has an 'xid'")
        if type(detail) is not str:
            raise ValueError(f"entry {i}: 'detail' must be a string")
        out[uuid].append(Fault(kind, xid, detail))
    return dict(out)


def _text(v: str | bytes) -> str:
    """NVML strings are bytes in older bindings, str in newer ones."""
    return v.decode() if isinstance(v, bytes) else v
