"""gather_grads (benchmarks/gather_grads.py): SAR's order, one all_reduce per parameter, against
buckets, at three model shapes."""

from __future__ import annotations

import textwrap
from typing import Any

from render import Context, Section, fmt_value, md_table, their_headline

TITLE = "gather_grads: SAR's order against buckets"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows: list[dict[str, Any]] = doc["rows"]
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
            f"At {largest['mib']:g} MiB the bucketed path was the slower one in this run (SAR's order "
            f"{largest['ratio']}x); it adds a `cat` into a flat buffer and a copy back per bucket, which "
            "may cost more than the calls it saves at that size on loopback (not investigated further)."
        )
    machine = doc.get("machine", {})
    load = max(float(machine.get(k) or 0) for k in ("loadavg_1m_at_start", "loadavg_1m_at_end"))
    if load > float(machine.get("affinity_cpus") or machine.get("nproc") or load):
        notes.append(
            "The host was under load (see the load average below): read the ratios, not the milliseconds."
        )
    columns = list(dict.fromkeys(k for r in rows for k in r))
    table = md_table(columns, [[fmt_value(r.get(c)) for c in columns] for r in rows], "l" * len(columns))
    body = (textwrap.fill(" ".join(notes), width=100) + "\n\n" if notes else "") + table
    return Section.of(doc, "gather_grads", str(doc.get("title") or TITLE), their_headline(doc), body)
