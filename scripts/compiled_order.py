"""Whether operator order (or inductor's buffer reuse) moves a compiled step's program peak.

    PYTHONPATH=. python scripts/compiled_order.py table experiments/compare_{cnn,mixture,separable,window,normmix}_cpu.yaml
    PYTHONPATH=. python scripts/compiled_order.py check experiments/compare_window_cpu.yaml --variant demand_first

`table`: torch's lowest-budget partition (its min-cut partitioner at activation_memory_budget 0.2) and the
lowest-peak stored gaswap policy of each experiment (`results/compiled_model/measured/<experiment>.csv`, kind
gaswap) written by inductor without compiling kernels (`dry_compile`) under each variant of `VARIANTS`: the
partitioned graphs re-ordered (`gaswap.compiled.order`), inductor's `reorder_for_peak_memory` off, its buffer
reuse off, or the fused graph run in one of the orders that pass chooses from, forced. Per row: the step's
program peak (`programs.step_peak`), relative to the first variant, which of the forward, the eager loss and
the backward holds it, and the CPU seconds of the dry compile (inductor's FX graph and AOTAutograd caches
off, so each is written afresh). results/compiled_order/ holds a run.

`check`: one experiment's lowest-peak gaswap policy compiled for real, by default and under `--variant`:
its first step's gradients (same weights, same random state) compared, then the allocator meter's peak
(`gaswap.run.peak_meter`, as compare meters) beside the dry compile's program peak, and CPU seconds per step.
"""
from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from torch._functorch import config as functorch_config

from gaswap.base import config
from gaswap.compiled import dry_compile, methods, partition, programs, step_model
from gaswap.compiled.order import ORDERS, options
from gaswap.compiled.step_model import LOSS_TEMPORARIES
from gaswap.plan.encoding import Action, Chromosome
from gaswap.run import training
from gaswap.run.capture import loss_fn, output_tensor
from gaswap.run.measure import measure

TORCH_BUDGET = 0.2
STORED = ROOT / "results" / "compiled_model"
# name: inductor options; "<order> off": the order with inductor's reorder_for_peak_memory off
VARIANTS = {"default": {}, "reorder off": {"reorder_for_peak_memory": False},
            "reuse off": options(buffer_reuse=False)}
VARIANTS |= {name: options(name) for name in ORDERS}
VARIANTS |= {f"{name} off": options(name) | {"reorder_for_peak_memory": False} for name in ORDERS}
VARIANTS |= {f"{name} reuse off": options(name, buffer_reuse=False) for name in ("demand_first", "rpo")}
HEURISTICS = ("baseline", "lpmf", "bfs", "dfs")  # the orders inductor's reorder pass chooses from: "inductor <name>"


def forced(heuristic: str) -> dict:
    """Inductor options that run the fused graph in the order `heuristic` of those its reorder pass
    (`memory.reorder_for_peak_memory`) chooses from (baseline: the fused graph's own), whatever its estimate
    says, its buffer reuse planned as usual."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    def run(nodes):
        s = V.graph.scheduler
        outputs = OrderedSet(V.graph.get_output_names())
        _, freeable = memory.prepare_planning_info(nodes, s.name_to_buf, s.name_to_fused_node,
                                                   OrderedSet(V.graph.graph_inputs), outputs)
        if heuristic == "baseline":
            return nodes
        if heuristic == "lpmf":
            return memory.topological_sort_lpmf(nodes, freeable, s.name_to_buf, outputs)
        return getattr(memory, f"topological_sort_{heuristic}")(nodes)

    return {"_post_fusion_custom_pass": run, "reorder_for_peak_memory": False}


VARIANTS |= {f"inductor {name}": forced(name) for name in HEURISTICS}


def torch_backend(budget: float, inductor_options: dict):
    """Inductor with its partitioner at `activation_memory_budget = budget`, under `inductor_options`."""
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs, config_patches=inductor_options)

    return inductor_at_budget


def lowest_gaswap(exp, graph, costs_dir: Path):
    """(label, policy) of the stored gaswap policy of `exp` with the lowest metered peak."""
    with open(STORED / "measured" / f"{exp.name}.csv") as f:
        row = min((r for r in csv.DictReader(f) if r["kind"] == "gaswap"), key=lambda r: int(r["peak_bytes"]))
    costs = measure(graph, "cpu", costs_dir, threads=exp.costs.threads)
    problem = step_model.CompiledProblem(graph, costs, None, config.load_search_space(partition.SPACE), loss=exp.loss)
    chromosome = Chromosome(problem.encoding.captured_keys(), tuple(
        int(Action.RECOMPUTE if ch == "r" else Action.KEEP) for ch in row["actions"]))
    return row["label"], partition.make_policy(graph, problem.actions_of(chromosome), provenance={
        "optimizer": exp.optimizer, "counts": sorted(exp.counts)})


def held_by(written, output_bytes: int, loss: str) -> str:
    """Which part of the step holds its peak: forward, loss or backward."""
    forward = next(p for p in written if not p.is_backward)
    backward = next(p for p in written if p.is_backward)
    fw = forward.walk()
    inputs = [n for n in backward.arguments if not n.startswith("tangents_")]
    bw = backward.walk(dict(zip(inputs, forward.saved_storage(len(inputs))))).peak
    parts = {"forward": fw.peak, "loss": fw.end + (1 + LOSS_TEMPORARIES[loss]) * output_bytes, "backward": bw}
    return max(parts, key=parts.get)


def dry(model, backend, inputs) -> tuple[list, float]:
    """(programs, CPU s) of a dry compile written afresh (no FX graph or AOTAutograd cache)."""
    torch._dynamo.reset()
    start = time.process_time()
    with functorch_config.patch(enable_autograd_cache=False):
        written = dry_compile.programs_of(model, backend, *inputs)
    return written, time.process_time() - start


def table_rows(path: str, variants: list[str], costs_dir: Path) -> list[dict]:
    exp = config.load_experiment(path)
    _, model, inputs, _, graph = methods.setup(exp)
    output_bytes = graph.tensors[graph.loss].size
    label, policy = lowest_gaswap(exp, graph, costs_dir)
    backends = {f"torch {TORCH_BUDGET:g}": lambda o: torch_backend(TORCH_BUDGET, o),
                label: lambda o: partition.backend(policy, **o)}
    rows = []
    for policy_label, backend in backends.items():
        default = None
        for name in variants:
            written, cpu = dry(model, backend(VARIANTS[name] | {"fx_graph_cache": False}), inputs)
            peak = programs.step_peak(written, output_bytes, exp.loss)
            default = default or peak
            rows.append({"experiment": exp.name.removeprefix("compare_").removesuffix("_cpu"), "policy": policy_label,
                         "variant": name, "peak_bytes": peak, "relative": round(peak / default, 4),
                         "held_by": held_by(written, output_bytes, exp.loss), "cpu_s": round(cpu, 2)})
            r = rows[-1]
            print(f"{r['experiment']:10s} {policy_label:13s} {name:22s} {peak / 1e6:8.3f} MB {r['relative']:6.3f}x  "
                  f"{r['held_by']:8s} {cpu:5.1f} CPU s", flush=True)
    return rows


def check(path: str, variant: str, costs_dir: Path, steps: int) -> None:
    """Compile the experiment's lowest-peak gaswap policy by default and under `variant`: gradients, peaks, time."""
    exp = config.load_experiment(path)
    device, model, inputs, target, graph = methods.setup(exp)
    output_bytes = graph.tensors[graph.loss].size
    label, policy = lowest_gaswap(exp, graph, costs_dir)
    methods.allow_recompiles(4)
    grads = {}
    for name in ("default", variant):
        written, cpu = dry(model, partition.backend(policy, **VARIANTS[name]), inputs)
        m, optimizer = training.fresh_copy(model, exp.optimizer)
        run = partition.compile(m, policy, **VARIANTS[name])
        torch.manual_seed(exp.seed)
        start = time.process_time()
        loss_fn(exp.loss, output_tensor(run(*inputs)), target).backward()
        compile_s = time.process_time() - start
        grads[name] = [p.grad.clone() for p in m.parameters()]
        optimizer.zero_grad(set_to_none=True)
        step = partial(training.train_step, run, optimizer, inputs, target, exp.loss, device)
        training.warm_up(step)
        metered, _, timed = training.metered_round(step, device, steps)
        peak = programs.step_peak(written, output_bytes, exp.loss)
        print(f"{exp.name} {label} {name}: program peak {peak / 1e6:.3f} MB (dry, {cpu:.1f} CPU s), metered "
              f"{metered / 1e6:.3f} MB, {statistics.median(c for _, c in timed):.4f} CPU s a step (median of {steps}), "
              f"first step with its compile {compile_s:.1f} CPU s", flush=True)
    pairs = list(zip(grads["default"], grads[variant]))
    worst = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in pairs)
    same = "bitwise equal, " if all(torch.equal(a, b) for a, b in pairs) else ""
    print(f"gradients of {variant} against default: {same}largest difference {worst:.2e} of the largest entry",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("table", "check"))
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=[v for v in VARIANTS if not v.startswith("inductor ")],
                        help="table: the variants (default: all but the forced orders of inductor's reorder pass)")
    parser.add_argument("--variant", default="demand_first", choices=list(VARIANTS), help="check: the variant compiled")
    parser.add_argument("--steps", type=int, default=5, help="check: steps timed")
    parser.add_argument("--csv", help="table: also write the rows to this CSV file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # a copy: the stored op times are read, never rewritten
        costs_dir = Path(shutil.copytree(STORED / "costs", Path(tmp) / "costs"))
        if args.verb == "check":
            for path in args.experiments:
                check(path, args.variant, costs_dir, args.steps)
            return
        rows = [row for path in args.experiments for row in table_rows(path, args.variants, costs_dir)]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
