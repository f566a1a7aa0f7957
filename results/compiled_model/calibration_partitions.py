"""Could torch's partitions stand in for compare's random calibration halves? (issue 34, item 3)

`gaswap compare` compiles and times torch.compile's three partitions anyway. For each run folder of
results/compare_time/*_one_finalist/ (its cost cache `costs/`, a compared policy `p00.yaml` whose provenance holds
the calibration's measured points, and compare.csv with torch's partitions' times): the compiled model fitted on
the four set calibration policies, the first random half and torch's three partitions (read back on this
machine's capture), and the two other random halves predicted by it; beside that, the seven-point fit of the run
predicting torch's partitions. torch's times come from the run's head to head, the halves' from its calibration
rounds: minutes apart in one process, so part of each error is the machine's drift between them. Run from the
repository root:
    PYTHONPATH=. python results/compiled_model/calibration_partitions.py > results/compiled_model/calibration_partitions.txt
"""
import csv
import statistics

from calibration_loo import (  # this folder's: each run's capture, problem and measured points
    predict,
    run_of,
)

from gaswap.compiled import partition, step_model

errors = []
for name in ("mixture", "cnn", "gpt", "window", "densenet"):
    folder, exp, model, inputs, problem, chosen, measured = run_of(name)
    timed = {r["knob"]: float(r["step_s"]) for r in csv.DictReader((folder / "compare.csv").open())
             if r["method"] == "torch.compile"}
    torch_points = []
    for budget in ("1", "0.5", "0.2"):
        _, actions = partition.torch_partition(model, *inputs, budget=float(budget), optimizer=exp.optimizer,
                                               counted=exp.counts)
        torch_points.append((f"torch {budget}", problem.canonical(problem.encoding.read_back(actions)), timed[budget]))
    calibration = [(label, chosen[label], measured[label]) for label in chosen if label in measured]
    halves = [p for p in calibration if p[0].startswith("random")]
    kept = [p for p in calibration if not p[0].startswith("random")] + halves[:1] + torch_points
    fitted = step_model.fit(step_model.samples(problem, kept))
    seven = step_model.fit(step_model.samples(problem, calibration))
    left = [predict(fitted, p) / p[-1] - 1 for p in step_model.samples(problem, halves[1:])]
    errors += [abs(e) for e in left]
    on_torch = [predict(seven, p) / p[-1] - 1 for p in step_model.samples(problem, torch_points)]
    print(f"{name}: {len(kept)} points (set, half 1, torch's 3) predict halves 2, 3: "
          + ", ".join(f"{e:+.1%}" for e in left) + f"; in-sample worst {fitted.worst_error():.1%}"
          + f" | the run's {len(calibration)}-point fit on torch 1 / 0.5 / 0.2: " + ", ".join(f"{e:+.1%}" for e in on_torch))
print(f"halves predicted within {min(errors):.1%} to {max(errors):.1%}, median {statistics.median(errors):.1%}")
