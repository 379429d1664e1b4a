#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the static checks, then the whole test suite (all three tiers:
# fast, integration, system; scripts/test-fast.sh runs the fast one alone), then the collectives
# and exit-path tests again on the oldest torch sarcomm admits (scripts/test-torch-floor.sh, its own
# venv; SARCOMM_TORCH_FLOOR=0 skips it). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -k membership` (not to the floor run, which always runs its own files).
#
# Two slow preparations run in the background while the static checks and the fast tier run side
# by side (in process, nothing timed against the wall clock), and are waited for before the integration
# and system tiers start, so that nothing competes with their timed tests: the floor's venv
# (a 3 GB download and its unpacking) and, for a whole run on a machine with a Docker engine, the
# container images the Docker tests use (deploy/docker/build-images.sh: debootstrap, a wheelhouse,
# the images; the tests' own call then finds them built).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts hundreds of Python processes (coordinators, agents, ranks) and three pytest runs:
# with bytecode never written (some images set PYTHONDONTWRITEBYTECODE), each compiles sarcomm and
# pytest rewrites every test module again. __pycache__ is git- and docker-ignored.
unset PYTHONDONTWRITEBYTECODE
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
fast=0
if [ "$#" = 0 ]; then
  # A whole run takes the static checks and the fast tier side by side (in process, no process
  # started, nothing timed against the wall clock) while the preparations above finish, and the
  # other tiers after them. The checks' output follows the fast tier's.
  checks_log=.checks.log
  bash scripts/check.sh >"$checks_log" 2>&1 </dev/null &
  checks_pid=$!
  python -m pytest -ra -m fast || fast=$?
  wait "$checks_pid" || checks=$?
  cat "$checks_log"
else
  bash scripts/check.sh || checks=$?
fi
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
if [ "$#" = 0 ]; then
  python -m pytest -ra --durations=25 -m "not fast" || exit $?
  [ "$fast" = 0 ] || exit "$fast"
else
  python -m pytest -ra --durations=25 "$@"
fi
if [ -n "$floor_pid" ]; then
  deactivate
  SARCOMM_FLOOR_BUILT=1 bash scripts/test-torch-floor.sh
fi
