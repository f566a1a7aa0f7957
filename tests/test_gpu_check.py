"""The GPU check's CPU side: the skip without CUDA, the derived experiments, goals and report assembly."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gaswap.app import gpu_check
from gaswap.base import config


def test_without_cuda_the_check_writes_a_report_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = gpu_check.run(tmp_path / "check.json")
    assert report["cuda"] is False and "no CUDA" in report["skipped"]
    assert json.loads((tmp_path / "check.json").read_text())["skipped"] == report["skipped"]


def test_derived_experiments_measure_on_cuda_and_search_briefly(tmp_path):
    for path in gpu_check.EXPERIMENTS:
        exp = config.load_experiment(gpu_check.derived_experiment(path, tmp_path))
        original = config.load_experiment(path)
        assert (exp.costs.source, exp.costs.device) == ("measure", "cuda")
        assert (exp.ga.population, exp.ga.generations) == (32, 15)
        assert exp.name == original.name + "_gpu_check" and exp.budget == original.budget
        assert exp.model == original.model and exp.search_space == original.search_space


def test_goals_from_a_validation_and_a_memory_run():
    validation = {"budget_bytes": 1000, "measured": {"peak_bytes": 980}, "peak_ratio": 1.03, "time_ratio": 0.85}
    assert gpu_check.goals(validation, {"measured": {"reserved_bytes": 1100}}) == {
        "peak_within_5pct": True, "peak_under_budget": True, "reserved_under_budget": False,
        "step_time_within_10pct": False}


def test_report_assembly_goes_on_after_a_failed_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(gpu_check, "cuda_tests", lambda timeout: {"rc": 0, "summary": "1 passed"})

    def check(path, work, steps):
        if "alexnet" in path:
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        return {"goals": {"peak_within_5pct": True}}

    monkeypatch.setattr(gpu_check, "check_experiment", check)
    monkeypatch.setattr(gpu_check, "compare", lambda experiment, work, timeout: {"skipped": "no compare verb"})
    report = gpu_check.run(tmp_path / "r.json")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["device"] == "Stand-in GPU" and written["tests"]["rc"] == 0
    assert written["experiments"]["alexnet_4gb"] == {"error": "alexnet_4gb: RuntimeError: CUDA error: out of memory"}
    assert written["experiments"]["gpt_bench"]["goals"] == {"peak_within_5pct": True}
    assert report["errors"] == ["alexnet_4gb: RuntimeError: CUDA error: out of memory"]


@pytest.mark.slow
def test_one_experiment_runs_end_to_end_on_the_cpu(tmp_path):
    """The code the GPU runs, on the CPU with a tiny experiment: search, validate and the memory run."""
    out = gpu_check.check_experiment("experiments/tiny_cnn_cpu.yaml", tmp_path, steps=3, device="cpu")
    assert out["validation"]["measured"]["peak_bytes"] > 0
    memory = out["memory"]
    assert memory["measured"]["requested_bytes"] == out["validation"]["measured"]["peak_bytes"]
    assert memory["predicted"]["requested"] == memory["predicted"]["simulated"]  # the replay of the policy's program
    assert set(out["goals"]) == {"peak_within_5pct", "peak_under_budget", "reserved_under_budget",
                                 "step_time_within_10pct"}
    arena = out["arena"]  # the same memory run from an arena: the arena is counted, nothing fails
    assert "error" not in arena and arena["arena"]["bytes"] > 0
    assert arena["requested_with_arena_bytes"] >= arena["arena"]["bytes"]


def test_the_head_to_head_is_found_when_the_cli_has_it():
    assert gpu_check.has_compare() == _cli_lists("compare")


def _cli_lists(verb: str) -> bool:
    import contextlib
    import io

    from gaswap.app import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["--help"])
    return verb in out.getvalue()


def test_the_script_runs_with_deap_but_without_moocore(tmp_path):
    """deap 1.4.2+ imports moocore in deap.tools; the lent GPU machine has deap only (a wheel): the script stands
    a module in for moocore, so the check starts (here, without CUDA, it writes its skip report)."""
    hide = tmp_path / "hide" / "moocore"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('moocore is hidden by the test')\n")
    env = os.environ | {"PYTHONPATH": str(hide.parent)}
    plain = subprocess.run([sys.executable, "-c", "from deap import tools"], env=env, capture_output=True)
    assert plain.returncode != 0  # without the stand-in deap.tools does not import
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(report)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert "no CUDA device" in json.loads(report.read_text())["skipped"]


def test_only_the_files_with_cuda_tests_are_collected():
    """The lent GPU machine has no hypothesis: collecting every test file would stop pytest before any CUDA test."""
    files = gpu_check.cuda_test_files()
    assert [f.name for f in files] == ["test_compiled.py", "test_runtime.py"]
    assert all("hypothesis" not in f.read_text() for f in files)
