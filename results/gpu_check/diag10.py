"""Run 10's diagnostic, as it ran on the device (repository root, deap importable, $OUT set): where the host's time
goes in gaswap's runner on gpt_bench. Each instruction's host seconds (the wall clock read around it, the device
not synchronized: what the host spends issuing it), for keep-all, every candidate swapped, and a searched policy;
summed by verb per step, with the instructions that take longest."""
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

out = Path(os.environ.get("OUT", "/tmp/diag10_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag10")
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
keep = simulator.run(order, encoding.uniform(Action.KEEP).actions, trace=True)
swap = simulator.run(order, encoding.uniform(Action.SWAP).actions, trace=True)
programs = {"keep_all": (keep.program, keep.step_time), "swap_all": (swap.program, swap.step_time),
            "policy": (policy.program, policy.predicted["step_time_s"])}
make_args = lambda: captured.arguments(model, [x.clone() for x in inputs], target.clone())  # noqa: E731
report = {"policy_counts": policy.counts()}


def host_timed(program):
    """A timed runner whose clock readings do not synchronize the device: each instruction's host seconds."""
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # read when the runner's code is generated
    try:
        return measure._TimedRunner(captured, program, dev)
    finally:
        torch.cuda.synchronize = synchronize


for name, (program, predicted) in programs.items():
    runner = host_timed(program)
    for run in range(13):
        if run == 3:
            runner.reset()
        measure.sync(dev)
        started = time.perf_counter()
        runner(make_args())
        issued = time.perf_counter() - started
        measure.sync(dev)
    per_instruction = [(statistics.median(s) if s else 0.0, i) for i, s in enumerate(runner._times)]
    by_verb = defaultdict(lambda: [0, 0.0])
    for seconds, i in per_instruction:
        verb = program[i][0] if i < len(program) else "?"
        by_verb[str(verb)][0] += 1
        by_verb[str(verb)][1] += seconds
    longest = sorted(per_instruction, reverse=True)[:15]
    report[name] = {"predicted_ms": round(predicted * 1e3, 3), "instructions": len(program),
                    "host_ms_summed": round(sum(s for s, _ in per_instruction) * 1e3, 3),
                    "last_step_issued_ms": round(issued * 1e3, 3),
                    "by_verb": {v: {"count": n, "host_ms": round(t * 1e3, 3), "us_each": round(t / n * 1e6, 1)}
                                for v, (n, t) in by_verb.items()},
                    "longest": [(str(program[i][0]), program[i][1], round(s * 1e6, 1)) for s, i in longest]}
    print(name, json.dumps({k: v for k, v in report[name].items() if k != "longest"}), flush=True)
    print("  longest:", report[name]["longest"][:8], flush=True)
host_alone = {}
for op in graph.ops:  # each op's host time alone: its call, the device not synchronized
    if op.signature in host_alone:
        continue
    try:
        fn, args, kwargs = measure.op_call(op.signature, dev)
        with torch.no_grad():
            for _ in range(3):
                fn(*args, **kwargs)
            samples = []
            for _ in range(9):
                measure.sync(dev)
                started = time.perf_counter()
                fn(*args, **kwargs)
                samples.append(time.perf_counter() - started)
            host_alone[op.signature] = statistics.median(samples)
    except Exception as e:  # noqa: BLE001 - recorded
        host_alone[op.signature] = None
alone = [host_alone[op.signature] for op in graph.ops if host_alone.get(op.signature) is not None]
report["ops_alone"] = {"ops": len(alone), "host_ms_summed": round(sum(alone) * 1e3, 3),
                       "median_us": round(statistics.median(alone) * 1e6, 1),
                       "gpu_ms_summed": round(sum(costs.op_time.values()) * 1e3, 3)}
print("ops alone", report["ops_alone"], flush=True)
(out / "run10_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
