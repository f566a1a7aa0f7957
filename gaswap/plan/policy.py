"""Versioned policy files: the op order and one action per activation, by stable names. No torch here.

A policy file is data: loading one runs no code (safe YAML types only, no aliases, bounded size, known keys
and types checked). It names the graph it was made for by fingerprint; using it for another graph is refused,
and so is a policy whose content does not hold together for its graph (`check_content`): an order that is not
the graph's ops, actions for tensors the graph lacks, a program that reads a tensor it dropped, never frees
what it made, disagrees with the actions or holds more memory than the policy predicts.

The `checksum` is an unkeyed sha256 of the content: it detects a file cut short or damaged, not a deliberate
edit (anyone can recompute it). It is not a signature; the content checks above are what make a handed
policy safe to run.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gaswap.base.errors import Refusal
from gaswap.base.files import UnreadableFile, load_yaml, write_atomic
from gaswap.base.program import Action, ProgramSyntaxError, parse_program
from gaswap.plan.graph import Graph, specialization_differences
from gaswap.plan.memory import allocator
from gaswap.plan.walker import Hooks, ProgramFault, Walker

VERSION = 1
MAX_BYTES = 16 * 2**20  # a 2,000-op graph makes a 95 KB policy (0.5 s to parse); larger files are refused unread
KEYS = ("gaswap_policy", "fingerprint", "order", "actions", "predicted", "provenance", "program", "checksum")
LABELS = tuple(a.label for a in Action)


class PolicyError(Refusal, ValueError):
    """A policy file that is unreadable, of another version, or made for another graph."""


@dataclass(frozen=True)
class Policy:
    """What a training step does: run `order`, and treat each listed activation as `actions` says."""

    fingerprint: str
    order: tuple[str, ...]
    actions: dict[str, str]  # candidate tensor name -> "keep" | "swap" | "recompute"
    predicted: dict = field(default_factory=dict)  # peak_bytes, step_time_s, overhead
    provenance: dict = field(default_factory=dict)  # experiment, model, inputs, device, cost source, ...
    program: tuple[tuple[str, str], ...] = ()  # the simulated step as the runtime replays it (verb, name)

    def counts(self) -> dict[str, int]:
        return {a.name.lower(): sum(1 for v in self.actions.values() if v == a.name.lower()) for a in Action}

    def order_indices(self, graph: Graph) -> list[int]:
        index = graph.op_index()
        return [index[name] for name in self.order]

    def action_codes(self, candidates: list[str]) -> tuple[int, ...]:
        return tuple(int(Action.parse(self.actions[t])) for t in candidates)


def from_result(graph: Graph, candidates: list[str], order: list[int], actions, predicted: dict,
                provenance: dict, program=()) -> Policy:
    """A policy from a decoded order (op indices), actions aligned with `candidates`, and the program
    (`SimResult.program` of a traced simulation) the runtime replays."""
    return Policy(
        fingerprint=graph.fingerprint(),
        order=tuple(graph.ops[i].name for i in order),
        actions={t: Action(a).name.lower() for t, a in zip(candidates, actions)},
        predicted=dict(predicted),
        provenance=dict(provenance) | ({"specialized": [list(s) for s in graph.specialized]} if graph.specialized else {}),
        program=tuple(program),
    )


def save(policy: Policy, path: str | Path) -> None:
    """Write the policy as YAML, atomically (a reader never sees half a file)."""
    body = {"gaswap_policy": VERSION} | asdict(policy)
    body["order"] = list(policy.order)
    body["program"] = [f"{verb} {name}" for verb, name in policy.program]
    body["checksum"] = _checksum(body)  # last key: a file cut anywhere fails the check
    write_atomic(path, yaml.safe_dump(body, sort_keys=False, width=120))


def _checksum(body: dict) -> str:
    """sha256 of the policy's content (everything but the checksum itself), canonical JSON."""
    content = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


def load(path: str | Path, graph: Graph | None = None) -> Policy:
    """Read a policy file, checking its form, checksum and types; with `graph`, also that it fits that graph."""
    path = Path(path)
    try:
        body = load_yaml(path, MAX_BYTES)
    except UnreadableFile as err:
        raise PolicyError(f"{err} (not a readable policy file)") from None
    if not isinstance(body, dict) or "gaswap_policy" not in body:
        raise PolicyError(f"{path}: not a gaswap policy file (no 'gaswap_policy' version key)")
    if body["gaswap_policy"] != VERSION:
        raise PolicyError(f"{path}: policy version {body['gaswap_policy']!r}, this gaswap reads version {VERSION}")
    unknown = [str(k) for k in body if k not in KEYS]
    if unknown:
        raise PolicyError(f"{path}: unknown key {unknown[0]!r} (a policy has {', '.join(KEYS)})")
    missing = [k for k in ("fingerprint", "order", "actions", "predicted", "program", "checksum") if k not in body]
    if missing:
        raise PolicyError(f"{path}: missing {', '.join(missing)} (truncated file?)")
    if body["checksum"] != _checksum(body):
        raise PolicyError(f"{path}: checksum mismatch: the file was cut, damaged or edited after it was written")
    _check_types(body, path)
    try:
        program = parse_program(body["program"] or ())
    except ProgramSyntaxError as err:
        raise PolicyError(f"{path}: program: {err}") from None
    policy = Policy(body["fingerprint"], tuple(body["order"]), dict(body["actions"]), dict(body["predicted"]),
                    dict(body.get("provenance") or {}), tuple(program))
    if graph is not None:
        check_matches(policy, graph, path)
    return policy


def _check_types(body: dict, path: Path) -> None:
    """PolicyError naming the first key whose value has the wrong type."""
    def names(value):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    predicted = body["predicted"]
    problems = {
        "fingerprint": "must be a string" if not isinstance(body["fingerprint"], str) else None,
        "order": "must be a list of op names" if not names(body["order"]) else None,
        "actions": (f"must map tensor names to {', '.join(LABELS)}" if not isinstance(body["actions"], dict) or not
                    all(isinstance(k, str) and v in LABELS for k, v in body["actions"].items()) else None),
        "predicted": ("must be a mapping whose peak_bytes and step_time_s are positive numbers" if not
                      isinstance(predicted, dict) or not all(_positive(predicted[k]) for k in
                                                             ("peak_bytes", "step_time_s") if k in predicted) else None),
        "provenance": "must be a mapping" if not isinstance(body.get("provenance") or {}, dict) else
        _margin_problem((body.get("provenance") or {}).get("device_margin")),
        "program": "must be a list of 'verb name' lines" if not names(body["program"] or []) else None,
    }
    for key, problem in problems.items():
        if problem:
            raise PolicyError(f"{path}: {key}: {problem}")


MARGIN_BYTES = ("workspace_bytes", "transient_bytes", "margin_bytes", "kept_bytes")


def _margin_problem(margin) -> str | None:
    """What is wrong with a recorded `device_margin`, or None (none recorded: a policy searched before it was)."""
    if margin is None:
        return None
    if not isinstance(margin, dict) or not all(_count(margin.get(k)) for k in MARGIN_BYTES):
        return f"device_margin: must be a mapping whose {', '.join(MARGIN_BYTES)} are byte counts"
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def kept_margin(policy: Policy) -> int:
    """The bytes its search kept under the budget for what the device holds beyond the graph's tensors (cuBLAS's
    workspace, an op's transients: `gaswap.run.workspace.margin`); 0 when none was kept or none is recorded."""
    return (policy.provenance.get("device_margin") or {}).get("kept_bytes", 0)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


PROVENANCE_CHECKED = ("model", "inputs", "target", "batch_size", "loss", "optimizer", "torch_version")


def check_matches(policy: Policy, graph: Graph, path: str | Path = "policy", provenance: dict | None = None,
                  torch_version: str | None = None) -> None:
    """Refuse (PolicyError) a policy made for another graph or another torch release, saying what differs (from
    `provenance`, the description of the model and inputs at hand, when given; else from the graphs), and a
    policy whose content does not fit its graph (`check_content`)."""
    if torch_version is not None:
        check_release(policy, path, torch_version)
    if said := specialization_differences(policy.provenance.get("specialized"), graph):
        raise PolicyError(f"{path}: {said}")
    if policy.fingerprint != graph.fingerprint():
        raise PolicyError(f"{path}: made for graph {policy.fingerprint}, but this model and inputs give graph "
                          f"{graph.fingerprint()}: {differences(policy, graph, provenance)}. Re-run the search for "
                          f"this model, shapes and dtype.")
    check_content(policy, graph, path)


def check_release(policy: Policy, path: str | Path, torch_version: str) -> None:
    """Refuse (PolicyError) a policy made with another torch release than `torch_version` (one that names none
    passes)."""
    made_with = policy.provenance.get("torch_version")
    if made_with is not None and _release(made_with) != _release(torch_version):
        raise PolicyError(f"{path}: made with torch {made_with}, this is torch {torch_version}: captured graphs "
                          f"and kernels differ between releases; re-run the search with this torch")


def _release(version: str) -> str:
    """"2.13.0+cu121" -> "2.13.0"."""
    return str(version).split("+")[0]


def differences(policy: Policy, graph: Graph, provenance: dict | None = None) -> str:
    """What differs between the graph a policy was made for and `graph`, in words."""
    said = []
    provenance = provenance or {}
    for key in PROVENANCE_CHECKED:
        if key in provenance and key != "torch_version" and policy.provenance.get(key) != provenance[key]:
            said.append(f"{key}: policy {_short(policy.provenance.get(key))}, here {_short(provenance[key])}")
    said += _input_differences(policy, provenance.get("input_shapes"))
    ops = {op.name for op in graph.ops}
    mine = set(policy.order)
    if ops - mine or mine - ops:
        lacks, extra = sorted(mine - ops)[:3], sorted(ops - mine)[:3]
        said.append(f"the policy orders {len(policy.order)} ops, this graph has {len(graph.ops)}"
                    + (f"; ops it names that this graph lacks: {', '.join(lacks)}" if lacks else "")
                    + (f"; ops of this graph it lacks: {', '.join(extra)}" if extra else ""))
    candidates = set(graph.candidates())
    if set(policy.actions) != candidates:
        gone = sorted(set(policy.actions) - candidates)[:3]
        new = sorted(candidates - set(policy.actions))[:3]
        said.append(f"activations it decides for that this graph lacks: {', '.join(gone)}" if gone else
                    f"this graph has activations it does not decide for: {', '.join(new)}")
    if not said:  # same op and tensor names: sizes or shapes changed
        model = policy.provenance.get("model")
        made_for = f"; the policy was made for {_short(model)}" if isinstance(model, dict) else ""
        said.append(f"the same ops and activations with other tensor sizes (a layer's width or the number of "
                    f"classes?){made_for}")
    return "; ".join(said)


def _input_differences(policy: Policy, here) -> list[str]:
    """How `here`, [(shape, dtype)] of the example inputs at hand, differ from the inputs the policy was made for."""
    specs, batch = policy.provenance.get("inputs"), policy.provenance.get("batch_size")
    if not isinstance(here, list) or not isinstance(specs, list) or not isinstance(batch, int):
        return []
    if len(here) != len(specs):
        return [f"the policy takes {len(specs)} inputs, here {len(here)}"]
    said = []
    for k, (spec, (shape, dtype)) in enumerate(zip(specs, here)):
        if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
            continue
        wanted = [batch if d == "batch" else d for d in spec["shape"]], spec.get("dtype", "float32")
        if wanted != (list(shape), dtype):
            said.append(f"input {k}: policy {wanted[0]} {wanted[1]} (batch size {batch}), here {list(shape)} {dtype}")
    return said


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_content(policy: Policy, graph: Graph, path: str | Path = "policy") -> None:
    """Refuse (PolicyError) a policy of this graph whose content does not hold together: its order must run
    every op once after the ops it reads from, its actions must cover exactly the graph's candidates, and
    replaying its program must find every tensor where it is read, free what it made, swap exactly the
    tensors marked swap, recompute those marked recompute, keep those marked keep, and never hold more
    memory than the policy predicts."""
    problem = _order_problem(policy, graph) or _actions_problem(policy, graph) or _program_problem(policy, graph)
    if problem:
        raise PolicyError(f"{path}: {problem}; the file was edited, or made by another gaswap: re-run the search")


def _order_problem(policy: Policy, graph: Graph) -> str | None:
    index = graph.op_index()
    if sorted(policy.order) != sorted(index):
        return "order: does not list every op of the graph exactly once"
    done = set()
    for name in policy.order:
        op = graph.ops[index[name]]
        producers = [graph.tensors[t].producer for t in op.inputs]
        early = [t for t, p in zip(op.inputs, producers) if p is not None and p not in done]
        if early:
            return f"order: {name} comes before {graph.tensors[early[0]].producer}, which makes its input {early[0]}"
        done.add(name)
    return None


def _actions_problem(policy: Policy, graph: Graph) -> str | None:
    candidates = graph.candidates()
    unknown = [t for t in policy.actions if t not in set(candidates)]
    if unknown:
        return f"actions: {unknown[0]!r} is not an activation of this graph that a policy decides"
    missing = [t for t in candidates if t not in policy.actions]
    return f"actions: no action for {missing[0]!r}" if missing else None


def _program_problem(policy: Policy, graph: Graph) -> str | None:
    """Replay the program on names and sizes only (a `Walker`): the first thing wrong with it, or None."""
    if not policy.program:
        return None  # an old policy without a program: the runtime refuses it with its own message
    uses = _Uses()
    try:
        walked = Walker(graph, uses).walk(policy.program)
    except ProgramFault as err:
        return str(err)
    return _runs_problem(policy, graph, walked) or _actions_vs_program(policy.actions, uses) or \
        _predicted_problem(policy, graph, walked.peak)


class _Uses(Hooks):
    """What the policy check needs of a program beyond the walker's state: the tensors it swaps out and
    recomputes, the line of each tensor's first free and of its last read by a run."""

    def __init__(self):
        self.swapped, self.remade = set(), set()
        self.freed_at, self.last_read = {}, {}

    def on_run(self, k: int, op, made: list[str]) -> None:
        self.last_read.update((t, k + 1) for t in op.inputs)

    def on_recompute(self, k: int, op, made: list[str]) -> None:
        self.remade.update(made)

    def on_swap_out(self, k: int, tensor: str) -> None:
        self.swapped.add(tensor)

    def on_free(self, k: int, tensor: str, retired: bool) -> None:
        self.freed_at.setdefault(tensor, k + 1)


def _runs_problem(policy: Policy, graph: Graph, walked: Walker) -> str | None:
    """The program runs the policy's order, and frees what it made."""
    if walked.ran != list(policy.order):
        if sorted(walked.ran) == sorted(op.name for op in graph.ops):
            return "program: runs the ops in another order than the policy's order"
        return f"program: does not run every op (it runs {len(walked.ran)} of {len(graph.ops)})"
    left = walked.unfreed()
    if left:
        return f"program: never frees {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} (frees removed?)"
    return None


def _actions_vs_program(action: dict[str, str], uses: _Uses) -> str | None:
    """The program swaps out exactly the tensors marked swap, recomputes those marked recompute, and frees
    none marked keep before its last read."""
    for t in sorted(set(action) | uses.swapped):
        if (action.get(t) == "swap") != (t in uses.swapped):
            return (f"actions: {t} is {action.get(t, 'not a candidate')!r}, but the program "
                    f"{'swaps it out' if t in uses.swapped else 'never swaps it out'}")
        if action[t] == "recompute" and t not in uses.remade:
            return f"actions: {t} is 'recompute', but the program never recomputes it"
        if action[t] == "keep" and uses.freed_at.get(t, math.inf) < uses.last_read.get(t, 0):
            return (f"actions: {t} is 'keep', but the program frees it at line {uses.freed_at[t]}, before it is "
                    f"read at line {uses.last_read[t]}")
    return None


def _predicted_problem(policy: Policy, graph: Graph, live: int) -> str | None:
    """The figures a policy predicts agree with its program: the live peak is the replay's (`live`), to the
    byte; with an experiment `memory` key, the allocated and reserved peaks are the allocator model's replay
    of the program; the peak is the live or the reserved one; the action counts are the actions'; the
    overhead is above -100 %."""
    predicted = policy.predicted
    said = {"live_bytes": predicted.get("live_bytes", predicted.get("peak_bytes"))}
    expected = {"live_bytes": live}
    memory = policy.provenance.get("memory")
    if "reserved_bytes" in predicted or "allocated_bytes" in predicted:
        if not isinstance(memory, dict):
            return "predicted: allocator peaks without the experiment's `memory` key in its provenance"
        peaks = allocator.replay(graph, policy, steps=2, expandable_segments=bool(memory.get("expandable_segments")),
                                 optimizer=policy.provenance.get("optimizer"))
        said |= {k: predicted.get(k) for k in ("allocated_bytes", "reserved_bytes")}
        expected |= {"allocated_bytes": peaks.allocated, "reserved_bytes": peaks.reserved}
    for key, value in said.items():
        if value != expected[key]:
            return (f"predicted: {key.replace('_bytes', ' peak')} {_short(value)} bytes, but replaying its program "
                    f"gives {expected[key]} bytes")
    if predicted.get("peak_bytes") not in (expected["live_bytes"], expected.get("reserved_bytes")):
        return f"predicted: peak_bytes {_short(predicted.get('peak_bytes'))} is neither its live nor its reserved peak"
    counts = policy.counts()
    wrong = [a for a in counts if a in predicted and predicted[a] != counts[a]]
    if wrong:
        return f"predicted: {wrong[0]} {_short(predicted[wrong[0]])}, but its actions {wrong[0]} {counts[wrong[0]]}"
    overhead = predicted.get("overhead", 0.0)
    if not (isinstance(overhead, (int, float)) and not isinstance(overhead, bool) and -1 < overhead < math.inf):
        return f"predicted: overhead {_short(overhead)} is no step-time overhead (a number above -1)"
    return None
