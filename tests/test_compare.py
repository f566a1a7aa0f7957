"""gaswap compare: its peak meter and its verdicts (the whole comparison compiles seven times: not a unit test;
`python -m gaswap compare experiments/compare_cnn_cpu.yaml` runs it)."""
import pytest
import torch

from gaswap import compare
from gaswap.meter import PeakMeter


def test_cpu_peak_meter_sees_what_a_block_holds_at_once():
    keep = torch.ones(8 << 20)  # resident before: not counted
    with PeakMeter("cpu") as meter:
        a = torch.ones(16 << 20)  # 64 MiB
        b = a * 2  # another 64 MiB while a lives
        del a, b
        c = torch.ones(4 << 20)  # 16 MiB after both are freed: not a new peak
        del c
    assert 128 << 20 <= meter.peak < (128 << 20) + 64  # the allocator counts bytes (and the scalar 2's)
    # An RSS meter reads the whole process: pages of the rest of it may go back to the system while the block
    # runs (seen: 0.2 MiB), so the bounds allow 4 MiB below the block's bytes; missing a 64 MiB tensor still fails.
    assert 124 << 20 <= meter.rss_peak < 140 << 20
    with PeakMeter("cpu") as meter:
        torch.ones(16 << 20).sum()
    assert 64 << 20 <= meter.peak < (64 << 20) + 64  # and the sum's one float
    assert 60 << 20 <= meter.rss_peak < 76 << 20  # memory freed and kept by malloc before is handed back first
    del keep


def test_cpu_peak_meter_ignores_frees_of_what_was_allocated_before():
    before = torch.ones(16 << 20)
    with PeakMeter("cpu") as meter:
        del before  # its size is unknown to the profiler: the meter can only err high, never miss bytes
        a = torch.ones(4 << 20)
        del a
    assert 16 << 20 <= meter.peak < (16 << 20) + 64


def _row(method, knob, peak, step):
    return {"method": method, "knob": knob, "predicted_peak_bytes": None, "predicted_step_s": None, "peak_bytes": peak,
            "peak_min": peak, "peak_max": peak, "step_s": step, "step_min": step, "step_max": step, "wall_step_s": step,
            "compile_s": 0.0, "recomputed": None, "rss_peak_bytes": peak}


def test_goal_compares_each_torch_point_with_the_fastest_gaswap_policy_at_or_below_its_peak():
    rows = [_row("eager", "-", 300, 1.0), _row("torch.compile", "1", 200, 1.0), _row("torch.compile", "0.2", 100, 1.3),
            _row("gaswap", "a", 190, 0.9), _row("gaswap", "b", 120, 1.1), _row("gaswap", "c", 90, 1.4)]
    lines = compare.goal_lines(rows)
    assert "gaswap a" in lines[0] and lines[0].endswith(": met")
    assert "gaswap c" in lines[1] and lines[1].endswith(": not met")  # only c is at or below 100
    table = compare.to_markdown(rows, "x", "cpu")
    assert "| gaswap | b | - | - |" in table and "+10.0%" in table
    rows[3]["origin"] = "torch 1"  # the search's policy at 190 is torch 1.0's own partition
    assert compare.goal_lines(rows)[0].endswith("a tie: gaswap's timing picked this very partition, faster or slower "
                                                "by noise alone")
    rows[3]["origin"] = "torch 0.2"
    assert compare.goal_lines(rows)[0].endswith(": met (gaswap's timing picked torch 0.2's partition)")
    assert "| gaswap (torch 0.2's partition) | a |" in compare.to_markdown(rows, "x", "cpu")


def test_compare_refuses_an_experiment_without_a_loss(tmp_path):
    from gaswap import config

    path = tmp_path / "e.yaml"
    path.write_text("model: {factory: gaswap.zoo:mlp}\ninputs: [{shape: [batch, 32]}]\nloss: external\n"
                    "batch_size: 4\nbudget: 0.5x\n")
    with pytest.raises(config.ConfigError, match="loss"):
        compare.run(path, results_root=tmp_path)


def test_pick_compares_the_finalist_that_measures_fastest_within_its_budget():
    from gaswap.encoding import Chromosome
    from gaswap.policy import Policy
    from gaswap.problem import Evaluated

    def evaluated(k):  # predicted at 50 bytes, 40 above resident
        return Evaluated(Chromosome((0.0,), (k,)), 1.0 + k / 10, 50)

    actions_of = {}  # method -> the actions it was compiled for

    def method(label, e):  # stands for compiling a policy
        m = compare.Method("gaswap", label, None, None, None)
        actions_of[id(m)] = e.chromosome.actions
        return m, Policy("f", (), {}, provenance={"budget": label})

    measured = {(0,): (150, 2.0), (1,): (90, 1.5), (2,): (80, 1.2), (3,): (40, 3.0)}  # actions -> peak, seconds
    timed = []

    def time_methods(methods):
        timed.extend(actions_of[id(m)] for m in methods)
        return [dict(zip(("peak_bytes", "step_s"), measured[actions_of[id(m)]])) for m in methods]

    def pick(finalists, refit=False):
        return compare._pick(finalists, method, {"A": 110, "B": 60}, 10, time_methods, lambda line: None, refit)

    picked, tuning, unfit = pick([("A", [evaluated(0), evaluated(1), evaluated(2)]),
                                  ("B", [evaluated(2), evaluated(3)])])
    assert unfit == {}
    assert len(tuning) == 4 and sorted(timed) == [(0,), (1,), (2,), (3,)]  # each distinct finalist timed once
    (a, policy_a), (b, policy_b) = picked
    # A (100 bytes above resident): #0 measures 150, over it; #2 is faster than #1. B (50): only #3 fits.
    assert actions_of[id(a)] == (2,) and actions_of[id(b)] == (3,)
    assert a.knob == "A" and policy_a.provenance == {"budget": "A", "budget_bytes": 110}
    assert b.knob == "B" and policy_b.provenance == {"budget": "B", "budget_bytes": 60}
    picked, _, _ = pick([("A", [evaluated(3), evaluated(0)]), ("B", [evaluated(3), evaluated(0)])])
    assert [actions_of[id(m)] for m, _ in picked] == [(3,), (3,)] and picked[0][0] is not picked[1][0]  # compiled apart
    picked, _, unfit = pick([("B", [evaluated(1), evaluated(2)])])
    (m, _), = picked
    assert actions_of[id(m)] == (1,)  # none fits when measured: the fastest predicted
    assert unfit == {"B": 90 / 40}  # how far over their predictions they measured, at most
    assert pick([("B", [evaluated(1), evaluated(2)])], refit=True)[0] == []  # a second search's: left out
    timed.clear()
    (m, _), = pick([("A", [evaluated(0)])])[0]
    assert actions_of[id(m)] == (0,) and timed == []  # one finalist: nothing to time
    assert pick([("A", [evaluated(0)])], refit=True)[2] == {"A": 150 / 40} and timed == [(0,)]  # a refit's is
    assert pick([], refit=True) == ([], [], {})  # a second search where nothing fits by the model: nothing timed


def test_a_budget_no_finalist_fits_is_searched_again_under_the_model_error_and_left_out_if_still_unmet():
    budget_of, resident = {"A": 110, "B": 60, "C": 40}, 10
    # A's finalists measured up to 1.25x their predictions: search A under 100 / 1.25; C erred low: no search
    assert compare._refit_budgets({"A": 1.25, "C": 0.9}, budget_of, resident) == [("A", 10 + 80)]

    def picked(*labels):
        return [(compare.Method("gaswap", label, None, None, None), label) for label in labels]
    first = picked("A", "B", "C")
    merged = compare._merge_refits(first, picked("A"), {"A": 1.25, "C": 1.1}, lambda line: None)
    assert [(m.knob, policy) for m, policy in merged] == [("A", "A"), ("B", "B")]  # A refit, B kept, C left out
    assert merged[0][0] is not first[0][0] and merged[1][0] is first[1][0]


def test_torch_partitions_that_measure_within_a_budget_join_its_finalists():
    from types import SimpleNamespace

    from gaswap.encoding import Chromosome
    from gaswap.problem import Evaluated

    ours = Evaluated(Chromosome((0.0,), (0,)), 1.0, 100)
    partitions = {"torch 1": (Chromosome((0.0,), (1,)), SimpleNamespace(step_time=2.0, peak_bytes=90), 150),
                  "torch 0.5": (Chromosome((0.0,), (2,)), SimpleNamespace(step_time=3.0, peak_bytes=80), 120),
                  "torch 0.2": (Chromosome((0.0,), (0,)), SimpleNamespace(step_time=1.0, peak_bytes=100), 110)}
    budgets = [("A", 150), ("B", 130), ("C", 115), ("D", 100)]
    out = compare._with_partitions([("A", [ours]), ("B", [ours])], partitions, budgets)
    assert [e.chromosome.actions for e in out[0][1]] == [(0,), (1,), (2,)]  # torch 0.2's is the search's own
    assert [e.chromosome.actions for e in out[1][1]] == [(0,), (2,)]  # torch 1 measured 150: over B
    assert out[0][1][1].peak_bytes == 90 and out[0][1][1].step_time == 2.0  # as the model predicts them
    assert [(label, [e.chromosome.actions for e in es]) for label, es in out[2:]] == [("C", [(0,)])]  # D: none


def test_the_shortlist_fills_a_small_front_with_the_next_fastest_policies():
    from gaswap.encoding import Chromosome
    from gaswap.problem import Evaluated

    def evaluated(action, seconds, peak):
        return Evaluated(Chromosome((0.0,), (action,)), seconds, peak)

    def canonical(c):  # as a CompiledProblem's: here action 4 runs as 2
        return Chromosome(c.keys, (2,)) if c.actions == (4,) else c

    front = [evaluated(0, 1.0, 100), evaluated(1, 2.0, 90), evaluated(4, 3.0, 80)]
    fastest = [front[0], evaluated(5, 1.1, 100), evaluated(2, 1.2, 100), evaluated(6, 1.3, 100)]

    def actions(shortlist):
        return [e.chromosome.actions[0] for e in shortlist]

    assert actions(compare._shortlist(front, fastest, canonical, 3)) == [0, 1, 2]  # the front alone
    assert actions(compare._shortlist(front, fastest, canonical, 1)) == [0]
    assert actions(compare._shortlist(front[:1], fastest, canonical, 3)) == [0, 5, 2]  # filled, fastest first
    assert actions(compare._shortlist(front[2:], fastest, canonical, 4)) == [2, 0, 5, 6]  # 4 runs as 2: one
    assert actions(compare._shortlist(front[:1], fastest[:2], canonical, 3)) == [0, 5]  # no more to fill with
    assert compare._shortlist([], [], canonical, 3) == []
    (e,) = compare._shortlist(front[2:], [], canonical, 3)
    assert e.chromosome.actions == (2,) and (e.step_time, e.peak_bytes) == (3.0, 80)  # the prediction kept


def test_a_policy_written_predicts_its_generated_programs_peak_and_keeps_the_models_beside_it(tmp_path):
    import json

    from gaswap import compiled_validate
    from gaswap.compiled_program import Program
    from gaswap.policy import Policy

    policy = Policy("f", (), {}, {"peak_bytes": 1000, "step_time_s": 1.0, "resident_bytes": 100},
                    provenance={"budget_bytes": 1200})
    assert compare._with_program_peak(policy, None) is policy  # no program read: the model's stays
    written = compare._with_program_peak(policy, 1050)
    assert written.predicted == {"peak_bytes": 1150, "step_time_s": 1.0, "resident_bytes": 100,
                                 "search_peak_bytes": 1000}
    r = compiled_validate.report(written, tmp_path / "p.yaml", "e", "cpu", 1, [1000], [1.1], [None], 0.1)
    assert r["predicted"] == {"peak_bytes": 1050, "step_time_s": 1.0, "search_peak_bytes": 900}
    assert r["peak_ratio"] == 1000 / 1050 and r["search_peak_ratio"] == 1000 / 900
    assert r["targets"] == {"peak_within_5pc": True, "peak_within_budget": True, "time_within_15pc": True}
    assert json.loads((tmp_path / "p.validation.json").read_text()) == r
    # a method whose programs cannot be read has no program peak, and says why
    lines = []
    m = compare.Method("gaswap", "A", None, None, None, programs=[Program("no program")])
    assert compare._program_peak(m, 10, "sum", lines.append) is None and "no program peak" in lines[0]


@pytest.mark.slow
def test_warm_up_records_a_compiled_methods_programs_and_reads_its_peak():
    from types import SimpleNamespace

    from gaswap import zoo

    torch.manual_seed(0)
    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    exp = SimpleNamespace(loss="cross_entropy")
    lines = []
    methods = []
    for name, run in (("eager", model), ("torch.compile", torch.compile(model, fullgraph=True, dynamic=False))):
        m = compare.Method(name, "-", model, run, torch.optim.SGD(model.parameters(), lr=0.1))
        compare._warm_up(m, (x,), y, exp, torch.device("cpu"), lines.append)
        methods.append(m)
    eager, compiled_ = methods
    assert eager.programs == [] and compare._program_peak(eager, 8 * 5 * 4, "cross_entropy", lines.append) is None
    assert len(compiled_.programs) == 2 and compiled_.compile_s > 0
    with PeakMeter("cpu") as meter:
        compare.train_step(compiled_, (x,), y, "cross_entropy", torch.device("cpu"))
    predicted = compare._program_peak(compiled_, 8 * 5 * 4, "cross_entropy", lines.append)
    assert abs(meter.peak / predicted - 1) <= 0.05, (meter.peak, predicted)
