"""GPU health: the HealthTracker (fake clock), the GPU state's health fields on the wire, SIMULATED
fault injection into simulated GPUs, and NvmlProbe's checks against a SIMULATED NVML module."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.resources import GpuState
from gpud_worker.device import SimulatedDevice
from gpud_worker.gpu import NvmlProbe, SimulatedProbe, parse_faults, simulated_gpus
from gpud_worker.health import APPLICATION_XIDS, FAULT_KINDS, Fault, HealthTracker
from tests.nvml_stand_in import NvmlStandIn

# ----------------------------------------------------------------------------- HealthTracker


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


def tracker(clock: FakeClock, probation_s: float = 60.0) -> HealthTracker:
    return HealthTracker(probation_s, clock)


def fault_of(kind: str) -> Fault:
    return Fault("xid", xid=79) if kind == "xid" else Fault(kind)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_fails_the_gpu_at_once(clock: FakeClock, kind: str) -> None:
    t = tracker(clock)
    assert t.fault("GPU-0", fault_of(kind)) is True
    h = t.status("GPU-0")
    assert h.health == "failed" and h.probation_left_s == 0.0
    assert h.reason == ("xid 79" if kind == "xid" else kind)
    assert t.failed() == {"GPU-0": h.reason}
    assert t.status("GPU-1").health == "ok"  # per GPU


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_are_ignored(clock: FakeClock, xid: int) -> None:
    t = tracker(clock)
    assert t.fault("GPU-0", Fault("xid", xid=xid)) is False
    t.check("GPU-0", [Fault("xid", xid=xid)])
    assert t.status("GPU-0").health == "ok" and t.failed() == {}


def test_application_xid_set_is_the_documented_one() -> None:
    assert APPLICATION_XIDS == {13, 31, 43, 45, 68, 109}


def test_fault_reason_carries_the_detail() -> None:
    assert Fault("thermal", detail="95 C, shutdown at 90 C").reason == "thermal (95 C, shutdown at 90 C)"
    assert Fault("xid", xid=48).reason == "xid 48"


@pytest.mark.parametrize(("kind", "xid"), [("overheated", None), ("xid", None), ("lost", 79)])
def test_malformed_faults_are_refused(kind: str, xid: int | None) -> None:
    with pytest.raises(ValueError):
        Fault(kind, xid=xid)


def test_probation_returns_a_gpu_after_its_checks_pass_long_enough(clock: FakeClock) -> None:
    t = tracker(clock, probation_s=60.0)
    t.fault("GPU-0", Fault("xid", xid=79))
    clock.advance(5)
    t.check("GPU-0", [])  # first passing check: probation starts now
    h = t.status("GPU-0")
    assert h.health == "failed" and h.reason == "xid 79" and h.probation_left_s == pytest.approx(60.0)
    clock.advance(59)
    t.check("GPU-0", [])
    h = t.status("GPU-0")
    assert h.health == "failed" and h.probation_left_s == pytest.approx(1.0)
    clock.advance(1)
    assert t.status("GPU-0").health == "ok" and t.status("GPU-0").reason == ""
    assert t.failed() == {}


def test_a_gpu_still_failing_its_checks_never_starts_probation(clock: FakeClock) -> None:
    t = tracker(clock, probation_s=10.0)
    for _ in range(100):
        t.check("GPU-0", [Fault("retired_pages_pending")])
        clock.advance(1)
    h = t.status("GPU-0")
    assert h.health == "failed" and h.probation_left_s == 0.0 and h.reason == "retired_pages_pending"


def test_fault_during_probation_starts_it_over(clock: FakeClock) -> None:
    t = tracker(clock, probation_s=60.0)
    t.fault("GPU-0", Fault("ecc_dbe"))
    t.check("GPU-0", [])
    clock.advance(50)
    t.check("GPU-0", [Fault("thermal")])  # 10 s before it would have served again
    h = t.status("GPU-0")
    assert h.health == "failed" and h.reason == "thermal" and h.probation_left_s == 0.0
    clock.advance(1)
    t.check("GPU-0", [])
    assert t.status("GPU-0").probation_left_s == pytest.approx(60.0)
    clock.advance(59.5)
    assert t.status("GPU-0").health == "failed"
    clock.advance(0.5)
    assert t.status("GPU-0").health == "ok"


def test_application_xid_during_probation_does_not_restart_it(clock: FakeClock) -> None:
    t = tracker(clock, probation_s=60.0)
    t.fault("GPU-0", Fault("lost"))
    t.check("GPU-0", [])
    clock.advance(30)
    t.check("GPU-0", [Fault("xid", xid=13)])
    assert t.status("GPU-0").probation_left_s == pytest.approx(30.0)


def test_zero_probation_returns_at_the_first_passing_check(clock: FakeClock) -> None:
    t = tracker(clock, probation_s=0.0)
    t.fault("GPU-0", Fault("xid", xid=79))
    assert t.status("GPU-0").health == "failed"
    t.check("GPU-0", [])
    assert t.status("GPU-0").health == "ok"


def test_negative_probation_is_refused(clock: FakeClock) -> None:
    with pytest.raises(ValueError):
        HealthTracker(-1.0, clock)


# ----------------------------------------------------------------------------- wire


def test_health_fields_round_trip_on_the_wire() -> None:
    s = GpuState(10.0, 5, 40.0, 100.0, "failed", "xid 79", 12.5)
    raw = P.gpu_state_to_wire("GPU-0", s)
    assert raw["health_reason"] == "xid 79" and raw["probation_left_s"] == 12.5
    assert P.parse_gpu_state(P.unpackb(P.packb(raw))) == ("GPU-0", s)


def test_healthy_gpu_state_has_only_the_existing_fields() -> None:
    raw = P.gpu_state_to_wire("GPU-0", GpuState(1.0, 2, 3.0, 4.0))
    assert set(raw) == {"uuid", "util", "mem_used", "temp", "power", "health"}
    assert P.parse_gpu_state(raw)[1] == GpuState(1.0, 2, 3.0, 4.0)


@pytest.mark.parametrize(
    ("reason", "left", "want_reason", "want_left"),
    [(7, "soon", "", 0.0), ("x" * 5000, 1e12, "x" * P.MAX_HEALTH_REASON, P.MAX_PROBATION_S),
     (None, -5.0, "", 0.0), ("xid 79", float("nan"), "xid 79", 0.0)],
)
def test_hostile_health_fields_are_clamped(reason: Any, left: Any, want_reason: str, want_left: float) -> None:
    _, s = P.parse_gpu_state({"uuid": "G", "health": "failed", "health_reason": reason, "probation_left_s": left})
    assert (s.health_reason, s.probation_left_s) == (want_reason, want_left)


# ----------------------------------------------------------------------------- SIMULATED faults


def sim_probe(clock: FakeClock, n: int = 2, probation_s: float = 10.0, fault_file: Path | None = None) -> SimulatedProbe:
    devs = [SimulatedDevice(g, clock=clock) for g in simulated_gpus(n, worker_name="h")]
    return SimulatedProbe(devs, probation_s=probation_s, clock=clock, fault_file=fault_file)


def test_parse_faults_by_index_and_uuid() -> None:
    gpus = simulated_gpus(2, worker_name="h")
    text = json.dumps([{"gpu": 0, "fault": "xid", "xid": 79},
                       {"gpu": "SIM-h-1", "fault": "thermal", "detail": "simulated"},
                       {"gpu": 1, "fault": "ecc_dbe"}])
    assert parse_faults(text, gpus) == {
        "SIM-h-0": [Fault("xid", xid=79)],
        "SIM-h-1": [Fault("thermal", detail="simulated"), Fault("ecc_dbe")],
    }
    assert parse_faults('{"gpu": 1, "fault": "lost"}', gpus) == {"SIM-h-1": [Fault("lost")]}
    assert parse_faults("", gpus) == parse_faults("[]", gpus) == parse_faults("null", gpus) == {}


@pytest.mark.parametrize("text", [
    "{not json", "[1]", '{"gpu": 2, "fault": "lost"}', '{"gpu": "SIM-x-0", "fault": "lost"}',
    '{"gpu": true, "fault": "lost"}', '{"gpu": 0, "fault": "melted"}', '{"gpu": 0, "fault": "xid"}',
    '{"gpu": 0, "fault": "xid", "xid": "79"}', '{"gpu": 0, "fault": "lost", "xid": 79}',
    '{"gpu": 0, "fault": "lost", "when": 3}', '{"gpu": 0, "fault": "lost", "detail": 3}',
])
def test_parse_faults_refuses_malformed_files(text: str) -> None:
    with pytest.raises(ValueError):
        parse_faults(text, simulated_gpus(2, worker_name="h"))


def test_injected_fault_fails_a_simulated_gpu_until_cleared_then_probation(clock: FakeClock) -> None:
    probe = sim_probe(clock)
    probe.inject({"SIM-h-0": [Fault("xid", xid=79)]})
    for _ in range(3):  # the fault stands: every check finds it
        st = probe.states()
        clock.advance(5)
    assert st["SIM-h-0"].health == "failed" and st["SIM-h-0"].health_reason == "xid 79"
    assert st["SIM-h-1"].health == "ok"
    assert probe.failed() == {"SIM-h-0": "xid 79"}
    probe.inject({})
    st = probe.states()
    assert st["SIM-h-0"].health == "failed" and st["SIM-h-0"].probation_left_s == pytest.approx(10.0)
    clock.advance(10)
    assert probe.states()["SIM-h-0"].health == "ok" and probe.failed() == {}


def test_injected_application_xid_changes_nothing(clock: FakeClock) -> None:
    probe = sim_probe(clock)
    probe.inject({"SIM-h-0": [Fault("xid", xid=13)]})
    assert all(s.health == "ok" for s in probe.states().values()) and probe.failed() == {}


def test_inject_refuses_unknown_gpus(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="no simulated GPU"):
        sim_probe(clock).inject({"GPU-real": [Fault("lost")]})


def test_fault_file_read_only_when_requested(clock: FakeClock, tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"gpu": 1, "fault": "ecc_dbe"}))
    probe = sim_probe(clock, fault_file=path)
    assert probe.states()["SIM-h-1"].health == "ok"  # not asked yet
    probe.request_faults()
    assert probe.states()["SIM-h-1"].health_reason == "ecc_dbe"
    path.write_text("[]")
    assert probe.states()["SIM-h-1"].health == "failed"  # still the faults read last
    probe.request_faults()
    assert probe.states()["SIM-h-1"].probation_left_s == pytest.approx(10.0)


@pytest.mark.parametrize("content", [None, "{broken", '{"gpu": 9, "fault": "lost"}', b"\xff\xfe"])
def test_bad_fault_file_is_refused_and_changes_nothing(clock: FakeClock, tmp_path: Path, content: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "faults.json"
    probe = sim_probe(clock, fault_file=path)
    probe.inject({"SIM-h-0": [Fault("thermal")]})
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    probe.request_faults()
    with caplog.at_level(logging.ERROR, logger="gpud_worker.gpu"):
        st = probe.states()
    assert "refused" in caplog.text
    assert st["SIM-h-0"].health_reason == "thermal" and st["SIM-h-1"].health == "ok"


def test_fault_request_without_a_fault_file_is_logged(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    probe = sim_probe(clock)
    probe.request_faults()
    with caplog.at_level(logging.ERROR, logger="gpud_worker.gpu"):
        assert all(s.health == "ok" for s in probe.states().values())
    assert "no fault file" in caplog.text


# ----------------------------------------------------------------------------- NVML checks


class SimulatedNvml(NvmlStandIn):
    """SIMULATED NVML (an A100 pair) with health counters and events, so that NvmlProbe's health
    checks run here; tests set the counters and queue events."""

    class NVMLError_Timeout(NvmlStandIn.NVMLError):
        pass

    name = b"NVIDIA A100"
    mem = (80 << 30, 1 << 30)
    cc = (8, 0)
    util = 10
    power_mw = 100_000

    class _Event:
        def __init__(self, device: int, event_type: int, data: int) -> None:
            self.device, self.eventType, self.eventData = device, event_type, data

    def __init__(self, supported: bool = True) -> None:
        super().__init__()
        self.supported = supported  # False: every health call raises NotSupported
        self.events: list[SimulatedNvml._Event] = []
        self.registered: dict[int, int] = {}
        self.ecc = [0, 0]
        self.pages_pending = [0, 0]
        self.rows = [(0, 0, 0, 0), (0, 0, 0, 0)]
        self.temp = [50, 50]
        self.freed = 0
        self.waits: list[int] = []

    def _health(self, h: int) -> None:
        self._check(h)
        if not self.supported:
            raise self.NVMLError_NotSupported("Not Supported")

    def nvmlEventSetCreate(self) -> str:
        if not self.supported:
            raise self.NVMLError_NotSupported("Not Supported")
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0x8 | 0x2 | 0x1 | 0x4  # XID, double-bit ECC, single-bit ECC, P-state

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        assert event_set == "event-set"
        self.registered[h] = types

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        if not self.events:
            raise self.NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed += 1

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter_type: int) -> int:
        self._health(h)
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return self.ecc[h]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        self._health(h)
        return self.pages_pending[h]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        self._health(h)
        return self.rows[h]

    def nvmlDeviceGetTemperatureThreshold(self, h: int, threshold: int) -> int:
        self._health(h)
        assert threshold == 0  # shutdown
        return 90


def nvml_probe(nv: SimulatedNvml, clock: FakeClock, probation_s: float = 30.0) -> NvmlProbe:
    probe = NvmlProbe(nvml=nv, probation_s=probation_s, clock=clock)
    probe.inventory()
    return probe


def health(probe: NvmlProbe) -> dict[str, tuple[str, str]]:
    return {u: (s.health, s.health_reason) for u, s in probe.states().items()}


def test_nvml_registers_critical_xid_and_double_bit_ecc_events(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    nvml_probe(nv, clock)
    assert nv.registered == {0: 0x8 | 0x2, 1: 0x8 | 0x2}


def test_nvml_healthy_gpus_are_ok_and_events_are_polled_without_waiting(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    assert health(probe) == {"GPU-0": ("ok", ""), "GPU-1": ("ok", "")}
    assert nv.waits and set(nv.waits) == {0}


def test_nvml_critical_xid_event_fails_its_gpu(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.events = [SimulatedNvml._Event(1, 0x8, 79)]
    assert health(probe) == {"GPU-0": ("ok", ""), "GPU-1": ("failed", "xid 79")}
    assert probe.failed() == {"GPU-1": "xid 79"}


def test_nvml_event_of_a_gpu_not_served_here_is_ignored(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.events = [SimulatedNvml._Event(7, 0x8, 79), SimulatedNvml._Event(0, 0x8, 48)]
    assert health(probe) == {"GPU-0": ("failed", "xid 48"), "GPU-1": ("ok", "")}


def test_nvml_application_xid_event_is_ignored(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.events = [SimulatedNvml._Event(0, 0x8, xid) for xid in sorted(APPLICATION_XIDS)]
    assert health(probe)["GPU-0"] == ("ok", "")
    assert not nv.events  # all read in one poll


def test_nvml_double_bit_ecc_event_fails_its_gpu(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.events = [SimulatedNvml._Event(0, 0x2, 0)]
    assert health(probe)["GPU-0"][0] == "failed" and health(probe)["GPU-0"][1].startswith("ecc_dbe")


def test_nvml_new_uncorrectable_ecc_errors_fail_the_gpu(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    nv.ecc = [3, 0]  # errors from before the worker started are the baseline
    probe = nvml_probe(nv, clock)
    assert health(probe)["GPU-0"] == ("ok", "")
    nv.ecc = [5, 0]
    assert health(probe)["GPU-0"] == ("failed", "ecc_dbe (2 new uncorrectable ECC error(s))")


def test_nvml_retired_pages_pending_fails_the_gpu(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.pages_pending = [0, 1]
    assert health(probe)["GPU-1"][0] == "failed"
    assert health(probe)["GPU-1"][1].startswith("retired_pages_pending")


@pytest.mark.parametrize(("rows", "detail"), [((0, 1, 1, 0), "remapped rows wait"), ((0, 1, 0, 1), "row remapping failed")])
def test_nvml_row_remap_pending_or_failed_fails_the_gpu(clock: FakeClock, rows: tuple[int, int, int, int], detail: str) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.rows = [(0, 0, 0, 0), rows]
    h, reason = health(probe)["GPU-1"]
    assert h == "failed" and reason.startswith("retired_pages_pending") and detail in reason


def test_nvml_shutdown_temperature_fails_the_gpu(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    nv.temp = [89, 90]
    states = health(probe)
    assert states["GPU-0"] == ("ok", "")
    assert states["GPU-1"] == ("failed", "thermal (90 C, shutdown at 90 C)")


def test_nvml_lost_gpu_fails_and_returns_after_probation(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock, probation_s=30.0)
    nv.lost.add(0)  # the event set says "GPU is lost" too, naming no GPU
    assert health(probe) == {"GPU-0": ("failed", "lost (NVML: GPU is lost)"), "GPU-1": ("ok", "")}
    clock.advance(100)
    assert health(probe)["GPU-0"][0] == "failed"  # still lost: no probation
    nv.lost.clear()
    assert probe.states()["GPU-0"].probation_left_s == pytest.approx(30.0)
    clock.advance(30)
    assert health(probe)["GPU-0"] == ("ok", "")


def test_nvml_without_health_support_reports_ok(clock: FakeClock) -> None:
    nv = SimulatedNvml(supported=False)  # no events, every health call NotSupported
    probe = nvml_probe(nv, clock)
    nv.temp = [120, 120]  # no shutdown threshold known: not judged
    assert health(probe) == {"GPU-0": ("ok", ""), "GPU-1": ("ok", "")}
    nv.lost.add(1)
    assert health(probe)["GPU-1"][0] == "failed"


def test_nvml_fault_injection_is_refused(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    probe.request_faults()
    with caplog.at_level(logging.ERROR, logger="gpud_worker.gpu"):
        assert health(probe) == {"GPU-0": ("ok", ""), "GPU-1": ("ok", "")}
    assert "fault injection refused" in caplog.text


def test_nvml_close_frees_the_event_set(clock: FakeClock) -> None:
    nv = SimulatedNvml()
    probe = nvml_probe(nv, clock)
    probe.close()
    probe.close()
    assert nv.freed == 1
