"""gaswap.plan.sharding against torch: FSDPMemTracker under the fake process group (W = 8, three models), the
fake process group with real tensors, and real gloo runs of 2 and 4 processes (slow: each under a minute)."""
import functools
import statistics

import gloo_batch
import pytest
import torch

from gaswap import zoo
from gaswap.plan.sharding import CATEGORIES, ShardSpec, memory_report, shard_step
from gaswap.shard import models
from gaswap.shard.capture import capture_for_sharding

pytestmark = pytest.mark.slow


def _captured(width=256, depth=3, batch=16):
    with torch.device("meta"):
        model = models.block_mlp(width, depth)
    return capture_for_sharding(model, (torch.empty(batch, width, device="meta"),), None, "sum",
                                unit_classes=(models.MLPBlock,))


def _llama_fused():
    model = models.llama()
    for layer in model.layers:
        layer.feed_forward.fused_silu = True  # F.silu, whose eager backward is one silu_backward
    return model


CASES = {
    "mlp": (lambda: models.block_mlp(256, 3), models.MLPBlock, lambda: (torch.randn(16, 256),)),
    "gpt": (lambda: zoo.gpt(1000, 4, 256, 4, 64), lambda m: type(m.blocks[0]),
            lambda: (torch.randint(0, 1000, (4, 64)),)),
    "llama": (_llama_fused, models.DecoderLayer, lambda: (torch.randint(0, 256, (2, 32)),)),
}


def _case(name):
    make_model, unit, make_inputs = CASES[name]
    with torch.device("meta"):
        model = make_model()
    unit = unit if isinstance(unit, type) else unit(model)
    captured, units, params = capture_for_sharding(model, tuple(x.to("meta") for x in make_inputs()), None, "sum",
                                                   unit_classes=(unit,))
    return make_model, make_inputs, captured, units, params


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_category_equals_fsdp_mem_tracker_at_8_ranks(name):
    from gaswap.shard.tracker import measure_fsdp_tracker

    make_model, make_inputs, captured, units, params = _case(name)
    report = memory_report(shard_step(captured.graph, params, ShardSpec(8, tuple(units), optimizer_scalar_bytes=4)),
                           tracker=True)
    tracker = measure_fsdp_tracker(make_model, make_inputs, units, 8, hold_grads=False)
    assert report.peak == tracker["total"]
    for cat in CATEGORIES:
        assert report.at_peak.get(cat, 0) == tracker.get(cat, 0), cat


def test_the_shipped_tracker_holds_the_tied_heads_input_gradient():
    """FSDPMemTracker as torch ships it: its ModTracker's multi-grad hook on zoo.gpt's head (whose forward takes
    the tied embedding weight) keeps the gradient of the head's input (B x T x width float32) until the
    embedding's gradient completes: temporaries one such tensor above the untracked run, nothing else."""
    from gaswap.shard.tracker import measure_fsdp_tracker

    make_model, make_inputs, _, units, _ = _case("gpt")
    untracked = measure_fsdp_tracker(make_model, make_inputs, units, 8, hold_grads=False)
    shipped = measure_fsdp_tracker(make_model, make_inputs, units, 8)
    held = 4 * 64 * 256 * 4
    assert shipped["total"] - untracked["total"] == held
    assert {c: shipped[c] - untracked[c] for c in CATEGORIES if shipped[c] != untracked[c]} == {"temporaries": held}


def test_tracker_with_real_tensors_equals_fake_tensors():
    from gaswap.shard.tracker import measure_fsdp_tracker

    make_model, make_inputs, _, units, _ = _case("mlp")
    fake = measure_fsdp_tracker(make_model, make_inputs, units, 8, hold_grads=False)
    real = measure_fsdp_tracker(make_model, make_inputs, units, 8, hold_grads=False, fake=False)
    assert real == fake


def _gloo_kwargs(record=False):
    _, units, _ = _captured(1024, 4, 64)  # as gaswap.shard.models.mlp_inputs
    return {"model": "gaswap.shard.models:block_mlp", "inputs": "gaswap.shard.models:mlp_inputs", "units": units,
            "steps": 6, "metered": 3, "record": record}


# in the session's launches of 2 and 4 (tests/gloo_batch.py); at 2 the steps are recorded too
gloo_batch.add(2, "test_shard_torch: block_mlp", functools.partial(_gloo_kwargs, record=True))
gloo_batch.add(4, "test_shard_torch: block_mlp", _gloo_kwargs)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_peak_and_resident_per_rank_equal_the_prediction_and_the_fake_process_group(world_size):
    from gaswap.shard.gloo import gloo_peak
    from gaswap.shard.tracker import measure_fake_pg_peak

    captured, units, params = _captured(1024, 4, 64)
    results = gloo_batch.result(world_size, "test_shard_torch: block_mlp")
    assert [r["rank"] for r in results] == list(range(world_size))
    if world_size == 2:  # the recorded steps: 6 losses, the same on every rank
        losses = [r["recorded"]["loss"] for r in results]
        assert len(losses[0]) == 6 and all(torch.equal(torch.stack(a), torch.stack(losses[0])) for a in losses)
        assert all(len(r["recorded"]["grads"]) == len(r["recorded"]["params"]) == 6 for r in results)
    for r in results:
        rank = shard_step(captured.graph, params, ShardSpec(world_size, tuple(units), rank=r["rank"],
                                                            optimizer_scalar_bytes=4))
        start = rank.graph.resident_bytes()
        predicted = gloo_peak(memory_report(rank), rank) - start
        assert r["resident_at_start"] == start
        assert r["peaks_above_start"] == [predicted] * 3  # every metered step, every rank
        fake = measure_fake_pg_peak(lambda: models.block_mlp(1024, 4), models.mlp_inputs, units, world_size,
                                    rank=r["rank"])
        assert fake == {"peak_above_start": predicted, "resident_at_start": start}
        assert r["fwd_bwd_cpu_s"] and statistics.median(r["fwd_bwd_cpu_s"]) > 0


@pytest.mark.parametrize("name, world_size, k", [("gpt", 8, 2), ("gpt", 8, 4), ("llama", 8, 2), ("llama", 64, 8)])
def test_integer_reshard_after_forward_equals_fsdp_mem_tracker(name, world_size, k):
    """reshard_after_forward=k on every unit (the root too): the post-forward slices (FSDPParam's
    `_sharded_post_forward_param_data`, the tracker's activations) and the backward all-gather over k ranks."""
    from gaswap.shard.tracker import measure_fsdp_tracker

    make_model, make_inputs, captured, units, params = _case(name)
    spec = ShardSpec(world_size, tuple(units), reshard_after_forward=k, optimizer_scalar_bytes=4)
    report = memory_report(shard_step(captured.graph, params, spec), tracker=True)
    tracker = measure_fsdp_tracker(make_model, make_inputs, units, world_size, reshard_after_forward=k,
                                   hold_grads=False)
    assert report.peak == tracker["total"]
    for cat in CATEGORIES:
        assert report.at_peak.get(cat, 0) == tracker.get(cat, 0), cat


@pytest.mark.parametrize("name, mesh", [("gpt", (2, 4)), ("gpt", (8, 8)), ("llama", (4, 2)), ("mlp", (2, 4))])
def test_hsdp_equals_fsdp_mem_tracker_on_a_2d_mesh(name, mesh):
    """HSDP: fully_shard over init_device_mesh("cpu", (replicate, shard)) under the fake process group."""
    from gaswap.shard.tracker import measure_fsdp_tracker

    make_model, make_inputs, captured, units, params = _case(name)
    world = mesh[0] * mesh[1]
    spec = ShardSpec(world, tuple(units), replicate=mesh[0], optimizer_scalar_bytes=4)
    report = memory_report(shard_step(captured.graph, params, spec), tracker=True)
    tracker = measure_fsdp_tracker(make_model, make_inputs, units, world, hold_grads=False, mesh_shape=mesh)
    assert report.peak == tracker["total"]
    for cat in CATEGORIES:
        assert report.at_peak.get(cat, 0) == tracker.get(cat, 0), cat
