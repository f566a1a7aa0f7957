"""Inductor's layout decision per graph (`GraphLowering.decide_layout_opt`: channels-last where the graph has
forward convolutions, so not in a backward that recomputes none) against the backward laid out as the forward
(`backward_as_forward`: inductor's `force_layout_optimization` for the backward where the forward decided for
channels-last), on the shipped compare experiments with convolutions and on gpt (none: nothing to change).
Per experiment, in one process, in rotated rounds (`methods.measure`: CPU seconds a step, median and range; the
allocator's peak above resident): torch.compile at activation_memory_budget 1.0 (torch's partitioner and inductor
as they are), and torch's 1.0 partition and the calibration's recompute-generated policy (no convolution
recomputed: the backward has none) compiled by gaswap's backend, each with inductor's per-graph decision ("per
graph", as gaswap compiles) and with the backward laid out as the forward ("as forward"). Inductor's autograd
cache is off here (its key does not tell the two apart).
Run from the repository root:
    PYTHONPATH=. python results/compiled_model/backward_layout.py cnn densenet separable gpt > results/compiled_model/backward_layout.txt
"""
import contextlib
import sys
from unittest import mock

from torch._functorch import config as functorch_config
from torch._inductor import compile_fx as inductor_compile_fx
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering

from gaswap.base import config
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import partition, step_model
from gaswap.compiled.methods import ROUND_S, Method
from gaswap.run import training
from gaswap.run.measure import device_name, measure

ROUNDS, STEPS = 9, 3


def backward_as_forward(compile_fx):
    """`compile_fx` (inductor's, as `partition` calls it) with the backward graph given the forward's layout."""
    inner = inductor_compile_fx.compile_fx_inner
    forward = {}

    def compile_graph(gm, example_inputs, *args, **kwargs):
        if not kwargs.get("is_backward"):
            forward["layout_opt"] = GraphLowering.decide_layout_opt(gm, is_inference=kwargs.get("is_inference", False))
        elif forward.get("layout_opt"):
            with inductor_config.patch(force_layout_optimization=True):
                return inner(gm, example_inputs, *args, **kwargs)
        return inner(gm, example_inputs, *args, **kwargs)

    def compile_with(gm, example_inputs, **kwargs):
        kwargs.setdefault("inner_compile", compile_graph)  # compile_fx calls itself with it, wrapped in its settings
        return compile_fx(gm, example_inputs, **kwargs)

    return compile_with


def experiment(name: str) -> list[str]:
    exp = config.load_experiment(f"experiments/compare_{name}_cpu.yaml")
    device, model, inputs, target, graph = compiled_methods.setup(exp)
    costs = measure(graph, device, None, threads=exp.costs.threads)
    _, parts = partition.torch_partitions(model, *inputs, budgets=(1.0,), optimizer=exp.optimizer, counted=exp.counts)
    problem, chosen = step_model.calibration_set(graph, costs, exp.loss, {"torch 1": parts[1.0]})
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    compiled_methods.allow_recompiles(8)
    made = []
    m, opt = training.fresh_copy(model, exp.optimizer)
    made.append(Method("torch.compile", "1.0", m, compiled_methods.torch_compiled(m, 1.0), opt))
    for label in ("torch 1", "recompute-generated"):
        policy = partition.make_policy(graph, problem.actions_of(chosen[label]), provenance=provenance)
        for layout in ("per graph", "as forward"):
            forced = mock.patch.object(inductor_compile_fx, "compile_fx",
                                       backward_as_forward(inductor_compile_fx.compile_fx))
            with forced if layout == "as forward" else contextlib.nullcontext():  # the backend made, and compiling
                m, opt = training.fresh_copy(model, exp.optimizer)
                method = Method("gaswap", f"{label}, {layout}", m, partition.compile(m, policy), opt)
                compiled_methods.warm_up(method, inputs, target, exp.loss, device, lambda line: None)
            made.append(method)
    rows = compiled_methods.measure(made, inputs, target, exp.loss, device, ROUNDS, STEPS, lambda line: None,
                                    metered=1, round_s=ROUND_S)
    out = [f"{name} ({device_name(device)}, {ROUNDS} rounds):"]
    for method, row in zip(made, rows):
        out.append(f"  {method.name:13s} {method.knob:32s} {row['step_s'] * 1e3:7.2f} ms "
                   f"[{row['step_min'] * 1e3:6.2f}-{row['step_max'] * 1e3:6.2f}]  peak {row['peak_bytes'] / 1e6:7.2f} MB")
    return out


if __name__ == "__main__":
    with functorch_config.patch(enable_autograd_cache=False):
        for name in sys.argv[1:]:
            print("\n".join(experiment(name)), flush=True)
