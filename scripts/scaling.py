"""How the search scales with the graph: GPT stacks of growing depth, searched to convergence on one core.

    PYTHONPATH=. python scripts/scaling.py [--layers 12:5,48:2,96:1] [--long 12,48]

For each depth: a GPT decoder (width 768, 12 heads, seq 1024, batch 8, Adam, A100 roofline costs) under
0.4x its keep-all peak, searched in the hybrid space with the default GA settings (`config.GASettings`:
population 64, converged when 50 generations gain no 0.1 %, at most 500 generations) once per seed
(`12:5` = seeds 0-4). `--long` depths are also searched once more with patience 60 and tolerance 0 (seed
100), which only counts toward the best known policy. Prints one Markdown row per search as it ends: ops,
candidates, evaluations, CPU seconds (this process, capture excluded), what stopped it, the best overhead
over keep-all and the gap to the best known policy (the fastest of every search of that depth: the MILP
does not solve graphs of this size); then per depth the seed spread, (slowest - fastest) / fastest of the
seeds' best times.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from gaswap.app.speed import deep_gpt_graph
from gaswap.base.config import GASettings, load_search_space
from gaswap.plan.problem import Problem
from gaswap.plan.search import search

LONG_SEED = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12:5,48:2,96:1", help="comma-separated depth:seeds")
    parser.add_argument("--long", default="", help="comma-separated depths also searched once for longer")
    args = parser.parse_args()
    longer = {int(x) for x in args.long.split(",") if x}
    space = load_search_space("hybrid")
    print("| layers | seed | ops | candidates | evaluations | CPU s | stopped by | best overhead | gap to best known |")
    print("|---|---|---|---|---|---|---|---|---|")
    summaries = []
    for spec in args.layers.split(","):
        layers, seeds = (int(x) for x in spec.split(":"))
        graph, costs = deep_gpt_graph(layers, profile="a100-pcie-40gb")
        keep = Problem(graph, costs).keep_all()
        budget = int(0.4 * keep.peak_bytes)
        plans = [(seed, GASettings()) for seed in range(seeds)]
        if layers in longer:
            plans.append((LONG_SEED, dataclasses.replace(GASettings(), patience=60, tolerance=0.0)))
        runs = []
        for seed, ga in plans:
            started = time.process_time()
            r = search(Problem(graph, costs, budget, space), ga, seed)
            runs.append((seed, r, time.process_time() - started))
            best = r.best.step_time if r.best else None
            print(f"<!-- {layers} layers, seed {seed}: best {best} s, {r.generations_done} generations -->",
                  flush=True)
        known = min((r.best.step_time for _, r, _ in runs if r.best), default=None)
        for seed, r, cpu in runs:
            best = r.best.step_time if r.best else None
            overhead = f"{best / keep.step_time - 1:+.1%}" if best else "none fits"
            gap = f"{best / known - 1:+.2%}" if best and known else "-"
            label = f"{seed} (long)" if seed == LONG_SEED else str(seed)
            print(f"| {layers} | {label} | {len(graph.ops):,} | {len(graph.candidates()):,} | {r.evaluations:,} | "
                  f"{cpu:.0f} | {r.stopped_by} | {overhead} | {gap} |", flush=True)
        times = [r.best.step_time for seed, r, _ in runs if r.best and seed != LONG_SEED]
        if len(times) > 1:
            summaries.append(f"{layers} layers: seed spread {max(times) / min(times) - 1:.2%} over {len(times)} seeds")
    for line in summaries:
        print(line)


if __name__ == "__main__":
    main()
