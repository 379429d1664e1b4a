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
# A run after a complete one with the same pyproject.toml has nothing to add (the install is
# editable: source changes need none); pip would still take about 15 s to find that out.
stamp=.venv/.sarcomm-setup
want="pyproject $(sha256sum pyproject.toml | cut -d' ' -f1) torch ${TORCH_VERSION}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && python -c "import importlib.util as u, sys, sarcomm.worker, sarcomm.coordinator
sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then
  echo "sarcomm installed in .venv (already set up for this pyproject.toml)"
  exit 0
fi
rm -f "$stamp"
python -m pip install --quiet --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==${TORCH_VERSION}"
python -m pip install --quiet -e ".[dev]"
python -c "import sarcomm.worker, sarcomm.coordinator; print('sarcomm installed in .venv')"
echo "$want" >"$stamp"
