"""CPU time per evaluation of Problem.evaluate and allocator.ReservedProblem.evaluate (reserved-memory target): one
replayed step, and two with the optimizer step as `memory: {target: reserved}` searches (workflow.allocator_options),
on 20 random policies of alexnet_4gb and gpt_bench, six rounds with the order rotated: median and range.
Run from the repository root: PYTHONPATH=$PWD python scripts/reserved_speed.py"""
import random
import statistics
import time

from gaswap.app import workflow
from gaswap.base import config
from gaswap.plan.memory.allocator import ReservedProblem
from gaswap.plan.problem import Problem

for name in ["alexnet_4gb", "gpt_bench"]:
    exp = config.load_experiment(f"experiments/{name}.yaml")
    p = workflow.prepare(exp)
    problems = {"Problem": Problem(p.graph, p.costs, None, exp.search_space),
                "ReservedProblem, 1 step": ReservedProblem(p.graph, p.costs, None, exp.search_space),
                "ReservedProblem, as searched": ReservedProblem(p.graph, p.costs, None, exp.search_space,
                                                                **workflow.allocator_options(exp))}
    rng = random.Random(0)
    policies = [problems["Problem"].encoding.random(rng) for _ in range(20)]
    per = {k: [] for k in problems}
    names = list(problems)
    for r in range(6):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.process_time()
            for c in policies:
                problems[k].evaluate(c)
            per[k].append((time.process_time() - t) / len(policies))
    print(name, {k: f"{statistics.median(v) * 1e3:.2f} ms (range {min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})"
                 for k, v in per.items()})
