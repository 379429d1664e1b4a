"""The memory-copy ceiling (benchmarks/memcpy.py): copy, pipe and loopback TCP bandwidth."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, cast

from render import (
    Context,
    Section,
    human_bytes,
    md_table,
)


class Rates(TypedDict):
    """Samples of one measurement, in GB/s (1e9 bytes per second)."""

    samples: int
    gbps: float  # the median
    min_gbps: float
    max_gbps: float


class CopyRow(Rates):
    """Single-thread copies of one size of float32 tensor."""

    bytes: int
    copies_per_sample: int


class StreamRow(Rates):
    """One process writing to another, through a pipe or loopback TCP."""

    bytes_per_sample: int
    chunk_bytes: int


class Ceiling(TypedDict):
    """The figures the report draws as ceilings: the best samples of the largest copy and of TCP."""

    statistic: NotRequired[str]
    copy_gbps: float
    tcp_gbps: float | None


def section(doc: dict[str, Any], ctx: Context) -> Section:
    copies = cast(list[CopyRow], doc["copy"])
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
            s = cast(StreamRow, doc[kind])
            rows.append(
                (
                    label,
                    human_bytes(s["bytes_per_sample"]),
                    f"{s['gbps']:.2f}",
                    f"{s['min_gbps']:.2f}",
                    f"{s['max_gbps']:.2f}",
                )
            )
    ceiling = cast(Ceiling, doc["ceiling"])
    copy = float(ceiling["copy_gbps"])
    tcp = ceiling.get("tcp_gbps")
    best = ceiling.get("statistic", "median")
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
