"""Is there a faster policy next to torch's partition, at its peak? (issue 34, item 2: normmix's torch 0.5 and 0.2, where
no policy of gaswap's own search fits.) From torch.compile's partition at a budget, each recomputed value kept instead
(one at a time), ranked by the compiled model's predicted gain (the stored run's calibration, `p00.yaml`), its peak
read from inductor's programs (`dry_compile`, no kernels compiled) against the partition's own; those that fit are
combined greedily (each added while the programs still fit); the combination and the first two singles that fit are
then compiled and timed beside the partition (CPU seconds a step, median of 9 rotated rounds of 3 steps; allocator
peak).
Run from the repository root (the costs are the stored run's):
    PYTHONPATH=. python results/compiled_model/next_to_torch.py normmix normmix_5cf0f96 0.5 20 --time
"""
import os
import sys
import time

import stored_run
from gaswap.base import config
from gaswap.compiled import calibration_run, dry_compile, partition, step_model
from gaswap.compiled import methods as cm
from gaswap.compiled.programs import step_peak
from gaswap.plan.encoding import Action, Chromosome
from gaswap.run.measure import measure


def main(name: str, run: str, knob: float, ranked: int, timed: bool) -> None:
    print(os.popen("uptime").read().strip())
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, target, graph = cm.setup(exp)
    costs = measure(graph, device, f"results/compare_time/{run}/costs", threads=exp.costs.threads)
    space = config.load_search_space(partition.space_for(device))
    torch_actions = partition.torch_partitions(model, *inputs, budgets=(knob,), optimizer=exp.optimizer,
                                               counted=exp.counts)[1][knob]
    calibration = stored_run.calibration_of(f"results/compare_time/{run}/p00.yaml")
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=calibration)
    checking = [0.0]  # CPU seconds in dry compiles

    def policy(chromosome):
        return partition.make_policy(graph, problem.actions_of(chromosome), provenance=provenance)

    def program_peak(chromosome) -> int:
        start = time.process_time()
        programs = dry_compile.programs_of(model, partition.backend(policy(chromosome)), *inputs)
        checking[0] += time.process_time() - start
        return step_peak(programs, graph.tensors[graph.loss].size, exp.loss)

    def kept(chromosome, indices):
        actions = list(chromosome.actions)
        for k in indices:
            actions[k] = int(Action.KEEP)
        return problem.canonical(Chromosome(chromosome.keys, tuple(actions)))

    base = problem.canonical(problem.encoding.read_back(torch_actions))
    budget = program_peak(base)
    base_time = problem.simulate(base).step_time
    recomputed = [k for k, a in enumerate(base.actions)
                  if a == Action.RECOMPUTE and Action.KEEP in problem.encoding.allowed[k]]
    gains = sorted(((base_time - problem.simulate(kept(base, [k])).step_time, k) for k in recomputed), reverse=True)
    print(f"torch {knob:g}: its programs' peak {budget / 1e6:.3f} MB; {len(recomputed)} values recomputed")
    fits = []
    for gain, k in gains[:ranked]:
        if gain <= 0:
            break
        peak = program_peak(kept(base, [k]))
        print(f"  keep {problem.encoding.candidates[k]:24s} model {-gain * 1e3:+.3f} ms  programs {peak / 1e6:.3f} MB "
              f"{'fits' if peak <= budget else 'over'}", flush=True)
        if peak <= budget:
            fits.append(k)
    chosen = fits[:1]
    for k in fits[1:]:
        if program_peak(kept(base, [*chosen, k])) <= budget:
            chosen.append(k)
    combined = kept(base, chosen)
    print(f"combined: {len(chosen)} kept ({', '.join(problem.encoding.candidates[k] for k in chosen)}); programs "
          f"{program_peak(combined) / 1e6:.3f} MB; model {(problem.simulate(combined).step_time - base_time) * 1e3:+.3f} "
          f"ms; dry compiles {checking[0]:.0f} CPU s")
    if chosen and timed:
        labels = ["torch", "combined", *(f"keep {problem.encoding.candidates[k]}" for k in fits[:2])]
        chromosomes = [base, combined, *(kept(base, [k]) for k in fits[:2])]
        rows = calibration_run.cpu_times_of([policy(c) for c in chromosomes], model, inputs, target, exp, device,
                                            lambda s: None, rounds=9, steps=3)
        for label, (seconds, peak) in zip(labels, rows):
            print(f"  {label:22s} {seconds * 1e3:.2f} ms ({seconds / rows[0][0] - 1:+.1%}) {peak / 1e6:.3f} MB")
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), "--time" in sys.argv)
