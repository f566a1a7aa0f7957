"""gaswap.plan.sharding against torch: FSDPMemTracker under the fake process group (W = 8) and a real gloo run
of 2 processes (slow: each under a minute)."""
import pytest
import torch

from gaswap.plan.sharding import CATEGORIES, ShardSpec, memory_report, shard_step
from gaswap.shard import models
from gaswap.shard.capture import capture_for_sharding

pytestmark = pytest.mark.slow


def _captured(width=256, depth=3, batch=16):
    with torch.device("meta"):
        model = models.block_mlp(width, depth)
    return capture_for_sharding(model, (torch.empty(batch, width, device="meta"),), None, "sum",
                                unit_classes=(models.MLPBlock,))


def test_every_category_equals_fsdp_mem_tracker_at_8_ranks():
    from gaswap.shard.tracker import measure_fsdp_tracker

    captured, units, params = _captured()
    report = memory_report(shard_step(captured.graph, params, ShardSpec(8, tuple(units), optimizer_scalar_bytes=4)),
                           tracker=True)
    tracker = measure_fsdp_tracker(lambda: models.block_mlp(256, 3), lambda: (torch.randn(16, 256),), units, 8)
    assert report.peak == tracker["total"]
    for cat in CATEGORIES:
        assert report.at_peak.get(cat, 0) == tracker.get(cat, 0), cat


def test_gloo_two_processes_peak_per_rank():
    from gaswap.shard.gloo import run_gloo

    captured, units, params = _captured(1024, 4, 64)  # as gaswap.shard.models.mlp_inputs
    results = run_gloo("gaswap.shard.models:block_mlp", "gaswap.shard.models:mlp_inputs", units, 2, metered=4)
    exact = 0
    for r in results:
        rank = shard_step(captured.graph, params, ShardSpec(2, tuple(units), rank=r["rank"], optimizer_scalar_bytes=4))
        start = rank.graph.resident_bytes()
        assert r["resident_at_start"] == start
        predicted = memory_report(rank).peak - start
        # gloo's worker thread may hold a freed collective buffer a moment longer (a race): never below the
        # prediction, and equal to it on the steps where the race is not lost
        assert min(r["peaks_above_start"]) >= predicted
        exact += predicted in r["peaks_above_start"]
    assert exact >= 1
