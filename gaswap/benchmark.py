"""Benchmarks that print figures: simulator evaluations per second (`python -m gaswap speed`)."""
from __future__ import annotations

import random
import time

from gaswap.costs import Costs
from gaswap.encoding import Encoding
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


def evaluations_per_second(graph: Graph, costs: Costs, seconds: float, seed: int = 0) -> tuple[float, int]:
    """Decode and simulate distinct random chromosomes for about `seconds`; (evaluations/s, evaluations)."""
    enc, sim, rng = Encoding(graph), Simulator(graph, costs), random.Random(seed)
    pool = [enc.random(rng) for _ in range(64)]
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        c = pool[done % len(pool)]
        c = type(c)(tuple(k + 1e-9 * done for k in c.keys), c.actions)  # distinct keys: no decode reuse
        sim.run(enc.decode(c.keys), c.actions)
        done += 1
    return done / (time.perf_counter() - started), done


def simulator_speed(experiments: list[str], synthetic_ops: int, seconds: float) -> list[str]:
    """One line per graph: ops, candidates, evaluations per second on one core."""
    from gaswap import config, workflow

    lines = []
    for path in experiments:
        prepared = workflow.prepare(config.load_experiment(path))
        g = prepared.graph
        rate, n = evaluations_per_second(g, prepared.costs, seconds)
        lines.append(f"{prepared.experiment.name}: {len(g.ops)} ops, {len(g.candidates())} candidates: "
                     f"{rate:,.0f} evaluations/s ({n} in {seconds:g} s, one core)")
    g = residual_graph(synthetic_ops)
    costs = Costs({op.name: 1e-4 for op in g.ops}, 12e9, 12e9, "synthetic", "synthetic")
    rate, n = evaluations_per_second(g, costs, seconds)
    lines.append(f"synthetic residual graph: {len(g.ops)} ops, {len(g.candidates())} candidates: "
                 f"{rate:,.0f} evaluations/s ({n} in {seconds:g} s, one core)")
    return lines
