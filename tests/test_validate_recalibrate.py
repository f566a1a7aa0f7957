"""`gaswap validate --recalibrate`: a compiled policy's step time predicted from a calibration timed here."""
from dataclasses import replace
from pathlib import Path

from gaswap.app import validate_compiled
from gaswap.app.cli import main
from gaswap.base import config
from gaswap.compiled import calibration_run, partition, step_model
from gaswap.compiled.methods import setup
from gaswap.plan.policy import Policy, load, save


def _mlp_experiment(tmp_path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text("model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [12, 32, 48, 5]}}\n"
                    "inputs: [{shape: [batch, 12]}]\ntarget: {shape: [batch], dtype: int64, high: 5}\n"
                    "loss: cross_entropy\noptimizer: sgd_momentum\nbatch_size: 8\nbudget: 1.0x\n"
                    "costs: {source: measure, device: cpu, threads: 1}\n")
    return path


def test_recalibrating_fits_the_model_on_times_taken_here_and_prices_the_policy_with_it(tmp_path, monkeypatch):
    """The calibration runs stood in for by a known law of the model's own terms (20 ms plus 3 ms a MB saved for
    the backward): the fit finds the law, and the policy is priced by it and measured beside the calibration."""
    exp = config.load_experiment(_mlp_experiment(tmp_path))
    dev, model, inputs, target, graph = setup(exp, "cpu")
    space = config.load_search_space(partition.SPACE)
    measured_costs = []
    real_measure = validate_compiled.measure
    monkeypatch.setattr(validate_compiled, "measure", lambda *a, **k: measured_costs.append(real_measure(*a, **k))
                        or measured_costs[-1])

    def law(policy) -> float:
        problem = step_model.CompiledProblem(graph, measured_costs[-1], None, space, loss=exp.loss)
        encoding = problem.encoding
        chromosome = problem.canonical(encoding.read_back(policy.actions))
        ((_, _, _, saved, _),) = step_model.features(problem, [chromosome])
        return 0.020 + 3e-9 * saved

    timed = []
    monkeypatch.setattr(calibration_run, "cpu_times_of", lambda policies, *args, **kwargs: timed.append(policies)
                        or [(law(p), 1000) for p in policies])
    policy = partition.make_policy(graph, dict.fromkeys(graph.candidates()[:2], "recompute"))  # the first layer's
    lines = []
    (r,) = validate_compiled.recalibrated([policy], exp, graph, dev, model, inputs, target, lines.append)
    (calibration_policies,) = timed  # timed in one go, the policy last
    assert calibration_policies[-1] is policy and len(calibration_policies) == len(r["calibration"]["points"]) + 1
    assert "1 beside them" in lines[0]
    assert r["measured_beside_s"] == law(policy) not in [m for _, m, _ in r["calibration"]["points"]]
    assert abs(r["step_time_s"] / law(policy) - 1) < 1e-9
    assert abs(r["calibration"]["saved_s_per_byte"] / 3e-9 - 1) < 1e-9
    assert r["time_ratio"] == r["measured_beside_s"] / r["step_time_s"]
    assert r["device"] == measured_costs[-1].device and r["cpu_s"] >= 0 and r["wall_s"] >= 0
    assert r["worst_fit"] < 1e-9  # the law is the model's own


def test_the_report_sets_the_recalibrated_prediction_beside_the_policys(tmp_path):
    policy = Policy("f", (), {}, {"peak_bytes": 1050, "step_time_s": 1.0, "resident_bytes": 100},
                    {"form": "compiled", "device": "cpu: Elsewhere (1 thread)"})
    again = {"step_time_s": 2.1, "measured_beside_s": 2.0, "time_ratio": 2.0 / 2.1, "device": "cpu: here",
             "cpu_s": 30.0, "wall_s": 45.0, "calibration": {"points": [["keep-all", 2.2, 2.3]]}, "worst_fit": 0.045}
    r = validate_compiled.report(policy, tmp_path / "p.yaml", "e", "cpu: here", 3, [1000], [2.0], [None], 0.1, again)
    assert r["recalibrated"] == again
    assert r["targets"]["time_within_15pc"] is False and r["targets"]["recalibrated_time_within_15pc"] is True


def test_recalibrate_refuses_a_policy_that_is_not_compiled(tmp_path, capsys):
    save(Policy("f", ("a",), {}, {"peak_bytes": 1, "step_time_s": 1.0}), tmp_path / "p.yaml")
    assert main(["validate", str(tmp_path / "p.yaml"), "--recalibrate"]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert "p.yaml: --recalibrate times a compiled policy's calibration again" in error


def test_validate_prints_the_recalibrated_prediction_and_why_it_misses(tmp_path, monkeypatch, capsys):
    from gaswap.app import validate

    policy = Policy("f", (), {}, {"peak_bytes": 1050, "step_time_s": 1.0, "resident_bytes": 100},
                    {"form": "compiled", "device": "cpu: Elsewhere (1 thread)", "budget_bytes": 1200})
    save(policy, tmp_path / "p.yaml")
    again = {"step_time_s": 2.5, "measured_beside_s": 2.0, "time_ratio": 0.8, "device": "cpu: here", "cpu_s": 30.0,
             "wall_s": 45.0, "calibration": {"points": [["keep-all", 2.2, 2.3]] * 7}, "worst_fit": 0.12}
    monkeypatch.setattr(validate, "validate", lambda path, *args, **kwargs: validate_compiled.report(
        load(path), path, "e", "cpu: here", 3, [1000], [2.0], [None], 1.7, again))  # as if trained here
    assert main(["validate", str(tmp_path / "p.yaml"), "--recalibrate"]) == 0
    out, err = capsys.readouterr()
    assert "recalibrated here: predicted 2500.0 ms, measured beside the calibration 2000.0 ms (-20.0%)" in out, out
    assert "7 calibration policies took 30 CPU s, 45 s wall; the model fits them within 12.0%" in out
    assert "not within 15%: the model fits its own points no closer than 12.0%, timed at a load of 1.70" in out
    assert "--recalibrate times this policy's calibration" not in err  # it did
    save(replace(policy, provenance={"form": "compiled"}), tmp_path / "p.yaml")  # no budget recorded, no device
    assert main(["validate", str(tmp_path / "p.yaml"), "--recalibrate"]) == 0
    assert "budget none recorded" in capsys.readouterr().out


def test_a_policy_of_another_torch_release_is_refused_before_recalibrating(tmp_path, monkeypatch):
    """On a GPU machine with another torch, a shipped policy was refused only when its compile ran, after the
    calibration's 33 s (results/gpu_check/run5_validate_log.txt)."""
    import pytest

    from gaswap.plan.policy import PolicyError

    exp = config.load_experiment(_mlp_experiment(tmp_path))
    dev, model, inputs, target, graph = setup(exp, "cpu")
    policy = partition.make_policy(graph, dict.fromkeys(graph.candidates()[:2], "recompute"),
                                   {"peak_bytes": 1000, "step_time_s": 1.0, "resident_bytes": 100},
                                   {"torch_version": "1.13.0+cu117"})
    monkeypatch.setattr(validate_compiled, "setup", lambda exp, device: (dev, model, inputs, target, graph))
    monkeypatch.setattr(validate_compiled, "recalibrated", lambda *a, **k: pytest.fail("recalibrated first"))
    with pytest.raises(PolicyError, match="made with torch 1.13.0"):
        validate_compiled.validate_compiled(policy, tmp_path / "p.yaml", exp, 2, "cpu", recalibrate=True)
