"""Which convergence rule: long fixed searches, with each (patience, tolerance) applied to their history.

    PYTHONPATH=. python scripts/stopping_rule.py [--graph gpt12|alexnet] [--generations 300] [--seeds 0,1]

Searches the 12-layer GPT of scripts/scaling.py at 0.4x (hybrid, population 64) or experiments/alexnet_4gb.yaml
for exactly `--generations` (patience off), then, for each rule, finds the generation where it would have
stopped and prints it with the evaluations spent and how many points of overhead over keep-all the best
policy then was behind the whole run's.
"""
from __future__ import annotations

import argparse
import dataclasses

from gaswap.config import GASettings, load_search_space
from gaswap.problem import Problem
from gaswap.search import converged, search

RULES = [(p, t) for p in (10, 20, 30, 50) for t in (0.0, 0.001, 0.005)]


def stopped_at(history, patience: int, tolerance: float) -> int:
    """The index of the generation where `search.converged` ends the search (else the last)."""
    return next((g for g in range(len(history)) if converged(history[:g + 1], patience, tolerance)),
                len(history) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", choices=("gpt12", "alexnet"), default="gpt12")
    parser.add_argument("--generations", type=int, default=300)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    if args.graph == "alexnet":
        from gaswap import config, workflow

        experiment = config.load_experiment("experiments/alexnet_4gb.yaml")
        prepared = workflow.prepare(experiment)
        keep = workflow.keep_all(prepared)
        graph, costs, space, population = prepared.graph, prepared.costs, experiment.search_space, 128
        budget = experiment.budget.resolve(keep.peak_bytes)
    else:
        from gaswap.speed import deep_gpt_graph

        graph, costs = deep_gpt_graph(12, profile="a100-pcie-40gb")
        keep = Problem(graph, costs).keep_all()
        space, population, budget = load_search_space("hybrid"), 64, int(0.4 * keep.peak_bytes)
    ga = dataclasses.replace(GASettings(), population=population, generations=args.generations, patience=None)
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        runs[seed] = search(Problem(graph, costs, budget, space), ga, seed).history
        print(f"seed {seed}: {runs[seed][-1].best_time_s / keep.step_time - 1:+.2%} after {args.generations} "
              "generations", flush=True)
    print("| patience | tolerance | " + " | ".join(f"seed {s}: generation, evaluations, behind" for s in runs) + " |")
    for patience, tolerance in RULES:
        cells = []
        for history in runs.values():
            g = stopped_at(history, patience, tolerance)
            behind = (history[g].best_time_s - history[-1].best_time_s) / keep.step_time
            cells.append(f"{g + 1}, {history[g].evaluations:,}, +{behind * 100:.2f} pp")
        print(f"| {patience} | {tolerance:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
