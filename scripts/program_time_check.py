"""Step time predicted from inductor's programs (`gaswap.compiled.program_time`) against the search's model
(`gaswap.compiled.step_model`), both fitted on the same calibration runs, on policies neither was fitted on.

    PYTHONPATH=. python scripts/program_time_check.py experiments/compare_separable_cpu.yaml [...] --tag run1

Per experiment, in one process: the seven calibration policies (`step_model.calibration_policies`),
torch.compile at activation_memory_budget 1.0 / 0.5 / 0.2 and the gaswap picks stored in
`results/compiled_model/measured/<experiment>.csv` are compiled and timed together in rotated rounds
(`methods.measure`: CPU seconds per step, median). Then each calibration policy's calls are timed
(`program_time.timed_calls`, a few steps each). Both models are fitted on the calibration policies alone: the
search's on their step times (`step_model.fit`), the program model on their step times and calls
(`ProgramTimes.fit`). torch's partitions and the gaswap picks are then predicted from their programs (the
program model) and from their actions (the search's model: torch's read back) and compared with their measured
time. Writes `results/compiled_model/program_time_<tag>.csv`, one row per policy, and prints a summary.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compiled_model_errors import _chromosome, _setup  # noqa: E402

from gaswap.base.files import csv_text, write_atomic  # noqa: E402
from gaswap.compiled import partition, program_time, step_model  # noqa: E402
from gaswap.compiled import methods as compiled_methods  # noqa: E402
from gaswap.compiled.methods import Method  # noqa: E402
from gaswap.plan.encoding import Chromosome  # noqa: E402
from gaswap.run import training  # noqa: E402

TORCH_BUDGETS = (1.0, 0.5, 0.2)
CALL_STEPS = 5  # steps whose calls are timed, per calibration policy
COLUMNS = ("experiment", "label", "kind", "step_s", "step_min", "step_max", "program_s", "program_error",
           "model_s", "model_error", "unseen_calls", "outside_s")


def check(path: str, out: Path, rounds: int, steps: int) -> list[dict]:
    exp, device, model, inputs, target, graph, costs, space = _setup(path, out)
    problem = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss)
    provenance = {"optimizer": exp.optimizer, "counts": sorted(exp.counts)}
    entries = []  # (label, kind, chromosome, Method)

    def gaswap_method(label, kind, c):
        policy = partition.make_policy(graph, problem.actions_of(c), provenance=provenance)
        m, opt = training.fresh_copy(model, exp.optimizer)
        entries.append((label, kind, c, Method("gaswap", label, m, partition.compile(m, policy), opt)))

    for label, c in step_model.calibration_policies(problem).items():
        gaswap_method(f"cal {label}", "calibration", c)
    for budget in TORCH_BUDGETS:
        _, actions = partition.torch_partition(model, *inputs, budget=budget, optimizer=exp.optimizer,
                                               counted=exp.counts)
        c = problem.canonical(Chromosome(problem.encoding.captured_keys(),
                                         compiled_methods.partition_actions(problem.encoding, actions)))
        m, opt = training.fresh_copy(model, exp.optimizer)
        entries.append((f"torch {budget:g}", "torch", c,
                        Method("torch.compile", f"{budget:g}", m, compiled_methods.torch_compiled(m, budget), opt)))
    with open(out / "measured" / f"{exp.name}.csv") as f:
        for r in csv.DictReader(f):
            if r["kind"] == "gaswap":
                gaswap_method(r["label"], "gaswap", problem.canonical(_chromosome(problem, r["actions"])))
    compiled_methods.allow_recompiles(len(entries) + 5)
    rows = compiled_methods.measure([e[3] for e in entries], inputs, target, exp.loss, device, rounds, steps,
                                    lambda line: print(line, flush=True), metered=1)
    calibration = [(e, row) for e, row in zip(entries, rows) if e[1] == "calibration"]
    timed = []
    for (label, _, _, m), row in calibration:
        run = partial(m.step, inputs, target, exp.loss, device)
        calls = program_time.timed_calls(m.programs, lambda: [run() for _ in range(CALL_STEPS)])
        timed.append((label, m.programs, row["step_s"], {k: (s / CALL_STEPS, n // CALL_STEPS)
                                                          for k, (s, n) in calls.items()}))
    programs_model = program_time.ProgramTimes.fit(timed)
    fitted = step_model.fit(step_model.samples(problem, [(e[0], e[2], row["step_s"]) for e, row in calibration]))
    priced = step_model.CompiledProblem(graph, costs, None, space, loss=exp.loss, calibration=fitted)
    print(f"{exp.name}: program model fit within {programs_model.spread:.1%} of its points, outside the calls "
          f"{programs_model.outside * 1e3:.2f} ms; the search's model within {fitted.worst_error():.1%}", flush=True)
    out_rows = []
    for (label, kind, c, m), row in zip(entries, rows):
        program_s = programs_model.step_time(m.programs)
        model_s = priced.simulate(c).step_time
        out_rows.append({"experiment": exp.name, "label": label, "kind": kind, "step_s": row["step_s"],
                         "step_min": row["step_min"], "step_max": row["step_max"], "program_s": program_s,
                         "program_error": program_s / row["step_s"] - 1, "model_s": model_s,
                         "model_error": model_s / row["step_s"] - 1,
                         "unseen_calls": programs_model.unseen(m.programs), "outside_s": programs_model.outside})
        print(f"  {label:24s} measured {row['step_s'] * 1e3:8.2f} ms  programs {program_s * 1e3:8.2f} "
              f"({out_rows[-1]['program_error']:+.1%}, {out_rows[-1]['unseen_calls']:.0%} calls unseen)  "
              f"model {model_s * 1e3:8.2f} ({out_rows[-1]['model_error']:+.1%})", flush=True)
    return out_rows


def summary(rows: list[dict]) -> str:
    lines = ["| experiment | held out | programs: largest error | within 10 % | search's model: largest | within 10 % |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["experiment"] for r in rows):
        held = [r for r in rows if r["experiment"] == name and r["kind"] != "calibration"]
        p = [r["program_error"] for r in held]
        s = [r["model_error"] for r in held]
        lines.append(f"| {name} | {len(held)} | {max(p, key=abs):+.1%} | {sum(abs(e) <= 0.10 for e in p)} | "
                     f"{max(s, key=abs):+.1%} | {sum(abs(e) <= 0.10 for e in s)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--out", default=str(ROOT / "results" / "compiled_model"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tag", default="current")
    args = parser.parse_args()
    out = Path(args.out)
    start = time.process_time()
    rows = [row for path in args.experiments for row in check(path, out, args.rounds, args.steps)]
    write_atomic(out / f"program_time_{args.tag}.csv", csv_text(rows, COLUMNS))
    print(summary(rows))
    print(f"{time.process_time() - start:.0f} CPU s in this process; median held-out |error|: programs "
          f"{statistics.median(abs(r['program_error']) for r in rows if r['kind'] != 'calibration'):.1%}, model "
          f"{statistics.median(abs(r['model_error']) for r in rows if r['kind'] != 'calibration'):.1%}")


if __name__ == "__main__":
    main()
