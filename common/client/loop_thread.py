"""A private event loop on a daemon thread, for sync code that uses the async client.

gRPC's asyncio channels belong to one loop; a process whose own code is synchronous (a
self-registered rank, torchrun's agent with sarcomm's rendezvous handler) runs the client's calls
and its heartbeat stream on a loop of its own, whether or not the caller runs an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

_T = TypeVar("_T")


class LoopThread:
    """A private event loop on a daemon thread, for the client calls and the heartbeat stream.

    gRPC's asyncio channels belong to one loop, and a self-registered process needs its
    heartbeats to keep flowing while the main thread trains; a loop of its own does both, and
    works whether or not the caller already runs an event loop.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``coro`` on the loop; block until it is done or ``timeout`` seconds passed.

        Raises:
            TimeoutError: ``timeout`` passed (the coroutine is cancelled); otherwise what ``coro``
                raised, as it raised it (a ``TimeoutError`` of its own, such as
                :class:`~sarcomm.common.errors.JoinTimeoutError`, included: only this wait's own
                deadline reads as this wait's).
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        # concurrent.futures.TimeoutError is the builtin TimeoutError: future.result(timeout) would
        # raise the same type for this wait's deadline and for a TimeoutError that coro raised.
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise TimeoutError(f"a coordinator call did not finish within {timeout:g} s")
        return future.result()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
