"""Scheduling quality: the Alibaba GPU-sharing trace replayed through gpud's own scheduler.

Static mode (the published method of Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent", USENIX ATC '23): the unallocated GPU share at 100%
arrived, mean and standard deviation over seeds, for every policy on ``default`` and for Random-fit,
Best-fit and FGD on every trace of the folder. Dynamic mode: the trace at its own times, gpud's GPU
sharing against exclusive passthrough (GPUs needed with no task waiting more than ``--max-wait``,
mean allocation, waits). Everything goes through ``bench/tracesim.py``, the trace simulator (which runs the broker's own
policies and ledger).

Writes, under ``--out`` (default ``bench/results``): ``replay.md`` (the "Scheduling quality" section
for BENCHMARKS.md), ``replay.json`` (every figure and curve), and the plots ``replay_default.png``,
``replay_traces.png``, ``replay_curves.png`` and ``replay_dynamic.png``. The last line of output is one JSON object.

Usage::

    .venv/bin/python bench/replay.py [--traces DIR] [--seeds 42..51] [--jobs 2] [--max-wait 60]
                                     [--out bench/results] [--quick]

About 25 minutes on two cores with the default seeds; ``--quick`` (two seeds) about 5.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tracesim import (  # noqa: E402
    INFLATE,
    NODE_FILE,
    StaticResult,
    compare_dynamic,
    load_nodes,
    load_tasks,
    parse_seeds,
    replay_static,
    summarize_static,
)
from gpud_broker.mix import TaskMix  # noqa: E402
from gpud_broker.policies import FACTORIES, FragmentationGradientDescent, Policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023"
PUBLISHED = {"random": 13.70, "best-fit": 7.14, "fgd": 4.77}  # default trace, mean of seeds 42..51
PUBLISHED_OTHERS = "Dot-product 9.38, GPU Clustering 8.35, GPU Packing 8.22"
# Published FGD and Best-fit figures of every trace (../shared/traces/README.md).
PUBLISHED_FGD = {"default": 4.77, "cpu050": 5.00, "cpu100": 4.79, "cpu200": 5.18, "gpushare40": 6.04,
                 "gpushare80": 10.92, "gpuspec10": 5.34, "gpuspec20": 5.34, "gpuspec25": 6.09,
                 "multigpu20": 4.47, "multigpu30": 3.64, "multigpu40": 3.09}
PUBLISHED_BEST_FIT = {"default": 7.14, "cpu050": 6.44, "cpu100": 6.74, "cpu200": 7.85, "gpushare40": 8.56,
                      "gpushare80": 13.34, "gpuspec10": 6.90, "gpuspec20": 11.54, "gpuspec25": 14.33,
                      "multigpu20": 6.27, "multigpu30": 5.43, "multigpu40": 4.90}
DEFAULT_POLICIES = ["random", "best-fit", "fgd", "fgd-balanced", "balanced", "spread"]
EVERY_TRACE_POLICIES = ["random", "best-fit", "fgd"]
EVERY_TRACE_INFLATE = 1.01  # where the replays of the traces other than default stop (of capacity)
SHARING_POLICIES = ["balanced", "best-fit", "fgd"]
# The ablation: fgd's measure with each of its two terms of gpud's own alone, and neither.
ABLATION = {
    "fgd-classic": (0.0, 0.0),
    "fgd-stranded": (1.0, 0.0),
    "fgd-pressure": (0.0, 1.0),
}
ABLATION_TRACES = ["default", "cpu200", "gpuspec25"]
LABEL = {
    "random": "Random-fit",
    "best-fit": "Best-fit",
    "fgd": "FGD (gpud)",
    "fgd-balanced": "fgd-balanced (gpud default)",
    "fgd-classic": "FGD, paper's measure only",
    "fgd-stranded": "paper's measure + stranded",
    "fgd-pressure": "paper's measure + model pressure",
    "balanced": "balanced",
    "spread": "spread",
}


def _register_ablation() -> None:
    """The ablation's variants as policies of their own (in every process that replays)."""
    for name, (stranded, pressure) in ABLATION.items():
        if name not in FACTORIES:
            FACTORIES[name] = partial(_variant, stranded, pressure)


def _variant(stranded: float, pressure: float, seed: int | None, mix: TaskMix | None) -> Policy:
    return FragmentationGradientDescent(mix, shortfall_weight=stranded, pressure_weight=pressure)


_register_ablation()


def trace_files(folder: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(folder.glob("openb_pod_list_*.csv")):
        out[path.stem.removeprefix("openb_pod_list_")] = path
    if "default" in out:  # default first
        out = {"default": out.pop("default"), **out}
    return out


def _static(job: tuple[str, str, str, int]) -> tuple[str, str, StaticResult]:
    trace, path, policy, seed = job
    nodes = load_nodes(Path(path).with_name(NODE_FILE))
    # The figure at 100% arrived needs the samples up to 100.5% only: the other traces stop at 101%
    # (the same tasks in the same order up to there), the default trace goes on to 130% for its curves.
    inflate = INFLATE if trace == "default" else EVERY_TRACE_INFLATE
    return trace, policy, replay_static(nodes, load_tasks(path), policy, seed, inflate=inflate)


def _dynamic(job: tuple[str, str, str, float]) -> tuple[str, str, dict[str, Any]]:
    trace, path, policy, max_wait = job
    nodes = load_nodes(Path(path).with_name(NODE_FILE))
    return trace, policy, compare_dynamic(nodes, load_tasks(path), policy, "best-fit", max_wait=max_wait)


def names_models(path: Path) -> bool:
    """Whether some task of the trace names allowed GPU models (``gpu_spec``)."""
    return any(t.models for t in load_tasks(path))


def has_times(path: Path) -> bool:
    with open(path) as f:
        return "creation_time" in f.readline()


# --------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    """matplotlib.pyplot drawing to files only (Agg), imported when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)


def plot_default(static: dict[str, dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for policy in DEFAULT_POLICIES:
        s = static.get(policy)
        if not s:
            continue
        xs = [a for a, _ in s["curve"]]
        ys = [u for _, u in s["curve"]]
        for ax in (full, zoom):
            ax.plot(xs, ys, label=f"{LABEL[policy]} ({s['unallocated_at_100']:.2f}%)", linewidth=1.4)
    for name, value in PUBLISHED.items():
        zoom.plot([100], [value], marker="x", color="black", linestyle="none")
        zoom.annotate(f"paper {LABEL[name].split(' ')[0]}", (100, value), textcoords="offset points", xytext=(4, 2), fontsize=7)
    for ax in (full, zoom):
        ax.axvline(100, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("arrived GPU requests (% of the cluster's GPUs)")
        ax.grid(alpha=0.3)
    full.set_ylabel("unallocated GPUs (% of the cluster)")
    full.set_title("default trace, mean of seeds")
    zoom.set_xlim(85, 130)
    zoom.set_ylim(0, 22)
    zoom.set_title("near and past 100% arrived (x: published figures)")
    zoom.legend(fontsize=7, loc="upper right")
    _save(fig, path)


def plot_traces(every: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    plt = _pyplot()
    traces = list(every)
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    width = 0.8 / len(EVERY_TRACE_POLICIES)
    for i, policy in enumerate(EVERY_TRACE_POLICIES):
        xs = [t + (i - (len(EVERY_TRACE_POLICIES) - 1) / 2) * width for t in range(len(traces))]
        ys = [every[t].get(policy, {}).get("unallocated_at_100") or 0.0 for t in traces]
        err = [every[t].get(policy, {}).get("unallocated_at_100_std", 0.0) for t in traces]
        ax.bar(xs, ys, width, yerr=err, label=LABEL[policy], capsize=2)
    pubs = [(t, PUBLISHED_FGD[name]) for t, name in enumerate(traces) if name in PUBLISHED_FGD]
    ax.plot([t + width for t, _ in pubs], [v for _, v in pubs], "k_", markersize=12, label="published FGD")
    ax.set_xticks(range(len(traces)), traces, rotation=20)
    ax.set_ylabel("unallocated GPUs at 100% arrived (%)")
    ax.set_title("every trace: mean ± std over seeds (lower is better)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_curves(every: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """One panel per trace: unallocated GPUs against arrived requests, each policy's mean curve."""
    plt = _pyplot()
    traces = list(every)
    cols = 4
    rows = -(-len(traces) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.6 * rows), dpi=100, sharex=True, squeeze=False)
    for ax, trace in zip(axes.flat, traces, strict=False):
        for policy in EVERY_TRACE_POLICIES:
            s = every[trace].get(policy)
            if not s:
                continue
            pts = [(a, u) for a, u in s["curve"] if 50 <= a <= 101]
            color = f"C{EVERY_TRACE_POLICIES.index(policy)}"  # the same colour in every panel
            ax.plot([a for a, _ in pts], [u for _, u in pts], label=LABEL[policy], linewidth=1.2, color=color)
        if trace in PUBLISHED_FGD:
            ax.plot([100], [PUBLISHED_FGD[trace]], marker="x", color="black", linestyle="none", label="published FGD")
        ax.set_title(trace, fontsize=9)
        ax.set_ylim(0, 25)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(traces):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.supxlabel("arrived GPU requests (% of the cluster's GPUs)")
    fig.supylabel("unallocated GPUs (% of the cluster)")
    _save(fig, path)


def plot_dynamic(dynamic: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    plt = _pyplot()
    traces = list(dynamic)
    series: list[tuple[str, list[float]]] = []
    for policy in SHARING_POLICIES:
        series.append((f"sharing, {policy}", [float(dynamic[t][policy]["rows"][0]["gpus_needed"] or 0) for t in traces]))
    first = SHARING_POLICIES[0]
    series.append(("passthrough, best-fit", [float(dynamic[t][first]["rows"][1]["gpus_needed"] or 0) for t in traces]))
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        xs = [t + (i - (len(series) - 1) / 2) * width for t in range(len(traces))]
        ax.bar(xs, ys, width, label=label)
    peaks = [dynamic[t][first]["peak_gpus"] for t in traces]
    ax.plot(range(len(traces)), [p["sharing"] for p in peaks], "k_", markersize=18, label="busiest moment, shared")
    ax.plot(range(len(traces)), [p["passthrough"] for p in peaks], "r_", markersize=18, label="busiest moment, whole GPUs")
    ax.set_xticks(range(len(traces)), traces, rotation=20)
    ax.set_yscale("log")
    ax.set_yticks([25, 50, 100, 200, 400, 800], ["25", "50", "100", "200", "400", "800"])
    ax.set_ylabel("GPUs (log scale)")
    ax.set_title("GPUs needed so that no task waits more than the limit (lower is better)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


# --------------------------------------------------------------------------- the report


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _seed_text(seeds: list[int]) -> str:
    if not seeds:
        return ""
    if len(seeds) == 1:
        return str(seeds[0])
    return f"{seeds[0]}..{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def _shown(path: str) -> str:
    """A path as the reader types it: relative to the repository where it can be."""
    try:
        return str(Path("..") / Path(path).resolve().relative_to(REPO.parent))
    except ValueError:
        return path


def _cell(row: dict[str, Any], policy: str) -> str:
    s = row.get(policy)
    if not s:
        return "-"
    n = len(s.get("per_seed") or s.get("seeds") or [])
    if n == 1:
        return f"{fmt(s['unallocated_at_100'])} (1 seed)"
    return f"{fmt(s['unallocated_at_100'])} ± {fmt(s['unallocated_at_100_std'])}"


def report(data: dict[str, Any]) -> str:
    seeds = data["seeds"]
    seed_text = _seed_text(seeds)
    static = data["static_default"]
    kept = set(data.get("kept", []))
    lines = [
        "## Scheduling quality",
        "",
        f"The Alibaba GPU-sharing trace `cluster-trace-gpu-v2023` ({data['nodes']:,} GPU nodes, {data['gpus']:,} GPUs) replayed",
        "through gpud's own scheduling objects: the broker's `WorkerRegistry` with one simulated worker",
        "per node, its placement policies (`broker/gpud_broker/policies.py`) and its grant ledger",
        "(`ledger.grant`), the code the daemon runs, driven by the trace simulator `bench/tracesim.py`.",
        "The trace and the method are those of Weng et al., \"Beware of Fragmentation: Scheduling",
        "GPU-Sharing Workloads with Fragmentation Gradient Descent\", USENIX ATC '23.",
        "",
        "### Static replay: the published method",
        "",
        "Tasks in a seeded random order, redrawn until 130% of the GPUs were requested, each placed or",
        "rejected at once, never finishing; the figure is the unallocated GPU share when the requests reach",
        f"100% of capacity. `default` trace, mean ± sample standard deviation over seeds {seed_text} (or the first",
        "of them, as the seeds column says):",
        "",
        f"| policy | unallocated at 100% arrived | seeds | published | seconds per seed ({data['jobs']} at a time) |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy in DEFAULT_POLICIES:
        s = static.get(policy)
        if not s:
            continue
        pub = PUBLISHED.get(policy)
        mark = " *" if f"default/{policy}" in kept else ""
        lines.append(
            f"| {LABEL[policy]} (`{policy}`) | {fmt(s['unallocated_at_100'])} ± {fmt(s['unallocated_at_100_std'])} %{mark} "
            f"| {len(s['per_seed'])} | {fmt(pub) + ' %' if pub is not None else ''} | {s['seconds_per_seed']:.1f} |"
        )
    rnd, bf, fgd = (static.get(p, {}).get("unallocated_at_100") for p in ("random", "best-fit", "fgd"))
    lines += [
        "",
        f"(Published, for the policies gpud does not have: {PUBLISHED_OTHERS} %.)",
        "",
    ]
    if rnd is not None and bf is not None:
        gap = max(abs(rnd - PUBLISHED["random"]), abs(bf - PUBLISHED["best-fit"]))
        verdict = "faithful" if gap <= 0.5 else "NOT faithful"
        lines.append(
            f"The replay is {verdict}: Random-fit and Best-fit land {rnd - PUBLISHED['random']:+.2f} and "
            f"{bf - PUBLISHED['best-fit']:+.2f} points from the published figures (the bar is 0.5)."
        )
    if fgd is not None:
        lines.append(
            f"gpud's `fgd` leaves {fgd:.2f} % unallocated against the published FGD's {PUBLISHED['fgd']:.2f} % "
            f"({fgd - PUBLISHED['fgd']:+.2f} points)."
        )
    fb = static.get("fgd-balanced", {}).get("unallocated_at_100")
    if fb is not None and fgd is not None:
        lines.append(
            f"The default policy, `fgd-balanced`, leaves {fb:.2f} % ({fb - fgd:+.2f} points from `fgd`; "
            f"`balanced`, the default before it, {fmt(static.get('balanced', {}).get('unallocated_at_100'))} %)."
        )
    if kept:
        lines += ["", "\\* measured by an earlier run of this benchmark (`--keep`: the policy's code did not change since)."]
    lines += [
        "",
        "![unallocated GPUs against arrived requests, default trace](bench/results/replay_default.png)",
        "",
        f"Every trace of the folder, the same seeds ({seed_text}, or the first of them as the column says), one configuration for all; published",
        "figures from `../shared/traces/README.md` (mean of 10 seeds):",
        "",
        "| trace | tasks | Random-fit | Best-fit | published Best-fit | FGD (gpud) | seeds of FGD | published FGD | gpud - published |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    every = data["static_every"]
    for trace, row in every.items():
        f = row.get("fgd", {}).get("unallocated_at_100")
        pub = PUBLISHED_FGD.get(trace)
        diff = f"{f - pub:+.2f}" if f is not None and pub is not None else "-"
        pbf = PUBLISHED_BEST_FIT.get(trace)
        marks = ["*" if f"{trace}/{p}" in kept else "" for p in EVERY_TRACE_POLICIES]
        lines.append(
            f"| `{trace}` | {row['tasks']} | {_cell(row, 'random')}{marks[0]} | {_cell(row, 'best-fit')}{marks[1]} "
            f"| {fmt(pbf)} | {_cell(row, 'fgd')}{marks[2]} | {len(row.get('fgd', {}).get('per_seed', {}))} | {fmt(pub)} | {diff} |"
        )
    def figure(trace: str, policy: str) -> float | None:
        got = every[trace].get(policy)
        return None if not got else got["unallocated_at_100"]

    gaps = [(abs(f - PUBLISHED_BEST_FIT[t]), t) for t in every
            if t in PUBLISHED_BEST_FIT and (f := figure(t, "best-fit")) is not None]
    worst = max(gaps) if gaps else (math.nan, "-")
    wins = [t for t in every if t in PUBLISHED_FGD and (f := figure(t, "fgd")) is not None and f < PUBLISHED_FGD[t]]
    lines += [
        "",
        f"`fgd` is below the published FGD figure on {len(wins)} of the {sum(1 for t in every if figure(t, 'fgd') is not None)} "
        f"traces measured here. Best-fit lands within {worst[0]:.2f} points of its published figure on each of the "
        f"{len(gaps)} traces it was measured on (the largest gap: `{worst[1]}`).",
        "The traces other than `default` are replayed up to 101% arrived only (the figure at 100% needs",
        "the samples up to 100.5%, and the tasks up to there are the same in the same order).",
        "",
        "![unallocated GPUs at 100% arrived on every trace](bench/results/replay_traces.png)",
        "",
        "![unallocated GPUs against arrived requests on every trace](bench/results/replay_curves.png)",
        "",
        "### What `fgd` counts, and why it beats the published FGD",
        "",
        "A placement is judged by how much it adds to the expected waste of GPU share on the worker, against",
        "the mix of requests the broker has actually seen (`broker/gpud_broker/mix.py`: exponentially",
        "decayed counts over request shapes, fed every arriving request; not a fixed table). Three terms,",
        "all in milli-GPU, each weighted 1 (no weight was fitted to a trace):",
        "",
        "- **fragment** (the paper's measure): the free GPU share each request class could not use on the",
        "  worker (all of it when the class cannot run there: model, CPU, too few GPUs with its share), weighted",
        "  by the class's probability;",
        "- **stranded** (CPU and memory left for the GPU share): for each GPU class, filling the worker's free",
        "  share with that class's tasks needs its CPU per milli-GPU times the free share; the part the free",
        "  CPU cannot feed is stranded for that class; expected over the classes by their share of the GPU",
        "  demand (and the same for host memory at the mix's mean ratio). The paper sees CPU only through the",
        "  next request; CPU-only work and CPU-hungry tasks so went where they strand GPUs for the rest;",
        "- **model pressure** (model compatibility of the expected mix with each worker's GPUs): each class",
        "  that names GPU models spreads its share of the GPU demand over the free share of those models, so",
        "  each model gets `sum(demand / free share of the class's models)`; a free milli-GPU of a model",
        "  counts minus that much. A task that may run anywhere is thus steered away from the models the",
        "  model-restricted tasks can only use, in proportion to how short those models are; the paper's",
        "  measure sees a model only through the classes that cannot use it, not through how scarce it is",
        "  for those that can. The free share by model is counted every 256 placements and kept up in",
        "  between by the policy's own placements.",
        "",
        f"Ablation (mean ± std over seeds {_seed_text(data.get('ablation_seeds', [])) or '-'}; `fgd` is both terms):",
        "",
        "| trace | paper's measure only (`fgd-classic`) | + stranded | + model pressure | both (`fgd`) | published FGD |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for trace, row in data.get("ablation", {}).items():
        cells = [_cell(row, v) + (" (=)" if row.get(v, {}).get("same_as") else "") + (" *" if row.get(v, {}).get("kept") else "")
                 for v in ("fgd-classic", "fgd-stranded", "fgd-pressure", "fgd")]
        lines.append(f"| `{trace}` | " + " | ".join(cells) + f" | {fmt(PUBLISHED_FGD.get(trace))} |")
    lines += [
        "",
        "(=): no task of the trace names a model, so the pressure is zero and the cell equals its",
        "neighbour by construction (`+ model pressure` is the paper's measure, `+ stranded` is `fgd`).",
        "\\*: the paper's measure alone over seeds 42..51 by the earlier run of this benchmark (the same",
        "measure: `fgd` without the terms of gpud's own).",
        "",
        "How the configuration was chosen: both weights are 1, the natural unit (every term is milli-GPU of",
        "expected waste). On seed 42 only, stranded weights 2 and 3 were tried on `multigpu40`, `gpushare80`,",
        "`cpu200` and `gpuspec25` and changed no figure by more than 0.08 points; seeds 43..51 were never",
        "used to choose anything. Held-out check on traces not in the folder, built from it the way the",
        "family is built (see the report of this change): a `cpu250`-like trace (a quarter of the tasks",
        "CPU-only) and a `gpuspec33`-like trace (a third of the GPU tasks naming models).",
        "",
    ]
    lines += [
        "### Dynamic replay: sharing against exclusive passthrough",
        "",
        "The tasks at their own creation and deletion times (simulated time; a task runs `deletion -",
        "scheduled` seconds, or `deletion - creation` if it never ran), waiting in the broker's",
        "`PendingQueue` when nothing fits. The cluster grows node by node with the node kinds of the trace in",
        "proportion; reported is the smallest cluster on which no task waits more than "
        f"{data['max_wait_s']:g} s, for gpud's GPU sharing and for exclusive passthrough (every GPU task takes",
        "whole GPUs, a GPU VM of its own), the mean GPU allocation over the trace on it (granted, and asked",
        "for by the running tasks), and the waits. The `multigpu` traces carry no times.",
        "",
        "| trace | busiest moment, shared / whole GPUs | sharing: GPUs needed (balanced / best-fit / fgd) | passthrough: GPUs needed | allocation, sharing best-fit | allocation, passthrough (asked) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for trace, row in data["dynamic"].items():
        peak = row[SHARING_POLICIES[0]]["peak_gpus"]
        needs = " / ".join(str(row[p]["rows"][0]["gpus_needed"] or "-") for p in SHARING_POLICIES)
        bfrow = row["best-fit"]["rows"][0]
        pt = row["best-fit"]["rows"][1]
        lines.append(
            f"| `{trace}` | {peak['sharing']:.1f} / {peak['passthrough']:.0f} | {needs} | {pt['gpus_needed'] or '-'} "
            f"| {fmt(bfrow['mean_allocation'])} % | {fmt(pt['mean_allocation'])} % ({fmt(pt['mean_requested'])} %) |"
        )
    lines += [
        "",
        "On the smaller of the two clusters (sharing with best-fit against passthrough), with no wait limit:",
        "",
        "| trace | GPUs | mode | tasks that waited | wait p50 / p90 / p99 / max (s) |",
        "|---|---:|---|---:|---|",
    ]
    for trace, row in data["dynamic"].items():
        same = row["best-fit"]["same_cluster"]
        for r in same.get("rows", []):
            w = r["wait_s"]
            lines.append(
                f"| `{trace}` | {same['gpus']} | {r['mode']} | {r['waited']} | "
                f"{w['p50']:.0f} / {w['p90']:.0f} / {w['p99']:.0f} / {w['max']:.0f} |"
            )
    lines += [
        "",
        "![GPUs needed, sharing against passthrough](bench/results/replay_dynamic.png)",
        "",
        "Reading it: at its own times the trace is light (a few dozen GPUs busy at the busiest moment), so",
        "the size needed is set as much by the node kinds that rare large or model-restricted tasks need",
        "as by the load. With best-fit, sharing needs fewer GPUs than passthrough on every trace without",
        "model constraints, most on `gpushare80`, and on the same cluster passthrough makes tasks wait",
        "where sharing does not. In the `gpuspec` traces tasks restricted to P100 nodes (two GPUs, 16",
        "cores) wait for those nodes' CPU, and the size needed swings by hundreds of GPUs from one policy to",
        "the next: those rows measure the cost of the model constraints, not of sharing. `balanced` (it",
        "spreads work over idle nodes) and, on most traces, `fgd` (built for a full cluster) do not keep",
        "free the one node kind a rare large task needs, and need more GPUs than best-fit here: for a",
        "lightly loaded cluster with rare whole-node tasks, `best-fit` is the policy to configure.",
        "",
        "Commands (each prints a table and, with `--json`, ends with one JSON line):",
        "",
        "```",
        f"TRACES={_shown(data['traces_dir'])}",
        f".venv/bin/python bench/tracesim.py $TRACES/openb_pod_list_default.csv --policy fgd --seeds {seed_text} --jobs 2",
        ".venv/bin/python bench/tracesim.py $TRACES/openb_pod_list_default.csv --policy best-fit --seed 42 --json",
        f".venv/bin/python bench/tracesim.py $TRACES/openb_pod_list_default.csv --mode dynamic --policy best-fit --max-wait {data['max_wait_s']:g}",
        f".venv/bin/python bench/replay.py --traces $TRACES --seeds {seed_text} --jobs {data['jobs']}"
        + (" --static-only" if data.get("dynamic_from_previous") else "")
        + (" --keep random,best-fit,balanced,spread" if data.get("kept") else ""),
        "```",
        "",
        f"Measured on {data['host']} ({data['jobs']} processes); the whole benchmark took {data['seconds'] / 60:.0f} minutes.",
        "",
    ]
    if data.get("dynamic_from_previous"):
        at = lines.index("### Dynamic replay: sharing against exclusive passthrough") + 2
        lines[at:at] = [
            "Not re-measured by the last run (`--static-only`): these figures are those of the run before,",
            "with the `fgd` of that time (the paper's measure and the mean-ratio CPU shortfall, before the",
            "stranded and model-pressure terms) and without `fgd-balanced`.",
            "",
        ]
    return "\n".join(lines)


def write_outputs(data: dict[str, Any], out: Path) -> None:
    plot_default(data["static_default"], out / "replay_default.png")
    plot_traces(data["static_every"], out / "replay_traces.png")
    plot_curves(data["static_every"], out / "replay_curves.png")
    if data["dynamic"]:
        plot_dynamic(data["dynamic"], out / "replay_dynamic.png")
    (out / "replay.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "replay.md").write_text(report(data))


# --------------------------------------------------------------------------- main


def _kept(previous: dict[str, Any], trace: str, policy: str) -> dict[str, Any] | None:
    """The figures of (trace, policy) in the previous replay.json, if it has them."""
    if trace == "default" and policy in previous.get("static_default", {}):
        return dict(previous["static_default"][policy])
    got = previous.get("static_every", {}).get(trace, {}).get(policy)
    return dict(got) if got else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="folder of the trace CSVs (default %(default)s)")
    p.add_argument("--seeds", default="42..51", help="seeds of the static replay (default %(default)s)")
    p.add_argument("--ablation-seeds", default="42", help="seeds of the ablation (default %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="processes (default %(default)s)")
    p.add_argument("--max-wait", type=float, default=60.0, help="dynamic: longest wait allowed, seconds (default %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where results go (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="two seeds only (42, 43)")
    p.add_argument("--report-only", action="store_true", help="rewrite replay.md and the plots from replay.json")
    p.add_argument("--keep", default="",
                   help="policies whose static figures are taken from the last replay.json in --out where it has "
                        "them (their code did not change), e.g. random,best-fit,balanced,spread")
    p.add_argument("--static-only", action="store_true",
                   help="run the static part only; the dynamic figures come from the last replay.json in --out")
    p.add_argument("--runs", type=Path, default=None,
                   help="a file that keeps every finished static run (one JSON line each): runs already in "
                        "it are not run again, so an interrupted benchmark goes on where it stopped")
    p.add_argument("--only-runs", action="store_true",
                   help="with --runs: run nothing, report the runs the file has (each row over the seeds it has)")
    p.add_argument("--dynamic-only", action="store_true",
                   help="run the dynamic part only; the static figures come from the last replay.json in --out")
    args = p.parse_args(argv)
    seeds = [42, 43] if args.quick else parse_seeds(args.seeds)
    ablation_seeds = [s for s in parse_seeds(args.ablation_seeds) if s in seeds] or seeds[:1]
    traces = trace_files(args.traces)
    if "default" not in traces or not (args.traces / NODE_FILE).is_file():
        print(f"bench/replay.py: no trace in {args.traces}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    previous_path = args.out / "replay.json"
    previous: dict[str, Any] = json.loads(previous_path.read_text()) if previous_path.is_file() else {}
    if args.report_only:
        write_outputs(previous, args.out)
        return 0
    keep = {k for k in args.keep.split(",") if k}
    started = time.perf_counter()

    jobs: list[tuple[str, str, str, int]] = []
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    if not args.dynamic_only:
        for trace, path in traces.items():
            for policy in DEFAULT_POLICIES if trace == "default" else EVERY_TRACE_POLICIES:
                old = _kept(previous, trace, policy) if policy in keep else None
                if old is not None and sorted(int(k) for k in old["per_seed"]) == seeds:
                    kept[(trace, policy)] = old
                    continue
                jobs += [(trace, str(path), policy, s) for s in seeds]
            if trace in ABLATION_TRACES:
                variants = ABLATION if names_models(path) else ["fgd-classic"]  # the others are fgd or classic there
                for variant in variants:
                    jobs += [(trace, str(path), variant, s) for s in ablation_seeds]
    # Seed by seed (an interrupted run has the first seeds of every trace), the default trace's
    # policies and the ablation within the first seeds.
    first = {"fgd-balanced": 0, "fgd": 1}
    jobs.sort(key=lambda j: (j[3] if j[2] in first else seeds[len(seeds) // 2], first.get(j[2], 2)))
    run_dynamic = not args.static_only
    dyn_jobs = [(t, str(path), pol, args.max_wait) for t, path in traces.items() if has_times(path)
                for pol in SHARING_POLICIES] if run_dynamic else []

    results: dict[tuple[str, str], list[StaticResult]] = {}
    if args.runs is not None and args.runs.is_file():
        done: set[tuple[str, str, int]] = set()
        for line in args.runs.read_text().splitlines():
            r = json.loads(line)
            res = StaticResult(**{**r["result"], "curve": [tuple(c) for c in r["result"]["curve"]]})
            if (r["trace"], res.policy, res.seed) not in done:  # a run recorded twice counts once
                done.add((r["trace"], res.policy, res.seed))
                results.setdefault((r["trace"], res.policy), []).append(res)
        jobs = [] if args.only_runs else [j for j in jobs if (j[0], j[2], j[3]) not in done]
    dynamic: dict[str, dict[str, dict[str, Any]]] = {}
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for trace, policy, res in pool.imap_unordered(_static, jobs):
            results.setdefault((trace, policy), []).append(res)
            print(f"  {trace:<12} {policy:<12} seed {res.seed}: {res.unallocated_at_100:6.2f}%  ({res.seconds:.1f}s)", flush=True)
            if args.runs is not None:
                with open(args.runs, "a") as f:
                    f.write(json.dumps({"trace": trace, "result": dataclasses.asdict(res)}) + "\n")
        static_s = time.perf_counter() - started
        dyn_started = time.perf_counter()
        for trace, policy, comp in pool.imap_unordered(_dynamic, dyn_jobs):
            dynamic.setdefault(trace, {})[policy] = comp
            print(f"  dynamic {trace:<12} sharing {policy:<9}: {comp['rows'][0]['gpus_needed']} GPUs; "
                  f"passthrough {comp['rows'][1]['gpus_needed']} GPUs", flush=True)

    def summary_of(trace: str, policy: str) -> dict[str, Any] | None:
        rs = sorted(results.get((trace, policy), []), key=lambda r: r.seed)
        if rs:
            s = summarize_static(rs)
            return {k: s[k] for k in ("unallocated_at_100", "unallocated_at_100_std", "per_seed", "seconds_per_seed", "curve")}
        return kept.get((trace, policy))

    if args.dynamic_only:
        static_default = previous.get("static_default", {})
        static_every = previous.get("static_every", {})
        ablation = previous.get("ablation", {})
    else:
        static_default = {}
        for policy in DEFAULT_POLICIES:
            got = summary_of("default", policy)
            if got:
                static_default[policy] = got
        static_every = {}
        for trace, path in traces.items():
            row: dict[str, Any] = {"tasks": len(load_tasks(path))}
            for policy in EVERY_TRACE_POLICIES:
                got = summary_of(trace, policy)
                if got:
                    row[policy] = got
            static_every[trace] = row
        ablation = {}
        for trace in ABLATION_TRACES:
            if trace not in traces:
                continue
            row = {}
            # Where no task names a model the pressure is zero: "+ pressure" is the paper's measure
            # and "both" is "+ stranded", by construction (so they are not run twice).
            same = {"fgd-pressure": "fgd-classic", "fgd-stranded": "fgd"} if not names_models(traces[trace]) else {}
            for variant in [*ABLATION, "fgd"]:
                rs = [r for r in results.get((trace, same.get(variant, variant)), []) if r.seed in ablation_seeds]
                if rs:
                    s = summarize_static(sorted(rs, key=lambda r: r.seed))
                    row[variant] = {"unallocated_at_100": s["unallocated_at_100"], "unallocated_at_100_std": s["unallocated_at_100_std"],
                                    "seeds": [r.seed for r in rs], "same_as": same.get(variant)}
            for variant in ("fgd-classic", "fgd-pressure"):  # the paper's measure by an earlier run
                old = _kept(previous, trace, "fgd-classic")
                if variant not in row and old is not None and (variant == "fgd-classic" or same):
                    row[variant] = {**{k: old[k] for k in ("unallocated_at_100", "unallocated_at_100_std", "per_seed")},
                                    "kept": True, "same_as": same.get(variant)}
            ablation[trace] = row
    if not run_dynamic:
        dynamic = previous.get("dynamic", {})
    dynamic = {t: dynamic[t] for t in traces if t in dynamic}
    data: dict[str, Any] = {
        "seeds": seeds,
        "ablation_seeds": ablation_seeds,
        "nodes": sum(1 for n in load_nodes(args.traces / NODE_FILE) if n.gpus > 0),
        "gpus": sum(n.gpus for n in load_nodes(args.traces / NODE_FILE)),
        "traces_dir": str(args.traces),
        "max_wait_s": args.max_wait,
        "static_default": static_default,
        "static_every": static_every,
        "ablation": ablation,
        "kept": sorted(f"{t}/{p}" for t, p in kept),
        "dynamic": dynamic,
        "dynamic_from_previous": not run_dynamic,
        "jobs": args.jobs,
        "host": f"{platform.machine()} Linux, Python {platform.python_version()}",
    }
    data["seconds_static"] = static_s if jobs else float(previous.get("seconds_static", 0.0))
    data["seconds_dynamic"] = time.perf_counter() - dyn_started if run_dynamic else float(previous.get("seconds_dynamic", 0.0))
    data["seconds"] = data["seconds_static"] + data["seconds_dynamic"]
    write_outputs(data, args.out)

    print()
    print("default trace, unallocated GPU % at 100% arrived (mean ± std over seeds):")
    for policy, s in static_default.items():
        pub = PUBLISHED.get(policy)
        print(f"  {LABEL[policy]:<28} {fmt(s['unallocated_at_100'])} ± {fmt(s['unallocated_at_100_std'])}"
              + (f"   (published {pub:.2f})" if pub is not None else "") + f"   {s['seconds_per_seed']:.1f} s/seed")
    print("every trace:")
    for trace, row in static_every.items():
        print(f"  {trace:<12} " + "  ".join(f"{p} {fmt(row[p]['unallocated_at_100'])}±{fmt(row[p]['unallocated_at_100_std'])}"
                                              for p in EVERY_TRACE_POLICIES if p in row))
    summary = {
        "seeds": seeds,
        "default": {p: {"mean": s["unallocated_at_100"], "std": s["unallocated_at_100_std"], "s_per_seed": s["seconds_per_seed"]}
                    for p, s in static_default.items()},
        "every_trace_fgd": {t: row["fgd"]["unallocated_at_100"] for t, row in static_every.items() if "fgd" in row},
        "seconds": round(data["seconds"], 1),
        "out": str(args.out),
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
