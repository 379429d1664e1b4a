"""agent_cpu (benchmarks/agent_cpu.py): the ``sar-worker`` agent's own CPU with busy ranks,
reporting every interval against reporting by exception (issue 28)."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, cpu_compared, md_table

TITLE = "agent_cpu: the sar-worker agent's own CPU, per interval against by exception"
#: Issue 28's target for the agent's own CPU with 8 busy ranks (fraction of one core).
TARGET = 0.01


class ModeRow(TypedDict):
    """One way of reporting, measured over ``window_s``."""

    mode: str
    #: Whether the stream took the coordinator's policy (the agent said so in its log).
    by_exception: bool
    ranks: int
    window_s: float
    #: user + system seconds of the agent process over the window, over the window.
    agent_cpu_fraction: float
    #: Heartbeat requests the coordinator counted over the window, per second.
    heartbeats_per_s: float


def headline(rows: list[ModeRow]) -> list[str]:
    by = {r["mode"]: r for r in rows}
    per, exc = by.get("per-interval"), by.get("by-exception")
    lines = [
        f"{r['mode']}: {r['agent_cpu_fraction'] * 100:.2f}% of a core with {r['ranks']} busy ranks "
        f"({'under' if r['agent_cpu_fraction'] < TARGET else 'over'} the 1% target)"
        for r in sorted(rows, key=lambda r: r["mode"] != "by-exception")  # by exception first
    ]
    if per is not None and exc is not None and exc["agent_cpu_fraction"] > 0:
        lines.append(
            cpu_compared(
                "by exception against every interval", exc["agent_cpu_fraction"], per["agent_cpu_fraction"]
            )
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[ModeRow], doc["rows"])
    machine = doc.get("machine", {})
    table = md_table(
        ["mode", "took the policy", "ranks", "window (s)", "agent CPU (% of a core)", "heartbeats/s"],
        [
            (r["mode"], "yes" if r["by_exception"] else "no", r["ranks"], f"{r['window_s']:g}",
             f"{r['agent_cpu_fraction'] * 100:.2f}", f"{r['heartbeats_per_s']:.2f}")
            for r in rows
        ],
    )  # fmt: skip
    body = (
        f"The agent process's user + system time (all threads, from `/proc`) over the window, with "
        f"{rows[0]['ranks'] if rows else 0} ranks that keep stamping progress (enter, leave, publish in a "
        "loop); both modes in one run, one after the other, the same agent command. The ranks are "
        "still read every interval in both: only the sending differs. `/proc` counts CPU time in ticks of "
        f"10 ms: over a {rows[0]['window_s'] if rows else 0:g} s window one tick is "
        f"{(0.01 / rows[0]['window_s'] * 100) if rows else 0:.2f}% of a core. Load: 1-minute load average "
        f"{machine.get('loadavg_1m_at_start', '?')} at the start and {machine.get('loadavg_1m_at_end', '?')} "
        f"at the end on {machine.get('nproc', '?')} CPUs.\n\n{table}"
    )
    return Section.of(doc, "agent_cpu", TITLE, headline(rows), body)
