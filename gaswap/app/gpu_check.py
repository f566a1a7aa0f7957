"""The GPU check: one command that confirms on a CUDA machine what the CPU tests stand in for.

`python -m gaswap check-gpu --out gpu_check.json` (or `scripts/gpu_check.sh`, which brings deap along
as a wheel) runs, within about ten minutes:
1. the CUDA-marked tests (`pytest -m cuda`);
2. for AlexNet at 4 GB and the GPT bench: costs measured on this GPU, a short search, `validate` (measured vs
   predicted peak and step time), and a memory run that compares the caching allocator model's allocated
   and reserved peaks (and the optimizer step's) with `torch.cuda.memory_stats()`, and replays the
   allocation trace recorded on the GPU through the model (`allocator.replay_recorded`); and the same memory
   run from a preallocated arena (gaswap.run.arena_runtime): `max_memory_reserved` with the arena against without;
3. the torch.compile head-to-head (`gaswap compare` on its CNN experiment, two short rounds), if present;
and writes one JSON report. Without CUDA it writes a report saying so and exits 0. Goals: peak within
5 % of the prediction and never above the budget; step time within 10 %.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gaswap.base.files import write_atomic

EXPERIMENTS = ("experiments/alexnet_4gb.yaml", "experiments/gpt_bench.yaml")
SHORT_GA = {"population": 32, "generations": 15, "workers": 1}  # a search that fits the check's time
COMPARE = "experiments/compare_cnn_cpu.yaml"  # the head-to-head's smallest experiment (it runs on CUDA when present)
PEAK_TOLERANCE, TIME_TOLERANCE = 0.05, 0.10


def run(out: str | Path = "gpu_check.json", *, experiments=EXPERIMENTS, steps: int = 5, deadline_s: float = 540.0,
        work: str | Path | None = None) -> dict:
    """Run the check and write its JSON report to `out`; returns the report."""
    import torch

    started = time.monotonic()
    out = Path(out)
    work = Path(work) if work else out.with_suffix("")  # searches, costs and derived experiment files
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "errors": []}
    if not report["cuda"]:
        report["skipped"] = "no CUDA device: nothing to check (the CPU tests cover the CPU side)"
        return _write(out, report, started)
    report["device"] = torch.cuda.get_device_name()
    left = lambda: deadline_s - (time.monotonic() - started)  # noqa: E731
    report["tests"] = _stage(report, "tests", lambda: cuda_tests(timeout=min(150.0, left())))
    report["experiments"] = {}
    for path in experiments:
        name = Path(path).stem
        if left() < 60:
            report["errors"].append(f"{name}: skipped, less than a minute left")
            continue
        report["experiments"][name] = _stage(report, name, lambda: check_experiment(path, work, steps))
    report["compare"] = _stage(report, "compare", lambda: compare(COMPARE, work, timeout=max(10.0, left())))
    return _write(out, report, started)


def _stage(report: dict, name: str, fn):
    """fn(), or {"error": ...} with the error also listed in the report (one line, the check goes on)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failed stage is a finding of the check, not its end
        line = f"{name}: {type(e).__name__}: {e}".splitlines()[0][:500]
        report["errors"].append(line)
        return {"error": line}


def _write(out: Path, report: dict, started: float) -> dict:
    report["seconds"] = round(time.monotonic() - started, 1)
    write_atomic(out, json.dumps(report, indent=2, default=str) + "\n")  # a reader never sees half a report
    return report


def cuda_tests(timeout: float = 150.0) -> dict:
    """Run the CUDA-marked tests; their exit code and summary line."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", *map(str, cuda_test_files())],
                          capture_output=True, text=True, timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-300:],
            "seconds": round(time.monotonic() - started, 1)}


def cuda_test_files(folder: str | Path = "tests") -> list[Path]:
    """The test files that hold CUDA-marked tests: only those are collected, so that a machine without the test
    suite's other needs (hypothesis, scipy, ...) still runs them (pytest stops at any file it cannot import)."""
    return sorted(p for p in Path(folder).glob("test_*.py") if "mark.cuda" in p.read_text())


def derived_experiment(path: str | Path, work: Path, device: str = "cuda") -> Path:
    """A copy of an experiment file whose costs are measured on `device` and whose search is short."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    raw["name"] = f"{raw.get('name', Path(path).stem)}_gpu_check"
    raw["costs"] = {"source": "measure", "device": device}
    raw["ga"] = dict(raw.get("ga") or {}) | SHORT_GA
    space = raw.get("search_space")
    if isinstance(space, str) and (Path(path).parent / space).exists():  # a relative path: keep it pointing there
        raw["search_space"] = str((Path(path).parent / space).resolve())
    work.mkdir(parents=True, exist_ok=True)
    derived = work / f"{raw['name']}.yaml"
    write_atomic(derived, yaml.safe_dump(raw, sort_keys=False))
    return derived


def check_experiment(path: str | Path, work: Path, steps: int, device: str = "cuda") -> dict:
    """Measure costs, search, validate and compare memory for one experiment (`device`: cuda; the CPU runs
    the same code in a test)."""
    # imported when the check runs: the CLI lists `check-gpu` without loading torch
    from gaswap.app import validate, workflow
    from gaswap.base import config

    exp = config.load_experiment(derived_experiment(path, work, device))
    started = time.monotonic()
    prepared = workflow.prepare(exp, cache_dir=work / "cache")
    measured_s = time.monotonic() - started
    result, _ = workflow.run_search(prepared, work / "results" / exp.name, force=True)
    policy = work / "results" / exp.name / "policy.yaml"
    validation = validate.validate(policy, steps=steps, device=device)
    memory = memory_run(policy, steps=3, device=device)
    out = {"ops": len(prepared.graph.ops), "costs_measured": prepared.costs.measured,
           "costs_estimated_ops": len(prepared.costs.estimated), "measure_s": round(measured_s, 1),
           "search_s": round(result.seconds, 1), "validation": validation, "memory": memory}
    out["goals"] = goals(validation, memory)
    # a failed arena run is recorded in its own entry ("error"); the experiment's other figures stand
    out["arena"] = _stage({"errors": []}, "arena", lambda: arena_run(policy, memory, device))
    return out


def arena_run(policy_path: str | Path, plain: dict, device: str = "cuda") -> dict:
    """The memory run from a preallocated arena (gradients included), beside the plain one (`plain`):
    reserved and allocated peaks with and without the arena, and the arena's planned size."""
    run = memory_run(policy_path, steps=3, device=device, arena=True)
    with_arena, without = run["measured"], plain["measured"]
    return {"arena": run["arena"], "measured": with_arena,
            "reserved_with_arena_bytes": with_arena["reserved_bytes"],
            "reserved_without_arena_bytes": without["reserved_bytes"],
            "reserved_ratio": with_arena["reserved_bytes"] / without["reserved_bytes"] if without["reserved_bytes"]
            else None,
            "requested_with_arena_bytes": with_arena["requested_bytes"],
            "requested_without_arena_bytes": without["requested_bytes"]}


def goals(validation: dict, memory: dict) -> dict:
    """The check's pass/fail lines from a validation report and a memory run."""
    budget = validation.get("budget_bytes")
    peak = validation["measured"]["peak_bytes"]
    reserved = memory.get("measured", {}).get("reserved_bytes")
    return {
        "peak_within_5pct": abs(validation["peak_ratio"] - 1) <= PEAK_TOLERANCE,
        "peak_under_budget": budget is None or peak <= budget,
        "reserved_under_budget": budget is None or reserved is None or reserved <= budget,
        "step_time_within_10pct": abs(validation["time_ratio"] - 1) <= TIME_TOLERANCE,
    }


def memory_run(policy_path: str | Path, steps: int = 3, device: str = "cuda", *, arena: bool = False) -> dict:
    """Train `steps` steps under a policy holding on the GPU only what the experiment counts (no inputs kept
    for cloning), then compare the allocator's peaks of the last step and its optimizer step with the
    allocator model's predictions for the same policy. On a CPU only the storage tracker's peak is measured.
    With `arena`, the step runs from a preallocated arena (an `ArenaRunner`, gradients in it too), which is
    counted; the report then says how big it is."""
    import torch

    # imported when the check runs: the CLI lists `check-gpu` without loading torch
    from gaswap.base import config
    from gaswap.plan import policy as policies
    from gaswap.plan.memory import allocator
    from gaswap.run import experiment, training
    from gaswap.run.arena_runtime import ArenaRunner, arena_figures
    from gaswap.run.capture import capture
    from gaswap.run.runtime import StepRunner

    policy = policies.load(policy_path)
    exp = config.load_experiment(policy.provenance["experiment_file"])
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:  # record every allocation from a clean cache: the model replays the same requests (replay_recorded)
        gc.collect()
        torch.cuda.empty_cache()
        _record_history(True)
    torch.manual_seed(exp.seed)
    model = experiment.build_model(exp, device=str(dev))
    spec_inputs, spec_target = experiment.make_inputs(exp, "meta")
    captured = capture(model, spec_inputs, spec_target, exp.loss, optimizer=exp.optimizer, counted=exp.counts,
                       autocast=exp.autocast)
    if arena:  # gradients too: each step drops them (training.optimizer_step) before the next
        runner = ArenaRunner(captured, policy.program, dev, results_in_arena=True)
    else:
        runner = StepRunner(captured, policy.program, dev)
    optimizer, params = training.make_optimizer(exp.optimizer, model), training.trainable(model)
    generator = torch.Generator(dev).manual_seed(exp.seed)
    figures = {}
    for _ in range(steps):
        inputs, target = experiment.make_inputs(exp, str(dev), generator)
        if exp.loss == "external":
            target = experiment.output_gradient(captured, dev, exp.seed)
        args = captured.arguments(model, inputs, target)
        del inputs, target
        held = training.resident(captured, args, optimizer, exp.counts, [runner.buffer] if arena else [])
        done = training.runtime_step(runner, args, held, optimizer, params, dev)
        figures = {"requested_bytes": done.memory.peak, "allocated_bytes": done.memory.allocated_peak,
                   "reserved_bytes": done.memory.reserved_peak, "optimizer_step_allocated_bytes": done.optimizer_peak}
    recorded = None
    if cuda:
        trace = torch.cuda.memory._snapshot()["device_traces"][dev.index or torch.cuda.current_device()]
        _record_history(False)
        recorded = allocator.replay_recorded(trace)
    predicted = allocator.replay(captured.graph, policy, optimizer=exp.optimizer)  # the program the runner ran
    pairs = (("requested", "requested_bytes", predicted.requested),
             ("allocated", "allocated_bytes", predicted.allocated), ("reserved", "reserved_bytes", predicted.reserved),
             ("optimizer_step", "optimizer_step_allocated_bytes", predicted.optimizer_step))
    ratios = {k: figures[m] / v for k, m, v in pairs if v}
    # the same program with swap-ins allocated on the h2d stream and frees by record_stream (the runtime before
    # issue 16's fixes): which of the two the GPU matches says which runtime ran
    older = allocator.replay(captured.graph, policy, optimizer=exp.optimizer, swap_in_stream="h2d",
                             swap_out_free="record_stream")
    return {"measured": figures, "predicted": predicted.as_dict(), "ratios": ratios, "recorded_replay": recorded,
            "predicted_h2d_record_stream": older.as_dict(), **({"arena": arena_figures(runner)} if arena else {}),
            "note": "measured allocated/reserved also hold what the model leaves out (cuBLAS/cuDNN workspaces); "
                    "optimizer step: absolute allocated peak, predicted: the model's allocated peak then"}


def _record_history(on: bool) -> None:
    """Start (without stack traces, which are slow) or stop torch.cuda.memory's allocation history."""
    import torch

    if not on:
        torch.cuda.memory._record_memory_history(None)
        return
    try:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
    except TypeError:  # an older signature
        torch.cuda.memory._record_memory_history(True)


def compare(experiment: str, work: Path, timeout: float = 120.0) -> dict:
    """Run the torch.compile head-to-head (`python -m gaswap compare EXPERIMENT`, on the GPU: it picks CUDA
    when present; two short rounds, results under `work`) when this gaswap has it."""
    if not has_compare():
        return {"skipped": "this gaswap has no `compare` verb"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gaswap", "compare", experiment, "--rounds", "2", "--steps", "2",
                           "--results", str(Path(work) / "results")], capture_output=True, text=True, timeout=timeout)
    return {"rc": proc.returncode, "output": proc.stdout[-4000:], "stderr": proc.stderr[-1000:],
            "seconds": round(time.monotonic() - started, 1)}


def has_compare() -> bool:
    """Whether the CLI has a `compare` verb (the torch.compile head-to-head): `gaswap compare --help` works."""
    proc = subprocess.run([sys.executable, "-m", "gaswap", "compare", "--help"], capture_output=True, text=True,
                          timeout=60)
    return proc.returncode == 0
