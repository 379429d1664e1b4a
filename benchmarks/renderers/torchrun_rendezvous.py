"""torchrun's rendezvous (benchmarks/torchrun_rendezvous.py): sarcomm's handler against c10d, in
world formation, node loss and import cost."""

from __future__ import annotations

import statistics
from typing import Any

from render import Context, Section, md_table

TITLE = "torchrun's rendezvous: sarcomm against c10d"
#: Seconds a node-loss round may take to stop the workers and train again (--loss-deadline).
LOSS_DEADLINE_S = 90.0


def _seconds(value: float | None, bound: float) -> str:
    return f"not within {bound:g} s" if value is None else f"{value:.2f} s"


def _deadline(doc: dict[str, Any]) -> float:
    return float(doc.get("settings", {}).get("loss_deadline_s") or LOSS_DEADLINE_S)


def headlines(doc: dict[str, Any]) -> list[str]:
    """The summary lines: formation where both formed and at the largest size, then node loss."""
    lines = []
    rows = doc.get("formation", [])
    both = [r for r in rows if "c10d_s" in r]
    if both:
        r = both[-1]
        lines.append(
            f"{r['nodes']} nodes form a world in {r['sarcomm_s']:.2f} s on sarcomm against "
            f"{r['c10d_s']:.2f} s on c10d ({r['c10d_s'] / r['sarcomm_s']:.0f}x)"
        )
    if rows and rows[-1] not in both:
        r = rows[-1]
        lines.append(f"{r['nodes']} nodes: sarcomm {r['sarcomm_s']:.2f} s; c10d {r.get('c10d', '-')}")
    losses = doc.get("node-loss", [])
    for row in losses:
        if row["backend"] != "sarcomm":
            continue
        c10d = next((x for x in losses if x["backend"] == "c10d" and x["signal"] == row["signal"]), None)
        other = f"; c10d {_seconds(c10d['training_s'], _deadline(doc))}" if c10d is not None else ""
        lines.append(
            f"node lost ({row['signal']}): the survivors train again after "
            f"{_seconds(row['training_s'], _deadline(doc))} on sarcomm{other}"
        )
    return lines


def section(doc: dict[str, Any], ctx: Context) -> Section:
    parts = []
    if "formation" in doc:
        formation: list[tuple[object, ...]] = []
        for row in doc["formation"]:
            formed = statistics.median(f for f in row["coordinator_formed_s"] if f is not None)
            formation.append(
                (
                    row["nodes"],
                    f"{row['sarcomm_s']:.2f} s",
                    f"{formed:.2f} s",
                    f"{row['c10d_s']:.2f} s" if "c10d_s" in row else row.get("c10d", "-"),
                    f"{row['c10d_s'] / row['sarcomm_s']:.1f}x" if "c10d_s" in row else "-",
                )
            )
        header = ["nodes", "sarcomm: every handler returned", "sarcomm: coordinator formed the world"]
        parts.append(md_table([*header, "c10d", "c10d / sarcomm"], formation, "rrrrr"))
    if "node-loss" in doc:
        deadline = _deadline(doc)
        losses = [
            (
                row["signal"],
                row["backend"],
                _seconds(row["stopped_s"], deadline),
                _seconds(row["training_s"], deadline),
                sorted({c for r in row["rounds"] for c in r["torch_restarts"]}) or "-",
            )
            for row in doc["node-loss"]
        ]
        header = ["signal", "backend", "workers stopped", "training again", "torch restarts spent"]
        parts.append(md_table(header, losses, "llrrl"))
    if "import" in doc:
        imp = doc["import"]
        parts.append(
            f"Import: the entry point adds {imp['entry_point_ms']:.1f} ms to `import "
            f"torch.distributed.elastic.rendezvous` (whose own part after torch took "
            f"{imp['rendezvous_import_rest_ms']:.0f} ms); the handler module, loaded only when the "
            f"backend is used, {imp['handler_module_ms']:.0f} ms."
        )
    body = "\n\n".join(parts)
    return Section.of(doc, "torchrun_rendezvous", str(doc.get("title") or TITLE), headlines(doc), body)
