"""Stopping an asyncio task from a stop path, with cancellation kept straight.

The usual idiom, ``task.cancel()`` then ``with suppress(CancelledError): await task``, cannot tell
the task's own ``CancelledError`` (expected: we cancelled it) from the caller's (the caller's own
caller is cancelling it, and must see it): it swallows both, so a stop path that is itself
cancelled carries on as if nothing happened. :func:`cancel_and_wait` keeps the first quiet and lets
the second through.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (nothing when it is None or done) and wait until it has ended.

    The task's own cancellation is kept quiet; an exception it ended with is raised here, as
    ``await task`` would. If the caller is cancelled while it waits, its ``CancelledError`` goes
    through (the task has been asked to stop already and ends on its own).
    """
    if task is None:
        return
    task.cancel()
    # asyncio.wait raises nothing of the task's: only this caller's own cancellation.
    await asyncio.wait({task})
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
