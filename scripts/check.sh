#!/usr/bin/env bash
# Static checks: generated code, docs/flags.md and benchmarks/RESULTS.md fresh, ruff lint + format,
# mypy --strict over the sarcomm namespace and over tests, benchmarks, examples and
# scripts/gen_flags.py, the import contracts. Any failure fails the script (after every check ran).
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
python protos/generate.py --check || status=1
# docs/flags.md is generated from the CLIs' parsers: stale after a flag changed until rerun.
python scripts/gen_flags.py --check || status=1
# benchmarks/RESULTS.md is rendered from the recorded JSON: stale after a renderer changed until rerun.
python benchmarks/report.py --check || status=1
ruff check . || status=1
ruff format --check . || status=1

# mypy and import-linter find modules by path, but the repository keeps coordinator/ and worker/
# beside protos/sarcomm/ and only installation maps them under `sarcomm`: scripts/linktree.sh lays
# the package out as it installs, as links to these files (paths in reports are under it).
tree=$(bash scripts/linktree.sh)
MYPYPATH="$tree" mypy -p sarcomm || status=1
# The layering contracts of pyproject.toml ([tool.importlinter]).
PYTHONPATH="$tree" lint-imports --no-cache || status=1

# Tests, benchmarks and examples, --strict like the package (same pyproject config), against the
# installed layout above. Their scripts run as files and import their neighbours by bare name
# (`import recording`, `from graph import ...`), so each folder is checked on its own with itself
# on the path: two scripts of the same name in different folders never clash. tests/ is a package
# (its rank scripts under tests/scripts import `tests.helpers` from the repository root).
MYPYPATH="$tree" mypy tests || status=1
MYPYPATH="$tree" mypy scripts/gen_flags.py || status=1
MYPYPATH="$tree:benchmarks" mypy benchmarks || status=1
MYPYPATH="$tree" mypy examples/collectives_check.py || status=1
MYPYPATH="$tree:examples/gcn" mypy examples/gcn || status=1
exit $status
