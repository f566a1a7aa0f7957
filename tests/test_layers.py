"""The package's layers (see gaswap/__init__.py): no import reaches up a layer, and the floor and the
planning core never import torch, not even inside a function."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gaswap"
FLOOR = {"program", "files", "step", "units", "locate"}
CORE = {"graph", "costs", "encoding", "simulator", "problem", "parallel", "checkpoint", "search", "baselines",
        "milp", "policy", "allocator", "costfile", "planned", "blocks", "mincut"}
APPLICATION = {"config", "experiment", "results", "signals", "workflow", "validate", "report", "bench", "speed",
               "compare", "compiled_validate", "gpu_check", "gpu_memory", "cli", "__main__"}


def layer(module: str) -> int:
    """0 floor, 1 core, 2 torch side (any module not named elsewhere), 3 application."""
    return 0 if module in FLOOR else 1 if module in CORE else 3 if module in APPLICATION else 2


def imports(path: Path) -> set[str]:
    """Top-level names this module imports, anywhere in it: gaswap modules by their short name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"gaswap.{a.name}" for a in node.names} if node.module == "gaswap" else {node.module}
    return {n.split(".")[1] if n.startswith("gaswap.") else n.split(".")[0] for n in out if n != "gaswap"}


MODULES = {p.stem: imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def test_every_layer_named_exists():
    assert (FLOOR | CORE | APPLICATION) - set(MODULES) == set()


def test_no_import_reaches_up_a_layer():
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
              for m, deps in sorted(MODULES.items()) for d in sorted(deps & set(MODULES)) if layer(d) > layer(m)]
    assert upward == [], "a torch-free planning module belongs in CORE of tests/test_layers.py"


def test_the_floor_and_the_core_never_import_torch():
    assert [m for m in sorted(FLOOR | CORE) if "torch" in MODULES[m]] == []


def test_importing_the_whole_core_loads_no_torch():
    code = ("import sys\n" + "".join(f"import gaswap.{m}\n" for m in sorted(FLOOR | CORE))
            + "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
