"""Soak (benchmarks/soak.py): the coordinator's memory over waves of jobs."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import (
    Context,
    Section,
    fmt_value,
    machine_caption,
    machine_line,
    md_table,
)


class Wave(TypedDict):
    """One wave: its members joined, reported and left; the coordinator's memory after it."""

    index: int
    seconds: float
    joined: int
    reports: int
    finished_jobs: int
    failed_jobs: int
    rss_mib: float
    fds: int
    threads: int


def section(doc: dict[str, Any], ctx: Context) -> Section:
    waves = cast(list[Wave], doc["waves"])
    base, final, top = doc["baseline_rss_mib"], doc["final_rss_mib"], doc["max_rss_mib"]
    tolerance = float(doc.get("tolerance_mib") or 0)
    verdict = "returned to" if doc.get("returned_to_baseline") else "did NOT return to"
    headline = [
        f"After {len(waves)} waves of {doc.get('members', '?')} members in {doc.get('jobs', '?')} jobs "
        f"joining, heartbeating and leaving, the coordinator's RSS {verdict} its baseline: {base:g} MiB "
        f"after warm-up, {final:g} MiB at the end (tolerance {tolerance:g} MiB), {top:g} MiB at most, trend "
        f"{doc.get('rss_trend_mib_per_wave', 0):g} MiB per wave"
    ]
    keys: list[str] = [
        "index",
        "seconds",
        "joined",
        "reports",
        "finished_jobs",
        "failed_jobs",
        "rss_mib",
        "fds",
        "threads",
    ]
    keys = [k for k in keys if any(k in w for w in waves)]
    body = (
        "<details><summary>every wave</summary>\n\n"
        + md_table(keys, [[fmt_value(cast(dict[str, Any], w).get(k)) for k in keys] for w in waves])
        + "\n\n</details>"
    )
    plot = ""
    if ctx.plt is not None and waves:
        fig, (left, right) = ctx.figure(2, 5.0)
        xs = [w["index"] for w in waves]
        left.plot(xs, [w["rss_mib"] for w in waves], "o-", markersize=3, label="RSS")
        left.axhspan(
            base - tolerance, base + tolerance, color="tab:green", alpha=0.15, label="baseline +/- tolerance"
        )
        left.set(xlabel="wave", ylabel="coordinator RSS (MiB)")
        left.set_title("Soak: coordinator memory per wave")
        left.legend(fontsize=8)
        for key in ("fds", "threads"):
            if all(key in w for w in waves):
                right.plot(xs, [cast(dict[str, Any], w)[key] for w in waves], "o-", markersize=3, label=key)
        right.set(xlabel="wave", ylabel="count")
        right.set_title("Open descriptors and threads")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
        machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "soak")
    return Section.of(doc, "soak", "Soak: coordinator memory over waves of jobs", headline, body, plot)


# -- benchmarks whose format this report does not know (written elsewhere, or newer) ---------------
