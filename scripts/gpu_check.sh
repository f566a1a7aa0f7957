#!/usr/bin/env bash
# The GPU check in one command, on a machine with CUDA (see gaswap/gpu_check.py):
#   scripts/gpu_check.sh [REPORT.json]
# Needs torch, numpy, pyyaml, tqdm, seaborn and pytest installed, and deap: if it is not, a deap wheel is
# installed from $GASWAP_WHEELS (default: .whl in the repository) into a private folder, nothing else.
# Exit status: 0 when every stage ran (or there is no GPU: the report says so), 1 when a stage failed.
set -euo pipefail
cd "$(dirname "$0")/.."
report=${1:-gpu_check.json}
if ! python3 -c "import deap" 2>/dev/null; then
  wheels=${GASWAP_WHEELS:-.whl}
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/deap-*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m gaswap check-gpu --out "$report"
