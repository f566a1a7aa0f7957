"""Exact timelines of the simulator on hand-worked graphs (sizes in bytes, times in seconds); the fast
untraced run against the traced one, and liveness against a plain walk, on random graphs and policies."""
import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaswap.plan.costs import Costs
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import Graph, Op, Tensor, chain, residual_graph
from gaswap.plan.simulator import Simulator, liveness
from helpers import trace, unit_costs
from strategies import chromosomes, costs_for, training_graphs

K, S, R = Action.KEEP, Action.SWAP, Action.RECOMPUTE


def run(graph, actions, **costs):
    enc = Encoding(graph)
    order = enc.decode(enc.captured_keys())
    return Simulator(graph, unit_costs(graph, **costs)).run(order, actions, trace=True)


def test_keep_all_chain():
    # chain(3): f1 f2 f3 | b3(a3, a2) b2(g3, a1) b1(g2, x); every tensor 1 byte, every op 1 s; x resident.
    r = run(chain(3), (K, K, K))
    assert trace(r) == [("compute", "run", n, float(i), float(i + 1)) for i, n in
                        enumerate(["f1", "f2", "f3", "b3", "b2", "b1"])]
    # a3 is the loss and stays; a2 goes after b3, g3 and a1 after b2, g2 and g1 (read by nobody) after b1.
    assert r.memory == ((0, 2), (1, 3), (2, 4), (3, 5), (4, 4), (4, 5), (5, 4), (5, 3), (5, 4),
                        (6, 3), (6, 2))
    assert (r.step_time, r.peak_bytes, r.compute_time) == (6.0, 5, 6.0)


def test_recompute_reruns_producer_before_backward_reader():
    r = run(chain(3), (K, R, K))
    assert trace(r)[3:6] == [("compute", "run", "b3", 3, 4), ("compute", "recompute", "f1", 4, 5),
                             ("compute", "run", "b2", 5, 6)]
    assert r.timeline[4].reason == "recompute f1 for b2"
    # a1 freed after f2 (t=2), back at t=4 for b2, freed after it.
    assert r.memory[:5] == ((0, 2), (1, 3), (2, 2), (2, 3), (3, 4))
    assert (r.step_time, r.peak_bytes, r.compute_time) == (7.0, 5, 7.0)


def test_recursive_recompute_runs_each_producer_once():
    r = run(chain(3), (K, R, R))
    assert [(e.kind, e.name, e.reason) for e in r.timeline if e.kind == "recompute"] == [
        ("recompute", "f1", "recompute f1 for f2"), ("recompute", "f2", "recompute f2 for b3")]
    # a1, recomputed on the way to a2, stays until b2 reads it: no second recompute.
    assert (r.step_time, r.compute_time) == (8.0, 8.0)


def _two_output_graph():
    """x -> stats -> (m, v), made together and read by the forward alone; fa(x, m) -> a and fb(v) -> b, both read
    by the backward (bj): a batch norm's mean and variance, read by two branches."""
    tensors = {"x": Tensor("x", 1, "input"), "m": Tensor("m", 1, "activation", "stats"),
               "v": Tensor("v", 1, "activation", "stats"), "a": Tensor("a", 2, "activation", "fa"),
               "b": Tensor("b", 2, "activation", "fb"), "L": Tensor("L", 1, "activation", "join"),
               "g": Tensor("g", 1, "activation", "bj")}
    ops = (Op("stats", "var_mean", ("x",), ("m", "v"), "fwd"), Op("fa", "sub", ("x", "m"), ("a",), "fwd"),
           Op("fb", "rsqrt", ("v",), ("b",), "fwd"), Op("join", "mul", ("a", "b"), ("L",), "fwd"),
           Op("bj", "mul_backward", ("L", "a", "b"), ("g",), "bwd"))
    return Graph(ops, tensors, loss="L")


def test_an_op_recomputed_for_one_output_keeps_the_other_for_the_same_readers_recomputations():
    graph = _two_output_graph()
    assert graph.candidates() == ["a", "b"]
    r = run(graph, (R, R))
    # stats runs again once: v, made with m for a's recomputation, stays for b's (before: stats ran twice)
    assert [(e.name, e.reason) for e in r.timeline if e.kind == "recompute"] == [
        ("stats", "recompute stats for fa"), ("fa", "recompute fa for bj"), ("fb", "recompute fb for bj")]
    assert r.compute_time == 5 + 3
    # and goes before bj runs: bj runs with x 1, L 1, a 2, b 2 and its output g 1
    assert r.peak_bytes == 1 + 1 + 2 + 2 + 1


def test_swap_overlaps_and_prefetches_just_in_time():
    r = run(chain(3), (K, S, S))
    assert trace(r) == [
        ("compute", "run", "f1", 0, 1), ("d2h", "swap_out", "a1", 1, 2), ("compute", "run", "f2", 1, 2),
        ("d2h", "swap_out", "a2", 2, 3), ("compute", "run", "f3", 2, 3),
        # both prefetches are issued after the last forward reader (f3); the one needed first goes first
        ("h2d", "swap_in", "a2", 3, 4), ("h2d", "swap_in", "a1", 4, 5),
        ("compute", "wait", "b3", 3, 4), ("compute", "run", "b3", 4, 5),
        ("compute", "run", "b2", 5, 6), ("compute", "run", "b1", 6, 7)]
    assert r.timeline[7].reason == "wait for swap-in of a2"
    assert r.timeline[5].reason == "swap-in a2: prefetch for b3"
    assert (r.step_time, r.peak_bytes, r.compute_time) == (7.0, 5, 6.0)


def test_copies_that_hold_up_compute_run_in_line_just_before_the_reader():
    """On a CPU "device" the runtime copies to and from its host store on the compute thread: each copy
    delays the next op, and a swapped tensor is copied back right before its reader (earlier would only
    hold memory longer)."""
    g = chain(3)
    enc = Encoding(g)
    costs = dataclasses.replace(unit_costs(g), copies_overlap=False)
    r = Simulator(g, costs).run(enc.decode(enc.captured_keys()), (K, S, S), trace=True)
    assert trace(r) == [
        ("compute", "run", "f1", 0, 1), ("d2h", "swap_out", "a1", 1, 2), ("compute", "run", "f2", 2, 3),
        ("d2h", "swap_out", "a2", 3, 4), ("compute", "run", "f3", 4, 5),
        ("h2d", "swap_in", "a2", 5, 6), ("compute", "run", "b3", 6, 7),
        ("h2d", "swap_in", "a1", 7, 8), ("compute", "run", "b2", 8, 9), ("compute", "run", "b1", 9, 10)]
    assert (r.step_time, r.compute_time) == (10.0, 6.0)
    assert r.peak_bytes == 5  # while b2 runs: x, the loss a3, g3, a1 (back just now) and g2


def test_swapped_memory_is_freed_when_the_copy_lands_not_before():
    # 2 s copies (bandwidth 0.5): a1's d2h copy runs 1..3, so its device bytes go at t=3, not at t=2.
    r = run(chain(3), (K, S, K), bandwidth=0.5)
    assert ("d2h", "swap_out", "a1", 1, 3) in trace(r)
    assert r.memory[:6] == ((0, 2), (1, 3), (2, 4), (3, 3), (3, 4), (3, 5))
    # the prefetch, due at f3 (t=2), waits until the device copy is gone rather than hold a1 twice
    assert ("h2d", "swap_in", "a1", 3, 5) in trace(r)


def test_prefetch_starts_early_enough_to_hide_the_copy():
    # Long chain: a1 is needed by b2 at position 8; a 2 s copy is issued 2 ops ahead, at position 6.
    g = chain(5)
    r = run(g, (K, S, K, K, K), bandwidth=0.5)
    swap_in = [e for e in r.timeline if e.kind == "swap_in"]
    assert [(e.start, e.end) for e in swap_in] == [(6.0, 8.0)]
    assert not [e for e in r.timeline if e.kind == "wait"]
    assert r.step_time == 10.0


def _dropout_graph():
    """x -> drop -> d -> f -> t (loss); backward reads d first (bd), then t (bt)."""
    tensors = {
        "x": Tensor("x", 1, "input"),
        "d": Tensor("d", 4, "activation", "drop"),
        "t": Tensor("t", 2, "activation", "f"),
        "L": Tensor("L", 1, "activation", "loss"),
        "gd": Tensor("gd", 1, "activation", "bd"),
        "gt": Tensor("gt", 1, "activation", "bt"),
    }
    ops = (
        Op("drop", "dropout", ("x",), ("d",), "fwd", recomputable=False),
        Op("f", "f", ("d",), ("t",), "fwd"),
        Op("loss", "loss", ("t",), ("L",), "fwd"),
        Op("bd", "bd", ("L", "d"), ("gd",), "bwd"),
        Op("bt", "bt", ("gd", "t"), ("gt",), "bwd"),
    )
    return Graph(ops, tensors, loss="L")


def test_random_op_outputs_are_never_recomputed():
    enc = Encoding(_dropout_graph())
    assert enc.candidates == ["d", "t"]  # x is read by the forward pass only
    assert enc.allowed == [(K, S), (K, S, R)]


def test_policy_that_needs_a_gone_random_output_is_invalid():
    # t is recomputed for bt, which needs d; d was kept only until bd, and dropout may not run twice.
    r = run(_dropout_graph(), (K, R))
    assert not r.valid
    assert r.reason == "d is needed by f but is gone and its producer is random or mutates state"


def test_a_kept_tensor_stays_for_the_recomputations_that_start_from_it_when_sources_are_held():
    """A compiled backward recomputes from what the forward saved: a kept d lives until t, computed from it,
    has been recomputed for bt (the same policy is invalid above, where d goes after its last reader bd)."""
    graph = _dropout_graph()
    enc = Encoding(graph)
    held = Simulator(graph, unit_costs(graph), hold_sources=True).run(enc.decode(enc.captured_keys()), (K, R),
                                                                        trace=True)
    assert held.valid
    assert [(e.name, e.reason) for e in held.timeline if e.kind == "recompute"] == [("f", "recompute f for bt")]
    # d (4 bytes) stays to the end of bt, which runs with x 1 + d 4 + L 1 + gd 1 + t 2 (made again) + gt 1
    assert held.peak_bytes == 10 and held.compute_time == 6.0
    keep_all = Simulator(graph, unit_costs(graph), hold_sources=True).run(enc.decode(enc.captured_keys()), (K, K))
    assert keep_all.peak_bytes == run(graph, (K, K)).peak_bytes  # nothing recomputed: nothing held longer


def _library_output_graph():
    """x -> mm -> s (a library call's output, read by the forward alone) -> soft -> p -> loss -> L; the backward
    reads p (bp)."""
    tensors = {"x": Tensor("x", 1, "input"), "s": Tensor("s", 4, "activation", "mm"),
               "p": Tensor("p", 3, "activation", "soft"), "L": Tensor("L", 1, "activation", "loss"),
               "gp": Tensor("gp", 1, "activation", "bp"), "gx": Tensor("gx", 1, "activation", "bx")}
    ops = (Op("mm", "mm", ("x",), ("s",), "fwd"), Op("soft", "softmax", ("s",), ("p",), "fwd"),
           Op("loss", "loss", ("p",), ("L",), "fwd"), Op("bp", "bp", ("L", "p"), ("gp",), "bwd"),
           Op("bx", "bx", ("gp",), ("gx",), "bwd"))
    return Graph(ops, tensors, loss="L", decidable=frozenset({"s"}))


def test_a_decidable_tensor_is_a_candidate_a_recomputation_can_start_from():
    graph = _library_output_graph()
    assert graph.candidates() == ["s", "p"]  # s: decidable, though no backward op reads it
    assert dataclasses.replace(graph, decidable=frozenset()).candidates() == ["p"]
    assert Graph.from_dict(graph.to_dict()) == graph
    assert graph.fingerprint() != dataclasses.replace(graph, decidable=frozenset()).fingerprint()
    enc = Encoding(graph)
    sim = Simulator(graph, unit_costs(graph), hold_sources=True)
    order = enc.decode(enc.captured_keys())

    def recomputed(actions):
        return [e.name for e in sim.run(order, actions, trace=True).timeline if e.kind == "recompute"]
    assert recomputed((K, R)) == ["soft"]  # p from the kept s
    assert recomputed((R, R)) == ["mm", "soft"]
    assert recomputed((K, K)) == recomputed((R, K)) == []
    # keeping s costs its bytes only where something is recomputed from it
    assert sim.run(order, (K, K)).peak_bytes == sim.run(order, (R, K)).peak_bytes
    # s, kept or re-produced, stays until the recomputation that reads it (through bp, the op it is for)
    assert sim.run(order, (K, R)).peak_bytes == sim.run(order, (R, R)).peak_bytes == 1 + 4 + 3 + 1 + 1
    # what the forward saves for the backward: p (3 bytes), or s to recompute p from (4), or nothing
    assert [sim.run(order, a).saved_bytes for a in ((K, K), (K, R), (R, R))] == [3, 4, 0]


def test_swapped_input_of_a_recompute_comes_back_on_demand():
    r = run(_dropout_graph(), (S, R))
    assert r.valid
    kinds = [(e.kind, e.name) for e in r.timeline if e.kind in ("swap_in", "recompute")]
    assert kinds == [("swap_in", "d"), ("swap_in", "d"), ("recompute", "f")]
    assert r.timeline[[e.kind for e in r.timeline].index("swap_in", 7)].reason == "swap-in d: on demand for f"


def test_a_swapped_input_leaves_at_the_start_and_comes_back_for_the_backward():
    # x (1 byte, resident from the start) is copied out at t=0 and freed after f1, its last forward reader.
    r = run(chain(3), (S, K, K))
    assert ("d2h", "swap_out", "x", 0, 1) in trace(r)
    assert ("h2d", "swap_in", "x", 4, 5) in trace(r)  # just in time for b1 at t=5
    assert r.memory[:3] == ((0, 2), (1, 1), (1, 2))  # after f1: x gone, a2 allocated
    assert (r.step_time, r.peak_bytes) == (6.0, 5)


def test_prefetch_waits_for_room_under_the_budget():
    # a1 swapped with 2 s copies. Unlimited, its prefetch is issued at t=3, beside b3's output: 5 bytes.
    # Under a budget of 4 bytes it waits until b3 has freed a2 (t=4), and b2 waits for it.
    g = chain(3)
    enc = Encoding(g)
    order = enc.decode(enc.captured_keys())
    costs = unit_costs(g, bandwidth=0.5)
    free = Simulator(g, costs).run(order, (K, S, K), trace=True)
    tight = Simulator(g, costs, budget=4).run(order, (K, S, K), trace=True)
    assert ("h2d", "swap_in", "a1", 3, 5) in trace(free)
    assert max(m for t, m in free.memory if t <= 4) == 5
    assert ("h2d", "swap_in", "a1", 4, 6) in trace(tight)
    assert ("compute", "wait", "b2", 4, 6) in trace(tight)
    assert max(m for t, m in tight.memory if t <= 4) == 4
    assert tight.step_time == free.step_time + 1


def test_memory_by_category_adds_up_to_the_total():
    g = _dropout_graph()
    r = run(g, (S, R))
    levels = r.by_category()
    assert [sum(level.values()) for _, level in levels][-1] == r.memory[-1][1]
    assert max(sum(level.values()) for _, level in levels) == r.peak_bytes
    seen = {c for _, level in levels for c, b in level.items() if b}
    assert {"inputs and buffers", "activations", "swapped in", "recomputed"} <= seen


def answers(result):
    return result.step_time, result.peak_bytes, result.compute_time, result.valid, result.reason


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_untraced_run_agrees_with_the_traced_one(data):
    """The untraced main loop is the traced one with its hooks written inline: whatever the graph (random and
    state-mutating ops included), order, policy, budget and copy mode, both give the same answers."""
    graph = data.draw(training_graphs())
    encoding = Encoding(graph)
    costs = dataclasses.replace(data.draw(costs_for(graph)), copies_overlap=data.draw(st.booleans()))
    c = data.draw(chromosomes(encoding))
    sim = Simulator(graph, costs, data.draw(st.none() | st.integers(0, 200)))
    order = encoding.decode(c.keys)
    assert answers(sim.run(order, c.actions)) == answers(sim.run(order, c.actions, trace=True))


def test_the_untraced_run_agrees_with_the_traced_one_on_a_large_graph():
    """The same on a 300-op residual graph: random orders and policies, budgets from none to a third of
    keep-all's peak, overlapping and serial copies."""
    g = residual_graph(300)
    enc = Encoding(g)
    rng = random.Random(0)
    for overlap in (True, False):
        costs = Costs({op.name: 1e-4 * (1 + k % 3) for k, op in enumerate(g.ops)}, 12e9, 6e9, "t", "t",
                      copy_latency=1e-5, copies_overlap=overlap)
        keep = enc.uniform(K)
        peak = Simulator(g, costs).run(enc.decode(keep.keys), keep.actions).peak_bytes
        for budget in (None, peak, peak // 2, peak // 3):
            sim = Simulator(g, costs, budget)
            for c in [enc.random(rng) for _ in range(4)] + [enc.uniform(a) for a in (S, R)]:
                order = enc.decode(c.keys)
                assert answers(sim.run(order, c.actions)) == answers(sim.run(order, c.actions, trace=True))


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_liveness_is_where_tensors_are_read(data):
    """`liveness` (computed on arrays) against a walk over the order: last reader, last forward reader,
    first backward reader."""
    graph = data.draw(training_graphs())
    encoding = Encoding(graph)
    order = encoding.decode(data.draw(chromosomes(encoding)).keys)
    sim = Simulator(graph, data.draw(costs_for(graph)))
    names = list(graph.tensors)
    last_use, last_fwd, first_bwd = ({t: -1 for t in names}, {t: -1 for t in names}, {t: len(order) for t in names})
    for p, i in enumerate(order):
        op = graph.ops[i]
        for t in op.inputs:
            last_use[t] = p
            if op.phase == "fwd":
                last_fwd[t] = p
            else:
                first_bwd[t] = min(first_bwd[t], p)
    assert liveness(sim, order) == ([last_use[t] for t in names], [last_fwd[t] for t in names],
                                     [first_bwd[t] for t in names])


def test_a_tensor_inlined_when_recomputed_takes_no_memory():
    from helpers import unit_costs

    mb = 1 << 20
    t = {"x": Tensor("x", mb, "input"), "a": Tensor("a", mb // 4, "activation", "f1"),
         "b": Tensor("b", mb, "activation", "f2"), "c": Tensor("c", mb, "activation", "f3"),
         "y": Tensor("y", mb, "activation", "f4"), "g": Tensor("g", mb, "activation", "b1")}
    ops = (Op("f1", "aten.mul.Tensor", ("x",), ("a",)), Op("f2", "aten.mul.Tensor", ("a",), ("b",)),
           Op("f3", "aten.mul.Tensor", ("x",), ("c",)), Op("f4", "aten.mul.Tensor", ("b", "c"), ("y",)),
           Op("b1", "aten.mul.Tensor", ("y", "b", "a"), ("g",), phase="bwd"))
    g = Graph(ops, t, loss="y")
    order = list(range(len(ops)))
    actions = [int(Action.RECOMPUTE if c == "b" else Action.KEEP) for c in g.candidates()]
    plain = Simulator(g, unit_costs(g), hold_sources=True).run(order, actions, trace=True)
    inlined = Simulator(g, unit_costs(g), hold_sources=True, inlined_if_recomputed={"b"}).run(order, actions,
                                                                                             trace=True)
    assert inlined.peak_bytes == plain.peak_bytes - mb  # b, alive with c and y in the forward, takes nothing
    assert not any(category == "recomputed" and delta for _, category, delta in inlined.changes)
    assert any(category == "recomputed" and delta for _, category, delta in plain.changes)
