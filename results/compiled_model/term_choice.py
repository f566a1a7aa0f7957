"""The compiled time model's fit on all four terms against the terms chosen by points left out (`step_model.fit`),
out of sample, on the measurements this repository holds. Run from the repository root:
    PYTHONPATH=. python results/compiled_model/term_choice.py > results/compiled_model/term_choice.txt

1. results/compiled_model/measured/ (the Intel Xeon, `scripts/compiled_model_errors.py measure`): fitted as
   `gaswap compare` fits (the four set policies, one random half, torch's three partitions, on their first
   timing), each priced by the op costs of that machine (results/compiled_model/costs/, read as that device's);
   predicted: the two other random halves and gaswap's picks.
2. results/compare_time/*_a301c48_w2 and four later runs (the AMD EPYC, `gaswap compare` runs): the run's own
   eight calibration points (`p00.yaml`'s provenance), re-priced by its cost cache; predicted: its first pick
   (`p00.yaml`, measured in compare.csv).
"""
import csv
import sys
from pathlib import Path

import yaml

import gaswap.run.measure as measure_module
from gaswap.base import config
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import partition, step_model
from gaswap.plan.encoding import Action, Chromosome

STORED = Path("results/compiled_model")
RUNS = Path("results/compare_time")
INTEL = "cpu: Intel(R) Xeon(R) Processor @ 2.50GHz, family 6 model 85, AVX512 (1 thread)"
FITTED = ("cal keep-all", "cal masks recomputed", "cal recompute-generated", "cal recompute-all", "cal random half 1",
          "torch 1", "torch 0.5", "torch 0.2")


def line(label: str, every, chosen, point) -> str:
    m = point[-1]
    return (f"  {label:24s} measured {m * 1e3:7.1f} ms   four terms {every.predict(point) / m - 1:+6.1%}   "
            f"chosen {chosen.predict(point) / m - 1:+6.1%}")


def header(name: str, every, chosen) -> str:
    return (f"{name}: four terms: base {every.base * 1e3:.1f} ms, within {every.worst_error():.1%} in sample; "
            f"chosen ({', '.join(chosen.terms) or 'none'}): base {chosen.base * 1e3:.1f} ms, within "
            f"{chosen.worst_error():.1%} in sample")


def stored(name: str) -> list[str]:
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, _, _, _, graph = compiled_methods.setup(exp)
    real = measure_module.device_name
    measure_module.device_name = lambda dev: INTEL  # the costs of the machine the times were taken on
    try:
        costs = measure_module.measure(graph, device, STORED / "costs", threads=exp.costs.threads)
    finally:
        measure_module.device_name = real
    assert costs.measured == 0, "every op's cost is in the stored cache"
    problem = step_model.CompiledProblem(graph, costs, None, config.load_search_space(partition.SPACE), loss=exp.loss)
    rows = list(csv.DictReader(open(STORED / "measured" / f"compare_{name}_cpu.csv")))

    def chromosome(letters: str) -> Chromosome:
        return problem.canonical(Chromosome(problem.encoding.captured_keys(), tuple(
            int(Action.RECOMPUTE if ch == "r" else Action.KEEP) for ch in letters)))

    first = [r for r in rows if r["label"] in FITTED]
    base = step_model.fit_measured(problem, [(r["label"], chromosome(r["actions"]),
                                              float(r.get("first_step_s") or r["step_s"]), int(r["peak_bytes"]))
                                             for r in first])
    points = [(label, *p[1:]) for label, p in zip(
        [r["label"] for r in first], step_model.samples(problem, [(r["label"], chromosome(r["actions"]), float(
            r.get("first_step_s") or r["step_s"])) for r in first], base.inline_recomputed))]
    every, chosen = step_model.fit_terms(points), step_model.fit(points)
    others = [r for r in rows if r["label"] not in FITTED]
    held = step_model.samples(problem, [(r["label"], chromosome(r["actions"]), float(r["step_s"])) for r in others],
                              base.inline_recomputed)
    return [header(f"{name} (Intel, stored)", every, chosen)] + [line(p[0], every, chosen, p) for p in held]


def compare_run(name: str, run: str) -> list[str]:
    run = RUNS / run
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, _, graph = compiled_methods.setup(exp)
    costs = measure_module.measure(graph, device, run / "costs", threads=exp.costs.threads)
    assert costs.measured == 0, "every op's cost is in the run's cache"
    p00 = yaml.safe_load((run / "p00.yaml").read_text())
    calibration = p00["provenance"]["calibration"]
    measured = {label: m for label, m, _ in calibration["points"]}
    torch_parts = {f"torch {b:g}": partition.torch_partition(model, *inputs, budget=b, optimizer=exp.optimizer,
                                                             counted=exp.counts)[1] for b in (1.0, 0.5, 0.2)}
    problem, chosen_policies = step_model.calibration_set(graph, costs, exp.loss, torch_parts)
    inline = calibration["inline_recomputed"]
    points = step_model.samples(problem, [(label, c, measured[label]) for label, c in chosen_policies.items()], inline)
    every, chosen = step_model.fit_terms(points), step_model.fit(points)
    pick = next(r for r in csv.DictReader(open(run / "compare.csv")) if r["method"] == "gaswap")
    (point,) = step_model.samples(problem, [("pick", problem.canonical(problem.encoding.read_back(p00["actions"])),
                                             float(pick["step_s"]))], inline)
    return [header(f"{name} (AMD, {run.name})", every, chosen), line(f"pick {pick['knob']}", every, chosen, point)]


if __name__ == "__main__":
    for name in ("cnn", "mixture", "normmix", "separable", "window"):
        print("\n".join(stored(name)), flush=True)
    for name in ("cnn", "mixture", "normmix", "separable", "window", "gpt", "gpt2_hf", "gru", "densenet"):
        print("\n".join(compare_run(name, f"{name}_a301c48_w2")), flush=True)
    for name, run in (("separable", "separable_5b19884"), ("separable", "separable_806fea8"),
                      ("separable", "separable_3fa5542"),
                      ("densenet", "densenet_6ec12ec"), ("densenet", "densenet_806fea8")):
        print("\n".join(compare_run(name, run)), flush=True)
    sys.exit(0)
