"""The planning core stays legible: no function or method in gaswap/plan or gaswap/base above cyclomatic
complexity 25 (radon's count; a closure counts towards the function around it). Reads source only: no torch."""
from __future__ import annotations

from pathlib import Path

import pytest
from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gaswap/plan", "gaswap/base")
MAX_COMPLEXITY = 25


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _functions(path: Path):
    """(name, line, complexity) of every function and method in `path`, closures inside their function."""
    for block in cc_visit(path.read_text()):
        if hasattr(block, "is_method"):  # a Function (methods included), not a Class
            name = f"{block.classname}.{block.name}" if block.classname else block.name
            yield name, block.lineno, block.complexity


def test_the_packages_have_sources():
    assert len(_sources()) > 10


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_above_the_complexity_limit(package):
    over = [f"{path.relative_to(ROOT)}:{line} {name} ({cc})"
            for path in _sources() if path.is_relative_to(ROOT / package)
            for name, line, cc in _functions(path) if cc > MAX_COMPLEXITY]
    assert not over, f"cyclomatic complexity above {MAX_COMPLEXITY}: " + ", ".join(over)
