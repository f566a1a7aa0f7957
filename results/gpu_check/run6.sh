#!/usr/bin/env bash
# Run 6, as it ran on the device (from the repository root, deap's wheel in .whl): the GPU check, then the compiled
# policy its compare stage wrote validated there (its peak: the programs' plus what the meter read beyond torch's).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run6}
mkdir -p "$out" /tmp/check
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deap-*.whl
mkdir -p /tmp/site/moocore
printf 'def hypervolume(*a, **k):\n    raise NotImplementedError("moocore stand-in")\n' > /tmp/site/moocore/__init__.py
export PYTHONPATH=/tmp/site
start=$(date +%s)
PYTHON=python3 timeout 330 scripts/gpu_check.sh /tmp/check/run6_gpu_check.json 2>&1 | tee "$out/run6_check_log.txt"
echo "check: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
cp /tmp/check/run6_gpu_check.json "$out/" 2>/dev/null
policy=/tmp/check/run6_gpu_check/results/compare_cnn_cpu/compiled/p00.yaml
cp "$policy" "$out/run6_p00.yaml" 2>/dev/null
timeout 120 python3 -m gaswap validate "$policy" --device cuda --steps 5 2>&1 | tee "$out/run6_validate_log.txt"
cp "${policy%.yaml}.validation.json" "$out/run6_p00.validation.json" 2>/dev/null
