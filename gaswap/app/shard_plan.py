"""`gaswap search` of an experiment with a `distributed:` key: plan one rank of an FSDP2 run before launch.

Capture the single-device step on the meta device (parameters in the mixed-precision parameter dtype), turn it
into one rank's step (`plan.sharding`), search activation checkpointing and FSDP's knobs (`plan.shard_search`)
with op costs from the hardware profile's roofline and collectives from its `links`, print per rank what is
resident by category for keep-all, full AC, selective AC and the best plan (the fastest on the front whose
reserved peak fits too, else the fastest), and whether each fits the budget (live, allocated and reserved
through the allocator model: the rank's program replayed in order, all on one stream), and write
`results/<experiment>/`: summary.json, front.csv, plan.yaml (the chosen knobs and recompute sets: not a
policy file, whose format names one device's keep/swap/recompute per activation) and torchtitan.toml (the
plan as torchtitan's job configuration, what it cannot express as comments at its top: `plan.torchtitan`).
"""
from __future__ import annotations

import csv
import fnmatch
import io
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from gaswap.app import results
from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.base.errors import NO_FIT
from gaswap.base.files import umask, write_atomic
from gaswap.base.training_options import HOST_STEP_TRAFFIC
from gaswap.plan import torchtitan
from gaswap.plan.costs import estimate, load_profile
from gaswap.plan.memory import allocator
from gaswap.plan.shard_search import Knobs, Point, ShardProblem, link_for, search
from gaswap.plan.sharding import CATEGORIES, ShardError, ShardSpec, keep_all_run, memory_report

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
REFERENCES = (("keep-all", "keep_all"), ("full AC", "full_ac"), ("selective AC", "selective_ac"))


def refuse_unsupported(exp: config.Experiment) -> None:
    """ConfigError (one line) for what this planner does not model."""
    d = exp.distributed
    where = f"{exp.path}: distributed"
    if d.strategy != "fsdp":
        raise config.ConfigError(f"{where}.strategy: {d.strategy!r} is not modelled yet; only 'fsdp' (FSDP2's "
                                 f"fully_shard, ZeRO-3) is planned")
    if exp.autocast and d.mixed_precision.param_dtype:
        raise config.ConfigError(f"{where}.mixed_precision: autocast together with FSDP's param_dtype is not "
                                 f"modelled; use one of them")
    if exp.costs.source != "estimate":
        raise config.ConfigError(f"{exp.path}: costs.source: a sharded run is planned from a hardware profile "
                                 f"('estimate', with `links`), not measured here")


def match_units(exp: config.Experiment, model) -> list[str]:
    """Module paths of the FSDP units: modules whose class name is a pattern, or whose path matches one
    (`fnmatch`); ConfigError for a pattern that matches nothing. The root comes last."""
    found = []
    for pattern in exp.distributed.units:
        hits = [name for name, m in model.named_modules()
                if name and (type(m).__name__ == pattern or fnmatch.fnmatchcase(name, pattern))]
        if not hits:
            classes = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise config.ConfigError(f"{exp.path}: distributed.units: {pattern!r} matches no module of "
                                     f"{exp.model.factory} (its classes: {', '.join(classes)})")
        found += hits
    return list(dict.fromkeys(found)) + [""]


def prepare(exp: config.Experiment) -> dict:
    """Capture (timed in CPU seconds) and the search problem: {"problem", "link", "profile", "capture_s", ...}."""
    import torch  # the torch side of this verb: building and capturing the model

    from gaswap.run.capture import CaptureError  # the capture's own errors, renamed with the file
    from gaswap.run.experiment import build_model, make_inputs  # the model and inputs, as every verb builds them
    from gaswap.shard.capture import capture_for_sharding  # the single-device step and its parameters

    refuse_unsupported(exp)
    d = exp.distributed
    try:
        profile = load_profile(exp.costs.profile)
        link_name, link = link_for(profile, d.mesh[1] if d.mesh else d.world_size, d.link)
        replica_link = link_for(profile, d.world_size)[1] if d.mesh else None  # the all-reduce crosses nodes
    except (ValueError, ShardError) as err:
        raise config.ConfigError(f"{exp.path}: costs.profile / distributed.link: {err}") from None
    started = time.process_time()
    model = build_model(exp)
    units = match_units(exp, model)
    sharded = {p.element_size() for p in model.parameters()}
    mp = d.mixed_precision
    if mp.param_dtype:
        if len(sharded) != 1:
            raise config.ConfigError(f"{exp.path}: distributed.mixed_precision: parameters of several dtypes "
                                     f"cast to {mp.param_dtype} are not modelled")
        model = model.to(getattr(torch, mp.param_dtype))
    inputs, target = make_inputs(exp)
    try:
        captured, _, params = capture_for_sharding(model, inputs, target, exp.loss, optimizer=exp.optimizer,
                                                   autocast=exp.autocast)
    except CaptureError as err:
        raise CaptureError(f"{exp.path}: {err}") from None
    capture_s = time.process_time() - started
    raf = d.reshard_after_forward
    spec = ShardSpec(d.world_size, tuple(units),
                     reshard_after_forward=None if raf is True else False if raf is False else {u: raf for u in units if u},
                     forward_prefetch=d.prefetch.forward, backward_prefetch=d.prefetch.backward,
                     sharded_itemsize=sharded.pop() if mp.param_dtype else None,
                     reduce_itemsize=ITEMSIZE[mp.reduce_dtype] if mp.reduce_dtype else None,
                     optimizer_scalar_bytes=4 if exp.optimizer == "adam" else 0,
                     replicate=d.mesh[0] if d.mesh else 1, offload=d.offload is True)
    costs = estimate(captured.graph, profile)
    host_step = HOST_STEP_TRAFFIC[exp.optimizer] / profile.host_memory_bandwidth \
        if d.offload and profile.host_memory_bandwidth else None
    if d.offload == "search" and host_step is None:
        raise config.ConfigError(f"{exp.path}: distributed.offload: search needs the hardware profile's "
                                 f"host_memory_bandwidth, which {profile.name!r} does not give")
    problem = ShardProblem(captured.graph, params, spec, costs.op_time, link, 0,
                           profile.memory_bandwidth * profile.efficiency, replica_link,
                           costs if d.offload else None, host_step)
    return {"problem": problem, "link": link_name, "profile": profile, "capture_s": capture_s, "units": units,
            "torch": str(torch.__version__)}


def memory(problem: ShardProblem, point: Point, optimizer: str) -> dict:
    """Per-category bytes at the peak, the live peak, and the allocator model's allocated and reserved peaks
    (two steps, the optimizer's temporaries included)."""
    rank = problem.rank(point.knobs)
    traced = keep_all_run(rank, trace=True)
    report = memory_report(rank, result=traced)
    figures = allocator.figures(rank.graph, traced, steps=2, optimizer=optimizer)
    return {"at_peak": {c: report.at_peak.get(c, 0) for c in CATEGORIES}, "peak_op": report.peak_op} | figures


def command(args, exp: config.Experiment) -> int:
    """The `search` verb for a sharded experiment: plan, print, write; 0, or 3 when nothing fits the budget."""
    out = results.folder_of(args.results, exp.name)
    d = exp.distributed
    print(f"gaswap search {exp.name}: {exp.model.factory}, batch {exp.batch_size} per rank, FSDP2 over "
          f"{d.world_size} ranks")
    prepared = prepare(exp)
    problem, profile = prepared["problem"], prepared["profile"]
    started = time.process_time()
    keep = problem.evaluate(problem.seed("keep_all"))
    rank_s = time.process_time() - started
    budget = exp.budget.resolve(keep.peak)
    problem.budget = budget
    g = problem.graph
    print(f"graph: {len(g.ops)} ops, {len(prepared['units'])} units ({len(problem.classes)} class(es) of identical "
          f"blocks), captured in {prepared['capture_s']:.1f} CPU s; one rank's graph + simulation "
          f"{rank_s:.2f} CPU s; costs {profile.name}, collectives over {prepared['link']}")
    result = search(problem, random.Random(exp.seed), population=exp.ga.population, generations=exp.ga.generations,
                    cx_prob=exp.ga.cx_prob, mut_prob=exp.ga.mut_prob, max_seconds=exp.ga.max_seconds)
    shown = {name: result.seeds[key] for name, key in REFERENCES}
    figures = {name: memory(problem, p, exp.optimizer) for name, p in shown.items()}
    best = None
    for p in sorted(result.front, key=lambda p: p.step_time):  # the fastest whose reserved peak fits too
        best, figures["best"] = p, memory(problem, p, exp.optimizer)
        if figures["best"]["reserved_bytes"] <= budget:
            break
    if best is not None:
        shown["best"] = best
    print(table(shown, figures, budget, keep))
    print(f"search: {result.evaluations} plans in {result.seconds:.1f} CPU s, {len(result.front)} on the front; "
          f"total {prepared['capture_s'] + rank_s + result.seconds:.1f} CPU s (capture, rank graph, search)")
    summary = {
        "experiment": exp.name, "experiment_file": exp.path, "model": asdict(exp.model),
        "distributed": asdict(d), "batch_size": exp.batch_size, "optimizer": exp.optimizer, "loss": exp.loss,
        "device": profile.name, "cost_source": f"estimated:{profile.name}", "link": prepared["link"],
        "budget_bytes": budget, "budget": str(exp.budget), "units": prepared["units"][:-1],
        "block_classes": [list(c) for c in problem.classes],
        "graph": {"ops": len(g.ops), "fingerprint": g.fingerprint()},
        "cpu_seconds": {"capture": prepared["capture_s"], "rank_graph": rank_s, "search": result.seconds},
        "plans": {name: {"peak_bytes": p.peak, "step_time_s": p.step_time, "fits": p.fits(budget),
                         "overhead": p.step_time / keep.step_time - 1} | figures[name] | {"knobs": knobs(problem, p)}
                  for name, p in shown.items()},
        "best": "best" if best is not None else None,
        "front_size": len(result.front), "evaluations": result.evaluations,
        "history": [{"best_time_s": t, "front_size": n} for t, n in result.history],
    }
    files = {"summary.json": json.dumps(summary, indent=2) + "\n",
             "front.csv": front_csv(problem, result.front, keep)}
    if best is not None:
        planned = plan(exp, problem, best, prepared["torch"])
        files["plan.yaml"] = yaml.safe_dump(planned, sort_keys=False)
        files["torchtitan.toml"] = torchtitan.to_toml(*torchtitan.job_config(planned, asdict(d)), exp.name)
    write_folder(exp, out, files, force=args.force, keep=("shard_compare*",))  # `shard-compare`'s tables stay
    print(f"wrote {out}/ ({', '.join(files)})")
    if best is None:
        print(f"error: no plan fits {format_size(budget)} per rank on {d.world_size} ranks", file=sys.stderr)
        return NO_FIT
    return 0


def table(shown: dict, figures: dict, budget: int, keep: Point) -> str:
    """Per rank, bytes by category at each plan's peak, the peaks and whether they fit the budget."""
    names = list(shown)
    rows = [["per rank"] + names]
    for cat in CATEGORIES:
        if any(figures[n]["at_peak"][cat] for n in names):
            rows.append([cat] + [format_size(figures[n]["at_peak"][cat]) for n in names])
    for key, label in (("live_bytes", "peak (live)"), ("allocated_bytes", "allocated"),
                       ("reserved_bytes", "reserved")):
        rows.append([label] + [format_size(figures[n][key]) for n in names])
        rows.append([f"  fits {format_size(budget)}"] + ["yes" if figures[n][key] <= budget else "NO" for n in names])
    rows.append(["step time"] + [f"{shown[n].step_time * 1e3:.1f} ms ({shown[n].step_time / keep.step_time - 1:+.1%})"
                                 for n in names])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def recompute_groups(problem: ShardProblem, knobs: Knobs) -> list[dict]:
    """Per block class, one entry per group of its units with the same recompute choice (a class's first units
    may be checkpointed more than the rest): the units, the choice ("none", "full" or op names), every unit's
    path and the class's own forward ops in order as [name, aten target]."""
    entries = []
    for cls in problem.classes:
        ops = problem.owned[cls[0]]
        groups: dict = {}
        for u in cls:
            groups.setdefault(knobs.recompute.get(u, ()), []).append(u)
        for chosen, units in groups.items():
            entries.append({"units": f"{units[0]} .. {units[-1]} ({len(units)})" if len(units) > 1 else units[0],
                            "recompute": "full" if chosen == "full" else
                            [problem.graph.ops[ops[i]].name for i in chosen] or "none",
                            "unit_paths": list(units),  # the ops listed per entry: YAML would alias a shared list
                            "forward": [[problem.graph.ops[i].name, problem.graph.ops[i].target] for i in ops]})
    return entries


def knobs(problem: ShardProblem, p: Point) -> dict:
    """A plan's knobs as plain data: the recompute groups (without their paths and ops), the units kept gathered
    after the forward, prefetch depths."""
    groups = [{k: e[k] for k in ("units", "recompute")} for e in recompute_groups(problem, p.knobs)]
    return {"recompute": groups,
            "reshard_after_forward_false": [u for u in problem.units if p.knobs.reshard.get(u, True) is False],
            "reshard_after_forward_groups": {u: k for u in problem.units
                                             if not isinstance(k := p.knobs.reshard.get(u, True), bool)},
            "forward_prefetch": p.knobs.forward_prefetch, "backward_prefetch": p.knobs.backward_prefetch,
            "offload": list(p.knobs.offload or (problem.units + [""] if problem.spec.offload is True else []))}


def plan(exp: config.Experiment, problem: ShardProblem, best: Point, torch_version: str) -> dict:
    """plan.yaml: the knobs, plus what `gaswap.shard.apply` needs to apply them to a model: every unit's path
    (root last), per recompute group its units' paths and their class's own forward ops in order as [name, aten
    target] (the recompute names are among them: the k-th call of a target in the block's forward), the torch
    version."""
    return {"experiment": exp.name, "experiment_file": exp.path, "world_size": exp.distributed.world_size,
            "torch": torch_version, "units": list(problem.units) + [""],
            "predicted": {"peak_bytes": best.peak, "step_time_s": best.step_time}, **knobs(problem, best),
            "recompute": recompute_groups(problem, best.knobs)}


def front_csv(problem: ShardProblem, front: list, keep: Point) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["peak_bytes", "step_time_s", "overhead", "recompute", "reshard_after_forward_false",
                "forward_prefetch", "backward_prefetch"])
    for p in front:
        k = knobs(problem, p)
        w.writerow([p.peak, p.step_time, p.step_time / keep.step_time - 1,
                    ";".join(str(c["recompute"]) if isinstance(c["recompute"], str) else f"{len(c['recompute'])} ops"
                             for c in k["recompute"]),
                    len(k["reshard_after_forward_false"]), k["forward_prefetch"], k["backward_prefetch"]])
    return out.getvalue()


def write_folder(exp: config.Experiment, out: Path, files: dict, *, force: bool, keep: tuple = ()) -> None:
    """Write `files` into `out` whole (a temporary sibling folder renamed into place, as `app.results` does),
    refusing another experiment's folder unless `force`; the folder's files matching a pattern of `keep` and not
    among `files` are carried over."""
    with results.locked(out):
        results.recover(out)
        results.check_folder(exp.name, exp.path, out, force=force)
        if out.exists():
            kept = {p.name for pattern in keep for p in out.glob(pattern) if p.is_file()} - set(files)
            files = {name: (out / name).read_text() for name in sorted(kept)} | files
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        tmp.chmod(0o777 & ~umask())
        try:
            for name, text in files.items():
                write_atomic(tmp / name, text)  # an OSError names the file
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        new, old = out.with_name(f".{out.name}.new"), out.with_name(f".{out.name}.old")
        tmp.rename(new)
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        new.rename(out)
        shutil.rmtree(old, ignore_errors=True)
