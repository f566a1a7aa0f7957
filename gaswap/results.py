"""The results folder of a search: policy.yaml, policies/, front.csv, history.csv, summary.json.

The folder is written whole into a temporary sibling and then renamed into place, so an interrupted
write never leaves half a result beside a whole one. A search stopped early writes the best results so far,
marked `"complete": false` in summary.json, and keeps its checkpoint (`.checkpoint.json`) in the folder.
No torch here.
"""
from __future__ import annotations

import csv
import io
import json
import shutil
import tempfile
from pathlib import Path

from gaswap import policy as policies
from gaswap.search import Evaluated, SearchResult

FRONT_COLUMNS = ("policy", "peak_bytes", "step_time_s", "overhead", "keep", "swap", "recompute")
HISTORY_COLUMNS = ("generation", "evaluations", "best_time_s", "front_size", "hypervolume", "seconds")


def overhead(e: Evaluated, keep_all: Evaluated) -> float:
    """Step time relative to keep-all, minus one (0.05 = 5 % slower)."""
    return e.step_time / keep_all.step_time - 1.0


def point(e: Evaluated, keep_all: Evaluated) -> dict:
    """Peak, time, overhead and action counts of one evaluated policy, as plain data."""
    return {"peak_bytes": e.peak_bytes, "step_time_s": e.step_time, "overhead": overhead(e, keep_all)} | e.counts()


def write(folder: str | Path, result: SearchResult, make_policy, summary: dict, *, carry=(), extra=None) -> Path:
    """Write the results of `result` into `folder`, replacing what was there.

    `make_policy(evaluated)` turns a front point into a `Policy`; `summary` holds the experiment's
    description (experiment, device, cost source, budget, keep-all...), to which this adds the best policy,
    the seeds, the evaluations, the search time and whether the search ran to its end (`complete`,
    `generations_done`). Files named in `carry` (bench tables, a checkpoint) are copied from the old folder into the new;
    `extra` maps more file names to their text (costs.json).
    """
    folder = Path(folder)
    keep_all = result.seeds["keep_all"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        rows = []
        for k, e in enumerate(result.front):
            name = f"policies/p{k:03d}.yaml"
            policies.save(make_policy(e), tmp / name)
            rows.append({"policy": name} | point(e, keep_all))
        if result.best is not None:
            policies.save(make_policy(result.best), tmp / "policy.yaml")
        _write_csv(tmp / "front.csv", FRONT_COLUMNS, rows)
        _write_csv(tmp / "history.csv", HISTORY_COLUMNS, result.history)
        body = summary | {
            "best": (point(result.best, keep_all) | {"policy": "policy.yaml"}) if result.best else None,
            "seeds": {name: point(e, keep_all) | {"valid": e.valid} for name, e in result.seeds.items()},
            "front_size": len(result.front),
            "evaluations": result.evaluations,
            "search_seconds": result.seconds,
            "complete": result.complete,
            "generations_done": result.generations_done,
        }
        (tmp / "summary.json").write_text(json.dumps(body, indent=2, default=_plain) + "\n")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        for name in carry:
            if (folder / name).is_file():
                shutil.copy2(folder / name, tmp / name)
        _replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _write_csv(path: Path, columns, rows) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(out.getvalue())


def _replace(new: Path, folder: Path) -> None:
    """Move `new` to `folder`; an old folder is moved aside first and removed once the new one is in place."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    new.rename(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _plain(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
