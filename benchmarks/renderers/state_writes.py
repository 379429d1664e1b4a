"""State writes (benchmarks/state_writes.py): immediate against write-behind."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import (
    Context,
    Section,
    machine_caption,
    machine_line,
    md_table,
    times,
)


class StateWritesRow(TypedDict):
    """One phase of N members, immediate writes (the coordinator before) against written behind:
    the event loop's CPU and wall seconds and its longest hold; ``immediate_scaled_by``: the
    baseline ran a sample of the changes, scaled by this to N."""

    members: int
    phase: str
    immediate_changes: int
    immediate_scaled_by: float
    immediate_loop_cpu_s: float
    immediate_wall_s: float
    immediate_longest_hold_ms: float
    write_behind_loop_cpu_s: float
    write_behind_wall_s: float
    write_behind_longest_hold_ms: float
    write_behind_batches: int
    #: Immediate over write-behind, as recorded (the page says it in words, from the two figures).
    loop_cpu_ratio: float | None


def headline(summary: list[StateWritesRow]) -> list[str]:
    """Every member leaving, at the largest size: the event loop's CPU, immediate against written behind."""
    leaves = [r for r in summary if r["phase"] == "leaves"]
    if not leaves:
        return []
    largest = max(leaves, key=lambda r: r["members"])
    base, ours = largest["immediate_loop_cpu_s"], largest["write_behind_loop_cpu_s"]
    return [
        f"{largest['members']} members leaving cost the event loop {base:.1f} s of CPU with immediate "
        f"writes against {ours:.2f} s written behind: write-behind costs it "
        f"{times(ours, base, 'less', 'more')}; "
        f"longest hold {largest['immediate_longest_hold_ms']:.0f} against "
        f"{largest['write_behind_longest_hold_ms']:.0f} ms"
    ]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    summary = cast(list[StateWritesRow], doc["summary"])
    rows = [
        [
            r["members"],
            r["phase"],
            f"{r['immediate_loop_cpu_s']:g}" + (" (scaled)" if r["immediate_scaled_by"] != 1 else ""),
            f"{r['write_behind_loop_cpu_s']:g}",
            times(r["write_behind_loop_cpu_s"], r["immediate_loop_cpu_s"], "less", "more"),
            f"{r['immediate_longest_hold_ms']:g}",
            f"{r['write_behind_longest_hold_ms']:g}",
            r["write_behind_batches"],
        ]
        for r in summary
    ]
    body = md_table(
        [
            "members",
            "phase",
            "immediate: loop CPU s",
            "write-behind: loop CPU s",
            "write-behind against immediate",
            "immediate: longest hold ms",
            "write-behind: longest hold ms",
            "write-behind batches",
        ],
        rows,
        align="rlrrrrrr",
    )
    body += (
        "\n\nOne job of N single-rank members forms, each member's first report names its metrics "
        "endpoint, and every member leaves: each change rewrites the job's record. Immediate: written on "
        "the event loop at each change (the coordinator before); write-behind: coalesced and written by a "
        "thread, Join and Leave answers waiting for the write. Scaled: the baseline ran a sample of the "
        "changes and is scaled to N (each of its changes costs the same)."
    )
    plot = ""
    leaves = [r for r in summary if r["phase"] == "leaves"]
    if ctx.plt is not None and len(leaves) > 1:
        fig, (ax,) = ctx.figure()
        sizes = [r["members"] for r in leaves]
        ax.plot(sizes, [r["immediate_loop_cpu_s"] for r in leaves], "o-", label="immediate (baseline)")
        ax.plot(sizes, [r["write_behind_loop_cpu_s"] for r in leaves], "o-", label="write-behind")
        ax.set(xscale="log", yscale="log", xlabel="members", ylabel="event-loop CPU s for all leaves")
        ax.set_title("Every member leaving: the event loop's cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "state_writes")
    title = str(doc.get("title") or "State writes")
    return Section.of(doc, "state_writes", title, headline(summary), body, plot)
