"""Failure detection inside a big job (benchmarks/detection.py): each failure class of issue 28, from
the fault to the coordinator's verdict, and the verdict's fan-out to every agent stream.

The row the benchmark records is typed here (:class:`DetectionRow`); ``detection.py`` builds it
under this type.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, md_table

TITLE = "Failure detection inside a big job"
#: What each class is, in the table.
CLASSES = {
    "kill": "agent process SIGKILLed",
    "stop": "agent process SIGSTOPped",
    "silent": "a rank silent (its agent reports its growing age)",
    "stuck": "agent loop stuck (connection open, no lease renewal)",
    "stall": "ranks stuck in a collective: the Stall names the blocking ranks",
    "fanout": "the verdict reaching every agent stream",
}


class DetectionRow(TypedDict):
    """One failure class in a job of ``agents`` x ``ranks_per_agent`` ranks."""

    #: One of :data:`CLASSES`.
    fault: str
    agents: int
    ranks: int
    protocol: str
    #: Streams that reported by exception (0: the coordinator offered no policy).
    streams_by_exception: int
    lease_s: float | None
    #: The bound the issue sets for this class, s.
    target_s: float
    #: The fault to the verdict (MEMBER_FAILED's time, or the stall's log line), on the
    #: coordinator's clock; None: not within ``deadline_s``.
    detected_s: float | None
    #: The fault to the MEMBER_FAILED event arriving on this script's Watch stream.
    watch_s: float | None
    #: The verdict to the event arriving at the last of the job's other agent streams.
    fanout_s: float | None
    streams_told: int
    streams: int
    deadline_s: float
    #: The verdict's words (the event's reason, or the stall line).
    verdict: str
    met: bool | None


def _s(value: float | None, deadline: float) -> str:
    return f"{value:.3f} s" if value is not None else f"not within {deadline:g} s"


def headline(rows: list[DetectionRow]) -> list[str]:
    """One line per class: the time against its bound."""
    lines = []
    for r in rows:
        verdict = "met" if r["met"] else "missed"
        lines.append(
            f"{CLASSES.get(r['fault'], r['fault'])}: {_s(r['detected_s'], r['deadline_s'])} "
            f"(target {r['target_s']:g} s: {verdict}), {r['ranks']} ranks"
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[DetectionRow], doc["rows"])
    table = md_table(
        ["fault", "ranks", "by exception", "lease", "detected", "Watch told", "fan-out", "told",
         "target", "verdict"],
        [
            (
                CLASSES.get(r["fault"], r["fault"]), str(r["ranks"]), str(r["streams_by_exception"]),
                f"{r['lease_s']:g} s" if r["lease_s"] else "-", _s(r["detected_s"], r["deadline_s"]),
                f"{r['watch_s']:.3f} s" if r["watch_s"] is not None else "-",
                f"{r['fanout_s']:.3f} s" if r["fanout_s"] is not None else "-",
                f"{r['streams_told']} / {r['streams']}", f"{r['target_s']:g} s",
                r["verdict"][:120].replace("|", "/"),
            )
            for r in rows
        ],
        "lrrrrrrrrl",
    )  # fmt: skip
    body = table + (
        "\n\nEach class in a fresh job of simulated agents (one connection each, reporting by exception "
        "when the coordinator offers it), the victim an agent in a process of its own. Detected: the "
        "fault to the coordinator's verdict on its own clock (MEMBER_FAILED's time; for the stall, its "
        "log line naming the blocking ranks); fan-out: that verdict to the event on the last agent stream."
    )
    return Section.of(doc, "detection", TITLE, headline(rows), body)
