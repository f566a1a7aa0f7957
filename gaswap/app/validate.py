"""Run real training steps of an experiment under a policy; compare measured with predicted.

`python -m gaswap validate results/<experiment>/policy.yaml --steps N` builds the experiment's model with
real parameters on the device at hand, re-captures its step, refuses a policy made for another graph,
then trains N steps with the policy's program and writes `validation.json` beside the policy. A step with
loss "external" is given a fixed random gradient of the model's output, as if a loss were computed outside.
"""
from __future__ import annotations

import json
import statistics
from contextlib import nullcontext
from pathlib import Path

import torch

from gaswap.app import workflow
from gaswap.app.results import Refused
from gaswap.base import config
from gaswap.base.errors import NoFit
from gaswap.base.files import write_atomic
from gaswap.base.locate import experiment_file
from gaswap.plan import policy as policies
from gaswap.plan.memory import allocator
from gaswap.run import training, workspace
from gaswap.run.arena_runtime import ArenaRunner, arena_figures
from gaswap.run.capture import capture
from gaswap.run.experiment import build_model, make_inputs, output_gradient
from gaswap.run.measure import device_name, load_per_cpu, resolve_device, use_cpu
from gaswap.run.runtime import CLOCK_NAMES, StepRunner, device_clock
from gaswap.zoo import shipped

# a GPU step the host takes at least this share of to issue is bound by the host: its Python dispatch, which op
# costs timed on the device leave out (on an H100, gpt_bench's policies: results/gpu_check/, runs 8-14)
HOST_BOUND = 0.9


def validate(policy_path: str | Path, steps: int = 5, device: str = "auto", *, experiment: str | Path | None = None,
             trust_factory: bool = False, progress=None, arena: bool = False, recalibrate: bool = False,
             say=None) -> dict:
    """Train `steps` steps under the policy; return (and write beside it) predicted vs measured figures.

    The model comes from `experiment` when given, else from the experiment file the policy names; a factory
    named only by the policy must be one of gaswap's own models unless `trust_factory` (a shared policy file
    must not choose code to run). The first step warms up and creates the optimizer state. Step time is the
    median of the later steps; the peak is the allocator's (CUDA, every later step) or the storage tracker's
    (CPU, the last step, which is left out of the timing because tracking slows it); on CUDA the peak predicted
    is the one with each op's transients where the search measured them (`device_peak_bytes`), the graph's
    tensors' alone beside it. `progress(done, steps)`
    after each step. With `arena`, the step's activations and gradients live in one buffer made beforehand at
    the offsets `arena.plan` gives (gaswap.run.arena_runtime), counted in the peak; the report says how big it is
    and which ops had their results copied into it. With `recalibrate` (compiled policies only), the compiled
    step's model is timed again here first and its prediction reported beside the policy's
    (`validate_compiled.recalibrated`; `say(line)` gets its progress).
    """
    _check_arguments(steps, device)
    policy_path = Path(policy_path)
    policy = policies.load(policy_path)
    if policy.provenance.get("form") == "compiled":  # trained inside torch.compile: gaswap.app.validate_compiled
        if arena:
            raise config.ConfigError(f"{policy_path}: --arena runs gaswap's own runtime; this policy runs inside "
                                     f"torch.compile, whose inductor allocates its own buffers")
        exp = _experiment(policy, policy_path, experiment, trust_factory)
        # inductor loads only for compiled policies
        from gaswap.app.validate_compiled import validate_compiled

        return validate_compiled(policy, policy_path, exp, steps, device, progress, recalibrate, say)
    if recalibrate:
        raise config.ConfigError(f"{policy_path}: --recalibrate times a compiled policy's calibration again; this "
                                 f"policy's costs are per op: run `gaswap search` on its experiment here instead")
    if not policy.program:
        raise policies.PolicyError(f"{policy_path}: the policy has no program; re-run the search that made it")
    if not all(k in policy.predicted for k in ("peak_bytes", "step_time_s")):
        raise policies.PolicyError(f"{policy_path}: predicted: needs peak_bytes and step_time_s to compare with")
    exp = _experiment(policy, policy_path, experiment, trust_factory)
    dev = resolve_device(device)
    workspace.fresh_allocator(dev)  # what the process did before (measuring costs) must not crowd the cap
    model, inputs, target, captured = _captured(policy, policy_path, exp, dev)
    if arena:  # gradients too: each step drops them (training.optimizer_step) before the next
        runner = ArenaRunner(captured, policy.program, dev, results_in_arena=True)
    else:
        runner = StepRunner(captured, policy.program, dev)
    load = load_per_cpu()
    batch = [x.untyped_storage().nbytes() for x in (*inputs, target) if isinstance(x, torch.Tensor)]
    cap = budget_cap(exp, policy, dev)
    if cap:  # the batch kept here to clone each step's from is no part of the step the budget is for
        cap += sum(batch)
    # a policy planned for reservations is judged by them: the allocator's, less the batch's segments
    reserved = dev.type == "cuda" and policy.predicted.get("reserved_bytes") == policy.predicted["peak_bytes"]
    kept = sum(allocator.allocation_size(allocator.round_size(n)) for n in batch) if reserved else None
    try:
        with workspace.capped(dev, cap) if cap else nullcontext():
            loss, peaks, times, issued = _train(runner, captured, model, inputs, target, exp, dev, steps, progress,
                                                [runner.buffer] if arena else [], kept)
    except torch.OutOfMemoryError:
        raise NoFit(f"{policy_path}: out of memory on {device_name(dev)} capped at {config.format_size(cap)} (the "
                    f"budget and the batch kept to clone each step's from): the caching allocator's reservations "
                    f"did not fit it (plan with `memory: {{target: reserved}}` to bound them)") from None
    report = {
        "experiment": exp.name,
        "policy": str(policy_path),
        "device": device_name(dev),
        "cost_source": policy.provenance.get("cost_source"),
        "steps": steps,
        "loss": float(loss) if exp.loss != "external" else None,  # external: `loss` is the model's output
        "predicted": {"peak_bytes": policy.predicted["peak_bytes"], "step_time_s": policy.predicted["step_time_s"]}
        | _on_device(policy.predicted, dev),
        "measured": {"peak_bytes": max(peaks), "step_time_s": statistics.median(times)},
        "budget_bytes": policy.provenance.get("budget_bytes"),
        "capped_at_bytes": cap,
        "peak_measured_as": "reserved" if reserved else "requested",
        "clock": CLOCK_NAMES.get(dev.type, "wall time"),
        "load_per_cpu": round(max(load, load_per_cpu()), 2),
    }
    report["peak_ratio"] = report["measured"]["peak_bytes"] / report["predicted"]["peak_bytes"]
    if "graph_peak_bytes" in report["predicted"]:
        report["graph_peak_ratio"] = report["measured"]["peak_bytes"] / report["predicted"]["graph_peak_bytes"]
    report["time_ratio"] = report["measured"]["step_time_s"] / report["predicted"]["step_time_s"]
    host = _host_figures(issued, report["measured"]["step_time_s"], dev)
    if host:
        report["measured"]["issue_time_s"], report["host_bound"] = host
    if arena:
        report["arena"] = arena_figures(runner)
    write_atomic(policy_path.with_name("validation.json"), json.dumps(report, indent=2) + "\n")
    return report


def _on_device(predicted: dict, dev: torch.device) -> dict:
    """On CUDA, where the search measured each op's transients there (`workflow.device_peak`): the peak compared
    is the one with them (`peak_bytes`), the graph's tensors' alone beside it (`graph_peak_bytes`)."""
    if dev.type != "cuda" or "device_peak_bytes" not in predicted:
        return {}
    return {"peak_bytes": predicted["device_peak_bytes"], "graph_peak_bytes": predicted["peak_bytes"]}


def _host_figures(issued: list[float], step_s: float, dev: torch.device) -> tuple[float, bool] | None:
    """On CUDA, (the median seconds the host took to issue a step, whether that is at least `HOST_BOUND` of the
    step's `step_s`: a step bound by the host's dispatch, which the prediction leaves out); None elsewhere (on a CPU
    the host runs the ops)."""
    if dev.type != "cuda":
        return None
    issue = statistics.median(issued)
    return issue, issue >= HOST_BOUND * step_s


def budget_cap(exp: config.Experiment, policy: policies.Policy, dev: torch.device) -> int | None:
    """The memory a CUDA run is capped at (`workspace.capped`): an absolute budget, as on a device of that size,
    where cuDNN's convolutions take the workspace the budget leaves them rather than the device's free memory
    (docs/gpu_memory.md); None on a CPU or for a fraction of keep-all's peak."""
    budget = policy.provenance.get("budget_bytes")
    if dev.type != "cuda" or exp.budget.bytes is None or not isinstance(budget, int) or budget <= 0:
        return None
    return budget


def _check_arguments(steps: int, device: str) -> None:
    """ConfigError unless `steps` and `device` can validate here."""
    if steps < 3:
        raise config.ConfigError(f"--steps {steps}: validate needs at least 3 steps: one warms up and creates the "
                                 f"optimizer state, then timed steps, and (on the CPU) a last step with the memory tracker")
    if device not in ("auto", "cpu", "cuda"):
        raise config.ConfigError(f"--device {device!r}: must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise config.ConfigError("--device cuda: this machine has no CUDA device (use cpu or auto)")


def _captured(policy: policies.Policy, policy_path: Path, exp: config.Experiment, dev: torch.device) -> tuple:
    """(model, inputs, target, captured step) of `exp` on `dev`, built from its seed, the step re-captured and
    checked to be the one the policy was made for (PolicyError otherwise). With loss "external", the target
    is a fixed random gradient of the model's output."""
    if dev.type == "cpu":
        use_cpu(exp.costs.threads)  # as when the costs were measured
    torch.manual_seed(exp.seed)
    model = build_model(exp, device=str(dev))
    inputs, target = make_inputs(exp, str(dev), torch.Generator(dev).manual_seed(exp.seed))
    captured = capture(model, inputs, target, exp.loss, optimizer=exp.optimizer, counted=exp.counts,
                       autocast=exp.autocast)
    workflow.check_target(exp, captured)
    if exp.loss == "external":  # the loss is computed outside the step: stand in a fixed gradient of the output
        target = output_gradient(captured, dev, exp.seed)
    here = {"model": {"factory": exp.model.factory, "kwargs": exp.model.kwargs}, "batch_size": exp.batch_size,
            "torch_version": str(torch.__version__)}
    policies.check_matches(policy, captured.graph, policy_path, provenance=policy.provenance | here,
                           torch_version=str(torch.__version__))
    return model, inputs, target, captured


def _train(runner, captured, model, inputs, target, exp: config.Experiment, dev: torch.device, steps: int,
           progress, extra: list, reserved_less: int | None = None) -> tuple:
    """`steps` runtime steps (`training.runtime_step`) on fresh copies of the batch, the first a warm-up;
    (the last step's loss, the peaks metered, the step times, the times to issue them) of the later steps timed;
    with `reserved_less`, the peaks are the allocator's reservations less those bytes (CUDA). The meter counts
    what the experiment counts, and `extra` (an arena's buffer)."""
    optimizer, params = training.make_optimizer(exp.optimizer, model), training.trainable(model)
    clock, cuda = device_clock(dev), dev.type == "cuda"  # CPU: the process's CPU time

    def step(k: int, metered: bool) -> training.RuntimeStep:
        args = captured.arguments(model, [x.clone() for x in inputs], target.clone())  # a fresh batch
        held = training.resident(captured, args, optimizer, exp.counts, extra)
        done = training.runtime_step(runner, args, held, optimizer, params, dev, metered=metered, clock=clock)
        if progress:
            progress(k + 1, steps)
        return done

    training.warm_up(lambda: step(0, cuda), steps=1)  # it creates the optimizer state
    peaks, times, issued = [], [], []
    for k in range(1, steps):
        # CUDA's allocator counts for free; the CPU tracker slows a step, so it meters the last one only, untimed.
        metered = cuda or k == steps - 1
        done = step(k, metered)
        if cuda or not metered:
            times.append(done.seconds)
            issued.append(done.issued)
        if metered:
            peaks.append(done.memory.peak if reserved_less is None else done.memory.reserved_peak - reserved_less)
    return done.loss, peaks, times, issued


def _experiment(policy: policies.Policy, policy_path: Path, named: str | Path | None, trust: bool) -> config.Experiment:
    """The experiment to build the model from: the one the user named, else the policy's, whose factory must
    then be one of gaswap's own models unless `trust` (Refused otherwise, before anything is imported)."""

    if named is not None:
        return config.load_experiment(named)
    file = policy.provenance.get("experiment_file")
    if not isinstance(file, str) or not file:
        raise policies.PolicyError(f"{policy_path}: provenance names no experiment file; pass --experiment FILE")
    try:
        file = str(experiment_file(policy.provenance, policy_path, f"{policy_path}: provenance.experiment_file"))
    except FileNotFoundError as err:
        raise config.ConfigError(str(err)) from None
    exp = config.load_experiment(file)
    if not shipped(exp.model.factory) and not trust:
        raise Refused(f"{policy_path}: its experiment {file} builds the model with {exp.model.factory}, code named "
                      f"only by this policy file; if you trust it, name the experiment yourself (--experiment "
                      f"{file}) or pass --trust-factory")
    return exp
