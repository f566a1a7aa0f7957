"""torch.compile's own partitions against the same partitions read back as gaswap policies, side by side.

    PYTHONPATH=. python scripts/readback.py experiments/compare_gpt_cpu.yaml [--budgets 1.0 0.5 0.2] [--rounds 5]

For each `activation_memory_budget`, torch.compile with inductor at that budget, and gaswap's compiled
backend under `compiled.torch_partition`'s keep/recompute actions (what torch's min-cut saved, as a policy),
each with its own copy of the model, trained in rounds with the order rotated: the allocator peak of one
metered step (`gaswap.meter`) and the CPU time per step (the experiment's `costs.threads` intra-op
threads), median and range. Equal figures mean gaswap's search space holds torch's choice as torch runs it.
"""
from __future__ import annotations

import argparse
import statistics

from gaswap import compiled, config
from gaswap.compare import Method, _allow_recompiles, _torch_compiled, fresh_copy, metered_round, prepare, train_step
from gaswap.config import format_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    args = parser.parse_args()
    exp = config.load_experiment(args.experiment)
    device, model, inputs, target, _ = prepare(exp)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    _allow_recompiles(2 * len(args.budgets))
    methods = []
    for budget in args.budgets:
        graph, actions = compiled.torch_partition(model, *inputs, budget=budget, optimizer=exp.optimizer,
                                                  counted=exp.counts)
        policy = compiled.make_policy(graph, actions, provenance=provenance)
        m, opt = fresh_copy(model, exp)
        methods.append(Method("torch.compile", f"{budget:g}", m, _torch_compiled(m, budget), opt))
        m, opt = fresh_copy(model, exp)
        methods.append(Method("read back", f"{budget:g}", m, compiled.compile(m, policy), opt))
    for m in methods:
        for _ in range(2):  # compile, then one step more
            train_step(m, inputs, target, exp.loss, device)
    peaks: dict[int, list[int]] = {k: [] for k in range(len(methods))}
    times: dict[int, list[float]] = {k: [] for k in range(len(methods))}
    for r in range(args.rounds):
        for k in [(k + r) % len(methods) for k in range(len(methods))]:
            peak, _, timed = metered_round(methods[k], inputs, target, exp.loss, device, args.steps)
            peaks[k].append(peak)
            times[k] += [cpu for _, cpu in timed]
    print(f"{exp.name}: {args.rounds} rounds x {args.steps} steps, CPU ms per step")
    print("| budget | method | peak | step (median) | range |")
    print("|---:|---|---:|---:|---:|")
    for k, m in enumerate(methods):
        t = times[k]
        print(f"| {m.knob} | {m.name} | {format_size(int(statistics.median(peaks[k])))} | "
              f"{statistics.median(t) * 1e3:.1f} | {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
