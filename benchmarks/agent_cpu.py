"""The ``sar-worker`` agent's own CPU with busy ranks: reporting every interval against reporting by
exception (issue 28), side by side in one run.

For each mode a ``sar-coordinator`` and one ``sar-worker`` with ``--ranks`` local ranks (8 by
default) start on loopback; each rank is this file run with ``--rank-loop``: it keeps a progress
record as the library does (enter a collective, leave it, publish, every ``--pace`` seconds), so
its progress changes all the time and its stamp stays fresh. Once the job runs and the agent's
stream has settled, the agent process's user + system time (all threads, ``/proc``) is read over
``--window`` seconds, with the member reports the coordinator counted
(``sar_coordinator_heartbeats_total``) beside it.

- ``per-interval``: the coordinator runs with ``--per-interval-flags`` (default
  ``--report-policy per-second``: it offers no policy), so the agent sends every rank's report each
  interval, as before issue 28. A coordinator without that flag gets none: it offers what it offers.
- ``by-exception``: the coordinator's defaults; the agent takes the policy it offers (its log says
  so: ``reporting by exception``) and sends only changes and the lease.

Both modes read every rank each interval: only the sending differs.

    python benchmarks/agent_cpu.py [--ranks 8] [--window 20] [--interval 1.0]
        [--json benchmarks/results/agent_cpu.json] [--markdown benchmarks/results/agent_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

from big_job import metric_sum
from harness import SAR_COORDINATOR, SAR_WORKER, CoordinatorProcess, process_cpu_seconds
from recording import describe, write_results
from renderers import agent_cpu as page
from renderers.agent_cpu import ModeRow

JOB = "agent-cpu"
BEATS = "sar_coordinator_heartbeats_total"
#: What the agent logs once its stream takes the coordinator's policy.
TOOK_POLICY = "reporting by exception"
PER_INTERVAL_FLAGS = "--report-policy per-second"


def rank_loop(pace: float) -> int:
    """A busy rank: a progress record that moves every ``pace`` seconds, until SIGTERM."""
    from sarcomm.worker.progress import ProgressWriter

    writer = ProgressWriter(Path(os.environ["SAR_PROGRESS_FILE"]))
    stop = False

    def ended(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, ended)
    while not stop:
        writer.enter("all_reduce")
        time.sleep(pace / 2)
        writer.leave()
        writer.publish()
        time.sleep(pace / 2)
    writer.close()
    return 0


def _job_running(coordinator: CoordinatorProcess, ranks: int) -> bool:
    try:
        jobs = json.loads(coordinator.get("/v1/jobs", timeout=5.0))["jobs"]
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return False
    return any(
        j["job"] == JOB and j.get("state") == "RUNNING" and len(j.get("members", [])) == ranks for j in jobs
    )


def measure(args: argparse.Namespace, work: Path, mode: str, flags: list[str]) -> ModeRow:
    log = work / f"agent-{mode}.log"
    with (
        CoordinatorProcess(
            work / f"coordinator-{mode}.log",
            flags=["--heartbeat-interval", str(args.interval), *flags],
        ) as coordinator,
        log.open("wb") as out,
    ):
        agent = subprocess.Popen(
            [*SAR_WORKER, "--coord", coordinator.target, "--job", JOB, "--world-size", str(args.ranks),
             "--nproc-per-node", str(args.ranks), "--heartbeat-interval", str(args.interval),
             "--no-auto-metrics", "--", sys.executable, __file__, "--rank-loop", "--pace", str(args.pace)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120.0
            while not _job_running(coordinator, args.ranks):
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the job did not run (agent exit {agent.poll()}); see {log}")
                time.sleep(0.2)
            time.sleep(args.settle)  # the offer, the switch, the ranks' start-up
            beats0 = metric_sum(coordinator.get("/metrics"), BEATS)
            cpu0, wall0 = process_cpu_seconds(agent.pid), time.monotonic()
            time.sleep(args.window)
            cpu1, wall1 = process_cpu_seconds(agent.pid), time.monotonic()
            beats1 = metric_sum(coordinator.get("/metrics"), BEATS)
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
    span = wall1 - wall0
    return {
        "mode": mode,
        "by_exception": TOOK_POLICY in log.read_text(errors="replace"),
        "ranks": args.ranks,
        "window_s": round(span, 2),
        "agent_cpu_fraction": round((cpu1 - cpu0) / span, 5),
        "heartbeats_per_s": round((beats1 - beats0) / span, 2),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="local ranks of the one agent")
    p.add_argument("--window", type=float, default=20.0, help="seconds the agent's CPU is read over")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the job runs before the window")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (agent and coordinator)")
    p.add_argument("--pace", type=float, default=0.02, help="seconds per collective of a busy rank")
    p.add_argument(
        "--per-interval-flags", default=PER_INTERVAL_FLAGS,
        help="sar-coordinator flags that make it offer no policy",
    )  # fmt: skip
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rank_loop:
        return rank_loop(args.pace)
    help_text = subprocess.run(
        [*SAR_COORDINATOR, "--help"], capture_output=True, text=True, check=False
    ).stdout
    per_interval = shlex.split(args.per_interval_flags)
    if per_interval and per_interval[0] not in help_text:
        print(
            f"sar-coordinator has no {per_interval[0]}: the per-interval run gets its defaults",
            file=sys.stderr,
        )
        per_interval = []
    machine = describe("grpcio", load_at="start")
    with tempfile.TemporaryDirectory(prefix="agent-cpu-") as tmp:
        rows = [
            measure(args, Path(tmp), "per-interval", per_interval),
            measure(args, Path(tmp), "by-exception", ["--report-policy", "exception"]),
        ]
    machine.update(describe(load_at="end"))
    doc: dict[str, Any] = {
        "benchmark": "agent_cpu",
        "command": shlex.join(["python", "benchmarks/agent_cpu.py", *(argv or sys.argv[1:])]),
        "machine": machine,
        "rows": rows,
    }
    write_results(doc, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
