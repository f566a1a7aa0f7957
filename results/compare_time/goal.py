"""Issue 34, item 2's goal, read from stored compare runs: at every torch.compile budget, a policy of gaswap's own
search (not a torch partition read back) at least 3 % faster at an equal or lower peak, or at least 10 % smaller
at equal time (no slower by the medians); and a point at 0.8 x torch's lowest peak
within 10 % of that torch point's time. Peaks by the allocator meter, times the head to head's CPU medians. Any
gaswap row of the run counts at a budget where its peak is at or under torch's. Run from the repository root:
    python results/compare_time/goal.py results/compare_time/<run> ...
"""
import csv
import sys
from pathlib import Path


def verdicts(folder: Path) -> list[str]:
    with open(folder / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("peak_bytes", "step_s", "step_min", "step_max"):
            r[k] = float(r[k])
    torch_rows = [r for r in rows if r["method"] == "torch.compile"]
    own = [r for r in rows if r["method"] == "gaswap" and r["origin"] in ("", "search")]
    out = []
    for t in torch_rows:
        under = [r for r in own if r["peak_bytes"] <= t["peak_bytes"]]
        faster = [r for r in under if r["step_s"] <= 0.97 * t["step_s"]]
        smaller = [r for r in under if r["peak_bytes"] <= 0.9 * t["peak_bytes"] and r["step_s"] <= t["step_s"]]
        best = min(faster or smaller or under, key=lambda r: r["step_s"], default=None)
        said = "none of gaswap's own at or under its peak" if best is None else (
            f"{best['step_s'] / t['step_s'] - 1:+.1%} at {1 - best['peak_bytes'] / t['peak_bytes']:.1%} less memory")
        out.append(f"torch {t['knob']}: {'met' if faster or smaller else 'not met'} ({said})")
    lowest = min(torch_rows, key=lambda r: r["peak_bytes"])
    below = [r for r in own if r["peak_bytes"] <= 0.8 * lowest["peak_bytes"]]
    best = min(below, key=lambda r: r["step_s"], default=None)
    out.append("0.8x: " + ("none" if best is None else
                           f"{'met' if best['step_s'] <= 1.1 * lowest['step_s'] else 'not met'} "
                           f"({best['step_s'] / lowest['step_s'] - 1:+.1%} against torch {lowest['knob']})"))
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{Path(arg).name}: " + "; ".join(verdicts(Path(arg))))
