"""`gaswap shard-compare EXPERIMENT`: one rank of a sharded run, gaswap's plans against the checkpointing choices
people use today, each expressed as a gaswap plan (`Knobs`) and evaluated by the same `ShardProblem` (the
simulator's per-rank peak, `sharding.step_time`'s predicted step time), at world sizes 8, 64 and 256:

- no AC; full AC on every block (torchtitan `mode: full`, plain `checkpoint` per block);
- torchtitan's per-op selective AC as its code does it (torchtitan/distributed/activation_checkpoint.py,
  `SelectiveAC`, at TORCHTITAN_COMMIT): the outputs of torch's compute-intensive ops (mm, addmm, bmm, SDPA
  variants, ...) and of `aten.max.default` / `linear` / `topk` saved, the rest recomputed, and of the mm / linear
  calls of a block every second one (the 2nd, 4th, ...) recomputed too;
- torchtitan's per-layer AC every 2 layers (`selective_ac_option: "2"`, `_apply_layer_sac` before torchtitan
  removed it in 114151ad4): full AC on the 2nd, 4th, ... block, the others kept;
- where the experiment searches CPU offload (`distributed.offload: search`): full AC with every unit offloaded
  (torchtitan's `training.enable_cpu_offload`);
- torch's `sac_milp` (torch.distributed._tools.sac_ilp, `gaswap.shard.sac_milp`) at each budget below: which
  blocks to checkpoint and how much of each to discard, then which ops, fed gaswap's statistics and given its
  best chance (the fastest of its plans under the budget); skipped, and said, where pulp or pwlf is missing;
- gaswap's search (`shard_search.search`), once per peer's per-rank peak used as the budget, once halfway between
  each two consecutive peaks (where only the lower peer fits) and once below the lowest of them; at each budget,
  the fastest plan the searches at that world size evaluated under it, and what first proposed it (a seed, the
  budget's fill, a random plan or the GA); and again restricted to the plans with the experiment's reshard and
  prefetch settings (the peers' own), which isolates what gaswap's recompute (and offload) choices gain.

With `--gloo` (a small model only), each method's plan at the experiment's world size is also applied with
`gaswap.shard.apply.shard` and run under gloo (`gaswap.shard.gloo.run_gloo`): each rank's measured peak and CPU
time per step, against the peak predicted for that run (its loss is `sum`, the model's own dtype).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import random
import statistics
import time

from gaswap.app import results
from gaswap.app.shard_plan import memory, prepare, recompute_groups, write_folder
from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.plan.shard_search import TORCHTITAN_COMMIT, Knobs, Point, ShardProblem, link_for, peak_bytes, search
from gaswap.plan.sharding import memory_report, shard_step
from gaswap.shard import sac_milp

WORLD_SIZES = (8, 64, 256)
PEERS = ("no AC", "full AC", "torchtitan SAC", "torchtitan AC every 2")
SAC_MILP = "torch sac_milp"
SAME_KNOBS = "gaswap, peers' FSDP knobs"  # gaswap's plans with the experiment's reshard and prefetch settings
OFFLOAD_PEER = "full AC + CPU offload"  # torchtitan's training.enable_cpu_offload, where the experiment searches offload
SAC_NOTE = ("torch sac_milp: torch's MILP and per-module op choice, fed gaswap's per-op times and sizes; at each "
            "budget the fastest of its plans (its `memory_budget` argument bisected) whose peak, by gaswap's "
            "simulator, is under the budget.")


def method_knobs(problem: ShardProblem, method: str) -> Knobs:
    """A peer's checkpointing as gaswap knobs, with the experiment's reshard and prefetch settings."""
    base = problem.decode(problem.seed("keep_all"))
    recompute = {}
    if method in ("full AC", OFFLOAD_PEER):
        recompute = {u: "full" for u in problem.units if u in problem.owned}
        if method == OFFLOAD_PEER:
            return dataclasses.replace(base, recompute=recompute, offload=tuple(problem.offload_order))
    elif method == "torchtitan AC every 2":
        recompute = {u: "full" for i, u in enumerate(problem.units) if (i + 1) % 2 == 0 and u in problem.owned}
    elif method == "torchtitan SAC":
        return problem.decode(problem.seed("selective_ac"))
    elif method != "no AC":
        raise ValueError(f"unknown method {method!r}: one of {', '.join(PEERS + (OFFLOAD_PEER,))}")
    return dataclasses.replace(base, recompute=recompute)


def evaluate(problem: ShardProblem, knobs: Knobs) -> Point:
    """`knobs` through the problem's rank graph, simulator and step time (per-unit choices need no genes)."""
    rank = problem.rank(knobs)
    return Point(peak_bytes(rank), problem.time(rank), knobs, ())


def method_plan(problem: ShardProblem, knobs: Knobs, torch_version: str, name: str) -> dict:
    """The plan dict `gaswap.shard.apply.shard` reads for `knobs` (per-layer AC splits a class in two)."""
    return {"method": name, "world_size": problem.spec.world_size, "torch": torch_version,
            "units": list(problem.units) + [""], "recompute": recompute_groups(problem, knobs),
            "reshard_after_forward_false": [u for u in problem.units if not knobs.reshard.get(u, True)],
            "forward_prefetch": knobs.forward_prefetch, "backward_prefetch": knobs.backward_prefetch,
            "offload": list(knobs.offload)}


def at_world_size(problem: ShardProblem, world_size: int, profile, link_name: str | None) -> ShardProblem:
    _, link = link_for(profile, world_size, link_name)
    return ShardProblem(problem.graph, problem.params, dataclasses.replace(problem.spec, world_size=world_size),
                        problem.op_time, link, 0, problem.copy_bandwidth, host_link=problem.host_link,
                        host_step=problem.host_step)


def compare(problem: ShardProblem, exp: config.Experiment, *, reserved: bool = True) -> list[dict]:
    """Rows for one world size: each peer, then torch's sac_milp and gaswap at each peer's peak as the budget,
    halfway between consecutive peaks, and below the lowest."""
    rows, peers = [], {}
    for name in PEERS + ((OFFLOAD_PEER,) if problem.offload_order else ()):
        p = evaluate(problem, method_knobs(problem, name))
        peers[name] = p
        rows.append(_row(problem, exp, name, p, None, reserved))
    peaks = sorted({p.peak for p in peers.values()}, reverse=True)
    below = min(peaks) - 1
    labels = {b: "at " + " / ".join(n for n, p in peers.items() if p.peak == b) + "'s peak" for b in peaks}
    for high, low in zip(peaks, peaks[1:]):  # halfway between two peers' peaks: the lower peer fits there
        labels[(high + low) // 2] = f"halfway, {format_size(low)} to {format_size(high)}"
    labels[below] = "below every peer"
    budgets = sorted(labels, reverse=True)[:-1]
    if sac_milp.available() is None:
        for budget in budgets + [below]:
            knobs, _ = sac_milp.plan(problem, budget)
            rows.append(_row(problem, exp, f"{SAC_MILP} ({labels[budget]})", knobs and evaluate(problem, knobs),
                             budget, reserved))
    seconds = 0.0
    for budget in budgets + [below]:
        problem.budget = budget
        result = search(problem, random.Random(exp.seed), population=exp.ga.population,
                        generations=exp.ga.generations, cx_prob=exp.ga.cx_prob, mut_prob=exp.ga.mut_prob,
                        max_seconds=exp.ga.max_seconds)
        seconds += result.seconds
    evaluated = list(problem.cache.values())
    spec = _fsdp(method_knobs(problem, "no AC"))
    for name, plans in (("gaswap", evaluated), (SAME_KNOBS, [p for p in evaluated if _fsdp(p.knobs) == spec])):
        for budget in budgets + [below]:
            under = [p for p in plans if p.peak <= budget]
            best = min(under, key=lambda p: (p.step_time, p.peak)) if under else None
            row = _row(problem, exp, f"{name} ({labels[budget]})", best, budget, reserved)
            same = [n for n, q in peers.items() if best is not None and q.knobs == best.knobs]
            if same:  # the search was seeded with the peers' plans: say when its pick is one of them
                row["recompute"] += f" (= {same[0]}'s plan)"
            rows.append(row)
    for r in rows:
        r["search_cpu_s"] = seconds
        r["plans_evaluated"] = len(evaluated)
    return rows


def _fsdp(knobs: Knobs) -> tuple:
    """The reshard and prefetch settings of `knobs`."""
    return knobs.reshard, knobs.forward_prefetch, knobs.backward_prefetch


def _row(problem, exp, name, p: Point | None, budget, reserved: bool) -> dict:
    row = {"world_size": problem.spec.world_size, "method": name, "budget_bytes": budget,
           "peak_bytes": p.peak if p else None, "reserved_bytes": None, "step_time_s": p.step_time if p else None,
           "recompute": _describe(problem, p.knobs) if p else "nothing fits",
           "reshard_after_forward_false": sum(not p.knobs.reshard.get(u, True) for u in problem.units) if p else None,
           "prefetch": f"{p.knobs.forward_prefetch}/{p.knobs.backward_prefetch}" if p else None,
           "found_by": (p.origin or "-") if p and name.startswith("gaswap") else None}
    if p and reserved:
        row["reserved_bytes"] = memory(problem, p, exp.optimizer)["reserved_bytes"]
    return row


def _describe(problem: ShardProblem, knobs: Knobs) -> str:
    full = sum(knobs.recompute.get(u) == "full" for u in problem.units)
    partial = [len(c) for u, c in knobs.recompute.items() if c != "full"]
    parts = []
    if full:
        parts.append(f"{full} blocks full")
    if partial:
        parts.append(f"{len(partial)} blocks {min(partial)}-{max(partial)} ops")
    if knobs.offload:
        parts.append(f"{len(knobs.offload)} units offloaded")
    return ", ".join(parts) or "none"


def verdicts(rows: list[dict]) -> list[str]:
    """Per world size: at each budget above the lowest peer's peak, gaswap's time against the best peer's that fits
    there (sac_milp's plans included), also with the peers' FSDP knobs only; below the lowest peer, whether gaswap
    fits."""
    out = []
    for w in dict.fromkeys(r["world_size"] for r in rows):
        mine = [r for r in rows if r["world_size"] == w]
        peers = [r for r in mine if not r["method"].startswith("gaswap")]
        ours = [r for r in mine if r["method"].startswith("gaswap (")]
        restricted = [r for r in mine if r["method"].startswith(SAME_KNOBS)]
        wins, same = (sum(_wins(g, peers) for g in rs[:-1]) for rs in (ours, restricted))
        below = ours[-1]
        out.append(f"W={w}: at {wins} of {len(ours) - 1} budgets gaswap's step time is at or below the best "
                   f"fitting peer's ({same} of {len(restricted) - 1} with the peers' FSDP knobs); below every "
                   f"peer's peak ({format_size(below['budget_bytes'])}): "
                   + (f"gaswap fits at {format_size(below['peak_bytes'])}, {below['step_time_s'] * 1e3:.1f} ms"
                      if below["peak_bytes"] is not None else "gaswap finds no plan either"))
    return out


def _wins(g: dict, peers: list[dict]) -> bool:
    """Whether gaswap's row `g` is at or below the fastest of `peers` under its budget."""
    fitting = [r for r in peers if r["peak_bytes"] is not None and r["peak_bytes"] <= g["budget_bytes"]]
    best = min(fitting, key=lambda r: r["step_time_s"])
    return g["step_time_s"] is not None and g["step_time_s"] <= best["step_time_s"]


def table(rows: list[dict]) -> str:
    lines = [("| W | method | budget | peak (live) | reserved | step time | recompute | RAF false | prefetch f/b | "
              "found by |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        size = lambda n: format_size(n) if n is not None else "-"  # noqa: E731
        t = f"{r['step_time_s'] * 1e3:.2f} ms" if r["step_time_s"] is not None else "-"
        lines.append(f"| {r['world_size']} | {r['method']} | {size(r['budget_bytes'])} | {size(r['peak_bytes'])} | "
                     f"{size(r['reserved_bytes'])} | {t} | {r['recompute']} | "
                     f"{r['reshard_after_forward_false'] if r['reshard_after_forward_false'] is not None else '-'} | "
                     f"{r['prefetch'] or '-'} | {r['found_by'] or '-'} |")
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


def gloo_inputs(exp: config.Experiment) -> dict:
    """The experiment's inputs and target as `gaswap.shard.gloo.make_batch` takes them (seed 1: every rank draws
    the same batch, and the tiny Llama's tokens are those of `zoo.llama_inputs`)."""
    return {"inputs": [dataclasses.asdict(s) for s in exp.inputs],
            "target": dataclasses.asdict(exp.target) if exp.target is not None else None,
            "batch_size": exp.batch_size, "seed": 1}


def gloo_rows(exp: config.Experiment, prepared: dict, world_size: int, steps: int = 6) -> list[dict]:
    """Each peer and gaswap's plan at each peer's peak, applied and run under gloo with `world_size` processes:
    per rank, measured peak above the step's start (CPU allocator) and forward+backward CPU seconds (median),
    against the peak predicted for the run. `prepared`: `shard_plan.prepare` of the experiment with loss `sum`
    (what the gloo run trains: the experiment's inputs, the model's own dtype)."""
    # imported when --gloo asks for it: torch and processes
    from gaswap.shard.gloo import checkpoint_rng_bytes, gloo_peak, run_gloo

    ranked = at_world_size(prepared["problem"], world_size, prepared["profile"], exp.distributed.link)
    ranked.spec = dataclasses.replace(ranked.spec, checkpoint_rng_bytes=checkpoint_rng_bytes())  # the CPU's
    rows = []
    plans = {name: method_knobs(ranked, name) for name in PEERS}
    budgets = sorted({evaluate(ranked, k).peak for k in plans.values()}, reverse=True)
    for budget in budgets:
        ranked.budget = budget
        search(ranked, random.Random(exp.seed), population=exp.ga.population, generations=exp.ga.generations)
    for budget in budgets:  # offload would move nothing on a CPU (its host is the device): plans without it
        under = [p for p in ranked.cache.values() if p.peak <= budget and not p.knobs.offload]
        plans[f"gaswap (budget {format_size(budget)})"] = min(under, key=lambda p: (p.step_time, p.peak)).knobs
    for name, knobs in plans.items():
        plan = method_plan(ranked, knobs, prepared["torch"], name)
        started = time.time()
        runs = run_gloo(exp.model.factory, gloo_inputs(exp), plan["units"], world_size,
                        model_kwargs=dict(exp.model.kwargs or {}), steps=steps, metered=2, plan=plan)
        for r in runs:
            rank = shard_step(ranked.graph, ranked.params, dataclasses.replace(knobs.spec(ranked.spec), rank=r["rank"]))
            predicted = gloo_peak(memory_report(rank), rank) - rank.graph.resident_bytes()
            rows.append({"world_size": world_size, "method": name, "rank": r["rank"],
                         "predicted_peak_bytes": predicted, "measured_peaks_bytes": r["peaks_above_start"],
                         "fwd_bwd_cpu_s": statistics.median(r["fwd_bwd_cpu_s"]),
                         "step_cpu_s": r["cpu_step_s"], "predicted_h100_step_s": ranked.time(rank),
                         "run_s": time.time() - started})
    return rows


def gloo_table(rows: list[dict]) -> str:
    lines = [("| W | method | rank | peak predicted | peak measured (metered steps) | fwd+bwd CPU (median) | "
              "step CPU with Adam (median) |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = ", ".join(str(n) for n in r["measured_peaks_bytes"])
        exact = "equal" if all(n == r["predicted_peak_bytes"] for n in r["measured_peaks_bytes"]) else \
            f"{max(r['measured_peaks_bytes']) - r['predicted_peak_bytes']:+d} B"
        lines.append(f"| {r['world_size']} | {r['method']} | {r['rank']} | {r['predicted_peak_bytes']} B | {measured} B "
                     f"({exact}) | {r['fwd_bwd_cpu_s'] * 1e3:.1f} ms | {r['step_cpu_s'] * 1e3:.1f} ms |")
    equal = sum(all(n == r["predicted_peak_bytes"] for n in r["measured_peaks_bytes"]) for r in rows)
    lines += ["", f"Predicted peak equal to every metered step's: {equal} of {len(rows)} rank rows."]
    return "\n".join(lines)


def command(args, exp: config.Experiment) -> int:
    """Compare, print, write results/<experiment>/shard_compare.md and .csv (and shard_compare_gloo.csv)."""
    if exp.distributed is None:
        raise config.ConfigError(f"{exp.path}: shard-compare needs a `distributed:` key")
    worlds = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else list(WORLD_SIZES)
    started = time.process_time()
    prepared = prepare(exp)
    rows = []
    for w in worlds:
        rows += compare(at_world_size(prepared["problem"], w, prepared["profile"], exp.distributed.link), exp,
                        reserved=not args.no_reserved)
    lines = [f"# gaswap shard-compare {exp.name}", "",
             f"`gaswap shard-compare {exp.path}`: {exp.model.factory} {exp.model.kwargs}, batch {exp.batch_size} "
             f"per rank, FSDP2 units {exp.distributed.units}; per rank, predicted by gaswap's simulator (fake process "
             f"group: one rank's graph), costs {prepared['profile'].name}; every method expressed as gaswap knobs and "
             f"evaluated by the same ShardProblem. torchtitan read at {TORCHTITAN_COMMIT[:10]}. "
             f"{SAC_NOTE if sac_milp.available() is None else 'torch sac_milp skipped: ' + sac_milp.available()}",
             "", table(rows), "", *[f"- {v}" for v in verdicts(rows)], ""]
    files = {"shard_compare.csv": to_csv(rows)}
    gloo_worlds = ([int(w) for w in args.gloo_world_sizes.split(",")] if getattr(args, "gloo_world_sizes", None)
                   else [exp.distributed.world_size] if args.gloo else [])
    if gloo_worlds:
        summed = prepare(dataclasses.replace(exp, loss="sum", target=None))  # what run_gloo trains
        grows = [r for w in gloo_worlds for r in gloo_rows(exp, summed, w)]
        lines += [f"## Measured under gloo, {' and '.join(map(str, gloo_worlds))} processes on the CPU", "",
                  ("Each method's plan applied with gaswap.shard.apply and run with run_gloo on the experiment's "
                   "inputs (loss `sum`, the model's dtype); peak above the step's start by the CPU allocator's "
                   "counts, predicted for the same run. The step time predicted here is from the H100 profile and "
                   "is not comparable to CPU time; no CPU step-time prediction is made by this verb."), "",
                  gloo_table(grows), ""]
        files["shard_compare_gloo.csv"] = to_csv([r | {"measured_peaks_bytes": ";".join(map(str, r["measured_peaks_bytes"]))}
                                                  for r in grows])
    lines.append(f"total {time.process_time() - started:.1f} CPU s (this process)")
    text = "\n".join(lines) + "\n"
    files["shard_compare.md"] = text
    print(text)
    out = results.folder_of(args.results, exp.name)
    keep = {p.name: p.read_text() for p in out.glob("*") if p.is_file() and p.name not in files} if out.exists() \
        else {}
    if "summary.json" not in keep:  # whose folder it is, for the next verb that writes there
        files["summary.json"] = json.dumps({"experiment": exp.name, "experiment_file": exp.path}, indent=2) + "\n"
    write_folder(exp, out, keep | files, force=args.force)
    print(f"wrote {out}/ ({', '.join(files)})")
    return 0
