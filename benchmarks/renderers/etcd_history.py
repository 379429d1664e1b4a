"""etcd's history (benchmarks/etcd_history.py): the database's size over a long churn of big job
records, with the leader compacting and without."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table

TITLE = "etcd's size over a long churn, with and without compaction"


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def _half_way(run: dict[str, Any]) -> str:
    samples = run["samples"]
    return _mb(samples[len(samples) // 2]["db_bytes"]) if samples else "-"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    runs: list[dict[str, Any]] = doc["results"]
    off = [r for r in runs if not r["retention_s"]]
    on = [r for r in runs if r["retention_s"]]
    headline = []
    for run in on:
        headline.append(
            f"compaction every {run['retention_s']:g} s: {_mb(run['sent_bytes'])} sent to etcd in "
            f"{run['seconds']:g} s, the database ends at {_mb(run['db_bytes'])} "
            f"({run['db_bytes'] / run['sent_bytes']:.2f} of what was sent)"
        )
    for run in off:
        headline.append(
            f"compaction off: {_mb(run['sent_bytes'])} sent, the database ends at {_mb(run['db_bytes'])} "
            f"({run['db_bytes'] / run['sent_bytes']:.2f} of what was sent: every revision kept)"
        )
    if on and off:
        headline.append(
            f"with compaction the database is {off[0]['db_bytes'] / on[0]['db_bytes']:.1f}x smaller than "
            "without, after the same churn"
        )
    table = md_table(
        ["retention", "generations", "seconds", "sent to etcd", "database half-way", "database at the end",
         "refused"],
        [
            (
                f"{r['retention_s']:g} s" if r["retention_s"] else "off",
                r["generations"],
                f"{r['seconds']:g}",
                _mb(r["sent_bytes"]),
                _half_way(r),
                _mb(r["db_bytes"]),
                "NOSPACE" if r["refused"] else "no",
            )
            for r in runs
        ],
        "rrrrrrc",
    )  # fmt: skip
    body = (
        table
        + f"\n\nJobs of {doc['hosts']} members, {doc['interfaces']} interfaces of 32 random IPv6 addresses "
        "per host; one etcd member, its default 2 GiB quota, no auto-compaction of its own. The database "
        "is etcd's file (what its quota counts); a compacted one also holds every finished generation's "
        "record, which stays."
    )
    return Section.of(doc, "etcd_history", TITLE, headline, body)
