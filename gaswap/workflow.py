"""One experiment from file to results: build the model, capture the step, get costs, search, write.

The glue between the torch side (capture, measure) and the torch-free core; the CLI calls it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gaswap import config, results
from gaswap.capture import CaptureError  # noqa: F401  (re-exported for the CLI)
from gaswap import policy as policies
from gaswap.costs import Costs, estimate, load_profile
from gaswap.encoding import Action, Encoding
from gaswap.graph import Graph
from gaswap.search import Evaluated, SearchResult, search
from gaswap.simulator import Simulator, lower_bound


class Infeasible(Exception):
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


def build_model(experiment: config.Experiment, device: str = "meta"):
    """The experiment's model, with parameters on `device` ("meta" allocates nothing)."""
    import torch

    from gaswap.zoo import resolve

    try:
        factory = resolve(experiment.model.factory)
    except ValueError as err:
        raise config.ConfigError(f"{experiment.path}: model.factory: {err}") from None
    try:
        with torch.device(device):
            return factory(**experiment.model.kwargs)
    except TypeError as err:
        raise config.ConfigError(f"{experiment.path}: model.kwargs: {experiment.model.factory} refused them: {err}") from None


def make_inputs(experiment: config.Experiment, device: str = "meta", generator=None):
    """The experiment's (inputs, target) tensors on `device`."""
    from gaswap.capture import make_inputs as make

    specs = [asdict(s) for s in experiment.inputs]
    target = asdict(experiment.target) if experiment.target is not None else None
    return make(specs, target, experiment.batch_size, device=device, generator=generator)


def prepare(experiment: config.Experiment, *, cache_dir=None, progress=None) -> Prepared:
    """Capture the experiment's training step (on the meta device) and get its costs."""
    import torch

    from gaswap.capture import capture

    started = time.perf_counter()
    model = build_model(experiment)
    inputs, target = make_inputs(experiment)
    captured = capture(model, inputs, target, experiment.loss, optimizer=experiment.optimizer,
                       counted=experiment.counts)
    capture_seconds = time.perf_counter() - started
    started = time.perf_counter()
    costs = costs_for(experiment, captured.graph, cache_dir=cache_dir, progress=progress)
    return Prepared(experiment, captured.graph, costs, capture_seconds, time.perf_counter() - started,
                    torch.__version__)


def costs_for(experiment: config.Experiment, graph: Graph, *, cache_dir=None, progress=None) -> Costs:
    """Estimated from the experiment's hardware profile, or measured on its device (cached on disk)."""
    spec = experiment.costs
    if spec.source == "estimate":
        try:
            profile = load_profile(spec.profile)
        except ValueError as err:
            raise config.ConfigError(f"{experiment.path}: costs.profile: {err}") from None
        return estimate(graph, profile)
    from gaswap.measure import measure

    return measure(graph, spec.device, cache_dir, progress=progress)


def keep_all(prepared: Prepared) -> Evaluated:
    """The captured order with every activation kept: what plain PyTorch does."""
    enc = Encoding(prepared.graph)
    c = enc.uniform(Action.KEEP)
    r = Simulator(prepared.graph, prepared.costs).run(enc.decode(c.keys), c.actions)
    return Evaluated(c, r.step_time, r.peak_bytes, r.valid)


def run_search(prepared: Prepared, out: str | Path, *, on_generation=None) -> tuple[SearchResult, dict]:
    """Search the experiment's policies and write its results folder; raises Infeasible when none fits."""
    exp, graph, costs = prepared.experiment, prepared.graph, prepared.costs
    reference = keep_all(prepared)
    budget = exp.budget.resolve(reference.peak_bytes)
    result = search(graph, costs, exp.search_space, exp.ga, budget, exp.seed, on_generation=on_generation)
    if result.best is None:
        raise Infeasible(
            f"{exp.path}: no policy found under the budget {config.format_size(budget)}: the smallest peak "
            f"reached was {config.format_size(result.smallest_peak)}, and no policy can go below "
            f"{config.format_size(lower_bound(graph))} (resident memory plus the largest single op). "
            f"Raise the budget, or search longer (ga.generations) or a wider search space."
        )
    encoding = Encoding(graph)
    provenance = describe(prepared) | {"budget_bytes": budget}

    def make_policy(e: Evaluated) -> policies.Policy:
        predicted = results.point(e, reference)
        return policies.from_result(graph, encoding.candidates, encoding.decode(e.chromosome.keys),
                                    e.chromosome.actions, predicted, provenance)

    summary = describe(prepared) | {
        "budget_bytes": budget,
        "budget": str(exp.budget),
        "keep_all": {"peak_bytes": reference.peak_bytes, "step_time_s": reference.step_time},
    }
    results.write(out, result, make_policy, summary)
    return result, summary


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
        "search_space": exp.search_space.name,
        "seed": exp.seed,
        "device": prepared.costs.device,
        "cost_source": prepared.costs.source,
        "torch_version": prepared.torch_version,
        "graph": {"fingerprint": graph.fingerprint(), "ops": len(graph.ops), "tensors": len(graph.tensors),
                  "candidates": len(graph.candidates())},
        "capture_seconds": prepared.capture_seconds,
        "costs_seconds": prepared.costs_seconds,
    })


def _plain(value: dict) -> dict:
    """Tuples to lists and str subclasses to str: what YAML and JSON writers take."""
    return json.loads(json.dumps(value))
