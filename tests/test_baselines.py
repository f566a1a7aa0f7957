"""Baseline policies on small graphs with hand-worked answers (no torch)."""
from types import SimpleNamespace

import pytest
from test_simulator import _dropout_graph

from gaswap.app.bench import _bench, parse_budget
from gaswap.base.config import Budget, GASettings
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.graph import chain, residual_graph
from gaswap.plan.problem import Problem
from gaswap.plan.solvers.baselines import BASELINES, chen_greedy, chen_sqrt, dtr, knapsack
from helpers import unit_costs

K, S, R = Action.KEEP, Action.SWAP, Action.RECOMPUTE


def test_uniform_baselines():
    g = chain(4)  # candidates x, a1, a2, a3; x is an input and cannot be recomputed
    c = unit_costs(g)
    assert BASELINES["keep_all"](g, c, 5).actions == (K, K, K, K)
    assert BASELINES["recompute_all"](g, c, 5).actions == (K, R, R, R)
    assert BASELINES["swap_all"](g, c, 5).actions == (S, S, S, S)


def test_sqrt_checkpointing_of_a_chain_of_16_makes_4_segments():
    # 16 candidates (x, a1..a15): keep every 4th, starting with x; each kept tensor starts a segment
    actions = chen_sqrt(chain(16), unit_costs(chain(16)), 10).actions
    assert [k for k, a in enumerate(actions) if a == K] == [0, 4, 8, 12]
    assert all(a == R for k, a in enumerate(actions) if k % 4)


def test_greedy_segmenting_takes_the_fastest_segment_size_that_fits():
    # chain(4), unit sizes and times, keep-all peak 6, budget 5. Segment sizes 1, 2 and 3 give
    # (K R K R): peak 5, 10 s; (K R R K): 6 (a1 and a2 come back together for b3); (K R R R): 6.
    g = chain(4)
    c = unit_costs(g)
    policy = chen_greedy(g, c, 5)
    assert policy.actions == (K, R, K, R)
    r = Problem(g, c, 5).simulate(policy)
    assert (r.peak_bytes, r.step_time) == (5, 10.0)


def test_dtr_evicts_the_stalest_cheapest_bytes_first():
    # chain(4), budget 5: b4 (t = 4) takes memory to 6. Evictable: a1 (last used at t = 2) and a2 (t = 3);
    # a3 is read by b4. h = cost / (bytes * staleness): a1 1/2, a2 1/1: a1 goes, and that is enough.
    g = chain(4)
    assert dtr(g, unit_costs(g), 5).actions == (K, R, K, K)
    # f1 three times dearer: h(a1) = 3/2 > h(a2) = 1, so a2 goes at b4; at b3 a2 comes back and a1 goes.
    assert dtr(g, unit_costs(g, f1=3.0), 5).actions == (K, R, R, K)
    assert dtr(g, unit_costs(g), 6).actions == (K, K, K, K)  # the keep-all peak fits: nothing evicted


def test_knapsack_saves_the_best_recompute_time_per_byte():
    # recompute seconds per byte: a1 3, a2 1, a3 2. Room: budget 5 - (keep-all peak 6 - 3 bytes) = 2 bytes,
    # so a1 and a3 are saved and a2 recomputed.
    g = chain(4)
    assert knapsack(g, unit_costs(g, f1=3.0, f3=2.0), 5).actions == (K, K, R, K)
    assert knapsack(g, unit_costs(g), 6).actions == (K, K, K, K)


GRAPHS = {"chain": chain(7), "residual": residual_graph(30), "dropout": _dropout_graph()}


@pytest.mark.parametrize("graph", GRAPHS.values(), ids=GRAPHS.keys())
@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_is_a_captured_order_chromosome_of_allowed_actions(graph, name):
    enc = Encoding(graph)
    policy = BASELINES[name](graph, unit_costs(graph), 3)
    assert policy.keys == enc.captured_keys()
    assert all(a in allowed for a, allowed in zip(policy.actions, enc.allowed))


@pytest.mark.parametrize("graph", [GRAPHS["chain"], GRAPHS["residual"]], ids=["chain", "residual"])
@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_is_valid_where_every_recomputation_is(graph, name):
    costs = unit_costs(graph)
    peak = Problem(graph, costs, None).simulate(Encoding(graph).uniform(K)).peak_bytes
    assert Problem(graph, costs, peak * 2 // 3).simulate(BASELINES[name](graph, costs, peak * 2 // 3)).valid


def test_bench_budgets_are_fractions_or_sizes():
    assert parse_budget("0.5") == parse_budget("0.5x") == Budget(fraction=0.5)
    assert parse_budget("4GB") == Budget(bytes=4 * 10**9)
    assert parse_budget("1") == Budget(fraction=1.0)


def test_bench_rows_put_the_hybrid_ga_at_or_below_every_fitting_baseline():
    g = residual_graph(30)
    costs = unit_costs(g, bandwidth=float(1 << 22))
    keep = Problem(g, costs, None).simulate(Encoding(g).uniform(K))
    experiment = SimpleNamespace(ga=GASettings(population=16, generations=10), seed=0)
    prepared = SimpleNamespace(graph=g, costs=costs, experiment=experiment)
    rows = list(_bench(prepared, keep.peak_bytes * 3 // 4, keep.step_time, time_limit=10))
    assert [r["method"] for r in rows] == [*BASELINES, "ga:swap_only", "ga:recompute_only", "ga:order_only",
                                           "ga:hybrid", "milp"]
    hybrid = rows[-2]["step_time_s"]
    assert all(hybrid <= r["step_time_s"] for r in rows if r["feasible"])
    ga, exact = rows[-4], rows[-1]  # the MILP starts from the GA's keep/recompute policy: never slower
    assert ga["feasible"] and f"warm start ga:recompute_only {ga['step_time_s'] * 1e3:.2f} ms" in exact["note"]
    assert exact["step_time_s"] <= ga["step_time_s"]
