"""Identical blocks and block-policy sharing (gaswap.plan.blocks), on synthetic graphs (no torch)."""
import dataclasses
import random

from gaswap.base.config import GASettings, load_search_space
from gaswap.plan.blocks import block_of, repeated_blocks, share, tied
from gaswap.plan.encoding import Encoding
from gaswap.plan.graph import Graph, residual_graph
from gaswap.plan.problem import Problem
from gaswap.plan.search import Search, search
from helpers import unit_costs


def numbered(g: Graph) -> Graph:
    """`g` with layer paths `blocks.<i>` instead of `layer<i>` (as captured transformer layers are named)."""
    ops = tuple(dataclasses.replace(op, layer=op.layer.replace("layer", "blocks.")) for op in g.ops)
    return Graph(ops, g.tensors, g.resident, g.counted, g.loss)


def test_a_block_is_the_layer_path_up_to_its_first_number():
    assert block_of("blocks.3.attn.qkv") == "blocks.3"
    assert block_of("layer2.1.conv1") == "layer2.1"
    assert block_of("head") is None and block_of("") is None


def test_identical_blocks_form_one_class_and_a_different_one_is_left_alone():
    encoding = Encoding(numbered(residual_graph(40)))
    [cls] = repeated_blocks(encoding)
    # the last layer's output is the loss, not a candidate: that block differs from the others
    assert cls.names == tuple(f"blocks.{i}" for i in range(1, 8))
    assert all(len(ops) == 5 and len(cands) == 2 for ops, cands in zip(cls.ops, cls.candidates))
    names = [[encoding.candidates[k] for k in cands] for cands in cls.candidates]
    assert names[0] == ["h1", "x1"] and names[6] == ["h7", "x7"]
    assert repeated_blocks(Encoding(residual_graph(40))) == []  # no numbered layers, no blocks


def test_share_gives_every_block_of_a_class_one_block_s_genes():
    encoding = Encoding(numbered(residual_graph(40)))
    classes = repeated_blocks(encoding)
    rng = random.Random(1)
    c = encoding.random(rng)
    assert not tied(c, classes)
    s = share(c, classes, rng)
    assert tied(s, classes) and s != c
    [cls] = classes
    genes = {tuple(c.keys[i] for i in ops) + tuple(c.actions[k] for k in cands)
             for ops, cands in zip(cls.ops, cls.candidates)}
    assert tuple(s.keys[i] for i in cls.ops[0]) + tuple(s.actions[k] for k in cls.candidates[0]) in genes
    outside = set(range(len(c.keys))) - {i for ops in cls.ops for i in ops}
    assert all(s.keys[i] == c.keys[i] for i in outside)


def shared_search(space_name: str, generations: int) -> tuple[Problem, Search]:
    """A search of a numbered residual graph in `space_name` that shares blocks in every new individual, run
    for `generations` generations."""
    g = numbered(residual_graph(40, size=100))
    space = dataclasses.replace(load_search_space(space_name), share_blocks=1.0)
    problem = Problem(g, unit_costs(g, bandwidth=200.0), 2400, space)
    s = Search(problem, GASettings(population=16, generations=generations, patience=None), seed=0)
    s.initial()
    for _ in range(generations):
        s.step()
    return problem, s


def test_a_search_sharing_every_child_keeps_its_random_individuals_tied():
    problem, s = shared_search("hybrid", 5)
    classes = repeated_blocks(problem.encoding)
    seeds = set(s.seed_chromosomes.values())
    assert all(tied(ind[0], classes) or ind[0] in seeds for ind in s.population)


def test_in_a_space_without_order_sharing_keeps_the_captured_order():
    problem, s = shared_search("recompute_only", 3)
    captured = problem.encoding.captured_keys()
    classes = repeated_blocks(problem.encoding)
    assert all(ind[0].keys == captured for ind in s.population)
    assert all(tied(ind[0], classes, order=False) or ind[0] in set(s.seed_chromosomes.values())
               for ind in s.population)


def test_sharing_changes_nothing_where_the_graph_has_no_repeated_blocks():
    g = residual_graph(40, size=100)
    costs = unit_costs(g, bandwidth=200.0)
    hybrid = load_search_space("hybrid")
    ga = GASettings(population=16, generations=5)
    plain = search(Problem(g, costs, 2400, hybrid), ga, 0)
    shared = search(Problem(g, costs, 2400, dataclasses.replace(hybrid, share_blocks=0.5)), ga, 0)
    assert [e.chromosome for e in plain.front] == [e.chromosome for e in shared.front]



def test_blocks_smaller_than_min_block_ops_form_no_class(monkeypatch):
    """AlexNet's ReLUs `features.9` and `features.11` look alike (one op forward, one backward): too small to
    tie. Here the residual blocks hold 5 ops each: a class at the threshold 4, none above 5."""
    from gaswap.plan import blocks

    encoding = Encoding(numbered(residual_graph(40)))
    assert blocks.MIN_BLOCK_OPS <= 5 and len(repeated_blocks(encoding)) == 1
    monkeypatch.setattr(blocks, "MIN_BLOCK_OPS", 6)
    assert repeated_blocks(encoding) == []
