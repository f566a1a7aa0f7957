"""Figures of results folders (`results/<experiment>/`): Pareto front, convergence, memory timeline, action map.

Each function returns a matplotlib Figure, made without pyplot (nothing is shown or left open); `pareto`
and `action_map` can also draw into an existing `ax=`. `plot_results(folder)` writes all four as PNGs
beside the results. No torch at import: the memory timeline and the action map re-capture the
experiment's graph (on the meta device) and re-simulate the policy, importing torch then; measured costs
come from the on-disk cost cache (`cache_dir`, as for the search).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from gaswap import policy as policies
from gaswap.config import format_size
from gaswap.encoding import Action
from gaswap.graph import Graph
from gaswap.program import Verb
from gaswap.problem import Problem
from gaswap.simulator import CATEGORIES, SimResult

MIB, GIB = 2**20, 2**30
_DEEP = sns.color_palette("deep")
SERIES_COLORS = [c for k, c in enumerate(_DEEP) if k != 3]  # red is the budget's
BASELINE_MARKERS = "sD^vPX"
ACTION_COLORS = {"keep": _DEEP[0], "swap": _DEEP[1], "recompute": _DEEP[2]}
# Resident memory in muted colours at the bottom of the stack; what a policy changes in the action colours.
CATEGORY_COLORS = dict(zip(CATEGORIES, (_DEEP[7], _DEEP[5], _DEEP[8], _DEEP[4], _DEEP[0], _DEEP[1], _DEEP[2])))
# Timeline rows beneath the memory: (stream, event kind, legend label, colour, row).
STREAM_BARS = (
    ("d2h", "swap_out", "swap out (d2h copy)", _DEEP[9], 2),
    ("h2d", "swap_in", "swap in (h2d copy)", _DEEP[1], 1),
    ("compute", "recompute", "recompute", _DEEP[2], 0),
    ("compute", "wait", "compute waits for a copy", _DEEP[3], 0),
)
BUDGET_STYLE = {"color": _DEEP[3], "linestyle": "--", "linewidth": 1.5}
BACKWARD_STYLE = {"color": "black", "linestyle": ":", "linewidth": 1.2}
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": "small"}


@dataclass(frozen=True)
class Result:
    """One results folder, read: summary.json, front.csv, history.csv and bench.csv (None when absent)."""

    folder: Path
    summary: dict
    front: pd.DataFrame
    history: pd.DataFrame
    bench: pd.DataFrame | None

    @property
    def name(self) -> str:
        return self.summary["experiment"]

    @property
    def budget_bytes(self) -> int:
        return self.summary["budget_bytes"]

    def overhead_pct(self, step_time_s):
        """Step time relative to keep-all, in percent (10 = 10 % slower)."""
        return 100.0 * (step_time_s / self.summary["keep_all"]["step_time_s"] - 1.0)

    def unit(self) -> tuple[int, str]:
        """Bytes per unit and its name for this experiment's memory axes: GiB, or MiB for small models."""
        return (GIB, "GiB") if self.summary["keep_all"]["peak_bytes"] >= GIB else (MIB, "MiB")


def load(folder: str | Path) -> Result:
    """Read a results folder written by `gaswap search`."""
    folder = Path(folder)
    bench = folder / "bench.csv"
    return Result(
        folder,
        json.loads((folder / "summary.json").read_text()),
        pd.read_csv(folder / "front.csv"),
        pd.read_csv(folder / "history.csv"),
        pd.read_csv(bench) if bench.is_file() else None,
    )


def _results(folders) -> list[Result]:
    """One folder or several, read; several must hold searches of the same graph."""
    results = [load(f) for f in ([folders] if isinstance(folders, (str, Path)) else folders)]
    if len({r.summary["graph"]["fingerprint"] for r in results}) > 1:
        raise ValueError(f"{', '.join(str(r.folder) for r in results)}: searches of different graphs cannot "
                         f"share one figure")
    return results


def _names(results: list[Result]) -> str:
    """The experiments' names, each once."""
    return ", ".join(dict.fromkeys(r.name for r in results))


def _labels(results: list[Result]) -> list[str]:
    """Each result's search space, or its folder name where two share a search space."""
    spaces = [r.summary["search_space"] for r in results]
    return [s if spaces.count(s) == 1 else r.folder.name for s, r in zip(spaces, results)]


def _styled(draw):
    """Draw under seaborn's whitegrid style without changing the global matplotlib settings."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with sns.axes_style("whitegrid"):
            return draw(*args, **kwargs)

    return wrapper


def _axes(ax, figsize):
    """`ax` and its figure, or a new figure with one axes."""
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots()


def _pct(value: float) -> str:
    """A percentage with its sign, "+0.0 %" rather than "-0.0 %" for rounding noise."""
    return f"{round(value, 1) + 0.0:+.1f} %"


def _budget_label(result: Result) -> str:
    """The budget in the experiment's words and in the axis unit."""
    div, unit = result.unit()
    return f"budget {format_size(result.budget_bytes)} = {result.budget_bytes / div:.2f} {unit}"


# ------------------------------------------------------------------------------------------- Pareto front


@_styled
def pareto(folders, ax=None) -> Figure:
    """Step-time overhead against peak memory: the GA front of each folder (one hue per search space), the
    first folder's baselines (bench.csv, else the search's seed policies) and keep-all, each folder's
    chosen policy, and the budgets."""
    results = _results(folders)
    first = results[0]
    div, unit = first.unit()
    fig, ax = _axes(ax, (9, 5))
    for r, label, color in zip(results, _labels(results), SERIES_COLORS):
        front = r.front.sort_values("peak_bytes")
        x, y = front["peak_bytes"] / div, r.overhead_pct(front["step_time_s"])
        ax.step(x, y, where="post", color=color, alpha=0.5)
        n = len(front)
        sns.scatterplot(x=x, y=y, ax=ax, color=color, s=60, zorder=4,
                        label=f"GA front, {label} ({n} {'policy' if n == 1 else 'policies'})")
    _baselines(first, ax, SERIES_COLORS[len(results):])
    keep = first.summary["keep_all"]
    ax.scatter(keep["peak_bytes"] / div, 0.0, marker="*", s=250, color="black", zorder=5,
               label="keep-all (plain PyTorch)")
    for r, label in zip(results, _labels(results)):
        best = r.summary["best"]
        x, y = best["peak_bytes"] / div, r.overhead_pct(best["step_time_s"])
        ax.scatter(x, y, s=260, facecolors="none", edgecolors="black", linewidths=1.5, zorder=5,
                   label=f"chosen, {label}: {x:.2f} {unit}, {_pct(y)}")
    _budgets(ax, results, div)
    ax.set(xlabel=f"peak device memory ({unit})", ylabel="step-time overhead vs keep-all (%)",
           title=f"{_names(results)}: step time against peak memory, budget {format_size(first.budget_bytes)}")
    ax.legend(**LEGEND_OUTSIDE, markerscale=0.7)
    return fig


def _budgets(ax, results: list[Result], div: int) -> None:
    """A line at each distinct budget, and the memory over the smallest one shaded."""
    lo, hi = ax.get_xlim()
    budgets = {r.budget_bytes: r for r in results}
    for budget, r in budgets.items():
        ax.axvline(budget / div, **BUDGET_STYLE, label=_budget_label(r))
    ax.axvspan(min(budgets) / div, max(hi, min(budgets) / div), color=BUDGET_STYLE["color"], alpha=0.07,
               label="over budget")
    ax.set_xlim(lo, hi)


def _baselines(result: Result, ax, colors) -> None:
    """bench.csv's methods, one hue and marker each; without bench.csv, the search's seed policies."""
    if result.bench is not None:
        rows = result.bench
    else:
        seeds = result.summary["seeds"]
        rows = pd.DataFrame([{"method": name.replace("_", "-")} | s for name, s in seeds.items()
                             if name != "keep_all" and s["valid"]])
    div, _ = result.unit()
    for (method, group), color, marker in zip(rows.groupby("method", sort=False), colors, BASELINE_MARKERS):
        sns.scatterplot(x=group["peak_bytes"] / div, y=result.overhead_pct(group["step_time_s"]), ax=ax,
                        color=color, marker=marker, s=60, zorder=3, label=method)


# -------------------------------------------------------------------------------------------- convergence


@_styled
def convergence(folders) -> Figure:
    """Best feasible step time and hypervolume of the front, per generation, for one folder or several.

    Each hypervolume is shown as a percentage of its final value: searches in different search spaces
    measure it from different reference points (twice their slowest seed policy), so only shapes compare."""
    results = _results(folders)
    labels = _labels(results)
    first = results[0]
    fig = Figure(figsize=(9, 6), layout="constrained")
    time_ax, volume_ax = fig.subplots(2, 1, sharex=True)
    for r, label, color in zip(results, labels, SERIES_COLORS):
        h = r.history.replace(float("inf"), float("nan"))
        sns.lineplot(x=h["generation"], y=h["best_time_s"] * 1e3, ax=time_ax, color=color, label=f"GA, {label}",
                     drawstyle="steps-post")
        sns.lineplot(x=h["generation"], y=100 * h["hypervolume"] / h["hypervolume"].max(), ax=volume_ax, color=color,
                     drawstyle="steps-post")
    keep = first.summary["keep_all"]
    over = " (over budget)" if keep["peak_bytes"] > first.budget_bytes else ""
    time_ax.axhline(keep["step_time_s"] * 1e3, color="black", linestyle=":", label=f"keep-all{over}")
    time_ax.set(ylabel="best step time\nunder the budget (ms)")
    volume_ax.set(xlabel="generation", ylabel="hypervolume of the front\n(% of its final value)")
    time_ax.legend(**LEGEND_OUTSIDE)
    fig.align_ylabels()
    stopped = "".join(f"\n({label} stopped after {r.summary['generations_done']} generations)"
                      for r, label in zip(results, labels) if r.summary.get("complete") is False)
    fig.suptitle(f"{_names(results)}: search convergence, budget {format_size(first.budget_bytes)}{stopped}")
    return fig


# ------------------------------------------------------------------------------ re-simulation of a policy


@dataclass(frozen=True)
class Replay:
    """A policy and keep-all re-simulated, traced, on the re-captured graph of a results folder."""

    result: Result
    graph: Graph
    policy: policies.Policy
    policy_name: str
    chosen: SimResult
    keep_all: SimResult


def replay(folder: str | Path, policy: str = "policy.yaml", *, cache_dir=None) -> Replay:
    """Re-capture the experiment of `folder` and simulate `policy` (a file in it) and keep-all, traced."""
    from gaswap import config, workflow  # torch

    result = load(folder)
    prepared = workflow.prepare(config.load_experiment(_experiment_file(result)), cache_dir=cache_dir)
    graph = prepared.graph
    chosen = policies.load(result.folder / policy, graph)
    problem = Problem(graph, prepared.costs, result.budget_bytes)
    order, actions = chosen.order_indices(graph), chosen.action_codes(problem.encoding.candidates)
    return Replay(result, graph, chosen, Path(policy).name, problem.simulator.run(order, actions, trace=True),
                  problem.simulate(problem.encoding.uniform(Action.KEEP), trace=True))


def _experiment_file(result: Result) -> Path:
    """The experiment file summary.json names: as written, or relative to the folder holding `results/`."""
    path = Path(result.summary["experiment_file"])
    if path.is_absolute() or path.exists():
        return path
    return result.folder.resolve().parents[1] / path


# -------------------------------------------------------------------------------------- memory timeline


@_styled
def memory_timeline(folder: str | Path, policy: str = "policy.yaml", *, cache_dir=None) -> Figure:
    """Device memory by category over simulated time for keep-all and `policy`, with the budget and the
    start of the backward pass; beneath, the policy's copies, recomputations and compute waits."""
    rp = replay(folder, policy, cache_dir=cache_dir)
    r = rp.result
    div, unit = r.unit()
    runs = {"keep-all": rp.keep_all, rp.policy_name: rp.chosen}
    levels = {name: _levels(run) / div for name, run in runs.items()}
    shown = [c for c in CATEGORIES if any(lv[c].any() for lv in levels.values())]
    fig = Figure(figsize=(11, 8.5), layout="constrained")
    *memory_axes, streams_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.2]})
    memory_axes[1].sharey(memory_axes[0])
    for ax, (name, run) in zip(memory_axes, runs.items()):
        lv = levels[name]
        overhead = f" ({_pct(r.overhead_pct(run.step_time))} vs keep-all)" if run is rp.chosen else ""
        ax.stackplot(lv.index, *(lv[c] for c in shown), labels=shown, colors=[CATEGORY_COLORS[c] for c in shown],
                     step="post", linewidth=0)
        ax.axhline(r.budget_bytes / div, **BUDGET_STYLE, label=_budget_label(r))
        ax.axvline(_backward_start(run, rp.graph), **BACKWARD_STYLE, label="backward pass starts")
        ax.set(ylabel=f"device memory ({unit})",
               title=f"{name}: peak {run.peak_bytes / div:.2f} {unit}, step {run.step_time * 1e3:.1f} ms{overhead}")
    memory_axes[0].legend(**LEGEND_OUTSIDE)
    _streams(streams_ax, rp.chosen)
    streams_ax.axvline(_backward_start(rp.chosen, rp.graph), **BACKWARD_STYLE)
    streams_ax.set(xlabel="simulated time (ms)", title=f"{rp.policy_name}: copy streams and compute stalls")
    fig.suptitle(f"{r.name}: device memory over one training step, budget {format_size(r.budget_bytes)}")
    return fig


def _levels(run: SimResult) -> pd.DataFrame:
    """Device bytes per category (columns) from each change on (index: time in ms) to the step's end."""
    changes = pd.DataFrame(run.changes, columns=["time", "category", "bytes"])
    levels = (changes.pivot_table(index="time", columns="category", values="bytes", aggfunc="sum")
              .fillna(0).cumsum().reindex(columns=list(CATEGORIES), fill_value=0))
    levels.loc[run.step_time] = levels.iloc[-1]
    levels.index = levels.index * 1e3
    return levels


def _backward_start(run: SimResult, graph: Graph) -> float:
    """When the first backward op starts (ms)."""
    backward = {op.name for op in graph.ops if op.phase == "bwd"}
    return min(e.start for e in run.timeline if e.kind == Verb.RUN and e.name in backward) * 1e3


def _streams(ax, run: SimResult) -> None:
    """The run's copy and recompute events and compute waits as bars, one row per stream."""
    for stream, kind, label, color, row in STREAM_BARS:
        spans = [(e.start * 1e3, (e.end - e.start) * 1e3) for e in run.timeline
                 if (e.stream, e.kind) == (stream, kind)]
        if spans:  # outlines keep microsecond events visible
            ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=color, edgecolors=color, linewidth=0.8,
                           label=label)
    ax.set(yticks=[0, 1, 2], yticklabels=["compute", "h2d copy", "d2h copy"], ylim=(-0.6, 2.6))
    ax.grid(False, axis="y")
    ax.legend(**LEGEND_OUTSIDE)


# ------------------------------------------------------------------------------------------- action map


@_styled
def action_map(folder: str | Path, policy: str = "policy.yaml", ax=None, *, cache_dir=None) -> Figure:
    """Per layer (module path, in captured order; inputs first), the bytes `policy` keeps, swaps and
    recomputes, as stacked horizontal bars."""
    rp = replay(folder, policy, cache_dir=cache_dir)
    table = _bytes_by_layer(rp.graph, rp.policy)
    div, unit = (GIB, "GiB") if table.sum(axis=1).max() >= GIB else (MIB, "MiB")
    fig, ax = _axes(ax, (9, 1.8 + 0.3 * len(table)))
    left = 0
    counts = rp.policy.counts()
    for action, color in ACTION_COLORS.items():
        width = table[action] / div
        ax.barh(table.index, width, left=left, color=color,
                label=f"{action}: {counts[action]} tensors, {width.sum():.2f} {unit}")
        left = left + width
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    ax.set(xlim=(0, 1.05 * left.max()), xlabel=f"saved tensors' size ({unit})", ylabel="layer (module path)",
           title=f"{rp.result.name}: {rp.policy_name} per layer, budget {format_size(rp.result.budget_bytes)}")
    ax.legend(**LEGEND_OUTSIDE)
    return fig


def _bytes_by_layer(graph: Graph, policy: policies.Policy) -> pd.DataFrame:
    """Bytes of the policy's tensors per producing layer (rows, captured order) and action (columns)."""
    index = graph.op_index()
    rows = []
    for name, action in policy.actions.items():
        producer = graph.tensors[name].producer
        layer = (graph.ops[index[producer]].layer or "(top level)") if producer else "input"
        rows.append({"position": index[producer] if producer else -1, "layer": layer, "action": action,
                     "bytes": graph.tensors[name].size})
    table = pd.DataFrame(rows).sort_values("position", kind="stable")
    return (table.pivot_table(index="layer", columns="action", values="bytes", aggfunc="sum", sort=False)
            .reindex(columns=list(ACTION_COLORS), fill_value=0).fillna(0))


# ----------------------------------------------------------------------------------------------- all four


def plot_results(folder: str | Path, *, cache_dir=None) -> list[Path]:
    """Write pareto.png, convergence.png, memory_timeline.png and action_map.png into `folder`."""
    folder = Path(folder)
    figures = {
        "pareto": pareto(folder),
        "convergence": convergence(folder),
        "memory_timeline": memory_timeline(folder, cache_dir=cache_dir),
        "action_map": action_map(folder, cache_dir=cache_dir),
    }
    paths = []
    for name, fig in figures.items():
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=150)
        paths.append(path)
    return paths
