"""The programs' peak against the meter, without and with the scratch of their library calls (issue 34, item 1;
`gaswap.compiled.library_calls`). For each experiment named: torch.compile's partitions at
activation_memory_budget 1, 0.5 and 0.2, and each policy file given after it (`experiment.yaml policy.yaml ...`,
a comma between experiments), written by inductor without compiling their kernels (`dry_compile.programs_of`),
their step peak read from the programs alone and with each library call replayed alone, then compiled for real
and metered (the allocator's count, third step). Run from the repository root, one thread:
    PYTHONPATH=. python results/compiled_model/library_scratch.py \
        results/compare_new_models/convnext.yaml results/compare_new_models/convnext_2d9e7a1/p00.yaml , \
        results/compare_new_models/mobilenet_se.yaml , experiments/compare_separable_cpu.yaml , ... \
        > results/compiled_model/library_scratch.txt
"""
import sys
import time

import torch

from gaswap.base import config
from gaswap.compiled import dry_compile, library_calls, methods, partition, programs
from gaswap.plan import policy as policies
from gaswap.run import training


def main(groups: list[list[str]]) -> None:
    worst = {"programs": 0.0, "with scratch": 0.0}
    for experiment, *policy_files in groups:
        exp = config.load_experiment(experiment)
        dev, model, inputs, target, graph = methods.setup(exp, "cpu")
        output = graph.tensors[graph.loss].size
        runs = [(f"torch {b:g}", methods.torch_backend(b), lambda b=b: methods.torch_compiled(model, b))
                for b in (1.0, 0.5, 0.2)]
        for path in policy_files:
            policy = policies.load(path, graph)
            runs.append((path, partition.backend(policy), lambda p=policy: partition.compile(model, p)))
        for name, backend, compiled in runs:
            written = dry_compile.programs_of(model, backend, *inputs)
            plain = programs.step_peak(written, output, exp.loss)
            started = time.process_time()
            counted = programs.step_peak(written, output, exp.loss, library_calls.scratch)
            replay_s = time.process_time() - started
            torch._dynamo.reset()
            run = compiled()
            optimizer = training.make_optimizer(exp.optimizer, model)
            for _ in range(2):
                training.train_step(run, optimizer, inputs, target, exp.loss, dev)
            metered = training.metered_peak(lambda: training.train_step(run, optimizer, inputs, target, exp.loss,
                                                                         dev), dev)[0]
            errors = {"programs": plain / metered - 1, "with scratch": counted / metered - 1}
            worst = {k: max(worst[k], abs(e)) for k, e in errors.items()}
            print(f"{exp.name} {name}: metered {metered:,} B; programs {plain:,} ({100 * errors['programs']:+.1f} %);"
                  f" with scratch {counted:,} ({100 * errors['with scratch']:+.1f} %); replays {replay_s:.2f} CPU s",
                  flush=True)
    print("worst: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in worst.items()))


if __name__ == "__main__":
    args, groups = sys.argv[1:], [[]]
    for a in args:
        if a == ",":
            groups.append([])
        else:
            groups[-1].append(a)
    main([g for g in groups if g])
