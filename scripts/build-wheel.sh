#!/usr/bin/env bash
# Build sarcomm's wheel into dist/ (or the folder given): the file to copy to a cluster and
# `pip install` there (after the cluster's own torch). Extra arguments go to `pip wheel`, e.g.
# `--no-build-isolation` where PyPI is out of reach and setuptools is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist}"
shift || true
python3 -m pip wheel --quiet --no-deps --wheel-dir "$out" "$@" .
ls "$out"/sarcomm-*.whl
