"""A stored compare run's calibration read back, shared by the scripts of this folder that refit it (`base_floor.py`,
`plain_backward.py`) or price with it (`next_to_torch.py`, `below_torch.py`): a run folder holds its cost cache
`costs/`, a compared policy `p00.yaml` (whose provenance holds the calibration and its measured points) and
`compare.csv`."""
import csv
from pathlib import Path
from typing import NamedTuple

import yaml

from gaswap.base import config
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import partition, step_model
from gaswap.run.measure import measure


def calibration_of(policy_file: str | Path) -> step_model.Calibration:
    """The calibration a compared policy was priced by, from its provenance (`Calibration.to_dict`; a run made
    before the layout term has no `plain_backward_s`: 0)."""
    c = yaml.safe_load(open(policy_file))["provenance"]["calibration"]
    return step_model.Calibration(c["base_s"], c["scale"], c["extern_scale"], c["mask_s_per_byte"],
                                  c["saved_s_per_byte"], peak_offset=c["peak_offset_bytes"],
                                  inline_recomputed=c["inline_recomputed"], plain_rate=c.get("plain_backward_s", 0.0))


class StoredRun(NamedTuple):
    """The calibration's points (`step_model.samples`, in the terms of the code at hand), the run's pick `p00` as
    one more point where it is the search's own (measured in the head to head, not fitted on; else none), the
    step's library calls' standalone seconds (`step_model.library_seconds`) and the measured seconds by label."""
    points: list
    held: list
    floor: float
    measured: dict


def experiment_of(folder: Path) -> Path:
    """The experiment file of a run folder `<name>` or `<name>_<commit>`: `<name>.yaml` beside it, else the shipped
    `experiments/compare_<name>_cpu.yaml`."""
    name = folder.name if (folder.parent / f"{folder.name}.yaml").exists() else folder.name.rsplit("_", 1)[0]
    beside = folder.parent / f"{name}.yaml"
    return beside if beside.exists() else Path(f"experiments/compare_{name}_cpu.yaml")


def read(folder: Path, traced: dict) -> StoredRun:
    """`folder`'s run as a `StoredRun`, its experiment captured on this machine with torch's three partitions read
    back as the compare calibrated on them (`traced`: experiment file -> (device, graph, partitions), filled here)."""
    path = experiment_of(folder)
    exp = config.load_experiment(path)
    if path not in traced:
        device, model, inputs, _, graph = compiled_methods.setup(exp)
        _, actions = partition.torch_partitions(model, *inputs, budgets=(1.0, 0.5, 0.2), optimizer=exp.optimizer,
                                                counted=exp.counts)
        traced[path] = device, graph, {f"torch {b:g}": a for b, a in actions.items()}
    device, graph, partitions = traced[path]
    costs = measure(graph, device, folder / "costs", threads=exp.costs.threads)
    policy = yaml.safe_load((folder / "p00.yaml").read_text())
    calibration = policy["provenance"]["calibration"]
    measured = {label: seconds for label, seconds, _ in calibration["points"]}
    problem, chosen = step_model.calibration_set(graph, costs, exp.loss, partitions)
    inline = calibration["inline_recomputed"]
    points = step_model.samples(problem, [(label, c, measured[label]) for label, c in chosen.items()
                                          if label in measured], inline)
    rows = list(csv.DictReader((folder / "compare.csv").open()))
    pick = next((r for r in rows if r["method"] == "gaswap" and r["knob"] == policy["provenance"]["budget"]
                 and r["origin"] in ("", "search")), None)
    held = [] if pick is None else step_model.samples(
        problem, [("pick", problem.canonical(problem.encoding.read_back(policy["actions"])), float(pick["step_s"]))],
        inline)
    return StoredRun(points, held, step_model.library_seconds(graph, costs), measured)
