"""Run 8's diagnostics, as they ran on the device (repository root, deap importable, $OUT set):
1. AlexNet planned for 6.5 GB of reservations, its costs measured in the same process (as the check's stage does),
   validated capped without `workspace.fresh_allocator` (the segments measuring left stay cached) and then with it;
2. gpt_bench's step time: the policy's and keep-all's steps through gaswap's runner, each step's wall time beside the
   host's time to issue it (a host-bound step issues for as long as it runs), against the prediction; the ops timed
   in place (`measure.profile_step`, each op synchronized) against the costs timed alone."""
import json
import os
import statistics
import time
from pathlib import Path

import torch

from gaswap.app import gpu_check, validate, workflow
from gaswap.base import config
from gaswap.base.errors import NoFit
from gaswap.plan import policy as policies
from gaswap.plan.encoding import Encoding
from gaswap.plan.policy import Action
from gaswap.plan.simulator import Simulator
from gaswap.run import measure, workspace
from gaswap.run.runtime import StepRunner

out = Path(os.environ.get("OUT", "/tmp/diag8_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag8")
report = {}
device = os.environ.get("DIAG_DEVICE", "cuda")  # cpu: part 2 alone, to try the script here


def save():
    (out / "run8_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def searched(path):
    exp = config.load_experiment(gpu_check.derived_experiment(path, work, device))
    prepared = workflow.prepare(exp, cache_dir=work / "cache")
    workflow.run_search(prepared, work / "results" / exp.name, force=True)
    return exp, prepared, work / "results" / exp.name / "policy.yaml"


def stats():
    s = torch.cuda.memory_stats()
    keys = ("allocated_bytes.all.current", "reserved_bytes.all.current", "reserved_bytes.all.peak",
            "inactive_split_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_ooms")
    return {k: s.get(k) for k in keys}


def figures(r):
    return {k: r.get(k) for k in ("predicted", "measured", "peak_ratio", "time_ratio", "capped_at_bytes")}


# 1. AlexNet capped, after measuring its costs in this process
t = time.monotonic()
if device != "cuda":
    raise SystemExit("part 1 needs CUDA")
exp, prepared, policy = searched("experiments/alexnet_4gb.yaml")
alex = report["alexnet"] = {"after_measuring": stats(), "measure_and_search_s": round(time.monotonic() - t, 1)}
fresh = workspace.fresh_allocator
workspace.fresh_allocator = lambda device, api=None: None  # as before the fix
for name in ("without_fresh_allocator", "with_fresh_allocator"):
    try:
        alex[name] = figures(validate.validate(policy, steps=5, device="cuda"))
    except NoFit as e:
        alex[name] = {"error": str(e), "out_of_memory": gpu_check.out_of_memory(e)}
    workspace.fresh_allocator = fresh
    alex[name]["stats_after"] = stats()
    print("alexnet", name, json.dumps(alex[name], default=str)[:600], flush=True)
save()
del prepared

# 2. gpt_bench's step time
t = time.monotonic()
exp, prepared, policy_path = searched("experiments/gpt_bench.yaml")
gpt = report["gpt_bench"] = {"measure_and_search_s": round(time.monotonic() - t, 1)}
policy = policies.load(policy_path)
gpt["policy"] = {"counts": policy.counts(), "predicted": policy.predicted, "program_length": len(policy.program)}
dev = torch.device("cuda")
model, inputs, target, captured = validate._captured(policy, policy_path, exp, dev)
graph, costs = prepared.graph, prepared.costs
encoding = Encoding(graph)
keep = encoding.uniform(Action.KEEP)
keep_run = Simulator(graph, costs).run(encoding.decode(keep.keys), keep.actions, trace=True)
programs = {"policy": (policy.program, policy.predicted["step_time_s"]),
            "keep_all": (keep_run.program, keep_run.step_time)}


class Issued:
    """The runner, with the host's seconds to issue each step (its call, before the device is synchronized)."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, []

    def __call__(self, args):
        started = time.perf_counter()
        result = self.runner(args)
        self.seconds.append(time.perf_counter() - started)
        return result


for name, (program, predicted) in programs.items():
    runner = Issued(StepRunner(captured, program, dev))
    loss, peaks, times = validate._train(runner, captured, model, inputs, target, exp, dev, 16, None, [])
    issued = runner.seconds[1:]  # the first is the warm-up
    gpt[name] = {"predicted_s": predicted, "wall_s": times, "issued_s": issued,
                 "median_wall_s": statistics.median(times), "median_issued_s": statistics.median(issued),
                 "time_ratio": statistics.median(times) / predicted}
    print("gpt", name, {k: v for k, v in gpt[name].items() if "median" in k or k.endswith("ratio")}, flush=True)
save()

make_args = lambda: captured.arguments(model, [x.clone() for x in inputs], target.clone())  # noqa: E731
profile = measure.profile_step(captured, make_args, dev, warmup=3, repeats=10)
alone = {op.name: costs.op_time[op.name] for op in graph.ops}
in_place = {name: profile.op_time.get(name) for name in alone}
ratios = sorted(((in_place[n] or 0) / max(alone[n], 1e-9), n) for n in alone)
gpt["in_place"] = {"sum_alone_s": sum(alone.values()), "sum_in_place_s": sum(v or 0 for v in in_place.values()),
                   "clock_overhead_s": measure.clock_overhead(dev, samples=501),
                   "median_ratio": statistics.median(r for r, _ in ratios),
                   "largest_ratios": [(n, round(r, 2), alone[n], in_place[n]) for r, n in ratios[-12:]],
                   "smallest_ratios": [(n, round(r, 2), alone[n], in_place[n]) for r, n in ratios[:6]]}
print("gpt in place", {k: v for k, v in gpt["in_place"].items() if not k.endswith("ratios")}, flush=True)
save()
