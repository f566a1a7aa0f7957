"""One exception hierarchy (gaswap.base.errors): every gaswap exception carries its exit code, and the CLI reads
that code rather than a table of names, so a new class needs no entry anywhere else."""
import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import gaswap
from gaswap.app import cli
from gaswap.base import errors

ROOT = Path(__file__).resolve().parents[1]

# The codes of README's "Exit codes and trust" table that a class may carry (0 is success; 5 is an OSError;
# 130 and 143 are signals).
DOCUMENTED = {1, 2, 3, 4}

# What each existing class reported through the CLI before the hierarchy: the codes stay.
BEFORE = {
    "gaswap.base.config.ConfigError": 2, "gaswap.run.capture.CaptureError": 2, "gaswap.app.results.ResultsError": 2,
    "gaswap.app.workflow.Infeasible": 3,
    "gaswap.plan.policy.PolicyError": 4, "gaswap.app.results.Refused": 4, "gaswap.plan.checkpoint.CheckpointError": 4,
    "gaswap.base.files.UnreadableFile": 1, "gaswap.base.program.ProgramSyntaxError": 1,
    "gaswap.plan.graph.GraphError": 1, "gaswap.plan.costfile.CostFileError": 4,  # a user's edit (issue 31): refused
    "gaswap.plan.simulator.Unrealizable": 1, "gaswap.plan.memory.allocator.OutOfMemory": 1,
    "gaswap.plan.solvers.milp.TooLarge": 1, "gaswap.run.runtime.ProgramError": 1, "gaswap.run.measure.DeviceError": 1,
    "gaswap.compiled.partition.CompiledCaptureError": 1, "gaswap.compiled.partition._Captured": 1,
    "gaswap.compiled.programs.ProgramError": 1,
}


def gaswap_exceptions() -> dict[str, type]:
    """Every exception class defined in gaswap, by qualified name, after importing all its modules."""
    for info in pkgutil.walk_packages(gaswap.__path__, "gaswap."):
        if info.name != "gaswap.__main__":  # it runs the CLI when imported
            importlib.import_module(info.name)
    found, todo = {}, [Exception]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("gaswap."):
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return found


def test_readme_documents_the_codes_classes_carry():
    section = (ROOT / "README.md").read_text().split("## Exit codes and trust", 1)[1]
    table = {int(code) for code in re.findall(r"^\| (\d+) \|", section, flags=re.MULTILINE)}
    assert DOCUMENTED | {0, errors.UNWRITABLE} <= table
    assert {errors.INTERNAL, errors.BAD_INPUT, errors.NO_FIT, errors.REFUSED} == DOCUMENTED


def test_every_gaswap_exception_is_a_gaswap_error_with_a_documented_code():
    found = gaswap_exceptions()
    assert set(BEFORE) <= set(found)  # the walk reaches every module
    for name, cls in found.items():
        assert issubclass(cls, errors.GaswapError), name
        assert isinstance(cls.exit_code, int) and cls.exit_code in DOCUMENTED, name


def test_each_class_keeps_its_exit_code_and_builtin_base():
    found = gaswap_exceptions()
    assert {name: found[name].exit_code for name in BEFORE} == BEFORE
    for name in ("base.config.ConfigError", "app.results.ResultsError", "plan.policy.PolicyError",
                 "plan.checkpoint.CheckpointError", "base.files.UnreadableFile", "plan.graph.GraphError"):
        assert issubclass(found[f"gaswap.{name}"], ValueError), name  # `except ValueError` callers still catch it
    for name in ("run.runtime.ProgramError", "compiled.programs.ProgramError", "run.measure.DeviceError"):
        assert issubclass(found[f"gaswap.{name}"], RuntimeError), name


@pytest.mark.parametrize("base", [errors.BadInput, errors.NoFit, errors.Refusal])
def test_a_new_class_reports_its_exit_code_without_any_entry_in_the_cli(base, monkeypatch, capsys):
    class Brand(base):
        pass

    def fail(*args):
        raise Brand("the new class's message\nover two lines")

    monkeypatch.setattr("gaswap.app.speed.simulator_speed", fail)
    assert cli.main(["speed"]) == base.exit_code
    assert capsys.readouterr().err == "error: the new class's message over two lines\n"


@pytest.mark.parametrize("error", [errors.GaswapError("unexpected"), KeyError("unexpected")])
def test_a_gaswap_error_of_code_1_and_any_other_exception_are_internal_errors(error, monkeypatch, capsys):
    def fail(*args):
        raise error

    monkeypatch.delenv("GASWAP_DEBUG", raising=False)
    monkeypatch.setattr("gaswap.app.speed.simulator_speed", fail)
    assert cli.main(["speed"]) == 1
    assert capsys.readouterr().err.startswith(f"error: internal error, please report it: {type(error).__name__}: ")


def test_the_cli_maps_no_error_by_name():
    """No string in cli.py names an exception class or a gaswap module (the old lookup table did both)."""
    names = {cls.__name__ for cls in gaswap_exceptions().values()}
    strings = {node.value for node in ast.walk(ast.parse(Path(cli.__file__).read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & names
    assert not [s for s in strings if re.fullmatch(r"gaswap(\.\w+)+", s)]


def test_bench_has_one_cli():
    """`gaswap bench` (cli.py) is bench's only command line: the module parses no arguments of its own."""
    from gaswap.app import bench

    assert not {"main", "command", "add_arguments"} & set(vars(bench))
    assert "argparse" not in Path(bench.__file__).read_text()
