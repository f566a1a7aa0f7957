"""Figures of results folders (`results/<experiment>/`): Pareto front, convergence, memory timeline, action map.

Each function returns a matplotlib Figure, made without pyplot (nothing is shown or left open); `pareto`
and `action_map` can also draw into an existing `ax=`. `plot_results(folder)` writes all four as PNGs
beside the results. No torch at import: the memory timeline and the action map re-capture the
experiment's graph (on the meta device) and re-simulate the policy, importing torch then, with the costs
the search used (`costs.json` in the folder). A folder without that file (written by an older gaswap) gets
its costs again (estimated, or measured through the cost cache `cache_dir`), and the figures say so when
keep-all then differs from the search's.

One style per method in every figure (`METHOD_STYLES`), sizes in the display convention of `gaswap.base.units`.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from gaswap.app.results import check_front
from gaswap.base import units
from gaswap.base.config import format_size
from gaswap.base.files import replacing
from gaswap.base.program import Verb
from gaswap.plan import costfile
from gaswap.plan import policy as policies
from gaswap.plan.encoding import Action
from gaswap.plan.graph import Graph
from gaswap.plan.problem import Problem
from gaswap.plan.simulator import CATEGORIES, SimResult

_DEEP, _DARK = sns.color_palette("deep"), sns.color_palette("dark")


@dataclass(frozen=True)
class Style:
    """How a method is drawn, the same in every figure and experiment."""

    label: str
    color: tuple | str
    marker: str


# Every method of bench.csv and every seed of a search (same names), and the GA per search space. Red is
# the budget's. Swap-all and recompute-all share the colours of the swap and recompute actions.
METHOD_STYLES = {
    "keep_all": Style("keep-all (plain PyTorch)", "black", "*"),
    "recompute_all": Style("recompute-all", _DEEP[2], "D"),
    "swap_all": Style("swap-all", _DEEP[1], "^"),
    "chen_sqrt": Style("chen-sqrt", _DEEP[4], "v"),
    "chen_greedy": Style("chen-greedy", _DEEP[6], "P"),
    "dtr": Style("dtr", _DEEP[7], "X"),
    "knapsack": Style("knapsack", _DEEP[8], "s"),
    "milp": Style("milp (keep/recompute optimum)", _DEEP[5], "p"),
    "ga:hybrid": Style("GA, hybrid", _DEEP[0], "o"),
    "ga:swap_only": Style("GA, swap_only", _DEEP[9], "o"),
    "ga:recompute_only": Style("GA, recompute_only", _DARK[2], "o"),
    "ga:order_only": Style("GA, order_only", _DARK[4], "o"),
}
_SPARE_COLORS = [_DARK[k] for k in (0, 1, 5, 6, 7, 8, 9)]  # further GA series (two folders of one space...)


def method_style(method: str) -> Style:
    """The style of a method name (as in bench.csv, e.g. "swap_all", "ga:hybrid"); an unknown one gets a grey
    hexagon."""
    return METHOD_STYLES.get(method, Style(method.replace("_", "-"), "grey", "h"))


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
# Two front policies closer than this in peak and in step time (each relative to keep-all's) are one point:
# a figure cannot tell them apart, nor can a measurement. Measured peaks match predictions to the byte, but
# measured step times move by more than 1 % from one run to the next; estimated ones are exact.
MEMORY_RESOLUTION = 1e-3
TIME_RESOLUTION = {"measured": 1e-2, "estimated": 1e-3}


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
        """Step time relative to the search's keep-all, in percent (10 = 10 % slower)."""
        return 100.0 * (step_time_s / self.summary["keep_all"]["step_time_s"] - 1.0)

    def unit(self) -> tuple[int, str]:
        """Bytes per unit and its name for this experiment's memory axes (GB or MB; GiB or MiB when binary)."""
        return units.scale(self.summary["keep_all"]["peak_bytes"])

    def resolution(self) -> tuple[float, float]:
        """(peak, step time) differences, relative to keep-all's, below which two policies count as one:
        MEMORY_RESOLUTION, and TIME_RESOLUTION[measured or estimated]."""
        measured = self.summary.get("cost_source") == "measured"
        return MEMORY_RESOLUTION, TIME_RESOLUTION["measured" if measured else "estimated"]

    def distinct_front(self) -> pd.DataFrame:
        """The front sorted by peak, less policies within `resolution()` of one already listed."""
        keep = self.summary["keep_all"]
        peak, time = self.resolution()
        return distinct(self.front, peak * keep["peak_bytes"], time * keep["step_time_s"])


def distinct(front: pd.DataFrame, peak_bytes: float, step_time_s: float) -> pd.DataFrame:
    """The rows of `front` (columns peak_bytes, step_time_s), fastest first, dropping each one whose peak and
    step time are within `peak_bytes` and `step_time_s` of a row kept before it; sorted by peak. The
    fastest policy (the chosen one) is always kept."""
    kept = []
    for row in front.sort_values(["step_time_s", "peak_bytes"], kind="stable").itertuples():
        if not any(abs(row.peak_bytes - k.peak_bytes) <= peak_bytes and abs(row.step_time_s - k.step_time_s)
                   <= step_time_s for k in kept):
            kept.append(row)
    return front.loc[[k.Index for k in kept]].sort_values(["peak_bytes", "step_time_s"], kind="stable")


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


def _series_colors(results: list[Result]) -> list:
    """Each result's GA colour: its search space's, or a spare one where two folders share a space."""
    spaces = [r.summary["search_space"] for r in results]
    spare = iter(_SPARE_COLORS)
    return [method_style(f"ga:{s}").color if spaces.count(s) == 1 else next(spare) for s in spaces]


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


def _peak_label(result: Result) -> str:
    """What the peaks are: live bytes, or what the caching allocator reserves (`memory: {target: reserved}`)."""
    reserved = (result.summary.get("memory") or {}).get("target") == "reserved"
    return "peak reserved device memory (allocator model)" if reserved else "peak device memory"


def _budget_label(result: Result) -> str:
    """The budget in the experiment's words (e.g. 0.5x) and in the display unit."""
    said = result.summary.get("budget", "")
    size = format_size(result.budget_bytes)
    return f"budget {size}" + (f" ({said})" if said and said != size else "")


# ------------------------------------------------------------------------------------------- Pareto front


@_styled
def pareto(folders, ax=None, *, close_up: bool = True) -> Figure:
    """Step-time overhead against peak memory: the GA front of each folder (one colour per search space;
    policies within the resolution of `Result.resolution` drawn once, the count of distinct ones said), the
    first folder's baselines (bench.csv's rows at its budget, else the search's seed policies), keep-all,
    each folder's chosen policy, and the budgets. In a new figure (no `ax`), when the fronts span less than
    a third of the memory axis, a second panel beneath shows them close up."""
    results = _results(folders)
    first = results[0]
    div, unit = first.unit()
    if ax is None:
        fig = Figure(figsize=(10, 8 if close_up else 5), layout="constrained")
        ax, zoom = fig.subplots(2, 1, height_ratios=(3, 2)) if close_up else (fig.subplots(), None)
    else:
        fig, zoom = ax.figure, None
    fronts, title, baselines = _draw_pareto(ax, results, div)
    keep = first.summary["keep_all"]
    budgets = [r.budget_bytes / div for r in results]
    _pad(ax, fronts["x"].tolist() + baselines + [keep["peak_bytes"] / div] + budgets)
    ax.set(xlabel=f"{_peak_label(first)} ({unit})", ylabel="step-time overhead vs keep-all (%)",
           title=f"{_names(results)}: step time against peak memory, {_budget_label(first)}")
    ax.legend(**LEGEND_OUTSIDE, markerscale=0.7, title=title, title_fontsize="small")
    if zoom is not None:
        lo, hi = min(fronts["x"].min(), *budgets), max(fronts["x"].max(), *budgets)
        if len(fronts) and (hi - lo) < (ax.get_xlim()[1] - ax.get_xlim()[0]) / 3:
            _draw_pareto(zoom, results, div)
            _pad(zoom, [lo, hi], 0.15)
            y_lo, y_hi = fronts["y"].min(), fronts["y"].max()
            margin = 0.15 * ((y_hi - y_lo) or abs(y_hi) or 1.0)
            zoom.set_ylim(y_lo - margin, y_hi + margin)
            zoom.set(xlabel=f"{_peak_label(first)} ({unit})", ylabel="overhead (%)",
                     title="close-up of the GA front and the budget")
        else:
            fig.delaxes(zoom)
    return fig


def _draw_pareto(ax, results: list[Result], div: int) -> tuple[pd.DataFrame, str, list[float]]:
    """Draw fronts, baselines, keep-all, chosen policies and budgets into `ax`; return the fronts' points
    drawn (x, y), where the baselines come from, and the baselines' x."""
    first = results[0]
    points, merged = [], ""
    for r, label, color in zip(results, _labels(results), _series_colors(results)):
        front = r.distinct_front()
        x, y = front["peak_bytes"] / div, r.overhead_pct(front["step_time_s"])
        ax.step(x, y, where="post", color=color, alpha=0.5)
        n, shown = len(r.front), len(front)
        count = f"{n} {'policy' if n == 1 else 'policies'}" + (f", {shown} distinct" if shown < n else "")
        ax.scatter(x, y, color=color, s=60, zorder=4, edgecolors="white", linewidths=0.5,
                   label=f"GA front, {label} ({count})")
        points.append(pd.DataFrame({"x": x, "y": y}))
        if shown < n:
            peak, time = r.resolution()
            merged = f"front: policies within {100 * peak:g} % in peak and {100 * time:g} % in time drawn once"
    title, baseline_xs = _baselines(first, ax)
    if merged:
        title += "\n" + merged
    keep = first.summary["keep_all"]
    star = METHOD_STYLES["keep_all"]
    ax.scatter(keep["peak_bytes"] / div, 0.0, marker=star.marker, s=250, color=star.color, zorder=5,
               label=star.label)
    for r, label in zip(results, _labels(results)):
        best = r.summary["best"]
        if best is None:
            continue
        x, y = best["peak_bytes"] / div, r.overhead_pct(best["step_time_s"])
        ax.scatter(x, y, s=260, facecolors="none", edgecolors="black", linewidths=1.5, zorder=5,
                   label=f"chosen, {label}: {format_size(best['peak_bytes'])}, {_pct(y)}")
        points.append(pd.DataFrame({"x": [x], "y": [y]}))
    _budgets(ax, results, div)
    return pd.concat(points, ignore_index=True), title, baseline_xs


def _pad(ax, xs, fraction: float = 0.08) -> None:
    """Limit the x axis to the points drawn (fronts, baselines, keep-all, budgets) plus a margin on each
    side, so that no point sits against an edge (the over-budget shading goes on beyond)."""
    data = [x for x in xs if pd.notna(x)]
    lo, hi = min(data), max(data)
    margin = fraction * ((hi - lo) or abs(hi) or 1.0)
    ax.set_xlim(lo - margin, hi + margin)


def _budgets(ax, results: list[Result], div: int) -> None:
    """A line at each distinct budget, and the memory over the smallest one shaded."""
    budgets = {r.budget_bytes: r for r in results}
    for budget, r in budgets.items():
        ax.axvline(budget / div, **BUDGET_STYLE, label=_budget_label(r))
    ax.axvspan(min(budgets) / div, 1e6 * max(budgets) / div, color=BUDGET_STYLE["color"], alpha=0.07,
               label="over budget")


def baseline_rows(result: Result) -> tuple[pd.DataFrame, str]:
    """(rows with method, peak_bytes, overhead_pct; where they come from): bench.csv's baseline rows at this
    experiment's budget (bench's own keep-all is the reference of their overheads), else the search's seed
    policies. Keep-all and the GA rows are left out (keep-all is drawn once, the GA is the front)."""
    bench = result.bench
    if bench is not None and "budget_bytes" in bench:
        rows = bench[(bench["budget_bytes"] == result.budget_bytes) & bench["peak_bytes"].notna()
                     & bench["step_time_s"].notna()]
        rows = rows[(rows["method"] != "keep_all") & ~rows["method"].str.startswith("ga:")]
        if len(rows):
            rows = rows.assign(overhead_pct=100 * rows["overhead"])
            note = f"baselines: bench.csv at {format_size(result.budget_bytes)}"
            keep = bench[(bench["method"] == "keep_all") & (bench["budget_bytes"] == result.budget_bytes)]
            searched = result.summary["keep_all"]["step_time_s"]
            if len(keep) and abs(keep["step_time_s"].iloc[0] / searched - 1) > result.resolution()[1]:
                note += (f"\n(its own costs: keep-all {keep['step_time_s'].iloc[0] * 1e3:.1f} ms there, "
                         f"{searched * 1e3:.1f} ms in the search)")
            return rows[["method", "peak_bytes", "overhead_pct"]], note
    seeds = result.summary["seeds"]
    rows = pd.DataFrame([{"method": name, "peak_bytes": s["peak_bytes"], "overhead_pct": 100 * s["overhead"]}
                         for name, s in seeds.items() if name != "keep_all" and s["valid"]],
                        columns=["method", "peak_bytes", "overhead_pct"])
    return rows, "baselines: the search's seed policies"


def _baselines(result: Result, ax) -> tuple[str, list[float]]:
    """Draw the baselines of `baseline_rows`, each method in its style; return where they come from and
    their x positions."""
    rows, note = baseline_rows(result)
    div, _ = result.unit()
    for method, group in rows.groupby("method", sort=False):
        style = method_style(method)
        ax.scatter(group["peak_bytes"] / div, group["overhead_pct"], color=style.color, marker=style.marker,
                   s=60, zorder=3, label=style.label, edgecolors="white", linewidths=0.5)
    return note, list(rows["peak_bytes"] / div)


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
    for r, label, color in zip(results, labels, _series_colors(results)):
        h = r.history.replace(float("inf"), float("nan"))
        sns.lineplot(x=h["generation"], y=h["best_time_s"] * 1e3, ax=time_ax, color=color, label=f"GA, {label}",
                     drawstyle="steps-post")
        sns.lineplot(x=h["generation"], y=100 * h["hypervolume"] / h["hypervolume"].max(), ax=volume_ax, color=color,
                     drawstyle="steps-post")
    keep = first.summary["keep_all"]
    over = " (over budget)" if keep["peak_bytes"] > first.budget_bytes else ""
    time_ax.axhline(keep["step_time_s"] * 1e3, color=METHOD_STYLES["keep_all"].color, linestyle=":",
                    label=f"keep-all{over}")
    time_ax.set(ylabel="best step time\nunder the budget (ms)")
    volume_ax.set(xlabel="generation", ylabel="hypervolume of the front\n(% of its final value)")
    time_ax.legend(**LEGEND_OUTSIDE)
    fig.align_ylabels()
    stopped = "".join(f"\n({label} stopped after {r.summary['generations_done']} generations)"
                      for r, label in zip(results, labels) if r.summary.get("complete") is False)
    fig.suptitle(f"{_names(results)}: search convergence, {_budget_label(first)}{stopped}")
    return fig


# ------------------------------------------------------------------------------ re-simulation of a policy


@dataclass(frozen=True)
class Replay:
    """A policy and keep-all re-simulated, traced, on the re-captured graph of a results folder.

    `costs_note` is None when the costs are those of the search (costs.json, or estimated again to the same
    keep-all); otherwise it says that they were measured again and how keep-all differs."""

    result: Result
    graph: Graph
    policy: policies.Policy
    policy_name: str
    chosen: SimResult
    keep_all: SimResult
    costs_note: str | None = None


def replay(folder: str | Path, policy: str = "policy.yaml", *, cache_dir=None, progress=None,
           trust_factory: bool = False) -> Replay:
    """Re-capture the experiment of `folder` and simulate `policy` (a file in it) and keep-all, traced, with
    the search's costs (costs.json); without that file, with costs got again (`progress(done, total)` while
    measuring), warning when keep-all then differs from the search's. A results folder is data: a model
    factory outside gaswap's zoo, named only by its files, is refused (`results.Refused`) unless
    `trust_factory`."""
    # only to redraw a folder from its experiment: a folder with costs.json plots without torch
    from gaswap.app import workflow
    from gaswap.app.results import Refused
    from gaswap.base import config, locate  # torch
    from gaswap.zoo import shipped

    result = load(folder)
    source = f"{result.folder / 'summary.json'}: experiment_file"
    try:
        file = locate.experiment_file(result.summary, result.folder / "summary.json", source)
    except FileNotFoundError as err:
        raise config.ConfigError(str(err)) from None
    experiment = config.load_experiment(file)
    if not trust_factory and not shipped(experiment.model.factory):
        raise Refused(f"{result.folder}: its experiment {file} builds the model with {experiment.model.factory}, "
                      f"code named only by these results; if you trust it, pass trust_factory=True")
    captured = workflow.capture_step(experiment)
    graph = captured.graph
    costs = costfile.load(result.folder, graph.fingerprint(), (op.name for op in graph.ops))
    again = costs is None
    if again:
        costs = workflow.costs_for(experiment, graph, cache_dir=cache_dir, progress=progress, captured=captured)
    chosen = policies.load(result.folder / policy, graph)
    problem = Problem(graph, costs, result.budget_bytes)
    keep_all = problem.simulate(problem.encoding.uniform(Action.KEEP), trace=True)
    note = None
    searched = result.summary["keep_all"]["step_time_s"]
    if again and abs(keep_all.step_time / searched - 1) > 1e-9:
        note = (f"costs {costs.source} again for this figure ({result.folder} has no {costfile.NAME}): keep-all "
                f"{keep_all.step_time * 1e3:.1f} ms here, {searched * 1e3:.1f} ms in the search")
        warnings.warn(note, stacklevel=2)
    order, actions = chosen.order_indices(graph), chosen.action_codes(problem.encoding.candidates)
    return Replay(result, graph, chosen, Path(policy).name, problem.simulator.run(order, actions, trace=True),
                  keep_all, note)


# -------------------------------------------------------------------------------------- memory timeline


@_styled
def memory_timeline(folder: str | Path, policy: str = "policy.yaml", *, cache_dir=None,
                    replayed: Replay | None = None, trust_factory: bool = False) -> Figure:
    """Device memory by category over simulated time for keep-all and `policy`, with the budget and the
    start of the backward pass; beneath, the policy's copies, recomputations and compute waits. Both runs
    are re-simulated with the same costs (`replayed`, else `replay(folder, policy)`), so the policy's
    overhead is measured against the keep-all drawn above it."""
    rp = replayed or replay(folder, policy, cache_dir=cache_dir, trust_factory=trust_factory)
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
        over = 100 * (run.step_time / rp.keep_all.step_time - 1)
        overhead = f" ({_pct(over)} vs keep-all)" if run is rp.chosen else ""
        ax.stackplot(lv.index, *(lv[c] for c in shown), labels=shown, colors=[CATEGORY_COLORS[c] for c in shown],
                     step="post", linewidth=0)
        ax.axhline(r.budget_bytes / div, **BUDGET_STYLE, label=_budget_label(r))
        ax.axvline(_backward_start(run, rp.graph), **BACKWARD_STYLE, label="backward pass starts")
        ax.set(ylabel=f"device memory ({unit})",
               title=f"{name}: peak {format_size(run.peak_bytes)}, step {run.step_time * 1e3:.1f} ms{overhead}")
    memory_axes[0].legend(**LEGEND_OUTSIDE)
    _streams(streams_ax, rp.chosen)
    streams_ax.axvline(_backward_start(rp.chosen, rp.graph), **BACKWARD_STYLE)
    streams_ax.set(xlabel="simulated time (ms)", title=f"{rp.policy_name}: copy streams and compute stalls")
    fig.suptitle(f"{r.name}: device memory over one training step, {_budget_label(r)}" + _warning(rp),
                 color="black" if rp.costs_note is None else _DEEP[3])
    return fig


def _warning(rp: Replay) -> str:
    """A second title line when the figure's costs are not the search's."""
    return "" if rp.costs_note is None else f"\nWARNING: {rp.costs_note}"


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
def action_map(folder: str | Path, policy: str = "policy.yaml", ax=None, *, cache_dir=None,
               replayed: Replay | None = None, trust_factory: bool = False) -> Figure:
    """Per layer (module path, in captured order; inputs first), the bytes `policy` keeps, swaps and
    recomputes, as stacked horizontal bars; layers holding no bytes (views) are left out."""
    rp = replayed or replay(folder, policy, cache_dir=cache_dir, trust_factory=trust_factory)
    table = _bytes_by_layer(rp.graph, rp.policy)
    table = table[table.sum(axis=1) > 0]  # layers whose saved tensors are views of others' hold no bytes
    div, unit = units.scale(table.sum(axis=1).max())
    fig, ax = _axes(ax, (9, 1.8 + 0.3 * len(table)))
    left = 0
    counts = rp.policy.counts()
    for action, color in ACTION_COLORS.items():
        width = table[action] / div
        ax.barh(table.index, width, left=left, color=color,
                label=f"{action}: {counts[action]} tensors, {format_size(table[action].sum())}")
        left = left + width
    ax.invert_yaxis()
    ax.grid(False, axis="y")
    ax.set(xlim=(0, 1.05 * left.max()), xlabel=f"saved tensors' size ({unit})", ylabel="layer (module path)",
           title=f"{rp.result.name}: {rp.policy_name} per layer, {_budget_label(rp.result)}")
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


# ------------------------------------------------------------------------------------------- in words


def describe(folders) -> str:
    """What each folder's search found, in a few sentences of Markdown written from its results (for the
    notebook's prose, so that it cannot go stale)."""
    results = _results(folders)
    paragraphs = []
    for r, label in zip(results, _labels(results)):
        s = r.summary
        keep = s["keep_all"]
        words = [f"**{r.name}** ({label}, costs {s['cost_source']}): keep-all peaks at "
                 f"{format_size(keep['peak_bytes'])} and steps in {keep['step_time_s'] * 1e3:.1f} ms; "
                 f"{_budget_label(r)}."]
        fits = [method_style(name).label for name, e in s["seeds"].items()
                if name != "keep_all" and e["valid"] and e["peak_bytes"] <= r.budget_bytes]
        if keep["peak_bytes"] <= r.budget_bytes:
            words.append("Keep-all already fits.")
        elif fits:
            words.append(f"Of the simple policies, {' and '.join(fits)} {'fits' if len(fits) == 1 else 'fit'}.")
        else:
            words.append("No simple policy fits.")
        n, shown = len(r.front), len(r.distinct_front())
        words.append(f"The GA front holds {n} {'policy' if n == 1 else 'policies'}"
                     + (f" ({shown} distinct within the figures' resolution)" if shown < n else "") + ".")
        best = s["best"]
        if best is None:
            words.append("None of them fits the budget.")
        else:
            words.append(f"The chosen one, `policy.yaml`, peaks at {format_size(best['peak_bytes'])}, "
                         f"{_pct(100 * best['overhead'])} in step time against keep-all (keep/swap/recompute "
                         f"{best['keep']}/{best['swap']}/{best['recompute']}).")
            if "reserved_bytes" in best:
                words.append(f"Through the caching allocator's model it has {format_size(best['live_bytes'])} live, "
                             f"{format_size(best['allocated_bytes'])} allocated and "
                             f"{format_size(best['reserved_bytes'])} reserved at its peak.")
        if s.get("complete") is False:
            words.append(f"The search was stopped after {s['generations_done']} of {s['generations']} generations.")
        paragraphs.append(" ".join(words))
    return "\n\n".join(paragraphs)


# ----------------------------------------------------------------------------------------------- all four


def plot_results(folder: str | Path, *, cache_dir=None, progress=None, trust_factory: bool = False) -> list[Path]:
    """Write pareto.png, convergence.png, memory_timeline.png and action_map.png into `folder`. The last two
    re-simulate the chosen policy (see `replay`; `progress(done, total)` while costs are measured again)."""
    folder = Path(folder)
    replayed = replay(folder, cache_dir=cache_dir, progress=progress, trust_factory=trust_factory)
    check_front(folder)  # what is drawn must add up with the policy files
    figures = {
        "pareto": pareto(folder),
        "convergence": convergence(folder),
        "memory_timeline": memory_timeline(folder, replayed=replayed),
        "action_map": action_map(folder, replayed=replayed),
    }
    paths = []
    for name, fig in figures.items():
        path = folder / f"{name}.png"
        with replacing(path, binary=True) as f:  # a reader, or a kill, finds the old figure or the new one
            fig.savefig(f, dpi=150, format="png")
        paths.append(path)
    return paths
