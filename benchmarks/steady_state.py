"""The steady state of one big job: what a coordinator spends while N agents x R ranks report, as one
JSON object that others can script (issue 28's reproducible figure).

A fresh ``sar-coordinator`` on loopback (SQLite state file) and ``load_agents.py`` processes
(``--procs`` of them) simulating ``--agents`` agents of ``--ranks-per-agent`` ranks: every agent
joins (one Join with its ranks), then keeps one Heartbeat stream on a TCP connection of its own and
writes one pre-built request with its ranks' reports every ``--interval`` (its beats spread over the
interval). After ``--warmup`` seconds of that, for ``--window`` seconds, it records:

- ``coordinator_cpu_fraction``: the coordinator process's user + system CPU time, all threads (from
  /proc), over the window, as a fraction of one core (also split into user and system);
- ``connections``: TCP connections the coordinator holds on its gRPC port (counted from /proc at
  the window's start and end, not assumed; the smaller is reported, both are kept);
- ``members_wrongly_failed``: members the coordinator judged failed from the join to the window's
  end (its ``sar_coordinator_member_failures_total``; nothing here fails, so every one is wrong);
- ``rss_mib``: the coordinator's peak RSS in the window; ``offered_reports_per_s`` (written by the
  load processes) and ``processed_reports_per_s`` (the coordinator's
  ``sar_coordinator_heartbeats_total``), so a load generator that fell behind shows;
- ``protocol``: how agents report. Today the only one is ``per-second`` (every agent sends every
  rank's progress every interval, as ``sar-worker`` does now); issue 28's reporting by exception
  will be a second choice, run by the same command for comparison.

Run::

    python benchmarks/steady_state.py --agents 4096 --json steady-4096.json
    python benchmarks/steady_state.py --agents 8192 --window 30 --procs 8 --json steady-8192.json

Nothing of it is rendered into RESULTS.md yet: its first real run (4,096 and 8,192 agents, on an
idle machine) comes with the redesign, old and new protocol side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from big_job import Clients, metric_sum
from harness import CoordinatorProcess, connections, memory_kib, process_cpu_times
from recording import describe

#: The reporting protocols this coordinator and its agents speak (the redesign adds its own).
PROTOCOLS = ("per-second",)
JOB = "steady"
FAILURES = "sar_coordinator_member_failures_total"
BEATS = "sar_coordinator_heartbeats_total"


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ranks = args.agents * args.ranks_per_agent
    coordinator = CoordinatorProcess(
        work / "coordinator.log",
        state=work / "state.sqlite",
        flags=["--heartbeat-interval", str(args.interval), "--heartbeat-misses", str(args.misses),
               "--join-timeout", "300", "--max-world-size", str(max(65536, ranks)),
               "--shutdown-grace", "1"],
    )  # fmt: skip
    with coordinator:
        pid = coordinator.proc.pid
        failures0 = metric_sum(coordinator.get("/metrics"), FAILURES)
        group = Clients(coordinator.target, JOB, args.agents, args.ranks_per_agent, args, 0)
        try:
            start = time.monotonic() + 0.5
            group.tell_all({"join": start})
            joined = group.answer_all("joined")
            join_errors = [e for a in joined for e in a["errors"]]
            if join_errors:
                raise RuntimeError(f"{len(join_errors)} joins failed, e.g. {join_errors[0]}")
            formed_s = max(t for a in joined for t in a["joined"]) - start
            began = time.monotonic()
            window = (began + args.warmup, began + args.warmup + args.window)
            group.tell_all({"beat": {"until": window[1] + args.after, "window": window}})
            group.answer_all("beating")
            time.sleep(max(0.0, window[0] - time.monotonic()))
            held0 = connections(coordinator.grpc_port, pid)
            beats0 = metric_sum(coordinator.get("/metrics"), BEATS)
            cpu0, wall0, clients0 = process_cpu_times(pid), time.monotonic(), group.cpu()
            rss = memory_kib(pid)["VmRSS"]
            while time.monotonic() < window[1]:
                time.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
                rss = max(rss, memory_kib(pid)["VmRSS"])
            cpu1, wall1, clients1 = process_cpu_times(pid), time.monotonic(), group.cpu()
            held1 = connections(coordinator.grpc_port, pid)
            metrics = coordinator.get("/metrics")
            group.tell_all({"results": True})
            results = group.answer_all("results")
        finally:
            group.close()
    span = wall1 - wall0
    beat = [r["results"] for r in results]
    written = sum(b["written"] for b in beat) * args.ranks_per_agent / args.window
    return {
        "agents": args.agents,
        "ranks_per_agent": args.ranks_per_agent,
        "ranks": ranks,
        "protocol": args.protocol,
        "connections": min(held0, held1),
        "connections_at_window": [held0, held1],
        "window_s": round(span, 3),
        "interval_s": args.interval,
        "misses": args.misses,
        "coordinator_cpu_fraction": round((cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) / span, 4),
        "coordinator_user_fraction": round((cpu1[0] - cpu0[0]) / span, 4),
        "coordinator_system_fraction": round((cpu1[1] - cpu0[1]) / span, 4),
        "members_wrongly_failed": int(metric_sum(metrics, FAILURES) - failures0),
        "rss_mib": round(rss / 1024, 1),
        "offered_reports_per_s": round(written),
        "processed_reports_per_s": round((metric_sum(metrics, BEATS) - beats0) / span),
        "load_generator_cpu_fraction": round((clients1 - clients0) / span, 3),
        "load_processes": args.procs,
        "formed_s": round(formed_s, 3),
        "client_errors": [e for r in results for e in r["errors"]][:5],
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, required=True, help="simulated agents (one connection each)")
    p.add_argument("--ranks-per-agent", type=int, default=8, help="ranks of each agent (8)")
    p.add_argument("--window", type=float, default=20.0, help="measured seconds (20)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of reports before the window (10)")
    p.add_argument("--after", type=float, default=2.0, help="seconds of reports after the window (2)")
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="per-second",
        help="how agents report: per-second (every rank's progress every interval, today's only one)",
    )
    p.add_argument("--procs", type=int, default=4, help="load processes the agents are spread over (4)")
    p.add_argument("--interval", type=float, default=1.0, help="the coordinator's --heartbeat-interval (1)")
    p.add_argument(
        "--misses",
        type=int,
        default=10,
        help="the coordinator's --heartbeat-misses (10, as big_job.py: on a small machine the load "
        "processes share its cores and answer a join burst of thousands slowly)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep the coordinator's log and state here")
    p.add_argument("--json", type=Path, required=True, help="write the result here (one JSON object)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.agents < 1 or args.ranks_per_agent < 1 or args.procs < 1 or args.window <= 0:
        parser().error("--agents, --ranks-per-agent and --procs must be at least 1, --window above 0")
    args.probes = 0  # (what big_job.Clients reads: no probe process here)
    with tempfile.TemporaryDirectory(prefix="steady-") as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    result["command"] = " ".join(["python", "benchmarks/steady_state.py", *(argv or sys.argv[1:])])
    result["machine"] = describe("grpcio", "protobuf", load_at="end")
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
