"""Run 13's diagnostic, as it ran on the device (repository root, deap importable, $OUT set): whether the runner's
ops dispatch slower in a step that swaps (run 11: every host call about twice as slow) because its copies switch the
current stream. gpt_bench's keep-all and every-candidate-swapped programs, each instruction's host time; the latter
again with its copies queued on the compute stream."""
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

out = Path(os.environ.get("OUT", "/tmp/diag13_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag13")
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


from gaswap.run import streams  # noqa: E402

switching = streams.CudaStreams.copy


def on_compute(self, stream, dst, src):  # the copy queued on the compute stream: no switch of the current stream
    dst.copy_(src, non_blocking=True)


for name, program, copy in (("keep_all", programs["keep_all"], switching), ("swap_all", programs["swap_all"], switching),
                            ("swap_all_copies_on_compute", programs["swap_all"], on_compute)):
    streams.CudaStreams.copy = copy
    runner = host_timed(program)
    for run in range(13):
        if run == 3:
            runner.reset()
        runner(make_args())
        measure.sync(dev)
    streams.CudaStreams.copy = switching
    report[name] = by_verb(runner, program)
    print(name, report[name], flush=True)
(out / "run13_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
