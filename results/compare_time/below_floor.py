"""Why no 0.8x point (issue 34, item 2) on five models: at 0.8 x torch's lowest measured peak, the smallest peak a
compare search reaches in the compiled model (`compare.SEARCH`, torch's partitions as seeds, the run's own peak
calibration), and for the candidates that fit the model there, the peak of the programs inductor writes for the
four smallest peaks the model gives (one candidate each; dry compiles: `dry_compile.policy_peak_and_partition`), and
the smallest's under every order inductor can be told (`order.ORDERS`, and as partitioned), buffer reuse on and off.
Run from the repository root:
    PYTHONPATH=. python results/compare_time/below_floor.py > results/compare_time/below_floor.txt
"""
import csv
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import yaml

from gaswap.app import compare
from gaswap.base import config
from gaswap.compiled import dry_compile, partition, step_model
from gaswap.compiled import order as orders
from gaswap.compiled import methods as compiled_methods
from gaswap.plan.search import search
from gaswap.run import measure

RUNS = (("separable", "separable_3fa5542"), ("mixture", "mixture_6996492"), ("normmix", "normmix_6996492"),
        ("gpt2_hf", "gpt2_hf_6996492"), ("gru", "gru_137499e"))
CHECKED = 4

def searched_at_0_8x(name: str, run: str) -> SimpleNamespace:
    """The compare search of `experiments/compare_<name>_cpu.yaml` at 0.8 x torch's lowest peak in stored `run`
    (its cost cache, its calibration's peak modelling, torch's partitions as seeds): exp, device, model, inputs,
    target, graph, unbounded (the problem without a budget), problem, resident, lowest, budget, result and found
    (the candidates that fit the model there, by actions)."""
    folder = Path("results/compare_time") / run
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, target, graph = compiled_methods.setup(exp)
    costs = measure.measure(graph, device, folder / "costs", threads=exp.costs.threads)
    recorded = yaml.safe_load((folder / "p00.yaml").read_text())["provenance"]["calibration"]
    calibration = replace(step_model.Calibration(0.0, 1.0), peak_offset=recorded["peak_offset_bytes"],
                          inline_recomputed=recorded["inline_recomputed"])  # peaks as the run modelled them
    space = config.load_search_space(partition.SPACE)
    unbounded = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=calibration)
    resident = unbounded.fused.resident_bytes()
    lowest = min(int(r["peak_bytes"]) for r in csv.DictReader((folder / "compare.csv").open())
                 if r["method"] == "torch.compile")
    partitions = partition.torch_partitions(model, *inputs, budgets=(1.0, 0.5, 0.2), optimizer=exp.optimizer,
                                            counted=exp.counts)[1]
    seeds = {f"torch_{b:g}": unbounded.canonical(unbounded.encoding.read_back(a)) for b, a in partitions.items()}
    budget = resident + int(0.8 * lowest)
    problem = step_model.CompiledProblem(graph, costs, budget, space, loss=exp.loss, calibration=calibration)
    result = search(problem, compare.SEARCH, exp.seed, seeds=seeds)
    found = {e.chromosome.actions: e for e in (*result.front, *result.fastest) if e.peak_bytes <= budget}
    return SimpleNamespace(exp=exp, device=device, model=model, inputs=inputs, target=target, graph=graph,
                           unbounded=unbounded, problem=problem, resident=resident, lowest=lowest, budget=budget,
                           result=result, found=found)


def _report(name: str, run: str, s: SimpleNamespace) -> None:
    """Print what `searched_at_0_8x` found for `name` and how inductor's programs hold its smallest candidates."""
    exp, model, inputs, graph, unbounded, problem = s.exp, s.model, s.inputs, s.graph, s.unbounded, s.problem
    resident, lowest, result, found = s.resident, s.lowest, s.result, s.found
    print(f"{name} ({run}): 0.8x = {0.8 * lowest / 1e6:.2f} MB; the model's smallest peak reached "
          f"{(result.smallest_peak - resident) / 1e6:.2f} MB; {len(found)} candidates fit the model", flush=True)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}  # as compare writes them
    programs = {}  # the model's peak -> the programs' (one candidate checked per peak the model gives)
    for e in sorted(found.values(), key=lambda e: e.peak_bytes):
        if e.peak_bytes in programs:
            continue
        policy = partition.make_policy(graph, unbounded.actions_of(problem.canonical(e.chromosome)),
                                       provenance=provenance)
        peak = programs[e.peak_bytes] = dry_compile.policy_peak_and_partition(
            model, policy, inputs, graph.tensors[graph.loss].size, exp.loss)[0]
        print(f"  model {(e.peak_bytes - resident) / 1e6:7.2f} MB   programs {peak / 1e6:7.2f} MB   "
              f"({peak / (e.peak_bytes - resident):.2f}x; {'fits' if peak <= 0.8 * lowest else 'over'})", flush=True)
        if len(programs) == CHECKED:
            break
    if found:  # the smallest under each order inductor can be told (`order.ORDERS`), and with buffer reuse off
        smallest = min(found.values(), key=lambda e: e.peak_bytes)
        actions = unbounded.actions_of(problem.canonical(smallest.chromosome))
        varied = []
        for order in (None, *orders.ORDERS):
            for reuse in (True, False):
                inductor = ({} if order is None else {"order": order}) | ({} if reuse else {"buffer_reuse": False})
                policy = partition.make_policy(graph, actions, provenance=provenance | {"inductor": inductor})
                varied.append(dry_compile.policy_peak(model, policy, inputs, graph.tensors[graph.loss].size, exp.loss))
        print(f"  the smallest under {len(varied)} orders and buffer reuse settings: programs "
              f"{min(varied) / 1e6:.2f} to {max(varied) / 1e6:.2f} MB", flush=True)


def main() -> None:
    for name, run in RUNS:
        _report(name, run, searched_at_0_8x(name, run))


if __name__ == "__main__":
    main()
