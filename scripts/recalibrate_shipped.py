"""Shipped compiled policies on the machine at hand: their step time as predicted where they were made, and as
predicted by the compiled model timed again here (`validate_compiled.recalibrated`), each against the time
measured here beside the calibration (the same rotated rounds, the same load).

    PYTHONPATH=. python scripts/recalibrate_shipped.py results/compare_cnn_cpu results/compare_mixture_cpu \
        [--out results/compiled_model/recalibrated.csv]

One calibration per results folder prices all its policies (`compiled/pNN.yaml`). Prints a table and the CPU
and wall seconds each folder's recalibration took; with `--out`, writes the rows as CSV. Use a fresh
`TORCHINDUCTOR_CACHE_DIR` to time it as a user's first run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gaswap.app.validate_compiled import recalibrated
from gaswap.base import config
from gaswap.base.files import csv_text, write_atomic
from gaswap.compiled.methods import setup
from gaswap.plan import policy as policies
from gaswap.run.measure import device_name, load_per_cpu

COLUMNS = ("experiment", "policy", "planned_device", "device", "shipped_predicted_s", "recalibrated_predicted_s",
           "measured_s", "shipped_error", "recalibrated_error", "worst_fit", "load_per_cpu", "cpu_s", "wall_s")


def folder_rows(folder: Path) -> list[dict]:
    """One row per compiled policy of a `gaswap compare` results folder, all priced by one calibration here."""
    paths = sorted(folder.glob("compiled/p[0-9]*.yaml"))
    loaded = [policies.load(p) for p in paths]
    exp = config.load_experiment(loaded[0].provenance["experiment_file"])
    device, model, inputs, target, graph = setup(exp)
    load = load_per_cpu()
    again = recalibrated(loaded, exp, graph, device, model, inputs, target, lambda line: None)
    load = max(load, load_per_cpu())
    rows = []
    for path, policy, r in zip(paths, loaded, again):
        shipped, measured = policy.predicted["step_time_s"], r["measured_beside_s"]
        rows.append({"experiment": exp.name, "policy": path.name, "planned_device": policy.provenance.get("device"),
                     "device": device_name(device), "shipped_predicted_s": shipped,
                     "recalibrated_predicted_s": r["step_time_s"], "measured_s": measured,
                     "shipped_error": shipped / measured - 1, "recalibrated_error": r["step_time_s"] / measured - 1,
                     "worst_fit": r["worst_fit"], "load_per_cpu": round(load, 2), "cpu_s": r["cpu_s"],
                     "wall_s": r["wall_s"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for folder in args.folders:
        done = folder_rows(folder)
        rows += done
        for r in done:
            print(f"{r['experiment']:<18} {r['policy']:<9} shipped {r['shipped_predicted_s'] * 1e3:7.1f} ms "
                  f"({r['shipped_error']:+7.1%})  recalibrated {r['recalibrated_predicted_s'] * 1e3:7.1f} ms "
                  f"({r['recalibrated_error']:+6.1%})  measured {r['measured_s'] * 1e3:7.1f} ms", flush=True)
        print(f"  {done[0]['experiment']}: recalibration {done[0]['cpu_s']:.0f} CPU s, {done[0]['wall_s']:.0f} s wall, "
              f"fit within {done[0]['worst_fit']:.1%} on its points, load {done[0]['load_per_cpu']:.2f} per CPU",
              flush=True)
    if args.out:
        write_atomic(args.out, csv_text(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
