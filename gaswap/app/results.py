"""The results folder of a search: policy.yaml, policies/, front.csv, history.csv, summary.json; and who may
write it.

One process at a time writes a results folder `root/<name>`: it holds `root/.<name>.lock` (`locked`). The
folder is written whole into `root/.<name>.tmp-*`, renamed to `root/.<name>.new` (complete), the old folder
renamed to `root/.<name>.old`, the new one into place, and the old one removed. A process killed anywhere in
between leaves a state `recover` finishes on the next start: a complete `.new` rolls forward, else `.old`
rolls back; temporary files are removed. Experiment names cannot start with '.', so these names never collide
with another experiment's folder. Folders and files honour the umask.

A search stopped early writes the best results so far, marked `"complete": false` in summary.json, and keeps
its checkpoint (`.checkpoint.json`) in the folder. A folder made by another experiment is not replaced unless
`force` (`check_folder`). No torch here.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from gaswap.base import config
from gaswap.base.errors import BadInput, Refusal
from gaswap.base.files import UnreadableFile, read_text, umask, write_atomic
from gaswap.base.locate import experiment_file
from gaswap.plan import checkpoint as checkpoints
from gaswap.plan import policy as policies
from gaswap.plan.problem import GENERATION_FIELDS, Evaluated, SearchResult

FRONT_COLUMNS = ("policy", "peak_bytes", "step_time_s", "overhead", "keep", "swap", "recompute")
HISTORY_COLUMNS = GENERATION_FIELDS
# the allocator model's peaks beside the live one, in policies' `predicted` when the experiment has a `memory` key
MEMORY_COLUMNS = ("live_bytes", "allocated_bytes", "reserved_bytes")
# Bounds on what is read of a results folder (files beyond are refused unread): a search's summary.json is a
# few KB, its front.csv and history.csv grow by ~100 bytes a policy or a generation.
SUMMARY_BYTES, TABLE_BYTES = 16 * 2**20, 64 * 2**20


def overhead(e: Evaluated, keep_all: Evaluated) -> float:
    """Step time relative to keep-all, minus one (0.05 = 5 % slower)."""
    return e.step_time / keep_all.step_time - 1.0


def point(e: Evaluated, keep_all: Evaluated) -> dict:
    """Peak, time, overhead and action counts of one evaluated policy, as plain data."""
    return {"peak_bytes": e.peak_bytes, "step_time_s": e.step_time, "overhead": overhead(e, keep_all)} | e.counts()


def write(folder: str | Path, result: SearchResult, make_policy, summary: dict, *, carry=(), extra=None,
          finish=None) -> Path:
    """Write the results of `result` into `folder`, replacing what was there.

    `make_policy(evaluated)` turns a front point into a `Policy`; `summary` holds the experiment's
    description (experiment, device, cost source, budget, keep-all...), to which this adds the best policy,
    the seeds, the evaluations, the search time, whether the search ran to its end (`complete`,
    `generations_done`) and what stopped it (`stopped_by`: "generations", "evaluations", "seconds",
    "converged" or "interrupted"). Files named in `carry` (bench tables, a checkpoint) are copied from the
    old folder into the new; `extra` maps more file names to their text (costs.json); `finish(new_folder)` adds
    to the new folder, complete but not yet in place (figures drawn again), before it replaces the old one.
    """
    folder = Path(folder)
    keep_all = result.seeds["keep_all"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder):
        recover(folder)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes an owner-only folder
        _fill(tmp, folder, result, make_policy, summary, keep_all, carry, extra or {}, finish)
    return folder


def _fill(tmp: Path, folder: Path, result, make_policy, summary: dict, keep_all, carry, extra, finish) -> None:
    """Write the results into `tmp`, then replace `folder` by it."""
    try:
        rows = []
        for k, e in enumerate(result.front):
            name = f"policies/p{k:03d}.yaml"
            policies.save(policy := make_policy(e), tmp / name)
            rows.append({"policy": name} | point(e, keep_all) | _memory(policy))
        best = make_policy(result.best) if result.best is not None else None
        if best is not None:
            policies.save(best, tmp / "policy.yaml")
        memory = MEMORY_COLUMNS if any(MEMORY_COLUMNS[0] in row for row in rows) else ()
        _write_csv(tmp / "front.csv", FRONT_COLUMNS + memory, rows)
        _write_csv(tmp / "history.csv", HISTORY_COLUMNS, [asdict(g) for g in result.history])
        body = summary | {
            "best": (point(result.best, keep_all) | _memory(best) | {"policy": "policy.yaml"}) if best else None,
            "seeds": {name: point(e, keep_all) | {"valid": e.valid} for name, e in result.seeds.items()},
            "front_size": len(result.front),
            "evaluations": result.evaluations,
            "search_seconds": result.seconds,
            "complete": result.complete,
            "generations_done": result.generations_done,
            "stopped_by": result.stopped_by,
        }
        write_atomic(tmp / "summary.json", json.dumps(body, indent=2, default=_plain) + "\n")
        for name, text in extra.items():
            write_atomic(tmp / name, text)
        for name in carry:
            if (folder / name).is_file():
                shutil.copy2(folder / name, tmp / name)
        if finish is not None:
            finish(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(tmp, folder)


def _memory(policy: policies.Policy) -> dict:
    """The allocator model's peaks a policy's `predicted` holds (none without an experiment `memory` key)."""
    return {k: policy.predicted[k] for k in MEMORY_COLUMNS if k in policy.predicted}


def _write_csv(path: Path, columns, rows) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


def _aside(folder: Path, what: str) -> Path:
    """The hidden sibling `.<name>.<what>` of a results folder (new, old, lock)."""
    return folder.with_name(f".{folder.name}.{what}")


def _replace(tmp: Path, folder: Path) -> None:
    """Move the complete folder `tmp` to `folder` (see the module docstring; `recover` finishes a killed one)."""
    new, old = _aside(folder, "new"), _aside(folder, "old")
    shutil.rmtree(new, ignore_errors=True)
    tmp.rename(new)  # from here on, the new results win
    _roll_forward(new, folder, old)


def _roll_forward(new: Path, folder: Path, old: Path) -> None:
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def recover(folder: str | Path) -> str | None:
    """Finish a replacement of `folder` that a killed process left half done, and remove its temporary files
    and folders; call it holding the folder's lock. Returns what was done, or None."""
    folder = Path(folder)
    new, old = _aside(folder, "new"), _aside(folder, "old")
    done = None
    if new.is_dir():
        _roll_forward(new, folder, old)
        done = f"completed an interrupted replacement of {folder}/ (the new results were whole)"
    elif old.is_dir() and not folder.exists():
        old.rename(folder)
        done = f"restored {folder}/ from {old.name}, left by an interrupted replacement"
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    for stray in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    for stray in folder.glob(".*.tmp") if folder.is_dir() else ():
        stray.unlink(missing_ok=True)  # a file write_atomic had not finished (a checkpoint, a bench table)
    return done


_HELD: dict[Path, int] = {}  # lock files this process holds -> how many times (locks nest)


@contextmanager
def locked(folder: str | Path):
    """Hold `root/.<name>.lock` while writing the results folder `root/<name>`; `Refused` when another process
    holds it. Nested calls in one process share the lock; the file is removed when the lock is let go."""
    folder = Path(folder)
    path = _aside(folder, "lock").absolute()
    if path in _HELD:
        _HELD[path] += 1
        try:
            yield
        finally:
            _HELD[path] -= 1
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    f = _acquire(path, folder)
    _HELD[path] = 1
    try:
        yield
    finally:
        del _HELD[path]
        path.unlink(missing_ok=True)  # before the unlock: a process that opened it now finds it gone and retries
        f.close()


def _acquire(path: Path, folder: Path):
    """The lock file `path`, open and locked (exclusive, without waiting), holding this process's id."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        fcntl = None
    while True:
        f = open(path, "a+")  # an OSError names the path
        if fcntl is None:
            break
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise Refused(f"{folder}/ is being written by another gaswap process (pid {holder}; lock {path}); "
                          f"wait for it to finish, or choose another --results folder") from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break  # the file we locked is still the lock file
        except FileNotFoundError:
            pass
        f.close()  # its holder removed it as we locked it: lock the new one
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError as err:  # a full disk: no lock file left behind
        path.unlink(missing_ok=True)
        f.close()
        raise OSError(err.errno, err.strerror, str(path)) from None
    return f


# ------------------------------------------------------------------------------------------ ownership


class Refused(Refusal):
    """What is on disk forbids the command: another experiment's results folder, a folder another process is
    writing, or no checkpoint to resume."""


class ResultsError(BadInput, ValueError):
    """A folder that is not a readable gaswap results folder; str() is one line naming the file."""


def folder_of(root: str | Path, name: str) -> Path:
    """`root/<name>`, the results folder of the experiment called `name`."""
    return Path(root) / name


def check_folder(name: str, experiment_file: str, out: str | Path, *, resume: bool = False,
                 force: bool = False) -> None:
    """Refuse (`Refused`) to replace a folder holding another experiment's results or something that is not a
    gaswap results folder, unless `force`; with `resume`, refuse when there is no checkpoint to resume."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise Refused(f"{out} exists and is not a folder; move it away or choose another --results folder")
    if out.is_dir() and not force:
        owner = owner_of(out)
        if owner is None and any(p for p in out.iterdir() if not p.name.endswith(".tmp")):
            raise Refused(f"{out}/ exists but has no readable gaswap summary.json or checkpoint; use --force to "
                          f"replace it, or choose another --results folder")
        if owner is not None and not same_experiment(owner, name, experiment_file):
            raise Refused(f"{out}/ holds the results of experiment {owner[0]!r} ({owner[1] or 'file unknown'}), "
                          f"not of {name!r} ({experiment_file}); use --force to replace them, choose "
                          f"another --results folder, or give this experiment another `name:`")
    if resume and not (out / checkpoints.NAME).is_file():
        raise Refused(f"{out / checkpoints.NAME}: no checkpoint to resume from (no search of {name!r} "
                      f"was interrupted there, or it completed); run without --resume to start a search")


def owner_of(out: Path) -> tuple[str, str | None] | None:
    """(experiment, experiment file) of a results folder, from its summary.json or else its checkpoint."""
    try:
        summary = json.loads(read_text(out / "summary.json", SUMMARY_BYTES))
    except (OSError, ValueError):  # UnreadableFile is a ValueError
        summary = None
    if not (isinstance(summary, dict) and isinstance(summary.get("experiment"), str)):
        summary = checkpoints.about(out / checkpoints.NAME) if (out / checkpoints.NAME).is_file() else None
    if not (isinstance(summary, dict) and isinstance(summary.get("experiment"), str)):
        return None
    file = summary.get("experiment_file")
    return summary["experiment"], file if isinstance(file, str) else None


def same_experiment(owner: tuple[str, str | None], name: str, experiment_file: str) -> bool:
    """Whether a folder's owner (see `owner_of`) is the experiment `name` loaded from `experiment_file`."""
    owner_name, file = owner
    if owner_name != name:
        return False
    if file is None or file == experiment_file:
        return True
    try:
        return os.path.samefile(file, experiment_file)
    except OSError:
        return False


def discard_checkpoint(out: Path) -> None:
    """Remove the checkpoint of a search that found nothing, with partial results that hold no policy either
    (those of its own interrupted runs), or the folder the checkpoint alone made."""
    (out / checkpoints.NAME).unlink(missing_ok=True)
    try:
        summary = json.loads(read_text(out / "summary.json", SUMMARY_BYTES))
        partial = summary.get("complete") is False and summary.get("best") is None
    except (OSError, ValueError, AttributeError):
        partial = False
    if partial:
        shutil.rmtree(out, ignore_errors=True)
    elif out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _plain(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# ------------------------------------------------------------------------------------------ reading


SUMMARY_KEYS = {"experiment": str, "experiment_file": str, "budget_bytes": int, "keep_all": dict, "graph": dict,
                "seeds": dict, "generations_done": int}


def check_plottable(folder: str | Path, *, trust_factory: bool = False) -> None:
    """Refuse, in one line, a folder `plot` cannot draw: missing, not a folder, no results files, a broken
    summary.json (ResultsError); or one whose experiment builds its model with code outside gaswap's zoo,
    named only by these files, unless `trust_factory` (Refused). A folder a killed search left between its
    renames is recovered first (`recover`)."""
    # the zoo imports torch; reading a results folder does not need it
    from gaswap.zoo import shipped

    folder = Path(folder)
    if not folder.exists() and (_aside(folder, "new").is_dir() or _aside(folder, "old").is_dir()):
        with locked(folder):  # refused while a search replaces it; else finish what a killed one left
            recover(folder)
    if not folder.is_dir():
        raise ResultsError(f"{folder}: {'no such folder' if not folder.exists() else 'not a folder'}; "
                           f"give a results folder, e.g. results/alexnet_4gb")
    missing = [name for name in ("summary.json", "front.csv", "history.csv") if not (folder / name).is_file()]
    if missing:
        raise ResultsError(f"{folder}: not a gaswap results folder (no {', '.join(missing)}); run "
                           f"`python -m gaswap search EXPERIMENT` to make one")
    too_big = [name for name in ("front.csv", "history.csv") if (folder / name).stat().st_size > TABLE_BYTES]
    if too_big:
        raise ResultsError(f"{folder / too_big[0]}: more than the {TABLE_BYTES} bytes a results table may have")
    try:
        summary = json.loads(read_text(folder / "summary.json", SUMMARY_BYTES))
    except UnreadableFile as err:
        raise ResultsError(str(err)) from None
    except ValueError as err:
        raise ResultsError(f"{folder / 'summary.json'}: not valid JSON ({err})") from None
    if not isinstance(summary, dict):
        raise ResultsError(f"{folder / 'summary.json'}: must hold a JSON object")
    for key, kind in SUMMARY_KEYS.items():
        if not isinstance(summary.get(key), kind) or isinstance(summary.get(key), bool):
            raise ResultsError(f"{folder / 'summary.json'}: {key}: missing or not a {kind.__name__}")

    try:  # as report finds it: from here, or from a folder above the results (the one the search ran in)
        file = experiment_file(summary, folder / "summary.json", f"{folder / 'summary.json'}: experiment_file")
    except FileNotFoundError as err:
        raise ResultsError(f"{err} (the figures re-capture its model)") from None
    exp = config.load_experiment(file)
    if not shipped(exp.model.factory) and not trust_factory:
        raise Refused(f"{folder}: its experiment {file} builds the model with {exp.model.factory}, code named only "
                      f"by these results; if you trust it, pass --trust-factory")


FRONT_CHECKED = ("peak_bytes", "step_time_s")  # front.csv's figures that must be its policy's predicted ones


def check_front(folder: str | Path) -> None:
    """Refuse (`Refused`) a results folder whose front.csv does not add up with policies/ and summary.json: the
    rows must name exactly the policy files of policies/, as many as summary.json's front_size, each with its
    policy's predicted peak and step time; summary.json's best must be policy.yaml's prediction. Each policy
    file is read as `policy.load` reads one (bounded, checksum checked)."""
    folder = Path(folder)
    where = folder / "front.csv"
    try:
        rows = list(csv.DictReader(io.StringIO(read_text(where, TABLE_BYTES))))
        summary = json.loads(read_text(folder / "summary.json", SUMMARY_BYTES))
    except (UnreadableFile, ValueError, csv.Error) as err:
        raise Refused(f"{where}: not readable with its summary.json ({_first_line(err)})") from None
    names = [row.get("policy") for row in rows]
    held = sorted(f"policies/{p.name}" for p in (folder / "policies").glob("*.yaml"))
    if sorted(map(str, names)) != held or summary.get("front_size") not in (None, len(rows)):
        raise Refused(f"{where} lists {len(rows)} policies, {folder / 'policies'}/ holds {len(held)} and "
                      f"summary.json says {summary.get('front_size')}: {UNEVEN}")
    for k, row in enumerate(rows):
        predicted = policies.load(folder / row["policy"]).predicted
        wrong = [c for c in FRONT_CHECKED if _number(row.get(c)) != predicted.get(c)]
        if wrong:
            raise Refused(f"{where}: row {k + 1} ({row['policy']}): {wrong[0]} {_number(row.get(wrong[0]))}, but the "
                          f"policy predicts {predicted.get(wrong[0])}: {UNEVEN}")
    best = summary.get("best")
    if isinstance(best, dict) and (folder / "policy.yaml").is_file():
        predicted = policies.load(folder / "policy.yaml").predicted
        if any(best.get(c) != predicted.get(c) for c in FRONT_CHECKED):
            raise Refused(f"{folder / 'summary.json'}: best says {best.get('peak_bytes')} bytes and "
                          f"{best.get('step_time_s')} s, policy.yaml predicts {predicted.get('peak_bytes')} bytes and "
                          f"{predicted.get('step_time_s')} s: {UNEVEN}")


UNEVEN = "the folder was cut or edited; run the search again (or restore the folder)"


def _number(text):
    """A CSV cell as the number it holds (int when whole), or the text itself when it holds none."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return text
    return int(value) if value.is_integer() and "." not in str(text) and "e" not in str(text).lower() else value


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())[:200]
