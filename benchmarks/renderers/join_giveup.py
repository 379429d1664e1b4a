"""A big world that does not form in time (benchmarks/join_giveup.py): the loop time of its Joins
giving up, this tree beside a baseline."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table


def _seconds(value: Any, run: dict[str, Any]) -> str:
    if value is None:
        return f"over {run['over_budget_s']:g} s (cut off)"
    return f"{value:.3f} s"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    runs = doc["runs"]
    rows = [(str(r["size"]), r["code"], _seconds(r["join_s"], r), _seconds(r["giveup_s"], r)) for r in runs]
    headline = []
    current = {r["size"]: r for r in runs if r["code"] == "current"}
    for r in runs:
        mine = current.get(r["size"])
        if r["code"] == "current" or mine is None or mine["giveup_s"] is None:
            continue
        theirs = r["giveup_s"]
        ratio = f" ({theirs / mine['giveup_s']:.0f}x longer)" if theirs else ""
        headline.append(
            f"{r['size']} Joins giving up: {mine['giveup_s']:.3f} s of the coordinator's loop; "
            f"{r['code']}: {_seconds(theirs, r)}{ratio}"
        )
    body = md_table(["Joins", "code", "join (loop s)", "all give up (loop s)"], rows, "rlrr")
    body += (
        "\n\nEach Join of the burst names the ranks its world still lacks and withdraws its members, "
        "as the coordinator does when the join timeout passes; the loop runs nothing else meanwhile."
    )
    return Section.of(doc, "join_giveup", doc["title"], headline, body)
