"""The compiled model's facts about inductor (gaswap.compiled.step_model): buffers a kernel writes into a buffer
it reads that dies there (`in_place`), and the peak offset fitted on measured calibration peaks. Hand-made
graphs."""
import pytest
from helpers import unit_costs

from gaswap.compiled import step_model as cc
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.graph import Graph, Op, Tensor

MB = 1 << 20


def _backward(read_again: bool = False, small: bool = False) -> Graph:
    """x -mm-> a -mm-> y; backward: g1 = mm(y) (a library call), g2 = mul(g1, a) (generated), g3 = mul(g2, a),
    gw = mm(g3, x); with `read_again`, the last mm reads g1 too; with `small`, g2 is half g1's size."""
    t = {"x": Tensor("x", MB, "input"), "w": Tensor("w", MB, "param"), "gw": Tensor("gw", MB, "grad", "wgrad")}
    for name, producer, size in (("a", "mm1", MB), ("y", "mm2", MB), ("g1", "gout", MB),
                                 ("g2", "mul", MB // 2 if small else MB), ("g3", "mul2", MB // 2 if small else MB)):
        t[name] = Tensor(name, size, "activation", producer)
    ops = (Op("mm1", "aten.mm.default", ("x", "w"), ("a",)),
           Op("mm2", "aten.mm.default", ("a", "w"), ("y",)),
           Op("gout", "aten.mm.default", ("y", "w"), ("g1",), phase="bwd"),
           Op("mul", "aten.mul.Tensor", ("g1", "a"), ("g2",), phase="bwd"),
           Op("mul2", "aten.mul.Tensor", ("g2", "a"), ("g3",), phase="bwd"),
           Op("wgrad", "aten.mm.default", ("g3", "x", *(("g1",) if read_again else ())), ("gw",), phase="bwd"))
    return Graph(ops, t, loss="y")


def test_a_kernel_writes_into_a_buffer_of_its_size_that_dies_there_and_follows_it():
    g = _backward()
    assert "a" in g.candidates() and "g2" not in g.candidates()
    # g2 takes g1's buffer (the mul is g1's last reader); g3 takes it next, as g2 dies at mul2; a, a candidate
    # the backward reads, is read last by mul2, but mul2's output went to g1's buffer already
    assert cc.in_place(g) == {"g2": "g1", "g3": "g1"}
    fused = cc.written(g)
    assert fused.tensors["g2"].size == 0 and fused.tensors["g3"].size == 0 and fused.tensors["g1"].size == MB
    assert "g1" in {op.name: op for op in fused.ops}["wgrad"].inputs  # g1's buffer lives until g3's reader
    assert cc.in_place(_backward(read_again=True)) == {"g3": "g2"}  # g1 read after the mul: not written into
    assert cc.in_place(_backward(small=True)) == {"g3": "g2"}  # g2 is smaller than g1: its own buffer
    assert cc.in_place(g, keep_apart={"g1"}) == {"g3": "g2"}  # g1 not written into


def test_a_policys_peak_counts_a_buffer_written_into_once():
    g = _backward()
    problem = cc.CompiledProblem(g, unit_costs(g), None, actions=(Action.KEEP, Action.RECOMPUTE))
    keep_all = problem.simulate(problem.encoding.uniform(Action.KEEP))
    apart = cc.CompiledProblem(g, unit_costs(g), None, actions=(Action.KEEP, Action.RECOMPUTE))
    apart.fused = cc.with_loss(g, "sum")  # the same graph, each buffer counted apart
    # during mul: a (saved), g1 and g2 apart; written into g1, one buffer less
    assert keep_all.peak_bytes <= keep_all_peak(apart) - MB


def keep_all_peak(problem) -> int:
    """Keep-all's peak of `problem` simulated on its `fused` graph as set."""
    from gaswap.plan.simulator import Simulator
    sim = Simulator(problem.fused, problem.costs, None, hold_sources=True)
    return sim.run(list(range(len(problem.fused.ops))), (int(Action.KEEP),) * len(problem.fused.candidates())).peak_bytes


def test_the_peak_offset_is_the_median_of_measured_less_simulated_and_moves_every_peak():
    g = _backward()
    actions = (Action.KEEP, Action.RECOMPUTE)
    plain = cc.CompiledProblem(g, unit_costs(g), None, actions=actions)
    policies = {"keep-all": plain.encoding.uniform(Action.KEEP), "recompute": plain.encoding.uniform(Action.RECOMPUTE)}
    resident = plain.fused.resident_bytes()
    simulated = {label: plain.simulate(c).peak_bytes - resident for label, c in policies.items()}
    measured = {"keep-all": simulated["keep-all"] + 1000, "recompute": simulated["recompute"] + 3000}
    samples = cc.peak_samples(plain, [(label, c, measured[label]) for label, c in policies.items()])
    assert samples == [(label, simulated[label], measured[label]) for label in policies]
    calibration = cc.Calibration(base=1.0, scale=1.0).with_peaks(samples)
    assert calibration.peak_offset == 2000 and calibration.to_dict()["peak_offset_bytes"] == 2000
    outlier = cc.Calibration(1.0, 1.0).with_peaks([*samples, ("odd", 0, 10 * MB), ("odd 2", 0, 1500)])
    assert outlier.peak_offset == 2250  # the median of 1000, 1500, 3000 and 10 MB: not moved by the outlier
    priced = cc.CompiledProblem(g, unit_costs(g), None, actions=actions, calibration=calibration)
    for c in policies.values():
        assert priced.simulate(c).peak_bytes == plain.simulate(c).peak_bytes + 2000
    assert cc.peak_samples(priced, [("keep-all", policies["keep-all"], 5)])[0][1] == simulated["keep-all"]
    assert cc.refit(calibration, plain, [("again", policies["recompute"], 2.0)]).peak_offset == 2000


def test_calibrate_fits_the_peak_offset_when_the_runs_give_their_peaks():
    g = _backward()
    plain = cc.CompiledProblem(g, unit_costs(g), None, actions=(Action.KEEP, Action.RECOMPUTE))
    resident = plain.fused.resident_bytes()

    def runs(actions, with_peaks: bool):
        out = []
        for a in actions:
            c = Chromosome(plain.encoding.captured_keys(), tuple(int(Action.parse(a[t])) for t in plain.encoding.candidates))
            seconds = 1.0 + sum(v == "recompute" for v in a.values())
            out.append((seconds, plain.simulate(c).peak_bytes - resident + 4096) if with_peaks else seconds)
        return out

    with_peaks = cc.calibrate(g, unit_costs(g), lambda a: runs(a, True))
    assert with_peaks.peak_offset == 4096 and len(with_peaks.peak_samples) == len(with_peaks.samples)
    without = cc.calibrate(g, unit_costs(g), lambda a: runs(a, False))
    assert without.peak_offset == 0 and without.base == pytest.approx(with_peaks.base)
