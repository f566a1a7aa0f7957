"""Run 14's diagnostic, as it ran on the device (repository root, deap importable, $OUT set): whether the runner's
ops dispatch slower when the GPU lags far behind the host (a deep queue of launches). gpt_bench's keep-all program,
each instruction's host time: as it runs, and with the GPU held back 50 ms at the step's start (`torch.cuda._sleep`)."""
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from gaswap.app import gpu_check, validate, workflow
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.plan.encoding import Encoding
from gaswap.plan.policy import Action
from gaswap.plan.simulator import Simulator
from gaswap.run import measure

out = Path(os.environ.get("OUT", "/tmp/diag14_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag14")
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


cycles = int(torch.cuda.get_device_properties(dev).clock_rate * 1e3 * 0.05)  # about 50 ms of the GPU's clock
for name, lag in (("keep_all", False), ("keep_all_gpu_behind", True), ("keep_all_again", False)):
    runner = host_timed(programs["keep_all"])
    for run in range(13):
        if run == 3:
            runner.reset()
        args = make_args()
        measure.sync(dev)
        if lag:
            torch.cuda._sleep(cycles)
        runner(args)
        measure.sync(dev)
    report[name] = by_verb(runner, programs["keep_all"])
    print(name, report[name], flush=True)
(out / "run14_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
