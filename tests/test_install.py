"""Tested as users install it: CI installs what the README says, and the `test` extra holds every package the
README offers and a test needs, so that no test is skipped for want of one (torchvision aside: see docs/models.md)."""
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_INSTALLABLE = {"torchvision": "its PyPI builds need another torch than 2.13.0's CPU build (docs/models.md)"}


def _extras() -> dict[str, list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {name: [r for r in value.splitlines() if r] for name, value in cfg["options.extras_require"].items()}


def test_the_test_extra_holds_every_extra_the_readme_offers_in_the_same_ranges():
    extras = _extras()
    for name in ("dask", "transformers", "notebook"):
        # jupyter is the notebook's user interface; the tests run the notebook with nbclient and ipykernel
        missing = [r for r in extras[name] if r not in extras["test"] and not r.startswith("jupyter")]
        assert not missing, f"extra {name!r}: {missing} not in the test extra"
    assert all(re.search(r"<\d", r) for r in extras["test"] if r.split(">")[0] in ("dask[distributed]", "transformers"))


def test_every_package_a_test_skips_without_is_in_the_test_extra():
    test = " ".join(_extras()["test"])
    skipped = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        skipped |= set(re.findall(r"importorskip\(\"(\w+)\"\)", path.read_text()))
    assert {"transformers", "distributed"} <= skipped
    assert all(name in test or name in NOT_INSTALLABLE for name in skipped), skipped


def test_ci_installs_torch_first_then_the_test_extra_and_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e '.[test]'" in readme and "python -m pytest" in readme
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    torch_at = next(k for k, line in enumerate(lines) if "pip install" in line and "torch==2.13.0" in line)
    extra_at = next(k for k, line in enumerate(lines) if "pip install" in line and "'.[test]'" in line)
    test_at = next(k for k, line in enumerate(lines) if line.startswith("python -m pytest"))
    assert torch_at < extra_at < test_at
