"""Failover (benchmarks/failover.py): the leader SIGKILLed under a job."""

from __future__ import annotations

from typing import Any

from render import (
    Context,
    Section,
    md_table,
    their_headline,
)


def section(doc: dict[str, Any], ctx: Context) -> Section:
    """benchmarks/failover.py: the leader SIGKILLed under a job, per kill, etcd beside SQLite."""
    rows = []
    for result in doc["results"]:
        for n, k in enumerate(result["kills"], 1):
            rows.append(
                [result["setup"], n, result["members"], f"{k['takeover_s']:g}"]
                + [
                    "-" if k.get(f"reattach_{q}_s") is None else f"{k[f'reattach_{q}_s']:g}"
                    for q in ("p50", "p99", "max")
                ]
                + [f"{k['streams_reattached']}/{k['streams']}", k["members_failed"]]
            )
    header = [
        "setup",
        "kill",
        "members",
        "take-over s",
        "re-attach p50 s",
        "p99 s",
        "max s",
        "streams back",
        "failed",
    ]
    ttl = doc.get("settings", {}).get("leader_ttl_s", "?")
    body = md_table(header, rows, "l" + "r" * (len(header) - 1)) + (
        f"\n\nLeader TTL {ttl} s. Take-over: the kill to the new leader's health SERVING (SQLite: the "
        "restarted process's). Re-attach: the kill to each agent's first heartbeat answer after it; "
        "members failed: judged after the reconnect grace and a liveness window."
    )
    title = str(doc.get("title") or "Failover")
    return Section.of(doc, "failover", title, their_headline(doc), body)
