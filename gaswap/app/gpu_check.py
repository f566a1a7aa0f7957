"""The GPU check: one command that confirms on a CUDA machine what the CPU tests stand in for.

`python -m gaswap check-gpu --out gpu_check.json` (or `scripts/gpu_check.sh`, which brings deap along
as a wheel) runs, within eight minutes on one H100 with cold caches, these stages, each in a process of its
own (the interpreter that runs the check) with a time limit of its own (`STAGES`):
1. "tests": the CUDA-marked tests (`pytest -m cuda`);
2. "alexnet_4gb", "gpt_bench": costs measured on this GPU, a short search, `validate` (measured vs predicted
   peak and step time), and a memory run that compares the caching allocator model's allocated and reserved
   peaks (and the optimizer step's) with `torch.cuda.memory_stats()`, and replays the allocation trace
   recorded on the GPU through the model (`allocator.replay_recorded`); and the same memory run from a
   preallocated arena (gaswap.run.arena_runtime): `max_memory_reserved` with the arena against without;
3. "compare": the torch.compile head-to-head (`gaswap compare` on its CNN experiment), cut to fit: one round,
   the fastest gaswap policy in prediction, untimed (`--finalists 0`), one budget below torch's.
It writes one JSON report: the torch version and the path its compiled swaps take (`offload_ops`), the
allocator and cuBLAS / cuDNN settings the measurements ran under, each stage's figures, and `errors` and
`timed_out` naming a stage that failed or ran past its limit (the others go on). Without CUDA it writes a
report saying so. Goals (`goals`): peak within 5 % of the prediction and never above the budget, reserved within
5 % of the allocator model's with the device's own memory; step time within 10 %.
Exit codes (`gaswap check-gpu`, docs/exit_codes.md): 0 every stage ran (or no CUDA), 1 a stage failed or
timed out; `scripts/gpu_check.sh` adds 2: deap cannot be imported (no wheel to install it from).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from gaswap.base.errors import GaswapError, NoFit
from gaswap.base.files import write_atomic

EXPERIMENTS = ("experiments/alexnet_4gb.yaml", "experiments/gpt_bench.yaml")
SHORT_GA = {"population": 32, "generations": 15, "workers": 1}  # a search that fits the check's time
# what the check plans for instead of the experiment's (results/gpu_check/README.md). AlexNet at batch 1400 on an
# H100: with costs measured there (a 54 GB/s link against convolutions of a few ms, swaps end late) the smallest live
# peak any search found was 4.0 GB, and the live plan for 4.5 GB (4.02 GB) needed 7.42 GB of reservations in the
# allocator model and ran out of memory capped at its budget; planned for reservations, a short search fits 6.5 GB
OVERRIDES = {"alexnet_4gb": {"budget": "6.5GB", "memory": {"target": "reserved"}}}
COMPARE = "experiments/compare_cnn_cpu.yaml"  # the head-to-head's smallest experiment (it runs on CUDA when present)
# what fits its limit: no finalists; three rounds, the later ones of a quarter of a second each method
# (`methods.ROUND_S`: its steps take milliseconds on a GPU; one round of two read one program 2.96 to 3.75 ms in run 9)
COMPARE_ARGS = ("--rounds", "3", "--steps", "2", "--finalists", "0", "--below", "0.8")
PEAK_TOLERANCE, TIME_TOLERANCE = 0.05, 0.10
# validation steps: a warm-up, then ten timed (their median). On an H100 gpt_bench's steps (~10 ms, issued by the host
# about as fast as the GPU runs them) ranged 9.6-20.3 ms in one run (run 8): the median of four read +84 % in run 6
STEPS = 11
# Each stage's limit (seconds): designed for one H100 with cold inductor and cost caches, summed with the
# processes' start (~5 s each: torch, CUDA) under DEADLINE_S, eight minutes less a margin for the report.
STAGES = {"tests": 120.0, "alexnet_4gb": 80.0, "gpt_bench": 100.0, "compare": 110.0}
DEADLINE_S = 450.0
SETTINGS_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "CUDNN_CONV_WSCAP_DBG",
                "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT")


def run(out: str | Path = "gpu_check.json", *, experiments=EXPERIMENTS, steps: int = STEPS,
        deadline_s: float = DEADLINE_S, work: str | Path | None = None) -> dict:
    """Run the check and write its JSON report to `out`; returns the report."""
    import torch

    started = time.monotonic()
    out = Path(out)
    work = Path(work) if work else out.with_suffix("")  # searches, costs and derived experiment files
    report: dict = {"torch": torch.__version__, "python": sys.executable, "cuda": torch.cuda.is_available(),
                    "errors": [], "timed_out": []}
    if not report["cuda"]:
        report["skipped"] = "no CUDA device: nothing to check (the CPU tests cover the CPU side)"
        return _write(out, report, started)
    report["device"] = torch.cuda.get_device_name()
    report["settings"] = settings()
    print(f"gpu check: torch {torch.__version__} on {report['device']} (python {sys.executable}); compiled swaps: "
          f"{report['settings']['compiled_swaps']}; allocator defaults: {report['settings']['allocator_defaults']}",
          flush=True)
    left = lambda: deadline_s - (time.monotonic() - started)  # noqa: E731
    report["tests"] = _stage(report, "tests", left(), lambda limit: _ran(cuda_tests(timeout=limit)))
    report["experiments"] = {}
    for path in experiments:
        name = Path(path).stem
        figures = _stage(report, name, left(), lambda limit, path=path: run_stage("experiment", path, work, steps, limit))
        if "error" in figures and figures["error"] not in report["errors"]:  # it ran, and ran out of memory
            report["errors"].append(f"{name}: {figures['error']}")
        report["experiments"][name] = figures
    report["compare"] = _stage(report, "compare", left(), lambda limit: _ran(compare(COMPARE, work, timeout=limit)))
    return _write(out, report, started)


def _ran(figures: dict) -> dict:
    """A stage's figures when its process ended well (exit 0, or no CUDA test to run); else StageFailed."""
    if figures.get("rc", 0) not in (0, 5):  # pytest's 5: no test collected
        raise StageFailed(f"exit {figures['rc']}: {figures.get('summary') or figures.get('stderr', '')[-300:]}")
    return figures


def settings() -> dict:
    """What the measurements ran under: the allocator's and cuBLAS's environment, cuDNN's and TF32's switches,
    and the path compiled swaps take on this torch. The allocator model assumes the defaults (no variable set)."""
    import torch

    # imported when the check runs: the CLI lists `check-gpu` without loading torch
    from gaswap.compiled import offload_ops

    env = {k: os.environ[k] for k in SETTINGS_ENV if k in os.environ}
    return {"env": env, "allocator_defaults": not any(k.startswith(("PYTORCH_", "CUBLAS")) for k in env),
            "cuda_runtime": torch.version.cuda, "cudnn_version": _reading(torch.backends.cudnn.version),
            "cudnn_enabled": torch.backends.cudnn.enabled, "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "compiled_swaps": offload_ops.offload_path(cuda=True)}


def _reading(fn):
    """fn(), or what it failed with (cuDNN's version where the library cannot load): a setting is a record."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return f"{type(e).__name__}: {e}"[:200]


def _stage(report: dict, name: str, left: float, fn):
    """fn(limit) with the stage's own limit (no more than the `left` seconds of the check), or {"error": ...}
    with the error also listed in the report (one line; a stage past its limit is named in `timed_out`); the
    check goes on."""
    limit = min(STAGES.get(name, 60.0), left)
    if limit < 10:
        line = f"{name}: skipped, {max(left, 0):.0f} s of the check's {DEADLINE_S:.0f} s left"
        report["errors"].append(line)
        return {"error": line}
    print(f"gpu check: {name} (limit {limit:.0f} s)", flush=True)
    try:
        return fn(limit)
    except subprocess.TimeoutExpired:
        report["timed_out"].append(name)
        return _failed(report, f"{name}: timed out after {limit:.0f} s (its limit)")
    except Exception as e:  # noqa: BLE001 - a failed stage is a finding of the check, not its end
        return _failed(report, f"{name}: {type(e).__name__}: {e}".splitlines()[0][:500])


def _part(name: str, fn) -> dict:
    """fn(), or {"error": ...}: a part of a stage whose failure leaves the stage's other figures standing."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the part's entry
        return {"error": f"{name}: {type(e).__name__}: {e}".splitlines()[0][:500]}


def _failed(report: dict, line: str) -> dict:
    report["errors"].append(line)
    return {"error": line}


def run_stage(stage: str, path: str | Path, work: Path, steps: int, timeout: float) -> dict:
    """Run one experiment's stage (`check_experiment`) in a process of its own, this interpreter, killed at
    `timeout` (subprocess.TimeoutExpired); its figures, or the one-line error it ended with (StageFailed)."""
    result = Path(work) / f"{Path(path).stem}.stage.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "gaswap.app.gpu_check", stage, str(path), str(work), str(steps),
                           str(result)], check=False, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0 or not result.exists():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise StageFailed(lines[-1] if lines else f"exit {proc.returncode}")
    return json.loads(result.read_text())


class StageFailed(GaswapError, RuntimeError):
    """A stage's process ended with an error: its last line (a finding the report lists; internal if raised)."""


def _write(out: Path, report: dict, started: float) -> dict:
    report["seconds"] = round(time.monotonic() - started, 1)
    write_atomic(out, json.dumps(report, indent=2, default=str) + "\n")  # a reader never sees half a report
    return report


def cuda_tests(timeout: float = 150.0) -> dict:
    """Run the CUDA-marked tests; their exit code and summary line."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", *map(str, cuda_test_files())],
                          check=False, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
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
    raw |= OVERRIDES.get(Path(path).stem, {})
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
    out = {"ops": len(prepared.graph.ops), "costs_measured": prepared.costs.measured,
           "costs_estimated_ops": len(prepared.costs.estimated), "measure_s": round(measured_s, 1),
           "search_s": round(result.seconds, 1)}
    try:
        validation = validate.validate(policy, steps=steps, device=device)
    except NoFit as e:  # out of memory capped at the budget
        error = str(e)  # (the exception's frames, and the tensors they hold, go at the end of this block)
        detail = out_of_memory(e, device)
    else:
        error = None
    if error is not None:  # the same steps uncapped say by how much it missed
        return out | {"error": error, "out_of_memory": detail,
                      "memory_uncapped": memory_run(policy, steps=3, device=device, cap=False)}
    memory = memory_run(policy, steps=3, device=device)
    out |= {"validation": validation, "memory": memory}
    out["goals"] = goals(validation, memory)
    # a failed arena run is recorded in its own entry ("error"); the experiment's other figures stand
    out["arena"] = _part("arena", lambda: arena_run(policy, memory, device))
    return out


def out_of_memory(error: BaseException, device: str = "cuda") -> dict:
    """What the out-of-memory behind `error` (a NoFit raised while handling torch's OutOfMemoryError) says, read
    before anything else runs: torch's message (what it tried to allocate, what the process held and reserved), the
    last of gaswap's frames it was raised in (a generated program's line names the instruction), and the caching
    allocator's figures then (CUDA)."""
    import torch

    oom = error.__cause__ or error.__context__
    package = str(Path(__file__).resolve().parents[1])
    frames = traceback.extract_tb(oom.__traceback__) if oom is not None else []
    ours = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames
            if f.filename.startswith(package) or f.filename.startswith("<gaswap")]
    out = {"message": " ".join(str(oom).split())[:600] if oom is not None else None, "raised_in": ours[-4:]}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        out["allocator"] = {k: stats.get(k) for k in (
            "allocated_bytes.all.current", "reserved_bytes.all.current", "reserved_bytes.all.peak",
            "inactive_split_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_ooms")}
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
    """The check's pass/fail lines from a validation report and a memory run: the peaks within 5 % of the
    prediction (allocated: the live model's; reserved: the allocator model's with the device's own memory,
    `ratios_with_device_memory`), the allocated peak under the budget, the step time within 10 %. Reserved under
    the budget is a goal only for a policy planned for it (`memory: {target: reserved}`; else None)."""
    budget = validation.get("budget_bytes")
    peak = validation["measured"]["peak_bytes"]
    reserved = memory.get("measured", {}).get("reserved_bytes")
    reserved_ratio = memory.get("ratios_with_device_memory", {}).get("reserved")
    return {
        "peak_within_5pct": abs(validation["peak_ratio"] - 1) <= PEAK_TOLERANCE,
        "reserved_within_5pct": None if reserved_ratio is None else abs(reserved_ratio - 1) <= PEAK_TOLERANCE,
        "peak_under_budget": budget is None or peak <= budget,
        "reserved_under_budget": None if memory.get("target") != "reserved" or budget is None or reserved is None
        else reserved <= budget,
        "step_time_within_10pct": abs(validation["time_ratio"] - 1) <= TIME_TOLERANCE,
    }


def memory_run(policy_path: str | Path, steps: int = 3, device: str = "cuda", *, arena: bool = False,
               cap: bool = True) -> dict:
    """Train `steps` steps under a policy holding on the GPU only what the experiment counts (no inputs kept
    for cloning), then compare the allocator's peaks of the last step and its optimizer step with the
    allocator model's predictions for the same policy. On a CPU only the storage tracker's peak is measured.
    With `arena`, the step runs from a preallocated arena (an `ArenaRunner`, gradients in it too), which is
    counted; the report then says how big it is. On CUDA the run is capped at an absolute budget
    (`validate.budget_cap`) unless not `cap`."""
    import torch

    # imported when the check runs: the CLI lists `check-gpu` without loading torch
    from gaswap.app.validate import budget_cap
    from gaswap.base import config
    from gaswap.plan import policy as policies
    from gaswap.plan.memory import allocator
    from gaswap.run import experiment, training, workspace
    from gaswap.run.arena_runtime import ArenaRunner, arena_figures
    from gaswap.run.capture import capture
    from gaswap.run.runtime import StepRunner

    policy = policies.load(policy_path)
    exp = config.load_experiment(policy.provenance["experiment_file"])
    dev = torch.device(device)
    cap = budget_cap(exp, policy, dev) if cap else None
    cuda = dev.type == "cuda"
    if cuda:  # record every allocation from a clean cache: the model replays the same requests (replay_recorded)
        workspace.fresh_allocator(dev)
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
    with workspace.capped(dev, cap) if cap else contextlib.nullcontext():
        figures = _steps(steps, exp, dev, generator, captured, model, runner, optimizer, params, arena)
    recorded = None
    if cuda:
        trace = torch.cuda.memory._snapshot()["device_traces"][dev.index or torch.cuda.current_device()]
        _record_history(False)
        recorded = allocator.replay_recorded(trace)
    predicted = allocator.replay(captured.graph, policy, optimizer=exp.optimizer)  # the program the runner ran
    # what the device holds beyond the graph's tensors, measured here (docs/gpu_memory.md): with it, the model's
    # peaks are those of everything the allocator serves. Transients: the least where the run was capped (cuDNN took
    # what the budget left), else those the ops take with memory to spare
    device_extra = {"workspace": workspace.workspace_bytes(dev),
                    "transients": workspace.op_transients(captured.graph, dev, least=cap is not None)}
    beside = allocator.replay(captured.graph, policy, optimizer=exp.optimizer, **device_extra)
    # the step's meter counts from a baseline that holds the workspace (made before the step): its requested and
    # allocated peaks are the model's with the transients alone (to 208 bytes on GPT in five runs on an H100)
    in_step = allocator.replay(captured.graph, policy, optimizer=exp.optimizer, transients=device_extra["transients"])
    ratios, ratios_beside = _ratios(figures, predicted), _ratios(figures, beside)
    ratios_beside |= {k: v for k, v in _ratios(figures, in_step).items() if k in ("requested", "allocated")}
    # the same program with swap-ins allocated on the h2d stream and frees by record_stream (the runtime before
    # issue 16's fixes): which of the two the GPU matches says which runtime ran
    older = allocator.replay(captured.graph, policy, optimizer=exp.optimizer, swap_in_stream="h2d",
                             swap_out_free="record_stream")
    largest = max(device_extra["transients"].values(), default=0)
    least = largest if cap is not None else max(workspace.op_transients(captured.graph, dev).values(), default=0)
    kept = policies.kept_margin(policy)  # what the search kept under the budget for them (0: none measured)
    return {"target": exp.memory.target if exp.memory is not None else "live", "capped_at_bytes": cap,
            "measured": figures, "predicted": predicted.as_dict(), "ratios": ratios, "recorded_replay": recorded,
            "predicted_with_device_memory": beside.as_dict(), "predicted_with_transients": in_step.as_dict(),
            "ratios_with_device_memory": ratios_beside,
            "device_memory": {"workspace_bytes": device_extra["workspace"], "largest_transient_bytes": largest,
                              "largest_least_transient_bytes": least,
                              "ops_with_transients": len(device_extra["transients"]),
                              "margin_bytes": device_extra["workspace"] + largest, "kept_bytes": kept,
                              "kept_covers_it": device_extra["workspace"] + largest <= kept if kept else None},
            "predicted_h2d_record_stream": older.as_dict(), **({"arena": arena_figures(runner)} if arena else {}),
            "note": "measured allocated/reserved also hold what the model leaves out (cuBLAS/cuDNN workspaces); "
                    "optimizer step: absolute allocated peak, predicted: the model's allocated peak then"}


def _steps(steps: int, exp, dev, generator, captured, model, runner, optimizer, params, arena: bool) -> dict:
    """`steps` training steps under the runner; the allocator's figures of the last."""
    # imported when the check runs, as in memory_run
    from gaswap.run import experiment, training

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
    return figures


def _ratios(figures: dict, predicted) -> dict:
    """Measured over predicted, for each peak the model predicts."""
    pairs = (("requested", "requested_bytes", predicted.requested),
             ("allocated", "allocated_bytes", predicted.allocated), ("reserved", "reserved_bytes", predicted.reserved),
             ("optimizer_step", "optimizer_step_allocated_bytes", predicted.optimizer_step))
    return {k: figures[m] / v for k, m, v in pairs if v}


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
    when present; cut to `COMPARE_ARGS`, results under `work`) when this gaswap has it."""
    if not has_compare():
        return {"skipped": "this gaswap has no `compare` verb"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gaswap", "compare", experiment, *COMPARE_ARGS,
                           "--results", str(Path(work) / "results")], check=False, capture_output=True, text=True,
                          timeout=timeout)
    return {"rc": proc.returncode, "output": proc.stdout[-4000:], "stderr": proc.stderr[-1000:],
            "seconds": round(time.monotonic() - started, 1)}


def has_compare() -> bool:
    """Whether the CLI has a `compare` verb (the torch.compile head-to-head): `gaswap compare --help` works."""
    proc = subprocess.run([sys.executable, "-m", "gaswap", "compare", "--help"], check=False, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode == 0


def _main(argv: list[str]) -> int:
    """`python -m gaswap.app.gpu_check experiment PATH WORK STEPS RESULT`: one stage, its figures to RESULT."""
    stage, path, work, steps, result = argv
    if stage != "experiment":
        print(f"unknown stage {stage!r}", file=sys.stderr)
        return 2
    figures = check_experiment(path, Path(work), int(steps))
    Path(result).write_text(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
