"""GPU diagnostics (not committed): alexnet's transients and whether capping memory makes them shrink."""
import json, os, sys, time
from pathlib import Path
import torch
from gaswap.app import gpu_check, workflow
from gaswap.base import config
from gaswap.run import workspace
from gaswap.run.measure import op_call

out = Path(os.environ["OUT"])
work = Path("/tmp/diag")
dev = torch.device("cuda")
total = torch.cuda.get_device_properties(0).total_memory
rep = {}
exp = config.load_experiment(gpu_check.derived_experiment("experiments/alexnet_4gb.yaml", work))
prepared = workflow.prepare(exp, cache_dir=work / "cache")
ka = workflow.planning_problem(prepared).keep_all()
rep["keep_all_peak"] = ka.peak_bytes
rep["budget"] = exp.budget.resolve(ka.peak_bytes)
t0 = time.monotonic()
tr = workspace.op_transients(prepared.graph, dev)
rep["transients_s"] = time.monotonic() - t0
sig = {op.name: op.signature for op in prepared.graph.ops}
top = sorted(tr.items(), key=lambda kv: -kv[1])[:8]
rep["top"] = [[n, b, json.loads(sig[n])["target"]] for n, b in top]
print(json.dumps(rep, indent=1), flush=True)

def timed(fn, args, kwargs, n=5):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*args, **kwargs); torch.cuda.synchronize(); s.record()
    for _ in range(n): fn(*args, **kwargs)
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n

capped = []
seen = set()
for name, b in top:
    if sig[name] in seen: continue
    seen.add(sig[name])
    fn, args, kwargs = op_call(sig[name], dev)
    with torch.no_grad():
        o = fn(*args, **kwargs); torch.cuda.synchronize()
        outb = workspace._bytes(o); del o
        free_ms = timed(fn, args, kwargs)
        row = {"op": name, "target": json.loads(sig[name])["target"], "uncapped": b, "uncapped_ms": free_ms, "caps": []}
        for extra in (0, 8 << 20, 64 << 20, 256 << 20):
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved()
            torch.cuda.set_per_process_memory_fraction(min(1.0, (base + outb + extra + (2 << 20)) / total))
            try:
                torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
                o = fn(*args, **kwargs); torch.cuda.synchronize()
                t = max(0, torch.cuda.max_memory_allocated() - before - workspace._bytes(o)); del o
                ms = timed(fn, args, kwargs)
                row["caps"].append({"extra": extra, "transient": t, "ms": ms})
            except torch.OutOfMemoryError as e:
                row["caps"].append({"extra": extra, "oom": str(e)[:120]})
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
    capped.append(row); print(json.dumps(row), flush=True)
    del fn, args, kwargs; torch.cuda.empty_cache()
rep["capped"] = capped

# search without the transients in the margin, then run under a 4 GB cap
real = workspace.op_transients
workspace.op_transients = lambda graph, dev, api=None: {}
try:
    result, _ = workflow.run_search(prepared, work / "results" / exp.name, force=True)
    rep["search"] = "ok"
except Exception as e:
    rep["search"] = f"{type(e).__name__}: {e}"
workspace.op_transients = real
print(rep["search"], flush=True)
policy = work / "results" / exp.name / "policy.yaml"
if policy.exists():
    for cap in (None, rep["budget"]):
        torch.cuda.empty_cache()
        if cap: torch.cuda.set_per_process_memory_fraction(cap / total)
        try:
            t0 = time.monotonic()
            r = gpu_check.memory_run(policy, steps=3, device="cuda")
            rep[f"run_cap_{cap}"] = {k: r[k] for k in ("measured", "predicted", "ratios", "ratios_with_device_memory", "device_memory")} | {"s": time.monotonic() - t0}
        except torch.OutOfMemoryError as e:
            rep[f"run_cap_{cap}"] = {"oom": str(e)[:300]}
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        print(json.dumps(rep[f"run_cap_{cap}"])[:1500], flush=True)
(out / "diag.json").write_text(json.dumps(rep, indent=1, default=str))
