"""The task mix (gpud_broker.mix) and fragmentation gradient descent (policies.FragmentationGradientDescent)."""

from __future__ import annotations

import random

import pytest

from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import GpuInfo, GpuState, Need
from gpud_broker import ledger
from gpud_broker.mix import NeedClass, TaskMix
from gpud_broker.policies import (
    FACTORIES,
    SAMPLE_ABOVE,
    SAMPLE_K,
    FragmentationGradientDescent,
    RandomFit,
    best_fit,
    feasible_gpus,
    make_policy,
    needs_gpu,
    worker_can_take,
)
from gpud_broker.registry import WorkerRecord, WorkerRegistry

GiB = 1 << 30


def add(reg: WorkerRegistry, name: str, gpus: int = 1, model: str = "T4", cpu: int = 64000, mem: int = 64 * GiB) -> WorkerRecord:
    return reg.add(
        name=name,
        identity=name.encode(),
        hostname=name,
        gpus=[GpuInfo(f"{name}-{i}", i, model, 16 * GiB, (7, 5)) for i in range(gpus)],
        cpu_milli=cpu,
        host_mem=mem,
        slots=64,
        policy=HeartbeatPolicy(),
        now=0.0,
    )


# --------------------------------------------------------------------------- the mix


def test_need_classes() -> None:
    assert NeedClass.of(Need(gpu_milli=300, cpu_milli=3152)) == NeedClass(300, 1, 4000, None)
    assert NeedClass.of(Need(gpus=4, cpu_milli=1000)) == NeedClass(1000, 4, 1000, None)
    assert NeedClass.of(Need(gpu_milli=0, cpu_milli=1)) == NeedClass(0, 0, 1000, None)
    assert NeedClass.of(Need(gpu_milli=10, exclusive=True)).milli == 1000  # takes the GPU whole
    assert NeedClass.of(Need(gpu_milli=250, models=frozenset({"T4"})), cpu_step=1).models == frozenset({"T4"})
    assert not NeedClass.of(Need(gpu_milli=0)).needs_gpu


def test_mix_observes_and_decays() -> None:
    mix = TaskMix(half_life=1)  # each observation weighs twice the one before
    a, b = Need(gpu_milli=500), Need(gpus=1)
    ca = mix.observe(a)
    cb = mix.observe(b)
    assert mix.probability(ca) == pytest.approx(1 / 3) and mix.probability(cb) == pytest.approx(2 / 3)
    mix.observe(a)  # weights 1, 2, 4
    assert mix.probability(ca) == pytest.approx(5 / 7)
    assert sum(p for _, p in mix.items()) == pytest.approx(1.0)
    assert dict(mix) == dict(mix.items())
    for _ in range(2000):  # far past the point where the weights are rescaled
        mix.observe(b)
    assert mix.probability(cb) == pytest.approx(1.0) and mix.observations == 2003


def test_mix_is_bounded() -> None:
    mix = TaskMix(half_life=1000, max_classes=2)
    for milli in (100, 100, 100, 200, 200, 300):
        mix.observe(Need(gpu_milli=milli))
    assert len(mix) == 2
    kept = {c.milli for c, _ in mix.items()}
    assert kept == {100, 300}  # the lightest (200) went when 300 came in


def test_mix_ratios_count_requests_with_gpu_only() -> None:
    mix = TaskMix(half_life=1e9)
    mix.observe(Need(gpu_milli=500, cpu_milli=4000, host_mem=8 * GiB))
    mix.observe(Need(gpus=2, cpu_milli=8000, host_mem=8 * GiB))
    mix.observe(Need(gpu_milli=0, cpu_milli=100_000, host_mem=100 * GiB))  # no GPU: not counted
    assert mix.cpu_per_milli == pytest.approx(12000 / 2500)
    assert mix.mem_per_milli == pytest.approx(16 * GiB / 2500)


def test_snapshot_versions_follow_real_change() -> None:
    mix = TaskMix(half_life=100, tolerance=0.05, check_every=4)
    assert mix.snapshot().version == 0 and mix.snapshot().classes == ()
    mix.observe(Need(gpu_milli=500))
    first = mix.snapshot()
    assert first.version == 1 and first.classes[0][1] == pytest.approx(1.0)
    for _ in range(40):  # the same class again and again: the distribution does not move
        mix.observe(Need(gpu_milli=500))
        assert mix.snapshot().version == 1
    for _ in range(40):
        mix.observe(Need(gpus=1))
    last = mix.snapshot()
    assert last.version > 1 and mix.distance() <= 0.05
    assert [p for _, p in last.classes] == sorted((p for _, p in last.classes), reverse=True)


# --------------------------------------------------------------------------- FGD by hand


def fgd_with(classes: list[tuple[Need, int]], shortfall_weight: float = 1.0, pressure_weight: float = 1.0) -> FragmentationGradientDescent:
    mix = TaskMix(half_life=1e9, cpu_step=1)
    for need, n in classes:
        for _ in range(n):
            mix.observe(need)
    mix.publish()
    return FragmentationGradientDescent(mix, shortfall_weight=shortfall_weight, pressure_weight=pressure_weight)


def test_expected_fragment_by_hand() -> None:
    """Mix: half 400-milli shares, half whole GPUs (no CPU, so no shortfall).

    Free (300, 1000): a 400 share fits, fragment 300 (the small GPU); a whole GPU fits, fragment 300.
    Expected 0.5 * 300 + 0.5 * 300 = 300. Free (300, 600): the share fragment is still 300, but no
    whole GPU is free: all 900 is fragment for it. Expected 0.5 * 300 + 0.5 * 900 = 600.
    """
    fgd = fgd_with([(Need(gpu_milli=400), 5), (Need(gpus=1), 5)])
    reg = WorkerRegistry()
    a, b = add(reg, "a", 2), add(reg, "b", 2)
    ledger.grant(a, [a.gpus[0]], Need(gpu_milli=700))
    ledger.grant(b, [b.gpus[0]], Need(gpu_milli=700))
    ledger.grant(b, [b.gpus[1]], Need(gpu_milli=400))
    assert fgd.score(a) == pytest.approx(300.0)
    assert fgd.score(b) == pytest.approx(600.0)


def test_fgd_prefers_less_fragmentation_where_best_fit_packs() -> None:
    """Mix: 400-milli shares only. A 300 task on A (free 700 -> 400) leaves a GPU the next 400
    task fits: no fragment. On B (free 400 -> 100) the 100 left fits nothing: +100. FGD takes A;
    Best-fit, packing, takes B."""
    fgd = fgd_with([(Need(gpu_milli=400), 10)])
    reg = WorkerRegistry()
    a, b = add(reg, "a"), add(reg, "b")
    ledger.grant(a, a.gpus, Need(gpu_milli=300))
    ledger.grant(b, b.gpus, Need(gpu_milli=600))
    need = Need(gpu_milli=300)
    assert (fgd.score(a), fgd.score(b)) == (0.0, 0.0)
    p = fgd(need, [a, b], ())
    assert p is not None and p.worker is a
    packed = best_fit(need, [a, b], ())
    assert packed is not None and packed.worker is b
    # either way round in the scan
    p = fgd(need, [b, a], ())
    assert p is not None and p.worker is a


def test_fgd_takes_the_gpu_that_fragments_least_inside_a_worker() -> None:
    fgd = fgd_with([(Need(gpu_milli=400), 10)])
    reg = WorkerRegistry()
    w = add(reg, "w", 3)
    ledger.grant(w, [w.gpus[0]], Need(gpu_milli=600))  # free 400: a 300 leaves 100 (fragment)
    ledger.grant(w, [w.gpus[1]], Need(gpu_milli=300))  # free 700: a 300 leaves 400 (usable)
    p = fgd(Need(gpu_milli=300), [w], ())
    assert p is not None and p.gpus == [w.gpus[1]]


def test_stranded_counts_gpus_the_cpu_cannot_feed() -> None:
    """Mix: 500 shares asking 5000 milli-CPU, i.e. 10 milli-CPU per milli-GPU.

    B (1 free GPU, 12000 CPU) can feed 1200 milli: nothing stranded. After a CPU-only task of 4000
    it can feed 800 of its 1000: 200 stranded. A has no free GPU: nothing to strand, so the CPU-only
    task goes there.
    """
    fgd = fgd_with([(Need(gpu_milli=500, cpu_milli=5000), 10)])
    reg = WorkerRegistry()
    a, b = add(reg, "a", cpu=20000), add(reg, "b", cpu=12000)
    ledger.grant(a, a.gpus, Need(gpus=1))
    assert fgd.score(b) == 0.0
    cpu_task = Need(gpu_milli=0, cpu_milli=4000)
    p = fgd(cpu_task, [b, a], ())
    assert p is not None and p.worker is a and p.gpus == []
    ledger.grant(b, [], cpu_task)
    assert fgd.score(b) == pytest.approx(200.0)
    classic = fgd_with([(Need(gpu_milli=500, cpu_milli=5000), 10)], shortfall_weight=0.0)
    assert classic.score(b) == 0.0


def test_stranded_is_expected_over_the_classes_cpu_per_gpu() -> None:
    """Mix by GPU demand: half whole GPUs asking 4000 CPU (4 per milli-GPU), half asking 16000 (16).

    A worker with 1000 free milli and 8000 free CPU feeds all of the first class (needs 4000) and
    half of the second (8000 / 16 = 500 milli): expected stranded 0.5 * 500 = 250 milli. With 20000
    CPU nothing is stranded; with 2000 the first class strands 500 and the second 875: 687.5.
    """
    fgd = fgd_with([(Need(gpus=1, cpu_milli=4000), 5), (Need(gpus=1, cpu_milli=16000), 5)])
    t = fgd.tables()
    assert t.stranded(1000, 8000, 0) == pytest.approx(250.0)
    assert t.stranded(1000, 20000, 0) == 0.0
    assert t.stranded(1000, 2000, 0) == pytest.approx(0.5 * 500 + 0.5 * 875)
    assert t.stranded(0, 0, 0) == 0.0
    # a CPU-only task goes where it strands least: the worker with CPU to spare for its GPUs
    reg = WorkerRegistry()
    lean, rich = add(reg, "lean", cpu=16000), add(reg, "rich", cpu=64000)
    p = fgd(Need(gpu_milli=0, cpu_milli=8000), [lean, rich], ())
    assert p is not None and p.worker is rich


def test_model_pressure_keeps_wanted_models_for_the_tasks_that_name_them() -> None:
    """Mix (by count): 30 % one T4 GPU only, 40 % one GPU of any model, 30 % two GPUs of any model.
    Free: a T4 worker with 1 GPU, a V100 worker with 2.

    The paper's measure: one GPU on the T4 worker removes the GPU the two-GPU class could never use
    there (-300); on the V100 worker it removes a GPU the T4 class cannot use (-300) but breaks the
    pair (+300): 0. It takes the T4 and leaves the T4-only tasks nothing. By GPU demand the T4-only
    class is 300 / 1300 of the demand and T4 a third of the free share: pressure 0.69 on T4, 0 on
    V100, so taking the T4 costs 692 more, and the task goes to the V100."""
    mix = [(Need(gpus=1, models=frozenset({"T4"})), 3), (Need(gpus=1), 4), (Need(gpus=2), 3)]
    fgd = fgd_with(mix)
    reg = WorkerRegistry()
    t4, v100 = add(reg, "t4", 1, "T4"), add(reg, "v100", 2, "V100")
    fgd.count_supply([t4, v100])
    assert fgd.pressure == pytest.approx({"T4": 300 / 1300 * 3, "V100": 0.0})
    p = fgd(Need(gpus=1), [t4, v100], ())
    assert p is not None and p.worker is v100
    classic = fgd_with(mix, shortfall_weight=0.0, pressure_weight=0.0)
    p = classic(Need(gpus=1), [t4, v100], ())
    assert p is not None and p.worker is t4
    # The T4-only task itself still goes to the T4, the only GPU it may use.
    p = fgd(Need(gpus=1, models=frozenset({"T4"})), [t4, v100], ())
    assert p is not None and p.worker is t4
    # Between counts the policy keeps the free share up with its own placements.
    assert fgd.supply == {"T4": 0, "V100": 1000}


def test_fgd_without_a_mix_feeds_its_own() -> None:
    fgd = FragmentationGradientDescent()
    reg = WorkerRegistry()
    w = add(reg, "w", 2)
    assert fgd(Need(gpu_milli=250), [w], ()) is not None
    assert fgd.feeds and fgd.mix.observations == 1
    shared = TaskMix()
    assert not FragmentationGradientDescent(shared).feeds


def test_fgd_models_several_on_one_worker() -> None:
    fgd = fgd_with([(Need(gpu_milli=500), 5)])
    reg = WorkerRegistry()
    w = reg.add(
        name="mixed", identity=b"mixed", hostname="", cpu_milli=8000, host_mem=GiB, slots=8,
        gpus=[GpuInfo("m0", 0, "T4", GiB, (7, 5)), GpuInfo("m1", 1, "A100", GiB, (8, 0))],
        policy=HeartbeatPolicy(), now=0.0,
    )
    p = fgd(Need(gpu_milli=500, models=frozenset({"A100"})), [w], ())
    assert p is not None and p.gpus == [w.gpus[1]]
    p = fgd(Need(gpus=2), [w], ())
    assert p is not None and p.gpus == w.gpus
    assert fgd(Need(gpus=3), [w], ()) is None


def test_fgd_picks_the_least_increase_against_brute_force() -> None:
    """On random clusters the placement FGD returns increases the score by the least any feasible
    placement does (each candidate tried with the real ledger and undone)."""
    rng = random.Random(5)

    def need() -> Need:
        kind = rng.choice(["cpu", "share", "share", "whole", "multi"])
        cpu = rng.choice([1000, 4000, 8000, 16000])
        if kind == "cpu":
            return Need(gpu_milli=0, cpu_milli=cpu)
        if kind == "share":
            return Need(gpu_milli=rng.choice([100, 250, 300, 500, 700]), cpu_milli=cpu,
                        models=rng.choice([None, frozenset({"A"}), frozenset({"B"})]))
        if kind == "whole":
            return Need(gpus=1, cpu_milli=cpu)
        return Need(gpus=rng.choice([2, 4]), cpu_milli=cpu)

    for _ in range(20):
        reg = WorkerRegistry()
        workers = [add(reg, f"n{i}", rng.choice([1, 2, 4, 8]), rng.choice("AB"), rng.choice([16000, 32000, 64000]))
                   for i in range(8)]
        mix = TaskMix(cpu_step=1)
        fgd = FragmentationGradientDescent(mix)
        for _ in range(30):
            n = need()
            mix.observe(n)
            fgd.tables()
            fgd.count_supply(workers)  # the model weights this decision uses
            best = None
            for w in workers:
                if not worker_can_take(n, w):
                    continue
                options: list[list] = [[]]
                if needs_gpu(n):
                    fit = feasible_gpus(n, w)
                    if len(fit) < n.gpu_count:
                        continue
                    options = [fit[: n.gpu_count]] if n.gpus else [[g] for g in fit]
                before = fgd.score(w)
                for option in options:
                    g = ledger.grant(w, option, n)
                    delta = fgd.score(w) - before
                    ledger.release(w, option, g)
                    best = delta if best is None else min(best, delta)
            p = fgd(n, workers, ())
            if best is None:
                assert p is None
                continue
            assert p is not None
            before = fgd.score(p.worker)
            ledger.grant(p.worker, p.gpus, n)
            assert fgd.score(p.worker) - before == pytest.approx(best, abs=1e-6)


# --------------------------------------------------------------------------- the tables


def test_make_policy() -> None:
    assert set(FACTORIES) >= {"balanced", "best-fit", "spread", "random", "fgd"}
    assert make_policy("best-fit") is best_fit
    assert isinstance(make_policy("random", seed=1), RandomFit)
    mix = TaskMix()
    fgd = make_policy("fgd", mix=mix)
    assert isinstance(fgd, FragmentationGradientDescent) and fgd.mix is mix
    with pytest.raises(ValueError):
        make_policy("nope")


def test_random_fit_is_seeded_and_uniform_over_feasible_workers() -> None:
    reg = WorkerRegistry()
    workers = [add(reg, f"w{i}", 2) for i in range(4)]
    ledger.grant(workers[0], workers[0].gpus, Need(gpus=2))  # full: never chosen for GPUs
    picks = [RandomFit(seed=9)(Need(gpu_milli=100), workers, ()) for _ in range(2)]
    assert picks[0] is not None and picks[1] is not None and picks[0].gpus == picks[1].gpus
    policy = RandomFit(seed=1)
    seen = {w.name: 0 for w in workers}
    for _ in range(600):
        p = policy(Need(gpu_milli=100), workers, ())
        assert p is not None
        seen[p.worker.name] += 1
    assert seen["w0"] == 0 and all(150 <= seen[f"w{i}"] <= 250 for i in (1, 2, 3))
    policy.tries = 0  # the listing path
    p = policy(Need(gpu_milli=100), workers, {"w1", "w2"})
    assert p is not None and p.worker.name == "w3"


# --------------------------------------------------------------------------- fgd-balanced


def test_fgd_balanced_spreads_where_packing_ties_and_packs_where_it_does_not() -> None:
    """Mix: 250-milli shares only, so no placement of a 250 share fragments: every GPU ties.
    fgd breaks the tie as Best-fit (the fullest GPU: all four on one); fgd-balanced by live load
    (one on each). With whole GPUs in the mix, putting the share on an idle GPU would break a whole
    GPU: both pack it onto the used one."""
    shares = [(Need(gpu_milli=250), 10)]
    for balance, expected in ((False, {"a-0": 4}), (True, {"a-0": 1, "a-1": 1, "b-0": 1, "b-1": 1})):
        reg = WorkerRegistry()
        a, b = add(reg, "a", 2), add(reg, "b", 2)
        fgd = fgd_with(shares)
        fgd.balance = balance
        placed: dict[str, int] = {}
        for _ in range(4):
            p = fgd(Need(gpu_milli=250), [a, b], ())
            assert p is not None
            ledger.grant(p.worker, p.gpus, Need(gpu_milli=250))
            placed[p.gpus[0].uuid] = placed.get(p.gpus[0].uuid, 0) + 1
        assert placed == expected, balance
    reg = WorkerRegistry()
    a, b = add(reg, "a", 2), add(reg, "b", 2)
    mixed = make_policy("fgd-balanced", mix=fgd_with([(Need(gpu_milli=250), 5), (Need(gpus=1), 5)]).mix)
    ledger.grant(a, [a.gpus[0]], Need(gpu_milli=250))
    p = mixed(Need(gpu_milli=250), [b, a], ())
    assert p is not None and p.gpus == [a.gpus[0]]


def test_fgd_balanced_follows_live_utilization_and_pending_work() -> None:
    """Two idle workers tie for packing. The one whose GPU measures busy (work the ledger does not
    hold) or that has requests dispatched and not answered loses the tie."""
    reg = WorkerRegistry()
    a, b = add(reg, "a", 1), add(reg, "b", 1)
    policy = make_policy("fgd-balanced", mix=fgd_with([(Need(gpus=1), 10)]).mix)
    p = policy(Need(gpus=1), [a, b], ())
    assert p is not None and p.worker is a  # a plain tie: the first
    reg.update_state(a, {a.gpus[0].uuid: GpuState(util=80.0)})
    p = policy(Need(gpus=1), [a, b], ())
    assert p is not None and p.worker is b
    reg.update_state(a, {a.gpus[0].uuid: GpuState()})
    a.inflight = 0
    b.inflight = 3
    p = policy(Need(gpus=1), [a, b], ())
    assert p is not None and p.worker is a
    fgd = make_policy("fgd", mix=policy.mix)  # type: ignore[attr-defined]
    p = fgd(Need(gpus=1), [b, a], ())
    assert p is not None and p.worker is b  # fgd does not look: the first of the tie


def offered_counts(policy: FragmentationGradientDescent) -> list[int]:
    """Record how many workers each decision of ``policy`` is offered."""
    offered: list[int] = []
    decide = policy._decide

    def counting(need: Need, ws: list[WorkerRecord], avoid: object) -> object:
        offered.append(len(ws))
        return decide(need, ws, avoid)  # type: ignore[arg-type]

    policy._decide = counting  # type: ignore[assignment,method-assign]
    return offered


def test_fgd_balanced_samples_a_large_cluster_and_remembers_where_it_packs() -> None:
    reg = WorkerRegistry()
    workers = [add(reg, f"w{i}", 2) for i in range(SAMPLE_ABOVE + 36)]
    mix = fgd_with([(Need(gpu_milli=300), 5), (Need(gpus=1), 5)]).mix
    policy = make_policy("fgd-balanced", seed=3, mix=mix)
    assert isinstance(policy, FragmentationGradientDescent)
    offered = offered_counts(policy)
    first = policy(Need(gpu_milli=300), workers, ())
    assert first is not None
    ledger.grant(first.worker, first.gpus, Need(gpu_milli=300))
    second = policy(Need(gpu_milli=300), workers, ())
    assert second is not None and second.worker is first.worker  # packed where it chose last
    assert offered == [SAMPLE_K, SAMPLE_K + 1] or offered == [SAMPLE_K, SAMPLE_K]  # (drawn again)
    # A worker it chose that has left the cluster is never taken again.
    reg.remove(first.worker)
    workers.remove(first.worker)
    for _ in range(5):
        p = policy(Need(gpu_milli=300), workers, ())
        assert p is not None and p.worker is not first.worker
    # Only one worker can take a model-restricted request: where the sample misses it, the policy
    # asks the whole cluster (five draws: the sample of 16 in 101 misses it at least once).
    special = add(reg, "special", 1, "A100")
    offered.clear()
    for seed in range(5):
        policy.rng = random.Random(seed)
        policy._recent.clear()
        p = policy(Need(gpu_milli=300, models=frozenset({"A100"})), [*workers, special], ())
        assert p is not None and p.worker is special
    assert len(workers) + 1 in offered
