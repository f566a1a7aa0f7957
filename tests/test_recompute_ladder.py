"""gaswap.plan.recompute_ladder: the static model of one block against the rank graph's simulation, the ladder,
the hull and the budget-aware fill (no torch)."""
import dataclasses
import itertools

import pytest
from test_shard_search import UNITS, problem

from gaswap.plan.recompute_ladder import (
    FULL,
    KEEP,
    BlockModel,
    Rung,
    fill,
    fill_first,
    frontier,
    hull,
    ladder,
)
from gaswap.plan.shard_search import peak_bytes


def test_block_model_prices_what_the_rank_graph_holds_and_reruns():
    """Every choice of the toy's block on all three units: the step time rises by three times the block's
    recompute seconds; the peak falls by the held bytes saved of the two units whose activations wait for the
    backward (the last unit's recompute runs as the backward starts, at the peak: its copies are live there)."""
    p = problem()
    keep = p.evaluate(p.seed("keep_all"))
    u = UNITS[1]
    model = BlockModel(p.graph, u, p.owned[u], p.op_time)
    assert model.keep() == Rung((), 64 + 256, 0.0)  # z and h, which the backward reads
    for n in (1, 2):
        for chosen in itertools.combinations(range(model.n), n):
            rung = model.cost(chosen)
            rank = p.rank(dataclasses.replace(keep.knobs, recompute={v: chosen for v in UNITS}))
            assert keep.peak - peak_bytes(rank) == 2 * (model.keep().held - rung.held)
            assert p.time(rank) - keep.step_time == pytest.approx(3 * rung.seconds)
    # the activation alone: h is still held (the next unit's backward reads it), and the matmul's z too (saved)
    assert model.cost((1,)) == Rung((1,), 64 + 256, 1e-3)
    assert model.cost((0,)) == Rung((0,), 256, 1e-3)  # z recomputed from the saved input
    assert p.ladders == [[Rung((0,), 256, 1e-3)]]  # (0, 1) is as much held, slower; (1,) holds as much as keep


def test_frontier_keeps_the_rungs_nothing_beats():
    rungs = [Rung((1,), 90, 1.0), Rung((2,), 80, 2.0), Rung((3,), 85, 3.0), Rung((4,), 80, 1.5), Rung((5,), 50, 4.0)]
    assert [r.positions for r in frontier(rungs)] == [(1,), (4,), (5,)]


def test_hull_is_the_lower_convex_hull_most_held_first():
    points = [(100, 0.0, "k"), (80, 1.0, "a"), (70, 1.5, "b"), (60, 4.0, "c"), (50, 3.0, "d"), (50, 5.0, "e"),
              (40, 10.0, "f")]
    # a is on the line from k to b; c and e are slower than d, which holds less
    assert [p[2] for p in hull(points)] == ["k", "b", "d", "f"]


def test_fill_spends_the_saving_cheapest_seconds_per_byte_first():
    a = [(100, 0.0, KEEP), (70, 1.5, 0), (50, 3.0, FULL)]  # 0.05 then 0.075 s per byte
    b = [(30, 0.0, KEEP), (20, 0.6, FULL)]  # 0.06 s per byte
    classes = [(2, a), (1, b)]
    assert fill(classes, 0) == [(0, KEEP, 0), (FULL, KEEP, 0)]
    assert fill(classes, 30) == [(0, KEEP, 1), (FULL, KEEP, 0)]  # one unit of a on rung 0
    assert fill(classes, 61) == [(FULL, 0, 0), (FULL, FULL, 0)]  # both of a on rung 0, then b's unit
    assert fill(classes, 85) == [(FULL, 0, 1), (FULL, FULL, 0)]  # 70 saved, then 20 more
    assert fill(classes, 10**9) == [(FULL, FULL, 0), (FULL, FULL, 0)]  # as much as there is


def test_ladder_rungs_are_non_dominated_and_ordered():
    p = problem()
    u = UNITS[0]
    model = BlockModel(p.graph, u, p.owned[u], p.op_time)
    rungs = ladder(model, p.selectable[0], p.by_bytes_per_second(u, p.selectable[0]))
    assert all(a.held > b.held and a.seconds < b.seconds for a, b in itertools.pairwise(rungs))
    every = [model.cost(c) for n in (1, 2) for c in itertools.combinations(range(model.n), n)]
    for r in rungs:
        assert not any(o.held <= r.held and o.seconds <= r.seconds and (o.held, o.seconds) != (r.held, r.seconds)
                       for o in every)


def test_fill_fits_the_budget_faster_than_any_uniform_choice():
    """One unit's saving below keep-all: the fill recomputes the matmul of one unit only; every choice taken by
    all units alike that fits pays three times that."""
    p = problem()
    keep = p.evaluate(p.seed("keep_all"))
    p.budget = keep.peak - 64
    filled = p.evaluate(p.fill(p.seed("keep_all")))
    assert filled.fits(p.budget) and filled.knobs.recompute == {UNITS[0]: (0,)}
    uniform = [p.evaluate(p.seed(s)) for s in ("full_ac", "selective_ac", "greedy_half_ac")]
    uniform += [p.evaluate(p.with_choices([(r, r, 3)], list(keep.genes[p.class_genes():])))
                for r in range(len(p.ladders[0]))]
    fitting = [q for q in uniform if q.fits(p.budget)]
    assert fitting and filled.step_time < min(q.step_time for q in fitting)
    assert filled.step_time == pytest.approx(keep.step_time + 1e-3)
    p.budget = 0  # nothing fits: the fill returns its smallest peak, as much saved as the hulls allow
    last = p.evaluate(p.fill(p.seed("keep_all")))
    assert not last.fits(0) and last.knobs.recompute == {u: (0,) for u in UNITS}


def test_fill_first_keeps_each_class_last_unit_and_puts_the_first_on_one_point():
    a = [(100, 0.0, KEEP), (70, 1.5, 0), (50, 3.0, FULL)]
    b = [(30, 0.0, KEEP), (20, 0.6, FULL)]
    # a's 3 units: at most 2 move, each 30 (rung 0, 1.5 s) or 50 (full, 3 s); b's 2 units: at most 1, 10 (0.6 s)
    classes = [(3, a), (2, b)]
    assert fill_first(classes, 0) == [(KEEP, KEEP, 0), (KEEP, KEEP, 0)]
    assert fill_first(classes, 10) == [(KEEP, KEEP, 0), (FULL, KEEP, 1)]  # 0.6 s, not a's 1.5
    assert fill_first(classes, 30) == [(0, KEEP, 1), (KEEP, KEEP, 0)]
    assert fill_first(classes, 50) == [(FULL, KEEP, 1), (KEEP, KEEP, 0)]  # 3 s: two on rung 0 also take 3 s
    assert fill_first(classes, 70) == [(0, KEEP, 2), (FULL, KEEP, 1)]  # 60 + 10 at 3.6 s
    assert fill_first(classes, 10**9) == [(FULL, KEEP, 2), (FULL, KEEP, 1)]  # as much as there is
    assert fill_first([(1, a)], 30) == [(KEEP, KEEP, 0)]  # a class of one: its only unit is its last


def test_fill_keeps_the_last_unit_where_its_recompute_meets_the_peak():
    """In the toy the peak comes as the last unit's recompute runs: where the hull fill overshoots, the fill
    with the last unit kept is tried too, and the faster fitting plan taken."""
    p = problem()
    keep = p.evaluate(p.seed("keep_all"))
    p.budget = keep.peak - 128  # two units' saving: the first two recompute their matmul, the last keeps all
    filled = p.evaluate(p.fill(p.seed("keep_all")))
    assert filled.fits(p.budget) and filled.knobs.recompute == {UNITS[0]: (0,), UNITS[1]: (0,)}
    assert filled.step_time == pytest.approx(keep.step_time + 2e-3)
