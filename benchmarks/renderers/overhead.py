"""The wrapper's overhead (benchmarks/overhead.py): no-op backend, one rank, two ranks."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, cast

from render import (
    Context,
    Section,
    baseline_commit,
    machine_caption,
    machine_line,
    md_table,
    span,
)


class Paired(TypedDict):
    """Bare and wrapped calls timed in pairs: median seconds per call of each, and of the paired
    difference (``added_s``). Blocks of calls (``blocks``, ``calls_per_block``) or single calls
    (``pairs``); ``bound_fraction``, on the two-rank rows: the wrapper alone's cost over the bare
    time (0 for the rows that are no wrapper: the A/A calibration, an earlier commit's all_to_all)."""

    bare_s: float
    wrapped_s: float
    added_s: float
    blocks: NotRequired[float]
    calls_per_block: NotRequired[float]
    pairs: NotRequired[float]
    bound_fraction: NotRequired[float]


#: Per op: the wrapper alone (no-op backend).
WrapperOnly = dict[str, Paired]
#: Per op, per size label (``4 B``, ``64 KiB``): two ranks, gloo on loopback.
World2 = dict[str, dict[str, Paired]]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    only = cast(WrapperOnly, doc["wrapper_only"])
    one = cast(Paired, doc["world1_all_reduce_4B"])
    two = cast(World2, doc["world2"])
    added_us = {op: r["added_s"] * 1e6 for op, r in only.items()}
    noise: dict[str, Paired] = two.get("all_reduce A/A (bare vs bare)", {})
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
        old: dict[str, Paired] = two.get(old_row, {})
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
        fig, (left, right) = ctx.figure(2, 5.5)
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
        machine_caption(left, machine_line(doc))
        plot = ctx.save(fig, "overhead")
    return Section.of(doc, "overhead", "Wrapper overhead", headline, body, plot)
