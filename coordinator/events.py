"""Fan-out of job events to the streams that watch them (Watch calls, heartbeat streams).

Each subscriber gets a bounded queue; a subscriber too slow to drain it loses its oldest events
rather than growing the coordinator's memory without bound.
"""

from __future__ import annotations

import asyncio
import logging

from sarcomm.coordinator.membership import JobEvent

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
