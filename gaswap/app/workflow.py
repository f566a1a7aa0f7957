"""One experiment from file to results: build the model, capture the step, get costs, search, write.

The glue between the torch side (capture, measure) and the torch-free core; the CLI calls it.

A search writes `results/<experiment>/` and, while it runs, its checkpoint `results/<experiment>/.checkpoint.json`
(see gaswap.plan.checkpoint). Stopped by SIGINT or SIGTERM (`gaswap.base.signals.stop_on_signals`), it finishes the
current generation, writes the results so far (summary.json: "complete": false) and keeps the checkpoint;
`resume` continues from it. A complete search removes its checkpoint. A results folder made by another
experiment is not replaced unless `force` (see gaswap.app.results, which owns results folders).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gaswap.app import results
from gaswap.app.results import Refused  # noqa: F401  (what check_results_folder raises)
from gaswap.base import config
from gaswap.base.errors import NoFit
from gaswap.plan import checkpoint as checkpoints
from gaswap.plan import costfile
from gaswap.plan import policy as policies
from gaswap.plan.costs import Costs, estimate, load_profile
from gaswap.plan.graph import Graph
from gaswap.plan.memory import allocator
from gaswap.plan.memory.allocator import ReservedProblem
from gaswap.plan.problem import Evaluated, Problem, SearchResult
from gaswap.plan.search import search
from gaswap.plan.simulator import lower_bound
from gaswap.run import workspace
from gaswap.run.experiment import build_model, make_inputs, output_gradient


class Infeasible(NoFit):
    """No policy found under the budget."""


@dataclass(frozen=True)
class Prepared:
    """An experiment's graph and costs, ready to search."""

    experiment: config.Experiment
    graph: Graph
    costs: Costs
    capture_seconds: float
    costs_seconds: float
    torch_version: str


def prepare(experiment: config.Experiment, *, cache_dir=None, progress=None) -> Prepared:
    """Capture the experiment's training step (on the meta device) and get its costs."""
    import torch

    started = time.perf_counter()
    captured = capture_step(experiment)
    capture_seconds = time.perf_counter() - started
    started = time.perf_counter()
    costs = costs_for(experiment, captured.graph, cache_dir=cache_dir, progress=progress, captured=captured)
    return Prepared(experiment, captured.graph, costs, capture_seconds, time.perf_counter() - started,
                    torch.__version__)


def capture_step(experiment: config.Experiment):
    """The experiment's training step captured on the meta device (a `Captured`; `.graph` is its Graph), with inputs
    on the CPU from its seed when the forward pass reads their values (gaswap.run.values);
    CaptureError naming the experiment file when it cannot be captured or has nothing to plan."""
    # torch loads when a step is captured or timed: checks of a folder and `plot` start without it
    from gaswap.run.capture import CaptureError, ValuesNeeded, capture

    model = build_model(experiment)
    inputs, target = make_inputs(experiment)
    try:
        try:
            captured = capture(model, inputs, target, experiment.loss, optimizer=experiment.optimizer,
                               counted=experiment.counts, autocast=experiment.autocast)
        except ValuesNeeded:  # the forward reads input values: those validate gives it on the CPU (gaswap.run.values)
            import torch

            inputs, target = make_inputs(experiment, "cpu", torch.Generator().manual_seed(experiment.seed))
            captured = capture(model, inputs, target, experiment.loss, optimizer=experiment.optimizer,
                               counted=experiment.counts, autocast=experiment.autocast)
        check_trainable(captured.graph)
    except CaptureError as err:
        raise CaptureError(f"{experiment.path}: {err}") from None
    check_target(experiment, captured)
    return captured


NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")  # where cross entropy reads its classes


def check_target(experiment: config.Experiment, captured) -> None:
    """Refuse (ConfigError naming target.high) class indices the model's output has no class for: with cross
    entropy, the target's `high` must be at most the output's number of classes."""
    target = experiment.target
    if experiment.loss != "cross_entropy" or target is None or target.high is None:
        return
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and str(node.target) in NLL:
            shape = node.args[0].meta["val"].shape
            classes = shape[1] if len(shape) >= 2 else shape[0]
            if target.high > classes:
                raise config.ConfigError(
                    f"{experiment.path}: target.high: {target.high}, but the model's output has {classes} classes: "
                    f"class indices up to {target.high - 1} would be out of range; set target.high to at most "
                    f"{classes}")


def check_trainable(graph: Graph) -> None:
    """Refuse (CaptureError) a step with nothing to plan: no gradient (the output is detached or depends
    on no trainable parameter) or no activation that the backward pass reads."""
    # torch loads when a step is captured or timed: checks of a folder and `plot` start without it
    from gaswap.run.capture import CaptureError

    if not any(t.kind == "grad" for t in graph.tensors.values()):
        raise CaptureError("the step computes no gradient: the model's output does not depend on any trainable "
                           "parameter (is it detached, or computed under torch.no_grad?)")
    if not graph.candidates():
        raise CaptureError("the backward pass reads no activation of the forward pass: nothing to keep, swap or "
                           "recompute (is the model's output detached, or computed under torch.no_grad?)")


def costs_for(experiment: config.Experiment, graph: Graph, *, cache_dir=None, progress=None, captured=None) -> Costs:
    """Estimated from the experiment's hardware profile, or measured on its device (cached on disk). Given the
    `captured` step of `graph`, a CPU times its ops in place, running the step on one batch with real weights."""
    spec = experiment.costs
    if spec.source == "estimate":
        try:
            profile = load_profile(spec.profile)
        except ValueError as err:
            raise config.ConfigError(f"{experiment.path}: costs.profile: {err}") from None
        return estimate(graph, profile)
    # torch loads when a step is captured or timed: checks of a folder and `plot` start without it
    from gaswap.run.measure import measure, resolve_device

    if spec.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise config.ConfigError(f"{experiment.path}: costs.device: cuda, but this machine has no CUDA device "
                                     f"(use auto or cpu, or costs from a hardware profile)")
    in_place = None
    if captured is not None and resolve_device(spec.device).type == "cpu":
        import torch

        torch.manual_seed(experiment.seed)
        model = build_model(experiment, device="cpu")
        inputs, target = make_inputs(experiment, "cpu", torch.Generator().manual_seed(experiment.seed))
        if experiment.loss == "external":
            target = output_gradient(captured, torch.device("cpu"), experiment.seed)
        in_place = captured, lambda: captured.arguments(model, tuple(x.clone() for x in inputs), target.clone())
    return measure(graph, spec.device, cache_dir, progress=progress, in_place=in_place, threads=spec.threads)


def keep_all(prepared: Prepared) -> Evaluated:
    """The captured order with every activation kept: what plain PyTorch does."""
    return Problem(prepared.graph, prepared.costs).keep_all()


def allocator_options(experiment: config.Experiment) -> dict:
    """How `allocator.replay` models the experiment's GPU memory (its `memory` key): two steps (the second is
    the steady state the budget must hold in), the optimizer step's temporaries included."""
    memory = experiment.memory or config.MemorySpec()
    return {"steps": 2, "expandable_segments": memory.expandable_segments, "optimizer": experiment.optimizer}


def planning_problem(prepared: Prepared, budget: int | None = None) -> Problem:
    """The experiment's problem: peaks in live bytes, or with `memory: {target: reserved}` the allocator
    model's reserved peak (`allocator.ReservedProblem`), which the budget then bounds."""
    exp = prepared.experiment
    if exp.memory is not None and exp.memory.target == "reserved":
        return ReservedProblem(prepared.graph, prepared.costs, budget, exp.search_space, **allocator_options(exp))
    return Problem(prepared.graph, prepared.costs, budget, exp.search_space)


def device_margin(prepared: Prepared):
    """What the device holds beyond the graph's tensors, for the costs the search plans with (`workspace.margin`)."""
    return workspace.margin(prepared.costs, prepared.experiment.costs.device, prepared.graph)


def with_capped_costs(prepared: Prepared, margin) -> Prepared:
    """`prepared` with the times of the ops `margin` timed capped (`workspace.capped_costs`) when its experiment's
    budget is absolute: `validate` caps such a run at it (`validate.budget_cap`), as a device of that size would."""
    if prepared.experiment.budget.bytes is None:
        return prepared
    return replace(prepared, costs=workspace.capped_costs(prepared.costs, margin))


def planning_budget(experiment: config.Experiment, keep_all_peak: int, margin) -> tuple[int, int]:
    """(the budget, what the search plans for): the experiment's budget, a fraction of keep-all's peak on the device
    (`keep_all_peak`, the graph's, with the margin: what the allocator reports for plain PyTorch), and that less the
    device's `margin` (a `workspace.Margin`; with `memory: {target: reserved}`, what it may add to
    reservations). Infeasible when nothing is left."""
    memory = experiment.memory
    kept = margin.reserved_bytes(memory.expandable_segments) if memory is not None and memory.target == "reserved" \
        else margin.margin_bytes
    budget = experiment.budget.resolve(keep_all_peak + kept)
    if kept >= budget:
        raise Infeasible(f"{experiment.path}: the budget {config.format_size(budget)} leaves nothing once "
                         f"{config.format_size(kept)} is kept for what the device holds beyond the graph's tensors "
                         f"({margin.source}); raise the budget")
    return budget, budget - kept


def _less(budget: int, planned: int) -> str:
    """How the budget was planned for, when a margin came off it."""
    return "" if planned == budget else f" (planned for {config.format_size(planned)}, the device's margin kept)"


def results_folder(root: str | Path, experiment: config.Experiment) -> Path:
    """`root/<experiment name>`, the folder the experiment's results go to."""
    return results.folder_of(root, experiment.name)


def check_results_folder(experiment: config.Experiment, out: str | Path, *, resume: bool = False,
                         force: bool = False) -> None:
    """`results.check_folder` for this experiment: refuse another experiment's folder unless `force`, and
    a `resume` without a checkpoint."""
    results.check_folder(experiment.name, experiment.path, out, resume=resume, force=force)


def run_search(prepared: Prepared, out: str | Path, *, on_generation=None, resume: bool = False,
               force: bool = False, stop=None, finish=None) -> tuple[SearchResult, dict]:
    """Search the experiment's policies and write its results folder; raises Infeasible when none fits.

    The search checkpoints into `out/.checkpoint.json` (see `search.search`); `resume` continues from there
    (CheckpointError when it is unusable). `stop()` (e.g. the `Stop` of `stop_on_signals`) ends the search
    early: the results so far are written, marked incomplete, beside the checkpoint. `force` replaces a
    folder made by another experiment (see `check_results_folder`). `finish(new_folder)` adds to the new
    results folder before it replaces the old one (`results.write`: figures drawn again).
    """
    exp = prepared.experiment
    with results.locked(out):
        results.recover(out)
        check_results_folder(exp, out, resume=resume, force=force)
        return _search_and_write(prepared, Path(out), on_generation, resume, stop, finish)


def _search_and_write(prepared: Prepared, out: Path, on_generation, resume: bool, stop,
                      finish=None) -> tuple[SearchResult, dict]:
    kept = device_margin(prepared)
    prepared = with_capped_costs(prepared, kept)
    exp, graph, costs = prepared.experiment, prepared.graph, prepared.costs
    reference = planning_problem(prepared).keep_all()
    budget, planned = planning_budget(exp, reference.peak_bytes, kept)
    problem = planning_problem(prepared, planned)
    result = search(problem, exp.ga, exp.seed, on_generation=on_generation, checkpoint=out / checkpoints.NAME,
                    resume=resume, stop=stop, about={"experiment": exp.name, "experiment_file": exp.path})
    if result.best is None and result.complete:
        results.discard_checkpoint(out)
        raise Infeasible(
            f"{exp.path}: no policy found under the budget {config.format_size(budget)}{_less(budget, planned)}: "
            f"the smallest peak reached was {config.format_size(result.smallest_peak)}, and no policy can go below "
            f"{config.format_size(lower_bound(graph))} (resident memory plus the largest single op). "
            f"Raise the budget, or search longer (ga.generations) or a wider search space."
        )
    margin_record = kept.as_dict() | {"kept_bytes": budget - planned}
    provenance = describe(prepared) | {"budget_bytes": budget, "planning_budget_bytes": planned,
                                       "device_margin": margin_record}

    def memory(e: Evaluated) -> dict:  # live, allocated and reserved peaks, with the experiment's `memory` key
        return allocator.figures(graph, problem.simulate(e.chromosome, trace=True), **allocator_options(exp)) \
            if exp.memory is not None else {}

    def make_policy(e: Evaluated) -> policies.Policy:
        traced = problem.simulate(e.chromosome, trace=True)  # its program: what the runtime replays
        return policies.from_result(graph, problem.encoding.candidates, problem.order(e.chromosome),
                                    e.chromosome.actions, results.point(e, reference) | memory(e)
                                    | device_peak(exp, graph, traced, kept), provenance, traced.program)

    summary = describe(prepared) | {
        "budget_bytes": budget,
        "budget": str(exp.budget),
        "planning_budget_bytes": planned,
        "device_margin": margin_record,
        "keep_all": {"peak_bytes": reference.peak_bytes, "step_time_s": reference.step_time} | memory(reference),
        "generations": exp.ga.generations,
    }
    if costs.source == "measured":  # ops that could not be timed got a roofline figure: say which
        summary["estimated_ops"] = list(costs.estimated)
    # bench tables compare methods on this experiment, whatever this search found: they stay
    owner = results.owner_of(out) if out.is_dir() else None
    carry = ("bench.csv", "bench.md") if owner and results.same_experiment(owner, exp.name, exp.path) else ()
    carry += () if result.complete else (checkpoints.NAME,)
    results.write(out, result, make_policy, summary, carry=carry, finish=finish,
                  extra={costfile.NAME: costfile.dumps(costs, graph.fingerprint())})  # what `plot` re-simulates with
    return result, summary


def device_peak(experiment: config.Experiment, graph, traced, margin) -> dict:
    """{"device_peak_bytes": the peak the device's meter reads under a traced SimResult's program} where the
    `margin` holds each op's transients measured on the device (CUDA; else {}): the allocator model with them, as
    `validate` measures it: the requested bytes of the step (cuBLAS's workspace, made before it, left out), or
    with `memory: {target: reserved}` the reservations, the workspace's segment in. On an H100 the model with
    the transients gave GPT's measured peak to 208 bytes in five runs, where the graph's tensors alone were up to
    9.6 % under it (`results/gpu_check/`, docs/gpu_memory.md)."""
    if not margin.transients:
        return {}
    if experiment.memory is not None and experiment.memory.target == "reserved":
        return {"device_peak_bytes": allocator.replay(graph, traced, workspace=margin.workspace_bytes,
                                                      transients=margin.transients,
                                                      **allocator_options(experiment)).reserved}
    return {"device_peak_bytes": allocator.replay(graph, traced, transients=margin.transients,
                                                  optimizer=experiment.optimizer).requested}


def describe(prepared: Prepared) -> dict:
    """Where a result comes from: experiment, model, inputs, device, costs, graph."""
    exp, graph = prepared.experiment, prepared.graph
    return _plain({
        "experiment": exp.name,
        "experiment_file": exp.path,
        "model": asdict(exp.model),
        "inputs": [asdict(s) for s in exp.inputs],
        "target": asdict(exp.target) if exp.target else None,
        "batch_size": exp.batch_size,
        "loss": exp.loss,
        "optimizer": exp.optimizer,
        "counts": list(exp.counts),
        "autocast": exp.autocast,
        **({"memory": asdict(exp.memory)} if exp.memory is not None else {}),
        "search_space": exp.search_space.name,
        "seed": exp.seed,
        "device": prepared.costs.device,
        "cost_source": _cost_source(prepared),
        "torch_version": prepared.torch_version,
        "graph": {"fingerprint": graph.fingerprint(), "ops": len(graph.ops), "tensors": len(graph.tensors),
                  "candidates": len(graph.candidates())},
        "capture_seconds": prepared.capture_seconds,
        "costs_seconds": prepared.costs_seconds,
    })


def _cost_source(prepared: Prepared) -> str:
    """Where the costs come from: "measured", unless no op could be timed (each got a roofline estimate)."""
    costs = prepared.costs
    if costs.source == "measured" and len(costs.estimated) == len(prepared.graph.ops):
        return "estimated (no op could be timed on the device: roofline estimates)"
    return costs.source


def _plain(value: dict) -> dict:
    """Tuples to lists and str subclasses to str: what YAML and JSON writers take."""
    return json.loads(json.dumps(value))
