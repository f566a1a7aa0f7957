"""The memory side of the compiled model's calibration (gaswap.compiled.step_model): the peak offset and the
inlining of recomputed candidates, fitted on the calibration runs' measured peaks. Hand-made graphs."""
import pytest
from helpers import unit_costs

from gaswap.compiled import step_model as cc
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.graph import Graph, Op, Tensor

MB = 1 << 20


def _backward(read_again: bool = False, small: bool = False) -> Graph:
    """x -mm-> a -mm-> y; backward: g1 = mm(y) (a library call), g2 = mul(g1, a) (generated), g3 = mul(g2, a),
    gw = mm(g3, x); with `read_again`, the last mm reads g1 too; with `small`, g2 is half g1's size.
    `sig`, sigmoid(a), is a candidate read by the last mul: inlined by inductor when recomputed."""
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
        for a in actions.values():
            c = Chromosome(plain.encoding.captured_keys(), tuple(int(Action.parse(a[t])) for t in plain.encoding.candidates))
            seconds = 1.0 + sum(v == "recompute" for v in a.values())
            out.append((seconds, plain.simulate(c).peak_bytes - resident + 4096) if with_peaks else seconds)
        return out

    with_peaks = cc.calibrate(g, unit_costs(g), lambda a: runs(a, True))
    assert with_peaks.peak_offset == 4096 and len(with_peaks.peak_samples) == len(with_peaks.samples)
    without = cc.calibrate(g, unit_costs(g), lambda a: runs(a, False))
    assert without.peak_offset == 0 and without.base == pytest.approx(with_peaks.base)


def test_calibrate_times_given_partitions_first_in_place_of_all_random_halves_but_one():
    g = _gated()
    plain = cc.CompiledProblem(g, unit_costs(g), None, actions=(Action.KEEP, Action.RECOMPUTE))
    every = set(plain.encoding.candidates)
    keep_all = {t: "keep" for t in every}
    recompute_s = keep_all | {"s": "recompute"}
    timed = []

    def runs(actions):
        timed.append(actions)
        return [1.0 + sum(v == "recompute" for v in a.values()) for a in actions.values()]

    cc.calibrate(g, unit_costs(g), runs)
    cc.calibrate(g, unit_costs(g), runs, partitions={"torch 1": keep_all, "torch 0.5": recompute_s})
    alone, beside = timed
    assert list(alone) == list(cc.calibration_policies(plain))
    assert list(beside)[:2] == ["torch 1", "torch 0.5"] and beside["torch 0.5"]["s"] == "recompute"
    assert "keep-all" not in beside  # the same actions as torch 1's partition: timed once, under its name
    assert sum(label.startswith("random") for label in beside) <= cc.PARTITION_MIXES


def _gated() -> Graph:
    """x -mm-> a; s = sigmoid(a), p = mul(s, a) (generated), y = mm(p); backward: g = mm(y), h = mul(g, s),
    gw = mm(h, a)."""
    t = {"x": Tensor("x", MB, "input"), "w": Tensor("w", MB, "param"), "gw": Tensor("gw", MB, "grad", "wgrad")}
    for name, producer in (("a", "mm1"), ("s", "sig"), ("p", "prod"), ("y", "mm2"), ("g", "gout"), ("h", "mul")):
        t[name] = Tensor(name, 4 * MB if name in "gh" else MB, "activation", producer)  # the backward's peak
    ops = (Op("mm1", "aten.mm.default", ("x", "w"), ("a",)),
           Op("sig", "aten.sigmoid.default", ("a",), ("s",)),
           Op("prod", "aten.mul.Tensor", ("s", "a"), ("p",)),
           Op("mm2", "aten.mm.default", ("p", "w"), ("y",)),
           Op("gout", "aten.mm.default", ("y", "w"), ("g",), phase="bwd"),
           Op("mul", "aten.mul.Tensor", ("g", "s"), ("h",), phase="bwd"),
           Op("wgrad", "aten.mm.default", ("h", "a"), ("gw",), phase="bwd"))
    return Graph(ops, t, loss="y")


def test_the_calibration_compile_jobs_are_the_policies_calibrate_then_compiles():
    from types import SimpleNamespace

    from gaswap.compiled import calibration_run, pool

    g = _gated()
    partitions = {"torch 1": {t: "keep" for t in g.candidates()}}
    exp = SimpleNamespace(optimizer="sgd", counts=(), loss="sum")
    asked = []

    def runs(actions):
        asked.append(actions)
        return [1.0 + sum(v == "recompute" for v in a.values()) for a in actions.values()]

    cc.calibrate(g, unit_costs(g), runs, "sum", partitions)
    own = [a for label, a in asked[0].items() if label not in partitions]
    jobs = calibration_run.compile_jobs(exp, g, unit_costs(g), partitions)
    assert len(own) >= 2 and [job.policy.actions for job in jobs] == own  # each policy, in order
    assert [job.label for job in jobs] == [f"calibration policy {k + 1}" for k in range(len(own))]
    assert len({pool.actions_key(job.policy) for job in jobs}) == len(jobs)


def test_the_peaks_choose_whether_recomputed_candidates_are_inlined():
    g = _gated()
    actions = (Action.KEEP, Action.RECOMPUTE)
    plain = cc.CompiledProblem(g, unit_costs(g), None, actions=actions)
    assert "s" in cc.inlined(g)[1]  # the rules inline s where it is recomputed
    counted = cc.CompiledProblem(g, unit_costs(g), None, actions=actions,
                                 calibration=cc.Calibration(1.0, 1.0, inline_recomputed=False))
    policies = [(label, c) for label, c in (("keep-all", plain.encoding.uniform(Action.KEEP)),
                                            ("recompute", plain.encoding.uniform(Action.RECOMPUTE)))]
    resident = plain.fused.resident_bytes()
    inlined_peak = plain.simulate(policies[1][1]).peak_bytes
    counted_peak = counted.simulate(policies[1][1]).peak_bytes
    assert counted_peak > inlined_peak  # s takes memory of its own in the backward
    for variant, truth in ((False, counted), (True, plain)):  # peaks measured as each variant says, 512 bytes over
        measured = [(label, c, truth.simulate(c).peak_bytes - resident + 512) for label, c in policies]
        fitted = cc.fit_peaks(cc.Calibration(1.0, 1.0), plain, measured)
        assert fitted.inline_recomputed is variant and fitted.peak_offset == 512
        assert fitted.to_dict()["inline_recomputed"] is variant
        again = cc.refit(fitted, plain, [("again", policies[0][1], 2.0)])
        assert again.inline_recomputed is variant and again.peak_offset == 512
    assert cc.fit_peaks(cc.Calibration(1.0, 1.0), plain, []) == cc.Calibration(1.0, 1.0)


def _forked() -> Graph:
    """x -mm-> a; u = neg(a), read by the forward alone; s = sigmoid(u) and c = cos(u), both inlined by the rules
    when recomputed, make p = mul(s, c), y = mm(p); backward: g = mm(y), h = mul(g, s), k = mul(h, c),
    gw = mm(k, a). Recomputed and held (not inlined), s and c are each re-produced from a re-produced u: the two
    simulations price recomputing them differently."""
    t = {"x": Tensor("x", MB, "input"), "w": Tensor("w", MB, "param"), "gw": Tensor("gw", MB, "grad", "wgrad")}
    for name, producer in (("a", "mm1"), ("u", "neg"), ("s", "sig"), ("c", "cos"), ("p", "prod"), ("y", "mm2"),
                           ("g", "gout"), ("h", "mul"), ("k", "mul2")):
        t[name] = Tensor(name, MB, "activation", producer)
    ops = (Op("mm1", "aten.mm.default", ("x", "w"), ("a",)),
           Op("neg", "aten.neg.default", ("a",), ("u",)),
           Op("sig", "aten.sigmoid.default", ("u",), ("s",)),
           Op("cos", "aten.cos.default", ("u",), ("c",)),
           Op("prod", "aten.mul.Tensor", ("s", "c"), ("p",)),
           Op("mm2", "aten.mm.default", ("p", "w"), ("y",)),
           Op("gout", "aten.mm.default", ("y", "w"), ("g",), phase="bwd"),
           Op("mul", "aten.mul.Tensor", ("g", "s"), ("h",), phase="bwd"),
           Op("mul2", "aten.mul.Tensor", ("h", "c"), ("k",), phase="bwd"),
           Op("wgrad", "aten.mm.default", ("k", "a"), ("gw",), phase="bwd"))
    return Graph(ops, t, loss="y")


def test_calibrate_fits_the_times_on_the_simulation_the_peaks_choose():
    g = _forked()
    actions = (Action.KEEP, Action.RECOMPUTE)
    plain = cc.CompiledProblem(g, unit_costs(g), None, actions=actions)
    held = cc.CompiledProblem(g, unit_costs(g), None, actions=actions, inline_recomputed=False)
    policies = cc.calibration_policies(plain)
    assert cc.features(plain, list(policies.values())) != cc.features(held, list(policies.values()))
    resident = plain.fused.resident_bytes()

    base = cc.library_seconds(g, unit_costs(g)) + 1.0  # a step runs its library calls, at least

    def runs(labelled):  # a step as the held simulation prices it, and its peak
        cs = [plain.encoding.read_back(a) for a in labelled.values()]
        return [(base + 0.5 * generated + 2.0 * extern, held.simulate(c).peak_bytes - resident)
                for c, (extern, generated, *_) in zip(cs, cc.features(held, cs))]

    calibration = cc.calibrate(g, unit_costs(g), runs)
    assert calibration.inline_recomputed is False
    priced = cc.CompiledProblem(g, unit_costs(g), None, actions=actions, calibration=calibration)
    for (label, c), (seconds, _) in zip(policies.items(), runs({k: plain.actions_of(c) for k, c in policies.items()})):
        assert priced.simulate(c).step_time == pytest.approx(seconds), label
