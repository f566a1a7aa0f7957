"""Kill `gaswap search` and `gaswap plot` with SIGKILL at the moments they write, and check what is left.

    python scripts/sigkill_writes.py [--work DIR] [--every K]

A first `search` + `plot` of a tiny MLP (estimated costs) makes a results folder holding its four figures.
Then one child process per write point runs `search` again on a copy of that folder (or `plot` of it) and
SIGKILLs itself just before the point: every `os.replace`, `os.rename`, `os.fsync` and `shutil.rmtree` the
command makes, in order (a counting run lists them). After each kill the folder must be whole once the next
gaswap run has recovered it (`results.recover`, under the lock): summary.json, front.csv and the policies add
up (`results.check_front`), all four figures are there and are whole PNGs, and nothing temporary is left.

`tests/test_hostile_files.py` runs a few of these points; this script runs all of them (or every K-th). It
prints one line per point and a count; exit 1 if any point left a broken folder.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = """\
model: {factory: gaswap.zoo:mlp, kwargs: {sizes: [8, 16, 16, 4]}}
inputs: [{shape: [batch, 8]}]
target: {shape: [batch], dtype: int64, high: 4}
loss: cross_entropy
batch_size: 4
budget: 2x
costs: {source: estimate, profile: v100-pcie-16gb}
ga: {population: 8, generations: 3}
"""
FIGURES = ("pareto.png", "convergence.png", "memory_timeline.png", "action_map.png")
PNG_START, PNG_END = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


def child(kill_at: str, log: str, argv: list[str]) -> int:
    """Run gaswap's CLI with `argv`, recording each write point in `log` (JSON lines), and SIGKILL this process
    just before the point numbered `kill_at` (-1: never), or before the first whose "function what" holds the
    text after "match:" (e.g. "match:rename .exp.new")."""
    count = [0]

    def hooked(name, original):
        def wrapper(*args, **kwargs):
            what = _fd_path(args[0]) if name == "fsync" else " -> ".join(map(str, args[:2]))
            with open(log, "a") as f:
                f.write(json.dumps([count[0], name, what]) + "\n")
            if str(count[0]) == kill_at or (kill_at.startswith("match:") and kill_at[6:] in f"{name} {what}"):
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return original(*args, **kwargs)
        return wrapper

    for name in ("replace", "rename", "fsync"):
        setattr(os, name, hooked(name, getattr(os, name)))
    shutil.rmtree = hooked("rmtree", shutil.rmtree)
    sys.path.insert(0, str(ROOT))
    from gaswap.app.cli import main

    return main(argv)


def _fd_path(fd) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
    except OSError:
        return "?"


def run_child(kill_at: int | str, log: Path, argv: list[str], cwd: Path) -> int:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(kill_at), str(log), "--", *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=600).returncode


def points(log: Path) -> list[tuple[int, str, str]]:
    """The write points a child recorded: (number, function, what)."""
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()] if log.is_file() else []


def check(folder: Path, figures=FIGURES) -> list[str]:
    """What is wrong with a results folder after a kill, once recovered as the next gaswap run recovers it."""
    sys.path.insert(0, str(ROOT))
    from gaswap.app import results

    with results.locked(folder):
        results.recover(folder)
    problems = []
    if not folder.is_dir():
        return [f"{folder} is gone"]
    try:
        results.check_front(folder)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        problems.append(f"results do not add up: {err}")
    for name in figures:
        data = (folder / name).read_bytes() if (folder / name).is_file() else b""
        if not (data.startswith(PNG_START) and data.endswith(PNG_END)):
            problems.append(f"{name}: {'missing' if not data else f'broken ({len(data)} bytes)'}")
    left = [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]
    left += [p.name for p in folder.rglob("*.tmp")]
    if left:
        problems.append(f"left behind: {', '.join(sorted(left))}")
    return problems


def prepare(work: Path) -> Path:
    """A results folder with its figures, made by an uninterrupted search and plot; returns the folder."""
    (work / "exp.yaml").write_text(EXPERIMENT)
    log = work / "first.log"
    for argv in (["search", "exp.yaml", "--results", "reference"], ["plot", "reference/exp"]):
        if run_child(-1, log, argv, work) != 0:
            raise SystemExit(f"the uninterrupted {argv[0]} failed")
    return work / "reference" / "exp"


def kill_at(work: Path, reference: Path, verb: str, k: int | str) -> list[str]:
    """Copy the reference folder, run `verb` on it killed at write point `k` (see `child`); what is wrong
    afterwards."""
    root = work / f"{verb}-{''.join(c if c.isalnum() else '_' for c in str(k))}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(reference, root / "exp")
    argv = ["search", "exp.yaml", "--results", root.name] if verb == "search" else ["plot", f"{root.name}/exp"]
    code = run_child(k, root.with_suffix(".log"), argv, work)
    if code != -signal.SIGKILL:
        return [f"not killed (exit {code})"]
    return check(root / "exp")


def write_points(work: Path, reference: Path, verb: str) -> list[tuple[int, str, str]]:
    """The write points of `verb` on a copy of the reference folder, from an uninterrupted counting run."""
    root = work / f"{verb}-count"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(reference, root / "exp")
    log = root.with_suffix(".log")
    log.unlink(missing_ok=True)
    argv = ["search", "exp.yaml", "--results", root.name] if verb == "search" else ["plot", f"{root.name}/exp"]
    if run_child(-1, log, argv, work) != 0:
        raise SystemExit(f"the counting {verb} failed")
    return points(log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="working folder (default: a new temporary one)")
    parser.add_argument("--every", type=int, default=1, help="kill at every K-th write point (default 1: all)")
    parser.add_argument("--child", nargs=2, metavar=("KILL_AT", "LOG"), help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.rest)
    work = Path(args.work or tempfile.mkdtemp(prefix="gaswap-sigkill-"))
    work.mkdir(parents=True, exist_ok=True)
    reference = prepare(work)
    broken = total = 0
    for verb in ("search", "plot"):
        for k, name, what in write_points(work, reference, verb)[::args.every]:
            problems = kill_at(work, reference, verb, k)
            total += 1
            broken += bool(problems)
            print(f"{verb} killed before write point {k} ({name} {what}): {'; '.join(problems) or 'whole'}",
                  flush=True)
    print(f"{total} SIGKILLs, {broken} left a broken folder (work folder {work})")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
