"""Command line: one thin function per verb. `python -m gaswap search experiments/alexnet_4gb.yaml`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from gaswap import config
from gaswap.config import format_size

EXIT_CONFIG, EXIT_INFEASIBLE = 2, 3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gaswap", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("search", help="search keep/swap/recompute policies for an experiment")
    p.add_argument("experiment", help="experiment YAML file, e.g. experiments/alexnet_4gb.yaml")
    p.add_argument("--results", default="results", help="folder of result folders (default: results)")
    p.add_argument("--cache", default=None, help="cost cache folder (default: $GASWAP_CACHE or ~/.cache/gaswap)")
    p.set_defaults(run=search)
    p = verbs.add_parser("speed", help="benchmark the simulator: evaluations per second")
    p.add_argument("experiments", nargs="*", help="experiment files whose graphs to time (default: alexnet_4gb)")
    p.add_argument("--synthetic-ops", type=int, default=2000, help="size of the synthetic graph also timed")
    p.add_argument("--seconds", type=float, default=3.0, help="time spent per graph")
    p.set_defaults(run=speed)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except config.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG


def search(args) -> int:
    """Capture, cost, search and write `results/<experiment>/`; print a short table."""
    from gaswap import workflow

    exp = config.load_experiment(args.experiment)
    out = Path(args.results) / exp.name
    print(f"gaswap search {exp.name}: {exp.model.factory}, batch {exp.batch_size}, budget {exp.budget}, "
          f"search space {exp.search_space.name}")
    try:
        with tqdm(desc="capture + cost measurement", unit="op", leave=False) as bar:
            prepared = workflow.prepare(exp, cache_dir=args.cache, progress=_progress(bar))
    except workflow.CaptureError as err:
        print(f"error: {exp.path}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    g = prepared.graph
    print(f"graph: {len(g.ops)} ops, {len(g.tensors)} tensors, {len(g.candidates())} candidate activations "
          f"(captured in {prepared.capture_seconds:.1f} s); costs {prepared.costs.source} on {prepared.costs.device} "
          f"({prepared.costs_seconds:.1f} s)")
    try:
        with tqdm(total=exp.ga.generations, desc="search", unit="gen") as gens:

            def on_generation(record):
                gens.update(1)
                gens.set_postfix(best=_ms(record["best_time_s"]), front=record["front_size"])

            result, summary = workflow.run_search(prepared, out, on_generation=on_generation)
    except workflow.Infeasible as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    print(table(result, summary))
    print(f"wrote {out}/ (policy.yaml, front.csv, history.csv, summary.json, policies/)")
    return 0


def table(result, summary) -> str:
    """Keep-all, the seed policies and the best policy under the budget, side by side."""
    keep = summary["keep_all"]
    rows = [("policy", "peak", "step time", "overhead", "keep/swap/recompute")]

    def row(name, e):
        if not e.valid:
            return (name, "invalid", "", "", "")
        counts = e.counts()
        over = e.step_time / keep["step_time_s"] - 1
        fits = "" if e.peak_bytes <= summary["budget_bytes"] else " (over budget)"
        return (name, format_size(e.peak_bytes) + fits, _ms(e.step_time), f"{over:+.1%}",
                f"{counts['keep']}/{counts['swap']}/{counts['recompute']}")

    for name, e in result.seeds.items():
        rows.append(row(name.replace("_", "-"), e))
    rows.append(row("best (GA)", result.best))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    budget = format_size(summary["budget_bytes"])
    if summary["budget"] != budget:
        budget += f" ({summary['budget']})"
    lines.append(f"budget {budget}; costs {summary['cost_source']}; "
                 f"search {result.seconds:.1f} s, {result.evaluations} evaluations, {len(result.front)} policies "
                 f"on the front")
    return "\n".join(lines)


def speed(args) -> int:
    """Print simulator evaluations per second on experiment graphs and a synthetic graph."""
    from gaswap import benchmark

    for line in benchmark.simulator_speed(args.experiments or ["experiments/alexnet_4gb.yaml"],
                                          args.synthetic_ops, args.seconds):
        print(line)
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < float("inf") else "-"


def _progress(bar):
    def update(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()

    return update
