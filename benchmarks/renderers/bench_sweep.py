"""The collective bench sweep (benchmarks/bench_sweep.py, ``sar-worker ... bench``).

The rows are what ``sar-worker ... bench --json`` writes: its own :class:`~sarcomm.worker.agent.bench.Row`,
read back as that type.
"""

from __future__ import annotations

from typing import Any

from render import (
    Context,
    Section,
    human_bytes,
    machine_caption,
    machine_line,
    md_table,
    span,
)

from sarcomm.worker.agent.bench import Row


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = [Row(**r) for r in doc["rows"]]
    ops = list(dict.fromkeys(r.op for r in rows))
    # The split ops round a size down to a multiple of the world, so the same requested size shows
    # as different bytes per op. Every op runs the same sweep in the same order: the i-th row of
    # each op belongs to the i-th requested size, labelled with the largest bytes of that step.
    by_op = {op: sorted((r for r in rows if r.op == op), key=lambda r: r.bytes) for op in ops}
    steps = max(len(v) for v in by_op.values())
    labels = [max(v[i].bytes for v in by_op.values() if i < len(v)) for i in range(steps)]
    grid = sorted(labels)

    def at(op: str, size: int) -> Row | None:
        i = labels.index(size)
        return by_op[op][i] if i < len(by_op[op]) else None

    wrong = sum(r.wrong for r in rows)
    top = grid[-1]
    copy, tcp = ctx.ceiling.get("copy"), ctx.ceiling.get("tcp")
    parts = []
    for op in ops:
        r = at(op, top)
        if r is None:
            continue
        parts.append(f"{op} {r.busbw:.2f}" + (f" ({r.busbw / tcp:.0%})" if tcp else ""))
    headline = [
        f"busbw at {human_bytes(top)}, GB/s"
        + (f" (in brackets: share of loopback TCP's {tcp:.1f} GB/s)" if tcp else "")
        + ": "
        + ", ".join(parts)
    ]
    small = [at(op, grid[0]) for op in ops]
    latencies = [r.time_us / 1e3 for r in small if r]
    headline.append(
        f"{doc.get('world_size', '?')} ranks, {doc.get('backend', '?')}: "
        f"{wrong} wrong value(s) over {len(rows)} checked rows; {human_bytes(grid[0])} calls take "
        f"{span(latencies, lambda x: f'{x:.1f} ms')}"
    )
    if copy:
        headline.append(
            f"ceiling (memcpy.json, best samples): one core copies {copy:.1f} GB/s"
            + (f", loopback TCP carries {tcp:.1f} GB/s" if tcp else "")
        )
    table = md_table(
        ["size", *ops],
        [(human_bytes(s), *(f"{r.busbw:.3f}" if (r := at(op, s)) else "-" for op in ops)) for s in grid],
    )
    times = md_table(
        ["size", *ops],
        [
            (human_bytes(s), *(f"{r.time_us / 1e3:.2f}" if (r := at(op, s)) else "-" for op in ops))
            for s in grid
        ],
    )
    body = (
        f"busbw (GB/s) by size and op, `sar-worker ... bench`, {doc.get('iters', '?')} timed calls per row "
        f"after {doc.get('warmup', '?')} warm-up; nccl-tests' bus factors.\n\n{table}\n\n"
        f"<details><summary>time per call (ms), the slowest rank's mean</summary>\n\n{times}\n\n</details>"
    )
    plot = ""
    if ctx.plt is not None:
        fig, (ax,) = ctx.figure(1, 8.0)
        for op in ops:
            points = [(s, r.busbw) for s in grid if (r := at(op, s)) and r.busbw > 0]
            if points:
                ax.plot(*zip(*points, strict=True), "o-", markersize=3, label=op)
        for value, label, style in (
            (copy, "memcpy, 1 thread", "--"),
            (tcp, "loopback TCP, 2 processes", ":"),
        ):
            if value:
                ax.axhline(value, color="black", linestyle=style, linewidth=1)
                ax.annotate(
                    f"{label}: {value:.1f} GB/s",
                    (grid[0], value),
                    xytext=(0, 3),
                    textcoords="offset points",
                    fontsize=8,
                )
        ax.set(xscale="log", yscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)")
        ax.set_xticks(grid, [human_bytes(s).replace(" ", "") for s in grid], rotation=45)
        ax.minorticks_off()
        ax.set_title(
            f"bench sweep: bus bandwidth, {doc.get('world_size', '?')} ranks, {doc.get('backend', '')}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "bench_sweep")
    return Section.of(
        doc, "bench_sweep", "Collective bench sweep (`sar-worker ... bench`)", headline, body, plot
    )
