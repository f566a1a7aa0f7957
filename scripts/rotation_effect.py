"""Does timing a compiled policy among others (as `gaswap compare` does) change its step time?

    PYTHONPATH=. python scripts/rotation_effect.py experiments/compare_gpt_cpu.yaml results/compare_gpt_cpu/compiled

In one process: every policy in the folder and torch.compile at budgets 1.0 / 0.5 / 0.2 are compiled; the
folder's first policy is then timed in alternating blocks, `--blocks` times: `--rounds` rounds of its own
(`training.metered_round`: a metered step, an untimed one, three timed), then `--rounds` rounds in which
every method runs in rotated order, as `compare` times them. Prints the first policy's CPU ms per step,
median and range, alone and rotated, and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path

from gaswap.base import config
from gaswap.compiled import partition
from gaswap.compiled.methods import allow_recompiles, setup, torch_compiled
from gaswap.plan import policy as policies
from gaswap.run import training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("policies", help="a folder of compiled policies (results/<experiment>/compiled)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    exp = config.load_experiment(args.experiment)
    device, model, inputs, target, _ = setup(exp)
    steps = []  # each method's training step: its own copy of the model, compiled

    def add(run, optimizer):
        steps.append(partial(training.train_step, run, optimizer, inputs, target, exp.loss, device))

    for path in sorted(Path(args.policies).glob("p*.yaml")):
        m, opt = training.fresh_copy(model, exp.optimizer)
        add(partition.compile(m, policies.load(path)), opt)
    if not steps:
        raise SystemExit(f"{args.policies}: no p*.yaml policies")
    for budget in (1.0, 0.5, 0.2):
        m, opt = training.fresh_copy(model, exp.optimizer)
        add(torch_compiled(m, budget), opt)
    allow_recompiles(len(steps))
    for step in steps:  # the compiles
        training.warm_up(step)
    alone, rotated = [], []
    for _ in range(args.blocks):
        for _ in range(args.rounds):
            alone += [cpu for _, cpu in training.metered_round(steps[0], device, 3)[2]]
        for r in range(args.rounds):
            for k in [*range(r % len(steps), len(steps)), *range(r % len(steps))]:
                times = [cpu for _, cpu in training.metered_round(steps[k], device, 3)[2]]
                rotated += times if k == 0 else []
    show = lambda v: f"{statistics.median(v) * 1e3:.2f} ms ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})"  # noqa: E731
    print(f"{exp.name}, {len(steps)} methods: alone {show(alone)}, rotated {show(rotated)}, "
          f"ratio {statistics.median(rotated) / statistics.median(alone):.3f}")


if __name__ == "__main__":
    main()
