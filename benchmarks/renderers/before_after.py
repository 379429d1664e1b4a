"""before_after (benchmarks/before_after.py): the wrapper-cost, rendezvous and heartbeat-load
benchmarks of this tree against a baseline checkout, in one run, as ratios."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table

TITLE = "Before and after: wrapper cost, rendezvous and heartbeat load against a baseline checkout"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    parts = [
        f"Before: `{doc['baseline']}`; after: `{doc['tree']}`. Medians of {doc['rounds']} ABBA rounds "
        "per benchmark (each tree runs its own copy of the script with its own interpreter); ratio = "
        "after / before, below 1 when after is faster or cheaper.",
    ]
    headline = []
    for bench in doc["benchmarks"]:
        rows = bench["rows"]
        ratios = [float(r["ratio"]) for r in rows if r["ratio"] is not None]
        if ratios:
            headline.append(
                f"{bench['benchmark']}: after / before {min(ratios):.2f} to {max(ratios):.2f} "
                f"over {len(ratios)} figures"
            )
        table = md_table(
            ["figure", "before", "after", "ratio"],
            [[r["figure"], f"{r['before']:.4g}", f"{r['after']:.4g}", _ratio(r["ratio"])] for r in rows],
            "lrrr",
        )
        parts += [f"**{bench['benchmark']}** (`{' '.join(bench['args'])}`):", table]
    return Section.of(doc, "before_after", TITLE, headline, "\n\n".join(parts))


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
