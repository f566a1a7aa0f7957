"""Could compare's calibration drop its last random half? (issue 34, item 3: one compile fewer a compare)

A compare calibrates on torch's three partitions, four set policies and one random half (`step_model.calibrate`,
`PARTITION_MIXES` 1). For each stored run of `inline_consistent.FOLDERS`: the fit on all its points against the
fit without the random half, predicting the half itself (held out by the second) and the head to head's
torch.compile rows and first pick (their measured CPU seconds). No new timing: the runs' points refitted. Run
from the repository root:
    PYTHONPATH=. python results/compiled_model/calibration_without_half.py > results/compiled_model/calibration_without_half.txt
"""
import statistics
import sys

from inline_consistent import (  # this folder's: each stored run on this machine's capture
    FOLDERS,
    RUNS,
    fitted_problem,
    run_of,
)

errors = {"with the half": [], "without": []}
held_out = []
for folder in map(RUNS.joinpath, sys.argv[1:] or FOLDERS):
    run = run_of(folder)
    halves = [p for p in run.points if p[0].startswith("random")]
    if not halves:
        print(f"{folder.name}: no random half among its points")
        continue
    line = []
    for when, points in (("with the half", run.points), ("without", [p for p in run.points if p not in halves])):
        priced = fitted_problem(run, points)
        e = [priced.simulate(c).step_time / s - 1 for _, c, s in run.head]
        errors[when] += [abs(x) for x in e]
        text = f"{when}: fit within {priced.calibration.worst_error():.1%}, " + ", ".join(
            f"{label} {x:+.1%}" for (label, _, _), x in zip(run.head, e))
        if when == "without":
            h = [priced.simulate(c).step_time / s - 1 for _, c, s in halves]
            held_out += [abs(x) for x in h]
            text += "; the half held out " + ", ".join(f"{x:+.1%}" for x in h)
        line.append(text)
    print(f"{folder.name}:\n  " + "\n  ".join(line), flush=True)
for when, e in errors.items():
    print(f"{when}: {sum(x <= 0.10 for x in e)}/{len(e)} within 10 %, median |error| {statistics.median(e):.1%}, "
          f"worst {max(e):.1%}")
print(f"the halves held out: median |error| {statistics.median(held_out):.1%}, worst {max(held_out):.1%}")
