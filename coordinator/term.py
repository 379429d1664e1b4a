"""One term of leading: the jobs loaded from the store and everything that serves them.

A coordinator on SQLite leads for as long as it runs: one term. Coordinators sharing an etcd
store begin a term each time they become leader (the jobs read afresh from etcd: what the
previous leader wrote) and abandon it when they stop leading: nothing more is written, the
liveness sweep stops, and every call in flight is ended so that its client goes to the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.common.errors import NotLeaderError, SarcommError
from sarcomm.common.tasks import cancel_and_wait
from sarcomm.coordinator.api.events import EventHub, FormedWaiters
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.api.service import CoordinatorService
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain import policy
from sarcomm.coordinator.domain.clock import Clock
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import Job, JobEvent, StoredState
from sarcomm.coordinator.storage.persistence import WriteBehind
from sarcomm.coordinator.storage.store import StateStore

log = logging.getLogger(__name__)

#: A sweep later than this is taken for time the coordinator was not listening (see
#: liveness.excuse); below it, the timer's ordinary jitter.
SWEEP_LATE_EXCUSED_S = 0.1


def build_membership(
    config: CoordinatorConfig, stored: StoredState, clock: Clock, persist: Callable[[Job], None] | None
) -> Membership:
    """The membership of ``stored`` under ``config``'s rules."""
    return Membership(
        stored=stored,
        clock=clock,
        persist=persist,
        liveness_timeout=config.liveness_timeout,
        max_jobs=config.limits.max_jobs,
        max_ended_jobs=config.limits.max_ended_jobs,
        # A reporter whose stream broke reopens it at once; one interval is enough to tell a
        # broken connection from a dead process without waiting for all the misses.
        lost_grace=config.heartbeat_interval,
        restore_grace=config.reconnect_grace,
        stall_threshold=config.stall_threshold,
        answer_timeout=config.join_timeout,
        silence=policy.silence_seconds(config.heartbeat_interval, config.heartbeat_misses),
    )


class Term:
    """The membership of one term, its writes, events, waiters, service and liveness sweeper."""

    def __init__(
        self,
        config: CoordinatorConfig,
        store: StateStore,
        stored: StoredState,
        clock: Clock,
        metrics: CoordinatorMetrics,
        where: str,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self.writes = WriteBehind(store, where=where)
        self.membership = build_membership(config, stored, clock, self.writes.mark)
        self.events = EventHub()
        self.formed = FormedWaiters()
        self.membership.add_listener(self.formed.publish)
        self.membership.elastic.wake = self.formed.nudge
        self.membership.add_listener(self.events.publish)
        self.membership.add_listener(self._count_event)
        self.service = CoordinatorService(
            self.membership, self.events, metrics, config, self.writes.durable, self.formed
        )
        self.ended = False
        # Calls in flight (their tasks), ended when the term is abandoned.
        self._calls: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="liveness-sweeper")

    def _count_event(self, event: JobEvent) -> None:
        if event.kind is EventKind.MEMBER_FAILED:
            # Every member failure carries its reason; REPORTED is only a guard for a bug.
            self._metrics.member_failures.labels((event.failure or FailureReason.REPORTED).value).inc()
        elif event.kind is EventKind.WORLD_FORMED:
            job = self.membership.job(event.job)
            if job is not None:
                self._metrics.rendezvous_duration.observe(max(0.0, job.formed - job.created))
                if job.restart_count:
                    self._metrics.restarts.inc()
        elif event.kind is EventKind.JOB_RESTARTING:
            self._metrics.rerendezvous.inc()

    async def _sweep_forever(self) -> None:
        # Sweeping at a fraction of the interval bounds detection at interval x misses + interval/4.
        period = self._config.heartbeat_interval / 4
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(period)
            # A sweep that comes late measures how long the coordinator was not reading reports
            # (its loop behind, or its process without a CPU): that time is excused, not silence.
            # Measured: 4096 agents' first reports, queued behind their 4096 new streams on a busy
            # 2-core machine, had every one of 32,768 members failed for silence.
            now = loop.time()
            late = now - last - period
            last = now
            try:
                self.membership.sweep(excused=late if late > SWEEP_LATE_EXCUSED_S else 0.0)
            except Exception:  # the sweeper must outlive any one bad sweep
                log.exception("liveness sweep failed")

    async def _stop_sweeper(self) -> None:
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
            self._sweeper = None

    async def close(self) -> None:
        """Orderly end (shutdown): stop sweeping, write everything still marked."""
        await self._stop_sweeper()
        await self.writes.close()

    def abandon(self) -> None:
        """This coordinator stopped leading: write nothing more and end every call in flight."""
        self.ended = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.writes.abandon()
        for task in list(self._calls):
            task.cancel()

    @contextlib.contextmanager
    def call(self, not_leader: Callable[[], NotLeaderError]) -> Iterator[None]:
        """Around one RPC served by this term: when the term is abandoned meanwhile, the call ends
        with ``not_leader()`` (UNAVAILABLE naming the leader) instead of whatever it was doing."""
        task = asyncio.current_task()
        if task is not None:
            self._calls.add(task)
        try:
            yield
        except (asyncio.CancelledError, SarcommError):
            if not self.ended:
                raise
            if task is not None and hasattr(task, "uncancel"):
                # Our own cancellation (see abandon), answered with a status instead.
                while task.cancelling():
                    task.uncancel()
            raise not_leader() from None
        finally:
            if task is not None:
                self._calls.discard(task)
