"""Evaluation throughput of the search's maps: one process against `gaswap.plan.parallel.ProcessMap(n)`.

    PYTHONPATH=. python scripts/parallel_throughput.py [--ops 1000,2000] [--workers 2] [--rounds 5]

On a synthetic residual graph of each size (budget 0.5x keep-all), evaluates batches of 64 distinct random
chromosomes (one generation of the shipped settings) with the serial map and with the process map, in
alternating order, and prints evaluations per wall-clock second of each and their ratio (median and range
over the rounds). Wall-clock, since it is the point of processes: run it on otherwise idle cores.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from gaswap.plan.costs import Costs
from gaswap.plan.graph import residual_graph
from gaswap.plan.parallel import ProcessMap, serial_map
from gaswap.plan.problem import Problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="1000,2000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4, help="batches of 64 per measurement")
    args = parser.parse_args()
    for n_ops in (int(x) for x in args.ops.split(",")):
        graph = residual_graph(n_ops)
        costs = Costs({op.name: 1e-4 for op in graph.ops}, 12e9, 12e9, "synthetic", "synthetic")
        problem = Problem(graph, costs, Problem(graph, costs).keep_all().peak_bytes // 2)
        rng = random.Random(0)
        batches = [[problem.encoding.random(rng) for _ in range(64)] for _ in range(args.batches * args.rounds * 2)]
        rates = {"serial": [], "processes": []}
        with ProcessMap(args.workers) as pmap:
            pmap(problem.evaluate, batches[0][:args.workers])  # the problem reaches the workers once, up front
            maps = {"serial": serial_map, "processes": pmap}
            for r in range(args.rounds):
                for name in (["serial", "processes"] if r % 2 == 0 else ["processes", "serial"]):
                    todo = [batches.pop() for _ in range(args.batches)]
                    started = time.perf_counter()
                    for batch in todo:
                        maps[name](problem.evaluate, batch)
                    rates[name].append(64 * len(todo) / (time.perf_counter() - started))
        ratios = [p / s for p, s in zip(rates["processes"], rates["serial"])]
        print(f"{n_ops} ops: serial {statistics.median(rates['serial']):.1f} evaluations/s, {args.workers} processes "
              f"{statistics.median(rates['processes']):.1f}; ratio median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}, {args.rounds} rounds)", flush=True)


if __name__ == "__main__":
    main()
