"""The GPU check's CPU side: the skip without CUDA, the derived experiments, goals and report assembly."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gaswap.app import gpu_check
from gaswap.base import config
from gaswap.compiled import offload_ops


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
        assert exp.name == original.name + "_gpu_check"
        planned = gpu_check.OVERRIDES.get(Path(path).stem, {})
        assert exp.budget == config.parse_size(planned.get("budget", str(original.budget)))
        assert exp.memory == (original.memory if "memory" not in planned else config.MemorySpec(**planned["memory"]))
        assert exp.model == original.model and exp.search_space == original.search_space


def test_goals_from_a_validation_and_a_memory_run():
    validation = {"budget_bytes": 1000, "measured": {"peak_bytes": 980}, "peak_ratio": 1.03, "time_ratio": 0.85}
    memory = {"target": "live", "measured": {"reserved_bytes": 1100}, "ratios_with_device_memory": {"reserved": 0.94}}
    assert gpu_check.goals(validation, memory) == {
        "peak_within_5pct": True, "reserved_within_5pct": False, "peak_under_budget": True,
        "reserved_under_budget": None, "step_time_within_10pct": False}  # a live target: reserved is no goal
    reserved = gpu_check.goals(validation, memory | {"target": "reserved"})["reserved_under_budget"]
    assert reserved is False  # planned for reserved memory: 1100 over the 1000 budget


def _stand_in_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(gpu_check, "cuda_tests", lambda timeout: {"rc": 0, "summary": "1 passed"})
    monkeypatch.setattr(gpu_check, "compare", lambda experiment, work, timeout: {"skipped": "no compare verb"})


def test_report_assembly_goes_on_after_a_failed_stage(tmp_path, monkeypatch):
    _stand_in_gpu(monkeypatch)
    for name in gpu_check.SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    limits = {}

    def stage(kind, path, work, steps, timeout):
        limits[path] = timeout
        if "alexnet" in path:
            raise gpu_check.StageFailed("RuntimeError: CUDA error: out of memory")
        return {"goals": {"peak_within_5pct": True}, **missed}

    monkeypatch.setattr(gpu_check, "run_stage", stage)
    missed = {}
    report = gpu_check.run(tmp_path / "r.json")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["device"] == "Stand-in GPU" and written["tests"]["rc"] == 0
    assert written["experiments"]["alexnet_4gb"] == {
        "error": "alexnet_4gb: StageFailed: RuntimeError: CUDA error: out of memory"}
    assert written["experiments"]["gpt_bench"]["goals"] == {"peak_within_5pct": True}
    assert report["errors"] == ["alexnet_4gb: StageFailed: RuntimeError: CUDA error: out of memory"]
    assert report["timed_out"] == []
    missed["error"] = "policy.yaml: out of memory on Stand-in GPU capped at 1 GB"  # a stage that ran and missed
    assert gpu_check.run(tmp_path / "r.json")["errors"] == [
        "alexnet_4gb: StageFailed: RuntimeError: CUDA error: out of memory", f"gpt_bench: {missed['error']}"]
    assert limits == {p: gpu_check.STAGES[Path(p).stem] for p in gpu_check.EXPERIMENTS}  # each its own limit
    settings = written["settings"]
    assert settings["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert settings["allocator_defaults"] is False
    assert settings["compiled_swaps"] == ("async" if offload_ops.has_async_offload() else "refused")
    assert {"cudnn_benchmark", "cudnn_deterministic", "matmul_allow_tf32", "cudnn_version"} <= set(settings)
    assert written["torch"] == torch.__version__ and written["python"] == sys.executable


def test_a_stage_past_its_limit_is_killed_and_named_and_the_check_goes_on(tmp_path, monkeypatch):
    _stand_in_gpu(monkeypatch)
    monkeypatch.setitem(gpu_check.STAGES, "alexnet_4gb", 10.0)
    started = {}

    def stage(kind, path, work, steps, timeout):
        started[Path(path).stem] = time.monotonic()
        if "alexnet" in path:  # a process that would run for a minute, killed at its limit
            subprocess.run([sys.executable, "-c", "import time; time.sleep(60)"], check=False, timeout=timeout)
        return {"goals": {}}

    monkeypatch.setattr(gpu_check, "run_stage", stage)
    report = gpu_check.run(tmp_path / "r.json")
    assert report["timed_out"] == ["alexnet_4gb"]
    assert report["errors"] == ["alexnet_4gb: timed out after 10 s (its limit)"]
    assert 9 <= started["gpt_bench"] - started["alexnet_4gb"] < 30
    assert report["experiments"]["gpt_bench"] == {"goals": {}}


def test_a_stage_left_with_too_little_time_is_skipped_and_named(tmp_path, monkeypatch):
    _stand_in_gpu(monkeypatch)
    monkeypatch.setattr(gpu_check, "run_stage", lambda *a: {"goals": {}})
    report = gpu_check.run(tmp_path / "r.json", deadline_s=5)
    assert report["errors"][0].startswith("tests: skipped") and len(report["errors"]) == 4


def test_failed_cuda_tests_fail_the_check(tmp_path, monkeypatch):
    _stand_in_gpu(monkeypatch)
    monkeypatch.setattr(gpu_check, "cuda_tests", lambda timeout: {"rc": 1, "summary": "1 failed, 9 passed"})
    monkeypatch.setattr(gpu_check, "run_stage", lambda *a: {"goals": {}})
    report = gpu_check.run(tmp_path / "r.json")
    assert report["errors"] == ["tests: StageFailed: exit 1: 1 failed, 9 passed"]


def test_a_stage_runs_in_a_process_of_this_interpreter(tmp_path):
    """The stage's process is this interpreter's (`sys.executable`): its own one-line error comes back."""
    with pytest.raises(gpu_check.StageFailed, match="unknown stage 'nothing'"):
        gpu_check.run_stage("nothing", "experiments/tiny_cnn_cpu.yaml", tmp_path, 3, timeout=120)


def test_the_stage_limits_fit_eight_minutes():
    assert list(gpu_check.STAGES) == ["tests", *(Path(p).stem for p in gpu_check.EXPERIMENTS), "compare"]
    assert sum(gpu_check.STAGES.values()) + 5 * len(gpu_check.STAGES) <= gpu_check.DEADLINE_S <= 8 * 60 - 20


@pytest.mark.slow
def test_one_experiment_runs_end_to_end_on_the_cpu(tmp_path):
    """The code the GPU runs, on the CPU with a tiny experiment: search, validate and the memory run."""
    out = gpu_check.check_experiment("experiments/tiny_cnn_cpu.yaml", tmp_path, steps=3, device="cpu")
    assert out["validation"]["measured"]["peak_bytes"] > 0
    memory = out["memory"]
    assert memory["measured"]["requested_bytes"] == out["validation"]["measured"]["peak_bytes"]
    assert memory["predicted"]["requested"] == memory["predicted"]["simulated"]  # the replay of the policy's program
    assert set(out["goals"]) == {"peak_within_5pct", "reserved_within_5pct", "peak_under_budget",
                                 "reserved_under_budget", "step_time_within_10pct"}
    assert memory["capped_at_bytes"] is None  # a CPU run is never capped
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


def _script_env(tmp_path, hide: str) -> dict:
    """An environment where `python3` on PATH cannot import anything gaswap needs and `hide` cannot be imported;
    the script is told to run `sys.executable` (PYTHON), as from a venv that is not activated."""
    hidden = tmp_path / "hide" / hide
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(f"raise ImportError('{hide} is hidden by the test')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\necho 'not this python' >&2\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    return os.environ | {"PYTHONPATH": str(hidden.parent), "PYTHON": sys.executable,
                         "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_script_runs_with_deap_but_without_moocore(tmp_path):
    """deap 1.4.2+ imports moocore in deap.tools; the lent GPU machine has deap only (a wheel): the script stands
    a module in for moocore, so the check starts (here, without CUDA, it writes its skip report), with the
    interpreter it is given, not the `python3` on PATH."""
    env = _script_env(tmp_path, "moocore")
    plain = subprocess.run([sys.executable, "-c", "from deap import tools"], env=env, check=False, capture_output=True)
    assert plain.returncode != 0  # without the stand-in deap.tools does not import
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(report)], env=env, check=False, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    written = json.loads(report.read_text())
    assert "no CUDA device" in written["skipped"] and written["python"] == sys.executable


def test_the_script_exits_2_without_deap_or_a_wheel_of_it(tmp_path):
    env = _script_env(tmp_path, "deap") | {"GASWAP_WHEELS": str(tmp_path / "no_wheels")}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "r.json")], env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no deap wheel" in proc.stderr and proc.stderr.count("\n") == 1


def test_only_the_files_with_cuda_tests_are_collected():
    """The lent GPU machine has no hypothesis: collecting every test file would stop pytest before any CUDA test."""
    files = gpu_check.cuda_test_files()
    assert [f.name for f in files] == ["test_compiled.py", "test_library_calls.py", "test_runtime.py"]
    assert all("hypothesis" not in f.read_text() for f in files)


def test_a_policy_out_of_memory_under_its_cap_is_an_error_with_the_uncapped_run_beside_it(tmp_path, monkeypatch):
    """On the H100 AlexNet's live plan ran out of memory capped at its budget; the stage then says so and still
    measures the same steps uncapped, so the report says by how much it missed."""
    from types import SimpleNamespace

    from gaswap.app import validate, workflow
    from gaswap.base.errors import NoFit

    prepared = SimpleNamespace(graph=SimpleNamespace(ops=[1, 2]), costs=SimpleNamespace(measured=2, estimated=()))
    monkeypatch.setattr(workflow, "prepare", lambda exp, cache_dir: prepared)
    monkeypatch.setattr(workflow, "run_search", lambda prepared, out, force: (SimpleNamespace(seconds=0.1), {}))

    def out_of_memory(policy, steps, device):
        raise NoFit("policy.yaml: out of memory on Stand-in GPU capped at 5.34 GB")

    monkeypatch.setattr(validate, "validate", out_of_memory)
    runs = []
    monkeypatch.setattr(gpu_check, "memory_run", lambda policy, steps, device, cap=True: runs.append(cap) or {"r": 1})
    out = gpu_check.check_experiment("experiments/alexnet_4gb.yaml", tmp_path, steps=3)
    assert out["error"] == "policy.yaml: out of memory on Stand-in GPU capped at 5.34 GB"
    assert out["memory_uncapped"] == {"r": 1} and runs == [False] and "validation" not in out


def test_an_out_of_memory_is_reported_with_torchs_message_and_the_program_line_it_came_from():
    """AlexNet ran out of memory capped on an H100 in two runs of three, and the report said only that
    (results/gpu_check/README.md): the next run says what was asked for, where, and what the allocator held."""
    from gaswap.base.errors import NoFit

    program = compile("def step():\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n",
                      "<gaswap program test>", "exec")
    scope = {"torch": torch}
    exec(program, scope)
    try:
        try:
            scope["step"]()
        except torch.OutOfMemoryError:
            raise NoFit("policy.yaml: out of memory capped at 7.34 GB") from None
    except NoFit as e:
        detail = gpu_check.out_of_memory(e, "cpu")
    assert "Tried to allocate 2.00 GiB" in detail["message"]
    assert detail["raised_in"] == ["<gaswap program test>:2:step"] and "allocator" not in detail  # no CUDA here


def test_the_check_says_which_experiments_step_the_host_bound(monkeypatch, capsys, tmp_path):
    """On an H100 gpt_bench's step missed its predicted time by 6-84 %, issued by the host for as long as it ran
    (results/gpu_check/, runs 8-14): the check's summary says so beside its goals."""
    from gaswap.app import cli

    def report(out, steps):
        bound = {"host_bound": True, "measured": {"step_time_s": 0.0137, "issue_time_s": 0.0135}}
        return {"errors": [], "seconds": 1.0, "experiments": {
            "gpt_bench": {"goals": {"step_time_within_10pct": False}, "validation": bound},
            "alexnet_4gb": {"goals": {"step_time_within_10pct": True}, "validation": {"host_bound": False}}}}

    monkeypatch.setattr(gpu_check, "run", report)
    assert cli.main(["check-gpu", "--out", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("  its step (13.7 ms) was bound by the host, which took 13.5 ms to issue it "
                        "(docs/running_policies.md)")
    assert lines[2].startswith("alexnet_4gb: ") and len(lines) == 4  # no such line for a step the GPU bound
