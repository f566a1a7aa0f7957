"""The NSGA-II search, the policy file and the results folder on small synthetic graphs (no torch)."""
import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaswap.app import results
from gaswap.base.config import GASettings, load_search_space
from gaswap.plan import checkpoint as checkpoints
from gaswap.plan import policy as policies
from gaswap.plan import stopping
from gaswap.plan.encoding import Action, Encoding
from gaswap.plan.front import FASTEST_KEPT, Fastest, Front, hypervolume
from gaswap.plan.graph import chain, residual_graph
from gaswap.plan.problem import Evaluated, Generation, Problem
from gaswap.plan.search import Search, _individual, _tournament, search, select
from gaswap.plan.stopping import stopping_generation
from helpers import unit_costs

GA = GASettings(population=24, generations=15)


@pytest.fixture(scope="module")
def problem():
    g = residual_graph(40, size=100)
    return g, unit_costs(g, bandwidth=200.0)


def run(problem, budget, space="hybrid", **ga):
    g, costs = problem
    settings = GASettings(**(GA.__dict__ | ga))
    return search(Problem(g, costs, budget, load_search_space(space)), settings, seed=3)


def test_same_seed_same_front_with_any_number_of_workers(problem):
    one, two = run(problem, 1500), run(problem, 1500, workers=2)
    assert [(e.step_time, e.peak_bytes, e.chromosome) for e in one.front] == \
           [(e.step_time, e.peak_bytes, e.chromosome) for e in two.front]
    def without_clock(history):
        return [dataclasses.replace(h, seconds=0) for h in history]

    assert without_clock(one.history) == without_clock(two.history)


def test_best_fits_and_beats_every_seed_that_fits(problem):
    keep = run(problem, 10**9).seeds["keep_all"]
    budget = int(0.6 * keep.peak_bytes)
    r = run(problem, budget, generations=30)
    assert r.best.peak_bytes <= budget
    fitting = [e.step_time for e in r.seeds.values() if e.feasible(budget)]
    assert fitting and r.best.step_time < min(fitting)
    # the front is sorted fastest first and nobody on it dominates another
    times = [e.step_time for e in r.front]
    peaks = [e.peak_bytes for e in r.front]
    assert times == sorted(times) and peaks == sorted(peaks, reverse=True)


def test_recompute_only_space_never_swaps(problem):
    r = run(problem, 1500, space="recompute_only")
    assert all(e.counts()["swap"] == 0 for e in r.front)
    enc = Encoding(problem[0])
    assert all(e.chromosome.keys == enc.captured_keys() for e in r.front)


def test_an_impossible_budget_gives_an_empty_front_and_the_smallest_peak(problem):
    r = run(problem, 10)
    assert r.front == () and r.best is None
    assert r.smallest_peak > 10


BUDGET_4GB = 4 * 10**9


def individuals(points, budget=BUDGET_4GB):
    """DEAP individuals of (step time, peak[, valid]) points, each chromosome distinct, named by position."""
    c = Encoding(chain(2)).uniform(Action.KEEP)
    return [_individual(Evaluated(type(c)((float(k),) * len(c.keys), c.actions), float(p[0]), int(p[1]), *p[2:]),
                        budget) for k, p in enumerate(points)]


def names(population, chosen):
    return [population.index(i) for i in chosen]


# budget 4 GB, peaks of GBs as AlexNet's: fronts of the feasible {0, 1, 2}, {3}, {4}; over budget 5 (5 %), 6 (25 %),
# 7 (5 %, after 5); 8 invalid. 5 and 6 are faster than any feasible point, 5 also lower than 0 and 3
POPULATION = [(0.70, 3.9e9), (0.80, 3.0e9), (0.90, 2.5e9), (0.85, 3.5e9), (0.95, 3.6e9),
              (0.60, 4.2e9), (0.50, 5.0e9), (0.65, 4.2e9), (0.0, 0, False)]


def test_selection_takes_the_feasible_first_then_the_least_violation():
    population = individuals(POPULATION)
    assert [i.violation for i in population] == [0, 0, 0, 0, 0, 0.05, 0.25, 0.05, math.inf]
    assert names(population, select(population, 9)) == [0, 1, 2, 3, 4, 5, 7, 6, 8]
    assert names(population, select(population, 6)) == [0, 1, 2, 3, 4, 5]  # the first over budget: 5, not 7
    assert names(population, select(population, 5)) == [0, 1, 2, 3, 4]  # no over-budget point while feasible ones wait
    reverse = population[::-1]
    assert [population.index(i) for i in select(reverse, 9)[5:]] == [7, 5, 6, 8]  # equal violations: in given order
    assert all(i.fitness.crowding_dist == 0.0 for i in population[5:])


def test_selection_is_pareto_on_the_objectives_among_the_feasible():
    # a front of five and 5 behind it (dominated by 1); the extremes are kept (infinite crowding), then the least
    # crowded: crowding distances (time, then peak, each over twice its range) 1: 1.1/8 + 1.1/5, 2: 2/8 + 1/5,
    # 3: 2.9/8 + 1.4/5
    population = individuals([(1.0, 3.0e9), (2.0, 2.0e9), (2.1, 1.9e9), (4.0, 1.0e9), (5.0, 0.5e9), (3.0, 3.0e9)])
    assert names(population, select(population, 6)) == [0, 1, 2, 3, 4, 5]
    assert [i.fitness.crowding_dist for i in population[1:4]] == pytest.approx([1.1 / 8 + 1.1 / 5, 2 / 8 + 1 / 5,
                                                                                 2.9 / 8 + 1.4 / 5])
    assert names(population, select(population, 4)) == [0, 4, 3, 2]  # 1, the most crowded, left out
    assert names(population, select(population, 2)) == [0, 4]
    assert population[5].fitness.crowding_dist == math.inf  # alone on the second front


def test_tournaments_compare_by_constraint_domination():
    population = individuals(POPULATION)
    select(population, len(population))  # crowding distances set
    pairs = [(5, 2), (2, 5), (6, 7), (8, 6), (3, 4), (4, 3), (0, 2), (2, 1), (1, 2)]

    class Drawn:  # an rng that draws the pairs above
        def __init__(self):
            self.pairs = iter(pairs)

        def sample(self, population, n):
            return [population[k] for k in next(self.pairs)]

    winners = names(population, _tournament(population, len(pairs), Drawn()))
    # feasible beats faster and smaller infeasible; less violation; invalid loses; lower front; extremes (inf
    # crowding) beat the middle point whichever is drawn first; equal crowding: the first drawn
    assert winners == [2, 2, 7, 6, 3, 3, 0, 2, 2]
    assert population[0].fitness.crowding_dist == population[2].fitness.crowding_dist == math.inf
    assert population[1].fitness.crowding_dist < math.inf


def constraint_dominates(a: Evaluated, b: Evaluated, budget: int) -> bool:
    """Deb's constraint-domination: `a` fits and `b` does not; both break the budget and `a` less; or both fit
    and `a` is at least as good on both objectives and better on one."""
    va, vb = a.violation(budget), b.violation(budget)
    if va or vb:
        return va < vb
    return a.step_time <= b.step_time and a.peak_bytes <= b.peak_bytes and a.objectives != b.objectives


points = st.tuples(st.floats(0.0, 1e6), st.integers(0, 8 * 10**9), st.booleans())


@given(st.lists(points, min_size=1, max_size=30), st.integers(1, 30), st.integers(1, 6 * 10**9))
def test_no_point_left_out_constraint_dominates_a_point_selected(population, k, budget):
    population = individuals(population, budget)
    chosen = select(population, k)
    assert len(chosen) == min(k, len(population)) and len({id(i) for i in chosen}) == len(chosen)
    left = [i for i in population if all(i is not j for j in chosen)]
    assert not any(constraint_dominates(o.evaluated, i.evaluated, budget) for o in left for i in chosen)
    violations = [i.violation for i in chosen]
    assert violations == sorted(violations)  # the feasible first, then less violation first


def test_front_keeps_only_nondominated_points():
    enc = Encoding(chain(3))
    front = Front()
    points = [(5, 50), (4, 60), (6, 40), (5, 55), (3, 70), (4, 50)]
    for k, (t, m) in enumerate(points):
        c = enc.uniform(Action.KEEP)
        c = type(c)(tuple(x + k for x in c.keys), c.actions)
        front.update([Evaluated(c, float(t), m)])
    assert [(e.step_time, e.peak_bytes) for e in front.fastest_first()] == [(3, 70), (4, 50), (6, 40)]
    assert len(front) == 3 and list(Front(front)) == list(front)  # as a checkpoint restores it
    assert front.hypervolume((7, 80)) == hypervolume([(3, 70), (4, 50), (6, 40)], (7, 80))


def test_fastest_keeps_the_fastest_points_one_per_prediction_the_first_winning():
    c = Encoding(chain(3)).uniform(Action.KEEP)
    points = [Evaluated(type(c)((float(k),) * len(c.keys), c.actions), 1.0 + (k * 7 % 20) // 2, 100 - k % 4)
              for k in range(60)]  # 20 distinct predictions in a shuffled order, each made by 3 chromosomes
    fastest = Fastest(points)
    firsts = {}
    for e in points:
        firsts.setdefault(e.objectives, e)
    assert fastest.points == sorted(firsts.values(), key=lambda e: e.objectives)[:FASTEST_KEPT]
    assert Fastest(fastest.points).points == fastest.points  # as a checkpoint restores it


def test_a_search_keeps_its_fastest_feasible_policies(problem):
    g, costs = problem
    evaluated = []

    def recording_map(func, items):
        out = list(map(func, items))
        evaluated.extend(out)
        return out

    s = Search(Problem(g, costs, 1500, load_search_space("hybrid")), GA, 3, map=recording_map)
    s.initial()
    while s.has_next():
        s.step()
    r = s.result()
    assert len(r.fastest) == FASTEST_KEPT and r.fastest[0] == r.front[0]
    assert all(e.feasible(1500) for e in r.fastest)
    assert [e.objectives for e in r.fastest] == sorted({e.objectives for e in r.fastest})  # sorted, distinct
    first = {}
    for e in evaluated:
        if e.feasible(1500):
            first.setdefault(e.objectives, e)
    assert list(r.fastest) == sorted(first.values(), key=lambda e: e.objectives)[:FASTEST_KEPT]
    assert run(problem, 10).fastest == ()  # nothing fits


def test_hypervolume_by_hand():
    assert hypervolume([(1, 3), (2, 1)], (4, 4)) == 3 * 1 + 2 * 2
    assert hypervolume([(5, 1)], (4, 4)) == 0


def test_policy_round_trip_and_refusal(problem, tmp_path):
    g, _ = problem
    enc = Encoding(g)
    c = enc.uniform(Action.SWAP)
    p = policies.from_result(g, enc.candidates, enc.decode(c.keys), c.actions, {"peak_bytes": 1}, {"x": 1})
    policies.save(p, tmp_path / "p.yaml")
    back = policies.load(tmp_path / "p.yaml", g)
    assert back == p and back.action_codes(enc.candidates) == c.actions
    assert back.order_indices(g) == enc.decode(c.keys)
    with pytest.raises(policies.PolicyError, match="made for graph .* but this model and inputs give graph"):
        policies.load(tmp_path / "p.yaml", chain(3))
    text = (tmp_path / "p.yaml").read_text()
    (tmp_path / "cut.yaml").write_text(text[: len(text) // 3].rsplit("\n", 1)[0] + "\n  - [broken")
    with pytest.raises(policies.PolicyError, match="cut.yaml: (not a readable|missing)"):
        policies.load(tmp_path / "cut.yaml")
    (tmp_path / "v9.yaml").write_text(text.replace("gaswap_policy: 1", "gaswap_policy: 9"))
    with pytest.raises(policies.PolicyError, match="version 9"):
        policies.load(tmp_path / "v9.yaml")


def test_results_folder(problem, tmp_path):
    g, costs = problem
    r = run(problem, 1500)
    enc = Encoding(g)

    def make_policy(e):
        return policies.from_result(g, enc.candidates, enc.decode(e.chromosome.keys), e.chromosome.actions,
                                    results.point(e, r.seeds["keep_all"]), {})

    out = results.write(tmp_path / "exp", r, make_policy, {"experiment": "exp", "budget_bytes": 1500})
    front = list(csv.DictReader(open(out / "front.csv")))
    assert len(front) == len(r.front) and list(front[0]) == list(results.FRONT_COLUMNS)
    assert all((out / row["policy"]).exists() for row in front)
    history = list(csv.DictReader(open(out / "history.csv")))
    assert len(history) == GA.generations
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["peak_bytes"] == r.best.peak_bytes <= 1500
    assert summary["evaluations"] == r.evaluations
    assert summary["stopped_by"] == "generations" and summary["complete"]
    assert policies.load(out / "policy.yaml", g).predicted["step_time_s"] == r.best.step_time
    # writing again replaces the folder whole, leaving no temporary folders behind
    results.write(tmp_path / "exp", r, make_policy, {"experiment": "exp"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_a_policy_cut_inside_its_program_or_edited_is_refused(problem, tmp_path):
    g, costs = problem
    enc = Encoding(g)
    c = enc.uniform(Action.SWAP)
    p = policies.from_result(g, enc.candidates, enc.decode(c.keys), c.actions, {}, {},
                             program=[("run", op.name) for op in g.ops])
    policies.save(p, tmp_path / "p.yaml")
    lines = (tmp_path / "p.yaml").read_text().splitlines(keepends=True)
    cut = [line for line in lines if not line.startswith("checksum")]
    (tmp_path / "cut.yaml").write_text("".join(cut[:-5]) + "".join(line for line in lines if line.startswith("checksum")))
    with pytest.raises(policies.PolicyError, match="cut.yaml: checksum mismatch"):
        policies.load(tmp_path / "cut.yaml")
    (tmp_path / "edit.yaml").write_text("".join(lines).replace(": swap", ": keep", 1))
    with pytest.raises(policies.PolicyError, match="edit.yaml: checksum mismatch"):
        policies.load(tmp_path / "edit.yaml")


def test_a_converged_search_stops_and_says_so(problem):
    r = run(problem, 1500, generations=500, patience=5, tolerance=0.001)
    assert r.complete and r.stopped_by == "converged" and r.generations_done < 500

    def stalled(k):  # no improvement beyond the tolerance over the 5 generations ending at history[k]
        now, then = r.history[k], r.history[k - 5]
        return now.best_time_s >= then.best_time_s * 0.999 and now.hypervolume <= then.hypervolume * 1.001

    assert stalled(len(r.history) - 1) and not any(stalled(k) for k in range(5, len(r.history) - 1))
    # while nothing fits, nothing has converged
    assert run(problem, 10, generations=12, patience=5).stopped_by == "generations"


def test_the_default_patience_waits_out_a_plateau_of_44_generations():
    # the longest plateau before a gain of 0.5 points or more in the recorded searches (AlexNet seed 1; a 48-layer
    # GPT's seed 4 sat 28 generations at +10.3 % before reaching +7.9 %): best time and hypervolume creep by less
    # than the tolerance from generation 6 to 49, then the best time drops by 2 % and nothing moves any more
    ga = GASettings()

    def record(g):
        best = 1.10 if g <= 5 else 1.08 * (1 - 1e-5 * min(g, 49)) if g < 50 else 1.06
        return Generation(g, 64 * g, best, 10, 5.0 + 1e-6 * g + (0.1 if g >= 50 else 0.0), 0.1 * g)

    history = [record(g) for g in range(1, 50 + ga.patience + 2)]

    assert stopping_generation(history, ga.patience, ga.tolerance) + 1 == 50 + ga.patience  # patience after the gain
    assert stopping_generation(history, 20, ga.tolerance) + 1 == 26  # the old default stopped on it, 2 % short


def test_the_default_patience_on_recorded_48_layer_histories():
    # results/stopping_rule: five 200-generation searches of a 48-layer GPT at 0.4x (patience off); patience 20
    # stopped seed 4 at generation 37, 2.58 points of overhead short; the default stops every seed within 0.05
    path = Path(__file__).resolve().parents[1] / "results/stopping_rule/gpt48_seeds0-4.json"
    recorded, ga = json.loads(path.read_text()), GASettings()

    for seed, rows in recorded["runs"].items():
        history = [Generation(**row) for row in rows]
        stopped = history[stopping_generation(history, ga.patience, ga.tolerance)]
        assert (stopped.best_time_s - history[-1].best_time_s) / recorded["keep_step_time"] < 0.0005, seed
    seed4 = [Generation(**row) for row in recorded["runs"]["4"]]
    assert stopping_generation(seed4, 20, ga.tolerance) + 1 == 37
    assert (seed4[36].best_time_s - seed4[-1].best_time_s) / recorded["keep_step_time"] > 0.02


def test_evaluation_and_time_limits_stop_the_search(problem):
    r = run(problem, 1500, generations=500, max_evaluations=200, patience=None)  # convergence off
    assert r.stopped_by == "evaluations" and 200 <= r.evaluations < 200 + GA.population
    r = run(problem, 1500, generations=10**6, max_seconds=0.5, patience=None)
    assert r.stopped_by == "seconds" and r.complete and r.seconds >= 0.5


def test_checkpoints_are_written_at_most_every_checkpoint_seconds(problem, tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(checkpoints, "save", lambda path, state, *a: written.append(state["generation"]))
    g, costs = problem
    search(Problem(g, costs, 1500, load_search_space("hybrid")), GA, 3, checkpoint=tmp_path / "c.json",
           checkpoint_seconds=math.inf)
    assert written == [0, GA.generations]  # the initial population, and the end
    written.clear()
    search(Problem(g, costs, 1500, load_search_space("hybrid")), GA, 3, checkpoint=tmp_path / "c.json",
           checkpoint_seconds=0.0)
    assert written == list(range(GA.generations + 1))


def test_stopping_rules_report_their_progress_and_the_nearest_one():
    def generation(g, best, volume):
        return Generation(g, 10 * g, best, 1, volume, 0.1 * g)

    history = [generation(1, 2.0, 1.0), generation(2, 1.0, 2.0), generation(3, 1.0, 2.0), generation(4, 1.0, 2.0)]
    now = type("Now", (), {"generation": 4, "evaluations": 40, "history": history, "seconds": lambda self: 1.0})()
    ga = GASettings(generations=10, max_evaluations=50, max_seconds=4.0, patience=4, tolerance=0.001)
    rules = stopping.rules(ga, stop=lambda: False)
    assert [(r.name, r.update(now)) for r in rules] == [
        ("generations", 0.4), ("evaluations", 0.8), ("seconds", 0.25), ("converged", 0.5), ("interrupted", 0.0)]
    assert stopping.nearest(rules, now) == ("evaluations", 0.8) and stopping.stopped_by(rules, now) is None
    history.append(generation(5, 1.0, 2.0))
    assert stopping.Converged(4, 0.001).update(now) == 0.75
    now.evaluations = 50
    assert stopping.stopped_by(rules, now) == "evaluations"
