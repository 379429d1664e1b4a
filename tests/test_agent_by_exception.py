"""``sar-worker`` reporting by exception (issue 28) against a real coordinator: one agent, two real
ranks (tests/scripts/exception_rank.py), heartbeat interval 0.25 s x 3 misses, stall threshold 2 s
(so a rank inside one collective for 1 s is reported quiet).

The stream's behaviour in detail is tests/test_heartbeat_by_exception.py's (fast tier); here the
whole chain once: the agent takes the offer and sends no member reports while its ranks run, a
rank stuck in a collective reaches the coordinator, and a stopped rank is failed within about the
liveness timeout.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import stays_false, wait_for
from tests.test_agent_e2e import SCRIPTS, Agents, job_state

pytestmark = pytest.mark.integration

RANK_SCRIPT = str(SCRIPTS / "exception_rank.py")
INTERVAL, MISSES, STALL = 0.25, 3, 2.0


def metric(coord: CoordinatorProcess, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    with urllib.request.urlopen(f"{coord.http_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def member(coord: CoordinatorProcess, rank: int) -> dict[str, object]:
    members = job_state(coord, "exc")["members"]
    assert isinstance(members, list)
    return next(m for m in members if m["rank"] == rank)


def quiet_in(view: dict[str, object], op: str) -> bool:
    progress = view["progress"]
    assert isinstance(progress, dict)
    return bool(progress["op"] == op and progress["in_collective"])


@pytest.fixture
def agents(start_coordinator: StartCoordinator) -> Iterator[Agents]:
    coord = start_coordinator(
        "--heartbeat-interval", str(INTERVAL), "--heartbeat-misses", str(MISSES),
        "--stall-threshold", str(STALL), "--report-policy", "exception",
    )  # fmt: skip
    started = Agents(coord)
    yield started
    started.kill()


def test_an_agent_by_exception_is_quiet_while_ranks_run_and_reports_a_stuck_and_a_stopped_rank(
    agents: Agents, tmp_path: Path
) -> None:
    coord = agents.coord
    command = [sys.executable, RANK_SCRIPT, str(tmp_path)]
    agent = agents.start("a", "exc", "--world-size", "2", "--nproc-per-node", "2", command=command)
    wait_for(lambda: all((tmp_path / f"rank{r}.started").exists() for r in (0, 1)), 60, what="both ranks")
    wait_for(
        lambda: metric(coord, "sar_coordinator_heartbeat_streams", protocol="exception") == 1,
        20,
        what="the agent's stream reporting by exception",
    )
    # Both ranks busy and fresh: the agent sends no member reports (per interval: 2 x 4 a second).
    beats = metric(coord, "sar_coordinator_heartbeats_total")
    stays_false(lambda: agent.poll() is not None, 2.0, what="the agent's exit")
    sent = metric(coord, "sar_coordinator_heartbeats_total") - beats
    assert sent <= 2, f"{sent} member reports in 2 s by exception (16 per interval)"

    # Rank 1 enters a broadcast and stays: reported quiet after STALL / 2 (only that report can
    # tell the coordinator the op: /v1/jobs without ?job= asks nobody for progress).
    (tmp_path / "hold").touch()
    held = time.monotonic()
    wait_for(
        lambda: quiet_in(member(coord, 1), "broadcast"),
        10,
        what="rank 1 reported quiet in its broadcast",
    )
    quiet_s = time.monotonic() - held

    # Rank 1 stops itself: its stamp ages, the agent reports it silent, the coordinator fails it.
    (tmp_path / "stop").touch()
    stopped = time.monotonic()
    wait_for(lambda: member(coord, 1)["state"] == "FAILED", 10, what="rank 1 failed")
    failed_s = time.monotonic() - stopped
    assert "missed heartbeats" in str(member(coord, 1)["reason"])
    code, stderr = agents.wait(agent, 30)
    assert code != 0, stderr
    print(
        f"quiet reported after {quiet_s:.2f} s (at {STALL / 2} s); stopped rank failed after {failed_s:.2f} s"
    )
    assert quiet_s < STALL / 2 + 2.0
    assert failed_s < INTERVAL * MISSES + 1.0 + 1.0  # about interval x misses + 1 s; 1 s for the load
