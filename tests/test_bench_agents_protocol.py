"""The benchmarks' simulated agents (``benchmarks/load_agents.py``) speak both protocols as the real
agent does, against a coordinator in this process: offered a policy, every stream switches to
reports by exception (a full report, then only a lease renewal); never offered one (``--report-policy
per-second``, or an old coordinator), they report every rank every interval."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.coordinator_fixture import in_process_coordinator
from tests.helpers import FakeClock

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
AGENTS = 2
INTERVAL_S = 0.1
BEAT_S = 0.6


@pytest.fixture(scope="module")
def load_agents() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("load_agents")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("offered", ["exception", "per-second"])
async def test_simulated_agents_switch_when_offered_and_report_per_second_when_not(
    load_agents: ModuleType, offered: str
) -> None:
    async with in_process_coordinator(FakeClock(), report_policy=offered) as coord:
        config = {
            "target": coord.target, "job": "sim", "world": AGENTS * 8, "agents": AGENTS, "members": 8,
            "proc": 0, "channels": 0, "interval": INTERVAL_S, "coordinator_interval": 1.0,
            "join_timeout": 30, "protocol": "exception",
        }  # fmt: skip
        agents = load_agents.Agents(config)
        try:
            await agents.connect()
            joined = await agents.join_all(time.monotonic())
            assert min(joined) > 0, agents.errors
            until = time.monotonic() + BEAT_S
            result = await agents.beat_all(until, (0.0, until), False)
        finally:
            for channel in agents.channels:
                await channel.close(None)

    assert agents.errors == []
    assert result["streams"] == AGENTS
    if offered == "exception":
        # One full report each, then at most the lease's first renewal (the next is 10 s away).
        assert result["by_exception"] == AGENTS
        assert result["reported"] == AGENTS
        assert AGENTS <= result["written"] <= 2 * AGENTS
    else:
        assert result["by_exception"] == 0
        assert result["reported"] == result["written"] >= AGENTS * (BEAT_S / INTERVAL_S - 2)
