"""`python -m gaswap speed`: simulator evaluations per second (decode and simulate, as the search does)."""
from __future__ import annotations

import random
import time

from gaswap.plan.costs import Costs
from gaswap.plan.graph import Graph, residual_graph
from gaswap.plan.problem import Problem
from gaswap.app import workflow
from gaswap.base import config


def evaluations_per_second(problem: Problem, seconds: float, seed: int = 0) -> tuple[float, int]:
    """Evaluate distinct random chromosomes for about `seconds` of this process's CPU time;
    (evaluations per CPU-second, evaluations)."""
    rng = random.Random(seed)
    pool = [problem.encoding.random(rng) for _ in range(64)]
    done, started = 0, time.process_time()
    while time.process_time() - started < seconds:
        c = pool[done % len(pool)]
        c = type(c)(tuple(k + 1e-9 * done for k in c.keys), c.actions)  # distinct keys: no decode reuse
        problem.evaluate(c)
        done += 1
    return done / (time.process_time() - started), done


def deep_gpt_graph(layers: int = 44, profile: str = "v100-pcie-16gb") -> tuple[Graph, Costs]:
    """A captured GPT-2-sized decoder (width 768, 12 heads, seq 1024, batch 8, Adam), by default deep enough
    for about 2,000 ops, with the roofline costs of hardware `profile`."""
    import torch

    # torch only for this synthetic graph: timing experiments' graphs starts without it
    from gaswap import zoo
    from gaswap.plan.costs import estimate, load_profile
    from gaswap.run.capture import capture, make_inputs

    with torch.device("meta"):
        model = zoo.gpt(vocab=50257, layers=layers, width=768, heads=12, seq=1024)
    ids = {"shape": ["batch", 1024], "dtype": "int64", "high": 50257}
    inputs, target = make_inputs([ids], ids, 8)
    graph = capture(model, inputs, target, "cross_entropy", optimizer="adam").graph
    return graph, estimate(graph, load_profile(profile))


def simulator_speed(experiments: list[str], synthetic_ops: int, seconds: float) -> list[str]:
    """One line per graph: ops, candidates, evaluations per second on one core (budget 0.5x keep-all
    where the graph has no experiment)."""

    def line(name, graph, costs, budget):
        rate, n = evaluations_per_second(Problem(graph, costs, budget), seconds)
        return (f"{name}: {len(graph.ops)} ops, {len(graph.candidates())} candidates: "
                f"{rate:,.0f} evaluations per CPU-second ({n} in {seconds:g} s of CPU, one core)")

    def half_keep_all(graph, costs):
        return Problem(graph, costs).keep_all().peak_bytes // 2

    lines = []
    for path in experiments:
        prepared = workflow.prepare(config.load_experiment(path))
        budget = prepared.experiment.budget.resolve(workflow.keep_all(prepared).peak_bytes)
        lines.append(line(prepared.experiment.name, prepared.graph, prepared.costs, budget))
    g = residual_graph(synthetic_ops)
    costs = Costs({op.name: 1e-4 for op in g.ops}, 12e9, 12e9, "synthetic", "synthetic")
    lines.append(line("synthetic residual graph", g, costs, half_keep_all(g, costs)))
    g, costs = deep_gpt_graph()
    lines.append(line("gpt, 44 layers, batch 8 x 1024 (captured)", g, costs, half_keep_all(g, costs)))
    return lines
