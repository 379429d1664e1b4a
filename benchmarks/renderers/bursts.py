"""Bursts of a big job (benchmarks/bursts.py): the loop time of thousands of calls changing one job
at once, this tree beside a baseline."""

from __future__ import annotations

from typing import Any, TypedDict, cast

from render import Context, Section, md_table, times

#: What each burst is, in the table.
KINDS = {
    "giveup": "a world not formed in time: every Join gives up",
    "finish": "every member leaves with 0",
    "fail": "one fails, then every member exits non-zero",
    "elastic": "an elastic world formed by every Join",
}


class BurstRun(TypedDict):
    """One burst: ``size`` calls of ``kind`` by ``code``, and the loop's seconds (None: cut off after
    ``cut_off_s``)."""

    kind: str
    size: int
    code: str
    seconds: float | None
    cut_off_s: float | None


def _seconds(run: BurstRun) -> str:
    if run["seconds"] is None:
        return f"over {run['cut_off_s']:g} s (cut off)"
    return f"{run['seconds']:.3f} s"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    runs = cast(list[BurstRun], doc["runs"])
    rows = [(KINDS.get(r["kind"], r["kind"]), str(r["size"]), r["code"], _seconds(r)) for r in runs]
    current = {(r["kind"], r["size"]): r for r in runs if r["code"] == "current"}
    headline = []
    for r in runs:
        mine = current.get((r["kind"], r["size"]))
        if (
            r["code"] == "current"
            or mine is None
            or mine["seconds"] is None
            or r["size"] != max(x["size"] for x in runs)
        ):
            continue
        ratio = (
            f" (the current code {times(mine['seconds'], r['seconds'], 'faster', 'slower')})"
            if r["seconds"]
            else ""
        )
        headline.append(
            f"{KINDS.get(r['kind'], r['kind'])}, {r['size']} members: {mine['seconds']:.3f} s of the "
            f"coordinator's loop; {r['code']}: {_seconds(r)}{ratio}"
        )
    body = md_table(["burst", "members", "code", "loop time"], rows, "lrlr")
    body += (
        "\n\nEach call of the burst does what the coordinator does for it on its event loop, which runs "
        "nothing else meanwhile (heartbeats and calls wait)."
    )
    return Section.of(doc, "bursts", doc["title"], headline, body)
