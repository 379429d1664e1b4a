#!/usr/bin/env bash
# Static checks: generated code fresh, ruff lint + format, mypy --strict over the sarcomm namespace.
set -euo pipefail
cd "$(dirname "$0")/.."

python protos/generate.py --check
ruff check .
ruff format --check .

# mypy resolves modules by path, but the repository keeps coordinator/ and worker/ beside
# protos/sarcomm/ and only installation maps them under `sarcomm`. Lay the package out as it
# installs, check that, and print paths as they are in the repository.
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/sarcomm"
cp -r protos/sarcomm/. "$tree/sarcomm/"
cp -r common "$tree/sarcomm/common"
cp -r coordinator "$tree/sarcomm/coordinator"
cp -r worker "$tree/sarcomm/worker"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
status=0
MYPYPATH="$tree" mypy -p sarcomm 2>&1 \
  | sed -e "s#$tree/sarcomm/coordinator/#coordinator/#" -e "s#$tree/sarcomm/worker/#worker/#" -e "s#$tree/sarcomm/common/#common/#" \
        -e "s#$tree/sarcomm/#protos/sarcomm/#" || status=$?
mypy tests benchmarks examples 2>/dev/null | tail -n 1 >/dev/null || true
exit $status
