"""Where a compiled policy's compile goes (issue 34, item 3): torch.compile's partition at budget 1 compiled, then a
calibration policy (`step_model.calibration_policies`' first random half), each warmed up (compiled and run once);
for each, the wall seconds, the CPU seconds of this process (dynamo, AOTAutograd, inductor's lowering and code
generation) and of its children (the C++ compiler), the kernels its programs call (`cpp_pybinding` in the
programs inductor wrote) and those compiled (shared objects inductor's cache gained): the difference is what a
compile found compiled already, by itself or the compile before. Use an empty cache:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python scripts/compile_profile.py experiments/compare_gpt_cpu.yaml
"""
from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

from gaswap.base import config
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled import partition, step_model
from gaswap.plan.encoding import Action
from gaswap.run import training
from gaswap.run.measure import measure


def cpu_seconds() -> tuple[float, float]:
    """(this process's, its waited-for children's) CPU seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def kernels(cache: Path) -> set[str]:
    """The names of the compiled kernels (shared objects) in inductor's cache folder, without their folders."""
    return {p.name for p in cache.rglob("*.so")}


def warmed(label: str, method, exp, inputs, target, device, cache: Path) -> None:
    """Warm `method` up and print what it took (the module's docstring)."""
    before, wall, cpu = kernels(cache), time.perf_counter(), cpu_seconds()
    compiled_methods.warm_up(method, inputs, target, exp.loss, device, lambda line: None)  # records its programs
    own, children = (b - a for a, b in zip(cpu, cpu_seconds()))
    called = sum(p.code.count("cpp_pybinding(") for p in method.programs)
    print(f"{label}: {time.perf_counter() - wall:.1f} s wall, {own:.1f} CPU s in the process, {children:.1f} in "
          f"the compiler; its programs call {called} kernels, {len(kernels(cache) - before)} compiled", flush=True)


def main(path: str) -> None:
    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    if not cache.is_dir():
        raise SystemExit("set TORCHINDUCTOR_CACHE_DIR to an empty folder")
    exp = config.load_experiment(path)
    device, model, inputs, target, graph = compiled_methods.setup(exp)
    costs = measure(graph, device, None, threads=exp.costs.threads)
    m, opt = training.fresh_copy(model, exp.optimizer)
    warmed("torch.compile 1", compiled_methods.Method("torch.compile", "1", m, compiled_methods.torch_compiled(m, 1.0),
                                                      opt), exp, inputs, target, device, cache)
    problem = step_model.CompiledProblem(graph, costs, None, actions=(Action.KEEP, Action.RECOMPUTE), loss=exp.loss)
    half = step_model.calibration_policies(problem, mixes=1)["random half 1"]
    policy = partition.make_policy(graph, problem.actions_of(half),
                                   provenance={"optimizer": exp.optimizer, "counts": sorted(exp.counts)})
    m, opt = training.fresh_copy(model, exp.optimizer)
    warmed("random half 1", compiled_methods.Method("gaswap", "1", m, partition.compile(m, policy), opt),
           exp, inputs, target, device, cache)


if __name__ == "__main__":
    main(sys.argv[1])
