"""The sharded pipeline beyond the tiny Llama: the zoo's GPT, a ViT and transformers' GPT-2 (where installed) planned,
applied and run; what torch's checkpoint holds besides the saved activations (its RNG stash, its inputs, selective
checkpointing's storage), on the hand-made two-unit step and against real runs under the fake process group; the
gloo run's inputs from an experiment. Slow: gloo runs, bitwise equal to the same sharded model without the plan."""
import dataclasses
import functools
from pathlib import Path

import gloo_batch
import pytest
import torch
from test_shard_recompute import toy

from gaswap import zoo
from gaswap.app import shard_compare
from gaswap.base import config
from gaswap.plan.sharding import ShardSpec, memory_report, shard_step
from gaswap.run.training import make_optimizer, split_step
from gaswap.shard.apply import PlanMismatch, shard
from gaswap.shard.gloo import checkpoint_rng_bytes, make_batch
from gaswap.shard.tracker import fake_process_group

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
MODELS = {"llama": "llama_tiny_fsdp_gloo", "gpt": "gpt_tiny_fsdp_gloo", "vit": "vit_tiny_fsdp_gloo",
          "gpt2_hf": "gpt2_hf_tiny_fsdp_gloo"}


def _experiment(name):
    if name == "gpt2_hf":
        pytest.importorskip("transformers")
    return config.load_experiment(str(EXPERIMENTS / f"{MODELS[name]}.yaml"))


@functools.cache
def _summed(name):
    exp = _experiment(name)
    return exp, shard_compare.prepare(dataclasses.replace(exp, loss="sum", target=None))


def _prepared(name, world_size=2):
    """(experiment, its loss-`sum` problem at `world_size` with the CPU's checkpoint RNG stash): what a gloo run
    trains and what shard-compare predicts for it."""
    exp, prepared = _summed(name)
    problem = shard_compare.at_world_size(prepared["problem"], world_size, prepared["profile"], None)
    problem.spec = dataclasses.replace(problem.spec, checkpoint_rng_bytes=checkpoint_rng_bytes())
    return exp, problem


def _plan(problem, method):
    return shard_compare.method_plan(problem, shard_compare.method_knobs(problem, method), str(torch.__version__),
                                     method)


# --- the models ---

def test_gpt_blocks_are_gpt_blocks_and_vit_classifies_images():
    gpt = zoo.gpt(64, 2, 16, 2, 8)
    assert [type(b) for b in gpt.blocks] == [zoo.GPTBlock, zoo.GPTBlock]
    assert isinstance(gpt.blocks[0], zoo._Block)  # the same layer as before, so what gpt captures is unchanged
    vit = zoo.vit(image=16, patch=4, width=32, layers=3, heads=2, classes=7)
    assert vit(*zoo.vit_inputs(batch=3, image=16)).shape == (3, 7)
    assert [type(b) for b in vit.blocks] == [zoo.ViTBlock] * 3
    assert vit.pos_embed.shape == (1, 16 + 1, 32)  # 16 patches and the class token
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        zoo.vit(image=30, patch=8)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_plans_one_class_of_identical_blocks(name):
    _, problem = _prepared(name)
    assert len(problem.units) == 2 and problem.classes == [tuple(problem.units)]
    sac = shard_compare.method_knobs(problem, "torchtitan SAC")
    assert sac.recompute and all(c != "full" and c for c in sac.recompute.values())


def test_gloo_inputs_are_the_experiments_and_the_llamas_are_unchanged():
    exp = _experiment("llama")
    args, target = make_batch(shard_compare.gloo_inputs(exp))
    assert len(args) == 1 and torch.equal(args[0], zoo.llama_inputs()[0])  # the tokens earlier runs trained on
    assert target.shape == (2, 32) and target.dtype == torch.int64
    (images,), labels = make_batch(shard_compare.gloo_inputs(_experiment("vit")))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (4,) and int(labels.max()) < 10
    assert make_batch("gaswap.zoo:llama_inputs")[1] is None


def test_a_plan_without_backward_prefetch_is_refused():
    _, problem = _prepared("llama")
    plan = _plan(problem, "full AC") | {"backward_prefetch": 0}
    with fake_process_group(2) as mesh, pytest.raises(PlanMismatch, match="cannot turn backward prefetch off"):
        shard(zoo.llama(preset="tiny"), plan, mesh)


# --- what the checkpoint holds, on the two-unit toy (units a, b; see test_shard_recompute) ---

def _trace(recompute, **spec):
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b"), recompute=recompute, **spec))
    return rank, memory_report(rank)


def test_the_rng_stash_is_held_from_the_units_forward_to_its_last_backward_op():
    rank, rep = _trace({"b": "full"}, checkpoint_rng_bytes=100)
    _, plain = _trace({"b": "full"})
    ops = [op.name for op in rank.graph.ops]
    post_backward = [n for n in ops if n.startswith("fsdp_free.reshard.b.")][-1]  # b's reshard after its backward
    stash, fork = ops.index("checkpoint_rng.b"), ops.index("checkpoint_fork.b")
    assert ops.index("fsdp_ag_copy_out.b.1") < stash < ops.index("fb1")  # after FSDP's pre-forward
    assert ops.index("fsdp_ag_alloc.a.2") < fork < ops.index("fb1.rc") < ops.index("bb2")  # the recompute's own
    frees = {t: op.name for op in rank.graph.ops if op.target == "fsdp.free" for t in op.inputs}
    assert ops.index(frees["checkpoint_fork.b"]) < ops.index("bb2")
    assert ops.index("bb1") < ops.index(frees["checkpoint_rng.b"]) < ops.index(post_backward)
    before = {n: t for n, t, _ in plain.timeline}
    after = {n: t for n, t, _ in rep.timeline}
    assert after["fb1"] - before["fb1"] == 100 and after["fb1.rc"] - before["fb1.rc"] == 200
    assert after[post_backward] == before[[n for n, _, _ in plain.timeline if n.startswith("fsdp_free.reshard.b.")][-1]]
    assert rep.peak == plain.peak + 100  # bb1, the peak, with the stash


def test_selective_storage_holds_a_saved_output_the_backward_never_reads():
    """b keeps fb2 (MUST_SAVE) and recomputes fb1: hb, fb2's output, is read by the loss only, yet it sits in the
    policy's storage; fb2 comes after the last op whose output b's backward reads (fb1: zb), so the recompute
    stops before it and hb is held until b's frame goes, after bb1."""
    rank, rep = _trace({"b": (0,)})
    _, keep = _trace(None)
    held = next(op for op in rank.graph.ops if op.target == "fsdp.free" and "hb" in op.inputs)
    ops = [op.name for op in rank.graph.ops]
    assert ops.index("bb1") < ops.index(held.name) < ops.index([n for n in ops if n.startswith("fsdp_free.reshard.b.")][-1])
    at = {n: t for n, t, _ in rep.timeline}
    kept = {n: t for n, t, _ in keep.timeline}
    assert at["seed"] == kept["seed"]  # zb (64) goes after fb2 to be recomputed, but hb (64) stays in storage
    _, full = _trace({"b": "full"})  # plain checkpoint: no storage, hb goes after the loss
    assert {n: t for n, t, _ in full.timeline}["seed"] == kept["seed"] - 64


# --- against real runs: the fake process group, real tensors (collectives do nothing) ---

@pytest.mark.parametrize("name", ["llama", "vit"])
def test_every_peer_peak_equals_the_prediction_under_the_fake_process_group(name):
    exp, problem = _prepared(name)
    for method in shard_compare.PEERS:
        knobs = shard_compare.method_knobs(problem, method)
        rank = shard_step(problem.graph, problem.params, knobs.spec(problem.spec))
        predicted = memory_report(rank).peak - rank.graph.resident_bytes()
        with fake_process_group(2) as mesh:
            torch.manual_seed(0)
            model = shard(zoo.resolve(exp.model.factory)(**exp.model.kwargs), _plan(problem, method), mesh)
            opt = make_optimizer("adam", model)
            args, _ = make_batch(shard_compare.gloo_inputs(exp))
            peaks = [split_step(model, opt, args, metered=step > 0).peak for step in range(3)][1:]
        assert peaks == [predicted] * 2, method


# --- gloo: bitwise against the same sharded model without the plan ---

def _recorded(run):
    r = run["recorded"]
    return list(zip(r["loss"], r["grads"], r["params"]))


def _gloo_kwargs(name, world_size, method):
    exp, problem = _prepared(name, world_size)
    return {"model": exp.model.factory, "inputs": shard_compare.gloo_inputs(exp), "units": problem.units + [""],
            "model_kwargs": dict(exp.model.kwargs), "steps": 3, "metered": 1, "plan": _plan(problem, method),
            "record": True}


GLOO_CASES = [("gpt", 2), ("vit", 2), ("vit", 4), ("gpt2_hf", 2)]
for _name, _w in GLOO_CASES:  # run in the session's one launch at each world size (tests/gloo_batch.py)
    for _method in ("torchtitan SAC", "no AC"):
        gloo_batch.add(_w, f"test_shard_models: {_name}, {_method}",
                       functools.partial(_gloo_kwargs, _name, _w, _method))


@pytest.mark.slow
@pytest.mark.parametrize("name, world_size", GLOO_CASES)
def test_gloo_bitwise_equal_without_the_plan_after_3_steps(name, world_size):
    exp = _experiment(name)  # skips gpt2_hf without transformers
    runs = {method: gloo_batch.result(world_size, f"test_shard_models: {name}, {method}")
            for method in ("torchtitan SAC", "no AC")}
    assert [len(runs[method]) for method in runs] == [world_size] * 2
    names = {n for n, _ in zoo.resolve(exp.model.factory)(**exp.model.kwargs).named_parameters()}
    assert all(set(r["recorded"]["params"][0]) == names for method in runs for r in runs[method])  # this model's
    for a, b in zip(runs["torchtitan SAC"], runs["no AC"]):
        assert len(_recorded(a)) == 3
        for (la, ga, pa), (lb, gb, pb) in zip(_recorded(a), _recorded(b)):
            assert torch.equal(la, lb)
            assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
            assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        assert a["peak_above_start"] < b["peak_above_start"]  # the plan frees activations


def test_gloo_table_says_by_how_much_a_measured_peak_differs():
    row = {"world_size": 4, "method": "full AC", "rank": 3, "predicted_peak_bytes": 1000,
           "measured_peaks_bytes": [1000, 1000], "fwd_bwd_cpu_s": 0.02, "step_cpu_s": 0.03}
    text = shard_compare.gloo_table([row, row | {"rank": 2, "measured_peaks_bytes": [1016, 1008]}])
    assert "| 4 | full AC | 3 | 1000 B | 1000, 1000 B (equal) | 20.0 ms | 30.0 ms |" in text
    assert "| 4 | full AC | 2 | 1000 B | 1016, 1008 B (+16 B) |" in text
    assert text.endswith("Predicted peak equal to every metered step's: 1 of 2 rank rows.")
