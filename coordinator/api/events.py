"""Where the service waits on the domain: job events fanned out to the streams that watch them
(Watch calls, heartbeat streams), and the Join calls waiting for their world to form.

Each subscriber gets a bounded queue; a subscriber too slow to drain it loses its oldest events
rather than growing the coordinator's memory without bound. Both are fed by the membership's
event listener; the domain itself holds no asyncio object.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from sarcomm.common.constants import EventKind
from sarcomm.coordinator.domain.model import Job, JobEvent, JobState

log = logging.getLogger(__name__)

QUEUE_LIMIT = 256


@dataclass(frozen=True)
class ProgressWanted:
    """The coordinator wants the progress of ``job``'s members now: pushed on the Heartbeat
    streams that report its members by exception (``HeartbeatResponse.progress_wanted``), never
    on a Watch."""

    job: str


#: What a subscriber's queue carries: job events, and (a by-exception Heartbeat stream's only)
#: asks for progress.
Pushed = JobEvent | ProgressWanted


class EventHub:
    """Subscribers by job name; :meth:`publish` is the membership's event listener."""

    def __init__(self) -> None:
        self._subscribers: dict[str, set[asyncio.Queue[Pushed]]] = {}

    def subscribe(self, job: str, queue: asyncio.Queue[Pushed] | None = None) -> asyncio.Queue[Pushed]:
        queue = queue if queue is not None else asyncio.Queue(QUEUE_LIMIT)
        self._subscribers.setdefault(job, set()).add(queue)
        return queue

    def subscribers(self, job: str) -> Iterable[asyncio.Queue[Pushed]]:
        """The queues subscribed to ``job`` now."""
        return self._subscribers.get(job, ())

    def unsubscribe(self, job: str, queue: asyncio.Queue[Pushed]) -> None:
        queues = self._subscribers.get(job)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._subscribers[job]

    def publish(self, event: JobEvent) -> None:
        for queue in self._subscribers.get(event.job, ()):
            push(queue, event)

    @property
    def subscriber_count(self) -> int:
        return sum(len(q) for q in self._subscribers.values())


def push(queue: asyncio.Queue[Pushed], item: Pushed) -> None:
    """Put ``item`` in a subscriber's ``queue``; a full one loses its oldest item."""
    if queue.full():
        queue.get_nowait()
        log.warning("job %r: a slow watcher lost its oldest event", item.job)
    queue.put_nowait(item)


class FormedWaiters:
    """Join calls waiting for their generation's world to form, one future per generation (the
    32,768 joins of one world share it); :meth:`publish` is the membership's event listener and
    resolves it on WORLD_FORMED. :meth:`nudge` wakes the calls waiting now without waking later
    ones (an elastic generation's calls look again, see ``CoordinatorService.Join``).

    Each call waits on the shared future with a timer of its own, not through ``wait_for``: that
    makes a task per call (49,000 tasks and their wake-ups at 32,768 single-rank joins, a quarter
    of the formation's time in process, measured)."""

    def __init__(self) -> None:
        # (job name, generation) -> the future calls wait on now and how many calls wait.
        self._waiting: dict[tuple[str, int], tuple[asyncio.Future[None], int]] = {}

    def publish(self, event: JobEvent) -> None:
        if event.kind is EventKind.WORLD_FORMED:
            entry = self._waiting.get((event.job, event.generation))
            if entry is not None and not entry[0].done():
                entry[0].set_result(None)

    def nudge(self, job: Job) -> None:
        """Wake the calls waiting for ``job`` now; later calls wait on a fresh future."""
        key = (job.name, job.generation)
        entry = self._waiting.get(key)
        if entry is not None:
            formed, count = entry
            if not formed.done():
                formed.set_result(None)
            self._waiting[key] = (asyncio.get_running_loop().create_future(), count)

    async def wait(self, job: Job, timeout: float) -> None:
        """Return once ``job`` (a generation) is no longer FORMING (at once if it is not), or when
        :meth:`nudge` wakes it.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if job.state is not JobState.FORMING:
            return
        loop = asyncio.get_running_loop()
        key = (job.name, job.generation)
        formed, count = self._waiting.get(key) or (loop.create_future(), 0)
        self._waiting[key] = (formed, count + 1)
        mine = loop.create_future()

        def release(_: object = None) -> None:
            if not mine.done():
                mine.set_result(None)

        # Not removed from the shared future when this call ends first: that is O(waiters) for
        # each, and a release of a finished call does nothing.
        formed.add_done_callback(release)
        timer = loop.call_later(timeout, release)
        try:
            await mine
        finally:
            timer.cancel()
            current, count = self._waiting[key]  # a nudge may have put a fresh future there
            if count > 1:
                self._waiting[key] = (current, count - 1)
            else:
                del self._waiting[key]
        if not formed.done():
            raise TimeoutError

    def __len__(self) -> int:
        """How many generations have calls waiting."""
        return len(self._waiting)
