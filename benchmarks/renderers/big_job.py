"""One head node for a big job (benchmarks/big_job.py): forming the world and heartbeats at scale."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table, their_headline

TITLE = "One head node for a big job"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    tables = []
    forms = [r for r in doc["runs"] if r["phase"] in ("agents", "singles")]
    if forms:
        header = ["phase", "store", "ranks", "code", "coordinator view s", "last answer s"]
        tables.append(
            md_table(
                [*header, "coordinator CPU s", "rounds"],
                [
                    (
                        r["phase"],
                        r["store"],
                        r["ranks"],
                        r["code"],
                        r["coordinator_view_s"],
                        r["last_answer_s"],
                        r["coordinator_cpu_s"],
                        r["rounds_view_s"],
                    )
                    for r in forms
                ],
                "lllrrrrl",
            )
        )
    beats = [r for r in doc["runs"] if r["phase"] == "beat"]
    if beats:
        header = [
            "store",
            "code",
            "ranks",
            "offered/s",
            "processed/s",
            "us CPU/report",
            "core share at offered",
        ]
        header += ["RSS MiB", "failed", "probe p50/p99/max ms", "/metrics /sd /v1/jobs s", "fan-out s (told)"]
        tables.append(
            md_table(
                header,
                [
                    (
                        r["store"],
                        r["code"],
                        r["ranks"],
                        r["offered_reports_per_s"],
                        r["processed_reports_per_s"],
                        r["coordinator_cpu_us_per_report"],
                        r["core_share_at_offered"],
                        r["rss_peak_mib"],
                        r["members_failed_in_window"],
                        f"{r['probe_ack_p50_ms']} / {r['probe_ack_p99_ms']} / {r['probe_ack_max_ms']}",
                        " / ".join(str(v) for v in r["endpoint_s"].values()),
                        f"{r['failure_fanout_s']} ({r['failure_streams_told']} of {r['failure_streams']})",
                    )
                    for r in beats
                ],
                "llrrrrrrrlll",
            )
        )
    body = "\n\n".join(tables) or "(no runs recorded)"
    name = str(doc.get("benchmark") or "big_job")
    return Section.of(doc, name, str(doc.get("title") or TITLE), their_headline(doc), body)
