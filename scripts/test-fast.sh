#!/usr/bin/env bash
# The fast tier, for checking a change in well under a minute: ruff, then the in-process and unit
# tests (`pytest -m fast`: no process started, no tool; tests/tiers.py says how each test gets its
# tier, and fails a fast test that starts a process). No setup and no mypy: scripts/check.sh runs
# the static checks and scripts/test.sh everything (.ci/run). Extra arguments go to pytest, e.g.
# `bash scripts/test-fast.sh -k membership` or `bash scripts/test-fast.sh tests/test_membership.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode written (see scripts/test.sh): collecting the suite takes about 5 s instead of 15.
unset PYTHONDONTWRITEBYTECODE
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
ruff check --quiet .
ruff format --check --quiet .
python -m pytest -m fast -q "$@"
