"""gather_grads (benchmarks/gather_grads.py): SAR's order, one all_reduce per parameter, against
buckets, at three model shapes."""

from __future__ import annotations

import textwrap
from typing import Any, TypedDict, cast

from render import Context, Section, faster, fmt_value, md_table

TITLE = "gather_grads: SAR's order against buckets"


class Timing(TypedDict):
    """One model shape: the medians of each side's calls, and the collectives each makes."""

    params: int
    mib: float
    bucketed_ms: float
    sar_order_ms: float
    #: SAR's order's time over buckets', as recorded (the page says it in words).
    ratio: float
    collectives_bucketed: int
    collectives_sar_order: int


class GatherRow(Timing):
    """A recorded row: the model shape's name and its timing."""

    model: str


def headline(rows: list[GatherRow]) -> list[str]:
    """Buckets against SAR's order at each model shape (``ratio``: SAR's order's time over buckets')."""
    return [
        "buckets against SAR's order (one all_reduce per parameter), 2 ranks, gloo on loopback: "
        + ", ".join(f"{r['model']} {faster(float(r['ratio']))}" for r in rows)
    ]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[GatherRow], doc["rows"])
    notes = []
    slower = [float(r["ratio"]) for r in rows if float(r["ratio"]) > 1]
    if slower:
        notes.append(
            f"At small parameters the per-call latency dominates and SAR's order is up to "
            f"{max(slower):.1f}x slower."
        )
    largest = max(rows, key=lambda r: float(r["mib"]))
    if float(largest["ratio"]) < 1:
        notes.append(
            f"At {largest['mib']:g} MiB the bucketed path was the slower one in this run (buckets "
            f"{faster(float(largest['ratio']))}); it adds a `cat` into a flat buffer and a copy back per "
            "bucket, which "
            "may cost more than the calls it saves at that size on loopback (not investigated further)."
        )
    machine = doc.get("machine", {})
    load = max(float(machine.get(k) or 0) for k in ("loadavg_1m_at_start", "loadavg_1m_at_end"))
    if load > float(machine.get("affinity_cpus") or machine.get("nproc") or load):
        notes.append(
            "The host was under load (see the load average below): read the ratios, not the milliseconds."
        )
    # The recorded ratio (SAR's order over buckets) is shown in words, the same way round as above.
    columns = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "ratio"]
    table = md_table(
        [*columns, "buckets against SAR's order"],
        [[*(fmt_value(r.get(c)) for c in columns), faster(float(r["ratio"]))] for r in rows],
        "l" * (len(columns) + 1),
    )
    body = (textwrap.fill(" ".join(notes), width=100) + "\n\n" if notes else "") + table
    return Section.of(doc, "gather_grads", str(doc.get("title") or TITLE), headline(rows), body)
