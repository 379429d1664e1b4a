"""Heartbeat load on the coordinator (benchmarks/heartbeat_load.py), SQLite and etcd."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from render import (
    Context,
    Section,
    machine_caption,
    machine_line,
    md_table,
    times,
)

#: The heartbeat ack p99 the probe streams must stay under, in ms (the SQLite target, for both).
ACK_P99_TARGET_MS = 20.0


def script_headline(summary: list[dict[str, Any]]) -> list[str]:
    """What each shape cost on each store, and etcd against SQLite where both ran."""
    lines = [
        f"{r['shape']}{' on etcd' if r.get('store') == 'etcd' else ''}: {r['members']} members on "
        f"{r['streams']} streams cost the coordinator {r['coordinator_cpu_percent']}% of a core and "
        f"{r['rss_peak_mib']} MiB at peak; {r['members_failed']} judged failed"
        for r in summary
    ]
    return lines + compare_stores(summary)


def compare_stores(summary: list[dict[str, Any]]) -> list[str]:
    """Per shape measured on both stores: etcd against SQLite, and the targets checked for both."""
    lines = []
    by = {(r.get("store", "sqlite"), r["shape"]): r for r in summary}
    for shape in dict.fromkeys(r["shape"] for r in summary):
        sqlite, etcd = by.get(("sqlite", shape)), by.get(("etcd", shape))
        if sqlite is None or etcd is None:
            continue
        met = [
            r["members_failed"] == 0 and (r["probe_ack_p99_ms"] or 0) < ACK_P99_TARGET_MS
            for r in (sqlite, etcd)
        ]
        cpu = times(etcd["coordinator_cpu_percent"], sqlite["coordinator_cpu_percent"], "less", "more")
        lines.append(
            f"{shape}, etcd store beside SQLite: coordinator CPU {etcd['coordinator_cpu_percent']}% against "
            f"{sqlite['coordinator_cpu_percent']}% (on etcd {cpu}; etcd itself {etcd['etcd_cpu_percent']}%), "
            f"probe ack p99 {etcd['probe_ack_p99_ms']} against {sqlite['probe_ack_p99_ms']} ms (target "
            f"< {ACK_P99_TARGET_MS:g} ms, no member failed): etcd {'MET' if met[1] else 'MISSED'}, "
            f"SQLite {'MET' if met[0] else 'MISSED'}"
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    summary = doc["summary"]
    # The comparison of shapes is SQLite's; an etcd run beside it is compared in the script's own
    # headline lines (below).
    by = {r["shape"]: r for r in summary if r.get("store", "sqlite") == "sqlite"}
    headline = []
    if "batched" in by and "single" in by:
        b, s = by["batched"], by["single"]
        cpu_b, cpu_s = float(b["coordinator_cpu_percent"]), float(s["coordinator_cpu_percent"])
        headline.append(
            f"{b['members']} members heartbeating through {b['streams']} agents' streams cost the "
            f"coordinator {cpu_b:g}% of a core against {cpu_s:g}% for {s['streams']} one-member streams"
            + (f" (batched {times(cpu_b, cpu_s, 'less', 'more')})" if cpu_b > 0 else "")
            + f"; peak RSS {b['rss_peak_mib']:g} against {s['rss_peak_mib']:g} MiB"
            + (
                f"; heartbeat ack p99 {b['probe_ack_p99_ms']:g} against {s['probe_ack_p99_ms']:g} ms"
                if b.get("probe_ack_p99_ms") is not None and s.get("probe_ack_p99_ms") is not None
                else ""
            )
        )
    probed = [r for r in summary if r.get("probe_ack_p99_ms") is not None]
    if probed:
        headline.append(
            "heartbeat ack p99 (probe streams, target under 20 ms): "
            + ", ".join(
                f"{r['shape']}{' on etcd' if r.get('store') == 'etcd' else ''} {r['probe_ack_p99_ms']:g} ms "
                f"(max {r['probe_ack_max_ms']:g})"
                for r in probed
            )
        )
    failed = sum(int(r.get("members_failed") or 0) for r in summary)
    headline.append(f"members wrongly judged failed during the runs: {failed}")
    headline += script_headline(summary)
    columns = [
        ("shape", "shape", "{}"),
        ("store", "store", "{}"),
        ("streams", "streams", "{}"),
        ("members", "members", "{}"),
        ("coordinator_cpu_percent", "CPU % of a core", "{:g}"),
        ("etcd_cpu_percent", "etcd CPU %", "{:g}"),
        ("reports_per_s", "reports/s", "{}"),
        ("rss_idle_mib", "RSS idle MiB", "{:g}"),
        ("rss_mib", "RSS end MiB", "{:g}"),
        ("rss_peak_mib", "RSS peak MiB", "{:g}"),
        ("probe_ack_p50_ms", "probe ack p50 ms", "{:g}"),
        ("probe_ack_p99_ms", "probe ack p99 ms", "{:g}"),
        ("probe_ack_max_ms", "probe ack max ms", "{:g}"),
        ("ack_p50_ms", "load-client ack p50 ms", "{:g}"),
        ("ack_p99_ms", "load-client ack p99 ms", "{:g}"),
        ("loop_lag_over_20ms", "loop lags > 20 ms", "{}"),
        ("scrape_max_ms", "scrape max ms", "{:g}"),
        ("members_failed", "failed", "{}"),
        ("world_formed_s", "formed s", "{:g}"),
        ("all_left_s", "all left s", "{:g}"),
    ]
    present = [c for c in columns if any(c[0] in r for r in summary)]
    rows = [
        [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in present] for r in summary
    ]
    settings = doc.get("settings", {})
    body = md_table([label for _, label, _ in present], rows)
    body += (
        f"\n\nHeartbeat interval {settings.get('interval_s', '?')} s; measured for "
        f"{settings.get('duration_s', '?')} s after {settings.get('warmup_s', '?')} s of warm-up, the "
        f"members simulated by {settings.get('procs', '?')} client processes on the same machine"
        + (
            " (the coordinator on a CPU of its own, `--pin`, the clients on the other)"
            if settings.get("pinned")
            else ""
        )
        + ". Probe "
        "acks come from a few streams kept by one extra, otherwise idle client process: they time the "
        "coordinator. Load-client acks also include the delay of the busy client processes, which share "
        "the 2 cores with it, in reading their own acks. Loop lags: samples of the coordinator's "
        "`sar_coordinator_event_loop_lag_seconds` (one each 50 ms) over the window; scrapes: `/metrics` and "
        "`/sd` fetched during the window at the scrape interval. All left: every member's Leave, each "
        "answered once on disk, until the job is FINISHED."
    )
    plot = ""
    metrics = [
        (key, label)
        for key, label in (
            ("coordinator_cpu_percent", "coordinator CPU (% of a core)"),
            ("rss_peak_mib", "coordinator peak RSS (MiB)"),
            ("probe_ack_p99_ms", "heartbeat ack p99, probe streams (ms)"),
        )
        if all(isinstance(r.get(key), int | float) for r in summary)
    ]
    scaling = [r for r in doc.get("scaling") or [] if r.get("reports_per_s")]
    if scaling:
        body += "\n\nHow the cost grows (8 s windows, no scrapes):\n\n" + md_table(
            [
                "shape",
                "members",
                "interval s",
                "reports/s",
                "CPU % of a core",
                "CPU us per report",
                "RSS peak MiB",
            ],
            [
                [
                    r["shape"],
                    r["members"],
                    f"{r['interval_s']:g}",
                    r["reports_per_s"],
                    f"{r['coordinator_cpu_percent']:g}",
                    f"{1e4 * r['coordinator_cpu_percent'] / r['reports_per_s']:.1f}",
                    f"{r['rss_peak_mib']:g}",
                ]
                for r in scaling
            ],
            align="lrrrrrr",
        )
    if ctx.plt is not None and metrics:
        fig, axes = ctx.figure(len(metrics) + (1 if scaling else 0), 3.6)
        if scaling:
            ax = axes[-1]
            for shape in dict.fromkeys(r["shape"] for r in scaling):
                points = sorted(
                    (r["reports_per_s"], r["coordinator_cpu_percent"]) for r in scaling if r["shape"] == shape
                )
                ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=shape, markersize=4)
            ax.set(xlabel="reports/s", ylabel="% of a core")
            ax.set_title("coordinator CPU against report rate", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        shapes = [f"{r['shape']}\n{r.get('streams', '?')} streams" for r in summary]
        for ax, (key, label) in zip(axes, metrics, strict=False):
            ax.bar(
                shapes,
                [r[key] for r in summary],
                color=["tab:blue", "tab:orange", "tab:green"][: len(summary)],
            )
            ax.set_title(label, fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
        machine_caption(axes[0], machine_line(doc))
        plot = ctx.save(fig, "heartbeat_load")
    title = "Heartbeat load on the coordinator"
    return Section.of(doc, "heartbeat_load", title, headline, body, plot)


def etcd_section(doc: dict[str, Any], ctx: Context) -> Section:
    """heartbeat_load.py --stores sqlite,etcd (results/heartbeat_load_etcd.json): the same load with
    the coordinator on etcd beside SQLite, in one run; the script's headline compares them."""
    return replace(
        section(doc, ctx), name="heartbeat_load_etcd", title="Heartbeat load: the etcd store beside SQLite"
    )
