"""How the sharded search's planning time scales with depth and world size: the Llama-3-8B shape of
experiments/llama3_8b_fsdp8.yaml with fewer or more decoder layers, searched as that experiment does (GA 12 x 6,
offload searched, its 79 GiB budget) at each world size.

    PYTHONPATH=. python scripts/shard_scaling.py [--layers 8,16,32] [--world-sizes 8,64,256]

Prints one Markdown row per (layers, W): the capture's CPU seconds (once per depth, on the meta device), the
search's CPU seconds and distinct plans simulated, CPU seconds per plan, capture + search, and the fastest plan
under the budget against keep-all (which may not fit: the budget is the experiment's). CPU seconds are
this process's (`time.process_time`).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time

from gaswap.app.shard_compare import at_world_size
from gaswap.app.shard_plan import prepare
from gaswap.base import config
from gaswap.plan.shard_search import search

EXPERIMENT = "experiments/llama3_8b_fsdp8.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,16,32")
    parser.add_argument("--world-sizes", default="8,64,256")
    args = parser.parse_args()
    exp = config.load_experiment(EXPERIMENT)
    print("| layers | W | capture CPU s | search CPU s | plans | CPU s per plan | capture + search CPU s | best vs keep-all |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in map(int, args.layers.split(",")):
        model = dataclasses.replace(exp.model, kwargs=dict(exp.model.kwargs) | {"layers": layers})
        prepared = prepare(dataclasses.replace(exp, model=model))
        for w in map(int, args.world_sizes.split(",")):
            problem = at_world_size(prepared["problem"], w, prepared["profile"], exp.distributed.link)
            started = time.process_time()
            keep = problem.evaluate(problem.seed("keep_all"))
            problem.budget = exp.budget.resolve(keep.peak)
            result = search(problem, random.Random(exp.seed), population=exp.ga.population,
                            generations=exp.ga.generations, cx_prob=exp.ga.cx_prob, mut_prob=exp.ga.mut_prob)
            seconds = time.process_time() - started
            print(f"| {layers} | {w} | {prepared['capture_s']:.1f} | {seconds:.1f} | {len(problem.cache)} | "
                  f"{seconds / len(problem.cache):.2f} | {prepared['capture_s'] + seconds:.1f} | "
                  f"{result.best.step_time / keep.step_time - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
