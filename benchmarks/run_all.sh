#!/bin/sh
# Every benchmark, then benchmarks/RESULTS.md: the one command (options: see run_all.py --help).
# PYTHON picks the interpreter; by default the one first on PATH, so activate the venv first.
exec "${PYTHON:-python3}" "$(dirname "$0")/run_all.py" "$@"
