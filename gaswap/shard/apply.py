"""A sharded plan (the plan.yaml `gaswap search` writes for an experiment with `distributed:`) applied where users
train: torch's own selective activation checkpointing inside FSDP2's `fully_shard`.

- `checkpoint_policy(plan)`: per FSDP unit, a `UnitPolicy`: "none", "full" (every op recomputed: plain
  non-reentrant checkpointing) or "selective", whose `policy_fn()` is a fresh policy function for
  `torch.utils.checkpoint.create_selective_checkpoint_contexts` (one per checkpointed forward: it counts calls)
  and whose `context_fn` is what `checkpoint(..., use_reentrant=False, context_fn=...)` takes.
- `shard(model, plan, mesh)`: all of it: each unit's forward checkpointed as the plan says, then `fully_shard`
  on every unit (innermost first, the root last) with the plan's `reshard_after_forward` per unit, its
  forward / backward prefetch depths (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`)
  and FSDP2's `CPUOffloadPolicy` on the units the plan offloads (`offload`: their parameters, gradients and
  optimizer state on the host).

How a plan's op names become SAC's decisions. The plan names, per class of identical blocks, the block's own
forward ops as the eager capture recorded them (`forward`: [name, aten target] in order; the names are the first
unit's fx node names, e.g. `mul_2`) and which of them it recomputes. SAC's policy_fn sees every aten call of the
checkpointed forward (views and other calls that make no new storage included, which the capture does not list
as ops) with its `func`. So the policy walks the plan's list with a cursor: a call whose target is one of the
block's op targets must be the next op of the list (else `PlanMismatch`, naming the unit, the position and both
targets: another model, another torch), and is recomputed (PREFER_RECOMPUTE) if that op is, else saved
(MUST_SAVE); a call of any other target (views, aliases) is recomputed, so that a saved view never holds a
recomputed tensor's storage. The k-th call of a target is thus the k-th op of that target in the list
(`op_calls` gives the mapping); tests/test_shard_apply.py checks on the tiny Llama that the eager capture's order
per block is the order SAC calls the policy in, and `shard`'s wrapper checks after each forward that the whole
list was walked.

A backward prefetch depth of 0 is refused too: FSDP2 prefetches the previous unit in the backward unless told to
prefetch others, and an empty list means its default (`FSDPState._pre_backward`).

Swapping activations (SAC's MUST_CPU_OFFLOAD) is refused: torch 2.13's eager SAC stores MUST_CPU_OFFLOAD's
outputs as it does recompute's (only MUST_SAVE / PREFER_SAVE are saved), so an offload decision would silently be a
recomputation.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gaswap.base.errors import Refusal
from gaswap.base.files import load_yaml
from gaswap.shard.tracker import apply_fsdp

MAX_PLAN_BYTES = 16 << 20
MODES = ("none", "full", "selective")


class PlanMismatch(Refusal):
    """A sharded plan made for another model, world size, unit layout or torch version, or one it cannot apply."""


@dataclass
class UnitPolicy:
    """One unit's checkpointing: `mode` "none", "full" or "selective"; `forward`, the block's own forward ops in
    order as (name, aten target); `recompute`, the names of those recomputed (selective)."""

    unit: str
    mode: str
    forward: tuple = ()
    recompute: frozenset = frozenset()
    walked: list = field(default_factory=list, repr=False)  # per forward of the unit: how far its policy got

    def policy_fn(self):
        """A fresh policy function (ctx, func, *args, **kwargs) -> CheckpointPolicy for one checkpointed forward of
        the unit (it counts the calls it sees)."""
        targets = {t for _, t in self.forward}
        state = {"at": 0}
        self.walked.append(state)
        del self.walked[:-1]

        def policy(ctx, func, *args, **kwargs):
            target = str(func)
            if target not in targets:
                return CheckpointPolicy.PREFER_RECOMPUTE
            at = state["at"]
            if at >= len(self.forward):
                raise PlanMismatch(f"{self.unit}: its forward calls {target} after the plan's last op "
                                   f"({len(self.forward)} ops): not the model the plan was made for")
            name, expected = self.forward[at]
            if target != expected:
                raise PlanMismatch(f"{self.unit}: op {at} of its forward is {target}, the plan's is {name} "
                                   f"({expected}): not the model (or torch) the plan was made for")
            state["at"] = at + 1
            return CheckpointPolicy.PREFER_RECOMPUTE if name in self.recompute else CheckpointPolicy.MUST_SAVE

        return policy

    def context_fn(self):
        """`checkpoint(..., use_reentrant=False, context_fn=policy.context_fn)`'s contexts (selective mode)."""
        return create_selective_checkpoint_contexts(self.policy_fn())

    def check_walked(self) -> None:
        """After a checkpointed forward: PlanMismatch unless it called every op of the plan's list."""
        if self.walked and self.walked[-1]["at"] != len(self.forward):
            at = self.walked[-1]["at"]
            name, target = self.forward[at]
            raise PlanMismatch(f"{self.unit}: its forward ended after {at} of the plan's {len(self.forward)} ops; "
                               f"the plan's next is {name} ({target}): not the model the plan was made for")


def op_calls(forward) -> dict[str, tuple[str, int]]:
    """{op name: (aten target, k)}: the op is the k-th call (from 0) of its target in the block's forward."""
    seen, out = Counter(), {}
    for name, target in forward:
        out[name] = (target, seen[target])
        seen[target] += 1
    return out


def read_plan(plan) -> dict:
    """The plan as data: a dict as given, or a plan.yaml path read with gaswap's safe YAML reader (no code run);
    PlanMismatch for a file that lacks what applying needs (written before plans carried it)."""
    data = plan if isinstance(plan, dict) else load_yaml(Path(plan), MAX_PLAN_BYTES)
    where = "the plan" if isinstance(plan, dict) else str(plan)
    if not isinstance(data, dict):
        raise PlanMismatch(f"{where}: not a mapping")
    missing = [k for k in ("world_size", "torch", "units", "recompute", "reshard_after_forward_false",
                           "forward_prefetch", "backward_prefetch") if k not in data]
    missing += [f"recompute[{i}].{k}" for i, c in enumerate(data.get("recompute") or [])
                for k in ("unit_paths", "forward", "recompute") if k not in c]
    if missing:
        raise PlanMismatch(f"{where}: lacks {', '.join(missing)} (a plan.yaml from before `gaswap search` wrote "
                           f"what applying needs: search again)")
    return data


def checkpoint_policy(plan) -> dict[str, UnitPolicy]:
    """{unit path: UnitPolicy} for every unit of a block class in `plan` (a plan.yaml path or its data)."""
    data = read_plan(plan)
    out = {}
    for i, cls in enumerate(data["recompute"]):
        forward = tuple((str(n), str(t)) for n, t in cls["forward"])
        if cls.get("swap"):
            raise PlanMismatch(f"recompute[{i}] ({cls['units']}): swaps {', '.join(cls['swap'])} to the CPU; "
                               f"torch {torch.__version__}'s eager selective checkpointing treats MUST_CPU_OFFLOAD "
                               f"as a recomputation, so a swap cannot be applied")
        chosen = cls["recompute"]
        if chosen in ("full", "none"):
            mode, names = chosen, frozenset()
        elif isinstance(chosen, list):
            names = frozenset(map(str, chosen))
            unknown = sorted(names - {n for n, _ in forward})
            if unknown:
                raise PlanMismatch(f"recompute[{i}] ({cls['units']}): recomputes {', '.join(unknown)}, which its "
                                   f"block's forward does not have")
            mode = "selective" if names else "none"
        else:
            raise PlanMismatch(f"recompute[{i}] ({cls['units']}): recompute is {chosen!r}, not 'full', 'none' or "
                               f"a list of op names")
        for unit in cls["unit_paths"]:
            out[str(unit)] = UnitPolicy(str(unit), mode, forward, names)
    return out


def check(model: nn.Module, plan, mesh) -> dict:
    """The plan's data, or PlanMismatch (one line) naming what differs: torch version, world size, unit paths."""
    data = read_plan(plan)
    if str(data["torch"]) != str(torch.__version__):
        raise PlanMismatch(f"the plan was made with torch {data['torch']}, this is torch {torch.__version__}: "
                           f"its op names and order may differ; search again with this torch")
    if int(data["backward_prefetch"]) < 1:
        raise PlanMismatch(f"the plan's backward_prefetch is {data['backward_prefetch']}: torch {torch.__version__}'s "
                           f"fully_shard cannot turn backward prefetch off (an empty set_modules_to_backward_prefetch "
                           f"list means its default, 1)")
    world = mesh.size()
    if int(data["world_size"]) != world:
        raise PlanMismatch(f"the plan is for {data['world_size']} ranks, the mesh has {world}")
    modules = dict(model.named_modules())
    named = [str(u) for u in data["units"]] + [str(u) for c in data["recompute"] for u in c["unit_paths"]]
    named += [str(u) for u in data["reshard_after_forward_false"]]
    named += [str(u) for u in data.get("reshard_after_forward_groups") or {}]
    named += [str(u) for u in data.get("offload") or ()]
    absent = [u for u in dict.fromkeys(named) if u not in modules]
    if absent:
        raise PlanMismatch(f"the plan's unit(s) {', '.join(absent)} are not modules of this "
                           f"{type(model).__name__}: not the model the plan was made for")
    return data


def _selective_contexts(policy: UnitPolicy):
    return policy.context_fn()


def _checkpointed(forward, policy: UnitPolicy, *args, **kwargs):
    """The unit's forward under torch's checkpoint. Under torch.compile (a unit compiled with `module.compile()`)
    the policy sees the ops once, when the graph is traced (a wrong op is refused then), and the check that the
    forward walked the whole list is left out: it would run at trace time, before the policy is called."""
    if policy.mode == "full":
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # a partial of a plain function: dynamo calls a bound method's function without its `self`
    contexts = functools.partial(_selective_contexts, policy)
    out = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        policy.check_walked()
    return out


def shard(model: nn.Module, plan, mesh) -> nn.Module:
    """Apply `plan` (a plan.yaml path or its data) to `model` (on its device, not yet sharded) over `mesh` (1-D,
    the plan's world size): each unit's forward checkpointed as the plan says (torch.utils.checkpoint,
    non-reentrant; selective through `checkpoint_policy`), then `fully_shard` per unit with the plan's
    reshard_after_forward, prefetch depths and CPU offload (`offload`: the units given CPUOffloadPolicy). Returns
    `model`, sharded in place."""
    data = check(model, plan, mesh)
    modules = dict(model.named_modules())
    for unit, policy in checkpoint_policy(data).items():
        if policy.mode != "none":
            m = modules[unit]
            m.forward = functools.partial(_checkpointed, m.forward, policy)
    units = [str(u) for u in data["units"]]
    kept = {str(u) for u in data["reshard_after_forward_false"]}
    groups = {str(u): int(k) for u, k in (data.get("reshard_after_forward_groups") or {}).items()}
    reshard = {u: groups.get(u, u not in kept) for u in units if u} | {"": False}
    return apply_fsdp(model, units, mesh, reshard_after_forward=reshard,
                      forward_prefetch=int(data["forward_prefetch"]), backward_prefetch=int(data["backward_prefetch"]),
                      offload={str(u) for u in data.get("offload") or ()})
