"""gaswap.shard.sac_milp: torch's sac_milp fed gaswap's statistics, on the hand-made three-unit step of
test_shard_search (skipped where pulp or pwlf is not installed)."""
import pytest

from gaswap.shard import sac_milp

pytestmark = pytest.mark.skipif(sac_milp.available() is not None, reason="pulp / pwlf not installed")

from test_shard_search import UNITS, problem  # noqa: E402


def test_block_statistics_are_the_graphs():
    p = problem()
    saved = sac_milp.saved_by_forward(p.graph)
    stats = sac_milp.sac_stats(p, "layers.1", saved)
    assert stats.func_names == ["aten.mm.default", "aten.relu.default"]
    assert stats.memory == [64, 256] and stats.runtimes == [1.0, 1.0]  # bytes created; ms
    assert stats.saved_autograd_ops == [0, 1] and stats.rand_ops == [] and stats.view_like_ops == []
    graph = sac_milp.module_graph(p, {u: sac_milp.sac_stats(p, u, saved) for u in UNITS}, saved)
    root, *blocks = graph.nodes
    assert root["param_per_module"] == 3 * 128 and [b["fqn"] for b in blocks] == [f"Model.{u}" for u in UNITS]
    assert [b["grad_total"] for b in blocks] == [256, 128, 0]  # the later units' gradients come first
    assert [b["act_total"] for b in blocks] == [320 + 256, 640 + 256, 960 + 256]
    assert graph.fw_post_order[-1] == "Model" and graph.ad_matrix[0][3] == 1 and graph.ad_matrix[1][2] == 0


def test_plans_fit_the_budget_or_say_none():
    p = problem()
    keep, full = (p.evaluate(p.seed(s)) for s in ("keep_all", "full_ac"))
    knobs, info = sac_milp.plan(p, keep.peak)
    assert knobs.recompute == {} and info["solves"] == 1  # nothing to discard at keep-all's peak
    knobs, info = sac_milp.plan(p, full.peak)
    assert knobs is not None and knobs.recompute
    assert sac_milp.peak_bytes(p.rank(knobs)) <= full.peak < keep.peak  # by gaswap's simulator, as every method
    assert info["solves"] > 1 and info["milp_peak_bytes"] > 0
    assert sac_milp.plan(p, full.peak - 1)[0] is None  # nothing below full AC without offload
