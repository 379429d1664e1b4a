#!/usr/bin/env bash
# The GPU check of issue 27, for a machine with one CUDA GPU, a CUDA build of torch, python3,
# grpcio, protobuf, prometheus-client and uvloop, and no network. Runs the project from this
# working tree (nothing is installed): the package as it installs, laid out as links
# (scripts/linktree.sh), with the metadata that gives torch sarcomm's entry points
# (torch.backends: zero-code metrics; torchrun.handlers: --rdzv-backend=sarcomm); the pure-Python
# dependencies that machine lacks are unpacked from scripts/gpu-wheels/ into a temporary folder.
#
# Then scripts/gpu_check.py starts a coordinator and checks and prints: on one nccl rank, the
# recorded duration of all_gather_into_tensor (4 KiB to 1 GiB) against CUDA-event timings (within
# 10% from 64 MiB, far above the launch time); a DDP script that never imports sarcomm under
# torchrun --rdzv-backend=sarcomm with every gradient all_reduce counted and its endpoint in /sd.
# Under 5 minutes; exits 0 when every check passed. Usage: bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "grpc", "google.protobuf", "prometheus_client", "uvloop") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu-check: missing {', '.join(missing)}: install them first (a CUDA build of torch)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA GPU")
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, python {sys.version.split()[0]}")
PY

tree="$root/$(bash scripts/linktree.sh)"
dist="$tree/sarcomm-0.1.0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: sarcomm\nVersion: 0.1.0\n' > "$dist/METADATA"
cat > "$dist/entry_points.txt" <<'ENTRY'
[torch.backends]
sarcomm = sarcomm.worker.autometrics.entry:load

[torchrun.handlers]
sarcomm = sarcomm.worker.torchrun:create_handler
ENTRY

# Unpack only the wheels whose modules this python lacks (a wheel is a zip of its files).
python3 - "$work/site" scripts/gpu-wheels/*.whl <<'PY'
import importlib.util, sys, zipfile
target, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/")[0].removesuffix(".py") for n in zf.namelist()
                if not n.split("/")[0].endswith((".dist-info", ".data"))}
        if any(importlib.util.find_spec(t) is None for t in tops):
            zf.extractall(target)
            print(f"gpu-check: using {wheel.rsplit('/', 1)[-1]}")
PY

export PYTHONPATH="$tree:$root:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
timeout 290 python3 scripts/gpu_check.py
