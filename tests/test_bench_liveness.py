"""The liveness benchmarks' own arithmetic (issue 28): burst_lag.py's p99 from the coordinator's
loop-lag histogram, detection.py's stall line on the coordinator's clock, and the renderers of
steady_state.py, detection.py and burst_lag.py on made-up rows (a coordinator that offered no
policy is said so; a missed bound reads "missed").

The benchmarks are scripts that import their neighbours by bare name, so they are loaded with
benchmarks/ on the path, as ``python benchmarks/NAME.py`` runs them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        names = ("burst_lag", "detection", "render", "renderers.steady_state", "renderers.detection")
        yield {name: importlib.import_module(name) for name in (*names, "renderers.burst_lag")}
    finally:
        sys.path.remove(str(BENCHMARKS))


def _histogram(counts: dict[str, int]) -> str:
    return "".join(
        f'sar_coordinator_event_loop_lag_seconds_bucket{{le="{le}"}} {n}.0\n' for le, n in counts.items()
    )


def test_the_lag_p99_is_the_bucket_of_the_samples_between_two_scrapes(bench: dict[str, ModuleType]) -> None:
    burst_lag = bench["burst_lag"]
    before = burst_lag.lag_buckets(
        _histogram({"0.01": 100, "0.1": 100, "0.25": 100, "1.0": 100, "+Inf": 100})
    )
    # 200 samples since: 197 within 10 ms, 3 between 0.25 and 1 s (so the 99th is one of those).
    after = burst_lag.lag_buckets(_histogram({"0.01": 297, "0.1": 297, "0.25": 297, "1.0": 300, "+Inf": 300}))

    summary = burst_lag.lag_summary(before, after, 0.25)

    assert summary == {"lag_p99_s": 1.0, "lag_samples": 200, "lag_over_target": 3, "lag_max_s": 1.0}
    one_late = burst_lag.lag_buckets(
        _histogram({"0.01": 298, "0.1": 299, "0.25": 299, "1.0": 300, "+Inf": 300})
    )
    assert burst_lag.lag_summary(before, one_late, 0.25)["lag_p99_s"] == 0.01
    assert burst_lag.lag_summary(after, after, 0.25)["lag_samples"] == 0


def test_the_stall_is_timed_by_the_coordinators_log_line_naming_the_victim(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    detection = bench["detection"]
    log = tmp_path / "coordinator.log"
    stall = (
        "3 rank(s) have waited 3.1 s in collective #9 (all_reduce) for rank(s) 8, which have not entered it"
    )
    log.write_text(
        f"2026-11-28 10:00:00,500 WARNING sweep: job 'j': {stall} (on host(s) victim0-a0)\n"
        f"2026-11-28 10:00:05,250 WARNING sweep: job 'j': {stall} (on host(s) p0-a3)\n"
        f"2026-11-28 10:00:06,750 WARNING sweep: job 'j': {stall} (on host(s) victim0-a0)\n"
    )
    fault = datetime(2026, 11, 28, 10, 0, 4).timestamp()

    at, line = detection.stall_line(log, fault)

    assert at - fault == pytest.approx(2.75)
    assert line.endswith("(on host(s) victim0-a0)")
    assert detection.stall_line(log, fault + 3) is None


def _steady(protocol: str, cpu: float, switched: int) -> dict[str, Any]:
    row: dict[str, Any] = {"agents": 4096, "ranks_per_agent": 8, "ranks": 32768, "protocol": protocol}
    row |= {"connections": 4096, "streams_by_exception": switched, "window_s": 32.0}
    row |= {"coordinator_cpu_fraction": cpu, "coordinator_user_fraction": cpu / 2}
    row |= {"coordinator_system_fraction": cpu / 2, "members_wrongly_failed": 0, "rss_mib": 400.0}
    row |= {"offered_requests_per_s": 256.0, "load_generator_cpu_fraction": 0.1}
    return row


def test_steady_state_compares_the_protocols_and_says_when_no_policy_was_offered(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    steady_state = bench["renderers.steady_state"]
    ctx = bench["render"].Context.page(tmp_path)
    rows = [_steady("exception", 0.05, 4096), _steady("per-second", 0.6, 0), _steady("grpc-floor", 0.5, 0)]
    section = steady_state.section({"rows": rows, "command": "x"}, ctx)
    fallback = steady_state.section({**_steady("exception", 0.6, 0), "command": "x"}, ctx)

    assert section.headline == [
        "32768 ranks by exception: 5.0% of a core (target 10%: met), 0 wrongly failed, 400 MiB, 4096 "
        "connections; 12.0x less CPU than per-second; 10.0x less CPU than grpc-floor"
    ]
    assert "| 32768 | exception | 4096 | 4096 | 32 s | 5.0% |" in section.body
    assert fallback.headline[0].startswith(
        "32768 ranks by exception (no policy offered: they reported per second): 60.0% of a core "
        "(target 10%: missed)"
    )


def test_detection_and_burst_lag_rows_read_against_their_bounds(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    burst_lag, detection = bench["renderers.burst_lag"], bench["renderers.detection"]
    ctx = bench["render"].Context.page(tmp_path)
    fault: dict[str, Any] = {"agents": 4096, "ranks": 32768, "protocol": "exception", "lease_s": 16.0}
    fault |= {"streams_by_exception": 4096, "watch_s": None, "fanout_s": None, "streams_told": 0}
    fault |= {"streams": 4095, "deadline_s": 15.0, "verdict": "connection lost"}
    rows = [
        {**fault, "fault": "kill", "target_s": 1.5, "detected_s": 1.2, "met": True},
        {**fault, "fault": "stop", "target_s": 5.0, "detected_s": None, "met": False},
    ]
    burst: dict[str, Any] = {"burst": "start", "agents": 4096, "ranks": 32768, "protocol": "exception"}
    burst |= {"streams_by_exception": 4096, "done": 4096, "took_s": 2.5, "deadline_s": 60.0}
    burst |= {"lag_p99_s": 0.5, "lag_samples": 40, "lag_over_target": 3, "lag_max_s": 1.0}
    burst |= {"coordinator_cpu_s": 2.0, "serving_s": None, "met": False}

    detected = detection.section({"rows": rows, "command": "x"}, ctx)
    bursts = burst_lag.section({"rows": [burst], "command": "x"}, ctx)

    assert detected.headline == [
        "agent process SIGKILLed: 1.200 s (target 1.5 s: met), 32768 ranks",
        "agent process SIGSTOPped: not within 15 s (target 5 s: missed), 32768 ranks",
    ]
    assert bursts.headline == [
        "the job's start: every agent joins and opens its stream, 32768 ranks: loop lag p99 <= 0.5 s "
        "(target 0.25 s: missed); 4096 of 4096 agents in 2.50 s"
    ]
