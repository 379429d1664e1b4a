"""Heartbeat load on the coordinator (benchmarks/heartbeat_load.py), SQLite and etcd.

The benchmark is recorded more than once (``heartbeat_load.json``: the shapes on SQLite and how the
cost grows; ``heartbeat_load_etcd.json``: ``--stores sqlite,etcd``, the etcd store beside SQLite in
one run). Its one section shows each part from the newest run that has it, with its baseline
named, and links the runs it replaced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NotRequired, TypedDict, cast

from render import (
    Context,
    Recording,
    Section,
    command,
    machine_caption,
    machine_line,
    md_table,
    newest_per_part,
    older_runs,
    times,
)


class LoopLag(TypedDict):
    """The coordinator's loop-lag histogram over the window (its metrics) and its full collections."""

    loop_lag_samples: int
    loop_lag_p99_le_ms: float | None
    loop_lag_over_5ms: int
    loop_lag_over_20ms: int
    full_collections: int
    full_collections_ms: float


class HeartbeatRow(LoopLag):
    """One measurement (a shape on a store, at a size and interval): a row of ``summary`` or
    ``scaling``. ``store`` and ``etcd_cpu_percent`` are absent from recordings older than the etcd
    store (SQLite, then); ``connections`` (the TCP connections the coordinator held, counted) from
    recordings older than one connection per simulated agent."""

    shape: str
    connections: NotRequired[int]
    store: NotRequired[str]
    etcd_cpu_percent: NotRequired[float]
    streams: int
    members: int
    members_per_stream: int
    interval_s: float
    coordinator_cpu_percent: float
    reports_per_s: int
    rss_idle_mib: float
    rss_mib: float
    rss_peak_mib: float
    ack_p50_ms: float | None
    ack_p99_ms: float | None
    ack_p999_ms: float | None
    ack_max_ms: float | None
    acks_measured: int
    probe_streams: int
    probe_ack_p50_ms: float | None
    probe_ack_p99_ms: float | None
    probe_ack_max_ms: float | None
    probe_acks_measured: int
    probe_loop_lag_max_ms: float
    probe_loop_lags_over_20ms: int
    scrapes: int
    scrape_max_ms: float | None
    members_failed: int
    stalest_member_s: float
    job_state: str
    world_formed_s: float
    all_reporting_s: float
    all_left_s: float
    profile_hottest: list[dict[str, Any]]
    client_errors: int
    client_error_examples: list[str]


#: The parts of a recording: the shapes against each other on SQLite, the etcd store beside
#: SQLite, and how the cost grows.
SHAPES, STORES, SCALING = "shapes", "stores", "scaling"
TITLE = "Heartbeat load on the coordinator"

#: The heartbeat ack p99 the probe streams must stay under, in ms (the SQLite target, for both).
ACK_P99_TARGET_MS = 20.0


def script_headline(summary: list[HeartbeatRow]) -> list[str]:
    """What each shape cost on each store, and etcd against SQLite where both ran."""
    return _cost_lines(summary) + compare_stores(summary)


def _cost_lines(summary: list[HeartbeatRow]) -> list[str]:
    """What each row's shape cost on its store."""
    return [
        f"{_label(r)}: {r['members']} members on "
        f"{r['streams']} streams cost the coordinator {r['coordinator_cpu_percent']}% of a core and "
        f"{r['rss_peak_mib']} MiB at peak; {r['members_failed']} judged failed"
        for r in summary
    ]


def compare_stores(summary: list[HeartbeatRow]) -> list[str]:
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


def _rows(doc: dict[str, Any], key: str = "summary") -> list[HeartbeatRow]:
    return cast(list[HeartbeatRow], doc.get(key) or [])


def _store(row: HeartbeatRow) -> str:
    return row.get("store", "sqlite")


def _label(row: HeartbeatRow) -> str:
    """The row's shape, and its store when that is etcd (``batched on etcd``)."""
    return row["shape"] + (" on etcd" if _store(row) == "etcd" else "")


def _compared(doc: dict[str, Any]) -> list[str]:
    """The shapes ``doc`` measured on both stores."""
    rows = _rows(doc)
    return [
        shape
        for shape in dict.fromkeys(r["shape"] for r in rows)
        if {_store(r) for r in rows if r["shape"] == shape} >= {"sqlite", "etcd"}
    ]


def _parts(doc: dict[str, Any]) -> list[str]:
    """What ``doc`` measured: the etcd store beside SQLite (a shape on both), the shapes against
    each other (on SQLite; a run of neither kind counts as this), how the cost grows."""
    parts = [STORES] if _compared(doc) else []
    if len({r["shape"] for r in _rows(doc) if _store(r) == "sqlite"}) > 1 or not parts:
        parts.append(SHAPES)
    if any(r.get("reports_per_s") for r in _rows(doc, SCALING)):
        parts.append(SCALING)
    return parts


def _part_rows(doc: dict[str, Any], part: str) -> list[HeartbeatRow]:
    """The summary rows of ``part`` (none for the scaling part, which has rows of its own)."""
    if part == STORES:
        compared = _compared(doc)
        return [r for r in _rows(doc) if r["shape"] in compared]
    if part == SHAPES:
        return [r for r in _rows(doc) if _store(r) == "sqlite"] or _rows(doc)
    return []


def _shapes_line(rows: list[HeartbeatRow]) -> list[str]:
    """Batched agents' streams against one stream per member (the baseline), where both ran."""
    by = {r["shape"]: r for r in rows}
    if "batched" not in by or "single" not in by:
        return []
    b, s = by["batched"], by["single"]
    cpu_b, cpu_s = float(b["coordinator_cpu_percent"]), float(s["coordinator_cpu_percent"])
    b_p99, s_p99 = b.get("probe_ack_p99_ms"), s.get("probe_ack_p99_ms")
    return [
        f"{b['members']} members heartbeating through {b['streams']} agents' streams cost the "
        f"coordinator {cpu_b:g}% of a core against {cpu_s:g}% for {s['streams']} one-member streams"
        + (f" (batched {times(cpu_b, cpu_s, 'less', 'more')})" if cpu_b > 0 else "")
        + f"; peak RSS {b['rss_peak_mib']:g} against {s['rss_peak_mib']:g} MiB"
        + (
            f"; heartbeat ack p99 {b_p99:g} against {s_p99:g} ms"
            if b_p99 is not None and s_p99 is not None
            else ""
        )
    ]


def headlines(doc: dict[str, Any], parts: Iterable[str]) -> list[str]:
    """The headline lines of ``doc``'s ``parts``, its comparison first (the failed members are
    counted by the caller)."""
    lines = []
    for part in parts:
        rows = _part_rows(doc, part)
        if not rows:
            continue
        lines += _shapes_line(rows) if part == SHAPES else compare_stores(rows)
        probed = [r for r in rows if r.get("probe_ack_p99_ms") is not None]
        if probed:
            lines.append(
                f"heartbeat ack p99 (probe streams, target under {ACK_P99_TARGET_MS:g} ms): "
                + ", ".join(
                    f"{_label(r)} {r['probe_ack_p99_ms']:g} ms (max {r['probe_ack_max_ms']:g})"
                    for r in probed
                )
            )
        lines += _cost_lines(rows)
    return lines


#: The summary table's columns: key, heading, format.
COLUMNS = [
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


def _table(rows: list[HeartbeatRow]) -> str:
    present = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    cells = [
        [fmt.format(r.get(key)) if r.get(key) is not None else "-" for key, _, fmt in present] for r in rows
    ]
    return md_table([label for _, label, _ in present], cells)


def _settings(doc: dict[str, Any]) -> str:
    """How ``doc`` measured: the interval, the window, the clients."""
    settings = doc.get("settings", {})
    return (
        f"Heartbeat interval {settings.get('interval_s', '?')} s; measured for "
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


def _scaling(doc: dict[str, Any]) -> str:
    scaling = [r for r in _rows(doc, SCALING) if r.get("reports_per_s")]
    return "How the cost grows (8 s windows, no scrapes):\n\n" + md_table(
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


def _against(doc: dict[str, Any], parts: list[str]) -> str:
    """What the shown parts of ``doc`` measured and against which baseline."""
    said = []
    if STORES in parts:
        said.append(f"{', '.join(_compared(doc))} on the etcd store against the baseline SQLite, in one run")
    if SHAPES in parts:
        by = {r["shape"]: r for r in _part_rows(doc, SHAPES)}
        b, s = by.get("batched"), by.get("single")
        if b is not None and s is not None:
            said.append(
                f"batched: {b['streams']} agents' streams of {b['members_per_stream']} members, against "
                f"the baseline single: {s['streams']} one-member streams"
            )
    return "; ".join(said)


def _plot(doc: dict[str, Any], ctx: Context) -> str:
    """The shapes of ``doc`` side by side (CPU, peak RSS, ack p99) and how the cost grows."""
    summary = _part_rows(doc, SHAPES)
    metrics = [
        (key, label)
        for key, label in (
            ("coordinator_cpu_percent", "coordinator CPU (% of a core)"),
            ("rss_peak_mib", "coordinator peak RSS (MiB)"),
            ("probe_ack_p99_ms", "heartbeat ack p99, probe streams (ms)"),
        )
        if all(isinstance(r.get(key), int | float) for r in summary)
    ]
    scaling = [r for r in _rows(doc, SCALING) if r.get("reports_per_s")]
    if ctx.plt is None or not metrics:
        return ""
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
            [cast(dict[str, Any], r)[key] for r in summary],
            color=["tab:blue", "tab:orange", "tab:green"][: len(summary)],
        )
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    machine_caption(axes[0], machine_line(doc))
    return str(ctx.save(fig, "heartbeat_load"))


def section(doc: dict[str, Any], ctx: Context) -> Section:
    """One recording alone (the benchmark's own page)."""
    return family_section([Recording(str(doc.get("benchmark") or "heartbeat_load"), doc)], ctx)


def family_section(recordings: list[Recording], ctx: Context) -> Section:
    """Every recording of the benchmark: each part from the newest one that has it."""
    chosen = newest_per_part(recordings, _parts)
    shown = list(dict.fromkeys(chosen.values()))
    lines: list[str] = []
    body: list[str] = []
    plot = ""
    failed = 0
    for recording in shown:
        doc = recording.doc
        parts = [part for part, r in chosen.items() if r is recording]
        lines += headlines(doc, parts)
        failed += sum(int(r.get("members_failed") or 0) for part in parts for r in _part_rows(doc, part))
        measured = [part for part in parts if part != SCALING]
        if len(shown) > 1:
            against = _against(doc, measured)
            body.append(
                f"**{', '.join(parts).capitalize()}**"
                + (f" ({against})" if against else "")
                + f": run {recording.when} (`{recording.name}.json`)."
            )
        rows = [r for part in measured for r in _part_rows(doc, part)]
        if rows:
            body += [_table(list({id(r): r for r in rows}.values())), _settings(doc)]
        if SCALING in parts:
            body.append(_scaling(doc))
        if SHAPES in parts and not plot:
            plot = _plot(doc, ctx)
    lines.append(f"members wrongly judged failed during the runs: {failed}")
    newest = shown[0]
    return Section(
        newest.name,
        TITLE,
        lines,
        "\n\n".join(body),
        "\n".join(command(r.doc, "heartbeat_load") for r in shown),
        machine_line(newest.doc),
        plot,
        any(bool(r.doc.get("quick")) for r in shown),
        shown=[r.name for r in shown],
        older=older_runs(recordings, chosen, _parts, ctx),
    )
