"""Run 11's diagnostic, as it ran on the device (repository root, deap importable, $OUT set): why gaswap's runner
issues the same ops more slowly in a step that swaps (run 10: 39-42 us an op against 23 in keep-all). gpt_bench's
keep-all and every-candidate-swapped programs: each instruction's host time with the garbage collector on and off,
and each program's host time by aten op under torch.profiler (CPU only)."""
import gc
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gaswap.app import gpu_check, validate, workflow
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.plan.encoding import Encoding
from gaswap.plan.policy import Action
from gaswap.plan.simulator import Simulator
from gaswap.run import measure
from gaswap.run.runtime import StepRunner

out = Path(os.environ.get("OUT", "/tmp/diag11_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag11")
device = os.environ.get("DIAG_DEVICE", "cuda")
exp = config.load_experiment(gpu_check.derived_experiment("experiments/gpt_bench.yaml", work, device))
prepared = workflow.prepare(exp, cache_dir=work / "cache")
workflow.run_search(prepared, work / "results" / exp.name, force=True)
policy_path = work / "results" / exp.name / "policy.yaml"
policy = policies.load(policy_path)
dev = torch.device(device)
model, inputs, target, captured = validate._captured(policy, policy_path, exp, dev)
graph, costs = prepared.graph, prepared.costs
encoding = Encoding(graph)
simulator = Simulator(graph, costs)
order = encoding.decode(encoding.uniform(Action.KEEP).keys)
programs = {name: simulator.run(order, encoding.uniform(action).actions, trace=True).program
            for name, action in (("keep_all", Action.KEEP), ("swap_all", Action.SWAP))}
make_args = lambda: captured.arguments(model, [x.clone() for x in inputs], target.clone())  # noqa: E731
report = {}


def host_timed(program):
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # read when the runner's code is generated
    try:
        return measure._TimedRunner(captured, program, dev)
    finally:
        torch.cuda.synchronize = synchronize


def by_verb(runner, program):
    verbs = defaultdict(list)
    for i, seconds in enumerate(runner._times):
        if seconds and i < len(program):
            verbs[str(program[i][0])].append(statistics.median(seconds))
    return {v: {"count": len(s), "us_each": round(statistics.mean(s) * 1e6, 1)} for v, s in verbs.items()}


for name, program in programs.items():
    for collector in ("on", "off"):
        runner = host_timed(program)
        (gc.enable if collector == "on" else gc.disable)()
        for run in range(13):
            if run == 3:
                runner.reset()
            runner(make_args())
            measure.sync(dev)
        gc.enable()
        report[f"{name}_gc_{collector}"] = by_verb(runner, program)
        print(name, "gc", collector, report[f"{name}_gc_{collector}"], flush=True)
    runner = StepRunner(captured, program, dev)
    for _ in range(3):
        runner(make_args())
    measure.sync(dev)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            runner(make_args())
            measure.sync(dev)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    report[f"{name}_profile"] = [(e.key, e.count // 5, round(e.self_cpu_time_total / 5 / 1e3, 3),
                                  round(e.cpu_time_total / max(e.count, 1), 1)) for e in rows]
    print(name, "profile (op, calls a step, self CPU ms a step, CPU us a call):", flush=True)
    for row in report[f"{name}_profile"][:18]:
        print("   ", row, flush=True)
(out / "run11_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
