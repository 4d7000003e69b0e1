"""Trace replay (bench/tracesim.py): loading, Need conversion, every policy's limits, the published
static method's bookkeeping, the dynamic mode, the command line and, where the trace is present, the
published Random-fit and Best-fit figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import tracesim
from bench.tracesim import (
    GPU_MEM,
    MiB,
    TraceNode,
    build_registry,
    compare_dynamic,
    curve_of,
    gpus_needed,
    load_nodes,
    load_tasks,
    parse_seeds,
    peak_demand,
    proportional_order,
    replay_static,
    run_dynamic,
    submission_order,
    task_need,
    unallocated_at,
    wait_percentiles,
)
from gpud.resources import Need
from gpud_broker import ledger
from gpud_broker.mix import TaskMix
from gpud_broker.policies import FACTORIES, make_policy, needs_gpu

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
TASK_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"

TRACES = Path(__file__).parents[2].parent / "shared" / "traces" / "alibaba-gpu-v2023"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    nodes = write(
        tmp_path / "nodes.csv",
        NODE_HEADER
        + "n0,16000,65536,2,T4\n"  # small: 16 cores, 64 GiB
        + "n1,64000,262144,4,V100\n"
        + "n2,96000,393216,8,A100\n",
    )
    tasks = write(
        tmp_path / "tasks.csv",
        TASK_HEADER
        + "t0,4000,8192,1,500,,LS,Running,0,100,0\n"  # a share
        + "t1,8000,16384,1,1000,,LS,Running,10,200,12\n"  # a whole GPU
        + "t2,32000,65536,4,1000,,LS,Running,20,300,\n"  # four GPUs, never scheduled
        + "t3,12000,4096,0,0,,BE,Running,30,40,30\n"  # CPU only
        + "t4,1000,1024,1,300,T4|V100,LS,Running,40,80,40\n",  # model filter
    )
    return nodes, tasks


# --------------------------------------------------------------------------- loading


def test_load_nodes_and_build_registry(trace: tuple[Path, Path]) -> None:
    nodes = load_nodes(trace[0])
    assert nodes[0] == TraceNode("n0", 16000, 65536, 2, "T4")
    reg = build_registry(nodes)
    assert len(reg) == 3 and len(reg.gpus) == 14
    w = reg.by_name["n1"]
    assert (w.cpu_milli, w.host_mem, w.simulated) == (64000, 262144 * MiB, True)
    assert [g.info.index for g in w.gpus] == [0, 1, 2, 3]
    assert {g.info.model for g in w.gpus} == {"V100"} and all(g.info.mem == GPU_MEM for g in w.gpus)


def test_load_tasks_and_need_conversion(trace: tuple[Path, Path]) -> None:
    tasks = {t.name: t for t in load_tasks(trace[1])}
    share, whole, four, cpu, typed = (tasks[f"t{i}"] for i in range(5))
    assert share.need == Need(gpu_milli=500, cpu_milli=4000, host_mem=8192 * MiB)
    assert share.gpu_request == 500 and share.duration == 100
    assert whole.need == Need(gpus=1, cpu_milli=8000, host_mem=16384 * MiB) and whole.gpu_request == 1000
    assert whole.duration == 200 - 12  # from scheduled_time
    assert four.need.gpus == 4 and four.need.total_milli == 4000 and four.gpu_request == 4000
    assert four.scheduled is None and four.duration == 300 - 20  # never scheduled: from creation
    assert cpu.need == Need(gpu_milli=0, gpus=0, cpu_milli=12000, host_mem=4096 * MiB)
    assert not needs_gpu(cpu.need) and cpu.gpu_request == 0
    assert typed.need.models == frozenset({"T4", "V100"}) and typed.models == typed.need.models


def test_load_tasks_without_spec_and_times(tmp_path: Path) -> None:
    """The multigpu files stop after gpu_milli."""
    path = write(tmp_path / "m.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,2,1000\np1,500,512,1,250\n")
    a, b = load_tasks(path)
    assert a.need == Need(gpus=2, cpu_milli=1000, host_mem=1024 * MiB) and a.models is None
    assert a.creation is None and a.duration is None
    assert b.need.gpu_milli == 250
    with pytest.raises(ValueError):
        run_dynamic([TraceNode("n", 1000, 1024, 1, "X")], [a, b], "best-fit")


def test_task_need_multi_gpu_ignores_share_column() -> None:
    assert task_need(8, 1000, 0, 0, None) == Need(gpus=8)
    assert task_need(1, 1000, 0, 0, None) == Need(gpus=1)


# --------------------------------------------------------------------------- every policy's limits


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_policy_respects_cpu_memory_model_and_multi_gpu(trace: tuple[Path, Path], name: str) -> None:
    reg = build_registry(load_nodes(trace[0]))
    workers = list(reg.by_identity.values())
    policy = make_policy(name, seed=1, mix=TaskMix())
    needs = [
        Need(gpu_milli=500, cpu_milli=2000, host_mem=MiB),
        Need(gpus=4, cpu_milli=40000, host_mem=128 * 1024 * MiB),  # only n1 or n2; n1 lacks memory? no: 256 GiB
        Need(gpus=8, cpu_milli=1000),  # only n2
        Need(gpu_milli=300, models=frozenset({"T4"})),  # only n0
        Need(gpu_milli=0, cpu_milli=50000, host_mem=300 * 1024 * MiB),  # CPU only: only n2
        Need(gpus=1, cpu_milli=20000, host_mem=MiB),  # not n0 (16 cores)
    ]
    for _ in range(3):
        for need in needs:
            p = policy(need, workers, ())
            if p is None:
                continue
            w = p.worker
            assert w.free_cpu >= need.cpu_milli and w.free_host_mem >= need.host_mem
            if not needs_gpu(need):
                assert p.gpus == []
            else:
                assert len(p.gpus) == need.gpu_count and all(g.worker is w for g in p.gpus)
                assert len({g.uuid for g in p.gpus}) == len(p.gpus)
                assert all(g.free_milli >= need.milli_per_gpu for g in p.gpus)
                if need.models is not None:
                    assert all(g.info.model in need.models for g in p.gpus)
                if need.gpus:
                    assert [g.info.index for g in p.gpus] == sorted(g.info.index for g in p.gpus)
            ledger.grant(w, p.gpus, need)  # never refused: the policy only proposes what fits
    # impossible requests are refused by every policy
    assert policy(Need(gpus=9), workers, ()) is None
    assert policy(Need(gpu_milli=100, cpu_milli=200_000), workers, ()) is None
    assert policy(Need(gpu_milli=100, models=frozenset({"H100"})), workers, ()) is None
    assert policy(Need(gpu_milli=0, host_mem=1 << 50), workers, ()) is None
    # and everything avoided means nothing
    assert policy(Need(gpu_milli=1), workers, {"n0", "n1", "n2"}) is None


def test_whole_gpus_take_the_lowest_free_indexes(trace: tuple[Path, Path]) -> None:
    for name in sorted(FACTORIES):
        reg = build_registry(load_nodes(trace[0]))
        w = reg.by_name["n2"]
        ledger.grant(w, [w.gpus[1]], Need(gpu_milli=100))
        p = make_policy(name, seed=3, mix=TaskMix())(Need(gpus=3), [w], ())
        assert p is not None and [g.info.index for g in p.gpus] == [0, 2, 3], name


# --------------------------------------------------------------------------- static mode


def one_node(tmp_path: Path, tasks: str, gpus: int = 2) -> tuple[list[TraceNode], Path]:
    nodes = [TraceNode("n0", 64000, 65536, gpus, "T4")]
    return nodes, write(tmp_path / "t.csv", TASK_HEADER + tasks)


def test_static_bookkeeping_by_hand(tmp_path: Path) -> None:
    """Two GPUs (2000 milli), every task a 500 share: five fit under 130% (2500 <= 2600), four fit."""
    nodes, path = one_node(tmp_path, "a,1000,1024,1,500,,LS,Running,0,1,0\n")
    tasks = load_tasks(path)
    for policy in sorted(FACTORIES):
        r = replay_static(nodes, tasks, policy, seed=7, keep_samples=True)
        assert (r.submitted, r.placed, r.rejected, r.gpus) == (5, 4, 1, 2)
        assert r.arrived == [25.0, 50.0, 75.0, 100.0, 125.0]
        assert r.allocated == [25.0, 50.0, 75.0, 100.0, 100.0]
        assert r.unallocated_at_100 == 0.0
        assert r.curve == [(25, 75.0), (50, 50.0), (75, 25.0), (100, 0.0), (125, 0.0)]


def test_cpu_only_and_rejected_tasks_are_samples(tmp_path: Path) -> None:
    nodes, path = one_node(
        tmp_path,
        "g,1000,1024,1,1000,,LS,Running,0,1,0\n"
        "c,1000,1024,0,0,,LS,Running,0,1,0\n"
        "big,1000,1024,1,1000,,LS,Running,0,1,0\n",
        gpus=1,
    )
    tasks = load_tasks(path)
    r = replay_static(nodes, tasks, "best-fit", seed=1, keep_samples=True)
    # capacity 1000, limit 1300: one 1000 task fits the limit; CPU-only tasks always do
    assert r.submitted == len(r.arrived) == len(r.allocated)
    gpu_tasks = sum(1 for a, b in zip([0.0, *r.arrived], r.arrived, strict=False) if b > a)
    assert gpu_tasks == 1 and r.placed >= 1
    assert max(r.allocated) == 100.0


def test_submission_order_is_seeded_and_bounded(trace: tuple[Path, Path]) -> None:
    tasks = load_tasks(trace[1])
    cap = 14_000
    a = [t.name for t in submission_order(tasks, cap, 5)]
    b = [t.name for t in submission_order(tasks, cap, 5)]
    c = [t.name for t in submission_order(tasks, cap, 6)]
    assert a == b and a != c
    assert sorted(a[: len(tasks)]) == sorted(t.name for t in tasks)  # the whole trace first
    assert sum(t.gpu_request for t in submission_order(tasks, cap, 5)) <= 1.3 * cap


def test_static_replay_is_deterministic(trace: tuple[Path, Path]) -> None:
    nodes, tasks = load_nodes(trace[0]), load_tasks(trace[1])
    for policy in ("random", "fgd", "best-fit"):
        x = replay_static(nodes, tasks, policy, seed=11, keep_samples=True)
        y = replay_static(nodes, tasks, policy, seed=11, keep_samples=True)
        assert (x.arrived, x.allocated, x.curve) == (y.arrived, y.allocated, y.curve)


def test_curve_and_figure_helpers() -> None:
    arrived = [99.4, 99.6, 100.4, 100.5, 101.0]
    allocated = [90.0, 91.0, 93.0, 95.0, 95.0]
    assert unallocated_at(arrived, allocated) == pytest.approx(100 - 92.0)
    assert curve_of(arrived, allocated) == [(99, 10.0), (100, 8.0), (101, 5.0)]
    assert math.isnan(unallocated_at([1.0], [1.0]))
    assert parse_seeds("42..44") == [42, 43, 44] and parse_seeds("1,5") == [1, 5] and parse_seeds("9") == [9]
    with pytest.raises(ValueError):
        parse_seeds("5..4")


# --------------------------------------------------------------------------- dynamic mode


def dynamic_trace(tmp_path: Path) -> tuple[list[TraceNode], list]:
    nodes = [TraceNode("n0", 16000, 16384, 1, "T4"), TraceNode("n1", 16000, 16384, 1, "T4")]
    path = write(
        tmp_path / "d.csv",
        TASK_HEADER
        + "a,1000,1024,1,600,,LS,Running,0,100,0\n"  # 0..100
        + "b,1000,1024,1,300,,LS,Running,10,60,10\n",  # 10..60
    )
    return nodes, load_tasks(path)


def test_dynamic_sharing_needs_fewer_gpus_than_passthrough(tmp_path: Path) -> None:
    nodes, tasks = dynamic_trace(tmp_path)
    share = gpus_needed(nodes, tasks, "best-fit", max_wait=60)
    whole = gpus_needed(nodes, tasks, "best-fit", passthrough=True, max_wait=60)
    assert (share.gpus_needed, whole.gpus_needed) == (1, 2)
    assert share.run is not None and whole.run is not None
    # sharing: 600 x 100 s + 300 x 50 s over 100 s on one GPU
    assert share.run.mean_allocation == pytest.approx(75.0)
    assert share.run.mean_requested == pytest.approx(75.0)
    # passthrough: two whole GPUs, 1000 x 100 s + 1000 x 50 s over 100 s on two GPUs
    assert whole.run.mean_allocation == pytest.approx(75.0)
    assert whole.run.mean_requested == pytest.approx(37.5)
    assert share.run.waits == [0.0, 0.0] and whole.run.waits == [0.0, 0.0]


def test_dynamic_waits_and_the_wait_limit(tmp_path: Path) -> None:
    nodes, tasks = dynamic_trace(tmp_path)
    one = nodes[:1]
    waited = run_dynamic(one, tasks, "best-fit", passthrough=True, max_wait=math.inf)
    assert waited.ok and sorted(waited.waits) == [0.0, 90.0]  # b waits for a's GPU
    assert waited.percentiles() == {"p50": 0.0, "p90": 90.0, "p99": 90.0, "max": 90.0}
    limited = run_dynamic(one, tasks, "best-fit", passthrough=True, max_wait=60)
    assert not limited.ok and "waited more than 60s" in limited.why
    assert peak_demand(tasks) == pytest.approx(0.9) and peak_demand(tasks, passthrough=True) == 2.0
    result = compare_dynamic(nodes, tasks, "fgd", "best-fit", max_wait=60)
    assert [r["gpus_needed"] for r in result["rows"]] == [1, 2]
    assert result["same_cluster"]["gpus"] == 1
    assert [r["waited"] for r in result["same_cluster"]["rows"]] == [0, 1]
    assert wait_percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}


def test_proportional_order_keeps_kinds_in_proportion() -> None:
    nodes = [TraceNode(f"a{i}", 1, 1, 8, "A") for i in range(6)] + [TraceNode(f"b{i}", 1, 1, 2, "B") for i in range(3)]
    order = proportional_order(nodes)
    assert sorted(n.name for n in order) == sorted(n.name for n in nodes)
    for k in range(1, len(order) + 1):
        a = sum(1 for n in order[:k] if n.model == "A")
        assert abs(a - k * 6 / 9) < 1.0 or k < 2


# --------------------------------------------------------------------------- command line


def test_cli_static_json(trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    nodes, tasks = trace
    assert tracesim.main([str(tasks), "--nodes", str(nodes), "--policy", "best-fit", "--seeds", "1..2", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "unallocated GPU share at 100% arrived" in "\n".join(out)
    summary = json.loads(out[-1])
    assert summary["policy"] == "best-fit" and summary["seeds"] == [1, 2] and summary["mode"] == "static"
    assert isinstance(summary["unallocated_at_100"], float) and summary["curve"]
    assert all(len(point) == 2 for point in summary["curve"])


def test_cli_dynamic_and_errors(trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    nodes, tasks = trace
    assert tracesim.main([str(tasks), "--nodes", str(nodes), "--mode", "dynamic", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == "dynamic" and len(summary["rows"]) == 2
    assert tracesim.main([str(tmp_path / "missing.csv"), "--nodes", str(nodes)]) == 2


# --------------------------------------------------------------------------- the published figures


@pytest.mark.skipif(not (TRACES / "openb_pod_list_default.csv").is_file(), reason="the shared trace is not here")
def test_published_random_and_best_fit_figures_one_seed() -> None:
    """One seed of the published method on `default` (the command's own function, ~10 s).

    The published figures are means of ten seeds (Random-fit 13.70, Best-fit 7.14); across seeds
    42..51 this replay's standard deviation is about 0.4 (random) and 0.2 (best-fit) points, so one
    seed must land within 1.5 and 1.0 points of them. (Seed 42 gives 14.09 and 7.24.)
    """
    nodes = load_nodes(TRACES / "openb_node_list_gpu_node.csv")
    tasks = load_tasks(TRACES / "openb_pod_list_default.csv")
    assert (len(nodes), sum(n.gpus for n in nodes), len(tasks)) == (1213, 6212, 8152)
    best = replay_static(nodes, tasks, "best-fit", seed=42)
    assert abs(best.unallocated_at_100 - 7.14) < 1.0, best.unallocated_at_100
    rand = replay_static(nodes, tasks, "random", seed=42)
    assert abs(rand.unallocated_at_100 - 13.70) < 1.5, rand.unallocated_at_100


def test_a_trace_without_gpu_requests_ends(tmp_path: Path) -> None:
    nodes, path = one_node(tmp_path, "c,1000,1024,0,0,,LS,Running,0,1,0\nd,1000,1024,0,0,,LS,Running,0,1,0\n")
    r = replay_static(nodes, load_tasks(path), "fgd", seed=1)
    assert r.submitted == 2 and math.isnan(r.unallocated_at_100)
