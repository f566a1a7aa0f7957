"""A sharded plan (`gaswap search` of an experiment with `distributed:`, results/<exp>/plan.yaml) as torchtitan's
job configuration, where torchtitan can express it, and one line per thing it cannot.

Read at `TORCHTITAN_COMMIT` (torchtitan/trainer.py `Trainer.Config`, torchtitan/config/configs.py,
torchtitan/distributed/activation_checkpoint.py and fsdp.py). At that commit a run is configured by a Python
function returning `Trainer.Config` (the TOML job files went in 9810191bb); the sections below name its fields,
which `--section.option` flags still set, in the section/key layout the TOML files had:

- `[activation_checkpoint] mode`: the policy subcommand, "none" | "full" | "selective" (`SelectiveAC`, per-op:
  `torchtitan_saves`) | "memory-budget" (compiled only; gaswap never plans it). There is no per-layer
  selective option at that commit (`selective_ac_option = "k"`, full AC on every k-th block, was removed in
  114151ad4), so a plan of full AC on every k-th block is listed as not expressible.
- `[parallelism] data_parallel_shard_degree`, `data_parallel_replicate_degree` (HSDP), `fsdp_reshard_after_forward`
  ("default": reshard every block, keep norm/output gathered, without pipeline parallelism; "always"; "never"):
  one setting for every block, booleans only.
- `[training] mixed_precision_param` ("bfloat16" | "float32"), `mixed_precision_reduce` ("float32" only),
  `enable_cpu_offload`.

torchtitan sets no FSDP prefetch for dense blocks (FSDP2's own: forward 0, backward 1), and applies AC and FSDP
to each child of `model.layers`. A plan's unset key is left out, so torchtitan's default applies there; the
statements say which. Torch-free.
"""
from __future__ import annotations

import re

from gaswap.plan.shard_search import TORCHTITAN_COMMIT, torchtitan_saves

ROOT = ""
BLOCK = re.compile(r"layers\.(\d+)")
FSDP2_PREFETCH = (0, 1)  # forward, backward: FSDP2's defaults, which torchtitan leaves alone for dense blocks
PARAM_DTYPES = ("bfloat16", "float32")
REDUCE_DTYPES = ("float32",)


def _names(units) -> str:
    units = list(units)
    return ", ".join(units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")


def per_unit_recompute(plan: dict) -> dict:
    """Unit path -> "none" | "full" | frozenset of recomputed op names, and unit path -> its forward's torchtitan
    SAC recompute set (the names `torchtitan_saves` does not save)."""
    choice, titan = {}, {}
    for entry in plan.get("recompute", []):
        rec = entry["recompute"]
        rec = rec if isinstance(rec, str) else frozenset(rec) or "none"
        forward = entry.get("forward", [])
        sac = frozenset(name for (name, _), saved in zip(forward, torchtitan_saves([t for _, t in forward]))
                        if not saved)
        for u in entry.get("unit_paths", []):
            choice[u], titan[u] = rec, sac
    return choice, titan


def _activation_checkpoint(plan: dict, blocks: list, missing: list) -> dict:
    choice, titan = per_unit_recompute(plan)
    per = {u: choice.get(u, "none") for u in blocks}
    outside = sorted(u for u, c in choice.items() if u not in per and c != "none")
    if outside:
        missing.append(f"recompute in {_names(outside)}: torchtitan checkpoints only the blocks of `model.layers`")
        return {}
    values = set(per.values())
    if not per or values == {"none"}:
        return {"mode": "none"}
    if values == {"full"}:
        return {"mode": "full"}
    if all(isinstance(c, frozenset) and c == titan[u] for u, c in per.items()):
        return {"mode": "selective"}
    full = [i for i, u in enumerate(blocks) if per[u] == "full"]
    if values == {"full", "none"}:
        k = full[0] + 1
        if full == list(range(k - 1, len(blocks), k)):
            missing.append(f"full AC on every {k}th block, the others none: torchtitan's per-layer selective AC "
                           f"(`selective_ac_option = \"{k}\"`) was removed in 114151ad4 and is not at "
                           f"{TORCHTITAN_COMMIT[:9]}; [activation_checkpoint] left out (torchtitan's default: "
                           f"selective, per-op)")
            return {}
    shown = sorted({c if isinstance(c, str) else f"{len(c)} op(s) ({', '.join(sorted(c)[:4])}"
                    f"{', ...' if len(c) > 4 else ''})" for c in per.values()})
    missing.append(f"recompute sets {'; '.join(shown)}: not none, full, torchtitan's per-op save list "
                   f"(selective) on every block, nor full on every k-th block; [activation_checkpoint] left out "
                   f"(torchtitan's default: selective, per-op)")
    return {}


def _reshard(plan: dict, blocks: list, missing: list) -> str | None:
    gathered = set(plan.get("reshard_after_forward_false", []))
    groups = dict(plan.get("reshard_after_forward_groups", {}) or {})
    if groups:
        by_k = {}
        for u, k in groups.items():
            by_k.setdefault(k, []).append(u)
        for k, units in sorted(by_k.items()):
            missing.append(f"reshard to {k} ranks after the forward (FSDP2 `reshard_after_forward={k}`) on "
                           f"{_names(units)}: torchtitan's fsdp_reshard_after_forward takes booleans only")
    kept = [u for u in blocks if u in gathered]
    if groups or (kept and len(kept) < len(blocks)):
        if kept and len(kept) < len(blocks):
            missing.append(f"per-unit reshard: {_names(kept)} kept gathered after the forward, the other "
                           f"{len(blocks) - len(kept)} block(s) not: torchtitan's fsdp_reshard_after_forward is "
                           f"one setting for every block")
        missing.append("[parallelism] fsdp_reshard_after_forward left out (torchtitan's \"default\": every "
                       "block resharded)")
        return None
    return "never" if kept else "default"


def job_config(plan: dict, experiment_distributed: dict) -> tuple[dict, list[str]]:
    """torchtitan's job configuration for `plan` (plan.yaml, as a dict) and the experiment's `distributed:`
    (`asdict(DistributedSpec)`): ({section: {key: value}}, [one line per thing torchtitan cannot express])."""
    d = experiment_distributed
    missing: list[str] = []
    units = [u for u in plan.get("units", []) if u != ROOT]
    blocks = sorted((u for u in units if BLOCK.fullmatch(u)), key=lambda u: int(BLOCK.fullmatch(u)[1]))
    others = [u for u in units if not BLOCK.fullmatch(u)]
    if others:
        missing.append(f"FSDP units {_names(others)}: torchtitan shards each block of `model.layers` (plus "
                       f"embeddings, norm/output and the root), not other modules")
    if d.get("strategy", "fsdp") != "fsdp":
        missing.append(f"strategy {d['strategy']!r}: torchtitan's data parallelism is FSDP2, HSDP or DDP")
    out: dict = {}
    ac = _activation_checkpoint(plan, blocks, missing)
    if ac:
        out["activation_checkpoint"] = ac
    mesh = d.get("mesh")
    world = d.get("world_size", plan.get("world_size"))
    replicate, shard = (mesh[0], mesh[1]) if mesh else (1, world)
    par = {"data_parallel_shard_degree": shard, "data_parallel_replicate_degree": replicate}
    raf = _reshard(plan, blocks, missing)
    if raf is not None:
        par["fsdp_reshard_after_forward"] = raf
    out["parallelism"] = par
    fwd, bwd = plan.get("forward_prefetch", FSDP2_PREFETCH[0]), plan.get("backward_prefetch", FSDP2_PREFETCH[1])
    if fwd != FSDP2_PREFETCH[0]:
        missing.append(f"forward prefetch of {fwd} unit(s) (`set_modules_to_forward_prefetch`): torchtitan has no "
                       f"prefetch option; FSDP2's default ({FSDP2_PREFETCH[0]}) applies")
    if bwd != FSDP2_PREFETCH[1]:
        missing.append(f"backward prefetch of {bwd} unit(s) (`set_modules_to_backward_prefetch`): torchtitan has "
                       f"no prefetch option; FSDP2's default ({FSDP2_PREFETCH[1]}) applies")
    mp = d.get("mixed_precision") or {}
    training = {}
    # None: the parameters' own dtype; torchtitan's parameters are float32, so "float32" is no cast
    param, reduce = mp.get("param_dtype") or "float32", mp.get("reduce_dtype") or "float32"
    if param in PARAM_DTYPES:
        training["mixed_precision_param"] = param
    else:
        missing.append(f"mixed precision param_dtype {param}: torchtitan takes {' or '.join(PARAM_DTYPES)}")
    if reduce in REDUCE_DTYPES:
        training["mixed_precision_reduce"] = reduce
    else:
        missing.append(f"mixed precision reduce_dtype {reduce}: torchtitan takes {' or '.join(REDUCE_DTYPES)}")
    offloaded = plan.get("offload", [])
    if d.get("offload") is True or (offloaded and set(offloaded) >= set(units) | {ROOT}):
        training["enable_cpu_offload"] = True
    elif offloaded:
        missing.append(f"CPU offload of {_names(offloaded)} only: torchtitan's enable_cpu_offload offloads every "
                       f"unit or none")
    out["training"] = training
    return out, missing


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(sections: dict, missing: list[str], experiment: str = "") -> str:
    """torchtitan.toml: what torchtitan cannot express as comments at the top, then the sections."""
    lines = [f"# torchtitan job configuration for gaswap's plan{f' of {experiment}' if experiment else ''} "
             f"(plan.yaml), torchtitan at {TORCHTITAN_COMMIT}:",
             "# Trainer.Config fields in the TOML layout; a key left out takes torchtitan's default.",
             "# What the plan does that torchtitan's configuration cannot express:" if missing else
             "# torchtitan's configuration expresses the whole plan."]
    lines += [f"# - {m}" for m in missing]
    for name, keys in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"
