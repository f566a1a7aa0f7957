"""How far the compiled model held in each compare run of this folder (issue 34, item 1), from its compare.csv and
finalists.csv: each timed compiled row's measured step time against the time its model predicted (within 10 %?),
and its metered peak against the peak of the programs inductor generated for it (within 5 %?), apart for
torch.compile's partitions and gaswap's policies (finalists of both rounds and the picks, each timing a row).
Run from the repository root:
    python results/compare_time/model_errors.py results/compare_time/*_one_finalist results/compare_time/*_partitions
"""
import csv
import statistics
import sys
from pathlib import Path


def rows_of(folder: Path) -> list[dict]:
    rows = list(csv.DictReader((folder / "compare.csv").open()))
    if (folder / "finalists.csv").exists():
        rows += list(csv.DictReader((folder / "finalists.csv").open()))
    return [r for r in rows if r["method"] != "eager" and r["predicted_step_s"]]


def summary(rows: list[dict]) -> str:
    times = [float(r["step_s"]) / float(r["predicted_step_s"]) - 1 for r in rows]
    peaks = [float(r["peak_bytes"]) / float(r["program_peak_bytes"]) - 1 for r in rows if r["program_peak_bytes"]]
    return (f"time {sum(abs(e) <= 0.10 for e in times)}/{len(times)} within 10 % (median |error| "
            f"{statistics.median(map(abs, times)):.1%}, worst {max(times, key=abs):+.1%}); peak "
            f"{sum(abs(e) <= 0.05 for e in peaks)}/{len(peaks)} within 5 % (worst {max(peaks, key=abs):+.1%})")


for folder in map(Path, sys.argv[1:]):
    rows = rows_of(folder)
    print(f"{folder.name}:\n  torch.compile: {summary([r for r in rows if r['method'] == 'torch.compile'])}"
          f"\n  gaswap:        {summary([r for r in rows if r['method'] == 'gaswap'])}")
