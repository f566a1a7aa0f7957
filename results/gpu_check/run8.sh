#!/usr/bin/env bash
# Run 8, as it ran on the device (from the repository root, deap's wheel in .whl): diag8.py (AlexNet capped after
# measuring costs in the same process, without and with `workspace.fresh_allocator`; gpt_bench's step time), then
# the check's two experiment stages as the check runs them (a process each).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run8}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deap-*.whl
mkdir -p /tmp/site/moocore
printf 'def hypervolume(*a, **k):\n    raise NotImplementedError("moocore stand-in")\n' > /tmp/site/moocore/__init__.py
export PYTHONPATH=/tmp/site:$PWD OUT="$out"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$out/run8_nvidia_smi.txt"
start=$(date +%s)
timeout 230 python3 results/gpu_check/diag8.py 2>&1 | grep -v "it/s" | tee "$out/run8_diag_log.txt"
echo "diag8: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$out/run8_diag_log.txt"
start=$(date +%s)
timeout 200 python3 - <<'PY' 2>&1 | tee "$out/run8_stages_log.txt"
import json, os, time
from pathlib import Path
from gaswap.app import gpu_check
report = {}
for path in gpu_check.EXPERIMENTS:
    name, started = Path(path).stem, time.monotonic()
    try:
        report[name] = gpu_check.run_stage("experiment", path, Path("/tmp/check8"), 5, 95)
    except Exception as e:
        report[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
    report[name]["stage_s"] = round(time.monotonic() - started, 1)
    print(name, json.dumps(report[name].get("goals") or report[name].get("error"))[:400], flush=True)
    Path(os.environ["OUT"], "run8_stages.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
PY
echo "stages: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$out/run8_stages_log.txt"
