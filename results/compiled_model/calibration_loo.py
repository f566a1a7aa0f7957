"""Leave-one-out on `gaswap compare`'s calibration points (issue 34, item 3: could fewer calibration policies do?).

For each run folder of results/compare_time/*_one_finalist/ (its cost cache `costs/` and a compared policy
`p00.yaml`, whose provenance holds the calibration's measured points): the calibration policies' features on this
machine's capture of the experiment, the fit on all points, each point predicted by the fit on the others, and the
random halves predicted by fits without 1, 2 or 3 of them. Run from the repository root:
    PYTHONPATH=. python results/compiled_model/calibration_loo.py > results/compiled_model/calibration_loo.txt
"""
import itertools
import statistics
from pathlib import Path

import yaml

from gaswap.base import config
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import step_model
from gaswap.plan.encoding import Action
from gaswap.run.measure import measure

RUNS = Path("results/compare_time")


def predict(cal, point) -> float:
    return cal.predict(point)


def run_of(name: str) -> tuple:
    """(its folder, the experiment, its model and inputs, the uncalibrated keep/recompute problem on this machine's
    capture priced by the run's cost cache, the calibration policies {label: chromosome}, the seconds measured
    for them {label: s}) of the run of experiment `name` in RUNS/<name>_one_finalist."""
    folder = RUNS / f"{name}_one_finalist"
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, _, graph = compiled_methods.setup(exp)
    costs = measure(graph, device, folder / "costs", threads=exp.costs.threads)
    problem = step_model.CompiledProblem(graph, costs, None, actions=(Action.KEEP, Action.RECOMPUTE), loss=exp.loss)
    measured = {label: m for label, m, _ in yaml.safe_load((folder / "p00.yaml").read_text())
                ["provenance"]["calibration"]["points"]}
    return folder, exp, model, inputs, problem, step_model.calibration_policies(problem), measured


def main() -> None:
    for name in ("mixture", "cnn", "gpt", "window", "densenet"):
        _, _, _, _, problem, chosen, measured = run_of(name)
        labels = [label for label in chosen if label in measured]
        points = step_model.samples(problem, [(label, chosen[label], measured[label]) for label in labels])
        full = step_model.fit(points)
        loo = [predict(step_model.fit(points[:i] + points[i + 1:]), p) / p[-1] - 1 for i, p in enumerate(points)]
        worst = max(abs(predict(full, p) / p[-1] - 1) for p in points)
        print(f"{name}: {len(points)} points, in-sample worst {worst:.1%}; each left out: " + ", ".join(f"{label} {e:+.1%}" for label, e in zip(labels, loo)))
        mixes = [i for i, label in enumerate(labels) if label.startswith("random")]
        for drop in range(1, len(mixes) + 1):
            errors = []
            for gone in itertools.combinations(mixes, drop):
                fitted = step_model.fit([p for i, p in enumerate(points) if i not in gone])
                errors += [abs(predict(fitted, points[i]) / points[i][5] - 1) for i in gone]
            print(f"  without {drop} random half(s): the dropped predicted within {statistics.median(errors):.1%} "
                  f"(median), {max(errors):.1%} (worst)")


if __name__ == "__main__":
    main()
