"""gaswap compare: its peak meter, its rounds and its verdicts; the whole comparison once, on a tiny MLP (slow: it
compiles a dozen times; `python -m gaswap compare experiments/compare_cnn_cpu.yaml` runs a real one)."""
import pytest
import torch

from gaswap.app import compare, compare_report
from gaswap.run.peak_meter import PeakMeter


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


def test_cpu_peak_meter_can_read_the_resident_set_alone_without_the_profiler():
    with PeakMeter("cpu", allocator=False) as meter:
        assert not torch.autograd.profiler._is_profiler_enabled  # the allocator's count is the profiler's
        a = torch.ones(16 << 20)  # 64 MiB
        del a
    assert meter.peak is None and 60 << 20 <= meter.rss_peak < 76 << 20
    with PeakMeter("cpu") as meter:
        assert torch.autograd.profiler._is_profiler_enabled
    assert meter.peak is not None


def test_cpu_peak_meter_ignores_frees_of_what_was_allocated_before():
    before = torch.ones(16 << 20)
    with PeakMeter("cpu") as meter:
        del before  # its size is unknown to the profiler: the meter can only err high, never miss bytes
        a = torch.ones(4 << 20)
        del a
    assert 16 << 20 <= meter.peak < (16 << 20) + 64


def _row(method, knob, peak, step, budget=None, rss=None):
    return {"method": method, "knob": knob, "predicted_peak_bytes": None, "predicted_step_s": None, "peak_bytes": peak,
            "peak_min": peak, "peak_max": peak, "step_s": step, "step_min": step, "step_max": step, "wall_step_s": step,
            "compile_s": 0.0, "recomputed": None, "rss_peak_bytes": peak if rss is None else rss,
            "budget": knob if method == "gaswap" else budget}


def test_a_verdict_judges_the_policy_picked_for_the_budget_a_torch_point_became():
    rows = [_row("eager", "-", 300, 2.0), _row("torch.compile", "1", 200, 1.0, "A"),
            _row("torch.compile", "0.2", 100, 1.3, "B"), _row("gaswap", "A", 190, 1.05), _row("gaswap", "B", 90, 0.95)]
    rows[3]["step_min"] = 0.94  # A's timings overlap B's: no other pick named; and torch's: slower by noise
    assert compare_report.goal_lines(rows)[0].endswith(
        ": not met (slower within the spread of both timings, at 5.0% less memory)")
    rows[3]["step_min"] = 1.05
    first, second = compare_report.goal_lines(rows)
    # A's pick is slower than torch 1: not met, though B's pick (another budget's) is faster and fits
    assert first == ("- torch.compile 1 (peak 200 B, 1000.00 ms): gaswap's pick for budget A: peak 190 B, "
                     "1050.00 ms (+5.0%): not met; budget B's pick runs at or below this peak in 950.00 ms (-5.0%)")
    assert second.endswith("gaswap's pick for budget B: peak 90 B, 950.00 ms (-26.9%): met")
    rows[3]["origin"] = "torch 1"  # A's pick is torch 1.0's own partition
    assert ": a tie: the pick is this very partition read back" in compare_report.goal_lines(rows)[0]
    rows[4]["origin"] = "torch 1"  # B's pick is torch 1.0's partition, read back at torch 0.2's peak
    assert compare_report.goal_lines(rows)[1].endswith(
        ": met (the pick is torch 1's partition read back, not a policy of gaswap's own search)")
    assert "| gaswap (torch 1's partition) | B |" in compare_report.to_markdown(rows, "x", "cpu")
    del rows[4]  # nothing picked for B
    assert compare_report.goal_lines(rows)[1].endswith(
        "gaswap picked no policy for budget B (none measured at or under it)")


def test_a_pick_above_torch_by_the_resident_set_is_explained_and_eager_faster_than_all_is_said():
    rows = [_row("eager", "-", 300, 0.5), _row("torch.compile", "1", 200, 1.0, "A", rss=250),
            _row("gaswap", "A", 190, 0.9, rss=260), _row("gaswap", "0.8x A", 150, 1.2, rss=210)]
    line, = compare_report.goal_lines(rows, "rss_peak_bytes")
    assert "peak 260 B, 900.00 ms (-10.0%): above torch's peak by this meter (by the allocator 190 B against " \
           "200 B; the resident set also counts what malloc keeps" in line
    assert line.endswith("budget 0.8x A's pick runs at or below this peak in 1200.00 ms (+20.0%)")
    assert compare_report.below_lines(rows) == [
        ("- below torch's lowest peak: gaswap's pick for budget 0.8x A: peak 150 B, 1200.00 ms (+20.0% against "
         "torch.compile 1, 1000.00 ms at 200 B)")]
    table = compare_report.to_markdown(rows, "x", "cpu")
    assert "Eager ran faster than every compiled method: 500.00 ms a step at a peak of 300 B, against the fastest " \
           "compiled, gaswap A, 900.00 ms at 190 B (-44.4%)" in table
    rows[0]["step_s"] = 0.95
    assert compare_report.eager_lines(rows) == [] and "Eager ran" not in compare_report.to_markdown(rows, "x", "cpu")


def test_a_torch_partition_timed_again_as_a_pick_says_how_far_one_program_moved():
    rows = [_row("torch.compile", "1", 200, 1.0, "A"), _row("torch.compile", "0.2", 100, 0.8, "B"),
            _row("gaswap", "A", 100, 0.9), _row("gaswap", "B", 100, 0.84)]
    assert compare_report.noise_lines(rows) == []  # no pick is a torch partition
    rows[2]["origin"] = rows[3]["origin"] = "torch 0.2"
    assert compare_report.noise_lines(rows) == ["", (
        "- torch.compile 0.2's partition ran as torch.compile and as gaswap's pick for A, B: 800.00 ms to 900.00 ms a "
        "step (12.5% apart) in the same rounds. Time differences of that size are within this run's noise.")]
    assert "(12.5% apart)" in compare_report.to_markdown(rows, "x", "cpu")
    rows[2]["step_s"] = rows[3]["step_s"] = 0.8
    assert compare_report.noise_lines(rows) == []  # measured alike: nothing to say


def test_budgets_apart_however_close_keep_labels_apart():
    resident = 1000
    peaks = [resident + 17_139_000, resident + 17_140_600, resident + 36_600_000, resident + 17_139_000]
    budgets = compare._budgets(peaks, (0.8,), resident)
    assert budgets == [("36.60 MB", resident + 36_600_000), ("17.141 MB", resident + 17_140_600),
                       ("17.139 MB", resident + 17_139_000), ("0.8x 17.139 MB", resident + int(0.8 * 17_139_000))]
    assert compare._labels_of(budgets, peaks) == ["17.139 MB", "17.141 MB", "36.60 MB", "17.139 MB"]
    assert compare_report.budget_labels([5, 5_000_000_000_001, 5_000_000_000_002]) == [
        "5 B", "5000000000001 B", "5000000000002 B"]  # no decimals of TB tell them apart: bytes


def test_compare_refuses_an_experiment_without_a_loss(tmp_path):
    from gaswap.base import config

    path = tmp_path / "e.yaml"
    path.write_text("model: {factory: gaswap.zoo:mlp}\ninputs: [{shape: [batch, 32]}]\nloss: external\n"
                    "batch_size: 4\nbudget: 0.5x\n")
    with pytest.raises(config.ConfigError, match="loss"):
        compare.run(path, results_root=tmp_path)


def _finalist_harness(measured: dict):
    """Stand-ins for compiling and timing finalists: (evaluated(k), method, time_methods, actions_of,
    problem_of, timed). `measured`: actions -> (peak above resident, seconds); every policy is predicted at
    40 above resident."""
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.policy import Policy
    from gaswap.plan.problem import Evaluated

    actions_of, problem_of, timed = {}, {}, []  # method -> its actions, the problem it was made with; timed

    def evaluated(k):
        return Evaluated(Chromosome((0.0,), (k,)), 1.0 + k / 10, 50)

    def method(label, e, problem):  # stands for compiling a policy
        m = compare.Method("gaswap", label, None, None, None)
        actions_of[id(m)], problem_of[id(m)] = e.chromosome.actions, problem
        return m, Policy("f", (), {}, provenance={"budget": label})

    def time_methods(methods, rounds, steps, **options):
        timed.extend(actions_of[id(m)] for m in methods)
        return [{"knob": m.knob, **dict(zip(("peak_bytes", "step_s"), measured[actions_of[id(m)]]))}
                for m in methods]

    return evaluated, method, time_methods, actions_of, problem_of, timed


def test_a_finalists_round_chooses_per_budget_the_fastest_measured_within_it():
    measured = {(0,): (150, 2.0), (1,): (90, 1.5), (2,): (80, 1.2), (3,): (40, 3.0), (5,): (70, 1.0)}
    evaluated, method, time_methods, actions_of, problem_of, timed = _finalist_harness(measured)
    made = {}

    def one_round(finalists, number=1, problem="first"):
        return compare._finalists_round(finalists, number, problem, made, method, {"A": 110, "B": 60}, 10,
                                        time_methods, lambda line: None)

    chosen, rows, unfit = one_round([("A", [evaluated(0), evaluated(1), evaluated(2)]),
                                     ("B", [evaluated(2), evaluated(3)])])
    assert sorted(timed) == [(0,), (1,), (2,), (3,)]  # each distinct finalist compiled and timed once
    assert [made[a][0].knob for a in rows] == ["A #1", "A #2", "A #3", "B #4"]
    assert all(row["round"] == 1 for row in rows.values()) and unfit == {}
    # A (100 bytes above resident): #0 measures 150, over it; #2 is faster than #1. B (50): only #3 fits.
    assert {label: e.chromosome.actions for label, e in chosen.items()} == {"A": (2,), "B": (3,)}
    timed.clear()
    chosen, rows, unfit = one_round([("B", [evaluated(1), evaluated(5), evaluated(2)])], 2, "second")
    assert timed == [(1,), (5,), (2,)] and made[(5,)][0].knob == "B #5"  # made once; numbered on
    assert problem_of[id(made[(5,)][0])] == "second" and problem_of[id(made[(1,)][0])] == "first"
    assert chosen == {} and unfit == {"B": 90 / 40}  # none fits: how far over their predictions, at most
    assert all(row["round"] == 2 for row in rows.values())
    timed.clear()
    assert one_round([]) == ({}, {}, {}) and timed == []  # nothing to time


def test_a_second_round_times_the_new_finalists_beside_the_first_choice_which_stands_where_none_is_new():
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

    evaluated, *_ = _finalist_harness({})
    made = {(0,): None, (1,): None, (2,): None}
    first = {"A": evaluated(1), "B": evaluated(2)}
    second = compare._second_round([("A", [evaluated(0), evaluated(4)]), ("B", [evaluated(1), evaluated(0)]),
                                    ("C", [evaluated(5)])], made, first)
    assert [(label, [e.chromosome.actions[0] for e in es]) for label, es in second] == [("A", [4, 1]), ("C", [5])]
    # a new finalist the refit predicts less than 3 % faster than A's choice (2.0 s by the same model) is not made
    slow, fast = Evaluated(Chromosome((0.0,), (6,)), 1.95, 50), Evaluated(Chromosome((0.0,), (7,)), 1.93, 50)
    said = []
    second = compare._second_round([("A", [slow, fast]), ("B", [slow])], made, first, {"A": 2.0, "B": 2.0},
                                   said.append)
    assert [(label, [e.chromosome.actions[0] for e in es]) for label, es in second] == [("A", [7, 1])]
    assert said[0].startswith("  at A: 1 of the second search's new finalists not compiled, predicted less than 3 %")
    lines = []
    final = compare._final_choice(["A", "B", "C", "D"], first, {"A": evaluated(4), "C": evaluated(5)}, lines.append)
    assert {label: e.chromosome.actions[0] for label, e in final.items()} == {"A": 4, "B": 2, "C": 5}
    assert list(final) == ["A", "B", "C"] and lines == [
        "  at D: left out, no policy at or under the budget (by the model or measured)"]


def test_the_picked_policies_are_the_ones_timed_and_one_picked_twice_runs_the_same_compiled_step_apart():
    evaluated, method, time_methods, actions_of, problem_of, timed = _finalist_harness(
        {(1,): (40, 1.0), (2,): (30, 2.0)})
    made = {}
    compare._finalists_round([("A", [evaluated(1), evaluated(2)])], 1, "timed", made, method, {"A": 110}, 10,
                             time_methods, lambda line: None)
    made[(1,)][0].run = object()  # stands for its compiled step
    picked = compare._picked({"A": evaluated(1), "B": evaluated(1), "C": evaluated(3)}, made, method,
                             {"A": 110, "B": 60, "C": 40}, "untimed")
    (a, policy_a), (b, _), (c, policy_c) = picked
    assert a is made[(1,)][0] and b is not a and b.run is a.run  # the same policy: its own row, not compiled again
    assert len(actions_of) == 3 and problem_of[id(c)] == "untimed"  # only the policy never made is made
    assert [m.knob for m, _ in picked] == ["A", "B", "C"]
    assert policy_a.provenance == {"budget": "A", "budget_bytes": 110}
    assert policy_c.provenance == {"budget": "C", "budget_bytes": 40}


def test_a_torch_partition_read_back_is_timed_in_torchs_program_and_compiled_as_gaswaps_only_where_picked():
    evaluated, method, time_methods, actions_of, problem_of, timed = _finalist_harness(
        {(1,): (40, 1.0), (2,): (30, 0.5)})
    torch_run = object()
    torch_m = compare.Method("torch.compile", "0.5", "its model", torch_run, "its optimizer", compile_s=12.0)
    made_by_method = []

    def counted(label, e, problem):
        made_by_method.append(e.chromosome.actions)
        return method(label, e, problem)

    def timing(methods, rounds, steps, **options):  # the stand-in times as its partition
        actions_of.update({id(m): (2,) for m in methods if m.run is torch_run})
        return time_methods(methods, rounds, steps, **options)

    made, said = {}, []
    chosen, _, _ = compare._finalists_round([("A", [evaluated(1), evaluated(2)])], 1, "p", made, counted,
                                            {"A": 110, "B": 110}, 10, timing, said.append,
                                            stand_ins={(2,): torch_m})
    assert "  timing 2 finalists (round 1; 1 of torch's partitions in torch.compile's programs of them)" in said
    stand_in = made[(2,)][0]
    assert stand_in.run is torch_run and stand_in.model == "its model" and stand_in.optimizer == "its optimizer"
    assert (stand_in.name, stand_in.knob, stand_in.compile_s) == ("gaswap", "A #1", 12.0)  # numbered first
    assert torch_m.knob == "0.5" and torch_m.name == "torch.compile"  # torch's own row unchanged
    assert chosen["A"].chromosome.actions == (2,) and timed == [(1,), (2,)]
    picked = compare._picked({"A": evaluated(2), "B": evaluated(2), "C": evaluated(1)}, made, counted,
                             {"A": 110, "B": 110, "C": 110}, "untimed", {(2,): torch_m})
    (a, _), (b, _), (c, _) = picked
    assert made_by_method == [(1,), (2,), (2,)]  # compiled as gaswap's policy once, for the head to head
    assert a.run is not torch_run and b is not a and b.run is a.run and c is made[(1,)][0]
    assert problem_of[id(a)] == "untimed"


def test_a_finalist_of_a_torch_partitions_partition_is_timed_in_torchs_program_and_picked_as_that_partition():
    evaluated, method, time_methods, actions_of, _, timed = _finalist_harness({(2,): (30, 0.5)})
    torch_run = object()
    torch_m = compare.Method("torch.compile", "0.5", "its model", torch_run, "its optimizer", compile_s=12.0)

    class OnePartition:  # stands for `pool.Programs`: every finalist saves the same activations
        def __init__(self):
            self.compiled = []

        def same(self, made, what):
            return [None] + [made[0][0]] * (len(made) - 1)

        def compile(self, fresh, what):
            self.compiled += fresh

    def timing(methods, rounds, steps, **options):
        actions_of.update({id(m): (2,) for m in methods if m.run is torch_run})
        return time_methods(methods, rounds, steps, **options)

    made, programs = {}, OnePartition()
    compare._finalists_round([("A", [evaluated(1), evaluated(2)])], 1, "p", made, method, {"A": 110}, 10, timing,
                             lambda line: None, programs, {(2,): torch_m})
    assert made[(1,)] is made[(2,)] and made[(1,)][0].run is torch_run  # the search's (1,) timed in torch's program
    assert programs.compiled == [] and timed == [(2,)]
    ((m, _),) = compare._picked({"A": evaluated(1)}, made, method, {"A": 110}, "untimed", {(2,): torch_m})
    assert actions_of[id(m)] == (2,) and m.run is not torch_run  # torch 0.5's partition read back, compiled


def test_of_finalists_timed_within_a_tie_of_the_fastest_the_one_of_least_memory_is_chosen():
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

    fits = [Evaluated(Chromosome((0.0,), (k,)), 1.0, 0) for k in range(3)]
    rows = {(0,): {"step_s": 9.93e-3, "peak_bytes": 5_510_000}, (1,): {"step_s": 9.98e-3, "peak_bytes": 4_600_000},
            (2,): {"step_s": 10.5e-3, "peak_bytes": 4_100_000}}  # 1 within 1 % of 0, 2 not
    assert compare._least_memory_of_the_fastest(fits, rows).chromosome.actions == (1,)
    rows[(1,)]["step_s"] = 10.1e-3  # 1.7 % slower: the fastest stands
    assert compare._least_memory_of_the_fastest(fits, rows).chromosome.actions == (0,)


def test_the_head_to_head_times_a_step_picked_at_several_budgets_once():
    from dataclasses import replace

    from gaswap.compiled.methods import Method

    eager = Method("eager", "-", "model", "model", None)
    pick = Method("gaswap", "40 MB", "copy", "compiled step", None, predicted=(1, 2.0, 3, 4.0), recomputed=5)
    again = replace(pick, knob="30 MB")  # the same policy at another budget (`_picked`): the same step
    other = Method("gaswap", "20 MB", "copy 2", "another step", None)
    timed = []

    def measure(ms):
        timed.append([m.knob for m in ms])
        return [{"knob": m.knob, "step_s": 0.01 * k, "recomputed": m.recomputed} for k, m in enumerate(ms)]

    rows = compare._timed_once([eager, pick, again, other], measure)
    assert timed == [["-", "40 MB", "20 MB"]]
    assert [r["knob"] for r in rows] == ["-", "40 MB", "30 MB", "20 MB"]
    assert rows[2] == rows[1] | {"knob": "30 MB"} and rows[3]["step_s"] == 0.02


def test_a_settled_pick_of_a_torch_partition_compiles_beside_the_next_finalists_and_is_not_made_again():
    evaluated, method, _, actions_of, _, _ = _finalist_harness({})
    torch_m = compare.Method("torch.compile", "0.5", "its model", object(), "its optimizer", compile_s=12.0)
    stand_ins = {(2,): torch_m}

    class Recording:  # stands for `pool.Programs`: each policy its own partition; the compiles asked for
        def __init__(self):
            self.calls = []

        def same(self, made, what):
            return [None] * len(made)

        def compile(self, fresh, what):
            self.calls.append(([m.knob for m, _ in fresh], what))

    made, own, programs = {}, {}, Recording()
    compare._make([("A", [evaluated(2)])], "p", made, method, programs, stand_ins)  # timed in torch's program
    assert made[(2,)][0].run is torch_m.run and programs.calls == [([], [])]
    pick = compare._own_program("A", evaluated(2), made, method, "p", stand_ins, own)
    assert pick[2] and actions_of[id(pick[0])] == (2,)
    assert compare._own_program("A", evaluated(2), made, method, "p", stand_ins, own) == (*pick[:2], False)
    compare._make([("B", [evaluated(3)])], "p", made, method, programs, stand_ins, [pick])  # round 2
    assert programs.calls[-1] == (["B #2", "A"], ["finalist", "pick"])  # in one batch: the workers both busy
    ((m, _),) = compare._picked({"A": evaluated(2)}, made, method, {"A": 110}, "p", stand_ins, own)
    assert m is pick[0]  # compiled already, not made again


def test_two_rounds_refit_the_time_model_on_round_one_and_time_round_twos_new_finalists_beside_its_choice():
    from test_compiled_costs import _masked

    from gaswap.compiled import step_model as cc
    from gaswap.plan.encoding import Action, Chromosome
    from gaswap.plan.problem import Evaluated
    from helpers import unit_costs

    g = _masked()
    calibration = cc.fit([("a", 0.0, 0.0, 0, 0, 1.0), ("b", 1.0, 1.0, 1, 1, 2.0)])
    problem = cc.CompiledProblem(g, unit_costs(g), None, actions=(Action.KEEP, Action.RECOMPUTE),
                                 calibration=calibration)
    keys = problem.encoding.captured_keys()

    def evaluated(*actions):  # predicted at 50 bytes, 40 above resident
        return Evaluated(Chromosome(keys, actions), 1.0, 50)

    measured = {(0, 0, 0): (30, 2.0), (0, 0, 1): (35, 1.5), (1, 0, 1): (45, 1.0), (1, 1, 1): (20, 1.2),
                (0, 1, 1): (25, 1.1)}  # actions -> (peak above resident, seconds)
    made, searched, problems = {}, [], []

    def method(label, e, problem_):
        problems.append(problem_)
        return compare.Method("gaswap", label, None, None, None, origin=e.chromosome.actions), None

    def time_methods(methods, rounds, steps, **options):
        return [{"knob": m.knob, **dict(zip(("peak_bytes", "step_s"), measured[m.origin]))} for m in methods]

    def search_again(refit, budgets, settled):
        searched.append((refit, budgets))
        assert settled("A", evaluated(0, 0, 0)) and not settled("A", evaluated(1, 1, 1))  # made in round 1 or not
        return [("A", [evaluated(0, 0, 1), evaluated(1, 1, 1)]), ("B", [evaluated(0, 1, 1)])]

    # A: 40 above resident; B: 30 above, where neither finalist fits: measured 45 and 35, 40 predicted
    chosen, rows = compare._two_rounds([("A", [evaluated(0, 0, 0), evaluated(0, 0, 1)]),
                                        ("B", [evaluated(1, 0, 1), evaluated(0, 0, 1)])],
                                       problem, [("A", 50), ("B", 40)], 10, made, method, time_methods,
                                       lambda line: None, search_again)
    (refit, budgets), = searched
    assert [p[0] for p in refit.points] == ["a", "b", "A #1", "A #2", "B #3"]  # calibrated on, then round 1
    assert budgets == [("A", 50), ("B", 10 + int(30 / (45 / 40)))]  # B lowered by how far over it measured
    assert [(row["knob"], row["round"]) for row in rows] == [
        ("A #1", 1), ("A #2", 1), ("B #3", 1), ("A #4", 2), ("A #2", 2), ("B #5", 2)]  # A's choice timed again
    assert {label: e.chromosome.actions for label, e in chosen.items()} == {"A": (1, 1, 1), "B": (0, 1, 1)}
    assert problems[:3] == [problem] * 3 and all(p.calibration is refit for p in problems[3:])
    searched.clear()
    assert compare._two_rounds([], problem, [("A", 50)], 10, {}, method, time_methods, lambda line: None,
                               search_again) == ({}, []) and searched == []  # no finalist: no second round


def test_finalists_clearly_slower_or_over_every_budget_of_theirs_are_timed_no_longer():
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

    def e(k):
        return Evaluated(Chromosome((0.0,), (k,)), 1.0, 50)

    def row(peak, low, median, high):
        return {"peak_bytes": peak, "step_min": low, "step_s": median, "step_max": high}

    timed = [(0,), (1,), (2,), (3,), (4,)]
    finalists = [("A", [e(0), e(1), e(2)]), ("B", [e(3), e(4), e(2)])]  # A: 100 above resident, B: 50
    rows = [row(90, 1.0, 1.05, 1.1), row(80, 1.25, 1.3, 1.4), row(40, 1.15, 1.2, 1.25), row(45, 1.3, 1.3, 1.3),
            row(60, 0.5, 0.5, 0.5)]
    # A: #0 fastest (slowest step 1.1); #1's fastest 1.25 is over 1.1 x 1.1: out; #2's 1.15 within. B: #4 is over
    # it (60 above resident > 50), fast as it is; #2 is B's fastest that fits, #3 within 1.25 x 1.1 of it.
    index = {a: i for i, a in enumerate(timed)}
    assert compare._contenders(index, finalists, {"A": 110, "B": 60}, 10, rows) == {0, 2, 3}
    rows[3]["step_min"] = 1.4  # now clearly slower than #2 too
    assert compare._contenders(index, finalists, {"A": 110, "B": 60}, 10, rows) == {0, 2}
    # (5,) runs #1's programs (its partition saves the same): one row, kept while a budget of either needs it
    finalists.append(("C", [e(5)]))
    assert compare._contenders(index | {(5,): 1}, finalists, {"A": 110, "B": 60, "C": 100}, 10, rows) == {0, 1, 2}


def test_measure_meters_the_first_rounds_only_and_stops_timing_what_prune_drops(monkeypatch):
    from gaswap import zoo
    from gaswap.compiled import methods
    from gaswap.run import training

    torch.manual_seed(0)
    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    ms = []
    for knob in ("a", "b", "c"):
        m, optimizer = training.fresh_copy(model, "sgd")
        ms.append(methods.Method("eager", knob, m, m, optimizer))
    metered, pruned = [], []
    real = training.metered_round
    monkeypatch.setattr(training, "metered_round", lambda *a, **k: metered.append(a) or real(*a, **k))

    def prune(rows):
        pruned.append([r["steps_timed"] for r in rows])
        return {0, 2}  # b is dropped after the first round

    rows = methods.measure(ms, (x,), y, "cross_entropy", torch.device("cpu"), 3, 2, lambda line: None, metered=1,
                           prune=prune)
    assert len(metered) == 3  # one metered round each, the first
    assert pruned == [[2, 2, 2], [4, 2, 4]]  # asked after every round but the last
    assert [r["steps_timed"] for r in rows] == [6, 2, 6] and rows[1]["peak_min"] == rows[1]["peak_max"] > 0


def test_pruning_reads_the_step_times_by_the_devices_clock_as_the_rows_do(monkeypatch):
    """On a GPU the rows are timed by the wall clock; pruning between rounds read the host's CPU seconds."""
    from gaswap import zoo
    from gaswap.compiled import methods
    from gaswap.run import training

    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    ms = [methods.Method("eager", k, *(lambda m, o: (m, m, o))(*training.fresh_copy(model, "sgd"))) for k in "ab"]
    monkeypatch.setattr(training, "step_clock", lambda device: "wall")  # as on a GPU
    monkeypatch.setattr(methods.Method, "step", lambda self, *args: (0.5, 0.1))  # (wall s, CPU s)
    seen = []
    rows = methods.measure(ms, (x,), y, "cross_entropy", torch.device("cpu"), 2, 1, lambda line: None, metered=1,
                           prune=lambda rows_: seen.append([r["step_s"] for r in rows_]) or {0, 1})
    assert seen == [[0.5, 0.5]] and [r["step_s"] for r in rows] == [0.5, 0.5]


def test_a_method_whose_round_is_short_takes_enough_steps_from_its_second_round_to_fill_one(monkeypatch):
    """Three steps of a few milliseconds a round leave a median to the noise (on an H100 the same program read 2.96 to
    3.75 ms in one compare): from its second round on, a method takes as many steps as last `round_s`."""
    from gaswap import zoo
    from gaswap.compiled import methods
    from gaswap.run import training

    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    ms = [methods.Method("eager", k, *(lambda m, o: (m, m, o))(*training.fresh_copy(model, "sgd"))) for k in "ab"]
    seconds = {"a": 0.01, "b": 0.2}  # CPU seconds a step
    monkeypatch.setattr(methods.Method, "step", lambda self, *args: (1.0, seconds[self.knob]))
    rows = methods.measure(ms, (x,), y, "cross_entropy", torch.device("cpu"), 3, 2, lambda line: None, metered=1,
                           round_s=0.25)
    assert [r["steps_timed"] for r in rows] == [2 + 25 + 25, 2 + 2 + 2]  # b's two steps fill a round already
    assert methods.steps_for([0.01, 0.03], 3, 0.25) == 13 and methods.steps_for([], 3, 0.25) == 3
    assert methods.steps_for([0.001], 3, 0.0) == 3  # no round length asked: the steps given


def test_a_budget_no_finalist_fits_is_searched_again_under_the_model_error():
    budget_of, resident = {"A": 110, "B": 60, "C": 40}, 10
    # A's finalists measured up to 1.25x their predictions: search A under 100 / 1.25; C erred low: no search
    assert compare._refit_budgets({"A": 1.25, "C": 0.9}, budget_of, resident) == [("A", 10 + 80)]


def test_torch_partitions_that_measure_within_a_budget_join_its_finalists():
    from types import SimpleNamespace

    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

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
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

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
    from dataclasses import replace

    from gaswap.app import validate_compiled
    from gaswap.compiled.programs import Program
    from gaswap.plan.policy import Policy

    policy = Policy("f", (), {}, {"peak_bytes": 1000, "step_time_s": 1.0, "resident_bytes": 100},
                    provenance={"budget_bytes": 1200})
    assert compare._with_program_peak(policy, None) is policy  # no program read: the model's stays
    written = compare._with_program_peak(policy, 1050)
    assert written.predicted == {"peak_bytes": 1150, "step_time_s": 1.0, "resident_bytes": 100,
                                 "beyond_programs_bytes": 0, "search_peak_bytes": 1000}
    beyond = compare._with_program_peak(policy, 1050, 40)  # what the meter read beyond torch's programs (a GPU's)
    assert beyond.predicted["peak_bytes"] == 1190 and beyond.predicted["beyond_programs_bytes"] == 40
    r = validate_compiled.report(written, tmp_path / "p.yaml", "e", "cpu", 1, [1000], [1.1], [None], 0.1)
    assert r["predicted"] == {"peak_bytes": 1050, "step_time_s": 1.0, "search_peak_bytes": 900}
    assert r["peak_ratio"] == 1000 / 1050 and r["search_peak_ratio"] == 1000 / 900
    assert r["targets"] == {"peak_within_5pc": True, "peak_within_budget": True, "time_within_15pc": True}
    assert json.loads((tmp_path / "p.validation.json").read_text()) == r
    assert r["planned_device"] is None and "does not name the device" in r["warnings"][0]  # written before it did
    stamped = replace(written, provenance=written.provenance | {"device": "cpu: X (1 thread)"})
    r = validate_compiled.report(stamped, tmp_path / "p.yaml", "e", "cpu", 1, [1000], [1.1], [None], 0.1)
    assert r["planned_device"] == "cpu: X (1 thread)" and r["warnings"] == []
    # a method whose programs cannot be read has no program peak, and says why
    lines = []
    m = compare.Method("gaswap", "A", None, None, None, programs=[Program("no program")])
    assert compare._program_peak(m, 10, "sum", lines.append) is None and "no program peak" in lines[0]


@pytest.mark.parametrize("device, warned", [
    ("cpu: AMD EPYC, family 26 model 2, AVX512 (1 thread)",
     ("the policy's costs were measured on cpu: AMD EPYC, family 26 model 2, AVX512 (1 thread) and this run is on")),
    (None, "does not name the device its costs and calibration were timed on")])
def test_validate_of_a_compiled_policy_from_another_device_or_none_named_warns(tmp_path, monkeypatch, capsys, device,
                                                                                warned):
    from gaswap.app import validate, validate_compiled
    from gaswap.app.cli import main
    from gaswap.plan.policy import Policy, save

    provenance = {"form": "compiled", "budget_bytes": 1200} | ({"device": device} if device else {})
    policy = Policy("f", (), {}, {"peak_bytes": 1050, "step_time_s": 1.0, "resident_bytes": 100}, provenance)
    save(policy, tmp_path / "p.yaml")
    here = "cpu: Elsewhere (1 thread)"
    monkeypatch.setattr(validate, "validate", lambda path, *args, **kwargs: validate_compiled.report(
        policy, path, "e", here, 3, [1000], [2.0], [None], 0.1))  # as if trained here: 2 s a step
    assert main(["validate", str(tmp_path / "p.yaml"), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert warned in err and err.count("warning:") == 1, err
    assert ("--recalibrate times this policy's calibration here" in err) == (device is not None)  # the way out


@pytest.mark.slow
def test_warm_up_records_a_compiled_methods_programs_and_reads_its_peak():
    from gaswap import zoo
    from gaswap.compiled import methods

    torch.manual_seed(0)
    model, x, y = zoo.mlp(sizes=(12, 32, 5)), torch.randn(8, 12), torch.randint(0, 5, (8,))
    lines = []
    ms = []
    for name, run in (("eager", model), ("torch.compile", torch.compile(model, fullgraph=True, dynamic=False))):
        m = methods.Method(name, "-", model, run, torch.optim.SGD(model.parameters(), lr=0.1))
        methods.warm_up(m, (x,), y, "cross_entropy", torch.device("cpu"), lines.append)
        ms.append(m)
    eager, compiled_ = ms
    assert eager.programs == [] and compare._program_peak(eager, 8 * 5 * 4, "cross_entropy", lines.append) is None
    assert len(compiled_.programs) == 2 and compiled_.compile_s > 0
    with PeakMeter("cpu") as meter:
        compiled_.step((x,), y, "cross_entropy", torch.device("cpu"))
    predicted = compare._program_peak(compiled_, 8 * 5 * 4, "cross_entropy", lines.append)
    assert abs(meter.peak / predicted - 1) <= 0.05, (meter.peak, predicted)


def test_workers_option_takes_a_count_or_auto():
    import argparse

    from gaswap.app.cli import _workers

    assert _workers("auto") is None  # one per CPU
    assert _workers("0") == 0 and _workers("2") == 2
    with pytest.raises(argparse.ArgumentTypeError):
        _workers("-1")


def test_a_gpu_steps_time_is_its_wall_time_and_the_table_says_so():
    """On the H100 compare ranked methods by the host's CPU seconds of a synchronized step: a GPU's step is timed
    by the wall clock (`runtime.device_clock`), and the table's column names the clock."""
    from gaswap.compiled import methods

    m = methods.Method("eager", "-", None, None, None)
    runs = [{"wall": [0.010, 0.012, 0.011], "cpu": [0.002, 0.003, 0.002], "peak": [100], "rss": [None]}]
    on_gpu, on_cpu = methods._rows([m], runs, "wall")[0], methods._rows([m], runs, "cpu")[0]
    assert (on_gpu["step_s"], on_gpu["step_min"], on_gpu["step_max"]) == (0.011, 0.010, 0.012)
    assert on_cpu["step_s"] == 0.002
    rows = [dict(on_gpu, method="torch.compile", knob="1", predicted_peak_bytes=None, opwise_peak_bytes=None,
                 predicted_step_s=None, opwise_step_s=None, recomputed=None)]
    table = compare_report.to_markdown(rows, "x", "H100", clock="wall time")
    assert "| wall time per step (median, range) |" in table and "CPU time" not in table


@pytest.mark.slow
def test_a_whole_compare_calibrates_on_torchs_partitions_and_times_them_in_torchs_programs(tmp_path):
    import csv

    import yaml

    # compare sets the experiment's CPU threads, raises dynamo's recompile limit and leaves a dozen compiles of the
    # MLP's forward in dynamo's cache: all put back after (a later test counts a worker's cache hits in this process)
    threads, limit = torch.get_num_threads(), torch._dynamo.config.recompile_limit

    path = tmp_path / "tiny.yaml"
    path.write_text("model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [16, 32, 32, 4], dropout: 0.1}}\n"
                    "inputs: [{shape: [batch, 16]}]\ntarget: {shape: [batch], dtype: int64, high: 4}\n"
                    "loss: cross_entropy\nbatch_size: 8\nbudget: 0.5x\ncosts: {source: measure, device: cpu, threads: 1}\n"
                    "search_space: compiled\nga: {population: 8, generations: 3, workers: 1}\n")
    lines = []
    try:
        rows = compare.run(path, rounds=1, steps=1, below=(), results_root=tmp_path, cache_dir=tmp_path / "costs",
                           progress=lines.append, workers=0)
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()
    folder = tmp_path / "tiny"
    torch_rows = {r["knob"]: r for r in rows if r["method"] == "torch.compile"}
    assert list(torch_rows) == ["1", "0.5", "0.2"] and rows[0]["method"] == "eager"
    ours = [r for r in rows if r["method"] == "gaswap"]
    assert ours and all(r["peak_bytes"] <= min(t["peak_bytes"] for t in torch_rows.values() if t["budget"] == r["knob"])
                        for r in ours)  # each pick at or under the torch peak its budget is
    points = yaml.safe_load((folder / "compiled" / "p00.yaml").read_text())["provenance"]["calibration"]["points"]
    labels = [label for label, _, _ in points]
    assert labels[0] == "torch 1"  # torch's partitions first, then gaswap's own calibration policies
    assert sum(label.startswith("random half") for label in labels) <= 1  # torch's partitions in the others' place
    assert any("calibrating the compiled model" in line and "beside torch.compile's" in line for line in lines)
    finalists = list(csv.DictReader((folder / "finalists.csv").open()))
    theirs = [f for f in finalists if f["origin"].startswith("torch")]
    assert theirs  # torch's partitions are finalists at the budgets they fit, timed in torch's own programs
    for f in theirs:
        assert float(f["compile_s"]) == torch_rows[f["origin"].removeprefix("torch ")]["compile_s"]
    for r in ours:  # a pick is compiled as gaswap's policy, the programs it writes to pNN.yaml
        if r["origin"].startswith("torch"):
            assert r["compile_s"] != torch_rows[r["origin"].removeprefix("torch ")]["compile_s"]


def test_an_experiment_naming_no_ga_is_searched_with_compares_own_settings(tmp_path):
    """The defaults (64 policies a generation, up to 500 generations, patience 50) would take minutes a compare on a
    model nobody wrote settings for; an experiment's own `ga` is kept."""
    from gaswap.base import config

    body = ("model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [12, 32, 5]}}\ninputs: [{shape: [batch, 12]}]\n"
            "target: {shape: [batch], dtype: int64, high: 5}\nloss: cross_entropy\nbatch_size: 8\nbudget: 1.0x\n"
            "search_space: compiled\n")
    (tmp_path / "plain.yaml").write_text(body)
    (tmp_path / "own.yaml").write_text(body + "ga: {population: 8, generations: 3}\n")
    plain = compare.search_settings(config.load_experiment(tmp_path / "plain.yaml"))
    own = compare.search_settings(config.load_experiment(tmp_path / "own.yaml"))
    assert plain.ga is compare.SEARCH and plain.ga.generations < config.GASettings().generations
    assert (own.ga.population, own.ga.generations) == (8, 3)


def test_next_to_a_torch_partition_chosen_in_round_one_a_policy_that_fits_is_timed_in_round_two():
    from gaswap.app import compare_screen
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

    def evaluated(k, seconds=1.0, peak=0):
        return Evaluated(Chromosome((0.0,), (k,)), seconds, peak)

    torch_05, torch_02, own_run = object(), object(), object()
    stand_ins = {(1,): compare.Method("torch.compile", "0.5", None, torch_05, None),
                 (3,): compare.Method("torch.compile", "0.2", None, torch_02, None)}
    made = {(1,): (compare.Method("gaswap", "A #1", None, torch_05, None, origin="torch 0.5"), None, None),
            (2,): (compare.Method("gaswap", "C #2", None, own_run, None), None, None),
            (3,): (compare.Method("gaswap", "D #3", None, torch_02, None, origin="torch 0.2"), None, None)}
    rows = {(1,): {"peak_bytes": 100}, (2,): {"peak_bytes": 90}, (3,): {"peak_bytes": 92}}
    chosen = {"A": evaluated(1), "B": evaluated(1), "C": evaluated(2), "D": evaluated(3)}
    budget_of = {"A": 130, "B": 120, "C": 300, "D": 105}
    standing = dict.fromkeys(chosen, 2.0)
    found = {(1,): evaluated(5, 1.99, 10 + 95), (3,): None}  # next to torch 0.5's: less memory, no gain predicted
    asked, said = [], []

    def near(label, start, problem, deadline):
        asked.append((label, start.actions))
        policy = found.get(label, found[start.actions])
        return compare_screen.Nearby(policy, 4, 0 if policy is None else 2, 0 if policy is None else 1)

    def near_torch(round2):
        asked.clear(), said.clear()
        out = compare._near_torch(round2, chosen, rows, made, stand_ins, "refit", standing, near, 10, budget_of,
                                  said.append)
        return [(label, [e.chromosome.actions[0] for e in es]) for label, es in out]

    # the smallest budget first; C's choice is gaswap's own; A reuses what B found next to the same partition
    assert near_torch([("A", [evaluated(4), chosen["A"]])]) == [("A", [4, 1, 5]), ("B", [5, 1])]
    assert asked == [("D", (3,)), ("B", (1,))]
    assert said == ["  at D: of the values torch 0.2's partition recomputes, 4 tried kept alone, 0 fit by inductor's "
                    "programs",
                    "  at B: of the values torch 0.5's partition recomputes, 4 tried kept alone, 2 fit; 1 kept: its "
                    "programs 95 B against 100 B measured, predicted -0.5%: a finalist",
                    "  at A: of the values torch 0.5's partition recomputes, 4 tried kept alone, 2 fit; 1 kept: its "
                    "programs 95 B against 100 B measured, predicted -0.5%: a finalist"]
    found[(1,)] = evaluated(6, 1.99, 10 + 100)  # as much memory, no gain: not worth a compile
    assert near_torch([]) == [] and said[1].endswith("not compiled (no less memory, nor 3 % faster predicted)")
    found |= {"B": None, "A": evaluated(7, 1.9, 10 + 125)}  # none at B; at A, one predicted 5 % faster
    assert near_torch([]) == [("A", [7, 1])] and asked == [("D", (3,)), ("B", (1,)), ("A", (1,))]
    tried_none = compare._near_torch([], {"D": chosen["D"]}, rows, made, stand_ins, "refit", standing,
                                     lambda *_: compare_screen.Nearby(None, 0, 0, 0), 10, budget_of, said.append)
    assert tried_none == [] and said[-1] == "  at D: none torch 0.2's partition recomputes is predicted faster kept"


def test_next_to_torch_is_looked_at_only_where_no_finalist_of_the_searchs_own_fit():
    from gaswap.plan.encoding import Chromosome
    from gaswap.plan.problem import Evaluated

    def evaluated(k):
        return Evaluated(Chromosome((0.0,), (k,)), 1.0, 0)

    torch_run = object()
    stand_ins = {(1,): compare.Method("torch.compile", "0.5", None, torch_run, None)}
    made = {(1,): (compare.Method("gaswap", "#1", None, torch_run, None), None, None),
            (2,): (compare.Method("gaswap", "#2", None, object(), None), None, None),
            (3,): (compare.Method("gaswap", "#3", None, object(), None), None, None)}
    rows = {(1,): {"peak_bytes": 80}, (2,): {"peak_bytes": 95}, (3,): {"peak_bytes": 120}}
    finalists = [("A", [evaluated(2), evaluated(1)]), ("B", [evaluated(3), evaluated(1)]), ("C", [evaluated(1)])]
    # A: its own finalist #2 measured 95, under 100; B: #3 over 100; C: torch's partition alone
    assert compare._own_fitting(finalists, made, rows, stand_ins, {"A": 110, "B": 110, "C": 110}, 10) == {"A"}
