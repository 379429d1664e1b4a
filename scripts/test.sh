#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks, then the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k membership`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/check.sh
python -m pytest -ra "$@"
