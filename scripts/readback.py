"""torch.compile's own partitions against the same partitions read back as gaswap policies, side by side.

    PYTHONPATH=. python scripts/readback.py experiments/compare_gpt_cpu.yaml [--budgets 1.0 0.5 0.2] [--rounds 5]

For each `activation_memory_budget`, torch.compile with inductor at that budget, and gaswap's compiled
backend under `partition.torch_partition`'s keep/recompute actions (what torch's min-cut saved, as a policy),
each with its own copy of the model, trained in rounds with the order rotated: the allocator peak of one
metered step (`gaswap.run.peak_meter`) and the CPU time per step (the experiment's `costs.threads` intra-op
threads), median and range. Equal figures mean gaswap's search space holds torch's choice as torch runs it.
"""
from __future__ import annotations

import argparse

from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.compiled import partition
from gaswap.compiled.methods import Method, measure, setup, torch_compiled
from gaswap.run.training import fresh_copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    args = parser.parse_args()
    exp = config.load_experiment(args.experiment)
    device, model, inputs, target, _ = setup(exp)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    methods = []
    for budget in args.budgets:
        graph, actions = partition.torch_partition(model, *inputs, budget=budget, optimizer=exp.optimizer,
                                                  counted=exp.counts)
        policy = partition.make_policy(graph, actions, provenance=provenance)
        m, opt = fresh_copy(model, exp.optimizer)
        methods.append(Method("torch.compile", f"{budget:g}", m, torch_compiled(m, budget), opt))
        m, opt = fresh_copy(model, exp.optimizer)
        methods.append(Method("read back", f"{budget:g}", m, partition.compile(m, policy), opt))
    rows = measure(methods, inputs, target, exp.loss, device, args.rounds, args.steps, progress=lambda _: None)
    print(f"{exp.name}: {args.rounds} rounds x {args.steps} steps, CPU ms per step")
    print("| budget | method | peak | step (median) | range |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['knob']} | {r['method']} | {format_size(r['peak_bytes'])} | {r['step_s'] * 1e3:.1f} | "
              f"{r['step_min'] * 1e3:.1f}-{r['step_max'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
