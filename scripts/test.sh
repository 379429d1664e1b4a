#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks, then the whole test suite (all three tiers:
# fast, integration, system; scripts/test-fast.sh runs the fast one alone), then the collectives
# and exit-path tests again on the oldest torch sarcomm admits (scripts/test-torch-floor.sh, its own
# venv; SARCOMM_TORCH_FLOOR=0 skips it). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -k membership` (not to the floor run, which always runs its own files).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/check.sh
python -m pytest -ra --durations=25 "$@"
if [ "${SARCOMM_TORCH_FLOOR:-1}" != 0 ]; then
  deactivate
  bash scripts/test-torch-floor.sh
fi
