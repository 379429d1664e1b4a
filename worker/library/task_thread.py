"""SAR's ``CommThread`` and its module-level ``comm_thread``: one background thread that runs
tasks (callables without arguments) in the order submitted, and a queue of their results.

SAR's sequential aggregation submits the feature fetches of the next rounds
(``exchange_single_tensor`` calls) while the main thread aggregates the current one, and its
gradient hooks submit the backward exchanges. Same interface and order as SAR's
(``submit_task(task_id, task)``, ``get_result(block=True)``, results of tasks that return None are
not queued), with these differences, each on purpose:

- A task that raises does not kill the thread (in SAR every later ``get_result()`` then blocks for
  ever): its exception is queued in its result's place and raised by the ``get_result()`` that
  reaches it, so a :class:`~sarcomm.common.errors.PeerFailedError` inside a fetch reaches the
  training loop. The thread goes on with the next task.
- ``get_result`` also takes a ``timeout`` (seconds; ``queue.Empty`` when it passes).
- The thread starts on the first ``submit_task`` (importing starts nothing), starts anew in a
  forked child (a thread does not survive ``fork``), and is stopped at interpreter exit, so that
  it is never running when torch's runtime is torn down.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["CommThread", "comm_thread"]

log = logging.getLogger(__name__)

#: Seconds the exit hook waits for a task still running (a collective has its own timeout).
_STOP_WAIT_S: Final = 5.0


@dataclass(frozen=True)
class _Failed:
    task_id: str
    error: BaseException


_STOP: Final = object()


class CommThread:
    """A worker thread that runs submitted tasks one at a time, in order (SAR's ``CommThread``)."""

    def __init__(self) -> None:
        self.task_queue: queue.Queue[tuple[str, Callable[[], Any]] | object] = queue.Queue()
        self.result_queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit_task(self, task_id: str, task: Callable[[], Any]) -> None:
        """Queue ``task`` (a callable with no arguments) to run after the tasks before it; does not
        block. Its result, unless None, is queued for :meth:`get_result`; so is its exception."""
        if not callable(task):
            raise TypeError(f"task {task_id!r} is a {type(task).__name__}, not a callable with no arguments.")
        self._ensure_running()
        log.debug("task submitted %s", task_id)
        self.task_queue.put((task_id, task))

    def get_result(self, block: bool = True, timeout: float | None = None) -> Any:
        """The oldest result not read yet. Blocks until there is one unless ``block`` is False
        (then, like ``timeout`` seconds passing, ``queue.Empty`` when there is none). Raises the
        exception of a task that raised, in its place in the order."""
        item = self.result_queue.get(block=block, timeout=timeout)
        if isinstance(item, _Failed):
            raise item.error
        return item

    def stop(self, timeout: float = _STOP_WAIT_S) -> None:
        """Let the thread finish the tasks already queued, then end it (waiting up to ``timeout``
        seconds). A later :meth:`submit_task` starts a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None or self._pid != os.getpid():
            return
        self.task_queue.put(_STOP)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the comm thread was still running a task %.0f s after it was asked to stop", timeout)

    def _ensure_running(self) -> None:
        with self._lock:
            pid = os.getpid()
            if self._thread is not None and self._pid == pid:
                return
            if self._thread is not None:  # a forked child: the parent's thread and queues are not here
                self.task_queue, self.result_queue = queue.Queue(), queue.Queue()
            else:
                atexit.register(self.stop)
            self._pid = pid
            self._thread = threading.Thread(target=self._run, name="sarcomm-comm-thread", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        tasks, results = self.task_queue, self.result_queue
        while True:
            item = tasks.get()
            if item is _STOP or not isinstance(item, tuple):
                return
            task_id, task = item
            try:
                result = task()
            except BaseException as exc:  # handed to the reader, never lost with the thread
                log.debug("task %s raised %s: %s", task_id, type(exc).__name__, exc)
                results.put(_Failed(task_id, exc))
                continue
            if result is not None:
                results.put(result)


#: The process's comm thread, as SAR's ``sar.comm.comm_thread``.
comm_thread: Final = CommThread()
