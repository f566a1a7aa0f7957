"""Why the compiled time model misses separable's policies: the calibration points of a stored compare run
(`p00.yaml`'s provenance: measured seconds) in the model's terms (`step_model.samples`, priced by the run's cost
cache), each with the bytes of 4-D buffers its backward program lays out plainly (not channels-last: inductor
lays a backward out channels-last only where it recomputes a convolution, `GraphLowering.decide_layout_opt`),
read from its programs written without compiling their kernels (`dry_compile`); then the model's fit on the
calibration points with each set of terms, and with a term for those plain-layout bytes or for "the backward
recomputes no convolution", in sample, each point left out in turn, and on the run's pick (measured in its
head to head). Run from the repository root:
    PYTHONPATH=. python results/compiled_model/separable_layout_fit.py > results/compiled_model/separable_layout_fit.txt
"""
import csv
import itertools
import re
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import nnls

from gaswap.base import config
from gaswap.compiled import dry_compile, partition, step_model
from gaswap.compiled import methods as compiled_methods
from gaswap.plan.op_types import is_library_call
from gaswap.run.measure import measure

RUN = Path("results/compare_time/separable_66e8842")
BUFFER = re.compile(r"(?:empty_strided_cpu|reinterpret_tensor)\((?:\w+, )?\((\d+), (\d+), (\d+), (\d+)\), "
                    r"\((\d+), (\d+), (\d+), (\d+)\)")


def plain_layout_bytes(code: str) -> int:
    """Bytes of the 4-D float buffers (allocated or reused) a program lays out plainly, spatial dims > 1."""
    total = 0
    for m in BUFFER.finditer(code):
        n, c, h, w, _, stride_c, _, stride_w = map(int, m.groups())
        if h * w > 1 and stride_c != 1 and stride_w == 1:
            total += n * c * h * w * 4
    return total


def main() -> None:
    exp = config.load_experiment("experiments/compare_separable_cpu.yaml")
    device, model, inputs, _, graph = compiled_methods.setup(exp)
    costs = measure(graph, device, RUN / "costs", threads=exp.costs.threads)
    _, parts = partition.torch_partitions(model, *inputs, budgets=(1.0, 0.5, 0.2), optimizer=exp.optimizer,
                                          counted=exp.counts)
    problem, chosen = step_model.calibration_set(graph, costs, exp.loss, {f"torch {b:g}": a for b, a in parts.items()})
    p00 = yaml.safe_load((RUN / "p00.yaml").read_text())
    calibration = p00["provenance"]["calibration"]
    measured = {label: m for label, m, _ in calibration["points"]}
    pick_row = next(r for r in csv.DictReader(open(RUN / "compare.csv")) if r["method"] == "gaswap")
    policies = dict(chosen) | {"pick": problem.canonical(problem.encoding.read_back(p00["actions"]))}
    times = measured | {"pick": float(pick_row["step_s"])}
    points = step_model.samples(problem, [(label, c, times[label]) for label, c in policies.items()],
                                calibration["inline_recomputed"])
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    convolutions = {op.name for op in graph.ops if is_library_call(op.target) and "convolution" in op.target}
    rows = []
    print(f"{RUN.name}: each policy's terms, its backward's plain-layout bytes, measured")
    for (label, c), p in zip(policies.items(), points):
        actions = problem.actions_of(c)
        _, backward = dry_compile.programs_of(model, partition.backend(partition.make_policy(
            graph, actions, provenance=provenance)), *inputs)
        plain = plain_layout_bytes(backward.code)
        no_conv = float(not any(actions.get(t) == "recompute" for t in convolutions))
        rows.append((label, *p[1:5], plain, no_conv, p[-1]))
        print(f"  {label:20s} library calls {p[1] * 1e3:5.2f} ms, generated {p[2] * 1e3:5.2f} ms, masks "
              f"{p[3] / 1e6:5.2f} MB, saved {p[4] / 1e6:5.2f} MB, backward plain layout {plain / 1e6:5.1f} MB"
              f"{', no convolution recomputed' if no_conv else ''}; measured {p[-1] * 1e3:6.2f} ms", flush=True)
    fitted, pick = rows[:-1], rows[-1]
    names = ("extern", "generated", "mask", "saved", "plain layout", "no convolution")

    def fit(sample, terms):  # the model's form: extern and generated at 1 where not fitted, the rest at 0
        default = lambda r: sum(r[k] for k in (1, 2) if k not in terms)
        x = np.array([[r[k] for k in terms] + [1.0] for r in sample])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
        w, _ = nnls(x / scale, np.array([r[7] - default(r) for r in sample]))
        w = w / scale
        return lambda r: float(np.dot([r[k] for k in terms] + [1.0], w)) + default(r)

    print("the 12 fits on the calibration points best in sample (worst error in sample, worst left out, the pick):")
    results = []
    for n in range(1, 5):
        for terms in itertools.combinations(range(1, 7), n):
            if 5 in terms and 6 in terms:
                continue
            f = fit(fitted, terms)
            inside = max(abs(f(r) / r[7] - 1) for r in fitted)
            out = max(abs(fit(fitted[:k] + fitted[k + 1:], terms)(r) / r[7] - 1) for k, r in enumerate(fitted))
            results.append((inside, f"  {', '.join(names[k - 1] for k in terms):48s} in sample {inside:6.1%}, "
                                    f"left out {out:6.1%}, pick {f(pick) / pick[7] - 1:+6.1%}"))
    for _, line in sorted(results)[:12]:
        print(line)


if __name__ == "__main__":
    main()
