"""etcd's history (benchmarks/etcd_history.py): the database's size over a long churn of big job
records, with the leader compacting and without."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table

TITLE = "etcd's size over a long churn, with and without compaction"


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def _second_half(run: dict[str, Any]) -> tuple[float, float]:
    """(bytes sent, bytes the database grew) from the middle sample to the end."""
    samples = run["samples"]
    if not samples:
        return float(run["sent_bytes"]), float(run["db_bytes"])
    middle = samples[len(samples) // 2]
    return run["sent_bytes"] - middle["sent_bytes"], run["db_bytes"] - middle["db_bytes"]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    runs: list[dict[str, Any]] = doc["results"]
    off = [r for r in runs if not r["retention_s"]]
    on = [r for r in runs if r["retention_s"]]
    headline = []
    for run in [*on, *off]:
        sent, grew = _second_half(run)
        how = (
            f"compaction of what is older than {run['retention_s']:g} s"
            if run["retention_s"]
            else "compaction off"
        )
        headline.append(
            f"{how}: {_mb(run['sent_bytes'])} sent to etcd in {run['generations']} generations, the database "
            f"ends at {_mb(run['db_bytes'])}; over the second half it grew {_mb(grew)} while {_mb(sent)} "
            f"were sent ({grew / sent:.2f} of it)"
        )
    if on and off:
        headline.append(
            f"after the same churn the database is {off[0]['db_bytes'] / on[0]['db_bytes']:.1f}x smaller "
            "with compaction than without"
        )
    table = md_table(
        ["retention", "generations", "seconds", "sent to etcd", "database at the end",
         "sent, second half", "database grew, second half", "refused"],
        [
            (
                f"{r['retention_s']:g} s" if r["retention_s"] else "off",
                r["generations"],
                f"{r['seconds']:g}",
                _mb(r["sent_bytes"]),
                _mb(r["db_bytes"]),
                _mb(_second_half(r)[0]),
                _mb(_second_half(r)[1]),
                "NOSPACE" if r["refused"] else "no",
            )
            for r in runs
        ],
        "rrrrrrrc",
    )  # fmt: skip
    body = (
        table
        + f"\n\nJobs of {doc['hosts']} members, {doc['interfaces']} interfaces of 32 random IPv6 addresses "
        "per host; one etcd member, its default 2 GiB quota, no auto-compaction of its own. The database "
        "is etcd's file (what its quota counts). A job keeps one record, its newest generation's: writing "
        "a generation deletes the earlier ones (before 2026-12-07 every finished generation's record, "
        "~0.3 MB each here, stayed stored, and the database grew by it even with compaction). With "
        "compaction it still grows by the pages etcd's file keeps free for reuse."
    )
    return Section.of(doc, "etcd_history", TITLE, headline, body)
