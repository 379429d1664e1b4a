"""common/tasks.cancel_and_wait: the stop paths' way to end a task (issue 29, item 8's root: the
``cancel(); with suppress(CancelledError): await task`` idiom swallowed the caller's own
cancellation too, in the agent's output pumps, the election, the take-over, the sweeper and the
coordinator's lag watcher)."""

from __future__ import annotations

import asyncio

import pytest

from sarcomm.common.tasks import cancel_and_wait


async def _forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


async def test_the_tasks_own_cancellation_is_quiet_and_it_has_ended() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(_forever(started))
    await asyncio.wait_for(started.wait(), 5)
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(None)  # nothing to stop
    await cancel_and_wait(task)  # already ended: nothing more


async def test_a_caller_cancelled_while_it_waits_sees_its_cancellation() -> None:
    release = asyncio.Event()
    stopping = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await release.wait()  # a stop that takes its time
            raise

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)  # let it start waiting
    caller = asyncio.create_task(cancel_and_wait(task))
    await asyncio.wait_for(stopping.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 5)
    assert caller.cancelled()
    release.set()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def broken() -> None:
        raise RuntimeError("the pump broke")

    task = asyncio.create_task(broken())
    await asyncio.wait({task}, timeout=5)
    with pytest.raises(RuntimeError, match="the pump broke"):
        await cancel_and_wait(task)
