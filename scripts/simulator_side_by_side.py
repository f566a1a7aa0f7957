"""The simulator (and decoding) of a past commit against this tree's, side by side in one process.

    PYTHONPATH=. python scripts/simulator_side_by_side.py [--old f9dcaf0] [--rounds 5] [--seconds 2]
                                                          [--graphs synthetic,alexnet,gpt]

Per graph (the 2,000-op synthetic residual graph at 0.5x keep-all; AlexNet at its experiment's 4 GB budget;
a 44-layer GPT of about 2,000 ops at 0.5x keep-all), both run the same 32 random policies, after checking
that they agree on each: step time, peak, compute time, validity and the traced program. Two measures,
each in CPU time with the two sides interleaved evaluation by evaluation (the first side alternating), so
that the load of the machine falls on both alike:

- simulator: `Simulator.run` on decoded orders (what the simulator costs);
- evaluate: decode and simulate a chromosome, what `Problem.evaluate` costs per chromosome (the old side:
  the old commit's `Encoding.decode` and `Simulator.run`; this tree: `Problem.evaluate`, its order cache
  missed by giving every evaluation distinct keys).

Prints evaluations per CPU-second of each side and the median and range of new/old over the rounds.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Chromosome
from gaswap.plan.graph import residual_graph
from gaswap.plan.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
POLICIES = 32


def old_module(rev: str, name: str):
    """gaswap/plan/<name>.py as of `rev` (gaswap/<name>.py before the sub-packages), imported as a module of
    its own."""
    def show(path):
        return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, cwd=ROOT)

    shown = show(f"gaswap/plan/{name}.py")
    text = (shown if shown.returncode == 0 else show(f"gaswap/{name}.py")).stdout
    path = Path(tempfile.mkdtemp()) / f"{name}_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"{name}_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def graphs(names: list[str]):
    """(name, graph, costs, budget) for each graph asked for."""
    def half_keep_all(graph, costs):
        return Problem(graph, costs).keep_all().peak_bytes // 2

    for name in names:
        if name == "synthetic":
            g = residual_graph(2000)
            costs = Costs({op.name: 1e-4 for op in g.ops}, 12e9, 12e9, "synthetic", "synthetic")
            yield "2000-op synthetic graph", g, costs, half_keep_all(g, costs)
        elif name == "alexnet":
            from gaswap.app import workflow
            from gaswap.base import config
            prepared = workflow.prepare(config.load_experiment(str(ROOT / "experiments/alexnet_4gb.yaml")))
            budget = prepared.experiment.budget.resolve(workflow.keep_all(prepared).peak_bytes)
            yield "AlexNet (alexnet_4gb)", prepared.graph, prepared.costs, budget
        elif name == "gpt":
            from gaswap.app.speed import deep_gpt_graph
            g, costs = deep_gpt_graph()
            yield f"GPT, 44 layers ({len(g.ops)} ops)", g, costs, half_keep_all(g, costs)
        else:
            raise SystemExit(f"unknown graph {name!r}: synthetic, alexnet or gpt")


def check_agreement(old_sim, new_sim, cases) -> None:
    """Both simulators give the same answers on every case, traced and not."""
    for order, actions in cases:
        for trace in (False, True):
            a, b = old_sim.run(order, actions, trace=trace), new_sim.run(order, actions, trace=trace)
            assert (a.step_time, a.peak_bytes, a.compute_time, a.valid, a.program) == \
                   (b.step_time, b.peak_bytes, b.compute_time, b.valid, b.program), "the simulators disagree"


def side_by_side(old, new, cases, seconds: float) -> tuple[float, float]:
    """Call old(x) and new(x) for each x of `cases` (cycled) alternately, which goes first alternating too,
    until both together have used `seconds` of CPU; evaluations per CPU-second of (old, new)."""
    clock = time.process_time
    spent = [0.0, 0.0]
    k = 0
    while spent[0] + spent[1] < seconds:
        x = cases(k)
        for side in ((0, 1) if k % 2 == 0 else (1, 0)):
            started = clock()
            (old, new)[side](x)
            spent[side] += clock() - started
        k += 1
    return k / spent[0], k / spent[1]


def measure(label: str, old, new, cases, rounds: int, seconds: float) -> None:
    """Print the median rates and the median and range of new/old over `rounds` of `side_by_side`."""
    rates, ratios = ([], []), []
    for _ in range(rounds):
        got = side_by_side(old, new, cases, seconds)
        rates[0].append(got[0])
        rates[1].append(got[1])
        ratios.append(got[1] / got[0])
    print(f"  {label}: old {statistics.median(rates[0]):,.1f} evaluations per CPU-second, "
          f"new {statistics.median(rates[1]):,.1f}; new/old median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}, {rounds} rounds of {seconds:g} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="f9dcaf0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--graphs", default="synthetic,alexnet,gpt")
    args = parser.parse_args()
    old_sim_module, old_enc_module = old_module(args.old, "simulator"), old_module(args.old, "encoding")
    for name, g, costs, budget in graphs(args.graphs.split(",")):
        problem = Problem(g, costs, budget)
        old_sim, old_enc = old_sim_module.Simulator(g, costs, budget), old_enc_module.Encoding(g)
        rng = random.Random(0)
        chromosomes = [problem.encoding.random(rng) for _ in range(POLICIES)]
        cases = [(problem.encoding.decode(c.keys), c.actions) for c in chromosomes]
        check_agreement(old_sim, problem.simulator, cases)
        print(f"{name}: {len(g.ops)} ops, {len(problem.encoding.candidates)} candidates, budget {budget:,} bytes; "
              f"{args.old} vs this tree, answers identical on {POLICIES} random policies")

        def distinct(k: int) -> Chromosome:  # keys no evaluation has seen: no decode is reused
            c = chromosomes[k % POLICIES]
            return Chromosome(tuple(x + 1e-9 * k for x in c.keys), c.actions)

        measure("simulator", lambda case: old_sim.run(*case), lambda case: problem.simulator.run(*case),
                lambda k: cases[k % POLICIES], args.rounds, args.seconds)
        measure("evaluate (decode + simulate)", lambda c: old_sim.run(old_enc.decode(c.keys), c.actions),
                problem.evaluate, distinct, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
