"""torch.compile's partitions of an experiment written under inductor's other settings (issue 34, item 2): each
partition's programs' peak, library calls' scratch counted (`dry_compile.programs_of`, `library_calls.scratch`),
under inductor's defaults, compare's `VARIANTS` and realize_reads 1 with no buffer reuse together; then torch's
partitions at the budgets given compiled as torch.compile compiles them, and the first partition also as a gaswap
policy under that last setting, each metered (allocator) and timed in CPU seconds, rounds rotated (`--peaks`: the
programs' peaks alone). Run from the repository root, one thread:
    PYTHONPATH=. python results/compare_new_models/inductor_variants.py results/compare_new_models/convnext.yaml \
        0.2 0.5 > results/compare_new_models/inductor_variants.txt
    for e in cnn separable unet normmix mixture window vit; do PYTHONPATH=. python \
        results/compare_new_models/inductor_variants.py experiments/compare_${e}_cpu.yaml 0.2 0.5 --peaks; done \
        > results/compare_new_models/inductor_variants_shipped.txt
"""
import statistics
import sys
import time

from gaswap.app.compare_screen import VARIANTS
from gaswap.base import config
from gaswap.compiled import dry_compile, library_calls, methods, partition, programs
from gaswap.run import training

TOGETHER = {"realize_reads": 1, "buffer_reuse": False}
ROUNDS, STEPS = 6, 5


def main(experiment: str, budgets: list[float], timed: bool = True) -> None:
    exp = config.load_experiment(experiment)
    device, model, inputs, target, graph = methods.setup(exp)
    output = graph.tensors[graph.loss].size
    actions = partition.torch_partitions(model, *inputs, budgets=tuple(budgets), optimizer=exp.optimizer,
                                         counted=exp.counts)[1]
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}

    def policy(budget: float, settings: dict):
        return partition.make_policy(graph, actions[budget], provenance=provenance | ({"inductor": settings}
                                                                                      if settings else {}))

    for budget in budgets:
        for settings in [{}, *(v for v, _ in VARIANTS), TOGETHER]:
            started = time.process_time()
            written = dry_compile.programs_of(model, partition.backend(policy(budget, settings)), *inputs)
            peak = programs.step_peak(written, output, exp.loss, library_calls.scratch)
            print(f"{exp.name}: torch {budget:g}'s partition, inductor {settings or 'defaults'}: programs {peak:,} B "
                  f"({time.process_time() - started:.1f} CPU s)", flush=True)
    if not timed:
        return
    runs = {}
    for budget in budgets:
        runs[f"torch.compile {budget:g}"] = lambda m, b=budget: methods.torch_compiled(m, b)
    runs[f"torch {budgets[0]:g}'s partition, inductor {TOGETHER}"] = \
        lambda m: partition.compile(m, policy(budgets[0], TOGETHER))
    steps = {}
    for name, compiled in runs.items():
        m, optimizer = training.fresh_copy(model, exp.optimizer)
        run = compiled(m)

        def step(run=run, optimizer=optimizer):
            return training.train_step(run, optimizer, inputs, target, exp.loss, device)

        step()
        step()
        steps[name] = (step, training.metered_peak(step, device)[0], [])
    names = list(steps)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, _, seconds = steps[name]
            seconds += [step()[1] for _ in range(STEPS)]
    for name, (_, peak, seconds) in steps.items():
        print(f"{name}: metered {peak:,} B; CPU time per step median {statistics.median(seconds) * 1e3:.2f} ms "
              f"({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}), {len(seconds)} steps")


if __name__ == "__main__":
    main(sys.argv[1], [float(b) for b in sys.argv[2:] if b != "--peaks"], "--peaks" not in sys.argv)
