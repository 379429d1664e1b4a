"""Zero-code metrics (benchmarks/zerocode.py): a DDP step with the dispatcher kernels and without,
the added cost per all_reduce beside the bare call and the library's wrapper, and the wrapper's
own cost on a one-rank all_reduce with its parts."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table, times

_OBSERVE = "stats.observe (append, fold every 256)"
_OBSERVE_COLD = "after a real call: stats.observe"
CALL_HEADER = ["size", "bare", "bare + zero-code", "added", "library", "library + zero-code", "added"]


def _us(value: dict[str, float]) -> str:
    return f"{value['wall_s'] * 1e6:.1f} ({value['cpu_s'] * 1e6:.1f})"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    ddp_rows = []
    cpu_words = []
    for size, row in doc["ddp"].items():
        off, on = row["off"], row["on"]
        cpu_words.append(f"{times(on['cpu_s'], off['cpu_s'], 'less', 'more')} at {size}")
        ddp_rows.append(
            (size, f"{off['wall_s'] * 1e3:.2f}", f"{on['wall_s'] * 1e3:.2f}",
             times(on["wall_s"], off["wall_s"], "less", "more"),
             f"{off['cpu_s'] * 1e3:.2f}", f"{on['cpu_s'] * 1e3:.2f}",
             times(on["cpu_s"], off["cpu_s"], "less", "more"))
        )  # fmt: skip
    call_rows = []
    for size, row in doc["per_call"].items():
        b0, b1, l0, l1 = (row[k] for k in ("bare_off", "bare_on", "library_off", "library_on"))
        call_rows.append(
            (size, _us(b0), _us(b1), f"{(b1['wall_s'] - b0['wall_s']) * 1e6:+.1f}",
             _us(l0), _us(l1), f"{(l1['wall_s'] - l0['wall_s']) * 1e6:+.1f}")
        )  # fmt: skip
    w = doc["world1"]
    bare, lib = w["bare"], w["library"]
    added_wall, added_cpu = (lib["wall_s"] - bare["wall_s"]) * 1e6, (lib["cpu_s"] - bare["cpu_s"]) * 1e6
    machine = doc["machine"]
    busy = max(machine["loadavg_1m_at_start"], machine["loadavg_1m_at_end"]) > machine["nproc"]
    headline = [
        "A DDP step (2 ranks, gloo) with zero-code metrics on takes **"
        + ", ".join(cpu_words)
        + "** process CPU time than one without"
        + ("; wall-time ratios and every absolute figure were taken under heavy load" if busy else ""),
        *_bound(doc),
        f"the library's wrapper adds {added_wall:+.2f} us wall, {added_cpu:+.2f} us CPU to a one-rank 4-byte "
        "all_reduce here (its parts below)",
    ]
    body = "\n\n".join(
        [
            f"Load: 1-minute load average {machine['loadavg_1m_at_start']:.1f} at the start and "
            f"{machine['loadavg_1m_at_end']:.1f} at the end on {machine['nproc']} CPUs"
            + (
                " shared with other engineers' tests: the wall times scatter by tens of percent from block "
                "to block;"
                if busy
                else ": the wall times still scatter by several percent from block to "
                "block (both ranks and gloo's threads share the 2 cores);"
            )
            + " the process CPU times (the rank's own work, what instrumentation adds to) are the "
            "steadier figure. Every figure is a median over interleaved blocks (ABBA, both ranks "
            "switching together). A step's difference within a few percent is that scatter: the bound "
            "above (what zero-code costs per collective, times the collectives a step makes) is the "
            "figure to hold against the 2% target.",
            "DDP step (forward and backward of one linear layer; DDP's 25 MiB buckets), ms per step:",
            md_table(
                ["gradients", "off", "on", "on than off", "off CPU", "on CPU", "on than off (CPU)"], ddp_rows
            ),
            "One all_reduce, 2 ranks, us per call, wall (CPU): bare `dist.all_reduce`, the same with the "
            "zero-code kernels, the library's `sar.all_reduce`, the library's with the kernels (its calls "
            "dispatched below them: each call counted once, by the wrapper):",
            md_table(CALL_HEADER, call_rows),
            "The library's wrapper on a one-rank 4-byte gloo all_reduce (kernels removed), us per call:",
            md_table(
                ["bare", "library", "added (wall)", "bare CPU", "library CPU", "added (CPU)"],
                [
                    (
                        f"{bare['wall_s'] * 1e6:.2f}",
                        f"{lib['wall_s'] * 1e6:.2f}",
                        f"{added_wall:+.2f}",
                        f"{bare['cpu_s'] * 1e6:.2f}",
                        f"{lib['cpu_s'] * 1e6:.2f}",
                        f"{added_cpu:+.2f}",
                    )
                ],
                "rrrrrr",
            ),
            *_library_on(w),
            "Where the wrapper's time goes: each part alone in a loop, ns per call (median of 20 blocks of "
            "20,000; the empty loop's cost is in every row); then the same parts timed right after a real "
            "one-rank all_reduce, as the wrapper meets them (median of 20 blocks of 500; a clock read is in "
            "every such row):",
            *_parts(doc),
            *_kernel(doc),
        ]
    )
    return Section.of(doc, "zerocode", "Zero-code metrics", headline, body)


def _bound(doc: dict[str, Any]) -> list[str]:
    """Zero-code's added CPU per collective (the one-rank recorded path) times the collectives of a
    DDP step, over the step's CPU without it: the step's cost bound, when the recording has both."""
    kernel = doc.get("kernel")
    rows = [(size, row) for size, row in doc["ddp"].items() if "collectives_per_step" in row]
    if not kernel or not rows:
        return []
    added = kernel["recorded"]["cpu_s"] - kernel["bare"]["cpu_s"]
    parts = [
        f"{row['collectives_per_step'] * added / row['off']['cpu_s']:.2%} at {size} "
        f"({row['collectives_per_step']} per step)"
        for size, row in rows
    ]
    return [
        f"zero-code's cost per collective ({added * 1e6:+.1f} us of CPU, the whole path on a one-rank "
        f"all_reduce) times the collectives a DDP step makes bounds its cost to **{', '.join(parts)}** "
        "of the step's CPU (target: at most 2%)"
    ]


def _parts(doc: dict[str, Any]) -> list[str]:
    """The wrapper's parts, and beside them the same with the rank on one CPU when recorded."""
    pinned = doc.get("pinned")
    if not pinned:
        return [md_table(["part", "ns"], [(name, f"{ns:.0f}") for name, ns in doc["parts"].items()])]
    rows = [(name, f"{ns:.0f}", f"{pinned['parts'][name]:.0f}") for name, ns in doc["parts"].items()]
    bare, lib = pinned["world1"]["bare"], pinned["world1"]["library"]
    return [
        md_table(["part", "ns", "ns, on one CPU"], rows),
        "The one-rank run again with the rank and gloo's threads on one CPU (`sched_setaffinity`): "
        f"bare {bare['wall_s'] * 1e6:.2f} us, library {lib['wall_s'] * 1e6:.2f} us, the wrapper adding "
        f"{(lib['wall_s'] - bare['wall_s']) * 1e6:+.2f} us wall, {(lib['cpu_s'] - bare['cpu_s']) * 1e6:+.2f} "
        "us CPU. Each part costs several times more right after a real call than in a loop (stats.observe: "
        f"{doc['parts'][_OBSERVE_COLD]:.0f} ns against {doc['parts'][_OBSERVE]:.0f} ns), on one CPU or two: "
        "the thread comes back from the collective's wait to caches that gloo's threads have used. That, "
        "not the wrapper's instructions, is most of its cost.",
    ]


def _library_on(w: dict[str, Any]) -> list[str]:
    """The library's call with zero-code on against off (its calls dispatched below the kernels),
    when the recording has it."""
    on = w.get("library_on")
    if not on:
        return []
    off = w["library"]
    return [
        "The same library call with zero-code on (its kernels registered; the wrapper dispatches the "
        "call below them, so the Python kernel never runs for it, and the progress hook counts the "
        "library's depth) against off (no kernels, no hook), us per call:",
        md_table(
            ["off", "on", "on than off", "off CPU", "on CPU", "on than off (CPU)"],
            [
                (
                    f"{off['wall_s'] * 1e6:.2f}",
                    f"{on['wall_s'] * 1e6:.2f}",
                    times(on["wall_s"], off["wall_s"], "less", "more"),
                    f"{off['cpu_s'] * 1e6:.2f}",
                    f"{on['cpu_s'] * 1e6:.2f}",
                    times(on["cpu_s"], off["cpu_s"], "less", "more"),
                )
            ],
            "rrrrrr",
        ),
    ]


def _kernel(doc: dict[str, Any]) -> list[str]:
    """Where the zero-code path's cost goes, when the recording has it."""
    kernel = doc.get("kernel")
    if not kernel:
        return []
    bare = kernel["bare"]
    rows = [
        (name, f"{v['wall_s'] * 1e6:.1f}", f"{(v['wall_s'] - bare['wall_s']) * 1e6:+.1f}",
         f"{v['cpu_s'] * 1e6:.1f}", f"{(v['cpu_s'] - bare['cpu_s']) * 1e6:+.1f}")
        for name, v in kernel.items()
    ]  # fmt: skip
    return [
        "Where the zero-code path's cost goes, one-rank 4-byte `dist.all_reduce`, us per call: bare; the "
        "Python kernel handing the call on (boxing the arguments into Python and back: what each of the "
        "library's calls paid before they were dispatched below the kernel); the whole path (the "
        "work's future and its completion callback on gloo's thread besides):",
        md_table(["path", "wall", "added", "CPU", "added (CPU)"], rows),
    ]
