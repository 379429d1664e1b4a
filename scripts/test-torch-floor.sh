#!/usr/bin/env bash
# The oldest torch that pyproject admits (torch>=2.2), in its own venv: the collectives and the
# exit path must hold there too (an exit that hung on torch 2.2 only is what this catches).
# torch 2.2.1 is the newest torch DGL's PyPI wheel supports. It comes from PyPI with its CUDA
# dependencies (about 3 GB; torch 2.2.1 without them does not import: libcublas is missing) and
# needs numpy<2. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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
python -m pytest -ra -p no:cacheprovider tests/test_collectives.py tests/test_comm_startup.py \
  tests/test_collective_helpers.py tests/test_exit_path.py "$@"
