"""The simulator of a past commit against this one, side by side in one process (CPU time, order rotated).

    PYTHONPATH=. python scripts/simulator_side_by_side.py [--old f9dcaf0] [--rounds 5] [--seconds 2]

On the 2,000-op synthetic residual graph (budget 0.5x keep-all), both simulators run the same 32 decoded
random policies (after checking they agree on them); prints evaluations per CPU-second of each and the
median and range of new/old over the rounds.
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

from gaswap import simulator as new
from gaswap.costs import Costs
from gaswap.encoding import Action, Encoding
from gaswap.graph import residual_graph


def old_simulator(rev: str):
    """gaswap/simulator.py as of `rev`, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{rev}:gaswap/simulator.py"], check=True, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "simulator_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("simulator_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rate(sim, cases, seconds: float) -> float:
    done, started = 0, time.process_time()
    while time.process_time() - started < seconds:
        order, actions = cases[done % len(cases)]
        sim.run(order, actions)
        done += 1
    return done / (time.process_time() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="f9dcaf0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    old = old_simulator(args.old)
    g = residual_graph(2000)
    costs = Costs({op.name: 1e-4 for op in g.ops}, 12e9, 12e9, "synthetic", "synthetic")
    enc = Encoding(g)
    keep = enc.uniform(Action.KEEP)
    budget = new.Simulator(g, costs).run(enc.decode(keep.keys), keep.actions).peak_bytes // 2
    rng = random.Random(0)
    cases = [(enc.decode(c.keys), c.actions) for c in (enc.random(rng) for _ in range(32))]
    sims = {"old": old.Simulator(g, costs, budget), "new": new.Simulator(g, costs, budget)}
    for order, actions in cases:
        a, b = sims["old"].run(order, actions), sims["new"].run(order, actions)
        assert (a.step_time, a.peak_bytes, a.valid) == (b.step_time, b.peak_bytes, b.valid)
    rates, ratios = {"old": [], "new": []}, []
    for r in range(args.rounds):
        got = {k: rate(sims[k], cases, args.seconds) for k in (("old", "new") if r % 2 == 0 else ("new", "old"))}
        for k, v in got.items():
            rates[k].append(v)
        ratios.append(got["new"] / got["old"])
    print(f"2000-op synthetic graph: {args.old} {statistics.median(rates['old']):.1f} evaluations per CPU-second, "
          f"this tree {statistics.median(rates['new']):.1f}; new/old median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}, {args.rounds} rounds of {args.seconds:g} s)")


if __name__ == "__main__":
    main()
