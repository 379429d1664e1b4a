"""benchmarks/report.py and the benchmarks' renderers: RESULTS.md is what the recorded JSON renders,
``--check`` catches a page that drifted from its JSON, and a benchmark's own page is drawn by the
same renderer as its part of RESULTS.md.

The benchmarks are scripts that import their neighbours by bare name, so they are loaded here with
benchmarks/ on the path, as ``python benchmarks/report.py`` runs them.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def report() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _results_copy(tmp_path: Path) -> Path:
    """The recorded JSON and notes, with RESULTS.md beside them, in ``tmp_path``."""
    results = tmp_path / "results"
    shutil.copytree(BENCHMARKS / "results", results, ignore=shutil.ignore_patterns("plots"))
    shutil.copy(BENCHMARKS / "RESULTS.md", tmp_path / "RESULTS.md")
    return results


def test_results_md_is_what_the_recorded_json_renders(
    report: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = report.main(["--check"])
    out = capsys.readouterr()
    assert code == 0, f"benchmarks/RESULTS.md is stale; rebuild it with python benchmarks/report.py:\n{out}"


def test_check_fails_with_the_difference_when_a_figure_changed(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _results_copy(tmp_path)
    memcpy = json.loads((results / "memcpy.json").read_text())
    memcpy["copy"][0]["gbps"] = 99.99
    (results / "memcpy.json").write_text(json.dumps(memcpy))

    code = report.main(["--check", "--results-dir", str(results), "--output", str(tmp_path / "RESULTS.md")])

    out = capsys.readouterr()
    assert code == 1
    assert "+| copy, 1 thread | 1 MiB | 99.99 |" in out.out
    assert out.err.strip().endswith(
        "is not what the JSON renders; rebuild it with `python benchmarks/report.py`"
    )


def test_check_names_an_output_it_cannot_read(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none" / "RESULTS.md"
    code = report.main(["--check", "--output", str(missing)])
    assert code == 1
    assert capsys.readouterr().err.startswith(f"report.py --check: cannot read {missing}: ")


def test_a_benchmarks_page_is_its_section_of_results_md(report: ModuleType, tmp_path: Path) -> None:
    render = importlib.import_module("render")
    doc = json.loads((BENCHMARKS / "results" / "state_writes.json").read_text())
    renderer = report.RENDERERS["state_writes"]
    page = render.write_page(doc, renderer, tmp_path / "state_writes.md")

    assert (tmp_path / "state_writes.md").read_text() == page
    assert page.startswith("# State writes: immediate against write-behind\n\n- 4096 members leaving")
    section = renderer(doc, render.Context.page(tmp_path / "state_writes.md"))
    summary = (BENCHMARKS / "RESULTS.md").read_text()
    for part in (section.body, *section.headline, section.command, f"Machine: {section.machine}."):
        assert part in page
        assert part in summary


def _beat(code: str, failed: int, store: str = "etcd") -> dict[str, Any]:
    """A made-up heartbeat row of big_job.py (the fields its renderer reads)."""
    beat: dict[str, Any] = {"phase": "beat", "store": store, "code": code, "ranks": 4096}
    beat |= {"offered_reports_per_s": 2048, "processed_reports_per_s": 2040}
    beat |= {"coordinator_cpu_us_per_report": 31.0, "core_share_at_offered": 0.06, "rss_peak_mib": 120}
    beat |= {"members_failed_in_window": failed, "probe_ack_p50_ms": 1, "probe_ack_p99_ms": 4}
    beat |= {"probe_ack_max_ms": 9, "endpoint_s": {"metrics": 0.1, "sd": 0.2, "jobs": 0.3}}
    beat |= {"failure_fanout_s": 0.4, "failure_streams_told": 511, "failure_streams": 512}
    return beat


def test_big_job_renders_its_phases(report: ModuleType, tmp_path: Path) -> None:
    """big_job's renderer on a made-up run: a figure the run did not get (None) shows as "-"."""
    form = {"store": "sqlite", "ranks": 4096, "code": "this", "coordinator_view_s": 1.2}
    form |= {"last_answer_s": None, "coordinator_cpu_s": 0.9, "rounds_view_s": [1.2, 1.3]}
    runs = [{"phase": "agents", **form}, _beat("this", 0)]
    doc = {"benchmark": "big_job", "command": "python benchmarks/big_job.py", "runs": runs}

    section = report.OPTIONAL_RENDERERS["big_job"](
        doc, importlib.import_module("render").Context.page(tmp_path)
    )

    assert "| agents | sqlite | 4096 | this | 1.2 | - | 0.9 | [1.2, 1.3] |" in section.body
    assert (
        "| etcd | this | 4096 | 2048 | 2040 | 31.0 | 0.06 | 120 | 0 | 1 / 4 / 9 | 0.1 / 0.2 / 0.3 "
        "| 0.4 (511 of 512) |" in section.body
    )


def test_a_benchmark_recorded_twice_shows_its_newest_run_and_links_the_older(
    report: ModuleType, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for name, day, failed, baseline in (("old", "01", 22184, 30768), ("new", "02", 0, 20944)):
        runs = [_beat("current", failed, "sqlite"), _beat("baseline abc1234", baseline, "sqlite")]
        doc = {
            "benchmark": f"big_job_{name}",
            "machine": {"date": f"2026-11-{day}T06:26:20+00:00"},
            "runs": runs,
        }
        (results / f"big_job_{name}.json").write_text(json.dumps(doc))
    render = importlib.import_module("render")

    text = report.build(render.Context(results, results / "plots", tmp_path / "RESULTS.md", None))

    assert text.count("\n## One head node for a big job\n") == 1
    assert "members wrongly failed: 0 (the baseline: 20944)" in text
    assert "22184" not in text  # the older run's figures are history, not the current code's
    assert (
        "- [`big_job_old.json`](results/big_job_old.json), run 2026-11-01 06:26 UTC against abc1234: all "
        "of it replaced by `big_job_new`"
    ) in text


def _heartbeat(shape: str, store: str, cpu: float, streams: int) -> dict[str, Any]:
    """A made-up summary row of heartbeat_load.py (the fields its renderer reads)."""
    row: dict[str, Any] = {"shape": shape, "store": store, "streams": streams, "members": 4096}
    row |= {"members_per_stream": 4096 // streams, "coordinator_cpu_percent": cpu, "rss_peak_mib": 99.0}
    row |= {"probe_ack_p99_ms": 1.5, "probe_ack_max_ms": 9.0, "members_failed": 0}
    return row | {"etcd_cpu_percent": 4.0 if store == "etcd" else 0.0}


def test_heartbeat_load_is_one_section_with_each_part_from_its_newest_run(
    report: ModuleType, tmp_path: Path
) -> None:
    """The etcd store beside SQLite (heartbeat_load_etcd.json) is a part of the heartbeat-load
    section, not a section of its own; a newer run of the shapes replaces the older one's."""
    results = tmp_path / "results"
    results.mkdir()
    batched, single = _heartbeat("batched", "sqlite", 6.0, 512), _heartbeat("single", "sqlite", 24.0, 4096)
    runs = {
        "heartbeat_load_old": ("01", [_heartbeat("batched", "sqlite", 60.0, 512), single]),
        "heartbeat_load": ("02", [batched, single]),
        "heartbeat_load_etcd": ("03", [batched, _heartbeat("batched", "etcd", 7.5, 512)]),
    }
    for name, (day, summary) in runs.items():
        doc = {"benchmark": "heartbeat_load", "machine": {"date": f"2026-11-{day}T06:00:00+00:00"}}
        (results / f"{name}.json").write_text(json.dumps({**doc, "summary": summary}))
    render = importlib.import_module("render")

    text = report.build(render.Context(results, results / "plots", tmp_path / "RESULTS.md", None))

    assert re.findall(r"^## Heartbeat load.*$", text, re.MULTILINE) == [
        "## Heartbeat load on the coordinator"
    ]
    assert "coordinator CPU 7.5% against 6.0% (on etcd 1.25x more" in text
    assert (
        "cost the coordinator 6% of a core against 24% for 4096 one-member streams (batched 4.00x less)"
        in text
    )
    assert (
        "**Stores** (batched on the etcd store against the baseline SQLite, in one run): run 2026-11-03"
        in text
    )
    assert "60%" not in text  # the older run's figures are history
    assert (
        "[`heartbeat_load_old.json`](results/heartbeat_load_old.json), run 2026-11-01 06:00 UTC: all" in text
    )


def test_each_benchmark_has_one_section_and_each_summary_link_lands_on_it(report: ModuleType) -> None:
    text = (BENCHMARKS / "RESULTS.md").read_text()
    titles = re.findall(r"^## (.+)$", text, re.MULTILINE)
    links = re.findall(r"^\| \[[^\]]+\]\(#([^)]+)\)", text, re.MULTILINE)

    assert len(titles) == len(set(titles))
    assert links == [report._anchor(title) for title in titles]
    assert report._anchors(["A b", "A b", "c"]) == ["a-b", "a-b-1", "c"]


def test_every_ratio_is_the_larger_over_the_smaller_in_words() -> None:
    render = importlib.import_module("render")

    assert render.times(1.0, 3.0, "sooner", "later") == "3.00x sooner"
    assert render.times(3.0, 1.0, "sooner", "later") == "3.00x later"
    assert render.faster(0.47) == "2.13x slower"  # gather_grads' 8 x 1M: 0.47 was "0.47x"
    text = (BENCHMARKS / "RESULTS.md").read_text()
    assert not re.search(r"\b0\.\d+x\b", text), "a ratio under 1x: write it the other way round, in words"
    assert "None" not in text
