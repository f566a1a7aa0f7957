"""How far the compiled model's predictions are from measured: peaks (the search model's, the ops one by one,
the generated program's) and CPU time per step, for torch's partitions, gaswap's picks and the calibration
policies, per experiment.

    PYTHONPATH=. python scripts/compiled_model_errors.py measure experiments/compare_cnn_cpu.yaml
    PYTHONPATH=. python scripts/compiled_model_errors.py report experiments/compare_*_cpu.yaml --tag after
    PYTHONPATH=. python scripts/compiled_model_errors.py dry experiments/compare_*_cpu.yaml --tag after

`measure` (the slow part: a compile per policy) compiles and trains, one experiment at a time: the seven
calibration policies (`step_model.calibration_policies`) and torch.compile at activation_memory_budget 1.0 /
0.5 / 0.2, timed together in rotated rounds (the first timing: the calibration is fitted on it, as `compare`
fits it on runs timed before the others); then gaswap's picks, the fastest policy the calibrated search finds
at each torch peak and at 0.8x the lowest; then every policy again, timed together (the times reported). It
stores, under `--out` (results/compiled_model/), each policy's actions (one letter per candidate, k / r) and
what was measured (`measured/<experiment>.csv`: peak by the allocator meter, `gaswap.run.peak_meter`; median
CPU seconds per step and range; `first_step_s`, the first timing), the generated programs under `--programs`
(not committed), and the op costs' cache (`costs/`, so a report re-prices with the same op times).

`report` re-prices the stored policies with the model of the code at hand: the calibration fitted again on
the stored calibration policies' first timing (and, where the model fits peaks, their measured peaks), each
policy's predicted peak (`CompiledProblem`) and time, the ops one by one (`Problem`), the stored generated
programs' peak (`programs.step_peak`); it writes `errors_<tag>.csv` and `errors_<tag>.md` (per experiment
and kind, the largest error of each prediction and how many are within 5 % / 10 %; torch's partitions' time
also against their first timing, beside the calibration's). The calibration policies are the fit's own
points.

`dry` has inductor write each stored policy's programs without compiling their kernels (`dry_compile`; torch's
partitions through its own partitioner at their budget) and writes `dry_<tag>.csv`: their peak beside the
meter's and the stored real compile's program peak, and the CPU seconds each took.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gaswap.base import config
from gaswap.base.files import csv_text, write_atomic
from gaswap.compiled import dry_compile, partition, programs, step_model
from gaswap.compiled import methods as compiled_methods
from gaswap.compiled.methods import Method
from gaswap.plan.encoding import Action, Chromosome
from gaswap.plan.problem import Problem
from gaswap.plan.search import search
from gaswap.run import training
from gaswap.run.measure import measure

TORCH_BUDGETS = (1.0, 0.5, 0.2)
BELOW = 0.8
MEASURED = ("experiment", "label", "kind", "actions", "peak_bytes", "peak_min", "peak_max", "step_s", "step_min",
            "step_max", "programs", "first_step_s")
ERRORS = ("experiment", "label", "kind", "recomputed", "peak_bytes", "model_peak_bytes", "opwise_peak_bytes",
          "program_peak_bytes", "step_s", "model_step_s", "model_peak_error", "opwise_peak_error",
          "program_peak_error", "step_error", "first_step_error")


def _letters(c: Chromosome) -> str:
    return "".join("r" if a == Action.RECOMPUTE else "k" for a in c.actions)


def _chromosome(problem, letters: str) -> Chromosome:
    return Chromosome(problem.encoding.captured_keys(),
                      tuple(int(Action.RECOMPUTE if ch == "r" else Action.KEEP) for ch in letters))


def _setup(path: str, out: Path):
    exp = config.load_experiment(path)
    device, model, inputs, target, graph = compiled_methods.setup(exp)
    costs = measure(graph, device, out / "costs", threads=exp.costs.threads)
    space = config.load_search_space(partition.SPACE)
    return exp, device, model, inputs, target, graph, costs, space


def _time(methods, exp, inputs, target, device, rounds: int, steps: int) -> list[dict]:
    return compiled_methods.measure(methods, inputs, target, exp.loss, device, rounds, steps,
                                    lambda line: print(line, flush=True), metered=1)


def calibration_and_torch(exp, model, inputs, graph, problem) -> tuple[list, Callable]:
    """(entries, add): the entries (label, kind, chromosome, Method) of the calibration policies
    (`step_model.calibration_policies`) and torch.compile at each of `TORCH_BUDGETS`, each its own copy of
    `model`; `add(label, kind, chromosome)` appends a gaswap policy's."""
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    entries = []

    def add(label, kind, c):
        policy = partition.make_policy(graph, problem.actions_of(c), provenance=provenance)
        m, opt = training.fresh_copy(model, exp.optimizer)
        entries.append((label, kind, c, Method("gaswap", label, m, partition.compile(m, policy), opt)))

    for label, c in step_model.calibration_policies(problem).items():
        add(f"cal {label}", "calibration", c)
    for budget in TORCH_BUDGETS:
        _, actions = partition.torch_partition(model, *inputs, budget=budget, optimizer=exp.optimizer,
                                               counted=exp.counts)
        c = problem.canonical(problem.encoding.read_back(actions))
        m, opt = training.fresh_copy(model, exp.optimizer)
        entries.append((f"torch {budget:g}", "torch", c,
                        Method("torch.compile", f"{budget:g}", m, compiled_methods.torch_compiled(m, budget), opt)))
    return entries, add


def measure_experiment(path: str, out: Path, program_dir: Path, rounds: int, steps: int) -> None:
    """Compile and time the calibration policies, torch's partitions and gaswap's picks of one experiment."""
    exp, device, model, inputs, target, graph, costs, space = _setup(path, out)
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    entries, gaswap_method = calibration_and_torch(exp, model, inputs, graph, problem)
    n_cal = sum(kind == "calibration" for _, kind, _, _ in entries)
    compiled_methods.allow_recompiles(len(entries) + 5)
    first = _time([e[3] for e in entries], exp, inputs, target, device, rounds, steps)
    calibration = step_model.fit_measured(problem, [
        (label, c, row["step_s"], row["peak_bytes"]) for (label, _, c, _), row in zip(entries[:n_cal], first[:n_cal])])
    resident = problem.fused.resident_bytes()
    torch_peaks = sorted({row["peak_bytes"] for row in first[n_cal:]}, reverse=True)
    budgets = [resident + p for p in torch_peaks] + [resident + int(BELOW * torch_peaks[-1])]
    known = {e[2].actions for e in entries}
    for k, budget in enumerate(budgets):
        searched = step_model.CompiledProblem(graph, costs, budget, space, loss=exp.loss, calibration=calibration)
        result = search(searched, exp.ga, exp.seed, seeds={e[0]: e[2] for e in entries if e[1] == "torch"})
        if result.best is not None and (c := searched.canonical(result.best.chromosome)).actions not in known:
            known.add(c.actions)
            gaswap_method(f"gaswap {'below' if k == len(torch_peaks) else k + 1}", "gaswap", c)
    rows = _time([e[3] for e in entries], exp, inputs, target, device, rounds, steps)
    folder = program_dir / exp.name
    folder.mkdir(parents=True, exist_ok=True)
    out_rows = []
    for (label, kind, c, m), row, early in zip(entries, rows, first + [None] * len(entries)):
        files = []
        for j, p in enumerate(m.programs):
            files.append(folder / f"{label.replace(' ', '_')}.{j}.py")
            files[-1].write_text(p.code)
        out_rows.append({"experiment": exp.name, "label": label, "kind": kind, "actions": _letters(c),
                         "peak_bytes": row["peak_bytes"], "peak_min": row["peak_min"], "peak_max": row["peak_max"],
                         "step_s": row["step_s"], "step_min": row["step_min"], "step_max": row["step_max"],
                         "programs": ";".join(f.name for f in files),
                         "first_step_s": early["step_s"] if early is not None else None})
    (out / "measured").mkdir(parents=True, exist_ok=True)
    _write(out / "measured" / f"{exp.name}.csv", out_rows, MEASURED)


DRY = ("experiment", "label", "kind", "peak_bytes", "program_peak_bytes", "dry_peak_bytes", "dry_peak_error",
       "same_as_program", "dry_cpu_s")


def dry_experiment(path: str, out: Path, program_dir: Path) -> list[dict]:
    """Each stored policy's program peak written by inductor without compiling its kernels
    (`dry_compile`), beside the meter's and the stored real compile's program peak."""
    exp = config.load_experiment(path)
    with open(out / "measured" / f"{exp.name}.csv") as f:
        stored = list(csv.DictReader(f))
    _, _, model, inputs, _, graph, costs, space = _setup(path, out)
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    output_bytes = graph.tensors[graph.loss].size
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    rows = []
    for r in stored:
        start = time.process_time()
        if r["kind"] == "torch":
            dry = dry_compile.torch_peak(model, float(r["label"].split()[1]), inputs, output_bytes, exp.loss)
        else:
            policy = partition.make_policy(graph, problem.actions_of(_chromosome(problem, r["actions"])),
                                           provenance=provenance)
            dry = dry_compile.policy_peak(model, policy, inputs, output_bytes, exp.loss)
        program = _program_peak(program_dir / exp.name, r["programs"], output_bytes, exp.loss)
        rows.append({"experiment": exp.name, "label": r["label"], "kind": r["kind"], "peak_bytes": int(r["peak_bytes"]),
                     "program_peak_bytes": program, "dry_peak_bytes": dry,
                     "dry_peak_error": _error(dry, int(r["peak_bytes"])),
                     "same_as_program": None if program is None else dry == program,
                     "dry_cpu_s": round(time.process_time() - start, 2)})
        print(f"{exp.name} {r['label']}: dry {dry} program {program} metered {r['peak_bytes']} "
              f"({rows[-1]['dry_cpu_s']} CPU s)", flush=True)
    return rows


def _write(path: Path, rows: list[dict], columns) -> None:
    """`rows`' `columns` (others left out) to the CSV file `path`, whole or not at all."""
    write_atomic(path, csv_text([{k: row.get(k) for k in columns} for row in rows], columns))


def _program_peak(folder: Path, names: str, output_bytes: int, loss: str) -> int | None:
    files = [folder / n for n in names.split(";") if n]
    if not files or not all(f.exists() for f in files):
        return None
    try:
        return programs.step_peak([programs.Program(f.read_text()) for f in files], output_bytes, loss)
    except programs.ProgramError:
        return None


def _first(row: dict) -> float:
    """CPU seconds a step in the first timing, beside the calibration policies (runs before `first_step_s`
    was stored kept the calibration policies' first timing in `step_s`)."""
    return float(row.get("first_step_s") or row["step_s"])


def _error(predicted, measured) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


def report_experiment(path: str, out: Path, program_dir: Path) -> list[dict]:
    """The stored measurements of one experiment, priced by the model at hand."""
    exp = config.load_experiment(path)
    with open(out / "measured" / f"{exp.name}.csv") as f:
        stored = list(csv.DictReader(f))
    _, _, _, _, _, graph, costs, space = _setup(path, out)
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    cal = [r for r in stored if r["kind"] == "calibration"]
    calibration = step_model.fit_measured(problem, [
        (r["label"], problem.canonical(_chromosome(problem, r["actions"])), _first(r), int(r["peak_bytes"]))
        for r in cal])
    priced = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=calibration)
    opwise = Problem(graph, costs, None, space)
    resident = priced.fused.resident_bytes()
    rows = []
    for r in stored:
        c = priced.canonical(_chromosome(problem, r["actions"]))
        sim = priced.simulate(c)
        peak, step = int(r["peak_bytes"]), float(r["step_s"])
        program = _program_peak(program_dir / exp.name, r["programs"], graph.tensors[graph.loss].size, exp.loss)
        row = {"experiment": exp.name, "label": r["label"], "kind": r["kind"],
               "recomputed": r["actions"].count("r"), "peak_bytes": peak,
               "model_peak_bytes": sim.peak_bytes - resident,
               "opwise_peak_bytes": opwise.simulate(c).peak_bytes - resident, "program_peak_bytes": program,
               "step_s": step, "model_step_s": sim.step_time}
        row |= {"model_peak_error": _error(row["model_peak_bytes"], peak),
                "opwise_peak_error": _error(row["opwise_peak_bytes"], peak),
                "program_peak_error": _error(program, peak), "step_error": _error(sim.step_time, step),
                "first_step_error": _error(sim.step_time, _first(r)) if r.get("first_step_s") else None}
        rows.append(row)
    return rows


def _worst(values) -> str:
    values = [v for v in values if v is not None]
    return f"{max(values, key=abs):+.1%}" if values else "-"


def _within(values, limit: float) -> str:
    values = [v for v in values if v is not None]
    return f"{sum(abs(v) <= limit for v in values)}/{len(values)}" if values else "-"


def markdown(rows: list[dict], tag: str) -> str:
    """Per experiment and kind of policy, the largest error of each prediction (signed: + predicted high) and
    how many are within 5 % (peaks) or 10 % (time)."""
    lines = [f"# Compiled model errors ({tag})", "",
             ("Per experiment and kind of policy: the largest error (predicted / measured - 1) and how many are "
              "within 5 % (peaks) or 10 % (time). Measured: the allocator meter's peak above resident, the median "
              "CPU seconds per step. The calibration policies are the time fit's own points (and, with a peak "
              "fit, the peak fit's)."), "",
             ("| experiment | policies | model peak | within 5 % | program peak | within 5 % | ops one by one peak "
              "| time | within 10 % | time, first timing |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["experiment"] for r in rows):
        for kind in ("torch", "gaswap", "calibration"):
            group = [r for r in rows if r["experiment"] == name and r["kind"] == kind]
            if not group:
                continue
            model, program = [r["model_peak_error"] for r in group], [r["program_peak_error"] for r in group]
            times = [r["step_error"] for r in group]
            lines.append(f"| {name} | {kind} ({len(group)}) | {_worst(model)} | {_within(model, 0.05)} | "
                         f"{_worst(program)} | {_within(program, 0.05)} | "
                         f"{_worst(r['opwise_peak_error'] for r in group)} | {_worst(times)} | "
                         f"{_within(times, 0.10)} | {_worst(r['first_step_error'] for r in group)} |")
    held = [r for r in rows if r["kind"] != "calibration"]
    lines += ["", ("Torch's partitions and gaswap's picks (held out), all experiments: model peak within 5 % "
              f"{_within([r['model_peak_error'] for r in held], 0.05)} (median |error| "
              f"{statistics.median(abs(r['model_peak_error']) for r in held):.1%}), program peak within 5 % "
              f"{_within([r['program_peak_error'] for r in held], 0.05)}, time within 10 % "
              f"{_within([r['step_error'] for r in held], 0.10)} (median |error| "
              f"{statistics.median(abs(r['step_error']) for r in held):.1%}).")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("measure", "report", "dry"))
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "results" / "compiled_model"))
    parser.add_argument("--programs", default="/tmp/gaswap_compiled_model_programs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tag", default="current")
    args = parser.parse_args()
    out, program_dir = Path(args.out), Path(args.programs)
    if args.verb == "measure":
        for path in args.experiments:
            measure_experiment(path, out, program_dir, args.rounds, args.steps)
        return
    if args.verb == "dry":
        rows = [row for path in args.experiments for row in dry_experiment(path, out, program_dir)]
        _write(out / f"dry_{args.tag}.csv", rows, DRY)
        return
    rows = [row for path in args.experiments for row in report_experiment(path, out, program_dir)]
    _write(out / f"errors_{args.tag}.csv", rows, ERRORS)
    (out / f"errors_{args.tag}.md").write_text(markdown(rows, args.tag))
    print(markdown(rows, args.tag))


if __name__ == "__main__":
    main()
