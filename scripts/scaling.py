"""How the search scales with the graph: GPT stacks of growing depth, searched to convergence on one core.

    PYTHONPATH=. python scripts/scaling.py [--layers 12,24] [--seeds 1]

For each depth: a GPT decoder (width 768, 12 heads, seq 1024, batch 8, Adam, A100 roofline costs) under
0.4x its keep-all peak, searched in the hybrid space (population 64) until it converges (no 0.1 %
improvement of the best time or the hypervolume in 20 generations) or reaches 300 generations. Prints one
Markdown row per depth: ops, candidates, evaluations, CPU seconds (this process, capture excluded),
what stopped the search, the best overhead over keep-all, and the gap to the best known policy: the
keep/recompute MILP's optimum where it solves within 60 s (a hybrid policy may beat it: the gap is then
negative), else the best of the seeds run.
"""
from __future__ import annotations

import argparse
import time

from gaswap import milp
from gaswap.config import GASettings, load_search_space
from gaswap.problem import Problem
from gaswap.search import search
from gaswap.speed import deep_gpt_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24", help="comma-separated depths")
    parser.add_argument("--seeds", type=int, default=1, help="searches per depth (seeds 0..n-1)")
    args = parser.parse_args()
    ga = GASettings(population=64, generations=300, patience=20, tolerance=0.001)
    space = load_search_space("hybrid")
    print("| layers | ops | candidates | evaluations | CPU s | stopped by | best overhead | gap to best known |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in (int(x) for x in args.layers.split(",")):
        graph, costs = deep_gpt_graph(layers, profile="a100-pcie-40gb")
        keep = Problem(graph, costs).keep_all()
        budget = int(0.4 * keep.peak_bytes)
        runs = []
        for seed in range(args.seeds):
            started = time.process_time()
            r = search(Problem(graph, costs, budget, space), ga, seed)
            runs.append((r, time.process_time() - started))
        exact = milp.solve(graph, costs, budget, time_limit=60) if len(graph.ops) <= 300 else None
        found = [r.best.step_time for r, _ in runs if r.best is not None]
        known = exact.step_time if exact is not None and exact.status == "optimal" else min(found, default=None)
        source = "MILP" if known is not None and exact is not None and exact.status == "optimal" else "best seed"
        for r, cpu in runs:
            best = r.best.step_time if r.best else None
            overhead = f"{best / keep.step_time - 1:+.1%}" if best else "none fits"
            gap = f"{best / known - 1:+.2%} ({source})" if best and known else "-"
            print(f"| {layers} | {len(graph.ops):,} | {len(graph.candidates()):,} | {r.evaluations:,} | {cpu:.0f} | "
                  f"{r.stopped_by} | {overhead} | {gap} |", flush=True)


if __name__ == "__main__":
    main()
