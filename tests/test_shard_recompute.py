"""Activation checkpointing inside one rank's FSDP2 step (gaswap.plan.sharding, `ShardSpec.recompute`), on a
hand-made two-unit step (no torch): exact memory traces."""
import pytest

from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.sharding import ParamSpec, ShardError, ShardSpec, memory_report, shard_step, unit_owned_forward

# units "a" and "b", each a linear (x, w -> z) then an activation (z -> h) whose backward reads z; weights of
# 8 x 4 float32 (128 bytes, shards of 64 at W = 2), activations of 64 bytes, Adam (two states per parameter)


def toy() -> tuple[Graph, list[ParamSpec]]:
    t = {"x": Tensor("x", 64, "input"), "wa": Tensor("wa", 128, "param"), "wb": Tensor("wb", 128, "param")}
    ops = []

    def op(name, layer, ins, outs, phase):
        for o in outs:
            t[o] = Tensor(o, 128 if o.startswith("g_") else 64, "grad" if o.startswith("g_") else "activation", name)
        ops.append(Op(name, "f", tuple(ins), tuple(outs), phase, layer))

    op("fa1", "a.lin", ["x", "wa"], ["za"], "fwd")
    op("fa2", "a", ["za"], ["ha"], "fwd")
    op("fb1", "b.lin", ["ha", "wb"], ["zb"], "fwd")
    op("fb2", "b", ["zb"], ["hb"], "fwd")
    op("loss", "loss", ["hb"], ["l"], "fwd")
    op("seed", "", ["l"], ["dl"], "bwd")
    op("bb2", "b", ["dl", "zb"], ["dzb"], "bwd")
    op("bb1", "b.lin", ["dzb", "ha", "wb"], ["dha", "g_wb"], "bwd")
    op("ba2", "a", ["dha", "za"], ["dza"], "bwd")
    op("ba1", "a.lin", ["dza", "x", "wa"], ["g_wa"], "bwd")
    g = Graph(tuple(ops), t, resident={"optimizer_state": 2 * 256}, loss="l")
    return g, [ParamSpec("wa", "a.lin.weight", (8, 4), 4, "g_wa"), ParamSpec("wb", "b.lin.weight", (8, 4), 4, "g_wb")]


def trace(recompute=None, **knobs):
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b"), recompute=recompute, **knobs))
    return rank, memory_report(rank)


def test_positions_are_the_units_own_forward_ops():
    g, _ = toy()
    units = ("a", "b", "")
    assert [g.ops[i].name for i in unit_owned_forward(g, units, "b")] == ["fb1", "fb2"]
    assert [g.ops[i].name for i in unit_owned_forward(g, units, "")] == []  # the loss is outside the model


def test_full_recompute_of_b_reruns_its_linear_after_the_backward_all_gather():
    rank, rep = trace({"b": "full"})
    ops = [op.name for op in rank.graph.ops]
    # only fb1 is rerun: b's backward reads zb (fb1's) and ha (unit a's, saved); fb2's output hb is not read
    assert rank.recomputed == {"fb1.rc": "fb1"}
    assert ops.index("fsdp_ag_copy_out.b.2") < ops.index("fb1.rc") < ops.index("bb2")
    clone = rank.graph.ops[ops.index("fb1.rc")]
    assert clone.inputs == ("ha", "wb.unsharded.b.2") and clone.outputs == ("zb.rc",) and clone.phase == "bwd"
    assert rank.graph.ops[ops.index("bb2")].inputs == ("dl", "zb.rc")
    keep = dict((n, t) for n, t, _ in trace()[1].timeline)
    full = dict((n, t) for n, t, _ in rep.timeline)
    # zb goes after fb2, its last reader now: 64 bytes less from there to the backward
    assert keep["fb2"] - full["fb2"] == 0 and keep["loss"] - full["loss"] == 64
    assert full["fb1.rc"] == full["fsdp_ag_alloc.a.2"] + 64  # the copy, made after a's prefetch is issued
    assert keep["bb2"] == full["bb2"]  # once rerun, the same bytes as keep-all


FULL_B = [("fsdp_ag_alloc.a.1", 576), ("fsdp_all_gather.a.1", 576), ("fsdp_ag_copy_out.a.1", 704), ("fa1", 768),
          ("fa2", 832), ("fsdp_free.reshard.a.1", 832), ("fsdp_ag_alloc.b.1", 832), ("fsdp_all_gather.b.1", 832),
          ("fsdp_free.all_gather_state.2", 832), ("fsdp_ag_copy_out.b.1", 832), ("fb1", 896), ("fb2", 960),
          ("fsdp_free.reshard.b.3", 896), ("fsdp_free.all_gather_state.4", 768), ("loss", 704), ("seed", 704),
          ("fsdp_ag_alloc.b.2", 832), ("fsdp_all_gather.b.2", 832), ("fsdp_ag_copy_out.b.2", 960),
          ("fsdp_ag_alloc.a.2", 960), ("fsdp_all_gather.a.2", 960), ("fb1.rc", 1024), ("bb2", 1088),
          ("bb1", 1216), ("fsdp_free.checkpoint.b.5", 1152), ("fsdp_free.reshard.b.6", 1088), ("fsdp_rs_alloc.b", 1088),
          ("fsdp_reduce_scatter.b", 1024), ("fsdp_ag_copy_out.a.2", 1152), ("ba2", 1088), ("ba1", 1088),
          ("fsdp_free.reshard.a.7", 1024), ("fsdp_free.reduce_scatter_state.8", 896), ("fsdp_rs_alloc.a", 896),
          ("fsdp_reduce_scatter.a", 832), ("fsdp_free.final.9", 832)]


def test_full_recompute_exact_trace():
    """W = 2: residents 448 (x 64, shards 2 x 64, Adam 256); the forward as keep-all's but zb freed after fb2
    (896 at b's reshard, keep-all 960); at b's backward: b re-gathered (128 out, freed after the copy-out, + 128
    unsharded), a prefetched (128), then zb's copy (64, gone after bb2); bb1 (dha 64 + b's gradient 128) is the
    peak, 1216, as keep-all's: the saving is in the forward. The checkpoint's frame goes after bb1 (its inputs,
    ha, held to there: bb1 reads it anyway)."""
    _, rep = trace({"b": "full"})
    assert [(n, t) for n, t, _ in rep.timeline] == FULL_B


def test_selective_recompute_and_a_unit_whose_inputs_are_saved():
    # a, position 0 (fa1): za is rerun from x (an input, resident) in a's backward; fa2's output ha stays
    # saved (b's backward reads it, and it is not chosen)
    rank, rep = trace({"a": (0,)})
    ops = [op.name for op in rank.graph.ops]
    assert rank.recomputed == {"fa1.rc": "fa1"}
    assert ops.index("fsdp_ag_copy_out.a.2") < ops.index("fa1.rc") < ops.index("ba2")
    # choosing fa2 alone recomputes nothing: ha is read by b's backward (outside a), za is saved
    rank2, _ = trace({"a": (1,)})
    assert rank2.recomputed == {}


def test_recompute_with_parameters_kept_gathered_reads_the_forwards_gather():
    rank, _ = trace({"b": "full"}, reshard_after_forward=False)
    clone = next(op for op in rank.graph.ops if op.name == "fb1.rc")
    assert "wb.unsharded.b.1" in clone.inputs


def test_recompute_errors():
    with pytest.raises(ShardError, match="not a unit"):
        trace({"c": "full"})
    with pytest.raises(ShardError, match="not a unit"):
        trace({"": "full"})
    with pytest.raises(ShardError, match="2 forward ops"):
        trace({"a": (2,)})
