"""Build ``benchmarks/RESULTS.md`` and its plots from the JSON in ``benchmarks/results/``.

::

    python benchmarks/report.py                          # results/ -> RESULTS.md, results/plots/
    python benchmarks/report.py --results-dir /tmp/quick # /tmp/quick -> /tmp/quick/RESULTS.md

For each benchmark: the headline ratios against its baseline (ratios travel between machines,
absolute times do not), the table, the command that reproduces it, the machine it ran on, and a
plot (matplotlib, Agg backend; ``pip install -e '.[bench]'``). A benchmark without JSON, or with
JSON this script cannot read (an older format), gets a line saying so instead of a section, and
without matplotlib the report is written without plots: a report with a gap is more use than none.
``SARCOMM_REPORT_DEBUG=1`` prints the traceback behind such a line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results"
DEFAULT_OUTPUT = HERE / "RESULTS.md"

KIB, MIB = 1024, 1024**2

# What reproduces a result whose JSON does not record its own command (older recordings).
FALLBACK_COMMANDS = {
    "memcpy": "python benchmarks/memcpy.py --json benchmarks/results/memcpy.json "
    "--markdown benchmarks/results/memcpy.md",
    "rendezvous": "python benchmarks/rendezvous.py --repeats 5 --json benchmarks/results/rendezvous.json "
    "--markdown benchmarks/results/rendezvous.md",
    "all_to_all": "python benchmarks/all_to_all.py --json benchmarks/results/all_to_all.json",
    "overhead": "python benchmarks/overhead.py --json benchmarks/results/overhead.json",
    "bench_sweep": "python benchmarks/bench_sweep.py --json benchmarks/results/bench_sweep.json",
}


# -- small helpers -------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n:g} B"


def ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def span(values: Iterable[float], fmt: Callable[[float], str] = ratio) -> str:
    """``low to high`` of ``values`` (one value alone when they are equal)."""
    ordered = sorted(values)
    if not ordered:
        return "-"
    low, high = fmt(ordered[0]), fmt(ordered[-1])
    return low if low == high else f"{low} to {high}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one of l/r per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(doc: dict[str, Any]) -> str:
    """One line naming the machine and date, from any of the formats the scripts write: a
    ``machine`` dict (rendezvous, memcpy, bench_sweep), a ``host`` dict (all_to_all, overhead), or
    a host name (older bench_sweep)."""
    m = doc.get("machine")
    host = doc.get("host")
    parts = []
    if isinstance(m, dict):
        cpus = m.get("affinity_cpus") or m.get("nproc")
        parts.append(f"{cpus} CPUs" + (f" ({m['cpu_model']})" if m.get("cpu_model") else ""))
        if m.get("memory_gib"):
            parts.append(f"{m['memory_gib']} GiB")
        parts += [str(m[k]) for k in ("platform",) if m.get(k)]
        parts += [f"{label} {m[k]}" for k, label in (("python", "Python"), ("torch", "torch")) if m.get(k)]
        date = m.get("date") or doc.get("date")
        recorded = (m.get("loadavg_1m_at_start"), m.get("loadavg_1m_at_end"))
        loads = [float(x) for x in recorded if isinstance(x, int | float)]
        if loads:
            parts.append(f"load average {span(loads, lambda x: f'{x:g}')} during the run")
    elif isinstance(host, dict):
        parts.append(f"{host.get('cpus', '?')} CPUs")
        parts += [str(host[k]) for k in ("platform",) if host.get(k)]
        parts += [
            f"{label} {host[k]}" for k, label in (("python", "Python"), ("torch", "torch")) if host.get(k)
        ]
        date = doc.get("date")
    else:
        if host:
            parts.append(f"host {host} (this recording keeps no machine details)")
        date = doc.get("date")
    if date:
        parts.append(f"run {str(date)[:16].replace('T', ' ')} UTC")
    return ", ".join(parts) or "not recorded"


# -- sections ------------------------------------------------------------------------------------


@dataclass
class Context:
    results: Path
    plots: Path
    output: Path
    plt: Any  # matplotlib.pyplot, or None when matplotlib is not installed
    ceiling: dict[str, float] = field(default_factory=dict)  # memcpy's GB/s: copy, tcp, pipe
    plot_notes: list[str] = field(default_factory=list)
    note: str = ""

    def link(self, path: Path) -> str:
        return os.path.relpath(path, self.output.parent)

    def save(self, fig: Any, name: str) -> str:
        """Write ``fig`` as plots/NAME.png; the Markdown that shows it."""
        self.plots.mkdir(parents=True, exist_ok=True)
        path = self.plots / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        self.plt.close(fig)
        return f"![{name}]({self.link(path)})"


@dataclass
class Section:
    name: str
    title: str
    headline: list[str]
    body: str
    command: str
    machine: str
    plot: str = ""
    quick: bool = False

    @classmethod
    def of(
        cls, doc: dict[str, Any], name: str, title: str, headline: list[str], body: str, plot: str = ""
    ) -> Section:
        """A section for ``doc``: the command, machine and quick mark come from the document."""
        return cls(
            name, title, headline, body, _command(doc, name), machine_line(doc), plot, bool(doc.get("quick"))
        )

    @property
    def machine_short(self) -> str:
        """CPUs and date only: the summary table's column (each section names the whole machine)."""
        parts = self.machine.split(", ")
        return ", ".join([parts[0], *(p for p in parts[1:] if p.startswith("run "))])


def _command(doc: dict[str, Any], name: str) -> str:
    return str(doc.get("command") or FALLBACK_COMMANDS.get(name, f"python benchmarks/{name}.py"))


def _new_figure(ctx: Context, ncols: int = 1, width: float = 6.5) -> tuple[Any, Any]:
    fig, axes = ctx.plt.subplots(1, ncols, figsize=(width * ncols, 4.2), squeeze=False)
    return fig, axes[0]


def _machine_caption(ax: Any, machine: str) -> None:
    # Absolute times belong to one machine: the plot says which, as the tables do.
    # Laid out first, then hung below the figure's bottom edge: it can never cover the axis labels.
    ax.figure.tight_layout()
    ax.figure.text(0.01, 0.0, machine, fontsize=7, color="0.35", ha="left", va="top", wrap=True)


def memcpy_section(doc: dict[str, Any], ctx: Context) -> Section:
    copies = doc["copy"]
    rows = [
        (
            "copy, 1 thread",
            human_bytes(c["bytes"]),
            f"{c['gbps']:.2f}",
            f"{c['min_gbps']:.2f}",
            f"{c['max_gbps']:.2f}",
        )
        for c in copies
    ]
    for kind, label in (("pipe", "pipe, 2 processes"), ("tcp", "TCP 127.0.0.1, 2 processes")):
        if isinstance(doc.get(kind), dict):
            s = doc[kind]
            rows.append(
                (
                    label,
                    human_bytes(s["bytes_per_sample"]),
                    f"{s['gbps']:.2f}",
                    f"{s['min_gbps']:.2f}",
                    f"{s['max_gbps']:.2f}",
                )
            )
    copy = float(doc["ceiling"]["copy_gbps"])
    tcp = doc["ceiling"].get("tcp_gbps")
    best = doc["ceiling"].get("statistic", "median")
    headline = [
        f"One core copies up to **{copy:.1f} GB/s** ({human_bytes(copies[-1]['bytes'])} float32 tensors, "
        f"{best})"
    ]
    if tcp:
        headline[0] += f"; loopback TCP between two processes carries up to **{float(tcp):.1f} GB/s**"
        headline.append(
            f"loopback TCP reaches {float(tcp) / copy:.0%} of a single-thread copy: those two, not a wire, "
            "bound every collective in the bench sweep on this machine"
        )
    body = md_table(["measurement", "size", "GB/s (median)", "min", "max"], rows, "lrrrr")
    body += "\n\nGB/s = 1e9 bytes per second, the unit of the bench's busbw; a copy moves each byte twice "
    body += "through memory (one read, one write)."
    return Section.of(doc, "memcpy", "Memory-copy ceiling", headline, body)


def rendezvous_section(doc: dict[str, Any], ctx: Context) -> Section:
    results = doc["results"]
    by: dict[tuple[str, int], dict[str, Any]] = {(r["method"], int(r["size"])): r for r in results}
    sizes = sorted({int(r["size"]) for r in results})
    methods = [
        m for m in ("sarcomm", "tcpstore", "c10d", "sarcomm-etcd", "etcd-v2") if any(k[0] == m for k in by)
    ]
    deadline = float(doc.get("settings", {}).get("c10d_deadline") or 60)
    etcd_deadline = float(doc.get("settings", {}).get("etcd_v2_deadline") or 60)

    def formed(method: str, size: int) -> float | None:
        r = by.get((method, size))
        if r is None or r.get("status") not in ("ok", "partial") or r.get("formation_s") is None:
            return None
        return float(r["formation_s"])

    def cell(method: str, size: int) -> str:
        r = by.get((method, size))
        t = formed(method, size)
        if t is not None:
            return f"{t:.3f}"
        if r is None:
            return "-"
        slow = {"c10d": deadline, "etcd-v2": etcd_deadline}
        return {"timeout": f"DNF in {slow[method]:g}" if method in slow else "timeout"}.get(
            r.get("status", ""), str(r.get("status", "?"))
        )

    rows = []
    for size in sizes:
        ours, floor, c10d = formed("sarcomm", size), formed("tcpstore", size), formed("c10d", size)
        r = by.get(("sarcomm", size), {})
        rows.append(
            (
                size,
                cell("sarcomm", size),
                cell("tcpstore", size),
                cell("c10d", size),
                ratio(ours / floor) if ours and floor else "-",
                ratio(c10d / ours) if ours and c10d else "-",
                f"{r['max_over_p50']:.2f}" if r.get("max_over_p50") else "-",
            )
        )
    body = md_table(
        ["N", "sarcomm s", "TCPStore s", "c10d s", "sarcomm / TCPStore", "c10d / sarcomm", "sarcomm max/p50"],
        rows,
    )
    body += (
        "\n\nWorld-formation time: a common start to the last member's answer, median round. TCPStore is "
        "the floor (a bare barrier with no membership, ranks or health); c10d is torch elastic's "
        "rendezvous (`torchrun --rdzv-backend c10d`). max/p50: slowest member over the median member."
    )
    headline = []
    if {"sarcomm-etcd", "etcd-v2"} & set(methods):
        etcd_rows = []
        for size in sizes:
            ours, on_etcd, torch_etcd = (
                formed("sarcomm", size),
                formed("sarcomm-etcd", size),
                formed("etcd-v2", size),
            )
            etcd_rows.append(
                (
                    size,
                    cell("sarcomm", size),
                    cell("sarcomm-etcd", size),
                    cell("etcd-v2", size),
                    ratio(on_etcd / ours) if ours and on_etcd else "-",
                    ratio(torch_etcd / on_etcd) if on_etcd and torch_etcd else "-",
                )
            )
        body += "\n\n" + md_table(
            [
                "N",
                "sarcomm (SQLite) s",
                "sarcomm-etcd s",
                "etcd-v2 s",
                "sarcomm-etcd / SQLite",
                "etcd-v2 / sarcomm-etcd",
            ],
            etcd_rows,
        )
        body += (
            "\n\nsarcomm-etcd: the coordinator keeps its state in etcd (`--store etcd://`, one etcd member "
            "on loopback, leading alone); etcd-v2: torch elastic's rendezvous over its `etcd-v2` backend "
            f"(python-etcd) on the same etcd with `--enable-v2`, one round, deadline {etcd_deadline:g} s."
        )
    both = [s for s in sizes if formed("sarcomm", s) and formed("tcpstore", s)]
    if both:
        top = both[-1]
        ours = formed("sarcomm", top) or 0.0
        headline.append(
            f"sarcomm forms a {top}-member world in **{ours:.2f} s**, "
            f"**{ratio(ours / (formed('tcpstore', top) or 1))}** the time of a bare TCPStore barrier "
            f"(the floor; {span([(formed('sarcomm', s) or 0) / (formed('tcpstore', s) or 1) for s in both])} "
            "over all sizes)"
        )
    c10d_ok = [s for s in sizes if formed("c10d", s) and formed("sarcomm", s)]
    if c10d_ok:
        worst = [s for s in sizes if by.get(("c10d", s), {}).get("status") not in ("ok", "partial", None)]
        line = ", ".join(
            f"{ratio((formed('c10d', s) or 0) / (formed('sarcomm', s) or 1))} at N={s}" for s in c10d_ok
        )
        headline.append(
            f"c10d is slower than sarcomm by {line}"
            + (f", and did not finish N={worst[0]} within {deadline:g} s" if worst else "")
        )
    pairs = [s for s in sizes if formed("sarcomm-etcd", s) and formed("etcd-v2", s)]
    if pairs:
        dnf = [s for s in sizes if by.get(("etcd-v2", s), {}).get("status") == "timeout"]
        headline.append(
            "torch elastic's etcd-v2 rendezvous is slower than sarcomm on etcd by "
            + ", ".join(
                f"{ratio((formed('etcd-v2', s) or 0) / (formed('sarcomm-etcd', s) or 1))} at N={s}"
                for s in pairs
            )
            + (f", and did not finish N={dnf[0]} within {etcd_deadline:g} s" if dnf else "")
        )
    if doc.get("verdict"):
        headline.append(str(doc["verdict"]))
    plot = ""
    if ctx.plt is not None:
        fig, (ax,) = _new_figure(ctx)
        styles = {
            "sarcomm": ("o-", "sarcomm"),
            "tcpstore": ("s--", "TCPStore (floor)"),
            "c10d": ("^-", "c10d"),
            "sarcomm-etcd": ("o:", "sarcomm (etcd store)"),
            "etcd-v2": ("v-", "torch etcd-v2"),
        }
        for method in methods:
            points = [(s, formed(method, s)) for s in sizes if formed(method, s)]
            if points:
                ax.plot(*zip(*points, strict=True), styles[method][0], label=styles[method][1])
        failed = [s for s in sizes if by.get(("c10d", s), {}).get("status") == "timeout"]
        if failed:
            ax.plot(
                failed,
                [deadline] * len(failed),
                "rx",
                markersize=10,
                label=f"c10d: not done in {deadline:g} s",
            )
        ax.set(xscale="log", yscale="log", xlabel="members N", ylabel="world formation (s)")
        ax.set_title("Rendezvous: time to form a world of N members")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
        _machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "rendezvous")
    return Section.of(doc, "rendezvous", "Rendezvous", headline, body, plot)


def baseline_commit(doc: dict[str, Any]) -> str:
    """The short commit of the ``--baseline-ref`` a benchmark timed beside the current code."""
    return str(doc.get("baseline", {}).get("commit", "?"))[:10]


def all_to_all_section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = doc["rows"]
    methods = list(rows[0]["median_seconds"])
    sizes = [int(r["bytes_per_rank"]) for r in rows]
    fallback = [float(r["sar_fallback_over_sarcomm"]) for r in rows]
    single = [float(r["a2a_single_over_sarcomm"]) for r in rows]
    # An earlier commit's all_to_all timed in the same run (--baseline-ref), where there is one.
    before = [float(r["baseline_over_sarcomm"]) for r in rows if "baseline_over_sarcomm" in r]
    table_rows = [
        (
            human_bytes(r["bytes_per_rank"]),
            *(f"{r['median_seconds'][m] * 1e3:.3f}" for m in methods),
            ratio(r["sar_fallback_over_sarcomm"]),
            ratio(r["a2a_single_over_sarcomm"]),
            *([ratio(r["baseline_over_sarcomm"])] if before else []),
        )
        for r in rows
    ]
    body = md_table(
        [
            "bytes per rank",
            *(f"{m} ms" for m in methods),
            "fallback / sarcomm",
            "a2a_single / sarcomm",
            *(["baseline / sarcomm"] if before else []),
        ],
        table_rows,
    )
    body += (
        f"\n\n{doc.get('world_size', '?')} ranks, {doc.get('backend', 'gloo')}, "
        f"{doc.get('transport', 'loopback')}; {doc.get('statistic', 'median')}. Ratios above 1 mean sarcomm "
        "is faster. sar_fallback is SAR's own gloo path (isend to all, recv in rank order, barrier); "
        "a2a_single is the same exchange with all_to_all_single and split sizes."
        + (
            f" baseline is sarcomm's all_to_all at commit {baseline_commit(doc)}, timed in the same run."
            if before and "baseline" in doc
            else ""
        )
    )
    # The smallest size from which sarcomm beats all_to_all_single at every larger size too.
    tail = len(single)
    while tail > 0 and single[tail - 1] > 1.0:
        tail -= 1
    headline = [
        f"sarcomm against SAR's gloo fallback: **{span(fallback)}** faster "
        f"({sum(r > 1 for r in fallback)} of {len(rows)} sizes faster)",
        f"against all_to_all_single: **{span(single)}** "
        + (
            f"({span(single[tail:])} at every size from {human_bytes(sizes[tail])} up)"
            if 0 < tail < len(single)
            else "(faster at every size)"
            if tail == 0
            else "(not faster at the largest size)"
        ),
    ]
    if before:
        headline.append(
            f"against the same code before this change (commit {baseline_commit(doc)}, same run): "
            f"{span(before)}"
        )
    plot = ""
    if ctx.plt is not None:
        fig, (left, right) = _new_figure(ctx, 2, 5.5)
        for m in methods:
            left.plot(sizes, [r["median_seconds"][m] * 1e3 for r in rows], "o-", label=m, markersize=4)
        left.set(xscale="log", yscale="log", xlabel="bytes sent per rank", ylabel="time per call (ms)")
        left.set_title("all_to_all, unequal sizes: time")
        right.plot(sizes, fallback, "o-", label="SAR fallback / sarcomm")
        right.plot(sizes, single, "s-", label="all_to_all_single / sarcomm")
        right.axhline(1.0, color="0.4", linewidth=1, linestyle=":")
        right.set(xscale="log", xlabel="bytes sent per rank", ylabel="ratio (> 1: sarcomm faster)")
        right.set_title("all_to_all: speed-up of sarcomm")
        for ax in (left, right):
            ax.set_xticks(sizes, [human_bytes(s).replace(" ", "") for s in sizes], rotation=45)
            ax.minorticks_off()
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        _machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "all_to_all")
    return Section.of(doc, "all_to_all", "all_to_all with unequal sizes (gloo)", headline, body, plot)


def overhead_section(doc: dict[str, Any], ctx: Context) -> Section:
    only: dict[str, dict[str, float]] = doc["wrapper_only"]
    one: dict[str, float] = doc["world1_all_reduce_4B"]
    two: dict[str, dict[str, dict[str, float]]] = doc["world2"]
    added_us = {op: r["added_s"] * 1e6 for op, r in only.items()}
    noise = two.get("all_reduce A/A (bare vs bare)", {})
    headline = [
        f"The wrapper alone adds **{span(added_us.values(), lambda x: f'{x:.2f} us')}** per call "
        "(backend replaced by a no-op; target under 2 us)",
        f"A 4-byte all_reduce gains {one['added_s'] * 1e6:.2f} us in one rank"
        + (
            f" and {two['all_reduce']['4 B']['added_s'] * 1e6:.2f} us with two ranks "
            f"({two['all_reduce']['4 B']['added_s'] / two['all_reduce']['4 B']['bare_s']:.1%} of "
            f"{two['all_reduce']['4 B']['bare_s'] * 1e6:.0f} us)"
            if "4 B" in two.get("all_reduce", {})
            else ""
        ),
    ]
    bounds = {
        f"{op} {label}": r["bound_fraction"]
        for op, by_size in two.items()
        for label, r in by_size.items()
        # 0 marks the rows that are no wrapper (A/A calibration, an earlier commit's all_to_all).
        if r.get("bound_fraction", 0) > 0 and label != "4 B"
    }
    a2a = two.get("all_to_all", {})
    if a2a:
        old_row = doc.get("baseline", {}).get("row", "")
        old = two.get(old_row, {})
        headline.append(
            "all_to_all with equal sizes adds "
            + ", ".join(f"{r['added_s'] * 1e6:.2f} us at {label}" for label, r in a2a.items())
            + " to a bare dist.all_to_all"
            + (
                " (before, at "
                + baseline_commit(doc)
                + ": "
                + ", ".join(f"{r['added_s'] * 1e6:.2f} us at {label}" for label, r in old.items())
                + ")"
                if old
                else ""
            )
        )
    if bounds:
        under = sum(b < 0.01 for b in bounds.values())
        headline.append(
            f"Calls of 64 KiB and more: the wrapper's cost is {span(bounds.values(), lambda x: f'{x:.2%}')} "
            f"of the bare call, under 1% for {under} of {len(bounds)} (op, size) pairs"
        )
    rows = []
    for op, by_size in two.items():
        for label, r in by_size.items():
            bound = f"{r['bound_fraction']:.2%}" if r.get("bound_fraction", 0) > 0 else "-"
            rows.append(
                (
                    op,
                    label,
                    f"{r['bare_s'] * 1e6:.2f}",
                    f"{r['added_s'] * 1e6:.2f}",
                    f"{r['added_s'] / r['bare_s']:.1%}",
                    bound,
                )
            )
    body = "Wrapper alone (no-op backend), microseconds per call:\n\n" + md_table(
        ["op", "bare us", "wrapped us", "added us"],
        [
            (op, f"{r['bare_s'] * 1e6:.2f}", f"{r['wrapped_s'] * 1e6:.2f}", f"{r['added_s'] * 1e6:.2f}")
            for op, r in only.items()
        ],
    )
    body += "\n\nTwo ranks, gloo on loopback, bare and wrapped interleaved:\n\n" + md_table(
        ["op", "size", "bare us", "added us", "added %", "bound %"], rows
    )
    body += (
        "\n\nadded = median of paired differences (wrapped minus the bare call beside it); bound = the "
        "wrapper-alone cost over the bare time. The A/A rows time bare against bare: their added is "
        "the measurement's own noise. all_to_all sends equal sizes (sarcomm's equal-size path); the "
        "row 'all_to_all at COMMIT (before)' is the same call through that commit's code, timed in the "
        "same run."
    )
    plot = ""
    if ctx.plt is not None:
        fig, (left, right) = _new_figure(ctx, 2, 5.5)
        ops = list(only)
        left.bar(ops, [added_us[o] for o in ops], color="tab:blue")
        left.axhline(2.0, color="tab:red", linestyle="--", linewidth=1, label="target: 2 us")
        left.set(ylabel="added per call (us)")
        left.set_title("Wrapper alone (no-op backend)")
        left.legend(fontsize=8)
        measured = [op for op in two if op in only or op == "send/recv"]
        labels = [label for label in ("4 B", "64 KiB") if any(label in two[op] for op in measured)]
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            xs = [k + (i - (len(labels) - 1) / 2) * width for k in range(len(measured))]
            ys = [two[op][label]["added_s"] * 1e6 if label in two[op] else 0.0 for op in measured]
            right.bar(xs, ys, width, label=label)
        for label, r in noise.items():
            if label in labels:
                right.axhline(abs(r["added_s"]) * 1e6, color="0.4", linestyle=":", linewidth=1)
        right.set_xticks(range(len(measured)), measured)
        right.set(ylabel="added per call (us)")
        right.set_title("Two ranks, gloo: measured added (dotted: A/A noise)")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=60)
            ctx.plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")  # label ends at its bar
            ax.grid(True, axis="y", alpha=0.3)
        _machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "overhead")
    return Section.of(doc, "overhead", "Wrapper overhead", headline, body, plot)


def bench_sweep_section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = doc["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    # The split ops round a size down to a multiple of the world, so the same requested size shows
    # as different bytes per op. Every op runs the same sweep in the same order: the i-th row of
    # each op belongs to the i-th requested size, labelled with the largest bytes of that step.
    by_op = {op: sorted((r for r in rows if r["op"] == op), key=lambda r: int(r["bytes"])) for op in ops}
    steps = max(len(v) for v in by_op.values())
    labels = [max(int(v[i]["bytes"]) for v in by_op.values() if i < len(v)) for i in range(steps)]
    grid = sorted(labels)

    def at(op: str, size: int) -> dict[str, Any] | None:
        i = labels.index(size)
        return by_op[op][i] if i < len(by_op[op]) else None

    wrong = sum(int(r.get("wrong", 0)) for r in rows)
    top = grid[-1]
    copy, tcp = ctx.ceiling.get("copy"), ctx.ceiling.get("tcp")
    parts = []
    for op in ops:
        r = at(op, top)
        if r is None:
            continue
        parts.append(f"{op} {r['busbw']:.2f}" + (f" ({r['busbw'] / tcp:.0%})" if tcp else ""))
    headline = [
        f"busbw at {human_bytes(top)}, GB/s"
        + (f" (in brackets: share of loopback TCP's {tcp:.1f} GB/s)" if tcp else "")
        + ": "
        + ", ".join(parts)
    ]
    small = [at(op, grid[0]) for op in ops]
    latencies = [float(r["time_us"]) / 1e3 for r in small if r]
    headline.append(
        f"{doc.get('world_size', '?')} ranks, {doc.get('backend', '?')}: "
        f"{wrong} wrong value(s) over {len(rows)} checked rows; {human_bytes(grid[0])} calls take "
        f"{span(latencies, lambda x: f'{x:.1f} ms')}"
    )
    if copy:
        headline.append(
            f"ceiling (memcpy.json, best samples): one core copies {copy:.1f} GB/s"
            + (f", loopback TCP carries {tcp:.1f} GB/s" if tcp else "")
        )
    table = md_table(
        ["size", *ops],
        [(human_bytes(s), *(f"{r['busbw']:.3f}" if (r := at(op, s)) else "-" for op in ops)) for s in grid],
    )
    times = md_table(
        ["size", *ops],
        [
            (human_bytes(s), *(f"{r['time_us'] / 1e3:.2f}" if (r := at(op, s)) else "-" for op in ops))
            for s in grid
        ],
    )
    body = (
        f"busbw (GB/s) by size and op, `sar-worker ... bench`, {doc.get('iters', '?')} timed calls per row "
        f"after {doc.get('warmup', '?')} warm-up; nccl-tests' bus factors.\n\n{table}\n\n"
        f"<details><summary>time per call (ms), the slowest rank's mean</summary>\n\n{times}\n\n</details>"
    )
    plot = ""
    if ctx.plt is not None:
        fig, (ax,) = _new_figure(ctx, 1, 8.0)
        for op in ops:
            points = [(s, r["busbw"]) for s in grid if (r := at(op, s)) and r["busbw"] > 0]
            if points:
                ax.plot(*zip(*points, strict=True), "o-", markersize=3, label=op)
        for value, label, style in (
            (copy, "memcpy, 1 thread", "--"),
            (tcp, "loopback TCP, 2 processes", ":"),
        ):
            if value:
                ax.axhline(value, color="black", linestyle=style, linewidth=1)
                ax.annotate(
                    f"{label}: {value:.1f} GB/s",
                    (grid[0], value),
                    xytext=(0, 3),
                    textcoords="offset points",
                    fontsize=8,
                )
        ax.set(xscale="log", yscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)")
        ax.set_xticks(grid, [human_bytes(s).replace(" ", "") for s in grid], rotation=45)
        ax.minorticks_off()
        ax.set_title(
            f"bench sweep: bus bandwidth, {doc.get('world_size', '?')} ranks, {doc.get('backend', '')}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        _machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "bench_sweep")
    return Section.of(
        doc, "bench_sweep", "Collective bench sweep (`sar-worker ... bench`)", headline, body, plot
    )


def _their_headline(doc: dict[str, Any]) -> list[str]:
    """The script's own summary lines (a string or a list of them), if it wrote any."""
    value = doc.get("headline")
    if isinstance(value, str):
        return [value]
    return [str(x) for x in value] if isinstance(value, list) else []


def failure_detection_section(doc: dict[str, Any], ctx: Context) -> Section:
    summary = doc["summary"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in summary))
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    cell = {(r["scenario"], r["mode"]): r for r in summary}
    settings = doc.get("settings", {})
    timeout = settings.get("gloo_timeout_s")

    def median(scenario: str, mode: str) -> float | None:
        r = cell.get((scenario, mode))
        return None if r is None or r.get("stopped_median_s") is None else float(r["stopped_median_s"])

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
                f"{mode} {ratio(base / t)}" if base and (t := median(scenario, mode)) else f"{mode} -"
                for mode in ours
            ]
            parts.append(f"{scenario}: " + ", ".join(ratios))
        headline.append(
            "Plain gloo's time to stop the other ranks over sarcomm's (> 1: sarcomm stops them sooner): "
            + "; ".join(parts)
            + (
                f" (gloo's timeout set to {timeout:g} s here; torch's default is 30 minutes)"
                if timeout
                else ""
            )
        )
    headline += _their_headline(doc)
    header = ["fault", *(f"{m} s" for m in modes)]
    if "gloo" in modes:
        header += [f"gloo / {m}" for m in ours]
    rows = []
    for scenario in scenarios:
        row = [scenario, *(shown(scenario, m) for m in modes)]
        if "gloo" in modes:
            base = median(scenario, "gloo")
            row += [ratio(base / t) if base and (t := median(scenario, m)) else "-" for m in ours]
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
        fig, (ax,) = _new_figure(ctx)
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [k + (i - (len(modes) - 1) / 2) * width for k in range(len(scenarios))]
            values, low, high, missing = [], [], [], []
            for scenario in scenarios:
                r = cell.get((scenario, mode), {})
                t = median(scenario, mode)
                if t is None:
                    # Did not stop within the deadline: a hatched bar up to it says "at least".
                    deadline = float(r.get("deadline_s") or 0)
                    values.append(deadline)
                    low.append(0.0)
                    high.append(0.0)
                    missing.append(True)
                else:
                    values.append(t)
                    low.append(t - float(r.get("stopped_min_s", t)))
                    high.append(float(r.get("stopped_max_s", t)) - t)
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
        _machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "failure_detection")
    title = "Failure detection"
    return Section.of(doc, "failure_detection", title, headline, body, plot)


def heartbeat_load_section(doc: dict[str, Any], ctx: Context) -> Section:
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
            + (f" ({ratio(cpu_s / cpu_b)})" if cpu_b > 0 else "")
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
    headline += _their_headline(doc)
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
        fig, axes = _new_figure(ctx, len(metrics) + (1 if scaling else 0), 3.6)
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
        _machine_caption(axes[0], machine_line(doc))
        plot = ctx.save(fig, "heartbeat_load")
    title = "Heartbeat load on the coordinator"
    return Section.of(doc, "heartbeat_load", title, headline, body, plot)


def state_writes_section(doc: dict[str, Any], ctx: Context) -> Section:
    summary = doc["summary"]
    headline = list(_their_headline(doc))
    rows = [
        [
            r["members"],
            r["phase"],
            f"{r['immediate_loop_cpu_s']:g}" + (" (scaled)" if r["immediate_scaled_by"] != 1 else ""),
            f"{r['write_behind_loop_cpu_s']:g}",
            ratio(r["loop_cpu_ratio"]) if r.get("loop_cpu_ratio") else "-",
            f"{r['immediate_longest_hold_ms']:g}",
            f"{r['write_behind_longest_hold_ms']:g}",
            r["write_behind_batches"],
        ]
        for r in summary
    ]
    body = md_table(
        [
            "members",
            "phase",
            "immediate: loop CPU s",
            "write-behind: loop CPU s",
            "ratio",
            "immediate: longest hold ms",
            "write-behind: longest hold ms",
            "write-behind batches",
        ],
        rows,
        align="rlrrrrrr",
    )
    body += (
        "\n\nOne job of N single-rank members forms, each member's first report names its metrics "
        "endpoint, and every member leaves: each change rewrites the job's record. Immediate: written on "
        "the event loop at each change (the coordinator before); write-behind: coalesced and written by a "
        "thread, Join and Leave answers waiting for the write. Scaled: the baseline ran a sample of the "
        "changes and is scaled to N (each of its changes costs the same)."
    )
    plot = ""
    leaves = [r for r in summary if r["phase"] == "leaves"]
    if ctx.plt is not None and len(leaves) > 1:
        fig, (ax,) = _new_figure(ctx)
        sizes = [r["members"] for r in leaves]
        ax.plot(sizes, [r["immediate_loop_cpu_s"] for r in leaves], "o-", label="immediate (baseline)")
        ax.plot(sizes, [r["write_behind_loop_cpu_s"] for r in leaves], "o-", label="write-behind")
        ax.set(xscale="log", yscale="log", xlabel="members", ylabel="event-loop CPU s for all leaves")
        ax.set_title("Every member leaving: the event loop's cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        _machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "state_writes")
    return Section.of(doc, "state_writes", str(doc.get("title") or "State writes"), headline, body, plot)


def heartbeat_load_etcd_section(doc: dict[str, Any], ctx: Context) -> Section:
    """heartbeat_load.py --stores sqlite,etcd (results/heartbeat_load_etcd.json): the same load with
    the coordinator on etcd beside SQLite, in one run; the script's headline compares them."""
    section = heartbeat_load_section(doc, ctx)
    return replace(section, name="heartbeat_load_etcd", title="Heartbeat load: the etcd store beside SQLite")


def failover_section(doc: dict[str, Any], ctx: Context) -> Section:
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
    return Section.of(doc, "failover", title, _their_headline(doc), body)


def soak_section(doc: dict[str, Any], ctx: Context) -> Section:
    waves = doc["waves"]
    base, final, top = doc["baseline_rss_mib"], doc["final_rss_mib"], doc["max_rss_mib"]
    tolerance = float(doc.get("tolerance_mib") or 0)
    verdict = "returned to" if doc.get("returned_to_baseline") else "did NOT return to"
    headline = [
        f"After {len(waves)} waves of {doc.get('members', '?')} members in {doc.get('jobs', '?')} jobs "
        f"joining, heartbeating and leaving, the coordinator's RSS {verdict} its baseline: {base:g} MiB "
        f"after warm-up, {final:g} MiB at the end (tolerance {tolerance:g} MiB), {top:g} MiB at most, trend "
        f"{doc.get('rss_trend_mib_per_wave', 0):g} MiB per wave"
    ]
    keys = [
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
        + md_table(keys, [[_fmt(w.get(k)) for k in keys] for w in waves])
        + "\n\n</details>"
    )
    plot = ""
    if ctx.plt is not None and waves:
        fig, (left, right) = _new_figure(ctx, 2, 5.0)
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
                right.plot(xs, [w[key] for w in waves], "o-", markersize=3, label=key)
        right.set(xlabel="wave", ylabel="count")
        right.set_title("Open descriptors and threads")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
        _machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "soak")
    return Section.of(doc, "soak", "Soak: coordinator memory over waves of jobs", headline, body, plot)


# -- benchmarks whose format this report does not know (written elsewhere, or newer) ---------------


def _flat_rows(doc: Any) -> list[dict[str, Any]] | None:
    """The first list of flat dicts in ``doc`` (depth first): what a generic table shows."""
    if isinstance(doc, list) and doc and all(isinstance(x, dict) for x in doc):
        flat = [
            {k: v for k, v in x.items() if isinstance(v, str | int | float | bool) or v is None} for x in doc
        ]
        if any(flat):
            return flat
    children = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else []
    for child in children:
        if isinstance(child, dict | list) and (found := _flat_rows(child)):
            return found
    return None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def generic_section(name: str, doc: dict[str, Any], ctx: Context) -> Section:
    """Any other benchmark's JSON: its summary lines, its first table of rows, and a plot of each
    numeric column against the first one when there are several rows."""
    headline = [
        str(doc[key])
        for key in ("headline", "verdict", "summary", "conclusion")
        if isinstance(doc.get(key), str) and doc[key]
    ]
    if isinstance(doc.get("headline"), list):
        headline += [str(x) for x in doc["headline"]]
    rows = _flat_rows({k: v for k, v in doc.items() if k not in ("machine", "settings")}) or []
    body = "(no table of rows found in the JSON)"
    plot = ""
    if rows:
        columns = list(dict.fromkeys(k for r in rows for k in r))[:10]
        body = md_table(columns, [[_fmt(r.get(c)) for c in columns] for r in rows], "l" * len(columns))
        numeric = [
            c
            for c in columns
            if all(isinstance(r.get(c), int | float) and not isinstance(r.get(c), bool) for r in rows)
        ]
        if ctx.plt is not None and len(rows) > 1 and len(numeric) >= 2:
            fig, (ax,) = _new_figure(ctx)
            x = numeric[0]
            for y in numeric[1:6]:
                ax.plot([r[x] for r in rows], [r[y] for r in rows], "o-", label=y, markersize=4)
            ax.set(xlabel=x)
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            _machine_caption(ax, machine_line(doc))
            plot = ctx.save(fig, name)
    title = str(doc.get("title") or name.replace("_", " ").capitalize())
    return Section.of(doc, name, title, headline, body, plot)


def torchrun_rendezvous_section(doc: dict[str, Any], ctx: Context) -> Section:
    """benchmarks/torchrun_rendezvous.py: its headline and the tables it renders itself."""
    return Section.of(
        doc, "torchrun_rendezvous", str(doc["title"]), list(doc["headline"]), str(doc["tables_markdown"])
    )


# -- the report ----------------------------------------------------------------------------------

Renderer = Callable[[dict[str, Any], Context], Section]
#: Known benchmarks, in the report's order; any other *.json in the folder follows them.
RENDERERS: dict[str, Renderer] = {
    "memcpy": memcpy_section,
    "rendezvous": rendezvous_section,
    "all_to_all": all_to_all_section,
    "overhead": overhead_section,
    "bench_sweep": bench_sweep_section,
    "state_writes": state_writes_section,
}
#: Written by other scripts; shown when their JSON is there, with no line when it is not.
OPTIONAL_RENDERERS: dict[str, Renderer] = {
    "failure_detection": failure_detection_section,
    "heartbeat_load": heartbeat_load_section,
    "heartbeat_load_etcd": heartbeat_load_etcd_section,
    "failover": failover_section,
    "soak": soak_section,
    "torchrun_rendezvous": torchrun_rendezvous_section,
}
OPTIONAL = tuple(OPTIONAL_RENDERERS)


def load(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The JSON document at ``path``, or None and why not."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "no results yet"
    except (OSError, ValueError) as exc:
        return None, f"could not read {path.name}: {exc}"
    if not isinstance(doc, dict):
        return None, f"{path.name} is not a JSON object (unknown format)"
    return doc, ""


def rerun(name: str) -> str:
    """How to (re)make ``name``'s JSON, for the benchmarks run_all.py runs; nothing for others."""
    return f"; run `benchmarks/run_all.sh --only {name}`" if name in (*RENDERERS, *OPTIONAL) else ""


def build(ctx: Context) -> str:
    memcpy_doc, _ = load(ctx.results / "memcpy.json")
    if memcpy_doc is not None:
        try:
            ceiling = memcpy_doc["ceiling"]
            ctx.ceiling = {
                k: float(ceiling[f"{k}_gbps"]) for k in ("copy", "tcp") if ceiling.get(f"{k}_gbps")
            }
        except (KeyError, TypeError, ValueError):
            pass  # memcpy's own section says what is wrong with it
    names = list(RENDERERS) + [n for n in OPTIONAL if (ctx.results / f"{n}.json").exists()]
    names += sorted(
        p.stem for p in ctx.results.glob("*.json") if p.stem not in names and not p.stem.startswith(".")
    )
    sections: list[Section] = []
    gaps: list[str] = []
    for name in names:
        path = ctx.results / f"{name}.json"
        doc, why = load(path)
        if doc is None:
            gaps.append(f"- **{name}**: {why}{rerun(name)}.")
            continue
        declared = doc.get("benchmark")
        renderer = RENDERERS.get(name) or OPTIONAL_RENDERERS.get(name)
        try:
            if declared not in (None, name):
                raise ValueError(f"the file says it holds {declared!r}")
            section = renderer(doc, ctx) if renderer else generic_section(name, doc, ctx)
        except Exception as exc:  # one unreadable result must not cost the whole report
            if ctx.plt is not None:
                ctx.plt.close("all")  # a figure the failed section left open
            detail = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            gaps.append(
                f"- **{name}**: `{ctx.link(path)}` is in a format this report does not read ({detail})"
                f"{rerun(name)}."
            )
            if os.environ.get("SARCOMM_REPORT_DEBUG"):
                traceback.print_exc()
            continue
        sections.append(section)
    return render(ctx, sections, gaps)


def render(ctx: Context, sections: list[Section], gaps: list[str]) -> str:
    source = ctx.link(ctx.results) if ctx.results != ctx.output.parent else str(ctx.results)
    out = [
        "# Benchmark results",
        "",
        f"Generated by `python benchmarks/report.py` from the JSON in `{source}/`. Rerun every "
        "benchmark and this report with `benchmarks/run_all.sh` (about 25 minutes on 2 cores; "
        "`--only NAME` for one, `--report-only` to rebuild this page). Ratios are the headline: they "
        "compare methods measured in the same run on the same machine. Absolute times belong to the "
        "machine named with each result.",
        "",
    ]
    if ctx.note:
        out += [f"**{ctx.note}**", ""]
    if sections:
        out += [
            md_table(
                ["benchmark", "headline", "machine"],
                [
                    (
                        f"[{s.title}](#{_anchor(s.title)})",
                        s.headline[0] if s.headline else "-",
                        s.machine_short,
                    )
                    for s in sections
                ],
                "lll",
            ),
            "",
        ]
    if gaps:
        out += ["Not shown:", "", *gaps, ""]
    if ctx.plot_notes:
        out += [*ctx.plot_notes, ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        if s.quick:
            out += ["*Quick pass: fewer samples and sizes; a smoke test, not a recording.*", ""]
        out += [*(f"- {line}" for line in s.headline), ""]
        if s.plot:
            out += [s.plot, ""]
        out += [s.body, ""]
        notes = ctx.results / f"{s.name}.md"
        if notes.exists():
            out += [f"Details and how to read them: [`{notes.name}`]({ctx.link(notes)}).", ""]
        out += [f"Machine: {s.machine}.", "", "Reproduce:", "", "```", s.command, "```", ""]
    return "\n".join(out)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON is")
    parser.add_argument(
        "--output",
        type=Path,
        help="the Markdown to write (default benchmarks/RESULTS.md, or RESULTS.md in --results-dir when "
        "that is not benchmarks/results)",
    )
    parser.add_argument("--plots-dir", type=Path, help="where the PNGs go (default RESULTS_DIR/plots)")
    parser.add_argument("--note", help="a line to show at the top (run_all.py marks a --quick pass so)")
    args = parser.parse_args(argv)
    results = args.results_dir.resolve()
    output = (
        args.output or (DEFAULT_OUTPUT if results == DEFAULT_RESULTS else results / "RESULTS.md")
    ).resolve()
    plots = (args.plots_dir or results / "plots").resolve()
    plt: Any = None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a benchmark host
        import matplotlib.pyplot

        plt = matplotlib.pyplot
    except ImportError:
        pass  # the report says so and goes on without plots
    ctx = Context(results, plots, output, plt, note=args.note or "")
    if plt is None:
        ctx.plot_notes.append("Plots: matplotlib is not installed (`pip install -e '.[bench]'`); none drawn.")
    text = build(ctx)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    print(f"wrote {output}" + (f" and plots in {plots}" if plt is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
