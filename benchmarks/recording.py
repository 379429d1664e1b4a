"""How a benchmark records its results: the machine it ran on, described the same way in every
script's JSON (``report.py`` reads it), and the files it writes: the JSON and the page its renderer
draws from it.

Absolute figures belong to a machine: each result carries its CPUs, memory, platform, versions,
date and the load average, since other work on a small machine skews every figure.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from render import Renderer, write_page


def describe(*packages: str, load_at: Literal["start", "end"] = "start", **extra: Any) -> dict[str, Any]:
    """The machine, the versions of ``packages`` (installed distributions, read without importing
    them: torch takes seconds), the 1-minute load average labelled ``load_at``, and ``extra``."""
    described: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model() or platform.processor(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for package in packages:
        try:
            described[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            described[package] = None
    described["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    described[f"loadavg_1m_at_{load_at}"] = round(os.getloadavg()[0], 2)
    described.update(extra)
    return described


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def write_results(
    doc: dict[str, Any], renderer: Renderer, json_path: Path | None, markdown_path: Path | None
) -> None:
    """Write ``doc`` as JSON where asked; print its page, drawn by the benchmark's ``renderer`` (the
    one ``report.py`` calls), and write it as Markdown where asked."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(write_page(doc, renderer, markdown_path))


def write_rows(
    script: str,
    argv: Sequence[str] | None,
    title: str,
    headline: list[str],
    rows: Sequence[Any],
    renderer: Renderer,
    json_path: Path | None,
    markdown_path: Path | None,
) -> None:
    """Write a benchmark's ``rows`` (with its ``headline``, the command that ran ``script`` with
    ``argv``, and the machine) as :func:`write_results` does; its name is the JSON file's."""
    name = Path(script).stem
    doc: dict[str, Any] = {
        "benchmark": json_path.stem if json_path else name,
        "title": title,
        "command": " ".join(
            ["python", f"benchmarks/{name}.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "headline": headline,
        "rows": list(rows),
        "machine": describe("grpcio", "protobuf", load_at="end"),
    }
    write_results(doc, renderer, json_path, markdown_path)
