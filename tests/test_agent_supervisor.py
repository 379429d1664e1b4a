"""The agent's supervisor, in process: what it logs of its own tasks' failures."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sarcomm.worker.agent.supervisor import log_failures


async def test_a_failed_agent_task_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def leave() -> None:
        raise RuntimeError("the Leave call broke")

    async def fine() -> None:
        return None

    tasks = [asyncio.ensure_future(leave()), asyncio.ensure_future(fine())]
    cancelled = asyncio.ensure_future(asyncio.sleep(60))
    cancelled.cancel()
    await asyncio.wait([*tasks, cancelled])

    with caplog.at_level(logging.ERROR, logger="sarcomm.worker.agent.supervisor"):
        log_failures([*tasks, cancelled], "job=j ranks=[0] generation=1")

    [record] = caplog.records
    assert record.getMessage() == "job=j ranks=[0] generation=1: agent task failed"
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    assert "Traceback (most recent call last)" in caplog.text
    assert 'raise RuntimeError("the Leave call broke")' in caplog.text
