"""The steady state of one big job: what a coordinator spends while N agents x R ranks report, as one
JSON object that others can script (issue 28's reproducible figure).

A fresh ``sar-coordinator`` on loopback (SQLite state file) and ``load_agents.py`` processes
(``--procs`` of them) simulating ``--agents`` agents of ``--ranks-per-agent`` ranks, each on a TCP
connection of its own (counted), with pre-built requests: every agent joins (one Join with its
ranks), opens its Heartbeat stream and sends its ranks' full report; then, by ``--protocol``:

- ``exception`` (the default): on an answer that carries the coordinator's ``policy``, the agent
  reports by exception, as ``sar-worker``'s agent does: nothing changes here, so it sends one empty
  request (``by_exception``) every ``policy.lease_seconds``, the lease's renewal. A coordinator that
  offers no policy gets every rank's report every ``--interval``, as from an old agent
  (``streams_by_exception`` says how many streams switched: 0 then).
- ``per-second``: every rank's progress every ``--interval`` (the old reporting; its beats spread
  over the interval).

After ``--warmup`` seconds, over ``--window`` seconds (default: two lease periods by exception, at
least 20 s), it records:

- ``coordinator_cpu_fraction``: the coordinator process's user + system CPU time, all threads (from
  /proc), over the window, as a fraction of one core (also split into user and system);
- ``connections``: TCP connections the coordinator holds on its gRPC port (counted from /proc at
  the window's start and end, as ``ss`` lists them, not assumed; the smaller is reported);
- ``members_wrongly_failed``: members the coordinator judged failed from the join to the window's
  end (its ``sar_coordinator_member_failures_total``; nothing here fails, so every one is wrong);
- ``rss_mib``: the coordinator's peak RSS in the window; requests and reports offered a second
  (written by the load processes) and reports processed (``sar_coordinator_heartbeats_total``);
- ``endpoint_s``: ``/v1/jobs?job=``, ``/sd`` and ``/metrics`` each fetched once after the window.

``--compare`` runs, in one run and each with a fresh process, by exception, per second, and the gRPC
floor (``grpc_floor.py``, one connection per agent) twice: the per-second requests answered by
gRPC alone (``grpc-floor``), and the same floor offering a policy with the coordinator's lease
(``grpc-floor-exception``: the lease renewals and keepalive pings of open streams, nothing
decided); it writes their rows side by side with the ratios in the headline. Several sizes
(``--agents 4096,8192``) are measured in turn into one document (the growth curve).

Run::

    python benchmarks/steady_state.py --agents 4096 --json steady-4096.json
    python benchmarks/steady_state.py --agents 4096,8192 --compare --json benchmarks/results/steady_state.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from big_job import Clients, Code, Coordinator, metric_sum
from harness import connections, memory_kib, process_cpu_times
from recording import describe, write_results
from renderers import steady_state as page
from renderers.steady_state import SteadyRow

#: How the simulated agents report: by exception (the coordinator's policy) or every interval.
PROTOCOLS = ("exception", "per-second")
JOB = "steady"
FAILURES = "sar_coordinator_member_failures_total"
BEATS = "sar_coordinator_heartbeats_total"
#: The lease the floor offers by exception when the coordinator offered none, s.
DEFAULT_FLOOR_LEASE_S = 10.0
#: The shortest window, s.
MIN_WINDOW_S = 20.0


def measure(
    args: argparse.Namespace, work: Path, protocol: str, floor: bool = False, offer: float = 0.0
) -> SteadyRow:
    """One coordinator (or the floor, offering a policy with ``lease`` when above 0) under
    ``args.agents`` agents reporting by ``protocol``."""
    ranks = args.agents * args.ranks_per_agent
    code = Code("grpc-floor", None, floor=True) if floor else Code("current", None)
    # The coordinator offers reports by exception (per-second agents ignore the offer, as old ones do).
    flags = (["--lease", str(offer)] if offer > 0 else []) if floor else ["--report-policy", "exception"]
    with Coordinator(code, work, None, args.interval, args.misses, flags=flags) as coordinator:
        pid = coordinator.proc.pid
        failures0 = metric_sum(coordinator.metrics(), FAILURES)
        group = Clients(
            coordinator.target, JOB, args.agents, args.ranks_per_agent, args, 0, protocol=protocol
        )
        try:
            start = time.monotonic() + 0.5
            group.tell_all({"join": start})
            joined = group.answer_all("joined")
            join_errors = [e for a in joined for e in a["errors"]]
            if join_errors:
                raise RuntimeError(f"{len(join_errors)} joins failed, e.g. {join_errors[0]}")
            formed_s = max(t for a in joined for t in a["joined"]) - start
            began = time.monotonic()
            group.tell_all({"beat": {"until": began + 36000, "window": [began, began + 36000]}})
            group.answer_all("beating")
            time.sleep(max(0.0, began + args.warmup - time.monotonic()))
            group.tell_all({"lease": True})
            offered = group.answer_all("lease")
            leases = [a["lease"] for a in offered if a["lease"]]
            lease = max(leases) if leases else None
            switched = sum(a["by_exception"] for a in offered)
            length = args.window or max(MIN_WINDOW_S, 2 * lease if lease else 0.0)
            held0 = connections(coordinator.grpc_port, pid)
            beats0 = metric_sum(coordinator.metrics(), BEATS)
            cpu0, wall0, clients0 = process_cpu_times(pid), time.monotonic(), group.cpu()
            window = (wall0, wall0 + length)
            rss = memory_kib(pid)["VmRSS"]
            while time.monotonic() < window[1]:
                time.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
                rss = max(rss, memory_kib(pid)["VmRSS"])
            cpu1, wall1, clients1 = process_cpu_times(pid), time.monotonic(), group.cpu()
            held1 = connections(coordinator.grpc_port, pid)
            metrics = coordinator.metrics()
            endpoint_s = {} if floor else _endpoints(coordinator)
            group.tell_all({"results": {"window": window}})
            results = group.answer_all("results")
        finally:
            group.close()
    span = wall1 - wall0
    beat = [r["results"] for r in results]
    requests = sum(b["written"] for b in beat)
    full = sum(b["reported"] for b in beat)
    return {
        "agents": args.agents,
        "ranks_per_agent": args.ranks_per_agent,
        "ranks": ranks,
        "protocol": ("grpc-floor-exception" if offer > 0 else "grpc-floor") if floor else protocol,
        "connections": min(held0, held1),
        "connections_at_window": [held0, held1],
        "streams_by_exception": switched,
        "lease_s": lease,
        "window_s": round(span, 3),
        "interval_s": args.interval,
        "misses": args.misses,
        "coordinator_cpu_fraction": round((cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) / span, 4),
        "coordinator_user_fraction": round((cpu1[0] - cpu0[0]) / span, 4),
        "coordinator_system_fraction": round((cpu1[1] - cpu0[1]) / span, 4),
        "members_wrongly_failed": int(metric_sum(metrics, FAILURES) - failures0),
        "rss_mib": round(rss / 1024, 1),
        "offered_requests_per_s": round(requests / span, 1),
        "offered_reports_per_s": round(full * args.ranks_per_agent / span),
        "processed_reports_per_s": round((metric_sum(metrics, BEATS) - beats0) / span),
        "load_generator_cpu_fraction": round((clients1 - clients0) / span, 3),
        "load_processes": args.procs,
        "formed_s": round(formed_s, 3),
        "endpoint_s": endpoint_s,
        "client_errors": [e for r in results for e in r["errors"]][:5],
    }


def _endpoints(coordinator: Coordinator) -> dict[str, float]:
    """Seconds each endpoint takes to answer, once."""
    took = {}
    for path in (f"/v1/jobs?job={JOB}", "/sd", "/metrics"):
        began = time.monotonic()
        coordinator.get(path)
        took[path] = round(time.monotonic() - began, 3)
    return took


def _sizes(text: str) -> list[int]:
    return [int(size) for size in text.split(",") if size]


def compare(args: argparse.Namespace, work: Path) -> list[SteadyRow]:
    """By exception, per second, and the floor both ways, at ``args.agents`` agents."""
    rows = [measure(args, work, "exception"), measure(args, work, "per-second")]
    rows.append(measure(args, work, "per-second", floor=True))
    lease = args.floor_lease or rows[0]["lease_s"] or DEFAULT_FLOOR_LEASE_S
    rows.append(measure(args, work, "exception", floor=True, offer=lease))
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--agents",
        type=_sizes,
        required=True,
        help="simulated agents (one connection each); several, comma-separated, measure each in turn",
    )
    p.add_argument("--ranks-per-agent", type=int, default=8, help="ranks of each agent (8)")
    p.add_argument(
        "--window",
        type=float,
        default=0.0,
        help="measured seconds (default: two lease periods by exception, at least 20)",
    )
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of reports before the window (10)")
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="exception",
        help="how agents report: exception (the coordinator's policy, when offered) or per-second "
        "(every rank's progress every interval)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run exception, per-second and the gRPC floor one after another, rows side by side",
    )
    p.add_argument(
        "--floor-lease",
        type=float,
        default=0.0,
        help="the lease the floor offers by exception under --compare (default: the coordinator's, or "
        f"{DEFAULT_FLOOR_LEASE_S:g} s when it offered none)",
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
    p.add_argument("--markdown", type=Path, default=None, help="write its page here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sizes = args.agents
    if not sizes or min(sizes) < 1 or args.ranks_per_agent < 1 or args.procs < 1 or args.window < 0:
        parser().error("--agents, --ranks-per-agent and --procs must be at least 1, --window not negative")
    args.probes = 0  # (what big_job.Clients reads: no probe process here)
    with tempfile.TemporaryDirectory(prefix="steady-") as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any]
        if args.compare or len(sizes) > 1:
            rows: list[SteadyRow] = []
            for size in sizes:
                args.agents = size
                rows += compare(args, work) if args.compare else [measure(args, work, args.protocol)]
            result = {"rows": rows, "headline": page.headline(rows)}
        else:
            args.agents = sizes[0]
            result = dict(measure(args, work, args.protocol))
    result["benchmark"] = args.json.stem
    result["title"] = page.TITLE
    result["command"] = " ".join(["python", "benchmarks/steady_state.py", *(argv or sys.argv[1:])])
    result["machine"] = describe("grpcio", "protobuf", load_at="end")
    write_results(result, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
