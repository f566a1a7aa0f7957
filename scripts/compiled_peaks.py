"""Predicted against measured peaks of compiled policies: keep-all, recompute-all, torch's partitions at
activation_memory_budget 1.0 / 0.5 / 0.2, and random keep/recompute policies, each compiled and trained.

    PYTHONPATH=. python scripts/compiled_peaks.py experiments/compare_cnn_cpu.yaml [--random 2] [--steps 3]

The measured peak is `gaswap.run.peak_meter`'s (torch's allocator, above what is allocated before the step; on a CPU
the resident-set high-water mark beside it); the predicted ones are the compiled model's
(`step_model.CompiledProblem`) and the joint graph's ops one by one (`Problem`), less the resident bytes,
and the peak of the programs inductor generated for the policy (`compiled_program`).
"""
from __future__ import annotations

import argparse
import random
import statistics
from functools import partial

from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.compiled import partition, programs, step_model
from gaswap.compiled.methods import allow_recompiles, setup
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.problem import Problem
from gaswap.run import training
from gaswap.run.measure import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--random", type=int, default=2, help="random policies besides the named ones")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    exp = config.load_experiment(args.experiment)
    device, model, inputs, target, graph = setup(exp)
    costs = measure(graph, device, threads=exp.costs.threads)
    space = config.load_search_space(partition.SPACE)
    fused = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    opwise = Problem(graph, costs, None, space)
    encoding, resident = fused.encoding, fused.fused.resident_bytes()
    policies = {"keep-all": encoding.uniform(Action.KEEP), "recompute-all": encoding.uniform(Action.RECOMPUTE)}
    for budget in (1.0, 0.5, 0.2):
        _, actions = partition.torch_partition(model, *inputs, budget=budget, optimizer=exp.optimizer,
                                              counted=exp.counts)
        policies[f"torch {budget:g}"] = encoding.read_back(actions)
    rng = random.Random(0)
    for k in range(args.random):
        c = encoding.random(rng, order=False)
        policies[f"random {k}"] = Chromosome(encoding.captured_keys(), c.actions)
    print(f"{exp.name}: {len(graph.ops)} ops, {len(encoding.candidates)} candidates, resident {format_size(resident)}")
    print("| policy | recomputed | predicted (compiled model) | predicted (ops one by one) | generated program "
          "| measured allocated | error (compiled model) | error (program) | measured resident |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    allow_recompiles(len(policies))
    for label, c in policies.items():
        policy = partition.make_policy(graph, fused.actions_of(c), provenance=provenance)
        m, optimizer = training.fresh_copy(model, exp.optimizer)
        step = partial(training.train_step, partition.compile(m, policy), optimizer, inputs, target, exp.loss, device)
        recorder = programs.Recorder()
        training.warm_up(step, first=recorder)
        program = programs.step_peak(recorder.programs, graph.tensors[graph.loss].size, exp.loss)
        rounds = [training.metered_round(step, device, 0) for _ in range(args.steps)]
        peaks, rss = [peak for peak, _, _ in rounds], [rss_peak for _, rss_peak, _ in rounds]
        predicted = fused.simulate(c).peak_bytes - resident
        measured = statistics.median(peaks)
        print(f"| {label} | {sum(a == Action.RECOMPUTE for a in c.actions)} | {format_size(predicted)} | "
              f"{format_size(opwise.simulate(c).peak_bytes - resident)} | {format_size(program)} | "
              f"{format_size(measured)} | {measured / predicted - 1:+.1%} | {measured / program - 1:+.1%} | "
              f"{'-' if None in rss else format_size(statistics.median(rss))} |",
              flush=True)


if __name__ == "__main__":
    main()
