"""The coordinator's event loop during a big job's bursts (benchmarks/burst_lag.py): its lag p99
(its own ``sar_coordinator_event_loop_lag_seconds``) while every agent attaches, while every agent
is asked for progress at once, and while every agent re-attaches after a restart.

The row the benchmark records is typed here (:class:`BurstLagRow`).
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, md_table

TITLE = "The event loop during a big job's bursts"
#: Issue 28's bound on the lag's p99, s.
TARGET_P99_S = 0.25
BURSTS = {
    "start": "the job's start: every agent joins and opens its stream",
    "stall": "every agent's ranks quiet at once: progress asked of every stream",
    "restart": "the coordinator restarted: every agent re-attaches",
}


class BurstLagRow(TypedDict):
    """One burst at ``agents`` x ``ranks_per_agent``."""

    burst: str
    agents: int
    ranks: int
    protocol: str
    streams_by_exception: int
    #: Agents that completed the burst (attached; asked for progress; re-attached).
    done: int
    #: The burst's start to its last agent done, s (None: not all within ``deadline_s``).
    took_s: float | None
    deadline_s: float
    #: The loop lag's p99 over the burst: the upper bound of the histogram bucket it falls in, s.
    lag_p99_s: float | None
    #: Lag samples over the burst (one due every 50 ms), and how many were over the target.
    lag_samples: int
    lag_over_target: int
    #: The bound of the highest bucket a sample reached, s (inf: over the last bound).
    lag_max_s: float | None
    coordinator_cpu_s: float
    #: For ``restart``: the kill to the new process serving, s (the rest of ``took_s`` is the
    #: agents' reconnecting).
    serving_s: float | None
    met: bool


def headline(rows: list[BurstLagRow]) -> list[str]:
    lines = []
    for r in rows:
        p99 = f"<= {r['lag_p99_s']:g} s" if r["lag_p99_s"] is not None else "-"
        took = f"{r['took_s']:.2f} s" if r["took_s"] is not None else f"not within {r['deadline_s']:g} s"
        lines.append(
            f"{BURSTS.get(r['burst'], r['burst'])}, {r['ranks']} ranks: loop lag p99 {p99} "
            f"(target {TARGET_P99_S:g} s: {'met' if r['met'] else 'missed'}); {r['done']} of "
            f"{r['agents']} agents in {took}"
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[BurstLagRow], doc["rows"])
    table = md_table(
        ["burst", "ranks", "by exception", "agents done", "took", "lag p99", "samples over 250 ms",
         "lag max", "coordinator CPU", "serving again"],
        [
            (
                BURSTS.get(r["burst"], r["burst"]), str(r["ranks"]), str(r["streams_by_exception"]),
                f"{r['done']} / {r['agents']}",
                f"{r['took_s']:.2f} s" if r["took_s"] is not None else f"> {r['deadline_s']:g} s",
                f"<= {r['lag_p99_s']:g} s" if r["lag_p99_s"] is not None else "-",
                f"{r['lag_over_target']} / {r['lag_samples']}",
                f"<= {r['lag_max_s']:g} s" if r["lag_max_s"] is not None else "-",
                f"{r['coordinator_cpu_s']:.2f} s",
                f"{r['serving_s']:.2f} s" if r["serving_s"] is not None else "-",
            )
            for r in rows
        ],
        "lrrrrrrrrr",
    )  # fmt: skip
    body = table + (
        "\n\nLag: the coordinator's own histogram (a timer due every 50 ms, how late it fired), its "
        "samples between the burst's start and its end; p99 and max are the upper bounds of the "
        "buckets they fall in."
    )
    return Section.of(doc, "burst_lag", TITLE, headline(rows), body)
