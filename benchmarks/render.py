"""What every benchmark's renderer shares: number formats, the Markdown table, the machine line, the
:class:`Section` a renderer returns, and the two pages a section is written on.

Each benchmark has one renderer, ``renderers/<name>.py``, with ``section(doc, ctx) -> Section``.
``report.py`` calls it for its part of ``RESULTS.md``; the benchmark calls the same function for
its own ``--markdown`` page (:func:`write_page`), so one recording reads the same in both places.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KIB, MIB = 1024, 1024**2

# What reproduces a result whose JSON does not record its own command (older recordings).
FALLBACK_COMMANDS = {
    "memcpy": "python benchmarks/memcpy.py --json benchmarks/results/memcpy.json "
    "--markdown benchmarks/results/memcpy.md",
    "rendezvous": "python benchmarks/rendezvous.py --repeats 5 --json benchmarks/results/rendezvous.json "
    "--markdown benchmarks/results/rendezvous.md",
    "all_to_all": "python benchmarks/all_to_all.py --json benchmarks/results/all_to_all.json",
    "overhead": "python benchmarks/overhead.py --json benchmarks/results/overhead.json",
    "bench_sweep": "python benchmarks/bench_sweep.py --json benchmarks/results/bench_sweep.json",
    "record_size": "python benchmarks/record_size.py --sizes 4096,32768,65536 --per-join 8,1 --stores "
    "--json benchmarks/results/record_size.json --markdown benchmarks/results/record_size.md",
}


# -- formats -------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", MIB), ("KiB", KIB)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n:g} B"


def ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


#: How every ratio on the page reads; the report says it once, at the top.
RATIOS_READ = (
    "Every ratio is the larger figure over the smaller, so never under 1x, with a word saying which "
    'way it goes: "sarcomm stops the others 3.0x sooner", "the baseline took 1.20x longer".'
)


def times(ours: float, theirs: float, less: str, more: str) -> str:
    """How ``ours`` compares with ``theirs``, both of a kind where less is less (seconds, CPU, bytes),
    as the larger over the smaller and the word for its direction: ``3.05x sooner`` (``less``) when
    ``ours`` is the smaller, ``1.20x later`` (``more``) when the larger, ``the same`` when equal."""
    if ours <= 0 or theirs <= 0:
        return "-"
    if ours == theirs:
        return "the same"
    return f"{ratio(theirs / ours)} {less}" if ours < theirs else f"{ratio(ours / theirs)} {more}"


def cpu_compared(what: str, ours: float, theirs: float) -> str:
    """``WHAT: 3.05x less CPU`` (or ``more CPU``): ``ours`` against ``theirs``, both CPU spent."""
    return f"{what}: {times(ours, theirs, 'less CPU', 'more CPU')}"


def faster(over: float) -> str:
    """A ratio of the other's time over ours (> 1: ours is faster) as ``2.00x faster`` or ``1.25x
    slower``: the larger over the smaller, in words."""
    return times(1.0, over, "faster", "slower")


def span(values: Iterable[float], fmt: Callable[[float], str] = ratio) -> str:
    """``low to high`` of ``values`` (one value alone when they are equal)."""
    ordered = sorted(values)
    if not ordered:
        return "-"
    low, high = fmt(ordered[0]), fmt(ordered[-1])
    return low if low == high else f"{low} to {high}"


def fmt_value(value: Any) -> str:
    """A cell of a table of recorded values: floats to 4 significant digits, None as ``-``."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def recorded(value: object) -> str:
    """A recorded figure as the JSON holds it (no rounding), None as ``-``."""
    return "-" if value is None else str(value)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one of l/r/c per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rules = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rules[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(doc: dict[str, Any]) -> str:
    """One line naming the machine and date, from any of the formats the scripts write: a
    ``machine`` dict (rendezvous, memcpy, bench_sweep), a ``host`` dict (all_to_all, overhead), or
    a host name (older bench_sweep)."""
    m = doc.get("machine")
    host = doc.get("host")
    parts = []
    if isinstance(m, dict):
        cpus = m.get("affinity_cpus") or m.get("nproc")
        parts.append(f"{cpus} CPUs" + (f" ({m['cpu_model']})" if m.get("cpu_model") else ""))
        if m.get("memory_gib"):
            parts.append(f"{m['memory_gib']} GiB")
        parts += [str(m[k]) for k in ("platform",) if m.get(k)]
        parts += [f"{label} {m[k]}" for k, label in (("python", "Python"), ("torch", "torch")) if m.get(k)]
        date = m.get("date") or doc.get("date")
        recorded = (m.get("loadavg_1m_at_start"), m.get("loadavg_1m_at_end"))
        loads = [float(x) for x in recorded if isinstance(x, int | float)]
        if loads:
            parts.append(f"load average {span(loads, lambda x: f'{x:g}')} during the run")
    elif isinstance(host, dict):
        parts.append(f"{host.get('cpus', '?')} CPUs")
        parts += [str(host[k]) for k in ("platform",) if host.get(k)]
        parts += [
            f"{label} {host[k]}" for k, label in (("python", "Python"), ("torch", "torch")) if host.get(k)
        ]
        date = doc.get("date")
    else:
        if host:
            parts.append(f"host {host} (this recording keeps no machine details)")
        date = doc.get("date")
    if date:
        parts.append(f"run {str(date)[:16].replace('T', ' ')} UTC")
    return ", ".join(parts) or "not recorded"


def their_headline(doc: dict[str, Any]) -> list[str]:
    """The script's own summary lines (a string or a list of them), if it wrote any."""
    value = doc.get("headline")
    if isinstance(value, str):
        return [value]
    return [str(x) for x in value] if isinstance(value, list) else []


def baseline_commit(doc: dict[str, Any]) -> str:
    """The short commit of the ``--baseline-ref`` a benchmark timed beside the current code."""
    return str(doc.get("baseline", {}).get("commit", "?"))[:10]


# -- what a renderer gets and returns ------------------------------------------------------------


@dataclass
class Context:
    results: Path
    plots: Path
    output: Path
    plt: Any  # matplotlib.pyplot, or None when matplotlib is not installed (or not wanted)
    ceiling: dict[str, float] = field(default_factory=dict)  # memcpy's GB/s: copy, tcp, pipe
    plot_notes: list[str] = field(default_factory=list)
    note: str = ""

    @classmethod
    def page(cls, path: Path) -> Context:
        """A benchmark's own page at ``path``: text only (the report draws the plots)."""
        return cls(path.parent, path.parent / "plots", path, None)

    def link(self, path: Path) -> str:
        return os.path.relpath(path, self.output.parent)

    def save(self, fig: Any, name: str) -> str:
        """Write ``fig`` as plots/NAME.png; the Markdown that shows it."""
        self.plots.mkdir(parents=True, exist_ok=True)
        path = self.plots / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        self.plt.close(fig)
        return f"![{name}]({self.link(path)})"

    def figure(self, ncols: int = 1, width: float = 6.5) -> tuple[Any, Any]:
        """A new figure of ``ncols`` axes side by side: (figure, axes)."""
        fig, axes = self.plt.subplots(1, ncols, figsize=(width * ncols, 4.2), squeeze=False)
        return fig, axes[0]


def machine_caption(ax: Any, machine: str) -> None:
    # Absolute times belong to one machine: the plot says which, as the tables do.
    # Laid out first, then hung below the figure's bottom edge: it can never cover the axis labels.
    ax.figure.tight_layout()
    ax.figure.text(0.01, 0.0, machine, fontsize=7, color="0.35", ha="left", va="top", wrap=True)


@dataclass
class Section:
    name: str
    title: str
    headline: list[str]
    body: str
    command: str
    machine: str
    plot: str = ""
    quick: bool = False
    #: The recordings whose figures the section shows (file stems in the results folder: their
    #: pages are linked as the details); empty: ``name`` alone.
    shown: list[str] = field(default_factory=list)
    #: Lines on the older recordings of the benchmark, kept as JSON and linked, not shown as current.
    older: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls, doc: dict[str, Any], name: str, title: str, headline: list[str], body: str, plot: str = ""
    ) -> Section:
        """A section for ``doc``: the command, machine and quick mark come from the document."""
        return cls(
            name, title, headline, body, command(doc, name), machine_line(doc), plot, bool(doc.get("quick"))
        )

    @property
    def machine_short(self) -> str:
        """CPUs and date only: the summary table's column (each section names the whole machine)."""
        parts = self.machine.split(", ")
        return ", ".join([parts[0], *(p for p in parts[1:] if p.startswith("run "))])

    def markdown(self, heading: str, details: str = "") -> list[str]:
        """The section's lines under a ``heading`` (``#``, ``##``), ``details`` after the body."""
        out = [f"{heading} {self.title}", ""]
        if self.quick:
            out += ["*Quick pass: fewer samples and sizes; a smoke test, not a recording.*", ""]
        out += [*(f"- {line}" for line in self.headline), ""]
        if self.plot:
            out += [self.plot, ""]
        out += [self.body, ""]
        if details:
            out += [details, ""]
        if self.older:
            out += [
                "Older runs, kept as recorded and not shown above:",
                "",
                *(f"- {o}" for o in self.older),
                "",
            ]
        return [*out, f"Machine: {self.machine}.", "", "Reproduce:", "", "```", self.command, "```", ""]


def command(doc: dict[str, Any], name: str) -> str:
    """What reproduces ``doc``: its own record, else the fallback for older recordings."""
    return str(doc.get("command") or FALLBACK_COMMANDS.get(name, f"python benchmarks/{name}.py"))


Renderer = Callable[[dict[str, Any], Context], Section]


# -- a benchmark recorded more than once -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Recording:
    """One recorded run of a benchmark: its file's stem in the results folder and its document
    (each recording is itself alone: compared and hashed by identity)."""

    name: str
    doc: dict[str, Any]

    @property
    def date(self) -> str:
        """When it ran (ISO 8601, UTC), "" when not recorded."""
        machine = self.doc.get("machine")
        date = machine.get("date") if isinstance(machine, dict) else None
        return str(date or self.doc.get("date") or "")

    @property
    def when(self) -> str:
        """Its date as the machine line writes it (``2026-11-26 06:26 UTC``)."""
        return f"{self.date[:16].replace('T', ' ')} UTC" if self.date else "date not recorded"


#: A benchmark's renderer for all its recordings (``NAME.json`` and ``NAME_LABEL.json``), newest first.
FamilyRenderer = Callable[[list[Recording], Context], Section]


def newest_per_part(
    recordings: Sequence[Recording], parts: Callable[[dict[str, Any]], Iterable[str]]
) -> dict[str, Recording]:
    """For each part of a benchmark (a phase, a measurement), the newest recording that has it, in
    the order the parts first appear (newest recording first)."""
    chosen: dict[str, Recording] = {}
    for recording in sorted(recordings, key=lambda r: r.date, reverse=True):
        for part in parts(recording.doc):
            chosen.setdefault(part, recording)
    return chosen


def older_runs(
    recordings: Sequence[Recording],
    chosen: dict[str, Recording],
    parts: Callable[[dict[str, Any]], Iterable[str]],
    ctx: Context,
    baseline: Callable[[dict[str, Any]], str] = lambda doc: "",
) -> list[str]:
    """One line per recording whose figures another, newer one replaced (in part or whole), with a
    link to its JSON: history, not the current figures."""
    lines = []
    for recording in sorted(recordings, key=lambda r: r.date, reverse=True):
        own = list(dict.fromkeys(parts(recording.doc)))
        replaced = [part for part in own if chosen.get(part) is not recording]
        if not replaced:
            continue
        path = ctx.results / f"{recording.name}.json"
        against = baseline(recording.doc)
        what = "all of it" if len(replaced) == len(own) else ", ".join(replaced)
        newer = ", ".join(dict.fromkeys(f"`{chosen[part].name}`" for part in replaced if part in chosen))
        lines.append(
            f"[`{path.name}`]({ctx.link(path)}), run {recording.when}"
            + (f" against {against}" if against else "")
            + f": {what} replaced by {newer}"
        )
    return lines


def page(section: Section) -> str:
    """A benchmark's own Markdown page: its section, under a title of its own."""
    return "\n".join(section.markdown("#"))


def write_page(doc: dict[str, Any], renderer: Renderer, path: Path | None) -> str:
    """Render ``doc`` with ``renderer`` as a page; write it to ``path`` where one is given."""
    text = page(renderer(doc, Context.page(path or Path("results") / "page.md")))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return text
