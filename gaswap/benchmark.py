"""Benchmarks that print figures: simulator evaluations per second (`python -m gaswap speed`)."""
from __future__ import annotations

import random
import time

from gaswap.costs import Costs
from gaswap.encoding import Action, Encoding
from gaswap.graph import Graph, Op, Tensor
from gaswap.simulator import Simulator


def residual_graph(n_ops: int, size: int = 1 << 20) -> Graph:
    """A synthetic training step of about `n_ops` ops: residual layers with weights, and their backward.

    Layer i (weight w{i}): h = f(x, w), y = x + h forward; backward gh = bf(gy, h, w) (input gradient),
    gw = bw(gy, x) (weight gradient, free to run anywhere after gy) and gx = gy + gh.
    """
    layers = max(1, n_ops // 5)
    tensors = {"x0": Tensor("x0", size, "input")}
    ops = []
    for i in range(1, layers + 1):
        tensors[f"w{i}"] = Tensor(f"w{i}", size // 4, "param")
        tensors[f"h{i}"] = Tensor(f"h{i}", size, "activation", f"f{i}")
        tensors[f"x{i}"] = Tensor(f"x{i}", size, "activation", f"add{i}")
        ops.append(Op(f"f{i}", "f", (f"x{i-1}", f"w{i}"), (f"h{i}",), "fwd", f"layer{i}", signature="f"))
        ops.append(Op(f"add{i}", "add", (f"x{i-1}", f"h{i}"), (f"x{i}",), "fwd", f"layer{i}", signature="add"))
    grad = f"x{layers}"
    for i in range(layers, 0, -1):
        tensors[f"gh{i}"] = Tensor(f"gh{i}", size, "activation", f"bf{i}")
        tensors[f"gw{i}"] = Tensor(f"gw{i}", size // 4, "grad", f"bw{i}")
        tensors[f"gx{i}"] = Tensor(f"gx{i}", size, "activation", f"badd{i}")
        ops.append(Op(f"bf{i}", "bf", (grad, f"h{i}", f"w{i}"), (f"gh{i}",), "bwd", f"layer{i}", signature="bf"))
        ops.append(Op(f"bw{i}", "bw", (grad, f"x{i-1}"), (f"gw{i}",), "bwd", f"layer{i}", signature="bw"))
        ops.append(Op(f"badd{i}", "badd", (grad, f"gh{i}"), (f"gx{i}",), "bwd", f"layer{i}", signature="badd"))
        grad = f"gx{i}"
    return Graph(tuple(ops), tensors, loss=f"x{layers}")


def evaluations_per_second(graph: Graph, costs: Costs, budget: int | None, seconds: float,
                           seed: int = 0) -> tuple[float, int]:
    """Decode and simulate distinct random chromosomes for about `seconds`; (evaluations/s, evaluations)."""
    enc, sim, rng = Encoding(graph), Simulator(graph, costs, budget), random.Random(seed)
    pool = [enc.random(rng) for _ in range(64)]
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        c = pool[done % len(pool)]
        c = type(c)(tuple(k + 1e-9 * done for k in c.keys), c.actions)  # distinct keys: no decode reuse
        sim.run(enc.decode(c.keys), c.actions)
        done += 1
    return done / (time.perf_counter() - started), done


def deep_gpt_graph(layers: int = 44) -> tuple[Graph, Costs]:
    """A captured GPT-2-sized decoder deep enough for about 2,000 ops, with V100 roofline costs."""
    import torch

    from gaswap import zoo
    from gaswap.capture import capture, make_inputs
    from gaswap.costs import estimate, load_profile

    with torch.device("meta"):
        model = zoo.gpt(vocab=50257, layers=layers, width=768, heads=12, seq=1024)
    ids = {"shape": ["batch", 1024], "dtype": "int64", "high": 50257}
    inputs, target = make_inputs([ids], ids, 8)
    graph = capture(model, inputs, target, "cross_entropy", optimizer="adam").graph
    return graph, estimate(graph, load_profile("v100-pcie-16gb"))


def simulator_speed(experiments: list[str], synthetic_ops: int, seconds: float) -> list[str]:
    """One line per graph: ops, candidates, evaluations per second on one core (budget 0.5x keep-all
    where the graph has no experiment)."""
    from gaswap import config, workflow

    def line(name, graph, costs, budget):
        rate, n = evaluations_per_second(graph, costs, budget, seconds)
        return (f"{name}: {len(graph.ops)} ops, {len(graph.candidates())} candidates: "
                f"{rate:,.0f} evaluations/s ({n} in {seconds:g} s, one core)")

    def half_keep_all(graph, costs):
        enc = Encoding(graph)
        c = enc.uniform(Action.KEEP)
        return Simulator(graph, costs).run(enc.decode(c.keys), c.actions).peak_bytes // 2

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
