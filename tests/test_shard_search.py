"""gaswap.plan.shard_search on a hand-made step of three identical units (no torch): block classes, links,
seeds, and a front of (per-rank peak, step time) under the budget."""
import random

import pytest

from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.graph import Graph, Op, Tensor
from gaswap.plan.shard_search import ShardProblem, link_for, search, unit_classes
from gaswap.plan.sharding import Link, ParamSpec, ShardError, ShardSpec, memory_report, shard_step

UNITS = ("layers.0", "layers.1", "layers.2")


def toy(n: int = 3) -> tuple[Graph, list[ParamSpec]]:
    """n units layers.k: a linear (h, w -> z, 64 B) then an activation (z -> h', 256 B) whose backward reads z
    and h'; weights 8 x 4 float32; the loss outside the model."""
    t = {"x": Tensor("x", 64, "input")}
    ops, params = [], []

    def op(name, layer, ins, outs, phase, sizes):
        for o, s in zip(outs, sizes):
            t[o] = Tensor(o, s, "grad" if o.startswith("g_") else "activation", name)
        ops.append(Op(name, "aten.mm.default" if name.startswith("lin") else "aten.relu.default", tuple(ins),
                      tuple(outs), phase, layer, flops=1e6))

    h = "x"
    for k in range(n):
        t[f"w{k}"] = Tensor(f"w{k}", 128, "param")
        params.append(ParamSpec(f"w{k}", f"layers.{k}.lin.weight", (8, 4), 4, f"g_w{k}"))
        op(f"lin{k}", f"layers.{k}.lin", [h, f"w{k}"], [f"z{k}"], "fwd", [64])
        op(f"act{k}", f"layers.{k}", [f"z{k}"], [f"h{k}"], "fwd", [256])
        h = f"h{k}"
    op("loss", "loss", [h], ["l"], "fwd", [4])
    op("seed", "", ["l"], ["dl"], "bwd", [4])
    d = "dl"
    for k in reversed(range(n)):
        op(f"actb{k}", f"layers.{k}", [d, f"z{k}", f"h{k}"], [f"dz{k}"], "bwd", [64])
        ins = [f"dz{k}", "x" if k == 0 else f"h{k - 1}", f"w{k}"]
        op(f"linb{k}", f"layers.{k}.lin", ins, [f"dh{k}", f"g_w{k}"], "bwd", [64, 128])
        d = f"dh{k}"
    return Graph(tuple(ops), t, resident={"optimizer_state": 2 * 128 * n}, loss="l"), params


def problem(budget: int = 10**9, **host) -> ShardProblem:
    g, params = toy()
    return ShardProblem(g, params, ShardSpec(2, UNITS), {op.name: 1e-3 for op in g.ops}, Link(1e-5, 1e9), budget,
                        1e10, **host)


def test_identical_units_form_one_class():
    g, _ = toy()
    assert unit_classes(g, UNITS + ("",)) == [UNITS]


def test_links_by_world_size():
    h100 = load_profile("h100-sxm-80gb")
    assert link_for(h100, 8)[0] == "nvlink" and link_for(h100, 16)[0] == "infiniband"
    assert link_for(h100, 8, "infiniband")[1] == Link(6e-6, 40e9)
    with pytest.raises(ShardError, match="no `links`"):
        link_for(load_profile("cpu"), 2)
    with pytest.raises(ShardError, match="not one of"):
        link_for(h100, 2, "ethernet")


def test_seeds_decode_to_the_knobs_they_name():
    p = problem()
    assert p.decode(p.seed("keep_all")).recompute == {}
    assert p.decode(p.seed("full_ac")).recompute == {u: "full" for u in UNITS}
    assert p.decode(p.seed("selective_ac")).recompute == {u: (1,) for u in UNITS}  # the matmul (0) saved
    assert p.decode(p.seed("full_ac_first_half")).recompute == {"layers.0": "full", "layers.1": "full"}
    assert p.decode(p.seed("full_then_selective")).recompute == {"layers.0": "full", "layers.1": "full",
                                                                 "layers.2": (1,)}
    # greedy: the activation (256 B per ms) before the matmul (64 B per ms)
    assert p.by_bytes_per_second("layers.0", (0, 1)) == [1, 0]
    assert p.decode(p.seed("greedy_half_ac")).recompute == {u: (1,) for u in UNITS}
    assert p.decode(p.seed("greedy_three_quarters_ac")).recompute == {u: (0, 1) for u in UNITS}
    assert p.decode(p.seed("full_then_greedy_half")).recompute == {"layers.0": "full", "layers.1": "full",
                                                                   "layers.2": (1,)}
    keep = p.decode(p.seed("keep_all"))
    assert keep.reshard == {**{u: True for u in UNITS}, "": False} and (keep.forward_prefetch,
                                                                           keep.backward_prefetch) == (0, 1)


def test_a_class_splits_its_units_between_two_choices():
    """Genes per class: first choice (mode, bit per selectable op, ladder rung), second choice, then how many
    units (in forward order) take the first; the split point ranges over 0..len(class)."""
    p = problem()
    assert p.length() == len(p.bounds()) == 2 * (1 + 2 + 1) + 1 + 1 + len(UNITS) + 2 and p.class_genes() == 9
    assert p.bounds()[8] == len(UNITS) and p.bounds()[9] == 0  # no offload gene: the host is not priced
    tail = list(p.seed("keep_all"))[9:]
    for k in range(len(UNITS) + 1):
        genes = [2, 0, 1, 0] + [1, 0, 0, 0] + [k] + tail  # first: recompute the activation; rest: full AC
        recompute = p.decode(genes).recompute
        assert recompute == {u: (1,) if i < k else "full" for i, u in enumerate(UNITS)}
    rungs = p.ladders[0]
    assert p.bounds()[3] == p.bounds()[7] == len(rungs) - 1
    for r, rung in enumerate(rungs):  # mode 3: the rung's positions, whatever the bits say
        assert p.decode([3, 1, 1, r] + [0, 0, 0, 0] + [2] + tail).recompute == {u: rung.positions for u in UNITS[:2]}
    later = p.evaluate([1, 0, 0, 0, 0, 0, 0, 0, 1] + tail)  # only layers.0 (whose activations live longest) full
    first = p.evaluate([0, 0, 0, 0, 1, 0, 0, 0, 2] + tail)  # only layers.2 full
    assert later.knobs.recompute == {"layers.0": "full"} and first.knobs.recompute == {"layers.2": "full"}
    assert later.peak < first.peak


def test_offload_gene_moves_units_state_to_the_host_at_a_price():
    """With the host priced, gene k offloads the first k of the non-root units then the root: their shards,
    gradients and optimizer state leave the device; the step pays the copies and the host's optimizer step."""
    costs = estimate(toy()[0], load_profile("h100-sxm-80gb"))
    p = problem(host_link=costs, host_step=1e-6)
    assert p.offload_order == list(UNITS) + [""] and p.bounds()[9] == len(UNITS) + 1
    genes = list(p.seed("keep_all"))
    points = []
    for k in range(len(UNITS) + 2):
        genes[9] = k
        points.append(p.evaluate(genes))
        assert points[-1].knobs.offload == tuple(p.offload_order[:k])
    # each unit: its 64-byte shard (8 x 4 float32 over 2 ranks) and 2 x 64 bytes of optimizer state, resident all
    # step (its gradient shard too, but the peak comes before the backward makes any)
    assert [a.peak - b.peak for a, b in zip(points, points[1:-1])] == [3 * 64] * len(UNITS)
    assert all(a.step_time < b.step_time for a, b in zip(points, points[1:-1]))
    rank = p.rank(points[2].knobs)
    assert rank.host_bytes["sharded params"] == 2 * 64 and rank.host_bytes["optimizer state"] == 2 * 128
    genes[9] = 2
    unpriced = problem(host_link=costs, host_step=0.0).evaluate(genes)  # the same plan, a free host step
    assert points[2].step_time == pytest.approx(unpriced.step_time + 2 * 64 * 1e-6)


def test_an_evaluation_is_the_rank_graphs_simulation():
    p = problem()
    full = p.evaluate(p.seed("full_ac"))
    g, params = toy()
    rank = shard_step(g, params, ShardSpec(2, UNITS, recompute={u: "full" for u in UNITS}))
    assert full.peak == memory_report(rank).peak
    assert set(rank.recomputed.values()) == {"lin0", "lin1", "lin2", "act0", "act1", "act2"}
    keep = p.evaluate(p.seed("keep_all"))
    assert full.peak < keep.peak and full.step_time > keep.step_time  # 3 x 256 B of activations rerun


def test_search_front_is_under_the_budget_and_non_dominated():
    p = problem()
    keep, full = (p.evaluate(p.seed(s)) for s in ("keep_all", "full_ac"))
    p.budget = (keep.peak + full.peak) // 2
    result = search(p, random.Random(0), population=8, generations=4)
    assert not result.seeds["keep_all"].fits(p.budget) and result.front
    assert all(q.fits(p.budget) for q in result.front)
    for a in result.front:
        assert not any(b.peak <= a.peak and b.step_time <= a.step_time and (b.peak, b.step_time) !=
                       (a.peak, a.step_time) for b in result.front)
    assert result.best == min(result.front, key=lambda q: q.step_time)
    again = search(problem(p.budget), random.Random(0), population=8, generations=4)
    assert [(q.peak, q.step_time) for q in again.front] == [(q.peak, q.step_time) for q in result.front]


def test_reshard_genes_take_the_world_sizes_divisors_up_to_8():
    g, params = toy()
    p = ShardProblem(g, params, ShardSpec(16, UNITS, reshard_after_forward={u: 4 for u in UNITS}),
                     {op.name: 1e-3 for op in g.ops}, Link(1e-5, 1e9), 10**9, 1e10)
    assert p.reshard_groups == (2, 4, 8)
    n = len(p.units)
    assert p.bounds()[-2 - n:-2] == [4] * n  # 0 False, 1 True, 2 / 4 / 8
    seed = p.seed("keep_all")
    assert seed[-2 - n:-2] == (3,) * n and p.decode(seed).reshard == {**{u: 4 for u in UNITS}, "": False}
    genes = list(seed)
    genes[-2 - n:-2] = [0, 1, 4]
    knobs = p.decode(genes)
    assert [knobs.reshard[u] for u in UNITS] == [False, True, 8]
    rank = p.rank(knobs)
    assert rank.ranks(next(op.name for op in rank.graph.ops if op.name.startswith(f"fsdp_all_gather.{UNITS[2].replace('.', '_')}.2"))) == 8
    assert problem().reshard_groups == ()  # W = 2: no integer between 2 and W - 1
