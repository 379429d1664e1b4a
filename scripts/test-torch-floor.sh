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
# sarcomm itself without re-resolving torch, then the runtime and test dependencies it names.
python -m pip install --quiet -e . --no-deps
python -m pip install --quiet "numpy<2" "grpcio>=1.85.1,<2" "grpcio-health-checking>=1.85.1,<2" \
  "grpcio-reflection>=1.85.1,<2" "protobuf>=7.35.1,<8" "uvloop>=0.19" "prometheus-client>=0.20" \
  "aiohttp>=3.9" "ifaddr>=0.2" "psutil>=5.9" "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.3" \
  "hypothesis>=6.100" "trustme>=1.1"
python -c "import torch, sarcomm.worker; print('torch', torch.__version__, 'in $VENV')"
python -m pytest -ra -p no:cacheprovider tests/test_collectives.py tests/test_exit_path.py "$@"
