"""Failover (benchmarks/failover.py): the leader SIGKILLed under a job."""

from __future__ import annotations

import statistics
from typing import Any, TypedDict, cast

from render import Context, Section, md_table, times


class KillTimes(TypedDict):
    """One leader SIGKILL: seconds to the take-over and until the coordinator saw every member
    again (None: it never did), and what the job came to."""

    takeover_s: float
    coordinator_saw_all_s: float | None
    job_state: str | None
    members_failed: int


class Reattach(TypedDict):
    """Each agent stream's first answer after the kill, as seconds after it."""

    streams_reattached: int
    streams: int
    reattach_p50_s: float | None
    reattach_p90_s: float | None
    reattach_p99_s: float | None
    reattach_max_s: float | None
    reattach_min_s: float | None
    #: When the streams (each ``members_per_stream`` members) re-attached, in 0.25 s buckets.
    histogram_0_25s: dict[str, int]
    members_per_stream: int


class Kill(KillTimes, Reattach):
    """One kill's figures, and the load clients' errors."""

    client_errors: list[str]


class SetupResult(TypedDict):
    """One setup ("etcd": two replicas; "sqlite": one coordinator restarted) and its kills."""

    setup: str
    members: int
    streams: int
    formed_s: float
    kills: list[Kill]


def headline(results: list[SetupResult], ttl: int) -> list[str]:
    """etcd's take-over and re-attachment against the target, and a SQLite restart beside it."""
    lines = []
    by = {r["setup"]: r for r in results}
    etcd = by.get("etcd")
    if etcd:
        worst = max(k["reattach_max_s"] or 0.0 for k in etcd["kills"])
        lost = sum(k["streams"] - k["streams_reattached"] for k in etcd["kills"])
        failed = sum(k["members_failed"] for k in etcd["kills"])
        met = worst < ttl + 2 and failed == 0 and lost == 0
        takeover = statistics.median(k["takeover_s"] for k in etcd["kills"])
        lines.append(
            f"etcd: {etcd['members']} members on {etcd['streams']} streams, {len(etcd['kills'])} leader "
            f"SIGKILLs: take-over {takeover:.2f} s (median); the streams that came back did within "
            f"{worst:.2f} s at worst (target < TTL + 2 = {ttl + 2} s); {lost} stream re-attachments "
            f"missing over all kills, {failed} members failed: " + ("MET" if met else "MISSED")
        )
    sqlite = by.get("sqlite")
    if etcd and sqlite:
        e = statistics.median(k["reattach_max_s"] or float("inf") for k in etcd["kills"])
        s = statistics.median(k["reattach_max_s"] or float("inf") for k in sqlite["kills"])
        lost = sum(k["streams"] - k["streams_reattached"] for k in sqlite["kills"])
        failed = sum(k["members_failed"] for k in sqlite["kills"])
        lines.append(
            "baseline, one SQLite coordinator restarted at once on the same host: the streams back within "
            f"{s:.2f} s (median of kills' max); {lost} stream re-attachments missing, {failed} members "
            f"failed; the restart had them back {times(s, e, 'sooner', 'later')} than an etcd failover (but "
            "needs the host alive)"
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    """benchmarks/failover.py: the leader SIGKILLed under a job, per kill, etcd beside SQLite."""
    rows = []
    results = cast(list[SetupResult], doc["results"])
    for result in results:
        for n, k in enumerate(result["kills"], 1):
            rows.append(
                [result["setup"], n, result["members"], f"{k['takeover_s']:g}"]
                + [
                    "-" if v is None else f"{v:g}"
                    for v in (k["reattach_p50_s"], k["reattach_p99_s"], k["reattach_max_s"])
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
    lines = headline(results, int(ttl)) if isinstance(ttl, int) else []
    body = md_table(header, rows, "l" + "r" * (len(header) - 1)) + (
        f"\n\nLeader TTL {ttl} s. Take-over: the kill to the new leader's health SERVING (SQLite: the "
        "restarted process's). Re-attach: the kill to each agent's first heartbeat answer after it; "
        "members failed: judged after the reconnect grace and a liveness window."
    )
    title = str(doc.get("title") or "Failover")
    return Section.of(doc, "failover", title, lines, body)
