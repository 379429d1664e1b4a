"""sweep_cost (benchmarks/sweep_cost.py): the coordinator's liveness sweep at one big job, every
member judged each sweep (per-second reporting) against only the members no open stream stands
for (reports by exception), in process on a fake clock."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, cpu_compared, md_table

TITLE = "The liveness sweep at one big job"


class ProtocolRow(TypedDict):
    """One way of reporting: the median CPU of each kind of sweep and the share of a core the
    four sweeps of a second make."""

    protocol: str
    #: Median CPU milliseconds of the three liveness-only sweeps of a second.
    sweep_ms: float
    #: Median CPU milliseconds of the second's first sweep, which also checks stalls and leases.
    sweep_with_checks_ms: float
    #: (first + 3 x others) / 1000: the fraction of one core the sweeps take.
    core_fraction: float


def pct(fraction: float) -> str:
    """A share of a core as a percentage with three significant digits (by exception it is tiny)."""
    return f"{fraction * 100:.3g}%"


def headline(doc: dict[str, Any]) -> list[str]:
    rows = {r["protocol"]: r for r in cast(list[ProtocolRow], doc["rows"])}
    per, exc = rows.get("per-second"), rows.get("exception")
    members = f"{doc['members']:,} members"
    shares = [
        f"{r['protocol']}: the sweeps take {pct(r['core_fraction'])} of a core at {members}"
        for r in rows.values()
    ]
    if per is None or exc is None:
        return shares
    compared = cpu_compared(
        f"by exception, {pct(exc['core_fraction'])} of a core against {pct(per['core_fraction'])} "
        f"per-second at {members}",
        exc["core_fraction"],
        per["core_fraction"],
    )
    return [compared, *shares]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[ProtocolRow], doc["rows"])
    machine = doc.get("machine", {})
    table = md_table(
        ["protocol", "sweep, liveness only (ms CPU)", "sweep with stall and lease checks (ms CPU)",
         "four sweeps a second (% of a core)"],
        [
            (r["protocol"], f"{r['sweep_ms']:.3f}", f"{r['sweep_with_checks_ms']:.3f}",
             pct(r['core_fraction']))
            for r in rows
        ],
    )  # fmt: skip
    body = (
        f"One job of {doc['agents']:,} agents x {doc['members'] // max(doc['agents'], 1)} ranks = "
        f"{doc['members']:,} members, formed and reported once per agent over its own stream, in "
        "process: the membership domain on a fake clock, no gRPC, no store. Then, for "
        f"{doc['repeats']} seconds of that clock, each second's traffic (every member's report per "
        "second, or each stream's lease renewal by exception; not timed) and the four sweeps of the "
        "second (one every interval / 4): the first also checks stalls and leases, the other three "
        "judge liveness only. The medians are this process's CPU time (other load on the machine "
        "does not count). By exception, the sweep visits only the members no open stream stands "
        "for: here none. Load: 1-minute load average "
        f"{machine.get('loadavg_1m_at_start', '?')} at the start and "
        f"{machine.get('loadavg_1m_at_end', '?')} at the end on {machine.get('nproc', '?')} CPUs.\n\n"
        f"{table}"
    )
    return Section.of(doc, "sweep_cost", TITLE, headline(doc), body)
