#!/usr/bin/env bash
# Run 9, as it ran on the device (from the repository root, deap's wheel in .whl): the GPU check as users run it
# (scripts/gpu_check.sh), after run 8's fixes (a fresh allocator before validating; ops timed capped where their
# transient shrinks, for absolute budgets; eleven validation steps).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run9}
mkdir -p "$out" /tmp/check
start=$(date +%s)
PYTHON=python3 timeout 470 scripts/gpu_check.sh /tmp/check/run9_gpu_check.json 2>&1 | tee "$out/run9_check_log.txt"
echo "check: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$out/run9_check_log.txt"
cp /tmp/check/run9_gpu_check.json "$out/" 2>/dev/null
