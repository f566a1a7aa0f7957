"""Run 5's diagnostics, as they ran on the device (repository root, deap importable, $OUT set):
1. AlexNet planned for 6.5 GB of reservations, validated capped: where the out-of-memory happens (the op, the
   allocator's state, the largest live blocks and where they were allocated);
2. gpt_bench validated: the blocks alive at the step's allocated peak and where they were allocated (the 33.5 MB
   the measured peak has above the live model's);
3. a compiled policy that `gaswap compare` made on this GPU, validated here (predicted against measured)."""
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from gaswap.app import gpu_check, validate, workflow
from gaswap.base import config
from gaswap.base.errors import NoFit

out = Path(os.environ.get("OUT", "/tmp/diag5_out"))
out.mkdir(parents=True, exist_ok=True)
work = Path("/tmp/diag5")
report = {}


def searched(path):
    exp = config.load_experiment(gpu_check.derived_experiment(path, work))
    prepared = workflow.prepare(exp, cache_dir=work / "cache")
    workflow.run_search(prepared, work / "results" / exp.name, force=True)
    return work / "results" / exp.name / "policy.yaml"


def where(frames, n=4):
    """The first frames in gaswap (or torch's Python where none), as file:line:function."""
    ours = [f for f in frames if "gaswap" in f["filename"]] or frames
    return [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in ours[:n]]


def record(on):
    if on:
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=200000)
    else:
        torch.cuda.memory._record_memory_history(None)


def live_at_peak(trace):
    """The blocks alive when the allocated bytes peaked over the whole trace, largest first."""
    live, total, best, at = {}, 0, -1, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, at = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    blocks = sorted(at.values(), key=lambda e: -e["size"])
    return best, [{"bytes": e["size"], "where": where(e.get("frames", []))} for e in blocks[:25]]


def stats():
    s = torch.cuda.memory_stats()
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "inactive_split_bytes.all.current", "num_alloc_retries", "num_ooms",
            "segment.all.current")
    return {k: s.get(k) for k in keys}


# 1. AlexNet capped
t = time.monotonic()
policy = searched("experiments/alexnet_4gb.yaml")
torch.cuda.empty_cache()
record(True)
try:
    r = validate.validate(policy, steps=4, device="cuda")
    report["alexnet"] = {"validated": {k: r[k] for k in ("predicted", "measured", "peak_ratio", "time_ratio")}}
except NoFit as e:
    oom = e.__context__
    snap = torch.cuda.memory._snapshot()
    segs = snap["segments"]
    blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    blocks.sort(key=lambda b: -b["size"])
    report["alexnet"] = {
        "error": str(e), "oom": str(oom)[:600],
        "oom_at": [] if oom is None else [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_tb(oom.__traceback__)][-12:],
        "stats": stats(),
        "segments": sorted(([s["total_size"], s["allocated_size"]] for s in segs), reverse=True)[:30],
        "largest_live": [{"bytes": b["size"], "where": where(b.get("frames", []))} for b in blocks[:20]],
        "last_events": [{"action": ev["action"], "bytes": ev["size"], "where": where(ev.get("frames", []), 2)}
                        for ev in snap["device_traces"][0][-25:]],
    }
record(False)
report["alexnet"]["seconds"] = round(time.monotonic() - t, 1)
print(json.dumps(report["alexnet"], indent=1)[:6000], flush=True)
torch.cuda.empty_cache()

# 2. gpt_bench: what is alive at the peak
t = time.monotonic()
policy = searched("experiments/gpt_bench.yaml")
record(True)
r = validate.validate(policy, steps=3, device="cuda")
trace = torch.cuda.memory._snapshot()["device_traces"][0]
record(False)
peak, blocks = live_at_peak(trace)
report["gpt"] = {"predicted": r["predicted"], "measured": r["measured"], "peak_ratio": r["peak_ratio"],
                 "trace_peak_allocated": peak, "live_at_peak": blocks,
                 "blocks_32MiB": [where(e.get("frames", []), 6) for e in trace
                                  if e["action"] == "alloc" and 33_000_000 <= e["size"] <= 34_000_000][:6],
                 "seconds": round(time.monotonic() - t, 1)}
print(json.dumps(report["gpt"], indent=1)[:6000], flush=True)
torch.cuda.empty_cache()

# 3. a compiled policy made here, validated here
t = time.monotonic()
proc = subprocess.run([sys.executable, "-m", "gaswap", "compare", "experiments/compare_cnn_cpu.yaml", "--rounds", "2",
                       "--steps", "3", "--results", str(work / "cmp")], capture_output=True, text=True, timeout=150)
report["compare"] = {"rc": proc.returncode, "tail": proc.stdout[-3500:], "stderr": proc.stderr[-800:],
                     "seconds": round(time.monotonic() - t, 1)}
print(proc.stdout[-3500:], proc.stderr[-800:], flush=True)
validated = []
for p in sorted((work / "cmp").glob("*/compiled/p*.yaml"))[:2]:
    v = subprocess.run([sys.executable, "-m", "gaswap", "validate", str(p), "--device", "cuda", "--steps", "5"],
                       capture_output=True, text=True, timeout=120)
    validated.append({"policy": p.name, "rc": v.returncode, "out": v.stdout[-1200:], "err": v.stderr[-600:]})
    print(v.stdout[-1200:], v.stderr[-600:], flush=True)
report["validated"] = validated
(out / "run5_diag.json").write_text(json.dumps(report, indent=1, default=str))
