#!/usr/bin/env bash
# The main job on one machine: a coordinator (embedded SQLite state) and two sar-worker agents with
# two local ranks each, training the SAR-style GCN of examples/gcn/ on a world of 4 over loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

workdir="$(mktemp -d -t sarcomm-demo.XXXXXX)"
read -r grpc_port http_port < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
coord="127.0.0.1:${grpc_port}"

echo "== starting sar-coordinator on ${coord} (HTTP 127.0.0.1:${http_port}, state ${workdir}/state.sqlite)"
sar-coordinator --listen "${coord}" --http "127.0.0.1:${http_port}" --state "${workdir}/state.sqlite" \
  >"${workdir}/coordinator.log" 2>&1 &
coordinator_pid=$!
trap 'kill "${coordinator_pid}" 2>/dev/null || true; wait "${coordinator_pid}" 2>/dev/null || true' EXIT

python - "${http_port}" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 30
while True:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the coordinator did not become healthy within 30 s")
        time.sleep(0.1)
PY

echo "== starting two sar-worker agents, 2 ranks each, training a GCN on a 4-way partitioned graph"
pids=()
for host in a b; do
  sar-worker --coord "${coord}" --job gcn-demo --world-size 4 --nproc-per-node 2 --join-timeout 60 -- \
    python examples/gcn/train.py --epochs 20 2>&1 | sed "s/^/[agent ${host}] /" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done

echo "== sar-coordinator status"
sar-coordinator status --coord "${coord}"
echo "== coordinator log: ${workdir}/coordinator.log"
exit "${status}"
