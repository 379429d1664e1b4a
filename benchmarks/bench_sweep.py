"""The bench sweep: ``sar-worker ... bench`` through a real coordinator, as a user runs it.

Starts a ``sar-coordinator`` on free loopback ports (state in memory), then one ``sar-worker``
agent with ``--nproc-per-node`` = ``--world`` local ranks (4) on gloo, whose COMMAND is the
built-in bench (``worker/agent/bench.py``): every op over the size sweep, each result checked. The
bench's own JSON (rows of op, bytes, time_us, algbw, busbw, wrong) is kept as it is, with the
command, the machine and the wall time added, so that ``report.py`` can label it. The agent's
exit status is this script's: 1 when any value was wrong.

    python benchmarks/bench_sweep.py --json benchmarks/results/bench_sweep.json   # about 30 s
    python benchmarks/bench_sweep.py --sizes 1K:1M --factor 32 --iters 5          # a smoke pass

It runs what ``benchmarks/README.md`` shows as two commands; the coordinator's log goes to a
temporary directory and is printed if the agent fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import SAR_WORKER, CoordinatorProcess
from recording import describe


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    return describe("torch", "grpcio", load_at="end")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4, help="ranks, all local (--nproc-per-node)")
    parser.add_argument("--backend", default="gloo", help="sar-worker --backend")
    parser.add_argument("--ops", default="all", help="bench --ops")
    parser.add_argument("--sizes", default="1K:16M", help="bench --sizes")
    parser.add_argument("--factor", default="2", help="bench --factor")
    parser.add_argument("--iters", default="50", help="bench --iters")
    parser.add_argument("--warmup", default="5", help="bench --warmup")
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds, given to both the coordinator and the agent (the agent's must not exceed the "
        "coordinator's; 0.5 on the coordinator with the agent's default 1 s fails the job)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the agent may run")
    parser.add_argument("--json", type=Path, help="write the bench's results, labelled, here")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/bench_sweep.py", *(sys.argv[1:] if argv is None else argv)])
    load_at_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="sarcomm-bench-") as tmp:
        log_path = Path(tmp) / "coordinator.log"
        raw_json = Path(tmp) / "bench.json"
        worker_cmd = [
            *SAR_WORKER,
            "--coord", "COORD", "--job", "bench-sweep",
            "--world-size", str(args.world), "--nproc-per-node", str(args.world), "--backend", args.backend,
            "--heartbeat-interval", str(args.heartbeat_interval),
            "bench", "--ops", args.ops, "--sizes", args.sizes, "--factor", args.factor,
            "--iters", args.iters, "--warmup", args.warmup, "--json", str(raw_json),
        ]  # fmt: skip
        with CoordinatorProcess(
            log_path, flags=["--heartbeat-interval", str(args.heartbeat_interval)]
        ) as coordinator:
            worker_cmd[worker_cmd.index("COORD")] = coordinator.target
            started = time.monotonic()
            try:
                status = subprocess.run(worker_cmd, timeout=args.timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                print(f"bench_sweep: sar-worker ran past --timeout {args.timeout:g} s", file=sys.stderr)
                status = 124
            wall = time.monotonic() - started
        if status != 0:
            print(f"bench_sweep: sar-worker exited {status}; coordinator log:", file=sys.stderr)
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        if args.json and raw_json.exists():
            document = json.loads(raw_json.read_text())
            labelled = {
                "benchmark": "bench_sweep",
                "command": command,
                "machine": {**machine(), "loadavg_1m_at_start": load_at_start},
                "wall_seconds": round(wall, 1),
                "exit_status": status,
                **document,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(labelled, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
