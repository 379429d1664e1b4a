"""Where the service waits on the domain: job events fanned out to the streams that watch them
(Watch calls, heartbeat streams), and the Join calls waiting for their world to form.

Each subscriber gets a bounded queue; a subscriber too slow to drain it loses its oldest events
rather than growing the coordinator's memory without bound. Both are fed by the membership's
event listener; the domain itself holds no asyncio object.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sarcomm.common.constants import EventKind
from sarcomm.coordinator.domain.model import Job, JobEvent, JobState

log = logging.getLogger(__name__)

QUEUE_LIMIT = 256


class EventHub:
    """Subscribers by job name; :meth:`publish` is the membership's event listener."""

    def __init__(self) -> None:
        self._subscribers: dict[str, set[asyncio.Queue[JobEvent]]] = {}

    def subscribe(self, job: str, queue: asyncio.Queue[JobEvent] | None = None) -> asyncio.Queue[JobEvent]:
        queue = queue if queue is not None else asyncio.Queue(QUEUE_LIMIT)
        self._subscribers.setdefault(job, set()).add(queue)
        return queue

    def unsubscribe(self, job: str, queue: asyncio.Queue[JobEvent]) -> None:
        queues = self._subscribers.get(job)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._subscribers[job]

    def publish(self, event: JobEvent) -> None:
        for queue in self._subscribers.get(event.job, ()):
            if queue.full():
                queue.get_nowait()
                log.warning("job %r: a slow watcher lost its oldest event", event.job)
            queue.put_nowait(event)

    @property
    def subscriber_count(self) -> int:
        return sum(len(q) for q in self._subscribers.values())


class FormedWaiters:
    """Join calls waiting for their generation's world to form, one ``asyncio.Event`` per
    generation (4096 joins of one world share it); :meth:`publish` is the membership's event
    listener and sets it on WORLD_FORMED. :meth:`nudge` wakes the calls waiting now without
    waking later ones (an elastic generation's calls look again, see :meth:`CoordinatorService.Join`)."""

    def __init__(self) -> None:
        # (job name, generation) -> the event the calls wait on now and how many calls wait.
        self._waiting: dict[tuple[str, int], _Waiters] = {}

    def publish(self, event: JobEvent) -> None:
        if event.kind is EventKind.WORLD_FORMED:
            entry = self._waiting.get((event.job, event.generation))
            if entry is not None:
                entry.event.set()

    def nudge(self, job: Job) -> None:
        """Wake the calls waiting for ``job`` now; later calls wait on a fresh event."""
        entry = self._waiting.get((job.name, job.generation))
        if entry is not None:
            entry.event.set()
            entry.event = asyncio.Event()

    async def wait(self, job: Job, timeout: float) -> None:
        """Return once ``job`` (a generation) is no longer FORMING (at once if it is not), or when
        :meth:`nudge` wakes it.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if job.state is not JobState.FORMING:
            return
        key = (job.name, job.generation)
        entry = self._waiting.get(key)
        if entry is None:
            entry = self._waiting[key] = _Waiters(asyncio.Event())
        entry.count += 1
        try:
            await asyncio.wait_for(entry.event.wait(), timeout)
        finally:
            entry.count -= 1
            if entry.count == 0 and self._waiting.get(key) is entry:
                del self._waiting[key]

    def __len__(self) -> int:
        """How many generations have calls waiting."""
        return len(self._waiting)


@dataclass
class _Waiters:
    """The event the calls of one generation wait on now, and how many wait."""

    event: asyncio.Event
    count: int = 0
