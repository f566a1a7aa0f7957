"""The packages' layering (see gaswap/__init__.py), read from every import of every module: absolute and
relative, at the top and inside functions. A planted upward import makes `violations` report it."""
import ast
import functools
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gaswap"

# What each package may import of gaswap (besides itself). Top-level modules count as packages of their own.
ALLOWED = {
    "base": set(),
    "plan": {"base"},
    "zoo": {"base"},
    "run": {"base", "plan", "zoo"},
    "compiled": {"base", "plan", "run"},
    "shard": {"base", "plan", "run", "zoo"},
    "app": {"base", "plan", "zoo", "run", "compiled", "shard"},
    "__init__": {"_moved", "plan", "run"},  # gaswap.apply and apply_step, imported when called
    "_moved": set(),
    "__main__": {"app"},
}
# Modules that never import torch, not even inside a function: named explicitly, package by package.
TORCH_FREE_PACKAGES = ("base", "plan")
TORCH_FREE_MODULES = ("compiled.step_model", "_moved")


def module_name(path: Path) -> str:
    """'plan.solvers.milp' for gaswap/plan/solvers/milp.py; a package's __init__ is named after the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def package_path(module: str) -> list[str]:
    """The package a module's relative imports start from: 'plan' for plan.graph and for plan (its __init__)."""
    is_package = (PACKAGE / module.replace(".", "/")).is_dir()
    return module.split(".") if is_package else module.split(".")[:-1]


@functools.cache
def parsed(source: str) -> ast.Module:
    """`source`'s syntax tree, parsed once per session (the tests read the same sources, a planted line apart; the
    trees are only read)."""
    return ast.parse(source)


@functools.cache
def imported(module: str, source: str) -> list[tuple[int, str, bool]]:
    """(line, dotted name, inside a function) for every import in `source`, relative ones resolved (once per
    module and source: the list is only read)."""
    tree = parsed(source)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    here = package_path(module)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module
            if node.level:
                base = here[:len(here) - node.level + 1]
                prefix = ".".join(["gaswap", *base, *([node.module] if node.module else [])])
            names = [f"{prefix}.{a.name}" if _is_module(f"{prefix}.{a.name}") else prefix for a in node.names]
        else:
            continue
        out += [(node.lineno, n, id(node) in in_function) for n in names]
    return out


def _is_module(dotted: str) -> bool:
    """Whether `gaswap.x.y` names a module or package of gaswap (not a function or class in one)."""
    if not dotted.startswith("gaswap."):
        return False
    path = PACKAGE.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or path.is_dir()


def package_of(name: str) -> str:
    """The layering unit of a gaswap module name without its prefix: its first part."""
    return name.split(".")[0]


def violations(modules: dict[str, str]) -> list[str]:
    """Every import that breaks ALLOWED or TORCH_FREE_*, and every gaswap import inside a function that has no
    reason beside it (a comment on its line or on the line above its block)."""
    found = []
    for module, source in modules.items():
        lines = source.splitlines()
        own = package_of(module)
        torch_free = own in TORCH_FREE_PACKAGES or module in TORCH_FREE_MODULES
        for line, name, in_function in imported(module, source):
            root = name.split(".")[0]
            if torch_free and root == "torch":
                found.append(f"{module}:{line} imports torch (it is torch-free)")
            if root != "gaswap" or name == "gaswap":
                continue
            target = package_of(name.split(".", 1)[1])
            if target != own and target not in ALLOWED.get(own, set()):
                found.append(f"{module}:{line} imports gaswap.{name.split('.', 1)[1]} ({own} may import "
                             f"{', '.join(sorted(ALLOWED.get(own, ()))) or 'nothing of gaswap'})")
            if in_function and not _explained(lines, line):
                found.append(f"{module}:{line} imports {name} inside a function with no reason beside it")
    return found


def _explained(lines: list[str], line: int) -> bool:
    """A comment on the import's line, or on the line above the run of import lines it belongs to."""
    i = line - 1
    if "#" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1
    return i > 0 and lines[i - 1].strip().startswith("#")


def test_no_import_breaks_the_layering():
    assert violations(sources()) == []


def import_cycles(modules: dict[str, str]) -> list[list[str]]:
    """Groups of gaswap modules that import each other, directly or through others (any import, anywhere)."""
    edges = {m: {name.split(".", 1)[1] for _, name, _ in imported(m, source)
                 if name.startswith("gaswap.") and name.split(".", 1)[1] in modules and name.split(".", 1)[1] != m}
             for m, source in modules.items()}
    cycles, done = [], set()
    for start in sorted(edges):
        reach, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - reach:
                reach.add(nxt)
                todo.append(nxt)
        if start in reach and start not in done:
            group = sorted(m for m in reach if start in _reachable(edges, m))
            done |= set(group)
            cycles.append(group)
    return cycles


def _reachable(edges, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycle():
    assert import_cycles(sources()) == []


def test_a_planted_cycle_is_caught():
    planted = dict(sources())
    planted["plan.graph"] += "\n\ndef _planted():\n    from gaswap.plan import simulator  # planted\n"
    assert any({"plan.graph", "plan.simulator"} <= set(group) for group in import_cycles(planted))


def test_every_package_has_a_rule():
    assert {package_of(m) for m in sources()} - set(ALLOWED) == set()


def test_a_planted_relative_import_inside_a_function_is_caught():
    planted = dict(sources())
    planted["plan.graph"] += "\n\ndef _planted():\n    from ..app.workflow import prepare\n    return prepare\n"
    found = violations(planted)
    assert any(f.startswith("plan.graph:") and "gaswap.app.workflow" in f for f in found), found
    assert any("plan.graph:" in f and "no reason" in f for f in found), found


def test_a_planted_torch_import_in_a_torch_free_module_is_caught():
    planted = dict(sources())
    planted["compiled.step_model"] += "\n\ndef _planted():\n    import torch  # planted\n    return torch\n"
    assert any(f.startswith("compiled.step_model:") and "torch" in f for f in violations(planted))


def test_no_module_imports_another_modules_private_names():
    private = []
    for module, source in sources().items():
        for node in ast.walk(parsed(source)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("gaswap")):
                private += [f"{module}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_moved"]
    assert private == []


def test_importing_every_torch_free_module_loads_no_torch():
    names = [m for m in sources() if package_of(m) in TORCH_FREE_PACKAGES or m in TORCH_FREE_MODULES]
    code = ("import sys\n" + "".join(f"import gaswap.{m}\n" for m in sorted(names))
            + "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_old_flat_paths_import_their_new_modules_with_a_warning():
    """In a fresh process: an old module path warns once, at its first import."""
    code = ("import warnings, importlib\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import gaswap.search as old\n"
            "    from gaswap import policy\n"
            "new = importlib.import_module('gaswap.plan.search')\n"
            "assert old is new, (old, new)\n"
            "assert policy is importlib.import_module('gaswap.plan.policy')\n"
            "messages = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
            "assert any('gaswap.search moved to gaswap.plan.search' in m for m in messages), messages\n"
            "assert any('gaswap.policy moved to gaswap.plan.policy' in m for m in messages), messages\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_the_former_gaswap_compiled_modules_names_are_found_with_a_warning():
    """`gaswap.compiled`'s __getattr__ warns at every look-up, so this runs in the test's process (a fresh one
    would import torch.compile's stack again: seconds)."""
    import warnings

    from gaswap.compiled import partition

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        from gaswap.compiled import backend
    assert backend is partition.backend
    messages = [str(x.message) for x in w if x.category is DeprecationWarning]
    assert any("gaswap.compiled.backend moved to gaswap.compiled.partition.backend" in m for m in messages), messages
