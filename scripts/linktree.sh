#!/usr/bin/env bash
# Lay out build/pkgtree/sarcomm as sarcomm installs (protos/sarcomm, with common/, coordinator/ and
# worker/ inside), as real folders of symbolic links to the repository's files: no copy, so an
# edit is seen at once. mypy and import-linter read this tree; neither understands the editable
# install's import hook (setuptools maps the folders at import time, which a tool that walks the
# file system cannot see). Paths in their reports are this tree's: build/pkgtree/sarcomm/X is X
# in the repository (sarcomm/v1 is protos/sarcomm/v1). Prints the tree's root.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/pkgtree
rm -rf "$tree"
link() {  # link SOURCE_FOLDER DEST_FOLDER [PRUNE...]
  local src=$1 dst=$2; shift 2
  local prune=()
  for p in "$@"; do prune+=(-path "./$p" -prune -o); done
  (cd "$src" && find . "${prune[@]}" -name __pycache__ -prune -o \( -name '*.py' -o -name '*.pyi' -o -name py.typed \) -print) |
    while read -r f; do
      mkdir -p "$dst/$(dirname "$f")"
      ln -s "$PWD/$src/${f#./}" "$dst/${f#./}"
    done
}
link protos/sarcomm "$tree/sarcomm"
link common "$tree/sarcomm/common"
link coordinator "$tree/sarcomm/coordinator"
link worker "$tree/sarcomm/worker"
echo "$tree"
