"""Versioned policy files: the op order and one action per activation, by stable names. No torch here.

A policy names the graph it was made for by fingerprint; loading it for another graph is refused.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from gaswap.encoding import Action
from gaswap.files import write_atomic
from gaswap.graph import Graph

VERSION = 1


class PolicyError(ValueError):
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
        provenance=dict(provenance),
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
    """Read a policy file; with `graph`, also check that it was made for that graph."""
    path = Path(path)
    try:
        body = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PolicyError(f"{path}: no such policy file") from None
    except yaml.YAMLError as err:
        raise PolicyError(f"{path}: not a readable policy file (corrupted or truncated?): {err}") from None
    if not isinstance(body, dict) or "gaswap_policy" not in body:
        raise PolicyError(f"{path}: not a gaswap policy file (no 'gaswap_policy' version key)")
    if body["gaswap_policy"] != VERSION:
        raise PolicyError(f"{path}: policy version {body['gaswap_policy']!r}, this gaswap reads version {VERSION}")
    missing = [k for k in ("fingerprint", "order", "actions", "checksum") if k not in body]
    if missing:
        raise PolicyError(f"{path}: missing {', '.join(missing)} (truncated file?)")
    if body["checksum"] != _checksum(body):
        raise PolicyError(f"{path}: checksum mismatch: the file was cut or edited after it was written")
    if not isinstance(body["order"], list) or not isinstance(body["actions"], dict) or any(
            v not in ("keep", "swap", "recompute") for v in body["actions"].values()):
        raise PolicyError(f"{path}: 'order' must be a list of op names and 'actions' map tensors to "
                          f"keep, swap or recompute")
    try:
        program = tuple(tuple(step.split(" ", 1)) for step in body.get("program") or ())
    except AttributeError:
        raise PolicyError(f"{path}: 'program' must be a list of 'verb name' lines") from None
    policy = Policy(str(body["fingerprint"]), tuple(body["order"]), dict(body["actions"]),
                    dict(body.get("predicted") or {}), dict(body.get("provenance") or {}), program)
    if graph is not None:
        check_matches(policy, graph, path)
    return policy


PROVENANCE_CHECKED = ("model", "inputs", "target", "batch_size", "loss", "optimizer", "torch_version")


def check_matches(policy: Policy, graph: Graph, path: str | Path = "policy", provenance: dict | None = None) -> None:
    """Refuse a policy made for another graph, saying what differs (from `provenance`, the description
    of the model and inputs at hand, when given; else from the graphs)."""
    if policy.fingerprint == graph.fingerprint():
        return
    ops = {op.name for op in graph.ops}
    unknown = [n for n in policy.order if n not in ops][:3]
    detail = f"; ops it names that this graph lacks: {', '.join(unknown)}" if unknown else ""
    if len(policy.order) != len(graph.ops):
        detail += f"; it orders {len(policy.order)} ops, this graph has {len(graph.ops)}"
    for key in PROVENANCE_CHECKED if provenance else ():
        if policy.provenance.get(key) != provenance.get(key):
            detail += f"; {key}: policy {policy.provenance.get(key)!r}, here {provenance.get(key)!r}"
    raise PolicyError(
        f"{path}: made for graph {policy.fingerprint}, but this model and inputs give graph "
        f"{graph.fingerprint()}{detail}. Re-run the search for this model, shapes and dtype."
    )
