"""Search checkpoints: the state of an NSGA-II search between two generations, as JSON. No torch here.

A search writes `results/<experiment>/.checkpoint.json` after its initial population, then at most every
`search.CHECKPOINT_SECONDS` and when it leaves between two generations (see `gaswap.plan.search.search`), atomically (temporary file, fsync, os.replace): a reader finds the previous checkpoint or the new
one, never half of one. The file is one JSON object and carries no code (no pickle):

    {"format": "gaswap-checkpoint", "version": 2, "sha256": <digest of "state">,
     "about": {...}, "fingerprint": {...}, "state": {...}}

- `about`: what the checkpoint belongs to (experiment name and file), for messages and folder ownership;
- `fingerprint`: one short hash per part of the configuration that shapes the search's trajectory (graph,
  costs, search space, GA settings, budget, seed, seed policies; see `fingerprint`). Resuming under another
  configuration is refused, naming the parts that differ. The limits (`ga.generations`, `ga.max_evaluations`,
  `ga.max_seconds`) and `ga.workers` are left out: a
  search may be resumed with more generations or another number of workers and still reach what an
  uninterrupted run with those settings reaches;
- `state`: what the search loop carries from one generation to the next (written and read by
  `gaswap.plan.search`): generation, evaluations, seconds, smallest_peak, rng
  (`random.Random.getstate()`), population (keys, actions, step time, peak, valid, crowding distance, in
  selection order), archive (keys, actions, step time, peak, valid, in insertion order), fastest (the same,
  fastest first; a checkpoint without it, written before it was kept, still reads), seeds and history.
  Keys are base64 strings of little-endian float64s, actions strings of digits (0 keep, 1 swap, 2 recompute).

Version 2: the population was selected under constraint-domination (`gaswap.plan.search.select`). Version 1
holds the same fields, but its population was selected, ordered and given crowding distances by the earlier
rule (over-budget policies ranked as 1e9 + violation); continued under today's rule it would reach neither
search's result, so it is refused (exit 4) with a message saying so.

Other floats are written as Python's json module writes them (shortest round-tripping repr, `Infinity` for
the step time of invalid policies), so a state reads back bit for bit. The sha256 of the canonical state
text catches corruption that still parses.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

from gaswap.base.errors import Refusal
from gaswap.base.files import MiB, UnreadableFile, read_text, write_atomic

FORMAT, VERSION = "gaswap-checkpoint", 2
# Versions this gaswap refuses, with why (read() says it).
OLDER = {1: "it was written by a search that ranked over-budget policies as 1e9 + violation, before selection "
            "by constraint-domination; its population cannot be continued under the new rule"}
NAME = ".checkpoint.json"  # inside the results folder of the experiment
# Parts of the fingerprint, in the order messages name them, with what to say when one differs.
PARTS = {
    "graph": "the captured graph (model, inputs, batch size, loss, optimizer or counted memory changed?)",
    "costs": "the op and copy costs (costs re-measured, or another cost source or profile?)",
    "search_space": "the search space",
    "ga": "the GA settings (population, cx_prob, mut_prob, patience or tolerance)",
    "budget": "the budget",
    "seed": "the seed",
    "seed_policies": "the seed policies",
}
STATE_KEYS = ("generation", "evaluations", "seconds", "smallest_peak", "rng",
              "population", "archive", "seeds", "history")
COUNTS = ("generation", "evaluations", "seconds", "smallest_peak")  # numbers that are never negative
MAX_BYTES = 256 * MiB  # a 4,500-op search's checkpoint is a few MB


class CheckpointError(Refusal, ValueError):
    """A checkpoint that is missing, unreadable, corrupted, of another version or of another configuration."""


def _digest(value) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:16]


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def fingerprint(graph, costs, space, ga, budget: int, seed: int, seeds: dict) -> dict[str, object]:
    """What a search's trajectory depends on: one short hash (or value) per part of PARTS.

    `seeds` maps names to the seed chromosomes (`keys`, `actions`). Only what the simulator and the GA read
    is hashed: the space's and settings' names and descriptions, `ga.generations` and `ga.workers` are not.
    """
    settings = asdict(ga)
    space_fields = asdict(space)
    return {
        "graph": _digest(graph.to_dict()),
        "costs": _digest({"op_time": costs.op_time, "d2h": costs.d2h_bandwidth, "h2d": costs.h2d_bandwidth,
                          "latency": costs.copy_latency, "copies_overlap": costs.copies_overlap}),
        "search_space": _digest({k: v for k, v in space_fields.items() if k not in ("name", "description")}),
        "ga": _digest({k: settings[k] for k in ("population", "cx_prob", "mut_prob", "patience", "tolerance")}),
        "budget": int(budget),
        "seed": int(seed),
        "seed_policies": _digest({name: [list(c.keys), list(c.actions)] for name, c in seeds.items()}),
    }


def save(path: str | Path, state: dict, fingerprint: dict, about: dict | None = None) -> None:
    """Write a checkpoint atomically: a temporary file in the same folder, fsync, then os.replace."""
    path = Path(path)
    state_text = _canonical(state)  # serialized once: big states take a while
    header = {"format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(state_text.encode()).hexdigest(),
              "about": about or {}, "fingerprint": fingerprint}
    text = json.dumps(header, separators=(",", ":"))[:-1] + ',"state":' + state_text + "}\n"
    write_atomic(path, text)


def read(path: str | Path) -> dict:
    """The whole checkpoint body, checked for format, version and integrity (not for configuration)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no checkpoint to resume from")
    try:
        text = read_text(path, MAX_BYTES)
    except UnreadableFile as err:
        raise CheckpointError(f"cannot read the checkpoint: {err}") from None
    try:
        body = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupted?): {err}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a gaswap checkpoint (no format {FORMAT!r})")
    if body.get("version") != VERSION:
        why = OLDER.get(body.get("version"))
        why = f" ({why})" if why else ""
        raise CheckpointError(f"{path}: checkpoint version {body.get('version')!r}, this gaswap reads version "
                              f"{VERSION}{why}; start the search afresh (without --resume)")
    state = body.get("state")
    if not isinstance(state, dict) or hashlib.sha256(_canonical(state).encode()).hexdigest() != body.get("sha256"):
        raise CheckpointError(f"{path}: corrupted checkpoint (its contents do not match their checksum)")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing or not isinstance(body.get("fingerprint"), dict) or not isinstance(body.get("about"), dict):
        raise CheckpointError(f"{path}: malformed checkpoint (missing {', '.join(missing) or 'fingerprint or about'})")
    negative = [k for k in COUNTS if not _count(state[k])]
    if negative:
        raise CheckpointError(f"{path}: malformed checkpoint ({', '.join(negative)} must be a number >= 0)")
    return body


def _count(value) -> bool:
    """A finite number >= 0 (booleans are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


EDITED = ("the checkpoint was edited (its checksum detects corruption, not edits); start the search afresh "
          "(without --resume)")
FEASIBLE = ("archive", "fastest")  # groups of points that fit the budget by construction


def check_points(groups: dict[str, list], allowed, evaluate, budget: int | None, path) -> None:
    """Refuse (CheckpointError) restored points (`Evaluated`, by group name) that do not add up: a key that is
    not finite, an action gene the search space does not allow for its candidate (`allowed`, per candidate),
    an archive or fastest point over the budget, or a stored step time, peak or validity other than what
    `evaluate` (a list of chromosomes -> their `Evaluated`, the simulator now) gives. Each distinct chromosome
    is simulated once."""
    for group, points in groups.items():
        for k, e in enumerate(points):
            problem = _gene_problem(e.chromosome, allowed) or (
                "over the budget" if group in FEASIBLE and budget is not None and not e.feasible(budget) else None)
            if problem:
                raise CheckpointError(f"{path}: {group} point {k}: {problem}; {EDITED}")
    distinct = list(dict.fromkeys(e.chromosome for points in groups.values() for e in points))
    now = dict(zip(distinct, evaluate(distinct)))
    for group, points in groups.items():
        for k, e in enumerate(points):
            n = now[e.chromosome]
            if (e.step_time, e.peak_bytes, e.valid) != (n.step_time, n.peak_bytes, n.valid):
                raise CheckpointError(
                    f"{path}: {group} point {k} says step time {e.step_time:.6g} s and peak {e.peak_bytes} bytes"
                    f"{'' if e.valid else ' (invalid)'}, but the simulator gives {n.step_time:.6g} s and "
                    f"{n.peak_bytes} bytes{'' if n.valid else ' (invalid)'}; {EDITED}")


def _gene_problem(chromosome, allowed) -> str | None:
    """What is out of range in a chromosome: a key that is not a finite number, or a disallowed action."""
    if not all(math.isfinite(key) for key in chromosome.keys):
        return "an order key is not a finite number"
    for k, (action, ok) in enumerate(zip(chromosome.actions, allowed)):
        if action not in ok:
            return (f"action gene {k} is {action}, but this search space allows "
                    f"{', '.join(f'{int(a)} ({a.name.lower()})' for a in ok)} there")
    return None


def load(path: str | Path, fingerprint: dict) -> dict:
    """The state of a checkpoint made under `fingerprint`; otherwise CheckpointError naming what differs."""
    body = read(path)
    theirs = body["fingerprint"]
    differ = [part for part in PARTS if theirs.get(part) != fingerprint.get(part)]
    if differ:
        made_by = body["about"].get("experiment_file") or body["about"].get("experiment")
        by = f" (made by {made_by})" if made_by else ""
        raise CheckpointError(
            f"{path}: this checkpoint{by} was made under another configuration; what differs: "
            f"{'; '.join(PARTS[part] for part in differ)}. Start the search afresh (without --resume) to replace it."
        )
    return body["state"]


def about(path: str | Path) -> dict | None:
    """What a checkpoint says it belongs to, or None when it cannot be read (never raises)."""
    try:
        body = json.loads(read_text(path, MAX_BYTES))
    except (OSError, ValueError):  # UnreadableFile is a ValueError
        return None
    ok = isinstance(body, dict) and body.get("format") == FORMAT and isinstance(body.get("about"), dict)
    return body["about"] if ok else None
