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

from gaswap.base import config
from gaswap.base.files import write_atomic
from gaswap.base.locate import experiment_file
from gaswap.plan import policy as policies
from gaswap.run.arena_runtime import ArenaRunner, arena_figures
from gaswap.run.capture import capture
from gaswap.run.experiment import build_model, make_inputs, output_gradient
from gaswap.run.measure import device_name, load_per_cpu, resolve_device, sync, use_cpu
from gaswap.run.runtime import CLOCK_NAMES, StepRunner, device_clock
from gaswap.run.step_memory import DeviceMemory
from gaswap.app.results import Refused
from gaswap.zoo import shipped

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def validate(policy_path: str | Path, steps: int = 5, device: str = "auto", *, experiment: str | Path | None = None,
             trust_factory: bool = False, progress=None, arena: bool = False) -> dict:
    """Train `steps` steps under the policy; return (and write beside it) predicted vs measured figures.

    The model comes from `experiment` when given, else from the experiment file the policy names; a factory
    named only by the policy must be one of gaswap's own models unless `trust_factory` (a shared policy file
    must not choose code to run). The first step warms up and creates the optimizer state. Step time is the
    median of the later steps; the peak is the allocator's (CUDA, every later step) or the storage tracker's
    (CPU, the last step, which is left out of the timing because tracking slows it). `progress(done, steps)`
    after each step. With `arena`, the step's activations and gradients live in one buffer made beforehand at
    the offsets `arena.plan` gives (gaswap.run.arena_runtime), counted in the peak; the report says how big it is
    and which ops had their results copied into it.
    """
    if steps < 3:
        raise config.ConfigError(f"--steps {steps}: validate needs at least 3 steps: one warms up and creates the "
                                 f"optimizer state, then timed steps, and (on the CPU) a last step with the memory tracker")
    if device not in ("auto", "cpu", "cuda"):
        raise config.ConfigError(f"--device {device!r}: must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise config.ConfigError("--device cuda: this machine has no CUDA device (use cpu or auto)")
    policy_path = Path(policy_path)
    policy = policies.load(policy_path)
    if policy.provenance.get("form") == "compiled":  # trained inside torch.compile: gaswap.app.validate_compiled
        # inductor loads only for compiled policies
        from gaswap.app.validate_compiled import validate_compiled

        if arena:
            raise config.ConfigError(f"{policy_path}: --arena runs gaswap's own runtime; this policy runs inside "
                                     f"torch.compile, whose inductor allocates its own buffers")
        exp = _experiment(policy, policy_path, experiment, trust_factory)
        return validate_compiled(policy, policy_path, exp, steps, device, progress)
    if not policy.program:
        raise policies.PolicyError(f"{policy_path}: the policy has no program; re-run the search that made it")
    if not all(k in policy.predicted for k in ("peak_bytes", "step_time_s")):
        raise policies.PolicyError(f"{policy_path}: predicted: needs peak_bytes and step_time_s to compare with")
    exp = _experiment(policy, policy_path, experiment, trust_factory)
    dev = resolve_device(device)
    if dev.type == "cpu":
        use_cpu(exp.costs.threads)  # as when the costs were measured
    torch.manual_seed(exp.seed)
    model = build_model(exp, device=str(dev))
    inputs, target = make_inputs(exp, str(dev), torch.Generator(dev).manual_seed(exp.seed))
    captured = capture(model, inputs, target, exp.loss, optimizer=exp.optimizer, counted=exp.counts,
                       autocast=exp.autocast)
    if exp.loss == "external":  # the loss is computed outside the step: stand in a fixed gradient of the output
        target = output_gradient(captured, dev, exp.seed)
    here = {"model": {"factory": exp.model.factory, "kwargs": exp.model.kwargs}, "batch_size": exp.batch_size,
            "torch_version": str(torch.__version__)}
    policies.check_matches(policy, captured.graph, policy_path, provenance=policy.provenance | here,
                           torch_version=str(torch.__version__))
    if arena:  # gradients too: this loop drops them before the next step
        runner = ArenaRunner(captured, policy.program, dev, results_in_arena=True)
    else:
        runner = StepRunner(captured, policy.program, dev)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = OPTIMIZERS[exp.optimizer](trainable)
    peaks, times = [], []
    clock, load = device_clock(dev), load_per_cpu()  # CPU: the process's CPU time
    for step in range(steps):
        # CUDA's allocator counts for free; the CPU tracker slows a step, so it runs on the last one only.
        tracked = dev.type == "cuda" or step == steps - 1
        args = captured.arguments(model, [x.clone() for x in inputs], target.clone())  # a fresh batch
        held = [a for (_, kind, _), a in zip(captured.placeholders, args) if kind != "param" or "parameters" in exp.counts]
        if "optimizer_state" in exp.counts:
            held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        sync(dev)
        started = clock()
        with DeviceMemory(dev) if tracked else nullcontext() as memory:
            if memory is not None:
                memory.hold(held + ([runner.buffer] if arena else []))
            del held  # the step owns its inputs: a swapped-out input must be free to go
            loss, *grads = runner(args)
        sync(dev)
        if step > 0:  # the first step creates the optimizer state and warms up
            times += [] if tracked and dev.type != "cuda" else [clock() - started]
            peaks += [memory.peak] if tracked else []
        for p, g in zip(trainable, grads):
            p.grad = g
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if progress:
            progress(step + 1, steps)
    report = {
        "experiment": exp.name,
        "policy": str(policy_path),
        "device": device_name(dev),
        "cost_source": policy.provenance.get("cost_source"),
        "steps": steps,
        "loss": float(loss) if exp.loss != "external" else None,  # external: `loss` is the model's output
        "predicted": {"peak_bytes": policy.predicted["peak_bytes"], "step_time_s": policy.predicted["step_time_s"]},
        "measured": {"peak_bytes": max(peaks), "step_time_s": statistics.median(times)},
        "budget_bytes": policy.provenance.get("budget_bytes"),
        "clock": CLOCK_NAMES.get(dev.type, "wall time"),
        "load_per_cpu": round(max(load, load_per_cpu()), 2),
    }
    report["peak_ratio"] = report["measured"]["peak_bytes"] / report["predicted"]["peak_bytes"]
    report["time_ratio"] = report["measured"]["step_time_s"] / report["predicted"]["step_time_s"]
    if arena:
        report["arena"] = arena_figures(runner)
    write_atomic(policy_path.with_name("validation.json"), json.dumps(report, indent=2) + "\n")
    return report


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
