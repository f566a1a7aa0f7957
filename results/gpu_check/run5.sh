#!/usr/bin/env bash
# Run 5, as it ran on the device (from the repository root, deap's wheel in .whl): the GPU check, then a shipped
# compiled policy (planned and calibrated on a CPU) validated on the GPU and recalibrated there.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run5}
mkdir -p "$out" /tmp/check
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deap-*.whl
mkdir -p /tmp/site/moocore
printf 'def hypervolume(*a, **k):\n    raise NotImplementedError("moocore stand-in")\n' > /tmp/site/moocore/__init__.py
export PYTHONPATH=/tmp/site
start=$(date +%s)
PYTHON=python3 timeout 330 scripts/gpu_check.sh /tmp/check/run5_gpu_check.json 2>&1 | tee "$out/run5_check_log.txt"
echo "check: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
cp /tmp/check/run5_gpu_check.json "$out/" 2>/dev/null
find /tmp/check -name compare.csv -exec cp {} "$out/run5_compare.csv" \;
start=$(date +%s)
timeout 230 python3 -m gaswap validate results/compare_cnn_cpu/compiled/p00.yaml --device cuda --steps 8 \
  --recalibrate 2>&1 | tee "$out/run5_validate_log.txt"
echo "validate: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
cp results/compare_cnn_cpu/compiled/p00.validation.json "$out/run5_p00.validation.json"
