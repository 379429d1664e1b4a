#!/usr/bin/env bash
# Create .venv and install sarcomm with its test tools. Safe to run again (it only adds what is missing).
# torch goes in first and pinned: an unpinned torch from PyPI would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${SARCOMM_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==${TORCH_VERSION}"
python -m pip install --quiet -e ".[dev]"
python -c "import sarcomm.worker, sarcomm.coordinator; print('sarcomm installed in .venv')"
