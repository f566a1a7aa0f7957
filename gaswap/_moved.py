"""The flat module paths of gaswap 0.1 (`gaswap.search`, `gaswap.policy`, ...), kept working until gaswap 0.3:
importing one imports its new home and warns once with a DeprecationWarning naming it."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "program": "base.program", "files": "base.files", "units": "base.units", "signals": "base.signals",
    "locate": "base.locate", "step": "base.training_options", "config": "base.config",
    "graph": "plan.graph", "costs": "plan.costs", "encoding": "plan.encoding", "simulator": "plan.simulator",
    "problem": "plan.problem", "parallel": "plan.parallel", "checkpoint": "plan.checkpoint",
    "search": "plan.search", "policy": "plan.policy", "costfile": "plan.costfile", "planned": "plan.planned",
    "blocks": "plan.blocks", "baselines": "plan.solvers.baselines", "mincut": "plan.solvers.mincut",
    "milp": "plan.solvers.milp", "allocator": "plan.memory.allocator", "arena": "plan.memory.arena",
    "capture": "run.capture", "dropout": "run.dropout", "measure": "run.measure", "memory": "run.step_memory",
    "meter": "run.peak_meter", "runtime": "run.runtime", "streams": "run.streams",
    "arena_runtime": "run.arena_runtime", "experiment": "run.experiment",
    "compiled_costs": "compiled.step_model", "compiled_program": "compiled.programs",
    "cli": "app.cli", "workflow": "app.workflow", "results": "app.results", "report": "app.report",
    "bench": "app.bench", "speed": "app.speed", "compare": "app.compare", "validate": "app.validate",
    "compiled_validate": "app.validate_compiled", "gpu_check": "app.gpu_check",
    "gpu_memory": "app.gpu_memory_report",
}  # `gaswap.compiled` is a package now; its __getattr__ finds the former module's names


def new_home(old: str) -> str:
    """`gaswap.<old>`'s new module path, warning that the old one goes."""
    new = f"gaswap.{MOVED[old]}"
    warnings.warn(f"gaswap.{old} moved to {new}; the old path goes in gaswap 0.3", DeprecationWarning, stacklevel=3)
    return new


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `gaswap.<old>` as its new module: the import system reads back `sys.modules` after
    `exec_module`, so the module it returns is the new one itself, not a copy."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix == "gaswap" and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(new_home(module.__name__.partition(".")[2]))


def install() -> None:
    """Make the old paths importable (once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
