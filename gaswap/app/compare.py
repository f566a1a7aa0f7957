"""`gaswap compare EXPERIMENT`: eager, torch.compile's memory budgets and gaswap compiled policies, head to head.

For one experiment, in one process: the model trained eagerly; compiled by torch.compile (inductor) with
`torch._functorch.config.activation_memory_budget` at 1.0, 0.5 and 0.2; and compiled under gaswap policies
(`gaswap.compiled.partition`) searched at the peaks torch's partitions reach and below. The gaswap budgets are the
peaks torch.compile's runs measure (one metered step each, after the compile), plus `--below` fractions of
the lowest of them; the GA (search space `compiled`: keep / recompute, the compiler's order) is seeded with
torch's partitions, each read back as keep/recompute actions. The model cannot see every effect of fusion
(keeping a bool mask can slow a kernel several times), so the `finalists` fastest policies it predicts at
each budget (the search's Pareto front, filled up with the next fastest that fit where the front holds
fewer: it can hold one or two when every policy is predicted nearly the same peak; of those, the first whose
programs, written by inductor without compiling their kernels, fit the budget: `compare_screen`), and torch's
partitions whose measured peak fits (timed in torch.compile's own programs of them, the same as their
read-back's; one picked is compiled as gaswap's policy for the head to head: `_make`), are compiled and timed
first, in rounds of their own (`_finalists_round`: the peak metered in the first, which the allocator gives the
same every run; a finalist over every budget of its own, or clearly slower than the fastest there, timed no
longer: `_contenders`). Then
a second round: the time model is fitted again on its calibration points and the finalists' measured
times (`step_model.refit`), the search runs again with it, and the new finalists it predicts fastest
are timed beside the first round's choice at their budget (`_second_round`; one the refit predicts less
than 3 % faster than that choice, `MIN_GAIN`, is not compiled). Where no first-round
finalist measured under its budget (the model erred low), the second search runs under the budget divided
by how far over their predictions those finalists measured (`_refit_budgets`). Where round 1 chose one of torch's
partitions and none of the search's own finalists fit, round 2 also times the policy found next to it: values it
recomputes kept instead, judged by their programs (`_near_torch`, `compare_screen.kept_near`). Under torch's least
peak, where none of the search's candidates fit by their programs even searched lower, round 1 descends from the
partition of that peak one action at a time, each step judged by the programs (`_below_torch`,
`compare_screen.descended`). The policy compared at a
budget is the fastest whose measured peak fits it, of the last round that timed any there; a budget none
fits is left out (`_final_choice`). A policy's predictions are those of the model that picked it, before
it was timed. The verdicts of compare.md are `gaswap.app.compare_report`'s.
Compiling is most of a compare's time (a cold compile of an unrolled GRU takes a minute of CPU): policies
whose partitions save the same activations generate the same programs, so each finalist is partitioned first
(its screen's dry compile did, or a trace) and one per partition is compiled and timed
(`gaswap.compiled.pool.Programs`; a torch partition's name passes on to the search's policy it equals); with
`workers` (`--workers`, by default one per CPU where the model trains on the CPU), the compiles run in worker
processes, each into inductor's caches, before the measuring process loads them (about a second each) and
times them with no worker running: the calibration policies' compiles queue behind torch's, and the first
candidates of every budget are written (no kernels compiled) at once. On this project's 2-core machine that
cut a compare's wall time by 9 to 25 % (docs/compiled.md, "Compare's time").
Policies are simulated as inductor runs them (`gaswap.compiled.step_model`): standalone op costs in CPU
seconds, fused intermediates not counted, the keep-all step, the cost of recomputation, of kept masks and
of saved bytes calibrated on policies compiled and timed first (`step_model.calibrate`: keep-all, masks
recomputed, recompute-generated, recompute-all and a random half, beside torch's three partitions, compiled
and metered before them; `calibration_run`). The
table shows those predictions beside the ones of the joint graph's ops one by one (every op alone, every
tensor counted).

Each method trains its own copy of the model from the same weights. After warm-up (the compile), rounds
run the methods in rotated order: for each, one step under the peak meter, one untimed step (the meter
handed freed memory back to the OS; malloc takes it again), then a few timed steps (forward, loss,
backward, optimizer step; the figure compared is the process's CPU time per step, steadier than wall
time on a shared machine, with the experiment's `costs.threads` intra-op threads; wall time is in the CSV).
The meter (`gaswap.run.peak_meter`) is independent of gaswap: the peak bytes torch's allocator held above what was
allocated before the step (CUDA: the caching allocator's; CPU: the CPU allocator's, counted by the
profiler), and on a CPU also the process's resident-set high-water mark. Both count gradients and every
temporary; the goal is judged by each. The predicted peak beside them is the simulated peak less the bytes
resident before a step (parameters, buffers, inputs, optimizer state); beside it, the peak of the programs
inductor generated for the method, read from them at its compile (`gaswap.compiled.programs`). A policy
file written predicts the latter, plus what the meter read beyond torch's partitions' programs
(`predicted.peak_bytes`, `beyond_programs_bytes`; the search model's is `search_peak_bytes`). On a
CPU, a swap would not lower these figures (the host store is the same RAM), so the compared policies keep
or recompute only; on CUDA with torch's asynchronous offloading they may swap too (`partition.space_for`).

Writes `results/<experiment>/compare.csv`, `compare.md`, `finalists.csv` and the gaswap policies compared
(`compiled/pNN.yaml`).
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from gaswap.app.compare_report import budget_labels, to_markdown
from gaswap.app.compare_screen import BELOW_TORCH_S, KEPT_NEAR_S, ProgramPeaks, descended, kept_near, offset
from gaswap.base import config
from gaswap.base.config import format_size
from gaswap.base.files import csv_text, write_atomic
from gaswap.compiled import calibration_run, library_calls, partition, pool, programs, step_model
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled.methods import Method
from gaswap.plan import policy as policies
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.problem import Evaluated, Problem
from gaswap.plan.search import search
from gaswap.run import training
from gaswap.run.measure import device_name, measure
from gaswap.run.runtime import CLOCK_NAMES

TORCH_BUDGETS = (1.0, 0.5, 0.2)
# gaswap policies per budget compiled and timed before the head to head, beside torch's partitions that fit; the
# fastest is compared. 1: where three were timed (results/compare_time/), the second or third, predicted within 1 %
# of the first, measured faster at 9 of 20 budgets, by 0.2 to 4.4 %; and the picks, timed again in the head to head,
# measured -3.0 to +9.2 % (median +2.1 %) against their finalist round: the fastest of noisy timings, not a gain
FINALISTS = 1
SCREENED = 3  # candidates per finalist whose programs inductor writes (no kernels compiled) to find those that fit
TIE = 0.01  # times (predicted, or finalists' measured) this close to the fastest are its equal: least memory first
# where none fits, the budget searched again is lowered by their least excess over the model's peak and this share
# more: the model errs a little differently on what it finds there (the GRU's, lowered by the excess alone,
# measured 0.5 % over the budget, at two budgets)
LOWERED_MARGIN = 0.05
TUNING_ROUNDS, TUNING_STEPS = 3, 2
MIN_GAIN = 0.03  # a second-round finalist is compiled only where the refit model predicts it this much faster
SEPARATED = 0.10  # a finalist whose fastest step is this much slower than the slowest of the fastest is not timed on
COLUMNS = ("method", "knob", "predicted_peak_bytes", "predicted_step_s", "peak_bytes", "peak_min", "peak_max",
           "step_s", "step_min", "step_max", "wall_step_s", "compile_s", "recomputed", "opwise_peak_bytes",
           "opwise_step_s", "rss_peak_bytes", "origin", "program_peak_bytes", "budget", "steps_timed")
# step_*: CPU seconds; opwise_*: the joint graph's ops one by one (no fusion model); program_peak_bytes: the
# peak of the programs inductor generated for the method (`gaswap.compiled.programs`); budget: the gaswap
# budget a torch.compile row's measured peak became, a gaswap row's own (`gaswap.app.compare_report`);
# steps_timed: fewer for a finalist no longer timed once clearly slower (`_contenders`); compile_s: wall seconds
# compiling (in a worker, `gaswap.compiled.pool`, plus loading it in the measuring process)
# the search each budget runs where the experiment names no `ga` (the defaults, 64 x up to 500 generations with
# patience 50, would take minutes a compare); the shipped compare experiments name these
SEARCH = config.GASettings(population=32, generations=100, patience=20, workers=1)
FINALIST_COLUMNS = (*COLUMNS, "round")  # finalists.csv: the round that timed the finalist (`_finalists_round`)


def run(experiment_path, *, rounds: int = 5, steps: int = 3, below=(0.8,), finalists: int = FINALISTS,
        results_root="results", cache_dir=None, progress=print, workers: int | None = None) -> list[dict]:
    """Compare the methods on one experiment; write compare.csv / compare.md; return the rows (COLUMNS).
    `workers`: processes that compile before the measuring process loads (`gaswap.compiled.pool`; None, the
    default: one per CPU on a CPU, none on a GPU, `pool.default_workers`; 0: compile in the measuring process)."""
    exp = search_settings(config.load_experiment(experiment_path))
    if exp.loss == "external":
        raise config.ConfigError(f"{exp.path}: loss: compare computes the loss outside the compiled model; give a "
                                 f"loss (cross_entropy, mse or sum) and its target")
    progress(f"{exp.name}: capturing torch.compile's joint graph")
    if exp.ga is SEARCH:
        progress(f"  {exp.path} names no `ga`: each search runs {SEARCH.population} policies a generation, at most "
                 f"{SEARCH.generations} generations, until {SEARCH.patience} bring nothing better")
    device, model, inputs, target, graph = compiled_methods.setup(exp)
    progress(f"  on {device_name(device)}")
    costs = measure(graph, device, cache_dir, threads=exp.costs.threads)
    space = config.load_search_space(partition.space_for(device))  # swaps on CUDA, keep / recompute on a CPU
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    compile_pool = pool.CompilePool(exp.path, pool.default_workers(device) if workers is None else workers, progress,
                                    local=(model, inputs))
    compile_pool.submit([pool.Job(f"torch.compile {b:g}", budget=b) for b in TORCH_BUDGETS])  # after the costs
    torch_actions = partition.torch_partitions(model, *inputs, budgets=TORCH_BUDGETS, optimizer=exp.optimizer,
                                               counted=exp.counts)[1]
    if compile_pool.workers > 0:  # the calibration's compiles queued behind torch's: no worker waits between
        compile_pool.submit(calibration_run.compile_jobs(
            exp, graph, costs, {f"torch {b:g}": a for b, a in torch_actions.items()}))
    eager, opt = training.fresh_copy(model, exp.optimizer)
    methods = [Method("eager", "-", eager, eager, opt)]
    compile_pool.compile([])  # those submitted: torch's and the calibration policies'
    for budget in TORCH_BUDGETS:
        m, opt = training.fresh_copy(model, exp.optimizer)
        methods.append(Method("torch.compile", f"{budget:g}", m, compiled_methods.torch_compiled(m, budget), opt,
                              precompiled_s=compile_pool.seconds.get(f"torch.compile {budget:g}")))
    reached = []
    for k, m in enumerate(methods[1:]):
        progress(f"  {'compiling' if m.precompiled_s is None else 'loading'} torch.compile {m.knob} "
                 f"({k + 1} of {len(methods) - 1})")
        reached.append(_peak_reached(m, inputs, target, exp, device, progress))

    # torch's partitions, compiled already, are calibrated on beside the calibration policies
    calibration, _ = calibration_run.calibrate(
        exp, graph, costs, model, inputs, target, device, progress, pool.Programs(compile_pool),
        partitions={f"torch {m.knob}": (torch_actions[b], m) for b, m in zip(TORCH_BUDGETS, methods[1:])})
    progress(f"  keep-all {calibration.base * 1e3:.2f} ms a step; recomputed generated ops cost "
             f"{calibration.scale:.2f}x their ops one by one, library calls {calibration.extern_scale:.2f}x; "
             f"a kept mask {calibration.mask_rate * 1e9:.1f} ms per MB, saved tensors "
             f"{calibration.saved_rate * 1e9:.1f} ms per MB"
             + (f"; a backward that recomputes no convolution {calibration.plain_rate * 1e3:.2f} ms more"
                if "plain" in calibration.terms else "") + "; fit within "
             f"{calibration.worst_error():.1%} on its points"
             + ("" if calibration.terms == step_model.TERMS else
                f" (terms fitted: {', '.join(calibration.terms) or 'none'}; the others at their defaults)")
             + "; peaks offset by "
             f"{'-' if calibration.peak_offset < 0 else '+'}{format_size(abs(calibration.peak_offset))}"
             f" (recomputed values inductor inlines {'held' if not calibration.inline_recomputed else 'not held'})")
    unbounded = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=calibration)
    opwise = Problem(graph, costs, None, space)  # the model before: every op alone, every tensor counted
    encoding = unbounded.encoding
    resident = unbounded.fused.resident_bytes()  # the meter measures above what is allocated before a step

    def predicted(chromosome, r) -> tuple:
        o = opwise.simulate(chromosome)
        return r.peak_bytes - resident, r.step_time, o.peak_bytes - resident, o.step_time

    torch_points = {}
    for budget, m in zip(TORCH_BUDGETS, methods[1:]):
        chromosome = unbounded.canonical(encoding.read_back(torch_actions[budget]))
        torch_points[budget] = (chromosome, unbounded.simulate(chromosome))
        m.predicted, m.recomputed = predicted(chromosome, torch_points[budget][1]), _count(chromosome)
    budgets = _budgets([peak + resident for peak in reached], below, resident)
    budget_of_torch = dict(zip((m.knob for m in methods[1:]), _labels_of(budgets, [p + resident for p in reached])))
    seeds = {f"torch_{b:g}": c for b, (c, _) in torch_points.items()}
    output_bytes = graph.tensors[graph.loss].size
    partition_keys = {}  # `pool.actions_key` -> partition key: the dry compiles' (`ProgramPeaks`), for `pool.Programs`
    # what the meter reads beyond the generated programs (a few kB on a CPU; on a GPU cuDNN's workspaces)
    beyond_programs = offset(reached, [_program_peak(m, output_bytes, exp.loss, progress) for m in methods[1:]])
    peaks = ProgramPeaks(model, inputs, output_bytes, exp.loss,
                         lambda c, inductor=None: partition.make_policy(
                             graph, unbounded.actions_of(c), provenance=provenance | _inductor(inductor)),
                         beyond_programs, progress, partition_keys, compile_pool if compile_pool.workers > 0 else None
                         ) if finalists > 0 else None
    least = min(zip(TORCH_BUDGETS, reached), key=lambda item: item[1])  # torch's partition of least peak
    below = partial(_below_torch, torch_points[least[0]][0], f"torch {least[0]:g}'s partition", resident + least[1],
                    unbounded, resident, peaks, progress)
    shortlist = _search(exp, graph, costs, calibration, space, seeds, budgets, resident, progress, finalists, peaks,
                        below=below, workers=compile_pool)
    folder = Path(results_root) / exp.name
    budget_of = dict(budgets)
    partitions = {f"torch {b:g}": (c, r, peak + resident) for (b, (c, r)), peak in zip(torch_points.items(), reached)}
    if finalists > 0:  # timed: torch's partitions that fit join the search's own
        shortlist = _with_partitions(shortlist, partitions, budgets)
    origin = {c.actions: name for name, (c, _, _) in reversed(partitions.items())}
    stand_ins = {c.actions: m for (c, _), m in zip(torch_points.values(), methods[1:])}  # `_make`
    inductor_of = peaks.inductor if peaks is not None else {}  # actions -> inductor settings its programs fit under

    def method(label: str, evaluated, problem) -> tuple[Method, policies.Policy]:
        """A gaswap method compiled under `evaluated`, predicted by `problem` (a calibrated CompiledProblem)."""
        r = problem.simulate(evaluated.chromosome)
        policy = partition.make_policy(graph, problem.actions_of(evaluated.chromosome),
                                      {"peak_bytes": r.peak_bytes, "step_time_s": r.step_time,
                                       "resident_bytes": resident},
                                      {"experiment": exp.name, "experiment_file": str(exp.path), "budget": label,
                                       "budget_bytes": budget_of[label],
                                       "optimizer": exp.optimizer, "counts": sorted(exp.counts),
                                       "inputs": [asdict(spec) for spec in exp.inputs], "batch_size": exp.batch_size,
                                       "cost_source": problem.simulator.costs.source,
                                       "device": problem.simulator.costs.device,  # costs and calibration timed here
                                       "calibration": problem.calibration.to_dict(),
                                       "torch_version": str(torch.__version__)}
                                      | _inductor(inductor_of.get(evaluated.chromosome.actions)))
        m, opt = training.fresh_copy(model, exp.optimizer)
        return Method("gaswap", label, m, partition.compile(m, policy), opt, predicted(evaluated.chromosome, r),
                      _count(evaluated.chromosome), origin=origin.get(evaluated.chromosome.actions, "search")), policy

    def measure_methods(ms, rounds_, steps_, **options):
        rows_ = compiled_methods.measure(ms, inputs, target, exp.loss, device, rounds_, steps_, progress, **options)
        for m, row in zip(ms, rows_):
            row["program_peak_bytes"] = _program_peak(m, output_bytes, exp.loss, progress)
        return rows_

    made = {}  # actions -> (Method, Policy, the problem that predicted it): every gaswap policy compiled
    own = {}  # actions -> (Method, Policy): torch's partitions picked, compiled as gaswap's own (`_own_program`)
    tuning = []  # the finalists' measured rows, both rounds
    if finalists == 0:  # the model's choice, untimed
        chosen = {label: evaluated[0] for label, evaluated in shortlist}
    else:
        chosen, tuning = _two_rounds(
            shortlist, unbounded, budgets, resident, made, method, measure_methods, progress,
            lambda refit, again, settled: _search(exp, graph, costs, refit, space, seeds, again, resident, progress,
                                                  finalists, peaks, settled, workers=compile_pool),
            pool.Programs(compile_pool, partition_keys), stand_ins, own,
            lambda label, start, problem, deadline: kept_near(problem, start, budget_of[label], resident, peaks,
                                                              deadline))
        progress(peaks.summary())
    picked = _picked(chosen, made, method, budget_of, unbounded, stand_ins, own)
    untimed = {tuple(sorted(policy.actions.items())): (m, policy) for m, policy in picked
               if not m.compile_s and m.precompiled_s is None}  # the others compiled in a worker already
    pool.Programs(compile_pool).compile(list(untimed.values()), "pick")  # with finalists 0: each policy once
    compile_pool.close()  # its workers idle and hold memory: gone before the head to head
    methods += [m for m, _ in picked]
    rows = _timed_once(methods, lambda ms: measure_methods(ms, rounds, steps, round_s=compiled_methods.ROUND_S))
    for row in rows:
        row["budget"] = row["knob"] if row["method"] == "gaswap" else budget_of_torch.get(row["knob"])
    # written once all is measured: a run that fails midway leaves the earlier run's results whole
    for stale in [*folder.glob("compiled/p[0-9]*.yaml"), *folder.glob("compiled/p[0-9]*.validation.json")]:
        stale.unlink()  # an earlier run's policies and their validations
    program_peak = {id(m): row["program_peak_bytes"] for m, row in zip(methods, rows)}
    for k, (m, policy) in enumerate(picked):
        policies.save(_with_program_peak(policy, program_peak[id(m)], beyond_programs),
                      folder / "compiled" / f"p{k:02d}.yaml")
    write_atomic(folder / "compare.csv", csv_text(rows, COLUMNS))
    if tuning:
        write_atomic(folder / "finalists.csv", csv_text(tuning, FINALIST_COLUMNS))
    elif (folder / "finalists.csv").exists():
        (folder / "finalists.csv").unlink()  # an earlier run's
    write_atomic(folder / "compare.md", to_markdown(rows, exp.name, device_name(device), tuning,
                                                    CLOCK_NAMES.get(device.type, "wall time")))
    return rows


def search_settings(exp: config.Experiment) -> config.Experiment:
    """`exp`, searching with `SEARCH` where its file names no `ga` (else as it says)."""
    return exp if "ga" in exp.given else replace(exp, ga=SEARCH)


def _search(exp, graph, costs, calibration, space, seeds, budgets, resident, progress,
            finalists: int = 1, peaks: ProgramPeaks | None = None, settled=None, below=None, workers=None
            ) -> list[tuple[str, list]]:
    """gaswap's `finalists` policies (`_shortlist`) at each of `budgets` ((label, bytes) pairs), the GA seeded
    with `seeds`: (label, [Evaluated, the fastest predicted first]) pairs, skipping budgets where nothing fits.
    With `peaks`, the `finalists` are the fastest of `SCREENED` times as many whose programs fit the budget
    (`ProgramPeaks.screen`; `settled(label, evaluated)`: one not checked, passed on as it is); where none does,
    the search runs once more under the budget lowered by the least excess of their programs' peaks over the
    model's (and `LOWERED_MARGIN`); a budget where none fits then is not searched again
    (`ProgramPeaks.unreached`), and one where they fit is searched under that lowered budget from then on
    (`ProgramPeaks.lowered`: the second round's model prices peaks as the first's did; on densenet the second
    round checked a candidate at the budget itself for 29 s, and lowered it again). `below(label, budget)`: where
    none fits even then, the policies found instead (`_below_torch`). `workers` (a `pool.CompilePool`): the
    budgets' searches run at once in its processes (`_searches`), the first ones, then those searched lower (all
    budgets checked first: on the GRU three lowered searches of about 20 s each ran one after another)."""

    size = max(finalists, 1) * (SCREENED if peaks is not None else 1)  # none timed: the model's choice

    def problem_at(budget: int):
        return step_model.CompiledProblem(graph, costs, budget, space, loss=exp.loss, calibration=calibration)

    def said(label, result) -> None:
        progress(f"  gaswap search at {label}: " + ("nothing fits" if result.best is None else
                 f"{format_size(result.best.peak_bytes - resident)}, {result.best.step_time * 1e3:.2f} ms predicted"))

    todo = []  # (label, budget, the budget searched under, how progress names it)
    for label, budget in budgets:
        if peaks is not None and label in peaks.unreached:
            progress(f"  at {label}: not searched again (none of the search's policies fit it by their programs, "
                     "searched lower too)")
        elif peaks is not None and label in peaks.lowered:  # the peaks are modelled alike again: start lower
            lowered = peaks.lowered[label]
            todo.append((label, budget, lowered, f"{label}, lowered to {format_size(lowered - resident)} as before"))
        else:
            todo.append((label, budget, budget, label))
    problems = [problem_at(under) for _, _, under, _ in todo]
    results = []
    for (label, budget, under, named), problem, result in zip(todo, problems, _searches(problems, exp, seeds, workers)):
        said(named, result)
        results.append((label, budget, under, problem, result))
    # one model prices every budget: a policy one search found is a candidate wherever it fits (a search can stop
    # short of a policy another found: on separable, 39.5 ms predicted at 59.22 MB beside 37.2 ms fitting it found
    # at 62.35 MB)
    found = [e for *_, result in results for e in (*result.front, *result.fastest)]
    searched = []
    for label, budget, searched_under, problem, result in results:
        fitting = _slack_first(sorted((e for e in found if e.peak_bytes <= searched_under), key=lambda e: e.step_time))
        if fitting and result.best is not None and fitting[0].step_time < result.best.step_time:
            progress(f"  at {label}: a policy another budget's search found is faster in prediction "
                     f"({fitting[0].step_time * 1e3:.2f} ms)")
        searched.append((label, budget, _shortlist(fitting, (), problem.canonical, size)))
    if peaks is None:
        return [(label, shortlist) for label, _, shortlist in searched if shortlist]
    skip = {label: partial(settled, label) if settled else None for label, _, _ in searched}
    _ahead(peaks, searched, finalists, settled)  # those each budget checks first, written at once with workers
    screened = {}  # label -> (its shortlist whose programs fit, the least ratio of programs to model where none)
    for label, budget, shortlist in searched:
        if shortlist:
            screened[label] = peaks.screen(label, budget, resident, shortlist, finalists, skip[label])
    # where none fits: each such budget searched once more, lowered by that ratio, the searches at once
    ratios = {label: ratio for label, (_, ratio) in screened.items() if ratio > 1}
    lower = [(label, budget, resident + int((budget - resident) / (ratios[label] * (1 + LOWERED_MARGIN))))
             for label, budget, _ in searched if label in ratios]
    problems = [problem_at(lowered) for *_, lowered in lower]
    again = []
    for (label, budget, lowered), problem, result in zip(lower, problems, _searches(problems, exp, seeds, workers)):
        said(f"{label}, lowered to {format_size(lowered - resident)}", result)
        again.append((label, budget, _shortlist(result.front, result.fastest, problem.canonical, size)))
    _ahead(peaks, again, finalists, settled)
    for (label, budget, shortlist), (_, _, lowered) in zip(again, lower):
        fitting = peaks.screen(label, budget, resident, shortlist, finalists, skip[label])[0]
        if fitting:
            peaks.lowered[label] = lowered
        else:
            peaks.unreached.add(label)  # the peaks are modelled alike in a second round: none would fit
            fitting = below(label, budget) if below is not None else []
        screened[label] = (fitting, 1.0)
    return [(label, screened[label][0]) for label, _, _ in searched if screened.get(label, ([], 1.0))[0]]


def _ahead(peaks: ProgramPeaks, searched: list, finalists: int, settled=None) -> None:
    """Start writing the programs of the candidates each budget of `searched` ((label, budget, shortlist)) checks
    first (`settled` ones need none), all at once in the workers (`ProgramPeaks.ahead`)."""
    first = [e.chromosome for label, _, shortlist in searched for e in shortlist[:finalists]
             if not (settled and settled(label, e))]
    if first:
        peaks.ahead(first)


def _searches(problems: list, exp, seeds, workers=None) -> list:
    """The GA's search of each of `problems`: at once in the processes of `workers` (a `pool.CompilePool`, idle
    between its compiles) where there are several and the GA evaluates in its own process, else one after
    another here. Seeded alike, a search finds the same in a worker (on densenet a search takes 3 CPU s; sending
    its problem there 0.03)."""
    several = workers is not None and len(problems) > 1 and exp.ga.workers <= 1 and exp.ga.executor != "dask"
    done = workers.map(partial(search, seeds=seeds), [(p, exp.ga, exp.seed) for p in problems]) if several else None
    return done or [search(p, exp.ga, exp.seed, seeds=seeds) for p in problems]


def _below_torch(start: Chromosome, name: str, start_peak: int, problem, resident: int, peaks: ProgramPeaks,
                 progress, label: str, budget: int) -> list[Evaluated]:
    """At a budget under `start`'s measured peak (`start_peak`, resident included; `start`: torch's partition of
    least peak, read back, called `name`), the policy `compare_screen.descended` reaches from it within
    `BELOW_TORCH_S` whose programs fit (none where the budget is not under it, or none fits): the model's peaks
    err little next to the partitions it was calibrated on, and the programs judge each step."""
    if budget >= start_peak:
        return []
    found = descended(problem, start, budget, resident, peaks, time.monotonic() + BELOW_TORCH_S)
    reached = "unread" if found.reached is None else format_size(found.reached)
    progress(f"  at {label}: from {name}, {found.steps} actions changed ({found.checked} checked by inductor's "
             f"programs): {reached}, " + (f"fits, {found.policy.step_time * 1e3:.2f} ms predicted"
                                         if found.policy is not None else "does not fit"))
    return [] if found.policy is None else [found.policy]


def _slack_first(fastest_first: list[Evaluated]) -> list[Evaluated]:
    """`fastest_first` with those predicted within `TIE` of the fastest first, the smallest peak first among them: a
    difference the model cannot tell buys no memory (on window, the picks had come within 1 % of its budgets
    for 0.5 % less time, and the programs of all four were over them: 98 s of checks and searches lowered)."""
    if not fastest_first:
        return []
    near = [e for e in fastest_first if e.step_time <= fastest_first[0].step_time * (1 + TIE)]
    return sorted(near, key=lambda e: (e.peak_bytes, e.step_time)) + fastest_first[len(near):]


def _shortlist(front, fastest, canonical, n: int) -> list[Evaluated]:
    """Up to `n` policies as they run (`canonical(chromosome)`), one per actions: the `front`'s, fastest first,
    then, where it has fewer than `n`, the next of `fastest` (fastest first)."""
    out = {}
    for e in (*front, *fastest):
        if len(out) == n:
            break
        c = canonical(e.chromosome)
        out.setdefault(c.actions, replace(e, chromosome=c))
    return list(out.values())


def _with_partitions(finalists, partitions: dict, budgets) -> list[tuple[str, list]]:
    """Each budget's finalists (`budgets`: (label, bytes) pairs), and after them torch's partitions
    (`partitions`: name -> (chromosome, simulated, measured peak)) whose measured peak is at or under the
    budget, as gaswap policies: the model cannot see all that makes a policy fast, so they are timed beside
    the search's own (and stand alone where the search found nothing that fits by the model)."""
    ours = dict(finalists)
    out = []
    for label, budget in budgets:
        evaluated = list(ours.get(label, []))
        known = {e.chromosome.actions for e in evaluated}
        for c, r, peak in partitions.values():
            if peak <= budget and c.actions not in known:
                known.add(c.actions)
                evaluated.append(Evaluated(c, r.step_time, r.peak_bytes))
        if evaluated:
            out.append((label, evaluated))
    return out


def _two_rounds(shortlist, problem, budgets, resident, made: dict, method, measure_methods, progress,
                search_again, programs=None, stand_ins=None, own: dict | None = None, near=None
                ) -> tuple[dict, list[dict]]:
    """The policy compared at each budget ({label: Evaluated}) and the finalists' measured rows: `shortlist`'s
    finalists timed (round 1); the time model of `problem` (calibrated) refit on their times; the search
    run again with it (`search_again(calibration, budgets, settled)`: (label, [Evaluated]) pairs; `settled(label,
    evaluated)`: made already or not to be compiled, so not worth checking by its programs), under a budget
    lowered by the model's peak error where no finalist fit (`_refit_budgets`); its new finalists timed
    beside round 1's choice (round 2). `programs` (`pool.Programs`): finalists of one partition compiled and
    timed once, in worker processes first; `stand_ins`: torch's partitions' compiled methods (`_make`). A budget
    with no new finalist in round 2 keeps round 1's choice: where that is a torch partition read back, its own
    program (`_own_program`, kept in `own`) compiles beside round 2's finalists, in a worker that would wait.
    `near(label, chromosome, problem, deadline)`: a policy next to a torch partition round 1 chose where none of
    its finalists of the search's own fit (`compare_screen.kept_near`'s `Nearby`), timed in round 2 too
    (`_near_torch`)."""
    budget_of, labels = dict(budgets), [label for label, _ in budgets]
    chosen, first, unfit = _finalists_round(shortlist, 1, problem, made, method, budget_of, resident,
                                            measure_methods, progress, programs, stand_ins)
    if not first:  # nothing fits by the model: nothing to refit on or to search again for
        return _final_choice(labels, {}, {}, progress), []
    keys = problem.encoding.captured_keys()
    refit = step_model.refit(problem.calibration, problem,
                                 [(row["knob"], Chromosome(keys, a), row["step_s"]) for a, row in first.items()])
    progress(f"  second round: the model refit on its {len(problem.calibration.samples)} calibration points and "
             f"the {len(first)} finalists' times "
             f"(within {refit.worst_error():.1%} of them), searched again"
             + "".join(f"; at {label} under the budget over the peak error" for label in unfit))
    again = [(label, budget) for label, budget in budgets if label not in unfit]
    refitted = step_model.CompiledProblem(problem.graph, problem.costs, None, problem.space, loss=problem.loss,
                                          calibration=refit)
    standing = {label: refitted.simulate(e.chromosome).step_time for label, e in chosen.items()}

    def settled(label: str, e: Evaluated) -> bool:  # made already, or not to be compiled (`_second_round`)
        return e.chromosome.actions in made or e.step_time > _time_limit(standing, label)

    retry = search_again(refit, again + _refit_budgets(unfit, budget_of, resident), settled)
    round2 = _second_round(retry, made, chosen, standing, progress)
    if near is not None:
        own_fit = _own_fitting(shortlist, made, first, stand_ins, budget_of, resident)
        round2 = _near_torch(round2, {label: e for label, e in chosen.items() if label not in own_fit}, first, made,
                             stand_ins, refitted, standing, near, resident, budget_of, progress)
    again_at = {label for label, _ in round2}
    picks = [] if own is None else [
        _own_program(label, e, made, method, problem, stand_ins, own) for label, e in chosen.items()
        if label not in again_at and _stands_in(made[e.chromosome.actions][0], stand_ins)]
    chosen2, second, _ = _finalists_round(round2, 2, refitted, made, method, budget_of, resident, measure_methods,
                                          progress, programs, stand_ins, [p for p in picks if p[2]])
    tuning = {id(row): row for row in [*first.values(), *second.values()]}  # a row per program and round
    return _final_choice(labels, chosen, chosen2, progress), list(tuning.values())


def _finalists_round(finalists, number: int, problem, made: dict, method, budget_of, resident, measure_methods,
                     progress, programs=None, stand_ins=None, picks=()) -> tuple[dict, dict, dict]:
    """Round `number` of the finalists ((label, [Evaluated]) pairs): each distinct one not in `made` made
    (`method(label, evaluated, problem)`, added to `made` as (Method, Policy, problem)); with `programs`
    (`pool.Programs`), one whose partition saves what one made before saves stands for that one (its entry in
    `made` is that one's: the same programs, compiled and timed once) and the others are compiled in worker
    processes; each program numbered in its knob. Then all timed together in rounds of their own
    (`measure_methods`), so the head to head that follows times the chosen ones afresh: picking the fastest
    of several noisy timings does not flatter the figures compared. Returns per budget the finalist measured
    fastest among those whose measured peak is at or under the budget, the smallest peak among those within `TIE`
    of it (`_least_memory_of_the_fastest`; {label: Evaluated}), the measured rows
    ({actions: row}, with their `round`; one row per program), and the budgets where none is, each with the
    largest measured / predicted peak of its finalists (`_refit_budgets`). `stand_ins`, `picks`: see `_make`."""
    _make(finalists, problem, made, method, programs, stand_ins, picks)
    timed = list(dict.fromkeys(e.chromosome.actions for _, evaluated in finalists for e in evaluated))
    if not timed:
        return {}, {}, {}
    methods = list({id(made[a][0]): made[a][0] for a in timed}.values())
    index = {a: [id(m) for m in methods].index(id(made[a][0])) for a in timed}
    theirs = sum(_stands_in(m, stand_ins) for m in methods)
    progress(f"  timing {len(methods)} finalists (round {number}"
             + (f"; {theirs} of torch's partitions in torch.compile's programs of them" if theirs else "") + ")")
    contenders = partial(_contenders, index, finalists, budget_of, resident)
    measured = [row | {"round": number} for row in
                measure_methods(methods, TUNING_ROUNDS, TUNING_STEPS, metered=1, prune=contenders,
                                round_s=compiled_methods.ROUND_S)]
    rows = {a: measured[index[a]] for a in timed}
    chosen, unfit = {}, {}
    number_of = lambda e: made[e.chromosome.actions][0].knob.rsplit(" ", 1)[-1]
    for label, evaluated in finalists:
        fits = [e for e in evaluated if rows[e.chromosome.actions]["peak_bytes"] <= budget_of[label] - resident]
        if not fits:
            unfit[label] = max(rows[e.chromosome.actions]["peak_bytes"] / max(e.peak_bytes - resident, 1)
                               for e in evaluated)
            continue
        chosen[label] = _least_memory_of_the_fastest(fits, rows)
        progress(f"  at {label}: finalist {number_of(chosen[label])} of "
                 + ", ".join(dict.fromkeys(number_of(e) for e in evaluated)))
    return chosen, rows, unfit


def _timed_once(methods: list[Method], measure_methods) -> list[dict]:
    """A row per method of `methods`, each compiled step timed once (`measure_methods(distinct methods)`): a policy
    picked at several budgets runs one step (`_picked`), whose row each of its budgets gets under its own knob. (Timed
    apart, densenet's one pick at three budgets read 83.07, 80.45 and 82.65 ms in one head to head, and its verdicts
    compared torch's partitions with three readings of one program.)"""
    first = {}  # id of a compiled step -> the first method running it
    for m in methods:
        first.setdefault(id(m.run), m)
    row_of = dict(zip(first, measure_methods(list(first.values()))))
    return [row_of[id(m.run)] | {"knob": m.knob} for m in methods]


def _least_memory_of_the_fastest(fits: list, rows: dict):
    """Of `fits` (Evaluated; `rows`: actions -> measured row), the smallest measured peak among those measured
    within `TIE` of the fastest: a difference the timings cannot tell buys no memory (on the GRU, torch 1's
    partition was picked at 9.93 ms over a policy of 16 % less memory at 9.98)."""
    fastest = min(rows[e.chromosome.actions]["step_s"] for e in fits)
    near = [e for e in fits if rows[e.chromosome.actions]["step_s"] <= fastest * (1 + TIE)]
    return min(near, key=lambda e: (rows[e.chromosome.actions]["peak_bytes"], rows[e.chromosome.actions]["step_s"]))


def _make(finalists, problem, made: dict, method, programs=None, stand_ins=None, picks=()) -> None:
    """Add to `made` the finalists not in it (`_finalists_round`): made by `method`, those of a partition
    made before standing for that one (`programs.same`; a torch partition's origin passed on to it), each
    other numbered after the programs made so far, and compiled by `programs`. A torch partition read back
    (`stand_ins`: its actions -> torch.compile's Method at that budget, compiled already) is timed in
    torch.compile's program, the same as its own would be (`_standing_in`): not compiled again. `picks`
    ([(Method, Policy, ...)]: picks settled already) are compiled with them, not timed."""
    new = {}
    for label, evaluated in finalists:
        for e in evaluated:
            a = e.chromosome.actions
            if a not in made and a not in new:
                m, policy = method(label, e, problem)
                new[a] = (label, _standing_in(m, stand_ins[a]) if a in (stand_ins or {}) else m, policy)
    # torch's programs first: a finalist of the same partition is timed in them, not compiled
    new = dict(sorted(new.items(), key=lambda item: not _stands_in(item[1][1], stand_ins)))
    same = programs.same([(m, policy) for _, m, policy in new.values()], "finalist") if programs else [None] * len(new)
    count = len({id(m) for m, *_ in made.values()})
    fresh = []
    for (a, (label, m, policy)), first in zip(new.items(), same):
        if first is None:
            count += 1
            m.knob = f"{label} #{count}"
            made[a] = (m, policy, problem)
            if not _stands_in(m, stand_ins):
                fresh.append((m, policy))
        else:
            if first.origin == "search" and m.origin not in ("", "search"):
                first.origin = m.origin  # a torch partition's programs: say so
            made[a] = next(v for v in made.values() if v[0] is first)
    if programs:
        programs.compile(fresh + [p[:2] for p in picks], ["finalist"] * len(fresh) + ["pick"] * len(picks))


def _standing_in(m: Method, compiled: Method) -> Method:
    """`m` (a torch partition read back) training `compiled`'s model with torch.compile's program of that
    partition (warmed up already): timed for it without compiling the same programs again."""
    return replace(m, model=compiled.model, run=compiled.run, optimizer=compiled.optimizer,
                   compile_s=compiled.compile_s, precompiled_s=compiled.precompiled_s, programs=compiled.programs)


def _stands_in(m: Method, stand_ins) -> bool:
    """Whether `m` runs a torch.compile program of `stand_ins` (`_standing_in`)."""
    return any(m.run is compiled.run for compiled in (stand_ins or {}).values())


def _contenders(index: dict, finalists, budget_of: dict, resident: int, rows: list[dict]) -> set[int]:
    """The indices in `rows` (the measured rows so far; `index`: each finalist's actions -> the index of its
    row) of the finalists still worth timing: at some budget of theirs (`finalists`: (label, [Evaluated])
    pairs) measured at or under it and not clearly slower than the fastest there (its slowest step faster than
    their fastest, by `SEPARATED`). The others cannot be chosen: over every budget of theirs, or separated by
    the timings alone."""
    row_of = {a: rows[i] for a, i in index.items()}
    keep = set()
    for label, evaluated in finalists:
        fits = [e.chromosome.actions for e in evaluated
                if row_of[e.chromosome.actions]["peak_bytes"] <= budget_of[label] - resident]
        if fits:
            best = min(fits, key=lambda a: row_of[a]["step_s"])
            keep |= {a for a in fits if row_of[a]["step_min"] <= row_of[best]["step_max"] * (1 + SEPARATED)}
    return {index[a] for a in keep}


def _second_round(finalists, made: dict, chosen: dict, standing: dict | None = None,
                  progress=lambda line: None) -> list[tuple[str, list]]:
    """The second search's `finalists` that no round compiled yet (`made`), each budget's with the first
    round's choice there (`chosen`: timed again beside them); a budget with none new is dropped (its first
    choice stands). A new one the refit model predicts less than `MIN_GAIN` faster than the choice there
    (`standing`: label -> that choice's seconds by the same model) is not compiled: the model that has seen the
    choice's time sees no gain worth a compile in it."""
    out = []
    for label, evaluated in finalists:
        new = [e for e in evaluated if e.chromosome.actions not in made]
        limit = _time_limit(standing or {}, label)
        hopeful = [e for e in new if e.step_time <= limit]
        if len(hopeful) < len(new):
            progress(f"  at {label}: {len(new) - len(hopeful)} of the second search's new finalists not compiled, "
                     f"predicted less than {MIN_GAIN * 100:g} % faster than the choice there ({limit * 1e3:.2f} ms)")
        if hopeful:
            out.append((label, hopeful + ([chosen[label]] if label in chosen else [])))
    return out


def _own_fitting(finalists, made: dict, rows: dict, stand_ins, budget_of: dict, resident: int) -> set[str]:
    """The budgets (labels) where a finalist of the search's own (not timed in torch.compile's program) measured at
    or under the budget (`finalists`: (label, [Evaluated]) pairs; `rows`: actions -> its measured row)."""
    return {label for label, evaluated in finalists for e in evaluated
            if not _stands_in(made[e.chromosome.actions][0], stand_ins)
            and rows[e.chromosome.actions]["peak_bytes"] <= budget_of[label] - resident}


def _near_torch(round2, chosen: dict, rows: dict, made: dict, stand_ins, problem, standing: dict, near, resident: int,
                budget_of: dict, progress) -> list[tuple[str, list]]:
    """`round2` ((label, [Evaluated]) pairs) with, at each budget whose first-round choice (`chosen`) is a torch
    partition timed in torch.compile's program, the policy `near` finds next to it (`compare_screen.kept_near`,
    within `KEPT_NEAR_S` a partition: at its smallest budget first, then at a larger one only where that policy
    does not fit it), beside that choice: where it is new and its programs hold less than the choice measured
    (`rows`: actions -> round 1's row), or `problem` (refit) predicts it `MIN_GAIN` faster (`standing`). The model
    cannot tell which of torch's recomputations cost memory in inductor's programs; the programs can."""
    added, deadline, found_at = {}, {}, {}  # label -> policy; start actions -> its deadline, what was found
    for label, e in sorted(chosen.items(), key=lambda item: budget_of[item[0]]):
        a = e.chromosome.actions
        if not _stands_in(made[a][0], stand_ins):  # round 1's choices are all made
            continue
        partition_name = f"{made[a][0].origin}'s partition"
        nearby = next((n for n in found_at.get(a, ()) if n.policy.peak_bytes <= budget_of[label]), None)
        if nearby is None:
            nearby = near(label, e.chromosome, problem, deadline.setdefault(a, time.monotonic() + KEPT_NEAR_S))
        tried = f"of the values {partition_name} recomputes, {nearby.tried} tried kept alone, {nearby.fitted} fit"
        if nearby.policy is None:
            progress(f"  at {label}: " + (f"{tried} by inductor's programs" if nearby.tried else
                                          f"none {partition_name} recomputes is predicted faster kept"))
            continue
        found_at.setdefault(a, []).append(nearby)
        found = nearby.policy
        fresh = found.chromosome.actions not in made
        smaller = found.peak_bytes - resident < rows[a]["peak_bytes"]
        worth = fresh and (smaller or found.step_time <= _time_limit(standing, label))
        progress(f"  at {label}: {tried}; {nearby.kept} kept: its programs {format_size(found.peak_bytes - resident)} "
                 f"against {format_size(rows[a]['peak_bytes'])} measured, predicted "
                 f"{found.step_time / standing[label] - 1:+.1%}: "
                 + ("a finalist" if worth else "made already" if not fresh else
                    f"not compiled (no less memory, nor {MIN_GAIN * 100:g} % faster predicted)"))
        if worth:
            added[label] = found
    out = [(label, [*evaluated, added.pop(label)] if label in added else evaluated) for label, evaluated in round2]
    return out + [(label, [found, chosen[label]]) for label, found in added.items()]


def _time_limit(standing: dict, label: str) -> float:
    """The predicted seconds above which a second-round finalist at `label` is not compiled: `MIN_GAIN` under the
    choice there (`standing`: label -> its seconds by the refit model); none where nothing stands."""
    return standing.get(label, float("inf")) * (1 - MIN_GAIN)


def _final_choice(labels, first: dict, second: dict, progress) -> dict:
    """Per budget label, in `labels`' order, the second round's choice, else the first's; a budget with
    neither is left out: a policy over its budget is not gaswap's at that budget."""
    out = {}
    for label in labels:
        chosen = second.get(label, first.get(label))
        if chosen is None:
            progress(f"  at {label}: left out, no policy at or under the budget (by the model or measured)")
        else:
            out[label] = chosen
    return out


def _picked(chosen: dict, made: dict, method, budget_of, problem, stand_ins=None, own: dict | None = None
            ) -> list[tuple[Method, policies.Policy]]:
    """[(Method, Policy)] of the `chosen` ({label: Evaluated}) at each budget, knobbed by it: the one `made`
    (actions -> (Method, Policy, problem)), and where it was picked already (the same programs picked at two
    budgets) a Method of its own running the same compiled step; a policy not made is compiled as `problem`
    predicts it (untimed finalists), and one timed in torch.compile's program (`_standing_in`, its own or one of
    the same partition) is that torch partition read back, compiled (`_own_program`; `own`: those made already)."""
    out, used, own = [], set(), {} if own is None else own
    for label, e in chosen.items():
        a = e.chromosome.actions
        if a in made and not _stands_in(made[a][0], stand_ins):
            m, policy, _ = made[a]
        else:
            m, policy, _ = _own_program(label, e, made, method, problem, stand_ins, own)
        m = replace(m, knob=label) if id(m) in used else m
        used.add(id(m))
        m.knob = label
        out.append((m, _with_budget(policy, label, budget_of[label])))
    return out


def _own_program(label: str, e, made: dict, method, problem, stand_ins, own: dict) -> tuple:
    """(Method, Policy, whether made now) of the policy `e` picked at `label` as it runs on its own: a torch
    partition timed in torch.compile's program (`_standing_in`) read back as that partition, or a policy not
    timed; made by `method` once per partition (`own`: actions -> (Method, Policy))."""
    a = e.chromosome.actions
    if a in made:  # timed in a torch program: that partition read back (compiled once, however often picked)
        a = next(k for k, compiled in stand_ins.items() if compiled.run is made[a][0].run)
        e = replace(e, chromosome=replace(e.chromosome, actions=a))
    if a in own:
        return *own[a], False
    own[a] = method(label, e, problem)
    return *own[a], True


def _refit_budgets(unfit: dict[str, float], budget_of: dict[str, int], resident: int) -> list[tuple[str, int]]:
    """(label, bytes) budgets for a second search where no finalist measured under its budget: the budget
    above resident divided by how far over their predictions the finalists measured (`unfit`: label ->
    the largest measured / predicted peak), so that a policy the model errs on as much still fits."""
    return [(label, resident + int((budget_of[label] - resident) / ratio)) for label, ratio in unfit.items()
            if ratio > 1]


def _with_budget(policy: policies.Policy, label: str, budget_bytes: int) -> policies.Policy:
    """`policy` with the budget it was picked at in its provenance."""
    return replace(policy, provenance=policy.provenance | {"budget": label, "budget_bytes": budget_bytes})


def _with_program_peak(policy: policies.Policy, program_peak: int | None, beyond: int = 0) -> policies.Policy:
    """`policy` predicting the peak its compiled programs hold (`compiled_program`) and `beyond` them what the
    meter read beyond torch's partitions' programs on this device (`compare_screen.offset`, recorded as
    `beyond_programs_bytes`: a few kB on a CPU; 147 MB of cuDNN's workspaces for compare_cnn_cpu on an H100,
    `results/gpu_check/`); the search model's prediction stays beside it as `search_peak_bytes`."""
    if program_peak is None:
        return policy
    predicted = policy.predicted
    return replace(policy, predicted=predicted | {"peak_bytes": program_peak + beyond + predicted["resident_bytes"],
                                                  "beyond_programs_bytes": beyond,
                                                  "search_peak_bytes": predicted["peak_bytes"]})


def _program_peak(m: Method, output_bytes: int, loss: str, progress) -> int | None:
    """The step peak above resident of the programs inductor generated for `m`, their library calls' scratch
    counted (None: none recorded, or programs `compiled_program` cannot read, said through `progress`)."""
    if not m.programs:
        return None
    try:
        return programs.step_peak(m.programs, output_bytes, loss, library_calls.scratch)
    except programs.ProgramError as e:
        progress(f"  {m.name} {m.knob}: no program peak ({e})")
        return None


def _budgets(peaks: list[int], below, resident: int) -> list[tuple[str, int]]:
    """(label, bytes): the distinct `peaks` (highest first), then `below` times the lowest; labelled by what
    the meter would read (the bytes above `resident`), distinct peaks apart however close
    (`compare_report.budget_labels`)."""
    peaks = sorted(set(peaks), reverse=True)
    labels = budget_labels([p - resident for p in peaks])
    return ([*zip(labels, peaks)]
            + [(f"{f:g}x {labels[-1]}", resident + int(f * (peaks[-1] - resident))) for f in below])


def _labels_of(budgets: list[tuple[str, int]], peaks: list[int]) -> list[str]:
    """The label of the budget each of `peaks` became (`_budgets`)."""
    label_of = {b: label for label, b in reversed(budgets)}
    return [label_of[p] for p in peaks]


def _peak_reached(m: Method, inputs, target, exp, device, progress) -> int:
    """The peak one step of `m` measures (bytes above what is allocated before it), after its warm-up."""
    compiled_methods.warm_up(m, inputs, target, exp.loss, device, progress)
    return training.metered_peak(partial(m.step, inputs, target, exp.loss, device), device)[0]


def _inductor(settings: dict | None) -> dict:
    """A policy's provenance entry for the inductor settings its programs fit under (`compare_screen.VARIANTS`;
    none: inductor's defaults)."""
    return {"inductor": dict(settings)} if settings else {}


def _count(chromosome) -> int:
    return sum(1 for a in chromosome.actions if a == Action.RECOMPUTE)


def command(args) -> int:
    """Run the comparison from parsed arguments and print the table."""
    below = tuple(float(b) for b in args.below.split(",") if b.strip())
    run(args.experiment, rounds=args.rounds, steps=args.steps, below=below, finalists=args.finalists,
        results_root=args.results, cache_dir=args.cache, workers=args.workers)
    name = config.load_experiment(args.experiment).name
    print((Path(args.results) / name / "compare.md").read_text(), end="")
    print(f"wrote {Path(args.results) / name}/ (compare.csv, compare.md, compiled/)")
    return 0
