#!/usr/bin/env bash
# The oldest torch that pyproject admits (torch>=2.2), in its own venv (scripts/setup-torch-floor.sh
# builds it): the collectives and the exit path must hold there too (an exit that hung on torch 2.2
# only is what this catches). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# scripts/test.sh has built it already (and says so): no second pass of pip over it.
[ "${SARCOMM_FLOOR_BUILT:-0}" = 1 ] || bash scripts/setup-torch-floor.sh
. .venv-torch-floor/bin/activate
python -m pytest -ra -p no:cacheprovider tests/test_collectives.py tests/test_comm_startup.py \
  tests/test_collective_helpers.py tests/test_exit_path.py "$@"
