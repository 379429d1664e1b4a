"""GPU-true durations of the library's own calls on CUDA tensors, by CUDA events, never by
synchronising the host.

On nccl a blocking collective returns once enqueued (the current stream is made to wait for the
NCCL stream; the host is not), so its wall time is the launch time. The library's wrappers record
an event on the current stream before the call and one after it (:meth:`EventTimer.begin`,
:meth:`EventTimer.end`): the second completes when the collective has (the stream waits for it),
the first when the stream reached the call, so the time between them is the collective's time on
the GPU from its turn on the caller's stream to its completion. The pair waits in a bounded queue,
in enqueue order, and is resolved later by ``query()`` (which never blocks): at the next call, and
before a scrape (:func:`~sarcomm.worker.library.metrics.add_before_scrape`). Resolution stops at
the first pair not done yet (a stream completes in order), so figures are recorded in order.

The nccl completion hook (:mod:`.gpu_timing`) times the works of the groups it covers, and skips the
library's own (noted by the zero-code kernels): these events are what times those. A full queue
(:data:`MAX_PENDING`; a stream that stopped progressing) drops its oldest pair, counted in
:attr:`EventTimer.dropped` and said once. :meth:`EventTimer.close` forgets the pending pairs
without waiting for them; an error of the CUDA runtime while polling (a context torn down at exit)
is said once and the timer drops everything and stays off. Nothing here raises to a caller.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

import torch

from sarcomm.worker.library.metrics import CollectiveStats

__all__ = ["MAX_PENDING", "EventLike", "EventTimer", "for_cuda"]

#: Pairs kept at most before the oldest is dropped (about 100 bytes each, events besides).
MAX_PENDING: Final = 1024


class EventLike(Protocol):
    """What is used of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds, to the pair's end


class EventTimer:
    """The pending event pairs of one process's library calls on CUDA tensors. Thread-safe: calls
    poll on the caller's thread, scrapes on the endpoint's."""

    def __init__(
        self, make_event: Callable[[], EventLike], say: Callable[[str], None], max_pending: int = MAX_PENDING
    ) -> None:
        self._make_event = make_event
        self._say = say
        self._max = max_pending
        self._pending: deque[tuple[EventLike, EventLike, CollectiveStats, int]] = deque()
        self._lock = threading.Lock()
        self._said_full = False
        self.dropped = 0
        self.on = True

    def begin(self) -> EventLike | None:
        """An event recorded now on the current stream (None when off or it failed)."""
        if not self.on:
            return None
        try:
            event = self._make_event()
            event.record()
        except Exception as exc:
            self._off(exc)
            return None
        return event

    def end(self, start: EventLike, stats: CollectiveStats, nbytes: int) -> None:
        """Record the end event of the call begun with ``start`` and queue the pair; then record
        whatever pairs are done. Never blocks; never raises."""
        try:
            event = self._make_event()
            event.record()
        except Exception as exc:
            self._off(exc)
            return
        with self._lock:
            if not self.on:
                return
            self._pending.append((start, event, stats, nbytes))
        self.poll()
        with self._lock:
            while len(self._pending) > self._max:
                self._pending.popleft()
                self.dropped += 1
            full = self.dropped > 0 and not self._said_full
            self._said_full = self._said_full or full
        if full:
            self._say(
                f"more than {self._max} library collectives on CUDA pending on the GPU: the oldest "
                "go unrecorded (is a stream stuck?)"
            )

    def poll(self) -> int:
        """Record every pair done, oldest first, stopping at the first not done; the number
        recorded. Never blocks (``query()`` only); never raises."""
        done: list[tuple[CollectiveStats, int, int]] = []
        try:
            with self._lock:
                while self._pending:
                    start, end, stats, nbytes = self._pending[0]
                    if not end.query():
                        break
                    self._pending.popleft()
                    done.append((stats, round(start.elapsed_time(end) * 1e6), nbytes))
        except Exception as exc:
            self._off(exc)
        for stats, duration_ns, nbytes in done:
            stats.record(max(duration_ns, 0), nbytes)
        return len(done)

    def pending(self) -> int:
        """How many pairs wait on the GPU."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Forget the pending pairs without waiting for them (shutdown); the timer stays off."""
        with self._lock:
            self.on = False
            self._pending.clear()

    def _off(self, exc: BaseException) -> None:
        with self._lock:
            was_on = self.on
            self.on = False
            self._pending.clear()
        if was_on:
            self._say(f"CUDA events for the library's calls are off: {type(exc).__name__}: {exc}")


def for_cuda(say: Callable[[str], None]) -> EventTimer:
    """The timer of a process whose library calls run on CUDA tensors (torch's CUDA events)."""
    event = torch.cuda.Event

    def make_event() -> EventLike:
        return event(enable_timing=True)  # type: ignore[no-untyped-call]

    return EventTimer(make_event, say)
