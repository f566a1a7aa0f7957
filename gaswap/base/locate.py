"""Finding what an experiment names from wherever a command runs: its model factory's module (also relative
to the experiment file's folder) and, from a policy or results folder, the experiment file itself. On the
floor: no torch, no other gaswap module.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

FIX = ("make it importable: run from the folder that holds it, add that folder to PYTHONPATH, or install "
       "it (pip install -e)")


def import_module(name: str, base: str | Path | None = None):
    """Import module `name`; if it is not found on the Python path, look for it in the folder `base` too (the
    experiment file's folder, then left at the end of the path so its siblings import as well). Raises
    ImportError saying where it looked and how to make it importable."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if base is None or not _names_module(name, err):  # a module it imports is missing: not ours to find
            raise
        first = err
    base = str(Path(base).resolve())
    if base not in sys.path:
        sys.path.append(base)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if not _names_module(name, err):
            raise
        raise ImportError(f"{first}: not on the Python path nor in the experiment's folder {base}; {FIX}") from None


def _names_module(name: str, err: ModuleNotFoundError) -> bool:
    """Whether the module not found is `name` or a package above it."""
    return err.name is not None and (name == err.name or name.startswith(err.name + "."))


def experiment_file(recorded: dict, near: str | Path, source: str) -> Path:
    """The experiment file a policy or summary `recorded` ("experiment_file", as given to the search): from the
    current folder if it is there, else from a folder above `near` (the policy or results folder: the folder
    the search ran in holds `results/<experiment>/`). `source` says where the name was read, for the error
    (a FileNotFoundError: callers turn it into their own one-line error)."""
    given = Path(str(recorded.get("experiment_file")))
    for path in (given, *(folder / given for folder in Path(near).resolve().parents)):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{source}: names the experiment file {str(given)!r} (as given to the search), which is "
                      f"neither in {Path.cwd()} nor in a folder above {near}; run from the folder the search ran "
                      f"in, or put the experiment file back")
