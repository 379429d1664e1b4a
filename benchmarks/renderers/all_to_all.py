"""all_to_all with unequal sizes (benchmarks/all_to_all.py) against SAR's fallback and a2a_single."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, cast

from render import (
    Context,
    Section,
    baseline_commit,
    faster,
    human_bytes,
    machine_caption,
    machine_line,
    md_table,
    span,
)


class SizeRow(TypedDict):
    """One size: each method's median time per call, and the others' over sarcomm's (> 1: sarcomm
    is faster). ``baseline_over_sarcomm``: an earlier commit's all_to_all timed in the same run."""

    bytes_per_rank: int
    iterations: int
    median_seconds: dict[str, float]
    sar_fallback_over_sarcomm: float
    a2a_single_over_sarcomm: float
    baseline_over_sarcomm: NotRequired[float]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[SizeRow], doc["rows"])
    methods = list(rows[0]["median_seconds"])
    sizes = [r["bytes_per_rank"] for r in rows]
    fallback = [r["sar_fallback_over_sarcomm"] for r in rows]
    single = [r["a2a_single_over_sarcomm"] for r in rows]
    # An earlier commit's all_to_all timed in the same run (--baseline-ref), where there is one.
    before = [r["baseline_over_sarcomm"] for r in rows if "baseline_over_sarcomm" in r]
    table_rows = [
        (
            human_bytes(r["bytes_per_rank"]),
            *(f"{r['median_seconds'][m] * 1e3:.3f}" for m in methods),
            faster(r["sar_fallback_over_sarcomm"]),
            faster(r["a2a_single_over_sarcomm"]),
            *([faster(r.get("baseline_over_sarcomm", 0.0))] if before else []),
        )
        for r in rows
    ]
    body = md_table(
        [
            "bytes per rank",
            *(f"{m} ms" for m in methods),
            "sarcomm against fallback",
            "sarcomm against a2a_single",
            *(["sarcomm against baseline"] if before else []),
        ],
        table_rows,
    )
    body += (
        f"\n\n{doc.get('world_size', '?')} ranks, {doc.get('backend', 'gloo')}, "
        f"{doc.get('transport', 'loopback')}; {doc.get('statistic', 'median')}. sar_fallback is SAR's own "
        "gloo path (isend to all, recv in rank order, barrier); "
        "a2a_single is the same exchange with all_to_all_single and split sizes."
        + (
            f" baseline is sarcomm's all_to_all at commit {baseline_commit(doc)}, timed in the same run."
            if before and "baseline" in doc
            else ""
        )
    )
    # The smallest size from which sarcomm beats all_to_all_single at every larger size too.
    tail = len(single)
    while tail > 0 and single[tail - 1] > 1.0:
        tail -= 1
    headline = [
        f"sarcomm against SAR's gloo fallback: **{span(fallback, faster)}** "
        f"(faster at {sum(r > 1 for r in fallback)} of {len(rows)} sizes)",
        f"against all_to_all_single: **{span(single, faster)}** "
        + (
            f"({span(single[tail:], faster)} at every size from {human_bytes(sizes[tail])} up)"
            if 0 < tail < len(single)
            else "(faster at every size)"
            if tail == 0
            else "(not faster at the largest size)"
        ),
    ]
    if before:
        headline.append(
            f"against the same code before this change (commit {baseline_commit(doc)}, same run): "
            f"{span(before, faster)}"
        )
    plot = ""
    if ctx.plt is not None:
        fig, (left, right) = ctx.figure(2, 5.5)
        for m in methods:
            left.plot(sizes, [r["median_seconds"][m] * 1e3 for r in rows], "o-", label=m, markersize=4)
        left.set(xscale="log", yscale="log", xlabel="bytes sent per rank", ylabel="time per call (ms)")
        left.set_title("all_to_all, unequal sizes: time")
        right.plot(sizes, fallback, "o-", label="SAR fallback / sarcomm")
        right.plot(sizes, single, "s-", label="all_to_all_single / sarcomm")
        right.axhline(1.0, color="0.4", linewidth=1, linestyle=":")
        right.set(xscale="log", xlabel="bytes sent per rank", ylabel="ratio (> 1: sarcomm faster)")
        right.set_title("all_to_all: speed-up of sarcomm")
        for ax in (left, right):
            ax.set_xticks(sizes, [human_bytes(s).replace(" ", "") for s in sizes], rotation=45)
            ax.minorticks_off()
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "all_to_all")
    return Section.of(doc, "all_to_all", "all_to_all with unequal sizes (gloo)", headline, body, plot)
