#!/usr/bin/env bash
# Build sarcomm's container image with no image registry, and with nothing fetched from a package
# index inside the build (the build runs with --network none):
#
#   1. base image ($SARCOMM_BASE_IMAGE, default sarcomm-base:<this host's Debian release>): a
#      minimal Debian with python3 and python3-venv, made by debootstrap from this host's Debian
#      mirror and loaded with `docker import`. Kept by its tag: built once per machine.
#      Set SARCOMM_BASE_IMAGE to an image you have (python:3.11-slim-bookworm, say) to skip it.
#   2. wheelhouse (deploy/docker/wheelhouse/): every wheel the image installs (torch, sarcomm's
#      dependencies, setuptools and wheel), downloaded here with pip for the base image's Python
#      and platform. Kept while pyproject.toml's dependencies and the torch version are unchanged.
#   3. the image ($SARCOMM_IMAGE, default sarcomm:latest, also tagged sarcomm:<version>, the
#      project's version in pyproject.toml, which deploy/kubernetes pins) from deploy/docker/Dockerfile, with
#      --build-arg PIP_INSTALL_OPTIONS=--no-index: pip installs from the wheelhouse only. Docker's
#      layer cache makes a rebuild with unchanged sources take seconds.
#   4. with --prometheus: $SARCOMM_PROMETHEUS_IMAGE (default sarcomm-prometheus:local), Prometheus
#      from Debian's `prometheus` package on the same base, for machines that cannot pull
#      prom/prometheus. Kept by its tag and the package's version.
#   5. with --etcd: $SARCOMM_ETCD_IMAGE (default sarcomm-etcd:local, also tagged
#      sarcomm-etcd:<version>), etcd from Debian's
#      `etcd-server` package (3.4) on the same base, for docker-compose.etcd.yml. Kept by its tag
#      and the package's version.
#
# The image installs sarcomm with its `etcd` extra (the etcd store's client), so one image serves
# both the SQLite and the etcd compose files.
#
# Usage: bash deploy/docker/build-images.sh [--prometheus] [--etcd] [--refresh]
#   --refresh   rebuild the base image and the wheelhouse even when they exist
#
# Environment: SARCOMM_TORCH_VERSION (2.13.0), SARCOMM_TORCH_INDEX (an extra index for torch, e.g.
# https://download.pytorch.org/whl/cpu: torch from PyPI alone brings several GB of CUDA wheels),
# SARCOMM_DEBIAN_SUITE and SARCOMM_DEBIAN_MIRROR (default: this host's, from /etc/os-release and
# apt's sources), PYTHON (the interpreter whose pip downloads; default .venv's, else python3).
#
# Exit status: 0 built; 3 when this machine cannot build them (no Docker engine, no debootstrap,
# not root, no Debian mirror or pip: the message says which); anything else: a build failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/deploy/docker"
WHEELHOUSE="$HERE/wheelhouse"
TORCH_VERSION="${SARCOMM_TORCH_VERSION:-2.13.0}"
IMAGE="${SARCOMM_IMAGE:-sarcomm:latest}"
PROMETHEUS_IMAGE="${SARCOMM_PROMETHEUS_IMAGE:-sarcomm-prometheus:local}"
ETCD_IMAGE="${SARCOMM_ETCD_IMAGE:-sarcomm-etcd:local}"
# Each image is also tagged with the project's version, the tag deploy/kubernetes pins.
PROJECT_VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
EXIT_CANNOT=3

with_prometheus=0
with_etcd=0
refresh=0
for arg in "$@"; do
  case "$arg" in
    --prometheus) with_prometheus=1 ;;
    --etcd) with_etcd=1 ;;
    --refresh) refresh=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

cannot() { echo "build-images.sh: cannot build here: $*" >&2; exit "$EXIT_CANNOT"; }
step() { printf '[build-images %4ss] %s\n' "$SECONDS" "$*"; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

command -v docker >/dev/null 2>&1 || cannot "no docker command (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || cannot "no Docker engine answers (start dockerd)"
# Debian's docker.io has no buildx: use the classic builder there, BuildKit where it exists.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

tmp="$(mktemp -d /var/tmp/sarcomm-build.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT

# -- 1. base image ---------------------------------------------------------------------------------
# shellcheck source=/dev/null
suite="${SARCOMM_DEBIAN_SUITE:-$( (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || true)}"
BASE="${SARCOMM_BASE_IMAGE:-sarcomm-base:${suite:-bookworm}}"

debian_mirror() {
  # The first Debian archive URI of apt's sources (deb822 .sources or one-line lists), not security.
  local uri
  uri="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' \
    | grep -v -e security -e '^file:' | head -n 1 || true)"
  [ -n "$uri" ] || uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; break}}' \
    | grep -v security | head -n 1 || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}

if [ "$refresh" = 1 ] && [ -z "${SARCOMM_BASE_IMAGE:-}" ] && have_image "$BASE"; then
  docker image rm "$BASE" >/dev/null
fi
if have_image "$BASE"; then
  step "base image $BASE: present"
elif [ -n "${SARCOMM_BASE_IMAGE:-}" ]; then
  cannot "SARCOMM_BASE_IMAGE=$BASE is not an image here (docker pull it, or unset it to debootstrap one)"
else
  [ -n "$suite" ] || cannot "no VERSION_CODENAME in /etc/os-release: set SARCOMM_DEBIAN_SUITE"
  command -v debootstrap >/dev/null 2>&1 || cannot "no debootstrap (Debian: apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || cannot "debootstrap needs root"
  mirror="${SARCOMM_DEBIAN_MIRROR:-$(debian_mirror)}"
  step "base image $BASE: debootstrap $suite from $mirror"
  rootfs="$tmp/rootfs"
  if ! debootstrap --variant=minbase --include=python3,python3-venv --components=main \
      "$suite" "$rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1; then
    tail -n 20 "$tmp/debootstrap.log" >&2
    cannot "debootstrap of $suite from $mirror failed (log above)"
  fi
  # What a container never needs: package lists, caches, logs, documentation.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/var/log/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/tmp/* "$rootfs"/root/.cache
  step "base image $BASE: docker import"
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.opencontainers.image.title=sarcomm-base org.opencontainers.image.base.name=debian:$suite" \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $suite from $mirror" - "$BASE" >/dev/null
  rm -rf "$rootfs"
fi

# -- 2. wheelhouse ---------------------------------------------------------------------------------
# The base's Python, C library and machine decide which wheels fit; its tomllib reads the
# dependencies from pyproject.toml (the Dockerfile reads them the same way).
read -r py_version glibc machine < <(docker run --rm --network none --entrypoint python3 "$BASE" -c \
  'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}", platform.libc_ver()[1] or "0.0", platform.machine())')
docker run --rm -i --network none --entrypoint python3 "$BASE" -c \
  'import sys, tomllib; p = tomllib.load(sys.stdin.buffer)["project"]; print("\n".join(p["dependencies"] + p.get("optional-dependencies", {}).get("etcd", [])))' \
  <"$ROOT/pyproject.toml" >"$tmp/requirements.txt"
key="$( { cat "$tmp/requirements.txt"; echo "torch==$TORCH_VERSION ${SARCOMM_TORCH_INDEX:-}"
          echo "$py_version $glibc $machine"; } | sha256sum | cut -c1-16)"
stamp="$WHEELHOUSE/.stamp"
if [ "$refresh" = 0 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
  step "wheelhouse: up to date ($(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, Python $py_version)"
else
  PYTHON="${PYTHON:-}"
  if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
  fi
  "$PYTHON" -m pip --version >/dev/null 2>&1 || cannot "$PYTHON has no pip to download the wheels with"
  step "wheelhouse: downloading for CPython $py_version, glibc $glibc, $machine"
  rm -f "$WHEELHOUSE"/*.whl "$stamp"
  platforms=(--platform "manylinux2014_$machine")
  glibc_minor="${glibc#*.}"
  for ((minor = 17; minor <= glibc_minor; minor++)); do
    platforms+=(--platform "manylinux_2_${minor}_$machine")
  done
  abi="cp${py_version/./}"
  # pip's own settings (pip.conf, PIP_*) apply: a local find-links folder or index is used too.
  status=0
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$WHEELHOUSE" \
    --only-binary=:all: --implementation cp --python-version "$py_version" \
    --abi "$abi" --abi abi3 --abi none "${platforms[@]}" \
    ${SARCOMM_TORCH_INDEX:+--extra-index-url "$SARCOMM_TORCH_INDEX"} \
    "torch==$TORCH_VERSION" -r "$tmp/requirements.txt" "setuptools>=77" wheel 2>"$tmp/pip.log" || status=$?
  # Leave out pip's warnings about configured index folders that do not exist.
  grep -v "is ignored: it is neither a file nor a directory" "$tmp/pip.log" >&2 || true
  [ "$status" = 0 ] || { echo "build-images.sh: pip download failed ($status)" >&2; exit 1; }
  if cuda="$(find "$WHEELHOUSE" -name 'nvidia_*.whl' -o -name 'triton-*.whl' | head -n 3)" && [ -n "$cuda" ]; then
    echo "build-images.sh: torch==$TORCH_VERSION came with CUDA wheels ($cuda ...);" \
      "set SARCOMM_TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build" >&2
    exit 1
  fi
  echo "$key" >"$stamp"
  step "wheelhouse: $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
fi

# -- 3. the sarcomm image --------------------------------------------------------------------------
step "image $IMAGE: docker build on $BASE, offline from the wheelhouse"
if ! docker build --network none --file "$HERE/Dockerfile" --tag "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg PIP_INSTALL_OPTIONS=--no-index "$ROOT" >"$tmp/build.log" 2>&1; then
  tail -n 40 "$tmp/build.log" >&2
  echo "build-images.sh: docker build of $IMAGE failed (log above)" >&2
  exit 1
fi
docker tag "$IMAGE" "sarcomm:$PROJECT_VERSION"
step "image $IMAGE: $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"

# -- 4. Prometheus from Debian's package -----------------------------------------------------------
if [ "$with_prometheus" = 1 ]; then
  label="sarcomm.prometheus.deb"
  have="$(docker image inspect --format "{{index .Config.Labels \"$label\"}}" "$PROMETHEUS_IMAGE" 2>/dev/null || true)"
  candidate="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}' || true)"
  if [ -n "$have" ] && { [ -z "$candidate" ] || [ "$candidate" = "$have" ]; }; then
    step "image $PROMETHEUS_IMAGE: present (Debian prometheus $have)"
  else
    command -v apt-get >/dev/null 2>&1 || cannot "no apt-get to fetch Debian's prometheus package"
    mkdir -p "$tmp/prometheus" && chmod 777 "$tmp/prometheus"
    fetch() { (cd "$tmp/prometheus" && apt-get download -qq prometheus) >/dev/null 2>&1; }
    fetch || { apt-get update -qq >/dev/null 2>&1 || true; fetch; } \
      || cannot "apt-get download prometheus failed (no Debian mirror?)"
    deb="$(ls "$tmp"/prometheus/prometheus_*.deb)"
    version="$(dpkg-deb --field "$deb" Version)"
    step "image $PROMETHEUS_IMAGE: Debian prometheus $version on $BASE"
    dpkg-deb --extract "$deb" "$tmp/prometheus/root"
    ctx="$tmp/prometheus/context"
    mkdir -p "$ctx"
    cp "$tmp/prometheus/root/usr/bin/prometheus" "$tmp/prometheus/root/usr/bin/promtool" "$HERE/prometheus.Dockerfile" "$ctx/"
    if ! docker build --network none --file "$ctx/prometheus.Dockerfile" --tag "$PROMETHEUS_IMAGE" \
        --build-arg BASE_IMAGE="$BASE" --label "$label=$version" "$ctx" >"$tmp/prometheus.log" 2>&1; then
      tail -n 20 "$tmp/prometheus.log" >&2
      echo "build-images.sh: docker build of $PROMETHEUS_IMAGE failed (log above)" >&2
      exit 1
    fi
  fi
fi
# -- 5. etcd from Debian's package ------------------------------------------------------------------
if [ "$with_etcd" = 1 ]; then
  label="sarcomm.etcd.deb"
  have="$(docker image inspect --format "{{index .Config.Labels \"$label\"}}" "$ETCD_IMAGE" 2>/dev/null || true)"
  candidate="$(apt-cache policy etcd-server 2>/dev/null | awk '/Candidate:/ {print $2}' || true)"
  if [ -n "$have" ] && { [ -z "$candidate" ] || [ "$candidate" = "$have" ]; }; then
    step "image $ETCD_IMAGE: present (Debian etcd-server $have)"
  else
    command -v apt-get >/dev/null 2>&1 || cannot "no apt-get to fetch Debian's etcd-server package"
    mkdir -p "$tmp/etcd" && chmod 777 "$tmp/etcd"
    fetch_etcd() { (cd "$tmp/etcd" && apt-get download -qq etcd-server) >/dev/null 2>&1; }
    fetch_etcd || { apt-get update -qq >/dev/null 2>&1 || true; fetch_etcd; } \
      || cannot "apt-get download etcd-server failed (no Debian mirror?)"
    deb="$(ls "$tmp"/etcd/etcd-server_*.deb)"
    version="$(dpkg-deb --field "$deb" Version)"
    step "image $ETCD_IMAGE: Debian etcd-server $version on $BASE"
    dpkg-deb --extract "$deb" "$tmp/etcd/root"
    ctx="$tmp/etcd/context"
    mkdir -p "$ctx"
    cp "$tmp/etcd/root/usr/bin/etcd" "$HERE/etcd.Dockerfile" "$ctx/"
    if ! docker build --network none --file "$ctx/etcd.Dockerfile" --tag "$ETCD_IMAGE" \
        --build-arg BASE_IMAGE="$BASE" --label "$label=$version" "$ctx" >"$tmp/etcd.log" 2>&1; then
      tail -n 20 "$tmp/etcd.log" >&2
      echo "build-images.sh: docker build of $ETCD_IMAGE failed (log above)" >&2
      exit 1
    fi
  fi
  docker tag "$ETCD_IMAGE" "sarcomm-etcd:$PROJECT_VERSION"
fi
step "done"
