"""torchrun's rendezvous (benchmarks/torchrun_rendezvous.py): sarcomm's handler against c10d, in
world formation, node loss and import cost.

The parts' rows are typed here (:class:`FormationRow`, :class:`LossRow`, :class:`ImportCost`) and
``torchrun_rendezvous.py`` builds them under these types. The benchmark ran once whole and once for
formation alone; the report shows each part from the newest run that has it and links the other.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any, TypedDict, cast

from render import (
    Context,
    Recording,
    Section,
    command,
    machine_line,
    md_table,
    newest_per_part,
    older_runs,
    times,
)

TITLE = "torchrun's rendezvous: sarcomm against c10d"
#: Seconds a node-loss round may take to stop the workers and train again (--loss-deadline).
LOSS_DEADLINE_S = 90.0
#: The benchmark's parts, in its order.
PARTS = ("formation", "node-loss", "import")


class _C10dFormation(TypedDict, total=False):
    """c10d's time to form the world, or why it has none ("not within 60 s", "not run (...)")."""

    c10d_s: float
    c10d: str


class FormationRow(_C10dFormation):
    """N handlers forming a world: sarcomm's rounds, and c10d's one (or why it has none)."""

    nodes: int
    #: Per round: the median handler's time, and when the coordinator had formed the world.
    sarcomm_p50_s: list[float]
    coordinator_formed_s: list[float | None]
    #: The median round's time for every handler to return, and each round's.
    sarcomm_s: float
    sarcomm_rounds_s: list[float]


class LossRound(TypedDict):
    """One node lost: seconds from the signal to the others' workers stopped and training again."""

    stopped_s: float | None
    training_s: float | None
    torch_restarts: list[int]


class LossRow(TypedDict):
    """A node lost to ``signal`` under ``backend``: its rounds and their medians (None: one missed)."""

    signal: str
    backend: str
    rounds: list[LossRound]
    stopped_s: float | None
    training_s: float | None


class ImportCost(TypedDict):
    """What the plugin costs at import, in milliseconds."""

    entry_point_ms: float
    rendezvous_import_rest_ms: float
    handler_module_ms: float


def _formation(doc: dict[str, Any]) -> list[FormationRow]:
    return cast(list[FormationRow], doc.get("formation", []))


def _losses(doc: dict[str, Any]) -> list[LossRow]:
    return cast(list[LossRow], doc.get("node-loss", []))


def _parts(doc: dict[str, Any]) -> Iterable[str]:
    return [part for part in PARTS if part in doc]


def _seconds(value: float | None, bound: float) -> str:
    return f"not within {bound:g} s" if value is None else f"{value:.2f} s"


def _deadline(doc: dict[str, Any]) -> float:
    return float(doc.get("settings", {}).get("loss_deadline_s") or LOSS_DEADLINE_S)


def headlines(doc: dict[str, Any]) -> list[str]:
    """The summary lines: formation where both formed and at the largest size, then node loss."""
    lines = []
    rows = _formation(doc)
    both = [r for r in rows if "c10d_s" in r]
    if both:
        r = both[-1]
        lines.append(
            f"{r['nodes']} nodes form a world in {r['sarcomm_s']:.2f} s on sarcomm against "
            f"{r['c10d_s']:.2f} s on c10d: sarcomm is "
            f"{times(r['sarcomm_s'], r['c10d_s'], 'faster', 'slower')}"
        )
    if rows and rows[-1] not in both:
        r = rows[-1]
        lines.append(f"{r['nodes']} nodes: sarcomm {r['sarcomm_s']:.2f} s; c10d {r.get('c10d', '-')}")
    losses = _losses(doc)
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


def _body(doc: dict[str, Any], parts: Iterable[str]) -> list[str]:
    """The tables of ``doc``'s ``parts``."""
    out = []
    if "formation" in parts:
        formation: list[tuple[object, ...]] = []
        for row in _formation(doc):
            formed = statistics.median(f for f in row["coordinator_formed_s"] if f is not None)
            c10d = row.get("c10d_s")
            formation.append(
                (
                    row["nodes"],
                    f"{row['sarcomm_s']:.2f} s",
                    f"{formed:.2f} s",
                    f"{c10d:.2f} s" if c10d is not None else row.get("c10d", "-"),
                    times(row["sarcomm_s"], c10d, "faster", "slower") if c10d is not None else "-",
                )
            )
        header = ["nodes", "sarcomm: every handler returned", "sarcomm: coordinator formed the world"]
        out.append(md_table([*header, "c10d", "sarcomm against c10d"], formation, "rrrrr"))
    if "node-loss" in parts:
        deadline = _deadline(doc)
        losses = [
            (
                row["signal"],
                row["backend"],
                _seconds(row["stopped_s"], deadline),
                _seconds(row["training_s"], deadline),
                sorted({c for r in row["rounds"] for c in r["torch_restarts"]}) or "-",
            )
            for row in _losses(doc)
        ]
        header = ["signal", "backend", "workers stopped", "training again", "torch restarts spent"]
        out.append(md_table(header, losses, "llrrl"))
    if "import" in parts:
        imp = cast(ImportCost, doc["import"])
        out.append(
            f"Import: the entry point adds {imp['entry_point_ms']:.1f} ms to `import "
            f"torch.distributed.elastic.rendezvous` (whose own part after torch took "
            f"{imp['rendezvous_import_rest_ms']:.0f} ms); the handler module, loaded only when the "
            f"backend is used, {imp['handler_module_ms']:.0f} ms."
        )
    return out


def section(doc: dict[str, Any], ctx: Context) -> Section:
    """One recording alone (the benchmark's own page)."""
    return family_section([Recording("torchrun_rendezvous", doc)], ctx)


def family_section(recordings: list[Recording], ctx: Context) -> Section:
    """Every recording of the benchmark: each part from the newest one that has it."""
    chosen = newest_per_part(recordings, _parts)
    shown = list(dict.fromkeys(chosen.values()))
    lines: list[str] = []
    body: list[str] = []
    for recording in shown:
        parts = [part for part, r in chosen.items() if r is recording]
        lines += [
            line
            for line in headlines({k: v for k, v in recording.doc.items() if k not in PARTS or k in parts})
        ]
        if len(shown) > 1:
            body.append(
                f"**{', '.join(parts).capitalize()}**: run {recording.when} (`{recording.name}.json`)."
            )
        body += _body(recording.doc, parts)
    newest = shown[0]
    return Section(
        newest.name,
        str(newest.doc.get("title") or TITLE),
        lines,
        "\n\n".join(body),
        "\n".join(command(r.doc, r.name) for r in shown),
        machine_line(newest.doc),
        shown=[r.name for r in shown],
        older=older_runs(recordings, chosen, _parts, ctx),
    )
