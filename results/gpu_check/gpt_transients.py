import json, os, sys
from pathlib import Path
import torch
from gaswap.app import gpu_check, workflow
from gaswap.base import config
from gaswap.run import workspace
exp = config.load_experiment(gpu_check.derived_experiment("experiments/gpt_bench.yaml", Path("/tmp/d2")))
graph = workflow.capture_step(exp)
graph = getattr(graph, "graph", graph)
sig = {op.name: json.loads(op.signature)["target"] for op in graph.ops}
least = workspace.op_transients(graph, "cuda")
spare = workspace.op_transients(graph, "cuda", least=False)
rows = sorted(((spare.get(n, 0), least.get(n, 0), n, sig[n]) for n in set(least) | set(spare)), reverse=True)[:10]
for r in rows: print(r)
Path(os.environ["OUT"], "transients.json").write_text(json.dumps(rows))
