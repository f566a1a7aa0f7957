"""Which convergence rule: long fixed searches, with each rule applied to their history.

    PYTHONPATH=. python scripts/stopping_rule.py [--graph gpt12|gpt48|gpt96|alexnet] [--generations 300]
        [--seeds 0,1] [--save histories.json | --load histories.json]

Searches a GPT stack of scripts/scaling.py (`gptN`: N layers) at 0.4x (hybrid, population 64) or
experiments/alexnet_4gb.yaml for exactly `--generations` (patience off), then, for each rule, finds the
generation where `stopping.converged` would have stopped it (`stopping.stopping_generation`) and prints it with the evaluations spent and how
many points of overhead over keep-all the best policy then was behind the whole run's. `--save` writes the
recorded histories (JSON) and `--load` replays saved ones without searching.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from gaswap.base.config import GASettings, load_search_space
from gaswap.plan.problem import Generation, Problem
from gaswap.plan.search import search
from gaswap.plan.stopping import stopping_generation

RULES = [(p, t) for p in (20, 30, 40, 50, 60) for t in (0.0, 0.001)]


def problem_of(graph_name: str):
    """(graph, costs, space, population, budget, keep-all step time) of a graph this script knows."""
    if graph_name == "alexnet":
        from gaswap.app import workflow
        from gaswap.base import config

        experiment = config.load_experiment("experiments/alexnet_4gb.yaml")
        prepared = workflow.prepare(experiment)
        keep = workflow.keep_all(prepared)
        return (prepared.graph, prepared.costs, experiment.search_space, 128,
                experiment.budget.resolve(keep.peak_bytes), keep.step_time)
    from gaswap.app.speed import deep_gpt_graph

    graph, costs = deep_gpt_graph(int(graph_name.removeprefix("gpt")), profile="a100-pcie-40gb")
    keep = Problem(graph, costs).keep_all()
    return graph, costs, load_search_space("hybrid"), 64, int(0.4 * keep.peak_bytes), keep.step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="gpt12", help="gptN (a GPT stack of N layers) or alexnet")
    parser.add_argument("--generations", type=int, default=300)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--save", help="write the recorded histories to this JSON file")
    parser.add_argument("--load", help="replay the histories of this JSON file (no search)")
    args = parser.parse_args()
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        keep_time = saved["keep_step_time"]
        runs = {int(s): [Generation(**g) for g in h] for s, h in saved["runs"].items()}
    else:
        graph, costs, space, population, budget, keep_time = problem_of(args.graph)
        ga = dataclasses.replace(GASettings(), population=population, generations=args.generations, patience=None)
        runs = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            runs[seed] = list(search(Problem(graph, costs, budget, space), ga, seed).history)
            if args.save:
                with open(args.save, "w") as f:
                    json.dump({"graph": args.graph, "keep_step_time": keep_time,
                               "runs": {s: [dataclasses.asdict(g) for g in h] for s, h in runs.items()}}, f)
    for seed, history in runs.items():
        print(f"seed {seed}: {history[-1].best_time_s / keep_time - 1:+.2%} after {len(history)} generations")
    print("| patience | tolerance | " + " | ".join(f"seed {s}: generation, evaluations, behind" for s in runs) + " |")
    for patience, tolerance in RULES:
        cells = []
        for history in runs.values():
            g = stopping_generation(history, patience, tolerance)
            g = len(history) - 1 if g is None else g
            behind = (history[g].best_time_s - history[-1].best_time_s) / keep_time
            cells.append(f"{g + 1}, {history[g].evaluations:,}, +{behind * 100:.2f} pp")
        print(f"| {patience} | {tolerance:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
