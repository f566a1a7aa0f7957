"""Could a different fit of the memory side fix the compiled model's peaks? (issue 34, items 1 and 2)

On the stored measurements of `measured/` (each policy's actions and metered peak; `scripts/compiled_model_errors.py`
made them), each policy simulated with the recomputed values inductor inlines taking no memory ("raw inline") and
held ("raw held"), and the memory side fitted on the calibration policies' peaks alone in five ways: the model's
(`step_model.fit_peaks`: the simulation nearer on average, offset by the median residual: V0), the same with the
offset kept at 0 or more (V0c), a blend of the two simulations with its weight chosen on a grid (V1) or by
weighted least squares (V3), each offset by the median residual; or the model's simulation offset by the residual
of the calibration policy whose simulated peak is nearest (V4), or scaled and offset (a x simulated + b, least
squares on relative errors: V5). Judged on torch's partitions and gaswap's picks (held out). Run from the repository root:
    PYTHONPATH=. python results/compiled_model/peak_variants.py cnn separable window mixture normmix > results/compiled_model/peak_variants.txt
"""
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "scripts")
from compiled_model_errors import _chromosome, _setup

from gaswap.compiled import step_model

OUT = Path("results/compiled_model")


def simulated(name: str) -> list[tuple[str, int, int, int]]:
    """(kind, measured peak, simulated peak inlined, simulated peak held), above resident, per stored policy."""
    exp, _, _, _, _, graph, costs, space = _setup(f"experiments/compare_{name}_cpu.yaml", OUT)
    with open(OUT / "measured" / f"compare_{name}_cpu.csv") as f:
        stored = list(csv.DictReader(f))
    inline, held = (step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, inline_recomputed=m)
                    for m in (True, False))
    resident = inline.fused.resident_bytes()
    rows = []
    for r in stored:
        c = inline.canonical(_chromosome(inline, r["actions"]))
        rows.append((r["kind"], int(r["peak_bytes"]), inline.simulate(c).peak_bytes - resident,
                     held.simulate(c).peak_bytes - resident))
    return rows


def blended(rows, weight: float) -> tuple[float, float]:
    """(the median offset, mean |relative error|) of `weight` x held + (1 - weight) x inlined on `rows`."""
    offset = float(np.median([m - (i + weight * (h - i)) for _, m, i, h in rows]))
    return offset, float(np.mean([abs((i + weight * (h - i) + offset) / m - 1) for _, m, i, h in rows]))


def variants(cal) -> dict:
    """name -> (weight of the held simulation, offset), each fitted on the calibration policies `cal`."""
    chosen = min((blended(cal, w) + (w,) for w in (0.0, 1.0)), key=lambda x: x[1])  # V0: the model's
    grid = min((blended(cal, w) + (w,) for w in np.linspace(0, 1, 21)), key=lambda x: x[1])
    a = np.array([[h - i, 1.0] for _, _, i, h in cal]) / np.array([[m] for _, m, _, _ in cal])
    y = np.array([(m - i) / m for _, m, i, _ in cal])
    wls = float(np.clip(np.linalg.lstsq(a, y, rcond=None)[0][0], 0, 1))
    return {"V0 choose+median": (chosen[2], chosen[0]), "V0c choose+median>=0": (chosen[2], max(0.0, chosen[0])),
            "V4 choose+nearest": (chosen[2], ("nearest", cal)), "V5 choose+affine": (chosen[2], ("affine", cal)),
            "V1 blend+median": (grid[2], grid[0]), "V3 wls blend": (wls, blended(cal, wls)[0]),
            "raw inline": (0.0, 0.0), "raw held": (1.0, 0.0)}


def predicted(weight: float, offset, i: int, h: int) -> float:
    """A policy's peak by `weight` x held + (1 - weight) x inlined, plus `offset`: a number, or ("nearest", cal):
    the residual of the calibration policy whose simulated peak (the same blend) is nearest, or ("affine", cal):
    a x simulated + b fitted by least squares on the calibration policies' relative errors."""
    s = i + weight * (h - i)
    if not isinstance(offset, tuple):
        return s + offset
    how, cal = offset
    sims = [(ci + weight * (ch - ci), m) for _, m, ci, ch in cal]
    if how == "nearest":
        near = min(sims, key=lambda x: abs(x[0] - s))
        return s + near[1] - near[0]
    a = np.array([[x, 1.0] for x, _ in sims]) / np.array([[m] for _, m in sims])
    coef = np.linalg.lstsq(a, np.ones(len(sims)), rcond=None)[0]
    return coef[0] * s + coef[1]


def main(names) -> None:
    held_out = {}
    for name in names:
        rows = simulated(name)
        cal = [r for r in rows if r[0] == "calibration"]
        fitted = variants(cal)
        print(f"{name}: " + "; ".join(f"{v} held weight {w:.2f}, offset {o / 1e6:+.2f} MB" for v, (w, o) in fitted.items()
                                      if v.startswith("V") and not isinstance(o, tuple)))
        for v, (w, o) in fitted.items():
            errors = [predicted(w, o, i, h) / m - 1 for _, m, i, h in rows if _ != "calibration"]
            own = [predicted(w, o, i, h) / m - 1 for _, m, i, h in cal]
            held_out.setdefault(v, []).extend(errors)
            print(f"  {v:22s} held out: mean |e| {np.mean(np.abs(errors)):.1%}, worst {max(errors, key=abs):+.1%}, "
                  f"within 5 % {sum(abs(e) <= .05 for e in errors)}/{len(errors)} | calibration worst "
                  f"{max(own, key=abs):+.1%}", flush=True)
    print("all experiments, held out:")
    for v, e in held_out.items():
        print(f"  {v:22s} mean |e| {np.mean(np.abs(e)):.1%}, median {np.median(np.abs(e)):.1%}, worst "
              f"{max(e, key=abs):+.1%}, within 5 % {sum(abs(x) <= .05 for x in e)}/{len(e)}, within 10 % "
              f"{sum(abs(x) <= .1 for x in e)}/{len(e)}")


if __name__ == "__main__":
    main(sys.argv[1:])
