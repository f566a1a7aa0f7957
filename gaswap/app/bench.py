"""`gaswap bench`: the GA against the baselines and the MILP optimum, under several budgets.

For one experiment and each budget: every baseline of `gaswap.plan.solvers.baselines`, the keep/recompute MILP
(`gaswap.plan.solvers.milp`, within a time limit) and the GA in each search space, all judged by the same simulator.
The GA is seeded with the baselines' policies (as far as a space allows their actions), and the hybrid
space, searched last, also with the best policy of each narrower space; the MILP, solved after the GA, is
warm-started with the GA's fastest fitting keep/recompute policy in the captured order.
Writes `results/<experiment>/bench.csv` and `bench.md`. No torch at import.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from gaswap.app import results
from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.base.files import csv_text, write_atomic
from gaswap.plan.encoding import Action
from gaswap.plan.problem import Problem
from gaswap.plan.search import search
from gaswap.plan.solvers import milp
from gaswap.plan.solvers.baselines import BASELINES
from gaswap.app import workflow

SPACES = ("swap_only", "recompute_only", "order_only", "hybrid")
COLUMNS = ("budget", "budget_bytes", "method", "feasible", "peak_bytes", "step_time_s", "overhead",
           "solve_seconds", "note")


def run(experiment_path, budgets, *, results_root="results", cache_dir=None, time_limit=60,
        progress=None, measure_progress=None) -> list[dict]:
    """Bench one experiment under each budget (a fraction of the keep-all peak such as 0.5, or a size for
    `config.parse_size`: "0.5x", "4GB"); write bench.csv and bench.md; return the rows (COLUMNS).
    `progress(row)` is called as each row is made, `measure_progress(done, total)` while costs are measured."""

    experiment = config.load_experiment(experiment_path)
    parsed = {label: parse_budget(label) for label in (str(b).strip() for b in budgets)}  # refused before capture
    prepared = workflow.prepare(experiment, cache_dir=cache_dir, progress=measure_progress)
    reference = workflow.keep_all(prepared)
    rows = []
    for label, spec in parsed.items():
        budget = spec.resolve(reference.peak_bytes)
        for row in _bench(prepared, budget, reference.step_time, time_limit):
            row = {"budget": label, "budget_bytes": budget} | row
            rows.append(row)
            if progress:
                progress(row)
    folder = Path(results_root) / experiment.name
    with results.locked(folder):  # not while a search replaces the folder
        results.recover(folder)
        write_atomic(folder / "bench.csv", csv_text(rows, COLUMNS))
        write_atomic(folder / "bench.md", to_markdown(rows, experiment.name))
    return rows


def parse_budget(text) -> config.Budget:
    """A plain number in (0, 1] is a fraction of the keep-all peak; anything else goes to `parse_size`."""
    try:
        number = float(text)
    except (TypeError, ValueError):
        number = None
    if number is not None and 0 < number <= 1:
        return config.Budget(fraction=number)
    return config.parse_size(text)


def _bench(prepared, budget: int, keep_time: float, time_limit: float):
    """The rows of one budget: baselines, the GA in each search space, then the MILP (warm-started by the GA)."""
    graph, costs = prepared.graph, prepared.costs
    problem = Problem(graph, costs, budget)
    seeds = {}
    for name, baseline in BASELINES.items():
        started = time.perf_counter()
        seeds[name] = chromosome = baseline(graph, costs, budget)
        r = problem.simulate(chromosome)
        yield _simulated_row(name, r, budget, keep_time, time.perf_counter() - started, _counts(chromosome.actions))
    found = {}
    yield from _ga_rows(prepared, budget, keep_time, seeds, found)
    yield _milp_row(problem, budget, keep_time, time_limit, found)


def _milp_row(problem: Problem, budget: int, keep_time: float, time_limit: float, found: dict):
    """The MILP's row, warm-started with the fastest keep/recompute policy in the captured order that fits
    among the GA's fronts in `found` (space -> SearchResult)."""
    captured = problem.encoding.captured_keys()
    usable = [(e.step_time, name, e.chromosome) for name, r in found.items() for e in r.front
              if e.chromosome.keys == captured and Action.SWAP not in e.chromosome.actions]
    warm = min(usable, key=lambda u: u[:2], default=None)
    m = milp.solve(problem.graph, problem.costs, budget, time_limit=time_limit,
                   warm_start=None if warm is None else warm[2])
    note = f"{m.status}; {m.binaries} binaries, {m.variables} variables, {m.constraints} constraints"
    if warm is not None:
        note += f"; warm start ga:{warm[1]} {warm[0] * 1e3:.2f} ms"
        note += " (nothing faster found)" if m.warm_start else ""
    if m.chromosome is None:
        return _row("milp", False, None, None, keep_time, m.seconds, note)
    gap = f"{m.gap:.3%}" if math.isfinite(m.gap) else "unknown (the solver proved no bound)"
    note += f"; MIP gap {gap}; {_counts(m.chromosome.actions)}"
    note += "" if m.verified else "; the simulator disagrees"
    return _simulated_row("milp", m.simulated, budget, keep_time, m.seconds, note)


def _ga_rows(prepared, budget: int, keep_time: float, seeds: dict, found: dict):
    """The GA in each space, seeded with `seeds`; hybrid, last, also with the narrower spaces' best policies
    (and its solve time includes theirs). Each space's SearchResult goes into `found`."""
    graph, costs, experiment = prepared.graph, prepared.costs, prepared.experiment
    best, spent = {}, 0.0
    for name in SPACES:
        problem = Problem(graph, costs, budget, config.load_search_space(name))
        extra = {k: problem.restrict(c) for k, c in (seeds | best if name == "hybrid" else seeds).items()}
        ga = dataclasses.replace(experiment.ga, milp_seed_ops=0)  # the GA against the MILP, not seeded by it
        result = found[name] = search(problem, ga, experiment.seed, seeds=extra)
        spent += result.seconds
        seconds = spent if name == "hybrid" else result.seconds
        note = f"{result.evaluations} evaluations, stopped by {result.stopped_by}"
        if name == "hybrid":
            note += "; seeded with the other spaces' best"
        if result.best is None:
            yield _row(f"ga:{name}", False, result.smallest_peak, None, keep_time, seconds,
                       note + "; none fits (peak is the smallest reached)")
        else:
            best[f"ga_{name}"] = result.best.chromosome
            yield _row(f"ga:{name}", True, result.best.peak_bytes, result.best.step_time, keep_time, seconds,
                       note + f"; {_counts(result.best.chromosome.actions)}")


def _simulated_row(method, r, budget: int, keep_time: float, seconds: float, note: str) -> dict:
    """The row of a simulated policy."""
    if not r.valid:
        return _row(method, False, None, None, keep_time, seconds, f"invalid: {r.reason}")
    return _row(method, r.peak_bytes <= budget, r.peak_bytes, r.step_time, keep_time, seconds, note)


def _row(method, feasible, peak, step_time, keep_time, seconds, note) -> dict:
    """One row (less the budget); peak and step time are None where there is no valid policy."""
    return {
        "method": method,
        "feasible": bool(feasible),
        "peak_bytes": peak,
        "step_time_s": step_time,
        "overhead": None if step_time is None else step_time / keep_time - 1,
        "solve_seconds": seconds,
        "note": note,
    }


def _counts(actions) -> str:
    return "keep/swap/recompute " + "/".join(str(sum(1 for a in actions if a == x)) for x in Action)


def to_markdown(rows: list[dict], name: str) -> str:
    """One table; per budget, the fastest policy that fits is in bold."""
    fastest = {}
    for r in rows:
        if r["feasible"] and r["step_time_s"] < fastest.get(r["budget"], float("inf")):
            fastest[r["budget"]] = r["step_time_s"]
    lines = [f"# gaswap bench: {name}", "",
             "| budget | method | fits | peak | step time | overhead | solve | note |",
             "|---|---|---|---|---|---|---:|---|"]
    for r in rows:
        time_ms = "-" if r["step_time_s"] is None else f"{r['step_time_s'] * 1e3:.2f} ms"
        if r["feasible"] and r["step_time_s"] == fastest.get(r["budget"]):
            time_ms = f"**{time_ms}**"
        lines.append(" | ".join([
            f"| {r['budget']} ({format_size(r['budget_bytes'])})", r["method"], "yes" if r["feasible"] else "no",
            "-" if r["peak_bytes"] is None else format_size(r["peak_bytes"]), time_ms,
            "-" if r["overhead"] is None else f"{round(r['overhead'], 4) + 0.0:+.1%}", f"{r['solve_seconds']:.2f} s",
            r["note"] + " |"]))
    return "\n".join(lines) + "\n"

