#!/usr/bin/env bash
# Run 15, as it ran on the device (from the repository root, deap's wheel in .whl): the check's gpt_bench stage alone
# (eleven validation steps), for validate's host figures (`issue_time_s`, `host_bound`) on a GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run15}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deap-*.whl 2>/dev/null
mkdir -p /tmp/site/moocore
printf 'def hypervolume(*a, **k):\n    raise NotImplementedError("moocore stand-in")\n' > /tmp/site/moocore/__init__.py
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 - <<'PY' 2>&1 | tee "$out/run15_log.txt"
import json, os
from pathlib import Path
from gaswap.app import gpu_check
r = gpu_check.run_stage("experiment", "experiments/gpt_bench.yaml", Path("/tmp/check15"), gpu_check.STEPS, 90)
Path(os.environ.get("OUT", "/tmp/run15"), "run15_stage.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
v = r["validation"]
print(json.dumps({"goals": r["goals"], "predicted": v["predicted"], "measured": v["measured"],
                  "time_ratio": v["time_ratio"], "host_bound": v.get("host_bound")}))
PY
