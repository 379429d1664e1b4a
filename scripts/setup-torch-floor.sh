#!/usr/bin/env bash
# Build (or complete) .venv-torch-floor: the oldest torch that pyproject admits (torch>=2.2), with
# sarcomm editable and its test tools. torch 2.2.1 is the newest torch DGL's PyPI wheel supports.
# It comes from PyPI with its CUDA dependencies (about 3 GB; torch 2.2.1 without them does not
# import: libcublas is missing) and needs numpy<2. Safe to run again (it only adds what is
# missing). .ci/run starts it first of all, scripts/test.sh in the background while the static
# checks run; scripts/test-torch-floor.sh runs it before its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# One build at a time: .ci/run starts one as early as it can and scripts/test.sh starts it again;
# the second waits here for the first and then finds everything installed.
if command -v flock >/dev/null 2>&1; then
  exec 9>.venv-torch-floor.lock
  if ! flock -w 1800 9; then
    echo "error: another build of .venv-torch-floor has held .venv-torch-floor.lock for 30 minutes;" \
      "see .venv-torch-floor.early.log, stop that build and run this again" >&2
    exit 1
  fi
fi
FLOOR_TORCH="${SARCOMM_FLOOR_TORCH:-2.2.1}"
VENV=.venv-torch-floor
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$FLOOR_TORCH')" 2>/dev/null; then
  python -m pip install --quiet "torch==${FLOOR_TORCH}" "numpy<2"
fi
# sarcomm with its dependencies and test tools as pyproject names them, torch and numpy held where
# they are by a constraints file (pip would otherwise be free to move them).
printf 'torch==%s\nnumpy<2\n' "$FLOOR_TORCH" > "$VENV/constraints.txt"
python -m pip install --quiet -e ".[dev]" -c "$VENV/constraints.txt"
python -c "import torch, sarcomm.worker; print('torch', torch.__version__, 'in $VENV')"
