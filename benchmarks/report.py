"""Build ``benchmarks/RESULTS.md`` and its plots from the JSON in ``benchmarks/results/``.

::

    python benchmarks/report.py                          # results/ -> RESULTS.md, results/plots/
    python benchmarks/report.py --results-dir /tmp/quick # /tmp/quick -> /tmp/quick/RESULTS.md
    python benchmarks/report.py --check                  # is RESULTS.md what the JSON renders?

For each benchmark: the headline ratios against its baseline (ratios travel between machines,
absolute times do not), the table, the command that reproduces it, the machine it ran on, and a
plot (matplotlib, Agg backend; ``pip install -e '.[bench]'``). Each benchmark's part is drawn by
its one renderer, ``renderers/<name>.py`` (the benchmark's own ``--markdown`` page calls it too);
this script loads the JSON, calls the renderers in the order of :data:`RENDERERS` and assembles
the page. A benchmark recorded more than once (``NAME.json`` and ``NAME_LABEL.json``, each run for
one purpose) gets one section from its renderer in :data:`FAMILY_RENDERERS`: the newest figures of
each of its parts, and its older runs linked as JSON, not shown as current. A benchmark without
JSON, or with JSON this script cannot read (an older format), gets a line saying so instead of a
section, and without matplotlib the report is written without plots: a report with a gap is more
use than none. ``SARCOMM_REPORT_DEBUG=1`` prints the traceback behind such a line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import run_all
from render import RATIOS_READ, Context, FamilyRenderer, Recording, Renderer, Section, md_table
from renderers import (
    agent_cpu,
    all_to_all,
    before_after,
    bench_sweep,
    big_job,
    burst_lag,
    bursts,
    detection,
    etcd_history,
    failover,
    failure_detection,
    gather_grads,
    generic,
    heartbeat_load,
    memcpy,
    overhead,
    record_size,
    rendezvous,
    soak,
    state_writes,
    steady_state,
    sweep_cost,
    torchrun_rendezvous,
    zerocode,
)

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results"
DEFAULT_OUTPUT = HERE / "RESULTS.md"

#: Known benchmarks, in the report's order; any other *.json in the folder follows them.
RENDERERS: dict[str, Renderer] = {
    "memcpy": memcpy.section,
    "rendezvous": rendezvous.section,
    "all_to_all": all_to_all.section,
    "overhead": overhead.section,
    "bench_sweep": bench_sweep.section,
    "state_writes": state_writes.section,
}
#: Written by other scripts; shown when their JSON is there, with no line when it is not.
OPTIONAL_RENDERERS: dict[str, Renderer] = {
    "failure_detection": failure_detection.section,
    "heartbeat_load": heartbeat_load.section,
    "failover": failover.section,
    "soak": soak.section,
    "torchrun_rendezvous": torchrun_rendezvous.section,
    "gather_grads": gather_grads.section,
    "record_size": record_size.section,
    "big_job": big_job.section,
    "before_after": before_after.section,
    "bursts": bursts.section,
    "etcd_history": etcd_history.section,
    "zerocode": zerocode.section,
    "agent_cpu": agent_cpu.section,
    "steady_state": steady_state.section,
    "detection": detection.section,
    "burst_lag": burst_lag.section,
    "sweep_cost": sweep_cost.section,
}
OPTIONAL = tuple(OPTIONAL_RENDERERS)
#: Benchmarks recorded more than once: one section for all their recordings (``NAME.json`` and
#: ``NAME_*.json``), drawn from the newest of each part.
FAMILY_RENDERERS: dict[str, FamilyRenderer] = {
    "big_job": big_job.family_section,
    "torchrun_rendezvous": torchrun_rendezvous.family_section,
    "heartbeat_load": heartbeat_load.family_section,
}
#: The lines that show a plot: ``--check`` compares the text without them (it draws nothing).
PLOT_LINE = re.compile(r"^!\[[^\]]*\]\([^)]*\)\n\n", re.MULTILINE)
"""The plots are left out of --check's comparison: drawing needs matplotlib, and the PNGs are not
text."""


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


def _family(name: str) -> Renderer | None:
    """The renderer of a benchmark recorded under another name (``big_job.py --json
    results/big_job_formation.json``): the benchmark's name, then ``_`` and a label."""
    for known, renderer in OPTIONAL_RENDERERS.items():
        if name.startswith(known + "_"):
            return renderer
    return None


def rerun(name: str) -> str:
    """How to (re)make ``name``'s JSON, for the benchmarks run_all.py runs; nothing for others."""
    return f"; run `benchmarks/run_all.sh --only {name}`" if name in run_all.NAMES else ""


def _family_of(name: str) -> str | None:
    """The benchmark of :data:`FAMILY_RENDERERS` that recorded ``name``, if any."""
    return next((f for f in FAMILY_RENDERERS if name == f or name.startswith(f + "_")), None)


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
    recorded = sorted(p.stem for p in ctx.results.glob("*.json") if not p.stem.startswith("."))
    members: dict[str, list[str]] = {}
    for stem in recorded:
        family = _family_of(stem)
        if family is not None:
            members.setdefault(family, []).append(stem)
    names = list(RENDERERS) + [n for n in OPTIONAL if n in recorded or n in members]
    names += [n for n in recorded if n not in names and _family_of(n) is None]
    sections: list[Section] = []
    gaps: list[str] = []
    for name in names:
        if name in members:
            section = _family_section(ctx, name, members[name], gaps)
            if section is not None:
                sections.append(section)
            continue
        path = ctx.results / f"{name}.json"
        doc, why = load(path)
        if doc is None:
            gaps.append(f"- **{name}**: {why}{rerun(name)}.")
            continue
        declared = doc.get("benchmark")
        renderer = RENDERERS.get(name) or OPTIONAL_RENDERERS.get(name) or _family(name)
        try:
            if declared not in (None, name) and not name.startswith(f"{declared}_"):
                raise ValueError(f"the file says it holds {declared!r}")
            section = renderer(doc, ctx) if renderer else generic.section(name, doc, ctx)
            if declared not in (None, name) and any(s.title == section.title for s in sections):
                section.title += f" ({name.removeprefix(str(declared) + '_')})"
        except Exception as exc:  # one unreadable result must not cost the whole report
            _unreadable(ctx, name, exc, gaps)
            continue
        sections.append(section)
    return render(ctx, sections, gaps)


def _family_section(ctx: Context, family: str, names: list[str], gaps: list[str]) -> Section | None:
    """The one section of a benchmark recorded as ``names``; None (and a gap) when none is readable."""
    recordings = []
    for name in names:
        doc, why = load(ctx.results / f"{name}.json")
        declared = None if doc is None else doc.get("benchmark")
        if doc is None:
            gaps.append(f"- **{name}**: {why}{rerun(name)}.")
        elif declared not in (None, name) and not name.startswith(f"{declared}_"):
            _unreadable(ctx, name, ValueError(f"the file says it holds {declared!r}"), gaps)
        else:
            recordings.append(Recording(name, doc))
    if not recordings:
        return None
    try:
        return FAMILY_RENDERERS[family](recordings, ctx)
    except Exception as exc:  # one unreadable result must not cost the whole report
        _unreadable(ctx, family, exc, gaps)
        return None


def _unreadable(ctx: Context, name: str, exc: Exception, gaps: list[str]) -> None:
    """Note in ``gaps`` that ``name``'s JSON is in a format no renderer reads."""
    if ctx.plt is not None:
        ctx.plt.close("all")  # a figure the failed section left open
    detail = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
    path = ctx.results / f"{name}.json"
    gaps.append(
        f"- **{name}**: `{ctx.link(path)}` is in a format this report does not read ({detail}){rerun(name)}."
    )
    if os.environ.get("SARCOMM_REPORT_DEBUG"):
        traceback.print_exc()


def render(ctx: Context, sections: list[Section], gaps: list[str]) -> str:
    source = ctx.link(ctx.results) if ctx.results != ctx.output.parent else str(ctx.results)
    out = [
        "# Benchmark results",
        "",
        f"Generated by `python benchmarks/report.py` from the JSON in `{source}/`. Rerun every "
        "benchmark and this report with `benchmarks/run_all.sh` (about 25 minutes on 2 cores; "
        "`--only NAME` for one, `--report-only` to rebuild this page). Ratios are the headline: they "
        "compare methods measured in the same run on the same machine. Absolute times belong to the "
        f"machine named with each result. {RATIOS_READ} Each benchmark has one section, with the "
        "newest figures of each of its parts; older runs are listed under it, linked to their JSON.",
        "",
    ]
    if ctx.note:
        out += [f"**{ctx.note}**", ""]
    anchors = _anchors([s.title for s in sections])
    if sections:
        out += [
            md_table(
                ["benchmark", "headline", "machine"],
                [
                    (
                        f"[{s.title}](#{anchor})",
                        s.headline[0] if s.headline else "-",
                        s.machine_short,
                    )
                    for s, anchor in zip(sections, anchors, strict=True)
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
        pages = [ctx.results / f"{name}.md" for name in s.shown or [s.name]]
        links = [f"[`{page.name}`]({ctx.link(page)})" for page in pages if page.exists()]
        link = f"Details and how to read them: {' and '.join(links)}." if links else ""
        out += s.markdown("##", link)
    return "\n".join(out)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _anchors(titles: Sequence[str]) -> list[str]:
    """The anchors of headings ``titles`` in order, as GitHub makes them: a repeated one gets
    ``-1``, ``-2``, ... so that each link lands on its own section."""
    seen: dict[str, int] = {}
    anchors = []
    for title in titles:
        anchor = _anchor(title)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.append(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a benchmark host
        import matplotlib.pyplot
    except ImportError:
        return None  # the report says so and goes on without plots
    return matplotlib.pyplot


def check(ctx: Context) -> int:
    """0 when ``ctx.output`` holds what the JSON renders (plots aside), else 1 and the difference."""
    wanted = build(ctx)
    try:
        found = PLOT_LINE.sub("", ctx.output.read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"report.py --check: cannot read {ctx.output}: {exc}", file=sys.stderr)
        return 1
    if found == wanted:
        print(f"{ctx.output} is what the JSON in {ctx.results} renders")
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(
            found.splitlines(keepends=True), wanted.splitlines(keepends=True), str(ctx.output), "rendered"
        )
    )
    print(
        f"{ctx.output} is not what the JSON renders; rebuild it with `python benchmarks/report.py`",
        file=sys.stderr,
    )
    return 1


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
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with the difference when --output is not what the JSON renders "
        "(plots aside: none is drawn)",
    )
    args = parser.parse_args(argv)
    results = args.results_dir.resolve()
    output = (
        args.output or (DEFAULT_OUTPUT if results == DEFAULT_RESULTS else results / "RESULTS.md")
    ).resolve()
    plots = (args.plots_dir or results / "plots").resolve()
    if args.check:
        return check(Context(results, plots, output, None, note=args.note or ""))
    plt = _pyplot()
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
