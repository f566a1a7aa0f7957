"""The compiled time fit with and without its term for a backward that recomputes no convolution (issue 34, item 1;
`step_model.CompiledProblem.plain_backward`, `Calibration.plain_rate`). For each stored compare run named (a folder
with its cost cache `costs/` and a compared policy `p00.yaml`, whose provenance holds the calibration's measured
points; the experiment file beside it, else experiments/compare_<name>_cpu.yaml): the calibration points' terms on
this machine's capture (torch's three partitions read back, as the compare calibrated on them), then the fit with
the term and without it (the same points, the term left out), each with its terms, worst error in sample, each
point predicted by the fit on the others (worst, median), and the run's pick `p00` where it is the search's own.
No timing: the runs' measured seconds refitted. Run from the repository root:
    PYTHONPATH=. python results/compiled_model/plain_backward.py <folder> ... > results/compiled_model/plain_backward.txt
"""
import statistics
import sys
from pathlib import Path

import stored_run
from gaswap.compiled import step_model


def main(folders: list[str]) -> None:
    errors = {"with the term": [], "without": []}
    traced = {}  # `stored_run.read`'s
    for folder in map(Path, folders):
        points, held, floor, _ = stored_run.read(folder, traced)
        print(f"{folder.name}: plain backward (1 = no convolution recomputed) "
              + ", ".join(f"{p[0]} {p[5]:g}" for p in points + held))
        for kind, strip in (("with the term", False), ("without", True)):
            def shown(p):
                return (p[0], *p[1:5], p[-1]) if strip else p
            pts = [shown(p) for p in points]
            fitted = step_model.fit(pts, floor)
            inside = [fitted.predict(p) / p[-1] - 1 for p in pts]
            left_out = [step_model.fit(pts[:k] + pts[k + 1:], floor).predict(p) / p[-1] - 1 for k, p in enumerate(pts)]
            picked = [fitted.predict(shown(p)) / p[-1] - 1 for p in held]
            errors[kind] += [("in sample", e) for e in inside] + [("left out", e) for e in left_out] + [
                ("pick", e) for e in picked]
            print(f"  {kind:13s} terms {', '.join(fitted.terms) or 'none'}"
                  + (f" (plain {fitted.plain_rate * 1e3:.2f} ms)" if "plain" in fitted.terms else "")
                  + f"; in sample worst {max(map(abs, inside)):.1%}; left out worst {max(map(abs, left_out)):.1%}, "
                  f"median {statistics.median(map(abs, left_out)):.1%}" + "".join(f"; pick {e:+.1%}" for e in picked),
                  flush=True)
    for kind, found in errors.items():
        for what in ("in sample", "left out", "pick"):
            e = [abs(x) for w, x in found if w == what]
            print(f"{kind}, {what}: {sum(x <= 0.10 for x in e)} of {len(e)} within 10 %, median "
                  f"{statistics.median(e):.1%}, worst {max(e):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
