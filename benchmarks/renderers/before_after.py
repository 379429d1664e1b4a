"""before_after (benchmarks/before_after.py): the wrapper-cost, rendezvous and heartbeat-load
benchmarks of this tree against a baseline checkout, in one run, as ratios."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, md_table, span, times

TITLE = "Before and after: wrapper cost, rendezvous and heartbeat load against a baseline checkout"


class FigureRow(TypedDict):
    """One figure of a benchmark's headline: each tree's median over the rounds, and after / before
    (None: before was 0)."""

    figure: str
    before: float
    after: float
    ratio: float | None


class Comparison(TypedDict):
    """One benchmark run in both trees, ``rounds`` ABBA rounds with ``args``."""

    benchmark: str
    args: list[str]
    rounds: int
    rows: list[FigureRow]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    parts = [
        f"Before: `{doc['baseline']}`; after: `{doc['tree']}`. Medians of {doc['rounds']} ABBA rounds "
        "per benchmark (each tree runs its own copy of the script with its own interpreter). Every figure "
        'is a cost (time, CPU, memory): "less" is the after tree doing better.',
    ]
    headline = []
    for bench in cast(list[Comparison], doc["benchmarks"]):
        rows = bench["rows"]
        ratios = [float(r["ratio"]) for r in rows if r["ratio"] is not None]
        if ratios:
            headline.append(
                f"{bench['benchmark']}: after against before, {span(ratios, _after)} "
                f"over {len(ratios)} figures"
            )
        table = md_table(
            ["figure", "before", "after", "after against before"],
            [[r["figure"], f"{r['before']:.4g}", f"{r['after']:.4g}", _after(r["ratio"])] for r in rows],
            "lrrr",
        )
        parts += [f"**{bench['benchmark']}** (`{' '.join(bench['args'])}`):", table]
    return Section.of(doc, "before_after", TITLE, headline, "\n\n".join(parts))


def _after(after_over_before: float | None) -> str:
    """The recorded ratio after / before, in words: ``1.30x less`` or ``1.20x more``."""
    return "n/a" if after_over_before is None else times(after_over_before, 1.0, "less", "more")
