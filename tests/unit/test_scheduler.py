"""The broker's scheduling core: registry records, the grant ledger and the placement policies."""

from __future__ import annotations

import pytest

from gpud.clock import FakeClock
from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import GpuInfo, GpuState, Grant, Need
from gpud_broker import ledger
from gpud_broker.ledger import LedgerError
from gpud_broker.policies import (
    POLICIES,
    balanced,
    best_fit,
    could_ever_fit,
    feasible_gpus,
    reserve_worker,
    spread,
    worker_can_take,
)
from gpud_broker.registry import GpuRecord, WorkerRecord, WorkerRegistry

GiB = 1 << 30


def info(
    uuid: str,
    index: int = 0,
    model: str = "A100",
    mem: int = 16 * GiB,
    cc: tuple[int, int] = (8, 0),
) -> GpuInfo:
    return GpuInfo(uuid=uuid, index=index, model=model, mem=mem, cc=cc)


def add(
    reg: WorkerRegistry,
    name: str,
    gpus: list[GpuInfo] | int = 1,
    *,
    cpu_milli: int = 8000,
    host_mem: int = 64 * GiB,
    slots: int = 16,
    now: float = 1000.0,
) -> WorkerRecord:
    if isinstance(gpus, int):
        gpus = [info(f"{name}-gpu{i}", i) for i in range(gpus)]
    return reg.add(
        name=name,
        identity=name.encode(),
        hostname=f"{name}.local",
        gpus=gpus,
        cpu_milli=cpu_milli,
        host_mem=host_mem,
        slots=slots,
        policy=HeartbeatPolicy(),
        now=now,
    )


def numbers(g: GpuRecord) -> tuple[int, int, int, bool]:
    return (g.granted_milli, g.granted_mem, g.tasks, g.exclusive)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg() -> WorkerRegistry:
    return WorkerRegistry()


# --------------------------------------------------------------------------- registry


def test_registry_add_and_remove(reg: WorkerRegistry, clock: FakeClock) -> None:
    w = add(reg, "w1", 2, now=clock.monotonic())
    assert len(reg) == 1 and reg.get(b"w1") is w and reg.by_name["w1"] is w
    assert set(reg.gpus) == {"w1-gpu0", "w1-gpu1"}
    assert all(g.worker is w for g in w.gpus)
    assert w.connected_at == clock.monotonic() and w.liveness.last_heard == clock.monotonic()
    clock.advance(HeartbeatPolicy().expiry + 0.5)
    assert reg.expired(clock.monotonic()) == [w]
    reg.remove(w)
    assert len(reg) == 0 and reg.gpus == {} and reg.by_name == {} and list(reg) == []


def test_update_state_applies_and_resets_since_beat(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2)
    a, b = w.gpus
    ledger.grant(w, [a], Need(gpu_milli=300, mem=GiB))
    assert (a.milli_since_beat, a.mem_since_beat) == (300, GiB)
    reg.update_state(w, {"w1-gpu0": GpuState(util=55.0), "unknown": GpuState(util=99.0)})
    assert a.state.util == 55.0 and b.state == GpuState()
    assert (a.milli_since_beat, a.mem_since_beat) == (0, 0)
    assert a.granted_milli == 300  # the ledger is untouched by measurements


# --------------------------------------------------------------------------- ledger


def test_grant_then_release_restores_every_number(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2, cpu_milli=4000, host_mem=8 * GiB)
    a, b = w.gpus
    need = Need(gpu_milli=300, mem=2 * GiB, cpu_milli=1500, host_mem=3 * GiB)
    g = ledger.grant(w, [a], need)
    assert g == Grant(
        worker="w1", gpus=("w1-gpu0",), gpu_milli=300, mem=2 * GiB, cpu_milli=1500, host_mem=3 * GiB
    )
    assert numbers(a) == (300, 2 * GiB, 1, False) and numbers(b) == (0, 0, 0, False)
    assert (a.free_milli, a.free_mem) == (700, 14 * GiB)
    assert (w.granted_cpu, w.granted_host_mem, w.free_cpu, w.free_host_mem) == (
        1500,
        3 * GiB,
        2500,
        5 * GiB,
    )
    ledger.release(w, [a], g)
    assert numbers(a) == (0, 0, 0, False)
    assert (w.granted_cpu, w.granted_host_mem) == (0, 0)


def test_exclusive_multi_gpu_grant_and_release(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 3)
    gpus = w.gpus[:2]
    g = ledger.grant(w, gpus, Need(gpus=2, mem=GiB, exclusive=True))
    assert g.gpus == ("w1-gpu0", "w1-gpu1") and g.gpu_milli == 1000 and g.exclusive
    assert [numbers(r) for r in w.gpus] == [
        (1000, GiB, 1, True),
        (1000, GiB, 1, True),
        (0, 0, 0, False),
    ]
    assert not gpus[0].placeable
    ledger.release(w, gpus, g)
    assert [numbers(r) for r in w.gpus] == [(0, 0, 0, False)] * 3
    assert all(r.placeable for r in w.gpus)


def test_grant_over_free_share_is_refused_and_changes_nothing(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2)
    a, b = w.gpus
    ledger.grant(w, [a], Need(gpu_milli=600))
    with pytest.raises(LedgerError):
        ledger.grant(w, [a], Need(gpu_milli=401))
    with pytest.raises(LedgerError):
        ledger.grant(w, [a], Need(gpu_milli=1, mem=17 * GiB))
    with pytest.raises(LedgerError):  # the second GPU fits, the first does not: nothing is granted
        ledger.grant(w, [b, a], Need(gpus=2))
    assert numbers(a) == (600, 0, 1, False) and numbers(b) == (0, 0, 0, False)
    assert a.milli_since_beat == 600 and b.milli_since_beat == 0
    ledger.grant(w, [a], Need(gpu_milli=400))  # exactly the rest still fits
    assert a.free_milli == 0


def test_grant_refuses_worker_resources_and_foreign_gpus(reg: WorkerRegistry) -> None:
    w1 = add(reg, "w1", 1, cpu_milli=1000, host_mem=GiB)
    w2 = add(reg, "w2", 1)
    with pytest.raises(LedgerError):
        ledger.grant(w1, w1.gpus, Need(gpu_milli=1, cpu_milli=1001))
    with pytest.raises(LedgerError):
        ledger.grant(w1, w1.gpus, Need(gpu_milli=1, host_mem=GiB + 1))
    with pytest.raises(LedgerError):
        ledger.grant(w1, w2.gpus, Need(gpu_milli=1))
    assert numbers(w1.gpus[0]) == numbers(w2.gpus[0]) == (0, 0, 0, False)
    assert (w1.granted_cpu, w1.granted_host_mem) == (0, 0)


def test_exclusive_refused_on_gpu_with_tasks_and_exclusive_blocks_others(
    reg: WorkerRegistry,
) -> None:
    w = add(reg, "w1", 1)
    (a,) = w.gpus
    small = ledger.grant(w, [a], Need(gpu_milli=1))
    with pytest.raises(LedgerError):
        ledger.grant(w, [a], Need(gpu_milli=10, exclusive=True))
    ledger.release(w, [a], small)
    ex = ledger.grant(w, [a], Need(gpu_milli=10, exclusive=True))
    with pytest.raises(LedgerError):
        ledger.grant(w, [a], Need(gpu_milli=1))
    ledger.release(w, [a], ex)
    assert numbers(a) == (0, 0, 0, False)


def test_release_twice_raises(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 1)
    g = ledger.grant(w, w.gpus, Need(gpu_milli=100, mem=GiB))
    ledger.release(w, w.gpus, g)
    with pytest.raises(LedgerError):
        ledger.release(w, w.gpus, g)


def test_release_twice_is_caught_while_other_grants_live(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 1)
    mine = ledger.grant(w, w.gpus, Need(gpu_milli=300))
    ledger.grant(w, w.gpus, Need(gpu_milli=300))
    ledger.release(w, w.gpus, mine)
    with pytest.raises(LedgerError):
        ledger.release(w, w.gpus, mine)


# --------------------------------------------------------------------------- filters


def test_feasible_gpus_filters(reg: WorkerRegistry) -> None:
    w = add(
        reg,
        "w1",
        [
            info("a100", 0, "A100", 40 * GiB, (8, 0)),
            info("h100", 1, "H100", 80 * GiB, (9, 0)),
            info("t4", 2, "T4", 16 * GiB, (7, 5)),
        ],
    )
    a100, h100, t4 = w.gpus

    def uuids(need: Need) -> list[str]:
        return [g.uuid for g in feasible_gpus(need, w)]

    assert uuids(Need(gpu_milli=100)) == ["a100", "h100", "t4"]
    # model filter
    assert uuids(Need(gpu_milli=100, models=frozenset({"H100"}))) == ["h100"]
    assert uuids(Need(gpu_milli=100, models=frozenset({"T4", "A100"}))) == ["a100", "t4"]
    assert uuids(Need(gpu_milli=100, models=frozenset({"V100"}))) == []
    # compute capability
    assert uuids(Need(gpu_milli=100, min_cc=(8, 0))) == ["a100", "h100"]
    assert uuids(Need(gpu_milli=100, min_cc=(8, 6))) == ["h100"]
    assert uuids(Need(gpu_milli=100, min_cc=(7, 5))) == ["a100", "h100", "t4"]
    # device memory: size, then what is already granted
    assert uuids(Need(gpu_milli=100, mem=20 * GiB)) == ["a100", "h100"]
    assert uuids(Need(gpu_milli=100, mem=50 * GiB)) == ["h100"]
    ledger.grant(w, [h100], Need(gpu_milli=1, mem=40 * GiB))
    assert uuids(Need(gpu_milli=100, mem=50 * GiB)) == []
    assert uuids(Need(gpu_milli=100, mem=40 * GiB)) == ["a100", "h100"]
    # free share
    ledger.grant(w, [t4], Need(gpu_milli=900))
    assert uuids(Need(gpu_milli=101)) == ["a100", "h100"]
    assert uuids(Need(gpu_milli=100)) == ["a100", "h100", "t4"]
    assert uuids(Need(gpus=1)) == ["a100"]  # whole GPUs: fully free only
    # an exclusive need refuses GPUs with tasks
    assert uuids(Need(gpu_milli=10, exclusive=True)) == ["a100"]


def test_feasible_gpus_placeability(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 3)
    a, b, c = w.gpus
    need = Need(gpu_milli=10)
    a.cordoned = True
    assert feasible_gpus(need, w) == [b, c]
    reg.update_state(w, {b.uuid: GpuState(health="failed"), c.uuid: GpuState(health="degraded")})
    assert feasible_gpus(need, w) == [c]
    a.cordoned = False
    ledger.grant(w, [c], Need(gpu_milli=10, exclusive=True))
    assert feasible_gpus(need, w) == [a]  # the exclusive holder takes nothing else


def test_worker_level_filters(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 1, cpu_milli=2000, host_mem=4 * GiB, slots=2)
    need = Need(gpu_milli=10)
    assert worker_can_take(need, w)
    w.inflight = 1
    assert worker_can_take(need, w) and balanced(need, [w]) is not None
    w.inflight = 2  # every slot taken
    assert not worker_can_take(need, w)
    for policy in POLICIES.values():
        assert policy(need, [w], ()) is None
    w.inflight = 0
    w.draining = True
    assert not w.has_slot and not worker_can_take(need, w) and balanced(need, [w]) is None
    w.draining = False
    assert not worker_can_take(Need(gpu_milli=10, cpu_milli=2001), w)
    assert not worker_can_take(Need(gpu_milli=10, host_mem=4 * GiB + 1), w)
    ledger.grant(w, w.gpus, Need(gpu_milli=10, cpu_milli=1500, host_mem=3 * GiB))
    assert balanced(Need(gpu_milli=10, cpu_milli=501), [w]) is None
    assert balanced(Need(gpu_milli=10, host_mem=GiB + 1), [w]) is None
    p = balanced(Need(gpu_milli=10, cpu_milli=500, host_mem=GiB), [w])
    assert p is not None and p.worker is w


# --------------------------------------------------------------------------- multi-GPU


def test_multi_gpu_need_picks_free_gpus_on_one_worker(reg: WorkerRegistry) -> None:
    w1 = add(reg, "w1", 2)
    w2 = add(reg, "w2", 3)
    ledger.grant(w1, [w1.gpus[0]], Need(gpu_milli=1))
    ledger.grant(w2, [w2.gpus[1]], Need(gpu_milli=1))
    need = Need(gpus=2)
    for policy in POLICIES.values():
        p = policy(need, reg, ())
        assert p is not None
        assert p.worker is w2
        assert {g.uuid for g in p.gpus} == {"w2-gpu0", "w2-gpu2"}
        assert all(g.worker is p.worker for g in p.gpus)


def test_multi_gpu_need_never_spans_workers(reg: WorkerRegistry) -> None:
    w1 = add(reg, "w1", 2)
    w2 = add(reg, "w2", 2)
    ledger.grant(w1, [w1.gpus[0]], Need(gpu_milli=1))
    ledger.grant(w2, [w2.gpus[1]], Need(gpu_milli=1))
    # two fully free GPUs exist, but on two workers
    for policy in POLICIES.values():
        assert policy(Need(gpus=2), reg, ()) is None
        p = policy(Need(gpus=1), reg, ())
        assert p is not None and len(p.gpus) == 1
    assert could_ever_fit(Need(gpus=2), reg)


# --------------------------------------------------------------------------- could_ever_fit


def test_could_ever_fit(reg: WorkerRegistry) -> None:
    assert not could_ever_fit(Need(gpu_milli=1), [])
    w1 = add(
        reg,
        "w1",
        [info("a", 0, "A100", 40 * GiB, (8, 0)), info("b", 1, "A100", 40 * GiB, (8, 0))],
        cpu_milli=4000,
    )
    add(reg, "w2", [info("c", 0, "T4", 16 * GiB, (7, 5))], host_mem=8 * GiB)
    # busy now is fine: the question is "if it were idle"
    ledger.grant(w1, w1.gpus, Need(gpus=2, exclusive=True))
    assert could_ever_fit(Need(gpu_milli=1000, mem=40 * GiB), reg)
    assert could_ever_fit(Need(gpus=2, mem=40 * GiB), reg)
    assert could_ever_fit(Need(gpu_milli=10, models=frozenset({"T4"}), host_mem=8 * GiB), reg)
    assert not could_ever_fit(Need(gpu_milli=1, mem=40 * GiB + 1), reg)
    assert not could_ever_fit(Need(gpus=3), reg)
    assert not could_ever_fit(Need(gpu_milli=1, models=frozenset({"H100"})), reg)
    assert not could_ever_fit(Need(gpu_milli=1, min_cc=(9, 0)), reg)
    assert not could_ever_fit(Need(gpu_milli=1, cpu_milli=8001), reg)
    assert not could_ever_fit(Need(gpu_milli=1, host_mem=64 * GiB + 1), reg)
    # T4 on w2 fits the model, but w2 lacks the host memory
    assert not could_ever_fit(
        Need(gpu_milli=1, models=frozenset({"T4"}), host_mem=8 * GiB + 1), reg
    )
    # failed GPUs do not count
    reg.update_state(w1, {"b": GpuState(health="failed")})
    assert not could_ever_fit(Need(gpus=2), reg)
    assert could_ever_fit(Need(gpus=1, min_cc=(8, 0)), reg)


# --------------------------------------------------------------------------- balanced


def test_balanced_ties_go_to_first(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2)
    p = balanced(Need(gpu_milli=100), reg)
    assert p is not None and p.gpus == [w.gpus[0]]


@pytest.mark.parametrize(
    "measured",
    [GpuState(util=90.0), GpuState(mem_used=12 * GiB)],
    ids=["util", "mem_used"],
)
def test_balanced_follows_measured_state(reg: WorkerRegistry, measured: GpuState) -> None:
    w = add(reg, "w1", 2)
    a, b = w.gpus
    assert numbers(a) == numbers(b)
    reg.update_state(w, {a.uuid: measured, b.uuid: GpuState()})
    for _ in range(3):
        p = balanced(Need(gpu_milli=100), reg)
        assert p is not None and p.gpus == [b]
    # and the other way round
    reg.update_state(w, {a.uuid: GpuState(), b.uuid: measured})
    p = balanced(Need(gpu_milli=100), reg)
    assert p is not None and p.gpus == [a]


def test_balanced_counts_dispatches_since_last_heartbeat(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2)
    a, b = w.gpus
    reg.update_state(w, {a.uuid: GpuState(util=0.0), b.uuid: GpuState(util=40.0)})
    need = Need(gpu_milli=500)
    first = balanced(need, reg)
    assert first is not None and first.gpus == [a]
    g = ledger.grant(w, first.gpus, need)
    ledger.release(w, first.gpus, g)  # finished before the next heartbeat
    assert numbers(a) == (0, 0, 0, False)  # the ledger is clean...
    assert a.milli_since_beat == 500  # ...but the measurement does not show the work yet
    second = balanced(need, reg)
    assert second is not None and second.gpus == [b]
    # A heartbeat arrives: A measured idle again; the since-beat counter resets.
    reg.update_state(w, {a.uuid: GpuState(util=0.0)})
    assert a.milli_since_beat == 0 and b.state.util == 40.0
    third = balanced(need, reg)
    assert third is not None and third.gpus == [a]


def burst(reg: WorkerRegistry, w: WorkerRecord, n: int, need: Need) -> dict[str, int]:
    counts = {g.uuid: 0 for g in w.gpus}
    for _ in range(n):
        p = balanced(need, reg)
        assert p is not None, "every request of the burst must be granted"
        ledger.grant(p.worker, p.gpus, need)  # kept running
        counts[p.gpus[0].uuid] += 1
    return counts


def test_balanced_burst_spreads_evenly(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 2)
    reg.update_state(w, {g.uuid: GpuState(util=0.0) for g in w.gpus})
    assert burst(reg, w, 10, Need(gpu_milli=100)) == {"w1-gpu0": 5, "w1-gpu1": 5}


def test_balanced_burst_does_not_herd_onto_the_idlest(reg: WorkerRegistry) -> None:
    """A reported 0 % and B 20 % at the last heartbeat; ten 100-milli requests arrive before the next.

    They must not all land on A. The balanced score counts B's measured 20 % as load, so the even
    outcome is equal total load: A takes 6 (0 % + 60 %) and B takes 4 (20 % + 40 %).
    """
    w = add(reg, "w1", 2)
    a, b = w.gpus
    reg.update_state(w, {a.uuid: GpuState(util=0.0), b.uuid: GpuState(util=20.0)})
    counts = burst(reg, w, 10, Need(gpu_milli=100))
    assert counts == {"w1-gpu0": 6, "w1-gpu1": 4}
    assert a.granted_milli + a.state.util * 10 == b.granted_milli + b.state.util * 10 == 600
    assert a.milli_since_beat == 600 and b.milli_since_beat == 400


# --------------------------------------------------------------------------- best-fit, spread, avoid


def test_best_fit_packs_and_spread_spreads(reg: WorkerRegistry) -> None:
    w = add(reg, "w1", 4)
    g0, g1, g2, g3 = w.gpus
    ledger.grant(w, [g0], Need(gpu_milli=300))
    ledger.grant(w, [g1], Need(gpu_milli=700))
    ledger.grant(w, [g2], Need(gpu_milli=900))  # 100 free: too little for the need below
    need = Need(gpu_milli=200)
    packed = best_fit(need, reg)
    assert packed is not None and packed.gpus == [g1]
    spread_out = spread(need, reg)
    assert spread_out is not None and spread_out.gpus == [g3]
    assert (
        POLICIES["best-fit"] is best_fit
        and POLICIES["spread"] is spread
        and POLICIES["balanced"] is balanced
    )
    # best-fit takes an exact fit, leaving nothing
    exact = best_fit(Need(gpu_milli=100), reg)
    assert exact is not None and exact.gpus == [g2]


def test_best_fit_and_spread_across_workers(reg: WorkerRegistry) -> None:
    w1 = add(reg, "w1", 1)
    w2 = add(reg, "w2", 1)
    ledger.grant(w2, w2.gpus, Need(gpu_milli=500))
    need = Need(gpu_milli=100)
    bf, sp = best_fit(need, reg), spread(need, reg)
    assert bf is not None and bf.worker is w2
    assert sp is not None and sp.worker is w1


@pytest.mark.parametrize("name", list(POLICIES))
def test_avoid_excludes_workers_by_name(reg: WorkerRegistry, name: str) -> None:
    policy = POLICIES[name]
    w1 = add(reg, "w1", 1)
    w2 = add(reg, "w2", 1)
    need = Need(gpu_milli=100)
    first = policy(need, reg, ())
    assert first is not None and first.worker is w1
    other = policy(need, reg, {"w1"})
    assert other is not None and other.worker is w2
    assert policy(need, reg, {"w1", "w2"}) is None
    assert policy(need, reg, {"nobody"}) is not None


# --------------------------------------------------------------------------- reservation


def test_reserve_worker_takes_the_most_free_fitting_share(reg: WorkerRegistry) -> None:
    """The broker's queue and the trace simulator reserve through this one function."""
    a = add(reg, "a", 2)
    add(reg, "b", [info("b-0", 0), info("b-1", 1), info("b-2", 2, model="T4")])
    add(reg, "c", 4, cpu_milli=1000)
    ledger.grant(a, [a.gpus[0]], Need(gpu_milli=500))
    need = Need(gpu_milli=500, cpu_milli=2000, models=frozenset({"A100"}))
    # a: 1500 free on A100s; b: 2000 on A100s (its T4 does not count); c can never take the CPU.
    assert reserve_worker(need, reg, set()) == "b"
    assert reserve_worker(need, reg, {"b"}) == "a"
    assert reserve_worker(need, reg, set(), avoid={"b"}) == "a"
    assert reserve_worker(need, reg, {"a", "b"}) is None
    assert reserve_worker(Need(gpus=1), reg, set()) == "c"  # 4 free GPUs, the CPU it asks is none
