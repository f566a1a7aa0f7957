"""The compiled time fit with its base bounded below by the step's library calls (`step_model.fit`'s floor,
`step_model.library_seconds`) and without (issue 34, item 1). For each stored compare run named (a folder of
results/compare_time/ with its cost cache `costs/` and a compared policy `p00.yaml`, whose provenance holds the
calibration's measured points): the calibration points' features on this machine's capture of the experiment
(torch's three partitions read back, as the compare calibrated on them), both fits' base and terms, their worst
error in sample, each point predicted by the fit on the others (worst, median), and the run's pick `p00` where it
is the search's own (measured in the head to head, not fitted on). No timing: the runs' measured seconds refitted.
base_floor.txt was made at 55fd258, before the fifth term (`plain_backward.py`); at later code both fits may take
that term too. Run from the repository root:
    PYTHONPATH=. python results/compiled_model/base_floor.py <run> ... > results/compiled_model/base_floor.txt
"""
import statistics
import sys
from pathlib import Path

import stored_run
from gaswap.compiled import step_model

RUNS = Path("results/compare_time")


def main(runs: list[str]) -> None:
    traced = {}  # `stored_run.read`'s
    errors = {"unbounded": [], "floor": []}
    for run in runs:
        points, held, floor, measured = stored_run.read(RUNS / run, traced)
        print(f"{run}: library calls {floor * 1e3:.2f} ms standalone, keep-all measured "
              f"{measured.get('keep-all', float('nan')) * 1e3:.2f} ms")
        for kind, bound in (("unbounded", 0.0), ("floor", floor)):
            fitted = step_model.fit(points, bound)
            inside = [fitted.predict(p) / p[-1] - 1 for p in points]
            left_out = [step_model.fit(points[:k] + points[k + 1:], bound).predict(p) / p[-1] - 1
                        for k, p in enumerate(points)]
            picked = [fitted.predict(p) / p[-1] - 1 for p in held]
            errors[kind] += [("left out", e) for e in left_out] + [("pick", e) for e in picked]
            print(f"  {kind:9s} base {fitted.base * 1e3:6.2f} ms, terms {', '.join(fitted.terms) or 'none'}; in sample "
                  f"worst {max(map(abs, inside)):.1%}; left out worst {max(map(abs, left_out)):.1%}, median "
                  f"{statistics.median(map(abs, left_out)):.1%}" + "".join(f"; pick {e:+.1%}" for e in picked),
                  flush=True)
    for kind, found in errors.items():
        for what in ("left out", "pick"):
            e = [abs(x) for w, x in found if w == what]
            print(f"{kind}, {what}: {sum(x <= 0.10 for x in e)} of {len(e)} within 10 %, median "
                  f"{statistics.median(e):.1%}, worst {max(e):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
