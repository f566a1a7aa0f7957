"""Chromosome decoding and variation operators on small synthetic graphs (no torch)."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gaswap.plan.encoding import Action, Chromosome, Encoding, crossover, mutate
from gaswap.plan.graph import chain, residual_graph

K, S, R = Action.KEEP, Action.SWAP, Action.RECOMPUTE


def is_valid_order(graph, order):
    position = {graph.ops[i].name: p for p, i in enumerate(order)}
    if sorted(order) != list(range(len(graph.ops))):
        return False
    fwd = [position[o.name] for o in graph.ops if o.phase == "fwd"]
    bwd = [position[o.name] for o in graph.ops if o.phase == "bwd"]
    if fwd and bwd and max(fwd) > min(bwd):
        return False
    for op in graph.ops:
        for t in op.inputs:
            src = graph.tensors[t].producer
            if src is not None and position[src] > position[op.name]:
                return False
    return True


def test_captured_keys_decode_to_the_captured_order():
    for g in (chain(5), residual_graph(40)):
        enc = Encoding(g)
        assert enc.decode(enc.captured_keys()) == list(range(len(g.ops)))


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=40), st.integers(min_value=0, max_value=2**32))
def test_any_keys_decode_to_a_valid_order(n_ops, seed):
    g = residual_graph(4 * n_ops)
    enc = Encoding(g)
    rng = random.Random(seed)
    keys = tuple(rng.uniform(-5, 5) for _ in g.ops)
    assert is_valid_order(g, enc.decode(keys))


def test_keys_change_the_order_where_the_graph_allows():
    g = residual_graph(10)  # two layers; weight gradients may run anywhere after their input
    enc = Encoding(g)
    rng = random.Random(0)
    orders = {tuple(enc.decode(tuple(rng.random() for _ in g.ops))) for _ in range(50)}
    assert len(orders) > 1
    assert all(is_valid_order(g, list(o)) for o in orders)


def test_allowed_actions_follow_the_search_space():
    g = chain(4)
    # candidates: the input x (read by b1) and a1..a3; an input has no producer to re-run
    assert Encoding(g).candidates == ["x", "a1", "a2", "a3"]
    assert Encoding(g).allowed == [(K, S)] + [(K, S, R)] * 3
    assert Encoding(g, (K, S)).allowed == [(K, S)] * 4
    assert Encoding(g, (S,)).allowed == [(K, S)] * 4  # keep is always allowed
    assert Encoding(g).uniform(S).actions == (S, S, S, S)
    assert Encoding(g, (K, R)).uniform(S).actions == (K, K, K, K)


def test_variation_is_deterministic_and_stays_allowed():
    g = residual_graph(40)
    enc = Encoding(g, (K, S))

    def children(seed):
        rng = random.Random(seed)
        a, b = enc.random(rng), enc.random(rng)
        c, d = crossover(a, b, rng, kind="two_point")
        return [mutate(x, rng, enc.allowed, key_indpb=0.5, action_indpb=0.5) for x in (c, d)]

    first, again = children(7), children(7)
    assert first == again
    for c in first:
        assert len(c.keys) == len(g.ops) and len(c.actions) == len(enc.candidates)
        assert all(Action(a) in allowed for a, allowed in zip(c.actions, enc.allowed))


def test_fixed_order_mutation_leaves_keys_alone():
    enc = Encoding(chain(6))
    c = enc.uniform(K)
    m = mutate(c, random.Random(1), enc.allowed, order=False, key_indpb=1.0, action_indpb=1.0)
    assert m.keys == c.keys and isinstance(m, Chromosome)


def test_random_and_mutating_ops_keep_their_captured_order():
    # Weight gradients bw7 and bw3 may run anywhere after their inputs; pinned, bw7 stays before bw3.
    g = residual_graph(50)
    pinned = {"bw7", "bw3"}
    g = type(g)(tuple(type(o)(**(o.__dict__ | {"recomputable": o.name not in pinned})) for o in g.ops), g.tensors,
                loss=g.loss)
    rng = random.Random(5)
    free, enc = Encoding(residual_graph(50)), Encoding(g)

    def bw7_first(encoding):
        order = [g.ops[i].name for i in encoding.decode(tuple(rng.random() for _ in g.ops))]
        return order.index("bw7") < order.index("bw3")

    assert not all(bw7_first(free) for _ in range(30))  # unpinned, some orders swap them
    assert all(bw7_first(enc) for _ in range(30))
