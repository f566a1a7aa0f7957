"""`gaswap memory` (gaswap.app.gpu_memory_report): budgets resolved as the search resolves them."""
from test_allocator_search import EXPERIMENT

from gaswap.app import gpu_memory_report, workflow
from gaswap.base import config


def test_a_fraction_budget_is_of_keep_all_on_the_device_and_baselines_fit_it_less_the_margin(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.replace("budget: 0.8x", "budget: 0.9x"))  # a baseline fits 0.9x less the margin
    prepared = workflow.prepare(config.load_experiment(path))
    keep = workflow.planning_problem(prepared).keep_all().peak_bytes
    kept = workflow.device_margin(prepared).margin_bytes
    assert kept > 0  # the V100's workspace: the fraction is of more than the graph's peak
    budget, planned = gpu_memory_report.budgets(prepared)
    assert budget == int(0.9 * (keep + kept)) and planned == budget - kept
    rows = gpu_memory_report.rows(prepared, tmp_path)
    assert rows[0].policy == "keep-all" and len(rows) == 2  # keep-all, the fastest baseline that fits
    assert all(r.budget == budget for r in rows) and rows[1].live <= planned < rows[0].live
