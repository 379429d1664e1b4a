"""Any benchmark's JSON without a renderer of its own (written elsewhere, or newer)."""

from __future__ import annotations

from typing import Any

from render import (
    Context,
    Section,
    fmt_value,
    machine_caption,
    machine_line,
    md_table,
)


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


def section(name: str, doc: dict[str, Any], ctx: Context) -> Section:
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
        body = md_table(columns, [[fmt_value(r.get(c)) for c in columns] for r in rows], "l" * len(columns))
        numeric = [
            c
            for c in columns
            if all(isinstance(r.get(c), int | float) and not isinstance(r.get(c), bool) for r in rows)
        ]
        if ctx.plt is not None and len(rows) > 1 and len(numeric) >= 2:
            fig, (ax,) = ctx.figure()
            x = numeric[0]
            for y in numeric[1:6]:
                ax.plot([r[x] for r in rows], [r[y] for r in rows], "o-", label=y, markersize=4)
            ax.set(xlabel=x)
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            machine_caption(ax, machine_line(doc))
            plot = ctx.save(fig, name)
    title = str(doc.get("title") or name.replace("_", " ").capitalize())
    return Section.of(doc, name, title, headline, body, plot)
