#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks, then the whole test suite (all three tiers:
# fast, integration, system; scripts/test-fast.sh runs the fast one alone), then the collectives
# and exit-path tests again on the oldest torch sarcomm admits (scripts/test-torch-floor.sh, its own
# venv; SARCOMM_TORCH_FLOOR=0 skips it). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -k membership` (not to the floor run, which always runs its own files).
#
# Two slow preparations run in the background while the static checks run, and are waited for
# before the suite starts, so that nothing competes with the suite's timed tests: the floor's venv
# (a 3 GB download and its unpacking) and, for a whole run on a machine with a Docker engine, the
# container images the Docker tests use (deploy/docker/build-images.sh: debootstrap, a wheelhouse,
# the images; the tests' own call then finds them built).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
floor_pid=
floor_log=.venv-torch-floor.setup.log
if [ "${SARCOMM_TORCH_FLOOR:-1}" != 0 ]; then
  bash scripts/setup-torch-floor.sh >"$floor_log" 2>&1 </dev/null &
  floor_pid=$!
fi
images_pid=
images_log=.build-images.log
if [ "$#" = 0 ] && command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
  bash deploy/docker/build-images.sh --prometheus --etcd >"$images_log" 2>&1 </dev/null &
  images_pid=$!
fi
. .venv/bin/activate
checks=0
bash scripts/check.sh || checks=$?
if [ -n "$floor_pid" ] && ! wait "$floor_pid"; then
  cat "$floor_log" >&2
  echo "error: building the torch-floor venv failed (log above: $floor_log)" >&2
  exit 1
fi
# A failed image build is the Docker tests' to report (they run the same script and show its output).
if [ -n "$images_pid" ] && ! wait "$images_pid"; then
  echo "warning: building the container images failed (the Docker tests will say why; log: $images_log)" >&2
fi
[ "$checks" = 0 ] || exit "$checks"
python -m pytest -ra --durations=25 "$@"
if [ -n "$floor_pid" ]; then
  deactivate
  bash scripts/test-torch-floor.sh
fi
