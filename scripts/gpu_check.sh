#!/usr/bin/env bash
# The GPU check in one command, on a machine with CUDA (see gaswap/app/gpu_check.py):
#   [PYTHON=/path/to/python] scripts/gpu_check.sh [REPORT.json]
# Runs with the interpreter $PYTHON (default: the `python3` on PATH; give a venv's python to use that venv
# without activating it); every stage runs with that interpreter too. Needs torch, numpy, pyyaml, tqdm, seaborn
# and pytest installed, and deap: if it is not, a deap wheel is installed from $GASWAP_WHEELS (default: .whl in
# the repository) into a private folder, nothing else (fetch it beforehand with `pip download deap --no-deps
# -d .whl`: deap 1.4.4 is a py3-none-any wheel). deap 1.4.2 and later import moocore (for deap's hypervolume
# indicator, which gaswap does not use: it computes its own); without moocore a stand-in module that refuses
# to be called goes in that folder.
# Exit status (docs/exit_codes.md): 0 when every stage ran (or there is no GPU: the report says so), 1 when a
# stage failed or ran past its time limit (the report names it), 2 when deap cannot be imported (no wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
report=${1:-gpu_check.json}
python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null; then
  echo "gpu_check.sh: no Python interpreter '$python' (set PYTHON)" >&2
  exit 2
fi
site=$(mktemp -d)
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$python" -c "import deap" 2>/dev/null; then
  wheels=${GASWAP_WHEELS:-.whl}
  shopt -s nullglob
  found=("$wheels"/deap-*.whl)
  shopt -u nullglob
  if [ ${#found[@]} -eq 0 ]; then
    echo "gpu_check.sh: deap is not installed for $python and there is no deap wheel in $wheels (pip download deap --no-deps -d $wheels)" >&2
    exit 2
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${found[@]}"
fi
if ! "$python" -c "import moocore" 2>/dev/null; then
  mkdir -p "$site/moocore"
  cat > "$site/moocore/__init__.py" <<'PY'
"""A stand-in for moocore (scripts/gpu_check.sh): deap.tools imports it for its hypervolume indicator,
which gaswap does not call."""


def hypervolume(*args, **kwargs):
    raise NotImplementedError("moocore is not installed: this is scripts/gpu_check.sh's stand-in")
PY
fi
if ! "$python" -c "from deap import base, creator, tools" 2>"$site/deap.err"; then
  echo "gpu_check.sh: deap cannot be imported: $(tail -n 1 "$site/deap.err")" >&2
  exit 2
fi
exec "$python" -m gaswap check-gpu --out "$report"
