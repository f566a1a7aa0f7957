"""gaswap.shard.apply: a sharded plan applied as torch's selective checkpointing inside fully_shard. Fast: the op
order SAC's policy_fn sees against the eager capture's, the op-name mapping, the refusals, and bitwise equality
under the fake process group (real tensors, collectives no-ops). Slow: real gloo runs of 2 and 4 processes,
bitwise equal to the same sharded model without the policy, and each rank's peak with and without it."""
import functools

import gloo_batch
import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from gaswap import zoo
from gaswap.base.errors import Refusal
from gaswap.plan.sharding import owned_forward
from gaswap.run.training import make_optimizer, split_step
from gaswap.shard.apply import (
    PlanMismatch,
    checkpoint_policy,
    op_calls,
    read_plan,
    shard,
)
from gaswap.shard.capture import capture_for_sharding
from gaswap.shard.tracker import fake_process_group

SAVED = ("aten.mm", "aten._scaled_dot_product", "aten.bmm")  # torchtitan's save list, roughly: the rest recomputed


@functools.cache
def _forward():
    """Per unit of the tiny Llama, its own forward ops [name, aten target] as the eager capture records them."""
    with torch.device("meta"):
        model = zoo.llama(preset="tiny")
    captured, units, _ = capture_for_sharding(model, tuple(x.to("meta") for x in zoo.llama_inputs()), None, "sum",
                                              unit_classes=(zoo.DecoderLayer,))
    g = captured.graph
    owned = owned_forward(g, units)
    return units, {u: [[g.ops[i].name, g.ops[i].target] for i in owned[u]] for u in units if u}


def _plan(recompute="selective", world_size=2, raf_false=(), forward_prefetch=0, backward_prefetch=1) -> dict:
    units, forward = _forward()
    first = forward["layers.0"]
    if recompute == "selective":
        recompute = [n for n, t in first if not t.startswith(SAVED)]
    return {"world_size": world_size, "torch": str(torch.__version__), "units": list(units),
            "recompute": [{"units": "layers.0 .. layers.1 (2)", "recompute": recompute,
                           "unit_paths": [u for u in units if u], "forward": first}],
            "reshard_after_forward_false": list(raf_false), "forward_prefetch": forward_prefetch,
            "backward_prefetch": backward_prefetch}


def test_the_eager_captures_op_order_per_block_is_the_order_sac_calls_the_policy_in():
    _, forward = _forward()
    torch.manual_seed(0)
    model = zoo.llama(preset="tiny")
    seen = {u: [] for u in forward}
    for u in forward:
        m = model.get_submodule(u)

        def policy(ctx, func, *args, _u=u, **kwargs):
            seen[_u].append(str(func))
            return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE

        m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False,
                                      context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    model(*zoo.llama_inputs()).sum().backward()
    for u, ops in forward.items():
        targets = [t for _, t in ops]
        assert [t for t in seen[u] if t in set(targets)] == targets, u
        assert len(seen[u]) > len(targets)  # views and the like: SAC sees them, the capture lists no op for them


def test_op_names_map_to_the_kth_call_of_their_target():
    _, forward = _forward()
    calls = op_calls(forward["layers.0"])
    muls = [n for n, t in forward["layers.0"] if t == "aten.mul.Tensor"]
    assert [calls[n] for n in muls] == [("aten.mul.Tensor", k) for k in range(len(muls))]
    assert calls["mul_2"] == ("aten.mul.Tensor", 2)
    # layers.1 has other names but the same targets in the same order: the plan's names (layers.0's) apply to it
    assert [t for _, t in forward["layers.1"]] == [t for _, t in forward["layers.0"]]
    policies = checkpoint_policy(_plan())
    assert set(policies) == {"layers.0", "layers.1"} and policies["layers.1"].mode == "selective"


def _mesh_size(n):
    return type("Mesh", (), {"size": lambda self: n})()


@pytest.mark.parametrize("change, message", [
    ({"world_size": 4}, "the plan is for 4 ranks, the mesh has 2"),
    ({"torch": "2.5.0"}, "the plan was made with torch 2.5.0, this is torch"),
    ({"units": ["layers.0", "layers.7", ""]}, "unit(s) layers.7 are not modules of this Llama"),
    ({"recompute": "bogus_op"}, "recomputes bogus_op, which its block's forward does not have"),
    ({"recompute": "swap"}, "treats MUST_CPU_OFFLOAD as a recomputation"),
    ({"drop": "forward_prefetch"}, "lacks forward_prefetch"),
    ({"offload": ["layers.9"]}, "unit(s) layers.9 are not modules of this Llama"),
])
def test_mismatches_are_refused_naming_what_differs(change, message):
    plan = _plan()
    if change.get("recompute") == "bogus_op":
        plan["recompute"][0]["recompute"] = plan["recompute"][0]["recompute"] + ["bogus_op"]
    elif change.get("recompute") == "swap":
        plan["recompute"][0]["swap"] = ["mm"]
    elif "drop" in change:
        del plan[change["drop"]]
    else:
        plan |= change
    with pytest.raises(PlanMismatch) as err:
        shard(zoo.llama(preset="tiny"), plan, _mesh_size(2))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, Refusal)  # gaswap's "refused" exit code


def test_another_model_is_refused_at_its_first_forward():
    with fake_process_group(2) as mesh:
        torch.manual_seed(0)
        model = zoo.llama(preset="tiny")
        for layer in model.layers:
            layer.feed_forward.fused_silu = True  # one aten.silu where the plan's block has sigmoid and mul
        model = shard(model, _plan(), mesh)
        with pytest.raises(PlanMismatch, match=r"layers.0: (op \d+ of its forward|its forward)"):
            model(*zoo.llama_inputs()).sum().backward()


def test_plan_file_is_read_safely(tmp_path):
    import yaml

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_plan()))
    assert read_plan(path) == _plan()
    path.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(Exception) as err:
        read_plan(path)
    assert not isinstance(err.value, PlanMismatch) or "mapping" in str(err.value)


def _run_fake(plan, steps=3, compiled=False, seen=None):
    with fake_process_group(2) as mesh:
        torch.manual_seed(0)
        model = shard(zoo.llama(preset="tiny"), plan, mesh)
        if compiled:  # torch.compile per block, as torchtitan compiles
            for layer in model.layers:
                layer.compile()
        opt = make_optimizer("adam", model)
        out = []
        for _ in range(steps):
            grads = {}
            done = split_step(model, opt, zoo.llama_inputs(), before_step=lambda m, grads=grads: grads.update(
                {n: p.grad.to_local().clone() for n, p in m.named_parameters()}))
            out.append((done.loss, grads, {n: p.to_local().clone() for n, p in model.named_parameters()}))
        if seen is not None:  # how far each selective unit's policy walked its plan's list
            seen.update({i: layer.forward.args[1].walked[-1]["at"] for i, layer in enumerate(model.layers)
                         if isinstance(layer.forward, functools.partial) and layer.forward.args[1].walked})
        return out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for (la, ga, pa), (lb, gb, pb) in zip(a, b):
        assert torch.equal(la, lb)
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_bitwise_equal_without_the_policy_under_the_fake_process_group(recompute):
    knobs = {"raf_false": ["layers.1"], "forward_prefetch": 1}
    _assert_bitwise(_run_fake(_plan(recompute, **knobs)), _run_fake(_plan("none", **knobs)))


def test_offloaded_units_get_cpu_offload_policy_and_train_the_same():
    """plan["offload"]: those units' fully_shard takes CPUOffloadPolicy (on a CPU the host is the device: nothing
    moves, the step is the same bit for bit)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    plan = _plan("full") | {"offload": ["layers.0", ""]}
    with fake_process_group(2) as mesh:
        model = shard(zoo.llama(preset="tiny"), plan, mesh)
        policies = {name: m._get_fsdp_state()._fsdp_param_group.offload_policy for name, m in model.named_modules()
                    if name in ("", "layers.0", "layers.1")}
    assert isinstance(policies[""], CPUOffloadPolicy) and isinstance(policies["layers.0"], CPUOffloadPolicy)
    assert not isinstance(policies["layers.1"], CPUOffloadPolicy)
    _assert_bitwise(_run_fake(plan), _run_fake(_plan("full")))


@pytest.mark.slow
def test_compiled_per_block_bitwise_equal_and_the_policy_walked_its_list():
    """Each block compiled (`module.compile()`) after `shard`: selective AC runs inside the compiled graph (the
    policy sees the block's ops when it is traced), losses, gradients and parameters bitwise those of the same
    compiled model without the plan."""
    plan, seen = _plan("selective"), {}
    _assert_bitwise(_run_fake(plan, compiled=True, seen=seen), _run_fake(_plan("none"), compiled=True))
    assert seen == {0: len(plan["recompute"][0]["forward"]), 1: len(plan["recompute"][0]["forward"])}


def _gloo_kwargs(recompute, world_size):
    return {"model": "gaswap.zoo:llama", "inputs": "gaswap.zoo:llama_inputs", "units": _forward()[0], "steps": 3,
            "metered": 1, "plan": _plan(recompute, world_size), "record": True}


GLOO_WORLD_SIZES = (2, 4)
for _w in GLOO_WORLD_SIZES:  # run in the session's one launch at each world size (tests/gloo_batch.py)
    for _r in ("selective", "none"):
        gloo_batch.add(_w, f"test_shard_apply: llama, {_r}", functools.partial(_gloo_kwargs, _r, _w))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", GLOO_WORLD_SIZES)
def test_gloo_bitwise_equal_without_the_policy_after_3_steps(world_size):
    runs = {name: gloo_batch.result(world_size, f"test_shard_apply: llama, {name}") for name in ("selective", "none")}
    assert [len(runs[name]) for name in runs] == [world_size] * 2
    for a, b in zip(runs["selective"], runs["none"]):
        ra, rb = a["recorded"], b["recorded"]
        _assert_bitwise(list(zip(ra["loss"], ra["grads"], ra["params"])),
                        list(zip(rb["loss"], rb["grads"], rb["params"])))
        assert a["peak_above_start"] < b["peak_above_start"]  # the policy frees activations
