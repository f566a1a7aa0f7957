"""What each starting-point lever buys: the GPT stack of scripts/scaling.py, searched to convergence per variant.

    PYTHONPATH=. python scripts/search_levers.py [--layers 12] [--seeds 0,1,2] [--variants base,mincut,share=0.5,...]

A variant is `+`-joined switches on top of the three simple seeds (fitting baselines always join): `mincut`
(the min-cut seed), `share=P` (space.share_blocks P; 0 otherwise). `base` is neither. Runs every variant for
each seed in one process (rotating nothing: CPU time per search) and prints one JSON line per search: best
overhead over keep-all, evaluations, evaluations until the first fitting policy, CPU seconds, generations.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from gaswap.app.speed import deep_gpt_graph
from gaswap.base.config import GASettings, load_search_space
from gaswap.plan import search as searching
from gaswap.plan.problem import Problem
from gaswap.plan.solvers import mincut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default="base,mincut,share=0.5,share=1,mincut+share=0.5")
    args = parser.parse_args()
    graph, costs = deep_gpt_graph(args.layers, profile="a100-pcie-40gb")
    keep = Problem(graph, costs).keep_all()
    budget = int(0.4 * keep.peak_bytes)
    hybrid = load_search_space("hybrid")
    for seed in (int(s) for s in args.seeds.split(",")):
        for variant in args.variants.split(","):
            switches = dict(s.partition("=")[::2] for s in variant.split("+"))
            space = dataclasses.replace(hybrid, share_blocks=float(switches.get("share") or 0))
            searching.min_cut_policies = mincut.min_cut_policies if "mincut" in switches else (lambda problem: [])
            started = time.process_time()
            r = searching.search(Problem(graph, costs, budget, space), GASettings(population=64), seed)
            cpu = time.process_time() - started
            first = next((h.evaluations for h in r.history if h.best_time_s < float("inf")), None)
            print(json.dumps({"layers": args.layers, "variant": variant, "seed": seed,
                              "overhead": r.best.step_time / keep.step_time - 1 if r.best else None,
                              "evaluations": r.evaluations, "first_fitting": first, "cpu_s": round(cpu, 1),
                              "generations": r.generations_done, "stopped_by": r.stopped_by}), flush=True)


if __name__ == "__main__":
    main()
