"""gaswap.plan.sharding on a hand-made two-unit step (no torch): exact memory traces at W = 2 and 4."""
import pytest

from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.sharding import (
    Link,
    ParamSpec,
    ShardError,
    ShardSpec,
    local_shard_numel,
    memory_report,
    padded_shard_numel,
    shard_step,
    step_time,
)

# two units "a" and "b", a root with no parameters; parameters of 8 x 4 float32 (128 bytes) and a bias of 3
# (12 bytes, padded to 4 or 4 rows); activations of 64 bytes; the loss outside the model


def toy() -> tuple[Graph, list[ParamSpec]]:
    t = {"x": Tensor("x", 64, "input"),
         "wa": Tensor("wa", 128, "param"), "ba": Tensor("ba", 12, "param"), "wb": Tensor("wb", 128, "param")}
    ops = []

    def op(name, layer, ins, outs, phase, kind="activation", size=64):
        for o in outs:
            t[o] = Tensor(o, size if not o.startswith("g_") else t[o[2:]].size, kind if o.startswith("g_") else
                          "activation", name)
        ops.append(Op(name, "f", tuple(ins), tuple(outs), phase, layer))

    op("fa", "a", ["x", "wa", "ba"], ["ha"], "fwd")
    op("fb", "b", ["ha", "wb"], ["hb"], "fwd")
    op("loss", "loss", ["hb"], ["l"], "fwd")
    op("seed", "", ["l"], ["dl"], "bwd")
    op("bb", "b", ["dl", "ha", "wb"], ["dha", "g_wb"], "bwd", kind="grad")
    op("ba_", "a", ["dha", "x", "wa"], ["g_wa", "g_ba"], "bwd", kind="grad")
    g = Graph(tuple(ops), t, resident={"optimizer_state": 2 * 268}, loss="l")
    params = [ParamSpec("wa", "a.weight", (8, 4), 4, "g_wa"), ParamSpec("ba", "a.bias", (3,), 4, "g_ba"),
              ParamSpec("wb", "b.weight", (8, 4), 4, "g_wb")]
    return g, params


def totals(report):
    return [(name, total) for name, total, _ in report.timeline]


def test_padding_follows_fsdp2_dim0_chunks():
    assert padded_shard_numel((8, 4), 2) == 16 and padded_shard_numel((3,), 2) == 2
    assert padded_shard_numel((3,), 4) == 1 and padded_shard_numel((10, 3), 8) == 6
    assert [local_shard_numel((10,), 8, r) for r in range(8)] == [2, 2, 2, 2, 2, 0, 0, 0]


# bytes after each op's outputs are allocated (before what it frees goes): W = 2, then W = 4
TRACE = {
    2: [("fsdp_ag_alloc.a.1", 616), ("fsdp_all_gather.a.1", 616), ("fsdp_ag_copy_out.a.1", 760), ("fa", 824),
        ("fsdp_free.reshard.a.1", 824), ("fsdp_ag_alloc.b.1", 808), ("fsdp_all_gather.b.1", 808),
        ("fsdp_free.all_gather_state.2", 808), ("fsdp_ag_copy_out.b.1", 792), ("fb", 856),
        ("fsdp_free.reshard.b.3", 856), ("fsdp_free.all_gather_state.4", 728), ("loss", 664), ("seed", 664),
        ("fsdp_ag_alloc.b.2", 792), ("fsdp_all_gather.b.2", 792), ("fsdp_ag_copy_out.b.2", 920),
        ("fsdp_ag_alloc.a.2", 936), ("fsdp_all_gather.a.2", 936), ("bb", 1128), ("fsdp_free.reshard.b.5", 1064),
        ("fsdp_rs_alloc.b", 1064), ("fsdp_reduce_scatter.b", 1000), ("fsdp_ag_copy_out.a.2", 1144), ("ba_", 1140),
        ("fsdp_free.reshard.a.6", 1076), ("fsdp_free.reduce_scatter_state.7", 932), ("fsdp_rs_alloc.a", 948),
        ("fsdp_reduce_scatter.a", 880), ("fsdp_free.final.8", 880)],
    4: [("fsdp_ag_alloc.a.1", 412), ("fsdp_all_gather.a.1", 412), ("fsdp_ag_copy_out.a.1", 556), ("fa", 620),
        ("fsdp_free.reshard.a.1", 620), ("fsdp_ag_alloc.b.1", 604), ("fsdp_all_gather.b.1", 604),
        ("fsdp_free.all_gather_state.2", 604), ("fsdp_ag_copy_out.b.1", 588), ("fb", 652),
        ("fsdp_free.reshard.b.3", 652), ("fsdp_free.all_gather_state.4", 524), ("loss", 460), ("seed", 460),
        ("fsdp_ag_alloc.b.2", 588), ("fsdp_all_gather.b.2", 588), ("fsdp_ag_copy_out.b.2", 716),
        ("fsdp_ag_alloc.a.2", 732), ("fsdp_all_gather.a.2", 732), ("bb", 924), ("fsdp_free.reshard.b.5", 860),
        ("fsdp_rs_alloc.b", 860), ("fsdp_reduce_scatter.b", 764), ("fsdp_ag_copy_out.a.2", 908), ("ba_", 904),
        ("fsdp_free.reshard.a.6", 840), ("fsdp_free.reduce_scatter_state.7", 696), ("fsdp_rs_alloc.a", 712),
        ("fsdp_reduce_scatter.a", 608), ("fsdp_free.final.8", 608)],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_units_exact_trace(world_size):
    """W = 2: residents 472 (shards 64 + 8 + 64, x 64, Adam's two states of the shards 272); a's all-gather
    output 2 x 72, copied out into unsharded a (128 + 16 padded: the bias's 3 rows become 4); the output is kept
    while b's is allocated (FSDP2's all_gather_state) and freed before b's copy-out; the root's post-forward
    frees b's; the backward re-gathers b, prefetches a, and b's reduce-scatter input outlives its collective
    until a's post-backward (at the end: a's input, x, needs no gradient)."""
    g, params = toy()
    rep = memory_report(shard_step(g, params, ShardSpec(world_size, ("a", "b"))))
    assert totals(rep) == TRACE[world_size]
    assert rep.peak == max(t for _, t in TRACE[world_size]) == rep.simulated_peak


def test_categories_at_the_peak():
    g, params = toy()
    rep = memory_report(shard_step(g, params, ShardSpec(2, ("a", "b"))))
    assert rep.peak_op == "fsdp_ag_copy_out.a.2"
    assert {k: v for k, v in rep.at_peak.items() if v} == {
        "sharded params": 136, "optimizer state": 272, "inputs": 64, "unsharded params": 144,
        "all-gather buffers": 144, "sharded grads": 64, "reduce-scatter buffers": 128, "activations": 64 + 64,
        "temporaries": 64}  # ha's gradient dha; l and the seed dl are held


def test_reduce_scatter_frees_unsharded_grads_and_keeps_one_input():
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b")))
    ops = [op.name for op in rank.graph.ops]
    # b: post-backward right after its backward (its input needs a gradient); a: at the end (x needs none)
    i = ops.index("bb")
    assert ops[i + 1:i + 4] == ["fsdp_free.reshard.b.6", "fsdp_rs_alloc.b", "fsdp_reduce_scatter.b"] or \
        ops[i + 1].startswith("fsdp_free.reshard.b")
    rs = rank.graph.tensors["rs_in.b"]
    assert rs.size == 2 * 64 and rank.graph.tensors["grad_shard.b"].size == 64
    assert rank.graph.tensors["grad_shard.b"].kind == "grad" and rank.graph.tensors["g_wb"].kind == "activation"
    rep = memory_report(rank)
    trace = dict((n, t) for n, t, _ in rep.timeline)
    before = trace["fsdp_rs_alloc.b"]
    assert trace["fsdp_reduce_scatter.b"] == before - 128 + 64  # unsharded grad gone, sharded one made
    # the reduce-scatter input of b is kept until a's reduce-scatter (the previous state is freed first)
    a_ops = ops[ops.index("fsdp_rs_alloc.a") - 1]
    assert a_ops.startswith("fsdp_free.reduce_scatter_state")
    assert rank.stream["fsdp_reduce_scatter.b"] == "reduce_scatter" and rank.stream["fsdp_all_gather.a.1"] == "all_gather"


def test_reshard_after_forward_false_keeps_unsharded_params_to_the_backward():
    g, params = toy()
    keep = shard_step(g, params, ShardSpec(2, ("a", "b"), reshard_after_forward=False))
    names = [op.name for op in keep.graph.ops]
    assert not any(n.startswith("fsdp_ag_alloc") and n.endswith(".2") for n in names)  # no re-gather
    assert "fsdp_free.reshard" not in " ".join(n for n, op in zip(names, keep.graph.ops) if op.phase == "fwd")
    bb = next(op for op in keep.graph.ops if op.name == "bb")
    assert "wb.unsharded.b.1" in bb.inputs  # the backward reads the forward's gather
    default = shard_step(g, params, ShardSpec(2, ("a", "b")))
    at_loss = {n: c for n, _, c in memory_report(keep).timeline}["loss"]
    assert at_loss["unsharded params"] == 144 + 128  # both units stay gathered from the forward on
    assert {n: c for n, _, c in memory_report(default).timeline}["loss"]["unsharded params"] == 0


def test_backward_prefetch_overlaps_the_next_units_all_gather():
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b")))
    ops = [op.name for op in rank.graph.ops]
    # at b's pre-backward: b's copy-out, then a's all-gather issued before b's backward op runs
    assert ops.index("fsdp_ag_copy_out.b.2") < ops.index("fsdp_ag_alloc.a.2") < ops.index("bb")
    none = shard_step(g, params, ShardSpec(2, ("a", "b"), backward_prefetch=0))
    ops0 = [op.name for op in none.graph.ops]
    assert ops0.index("fsdp_ag_alloc.a.2") > ops0.index("bb")
    times = {op.name: 1.0 for op in rank.graph.ops if not op.name.startswith("fsdp_free")}
    overlapped, busy = step_time(rank, times)
    serial, _ = step_time(rank, times, overlap=False)
    assert overlapped < serial and busy["all_gather"] > 0


def test_forward_prefetch_issues_the_next_units_all_gather_early():
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b"), forward_prefetch=1))
    ops = [op.name for op in rank.graph.ops]
    assert ops.index("fsdp_ag_alloc.b.1") < ops.index("fa")


def test_tracker_view_labels_unsharded_grads_temporaries_until_post_backward():
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b")))
    tracker = dict((n, c) for n, _, c in memory_report(rank, tracker=True).timeline)
    own = dict((n, c) for n, _, c in memory_report(rank).timeline)
    assert own["bb"]["unsharded grads"] == 128 and tracker["bb"]["unsharded grads"] == 0
    assert tracker["fsdp_rs_alloc.b"]["unsharded grads"] == 128  # relabelled as the post-backward starts


def test_link_costs_and_errors():
    link = Link(latency=1e-5, bandwidth=1e9)
    assert link.all_gather(1000, 4) == pytest.approx(3e-5 + 750e-9)
    g, params = toy()
    with pytest.raises(ShardError, match="at least 2"):
        shard_step(g, params, ShardSpec(1, ("a", "b")))


# integer reshard_after_forward, W = 4 and k = 2: the trace of TRACE[4] with each unit's post-forward slice
RESHARD_TO_2 = [
    ("fsdp_ag_alloc.a.1", 412), ("fsdp_all_gather.a.1", 412), ("fsdp_ag_copy_out.a.1", 556), ("fa", 620),
    ("fsdp_post_forward_slice.a.1", 692), ("fsdp_free.reshard.a.2", 692), ("fsdp_ag_alloc.b.1", 676),
    ("fsdp_all_gather.b.1", 676), ("fsdp_free.all_gather_state.3", 676), ("fsdp_ag_copy_out.b.1", 660),
    ("fb", 724), ("fsdp_post_forward_slice.b.4", 788), ("fsdp_free.reshard.b.5", 788),
    ("fsdp_free.all_gather_state.6", 660), ("loss", 596), ("seed", 596), ("fsdp_ag_alloc.b.2", 724),
    ("fsdp_all_gather.b.2", 724), ("fsdp_ag_copy_out.b.2", 852), ("fsdp_free.post_forward.b.7", 724),
    ("fsdp_ag_alloc.a.2", 804), ("fsdp_all_gather.a.2", 804), ("bb", 996), ("fsdp_free.reshard.b.8", 932),
    ("fsdp_rs_alloc.b", 932), ("fsdp_reduce_scatter.b", 836), ("fsdp_ag_copy_out.a.2", 980),
    ("fsdp_free.post_forward.a.9", 836), ("ba_", 904), ("fsdp_free.reshard.a.10", 840),
    ("fsdp_free.reduce_scatter_state.11", 696), ("fsdp_rs_alloc.a", 712), ("fsdp_reduce_scatter.a", 608),
    ("fsdp_free.final.12", 608)]


def test_integer_reshard_after_forward_keeps_a_slice_and_gathers_within_k_ranks():
    """W = 4, reshard_after_forward = 2 (FSDPParam.to_sharded_post_forward): after a's forward each rank clones a
    1/2 slice of a's unsharded parameters (144 / 2 = 72 bytes) before they go, b's 128 / 2 = 64; from the loss on
    the rank holds 136 bytes more than with True (TRACE[4]); the backward all-gather copies the slice in (its
    output the same 4 x 36 = 2 x 72 bytes), runs over 2 ranks, and the slice goes after the copy-out
    (FSDPParam.to_unsharded). The peak (at bb) is 72 above True's: a's slice is still held there."""
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(4, ("a", "b"), reshard_after_forward=2))
    rep = memory_report(rank)
    assert totals(rep) == RESHARD_TO_2
    assert rep.peak == 996 == max(t for _, t in TRACE[4]) + 72
    assert rank.graph.tensors["wa.post_forward.1"].size == 64 and rank.graph.tensors["ba.post_forward.1"].size == 8
    assert rank.category["wa.post_forward.1"] == "sharded params"
    assert rank.tracker_category["wa.post_forward.1"] == "activations"  # cloned in the forward
    assert rank.ranks("fsdp_all_gather.a.2") == 2 and rank.ranks("fsdp_all_gather.a.1") == 4
    link = Link(1e-3, 1e9)
    from gaswap.plan.sharding import rank_op_times
    times = rank_op_times(rank, {}, link)
    assert times["fsdp_all_gather.a.2"] == pytest.approx(link.all_gather(144, 2))
    assert times["fsdp_all_gather.a.1"] == pytest.approx(link.all_gather(144, 4))
    # per unit: only b resharded to 2, a as True
    mixed = memory_report(shard_step(g, params, ShardSpec(4, ("a", "b"), reshard_after_forward={"a": True, "b": 2})))
    assert dict(totals(mixed))["loss"] == 460 + 64


@pytest.mark.parametrize("k", [0, 3, 5])
def test_integer_reshard_after_forward_must_divide_the_world_size(k):
    g, params = toy()
    with pytest.raises(ShardError, match="must divide the world size 4"):
        shard_step(g, params, ShardSpec(4, ("a", "b"), reshard_after_forward=k))


def test_hsdp_shards_over_the_shard_dimension_and_all_reduces_across_replicas():
    """A (2, 2) mesh of 4 ranks: parameters sharded over 2 (TRACE[2], the same bytes), each reduce-scatter's
    output all-reduced in place across the 2 replicas (stream "all_reduce", no bytes of its own in fp32), costed on
    the replicas' link with 2 ranks; with a reduce dtype other than the parameters' the all-reduced buffer is
    held to the end of the backward (FSDPParamGroup._all_reduce_state)."""
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(4, ("a", "b"), replicate=2))
    rep = memory_report(rank)
    assert [t for n, t in totals(rep) if not n.startswith("fsdp_all_reduce")] == [t for _, t in TRACE[2]]
    ar = [op.name for op in rank.graph.ops if op.target == "fsdp.all_reduce"]
    assert ar == ["fsdp_all_reduce.b", "fsdp_all_reduce.a"] and rank.stream[ar[0]] == "all_reduce"
    assert rank.graph.ops[[op.name for op in rank.graph.ops].index(ar[0])].inputs == ("grad_shard.b",)
    from gaswap.plan.sharding import rank_op_times
    slow = Link(1e-3, 1e8)
    times = rank_op_times(rank, {}, Link(1e-6, 1e10), replica_link=slow)
    assert times["fsdp_all_reduce.b"] == pytest.approx(2 * slow.all_gather(64, 2))
    assert times["fsdp_reduce_scatter.b"] == pytest.approx(Link(1e-6, 1e10).reduce_scatter(128, 2))
    # fp16 reduce of fp32 shards: the raw reduce-scatter output (2 bytes / element) is held to the final callback
    mixed = shard_step(g, params, ShardSpec(4, ("a", "b"), replicate=2, reduce_itemsize=2))
    final = next(op for op in mixed.graph.ops if op.name.startswith("fsdp_free.final"))
    assert {"rs_out.a", "rs_out.b"} <= set(final.inputs)
    flat = shard_step(g, params, ShardSpec(2, ("a", "b"), reduce_itemsize=2))
    assert memory_report(mixed).peak >= memory_report(flat).peak
    with pytest.raises(ShardError, match="HSDP mesh"):
        shard_step(g, params, ShardSpec(4, ("a", "b"), replicate=3))


OFFLOAD_TRACE = [
    ("fsdp_h2d.a.1", 136), ("fsdp_ag_alloc.a.1", 280), ("fsdp_all_gather.a.1", 208), ("fsdp_ag_copy_out.a.1", 352),
    ("fa", 416), ("fsdp_free.reshard.a.1", 416), ("fsdp_h2d.b.1", 336), ("fsdp_ag_alloc.b.1", 464),
    ("fsdp_all_gather.b.1", 400), ("fsdp_free.all_gather_state.2", 400), ("fsdp_ag_copy_out.b.1", 384), ("fb", 448),
    ("fsdp_free.reshard.b.3", 448), ("fsdp_free.all_gather_state.4", 320), ("loss", 256), ("seed", 256),
    ("fsdp_h2d.b.2", 320), ("fsdp_ag_alloc.b.2", 448), ("fsdp_all_gather.b.2", 384), ("fsdp_ag_copy_out.b.2", 512),
    ("fsdp_h2d.a.2", 456), ("fsdp_ag_alloc.a.2", 600), ("fsdp_all_gather.a.2", 528), ("bb", 720),
    ("fsdp_free.reshard.b.5", 656), ("fsdp_rs_alloc.b", 656), ("fsdp_reduce_scatter.b", 592), ("fsdp_d2h.b", 592),
    ("fsdp_ag_copy_out.a.2", 672), ("ba_", 668), ("fsdp_free.reshard.a.6", 604),
    ("fsdp_free.reduce_scatter_state.7", 460), ("fsdp_rs_alloc.a", 476), ("fsdp_reduce_scatter.a", 408),
    ("fsdp_d2h.a", 408), ("fsdp_free.final.8", 336)]


def test_cpu_offload_device_bytes_by_hand():
    """W = 2 with CPUOffloadPolicy, worked by hand: the device holds only x (64) at the start (shards 136 and
    Adam's 272 on the host); each all-gather first copies the unit's shards host->device (a: 72, b: 64), which go
    after the copy-in, before the collective; each reduce-scatter's output (the sharded gradients, b: 64) is
    copied device->host and goes after the copy (its host copy has no device bytes). At bb (now the peak) the
    device holds TRACE[2]'s bytes less the shards and the optimizer state: 1128 - 136 - 272 = 720; at a's
    backward copy-out (TRACE[2]'s peak, 1144) b's sharded gradients (64) are on the host too: 672. FSDPMemTracker cannot tell host from device
    on a CPU-only machine, so this is checked by hand, not against it."""
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, ("a", "b"), offload=True))
    rep = memory_report(rank)
    assert totals(rep) == OFFLOAD_TRACE
    assert rep.peak == 720 == dict(TRACE[2])["bb"] - 136 - 272
    assert dict(totals(rep))["fsdp_ag_copy_out.a.2"] == max(t for _, t in TRACE[2]) - 136 - 272 - 64
    assert rank.host_bytes == {"sharded params": 136, "sharded grads": 136, "optimizer state": 272}
    assert rank.host_copies["fsdp_h2d.a.1"] == ("h2d", 72) and rank.host_copies["fsdp_d2h.b"] == ("d2h", 64)
    from gaswap.plan.costs import Costs
    from gaswap.plan.sharding import rank_op_times
    pcie = Costs({}, 1e9, 2e9, "gpu", "test", copy_latency=1e-6)
    times = rank_op_times(rank, {}, Link(1e-6, 1e10), host_link=pcie)
    assert times["fsdp_h2d.a.1"] == pytest.approx(1e-6 + 72 / 2e9)
    assert times["fsdp_d2h.b"] == pytest.approx(1e-6 + 64 / 1e9)
