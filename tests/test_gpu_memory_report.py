"""`gaswap memory` (gaswap.app.gpu_memory_report): budgets resolved as the search resolves them."""
from gaswap.app import gpu_memory_report, workflow
from gaswap.base import config

EXPERIMENT = """
model: {factory: gaswap.zoo:tiny_cnn, kwargs: {num_classes: 10, width: 16}}
inputs: [{shape: [batch, 3, 32, 32]}]
target: {shape: [batch], dtype: int64, high: 10}
loss: cross_entropy
batch_size: 128
budget: 0.9x
costs: {source: estimate, profile: v100-pcie-16gb}
"""


def test_a_fraction_budget_is_of_keep_all_on_the_device_and_baselines_fit_it_less_the_margin(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    prepared = workflow.prepare(config.load_experiment(path))
    keep = workflow.planning_problem(prepared).keep_all().peak_bytes
    kept = workflow.device_margin(prepared).margin_bytes
    assert kept > 0  # the V100's workspace: the fraction is of more than the graph's peak
    budget, planned = gpu_memory_report.budgets(prepared)
    assert budget == int(0.9 * (keep + kept)) and planned == budget - kept
    rows = gpu_memory_report.rows(prepared, tmp_path)
    assert [r.policy for r in rows][0] == "keep-all" and len(rows) == 2  # keep-all, the fastest baseline that fits
    assert all(r.budget == budget for r in rows) and rows[1].live <= planned < rows[0].live
