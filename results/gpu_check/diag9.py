"""Run 9's diagnostic, as it ran on the device (repository root, deap importable, $OUT set): gpt_bench's policy steps
through gaswap's runner under torch.profiler: where the host's time goes (self CPU time by call, CUDA runtime calls
included: a blocking copy or synchronize shows there), its instructions by verb, and each step's wall and issue time."""
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gaswap.app import gpu_check, validate, workflow
from gaswap.base import config
from gaswap.plan import policy as policies
from gaswap.run.runtime import StepRunner

out = Path(os.environ.get("OUT", "/tmp/diag9_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag9")
exp = config.load_experiment(gpu_check.derived_experiment("experiments/gpt_bench.yaml", work))
prepared = workflow.prepare(exp, cache_dir=work / "cache")
workflow.run_search(prepared, work / "results" / exp.name, force=True)
policy_path = work / "results" / exp.name / "policy.yaml"
policy = policies.load(policy_path)
dev = torch.device("cuda")
model, inputs, target, captured = validate._captured(policy, policy_path, exp, dev)
report = {"counts": policy.counts(), "predicted": policy.predicted,
          "verbs": dict(Counter(verb for verb, _ in policy.program))}


class Issued:
    def __init__(self, runner):
        self.runner, self.seconds = runner, []

    def __call__(self, args):
        started = time.perf_counter()
        result = self.runner(args)
        self.seconds.append(time.perf_counter() - started)
        return result


runner = Issued(StepRunner(captured, policy.program, dev))
_, _, times = validate._train(runner, captured, model, inputs, target, exp, dev, 12, None, [])
report["unprofiled"] = {"wall_ms": [round(t * 1e3, 2) for t in times],
                        "issued_ms": [round(t * 1e3, 2) for t in runner.seconds[1:]]}
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    _, _, times = validate._train(runner, captured, model, inputs, target, exp, dev, 6, None, [])
report["profiled"] = {"wall_ms": [round(t * 1e3, 2) for t in times],
                      "issued_ms": [round(t * 1e3, 2) for t in runner.seconds[-5:]]}
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
(out / "run9_diag_profile.txt").write_text(table + "\n")
device_total = sum(e.self_device_time_total for e in prof.key_averages())
report["device_busy_ms_per_step"] = round(device_total / 6 / 1e3, 3)
report["cuda_runtime_calls"] = {e.key: {"count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
                                for e in prof.key_averages() if e.key.startswith("cuda")}
(out / "run9_diag.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
print(json.dumps({k: report[k] for k in ("counts", "verbs", "unprofiled", "device_busy_ms_per_step")}), flush=True)
print(json.dumps(report["cuda_runtime_calls"]), flush=True)
print(table[:6000])
