"""The min-cut seed (gaswap.plan.solvers.mincut): the fewest bytes to save, checked against brute force (no torch)."""
import dataclasses
import itertools

from gaswap.base.config import GASettings, load_search_space
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import Graph, chain, residual_graph
from gaswap.plan.op_types import is_compute_intensive
from gaswap.plan.problem import Problem
from gaswap.plan.search import Search, seed_policies
from gaswap.plan.solvers.baselines import min_cut
from gaswap.plan.solvers.mincut import min_cut_policies, min_cut_saved
from helpers import unit_costs


def sized(g: Graph) -> Graph:
    """`g` with tensors of different sizes, so that one cut is the cheapest."""
    tensors = {n: dataclasses.replace(t, size=t.size * (1 + i % 5)) for i, (n, t) in enumerate(g.tensors.items())}
    return Graph(g.ops, tensors, g.resident, g.counted, g.loss)


def recomputable_from(encoding: Encoding, saved: set[int], pinned=lambda target: False) -> bool:
    """Whether the backward can have every candidate: saved, or re-produced by forward ops from saved
    candidates, resident tensors and (recursively) re-produced ones."""
    graph = encoding.graph
    producer = {t: op for op in graph.ops for t in op.outputs}
    have = {encoding.candidates[k] for k in saved}

    def available(t: str) -> bool:
        if t in have or graph.tensors[t].producer is None and graph.tensors[t].kind != "input":
            return True
        op = producer.get(t)
        if op is None or op.phase != "fwd" or not op.recomputable or pinned(op.target):
            return False
        if t in encoding.candidates and Action.RECOMPUTE not in encoding.allowed[encoding.candidates.index(t)]:
            return False
        return all(available(u) for u in op.inputs)

    return all(available(t) for t in encoding.candidates)


def test_the_cut_is_the_fewest_bytes_from_which_the_backward_recomputes_everything():
    for g in (sized(residual_graph(20)), sized(chain(6))):
        encoding = Encoding(g)
        size = [g.tensors[t].size for t in encoding.candidates]
        saved = min_cut_saved(encoding, pinned=lambda target: False)
        assert recomputable_from(encoding, saved)
        best = min(sum(size[k] for k in subset)
                   for r in range(len(size) + 1) for subset in itertools.combinations(range(len(size)), r)
                   if recomputable_from(encoding, set(subset)))
        assert sum(size[k] for k in saved) == best


def test_on_a_chain_only_the_input_is_saved_unless_its_ops_are_is_compute_intensive():
    g = chain(6)
    encoding = Encoding(g)
    assert {encoding.candidates[k] for k in min_cut_saved(encoding, pinned=lambda target: False)} == {"x"}
    mm = Graph(tuple(dataclasses.replace(op, target="aten.mm.default") for op in g.ops), g.tensors, loss=g.loss)
    assert len(min_cut_saved(Encoding(mm))) == len(encoding.candidates)  # torch never recomputes a matmul
    assert is_compute_intensive("aten.addmm.default") and is_compute_intensive("aten.convolution.default")
    assert not is_compute_intensive("aten.gelu.default") and not is_compute_intensive("aten.add.Tensor")


def test_min_cut_policies_save_by_keeping_or_swapping_as_the_space_allows():
    g = residual_graph(30, size=100)
    costs = unit_costs(g, bandwidth=200.0)
    for space, saving in (("recompute_only", {Action.KEEP}), ("hybrid", {Action.KEEP, Action.SWAP})):
        problem = Problem(g, costs, 2000, load_search_space(space))
        policies = min_cut_policies(problem)
        assert policies and {a for c in policies for a in c.actions} == saving | {Action.RECOMPUTE}
        assert all(c.keys == problem.encoding.captured_keys() for c in policies)
    assert min_cut_policies(Problem(g, costs, 2000, load_search_space("swap_only"))) == []


def test_the_min_cut_baseline_is_the_fastest_fitting_keep_recompute_cut():
    g = residual_graph(30, size=100)
    costs = unit_costs(g, bandwidth=200.0)
    keep = Problem(g, costs).keep_all().peak_bytes
    for budget, fits in ((keep, True), (keep // 2, False)):
        problem = Problem(g, costs, budget, actions=(Action.KEEP, Action.RECOMPUTE))
        c = min_cut(g, costs, budget)
        evaluated = [problem.evaluate(p) for p in min_cut_policies(problem)]
        fitting = [e.step_time for e in evaluated if e.feasible(budget)]
        assert bool(fitting) == fits
        if fits:
            assert problem.evaluate(c).step_time == min(fitting)
        else:  # none fits: the lowest peak
            assert problem.evaluate(c).peak_bytes == min(e.peak_bytes for e in evaluated)


def test_the_search_is_seeded_with_the_min_cut_and_the_milp_where_they_fit():
    g = residual_graph(30, size=100)
    costs = unit_costs(g, bandwidth=200.0)
    keep = Problem(g, costs).keep_all().peak_bytes
    problem = Problem(g, costs, keep, load_search_space("recompute_only"))
    seeds = seed_policies(problem, milp_ops=1000)
    assert {"min_cut", "milp"} <= set(seeds)
    assert all(problem.evaluate(c).feasible(problem.budget) for name, c in seeds.items()
               if name not in ("keep_all", "recompute_all", "swap_all"))
    assert "milp" not in seed_policies(problem, milp_ops=len(g.ops) - 1)
    s = Search(problem, GASettings(population=8, generations=1, milp_seed_ops=1000), seed=0)
    assert {"min_cut", "milp"} <= set(s.seed_chromosomes)
