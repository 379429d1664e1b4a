"""Failure detection (benchmarks/failure_detection.py): sarcomm against plain gloo."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import (
    Context,
    Section,
    machine_caption,
    machine_line,
    md_table,
    their_headline,
    times,
)


class SummaryRow(TypedDict):
    """One fault under one way of detecting it, over its runs: seconds from the fault to the last
    other rank stopped (None: none stopped before the deadline), and to it being told."""

    scenario: str
    mode: str
    runs: int
    stopped_median_s: float | None
    stopped_min_s: float | None
    stopped_max_s: float | None
    over_deadline: int
    told_median_s: float | None
    deadline_s: float | None


def section(doc: dict[str, Any], ctx: Context) -> Section:
    summary = cast(list[SummaryRow], doc["summary"])
    scenarios = list(dict.fromkeys(r["scenario"] for r in summary))
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    cell = {(r["scenario"], r["mode"]): r for r in summary}
    settings = doc.get("settings", {})
    timeout = settings.get("gloo_timeout_s")

    def median(scenario: str, mode: str) -> float | None:
        r = cell.get((scenario, mode))
        return None if r is None else r["stopped_median_s"]

    def shown(scenario: str, mode: str) -> str:
        r = cell.get((scenario, mode))
        if r is None:
            return "-"
        if r.get("stopped_median_s") is None:
            return f"> {r.get('deadline_s') or '?'} (deadline)"
        text = f"{r['stopped_median_s']:.2f} ({r['stopped_min_s']:.2f} to {r['stopped_max_s']:.2f})"
        return text + (f", {r['over_deadline']} over deadline" if r.get("over_deadline") else "")

    ours = [m for m in modes if m != "gloo"]
    headline = []
    if "gloo" in modes and ours:
        parts = []
        for scenario in scenarios:
            base = median(scenario, "gloo")
            ratios = [
                f"the {mode} {times(t, base, 'sooner', 'later')}"
                if base and (t := median(scenario, mode))
                else f"the {mode} -"
                for mode in ours
            ]
            parts.append(f"{scenario}: " + ", ".join(ratios))
        headline.append(
            "sarcomm against plain gloo, the last other rank stopped after a fault: "
            + "; ".join(parts)
            + (
                f" (gloo's timeout set to {timeout:g} s here; torch's default is 30 minutes)"
                if timeout
                else ""
            )
        )
    headline += their_headline(doc)
    header = ["fault", *(f"{m} s" for m in modes)]
    if "gloo" in modes:
        header += [f"{m} against gloo" for m in ours]
    rows = []
    for scenario in scenarios:
        row = [scenario, *(shown(scenario, m) for m in modes)]
        if "gloo" in modes:
            base = median(scenario, "gloo")
            row += [
                times(t, base, "sooner", "later") if base and (t := median(scenario, m)) else "-"
                for m in ours
            ]
        rows.append(row)
    body = md_table(header, rows)
    body += (
        "\n\nSeconds from the fault to the last other rank's exit: median (min to max) over "
        f"{settings.get('repeats', '?')} run(s) per sarcomm pair and {settings.get('baseline_repeats', '?')} "
        f"per gloo pair; {settings.get('world_size', '?')} ranks on {settings.get('hosts', '?')}, heartbeat "
        f"{settings.get('heartbeat_interval_s', '?')} s x {settings.get('heartbeat_misses', '?')} misses."
    )
    plot = ""
    if ctx.plt is not None and scenarios and modes:
        fig, (ax,) = ctx.figure()
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [k + (i - (len(modes) - 1) / 2) * width for k in range(len(scenarios))]
            values, low, high, missing = [], [], [], []
            for scenario in scenarios:
                r = cell.get((scenario, mode))
                t = median(scenario, mode)
                if r is None or t is None:
                    # Did not stop within the deadline: a hatched bar up to it says "at least".
                    deadline = (r["deadline_s"] if r is not None else None) or 0.0
                    values.append(deadline)
                    low.append(0.0)
                    high.append(0.0)
                    missing.append(True)
                else:
                    values.append(t)
                    low.append(t - (r["stopped_min_s"] or t))
                    high.append((r["stopped_max_s"] or t) - t)
                    missing.append(False)
            bars = ax.bar(xs, values, width, yerr=[low, high], capsize=3, label=mode)
            for bar, over in zip(bars, missing, strict=True):
                if over:
                    bar.set_hatch("//")
                    bar.set_alpha(0.5)
        if timeout:
            ax.axhline(timeout, color="0.4", linestyle=":", linewidth=1)
            ax.annotate(
                f"gloo timeout here: {timeout:g} s",
                (-0.4, timeout),
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=8,
            )
        ax.set_xticks(range(len(scenarios)), scenarios)
        ax.set(ylabel="fault to last other rank stopped (s)")
        ax.set_title("Failure detection (bars: median, whiskers: min to max)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "failure_detection")
    title = "Failure detection"
    return Section.of(doc, "failure_detection", title, headline, body, plot)
