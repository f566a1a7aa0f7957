#!/usr/bin/env bash
# Run 7, as it ran on the device (from the repository root, deap's wheel in .whl): the GPU check's compare stage
# alone (compare_cnn_cpu cut as gpu_check.COMPARE_ARGS), then the compiled policies it wrote validated there.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/run7}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deap-*.whl
mkdir -p /tmp/site/moocore
printf 'def hypervolume(*a, **k):\n    raise NotImplementedError("moocore stand-in")\n' > /tmp/site/moocore/__init__.py
export PYTHONPATH=/tmp/site
start=$(date +%s)
timeout 100 python3 -m gaswap compare experiments/compare_cnn_cpu.yaml --rounds 1 --steps 2 --finalists 0 \
  --below 0.8 --results /tmp/run7 2>&1 | tee "$out/run7_compare_log.txt"
echo "compare: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
cp /tmp/run7/compare_cnn_cpu/compare.csv "$out/run7_compare.csv" 2>/dev/null
for k in 00 01; do
  policy=/tmp/run7/compare_cnn_cpu/compiled/p$k.yaml
  [ -f "$policy" ] || continue
  timeout 45 python3 -m gaswap validate "$policy" --device cuda --steps 4 2>&1 | grep -v "it/s\|step/s" \
    | tee -a "$out/run7_validate_log.txt"
  cp "${policy%.yaml}.validation.json" "$out/run7_p$k.validation.json" 2>/dev/null
done
