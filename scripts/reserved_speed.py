"""CPU time per evaluation of Problem.evaluate and allocator.ReservedProblem.evaluate (reserved-memory target),
on 20 random policies of alexnet_4gb and gpt_bench, six rounds with the order rotated: median and range.
Run from the repository root: PYTHONPATH=$PWD python scripts/reserved_speed.py"""
import time, statistics, random
from gaswap import config, workflow
from gaswap.allocator import ReservedProblem
from gaswap.problem import Problem
for name in ["alexnet_4gb", "gpt_bench"]:
    exp = config.load_experiment(f"experiments/{name}.yaml")
    p = workflow.prepare(exp)
    plain = Problem(p.graph, p.costs, None, exp.search_space); reserved = ReservedProblem(p.graph, p.costs, None, exp.search_space)
    rng = random.Random(0)
    pols = [plain.encoding.random(rng) for _ in range(20)]
    runs = {"Problem.evaluate": plain.evaluate, "ReservedProblem.evaluate": reserved.evaluate}
    per = {k: [] for k in runs}
    for r in range(6):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t = time.process_time()
            for c in pols: runs[k](c)
            per[k].append((time.process_time() - t) / len(pols))
    print(name, {k: f"{statistics.median(v)*1e3:.2f} ms (range {min(v)*1e3:.2f}-{max(v)*1e3:.2f})" for k, v in per.items()})
