"""Searching against the caching allocator model's reserved peak (an experiment's `memory` key): what the
results report, and that it is what the model gives for the policies written."""
import csv
import json

import pytest

from gaswap.app import results, workflow
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.plan.memory import allocator

EXPERIMENT = """
model: {factory: gaswap.zoo:tiny_cnn, kwargs: {num_classes: 10, width: 16}}
inputs: [{shape: [batch, 3, 32, 32]}]
target: {shape: [batch], dtype: int64, high: 10}
loss: cross_entropy
batch_size: 128
budget: 0.8x
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 16, generations: 4}
"""


def search(tmp_path, memory: str):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT + memory)
    exp = config.load_experiment(path)
    prepared = workflow.prepare(exp)
    out = tmp_path / "results" / "exp"
    workflow.run_search(prepared, out)
    return exp, prepared, out, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("target", ["reserved", "live"])
def test_results_give_live_allocated_and_reserved_and_the_budget_bounds_the_target(tmp_path, target):
    exp, prepared, out, summary = search(tmp_path, f"memory: {{target: {target}}}\n")
    assert summary["memory"] == {"target": target, "expandable_segments": False}
    keep = summary["keep_all"]
    assert keep["peak_bytes"] == keep[f"{target}_bytes"]  # the budget's fraction is of the keep-all target peak
    assert keep["live_bytes"] < keep["reserved_bytes"]  # 2 MiB and 20 MiB segments: reserved is above live here
    kept = summary["device_margin"]["kept_bytes"]  # a fraction of keep-all's peak on the device, the margin kept
    assert kept > 0 and summary["budget_bytes"] == int(0.8 * (keep[f"{target}_bytes"] + kept))
    assert summary["planning_budget_bytes"] == summary["budget_bytes"] - kept
    rows = list(csv.DictReader(open(out / "front.csv")))
    assert rows and list(rows[0]) == [*results.FRONT_COLUMNS, *results.MEMORY_COLUMNS]
    options = workflow.allocator_options(exp)
    for row in rows:
        live, allocated, reserved = (int(row[k]) for k in results.MEMORY_COLUMNS)
        assert int(row["peak_bytes"]) == {"live": live, "reserved": reserved}[target] <= summary["planning_budget_bytes"]
        assert live <= allocated <= reserved
        policy = policies.load(out / row["policy"], prepared.graph)
        assert policy.predicted["reserved_bytes"] == reserved
        # the policy's own program, replayed through the model, gives what the search evaluated
        assert allocator.replay(prepared.graph, policy, **options).reserved == reserved
    best = summary["best"]
    assert set(results.MEMORY_COLUMNS) <= set(best) and best["peak_bytes"] == best[f"{target}_bytes"]


def test_without_the_memory_key_results_are_live_bytes_only(tmp_path):
    _, _, out, summary = search(tmp_path, "")
    assert "memory" not in summary and "reserved_bytes" not in summary["keep_all"]
    assert list(csv.DictReader(open(out / "front.csv")))[0].keys() == set(results.FRONT_COLUMNS)


def test_the_memory_key_is_checked(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT + "memory: {target: reservd}\n")
    with pytest.raises(config.ConfigError, match=r"exp.yaml: memory.target: must be one of live, reserved, got "
                                                 r"'reservd' \(did you mean 'reserved'\?\)"):
        config.load_experiment(path)
    path.write_text(EXPERIMENT + "memory: {expandable_segments: yes please}\n")
    with pytest.raises(config.ConfigError, match=r"memory.expandable_segments: must be true or false"):
        config.load_experiment(path)
    path.write_text(EXPERIMENT + "memory: {expandable_segments: true}\n")
    exp = config.load_experiment(path)
    assert exp.memory == config.MemorySpec("live", True)
    assert workflow.allocator_options(exp)["expandable_segments"] is True
