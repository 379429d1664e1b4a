"""The liveness sweep's cost at one big job, per-second reporting against reports by exception, in
process (the membership domain, a fake clock), side by side in one run.

A job of AGENTS x RANKS members forms (one Join per agent, 8,192 x 8 = 65,536 by default), each
agent's members are reported once over its own stream, and then either every stream stays a
per-interval reporter (``per-second``: every member is judged by the sweep, as before) or every
stream takes the policy (``exception``: its members are trusted, the sweep does not visit them).
Then, for REPEATS seconds of a fake clock, each second's reports arrive (every member's report,
or only each stream's lease renewal) and the four sweeps of that second run: the first also
checks stalls and leases (once a second), the other three judge liveness only. Printed: the median
CPU milliseconds of each kind of sweep (this process's CPU time: other load on the machine does
not count), the share of one core the four make, and the ratio of the shares: the page its
renderer draws (``renderers/sweep_cost.py``, the section of ``RESULTS.md``), written to --json and
--markdown where asked. The reports themselves are not timed.

    python benchmarks/sweep_cost.py --json benchmarks/results/sweep_cost.json   # 65,536 members, ~30 s
    python benchmarks/sweep_cost.py --agents 512 --repeats 20                    # a smoke pass
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recording import describe, write_results
from renderers import sweep_cost as page
from renderers.sweep_cost import ProtocolRow

from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.domain.membership import JoinSpec, Member, MemberRequest, Membership, Progress
from sarcomm.coordinator.domain.reporters import Reporter

LOOPBACK = (InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK),)
#: Sweeps a heartbeat interval (coordinator/term.py: every interval / 4).
SWEEPS_PER_INTERVAL = 4


class Clock:
    """The coordinator's clocks, moved by the benchmark."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_699_999_000.0 + self.now


class Job:
    """One running job of ``agents`` x ``ranks`` members, each agent's members reported over its
    own stream; with ``by_exception`` each stream took the policy."""

    def __init__(self, agents: int, ranks: int, by_exception: bool) -> None:
        self.clock = Clock()
        self.membership = Membership(liveness_timeout=3.0, clock=self.clock)
        self.by_exception = by_exception
        world = agents * ranks
        self.streams: list[tuple[Reporter, list[tuple[Member, Progress | None, float]]]] = []
        for i in range(agents):
            ticket = self.membership.join(
                JoinSpec(
                    job="big",
                    world_size=world,
                    host=f"node{i}",
                    interfaces=LOOPBACK,
                    store_port=29500,
                    members=tuple(MemberRequest(local_rank=r) for r in range(ranks)),
                )
            )
            stream = Reporter()
            stream.members.update(m.member_id for m in ticket.members)
            self.streams.append((stream, [(m, Progress(), 0.0) for m in ticket.members]))
        for stream, reports in self.streams:  # each stream's first request: a full report
            self.membership.beats(reports, stream)
            if by_exception:
                self.membership.took_policy(stream, 10.0)

    def beat(self) -> None:
        """One second of the reporters' traffic: every member's report (per-second), or the
        streams' lease renewals (by exception; all of them, the most a second can bring)."""
        for stream, reports in self.streams:
            if self.by_exception:
                self.membership.by_exception.renew(stream)
            else:
                self.membership.beats(reports, stream)


def cpu_ms(job: Job, repeats: int) -> tuple[float, float]:
    """The median CPU milliseconds of the sweep that comes first each second (it also checks
    stalls and leases) and of the three after it (liveness only)."""
    first: list[float] = []
    others: list[float] = []
    for _ in range(repeats):
        job.clock.now += 1.0
        job.beat()
        for timed in (first, others, others, others):
            started = time.process_time()
            failed = job.membership.sweep()
            timed.append(time.process_time() - started)
            assert not failed, failed
    return statistics.median(first) * 1000, statistics.median(others) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--agents", type=int, default=8192, help="agents (streams)")
    parser.add_argument("--ranks-per-agent", type=int, default=8, help="members of each agent")
    parser.add_argument("--repeats", type=int, default=10, help="seconds of sweeps timed for each protocol")
    parser.add_argument("--json", type=Path, help="write the result here too")
    parser.add_argument("--markdown", type=Path, help="write the page here too")
    args = parser.parse_args(argv)
    machine = describe("grpcio", load_at="start")
    rows: list[ProtocolRow] = []
    for protocol in ("per-second", "exception"):
        job = Job(args.agents, args.ranks_per_agent, protocol == "exception")
        each_second, others = cpu_ms(job, args.repeats)
        rows.append(
            ProtocolRow(
                protocol=protocol,
                sweep_ms=round(others, 3),
                sweep_with_checks_ms=round(each_second, 3),
                # Four sweeps a second: one with the stall and lease checks, three without.
                core_fraction=round((each_second + 3 * others) / 1000, 8),
            )
        )
        del job
    machine.update(describe(load_at="end"))
    doc: dict[str, Any] = {
        "benchmark": "sweep_cost",
        "command": shlex.join(["python", "benchmarks/sweep_cost.py", *(argv or sys.argv[1:])]),
        "machine": machine,
        "members": args.agents * args.ranks_per_agent,
        "agents": args.agents,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_results(doc, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
