"""The service's side of reports by exception: the offer, the switch, leases renewed, and the
progress of a job asked for (pushed on its by-exception streams, and awaited by ``status``).

The numbers are :mod:`~sarcomm.coordinator.domain.policy`'s; what a switch and a report mean for
liveness is :mod:`~sarcomm.coordinator.domain.by_exception`'s. Here: which answer carries the
policy (the first answer of a stream, and one that offers a longer lease), which queues a
``progress_wanted`` goes to, and the bounded wait of ``status`` of one job for the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sarcomm.coordinator.api.events import EventHub, ProgressWanted, Pushed, push
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain import policy
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import Job, JobState
from sarcomm.coordinator.domain.reporters import Reporter
from sarcomm.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["PROGRESS_WAIT_S", "ExceptionStreams"]

#: How long ``status`` of one job waits for the progress it asked the job's reporters for.
PROGRESS_WAIT_S = 1.0


class ExceptionStreams:
    """The Heartbeat streams of one term as reports by exception sees them."""

    def __init__(self, membership: Membership, events: EventHub, config: CoordinatorConfig) -> None:
        self._membership = membership
        self._events = events
        self._config = config
        self._offers = config.report_policy == "exception"
        # The event queue of each open by-exception stream (where progress_wanted is pushed).
        self._queues: dict[asyncio.Queue[Pushed], Reporter] = {}
        # Asks awaited by status: the reporters that have not answered yet, and the event set when
        # none is left.
        self._waits: list[tuple[set[Reporter], asyncio.Event]] = []
        membership.by_exception.ask_progress = self.ask

    @property
    def open_streams(self) -> int:
        """Open by-exception streams."""
        return len(self._membership.by_exception.reporters)

    def first_answer(self, answer: pb.HeartbeatResponse, reporter: Reporter) -> pb.HeartbeatResponse:
        """``answer``, the first of a stream, with the policy on offer (``answer`` itself when
        none is: ``--report-policy per-second``)."""
        if not self._offers:
            return answer
        offer = self._offer()
        reporter.lease_seconds = offer.lease_seconds
        return with_policy(answer, offer)

    def _offer(self, lease: float | None = None) -> pb.ReportPolicy:
        """The policy for a stream offered now (``lease``: its lease instead of today's)."""
        config = self._config
        offer = policy.report_policy(
            config.heartbeat_interval, config.heartbeat_misses, config.stall_threshold, self.open_streams + 1
        ).to_proto()
        if lease is not None:
            offer.lease_seconds = lease
        return offer

    def reoffered(self, answer: pb.HeartbeatResponse, lease: float) -> pb.HeartbeatResponse:
        """``answer`` offering a stream the longer ``lease`` (see :meth:`request`)."""
        return with_policy(answer, self._offer(lease))

    def request(
        self, request: pb.HeartbeatRequest, reporter: Reporter, queue: asyncio.Queue[Pushed]
    ) -> float | None:
        """A request arrived on ``reporter``'s stream, before its reports are taken: the switch to
        by exception (its first ``by_exception`` request, on a coordinator that offers it), the
        lease renewed. Returns a longer lease to offer on the answer (see ``policy.reoffer``)."""
        if not (request.by_exception and self._offers):
            return None
        membership = self._membership
        if not reporter.by_exception:
            lease = reporter.lease_seconds or policy.lease_seconds(self.open_streams + 1)
            membership.took_policy(reporter, lease)
            self._queues[queue] = reporter
        else:
            membership.by_exception.renew(reporter)
        if self._waits:
            self._answered(reporter)
        longer = policy.reoffer(reporter.lease_seconds, self.open_streams)
        if longer is not None:
            reporter.lease_seconds = longer
        return longer

    def ended(self, queue: asyncio.Queue[Pushed]) -> None:
        """The stream of ``queue`` ended."""
        reporter = self._queues.pop(queue, None)
        if reporter is not None and self._waits:
            self._answered(reporter)

    def ask(self, job: Job) -> set[Reporter]:
        """Push ``progress_wanted=[job]`` to every by-exception stream that reports members of
        ``job``; returns their reporters."""
        asked: set[Reporter] = set()
        wanted = ProgressWanted(job.name)
        for queue in self._events.subscribers(job.name):
            reporter = self._queues.get(queue)
            if reporter is not None:
                push(queue, wanted)
                asked.add(reporter)
        return asked

    async def gather(self, name: str, timeout: float = PROGRESS_WAIT_S) -> None:
        """Ask for the progress of running job ``name`` and wait until every asked stream sent
        a request since (its answer), at most ``timeout`` seconds. Returns at once when none was
        asked (no such job, no by-exception stream reports it, or it was asked lately: see
        ``ReportsByException.progress_wanted``)."""
        job = self._membership.job(name)
        if job is None or job.state is not JobState.RUNNING or not self._queues:
            return
        if not self._membership.by_exception.progress_wanted(job):
            return  # asked lately: its reporters send each change every interval still
        asked = self.ask(job)
        if not asked:
            return
        done = asyncio.Event()
        wait = (asked, done)
        self._waits.append(wait)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout)
        finally:
            self._waits.remove(wait)
        if asked:
            log.debug(
                "job %r: %d reporter(s) did not answer the ask for progress in %gs", name, len(asked), timeout
            )

    def _answered(self, reporter: Reporter) -> None:
        for pending, done in self._waits:
            pending.discard(reporter)
            if not pending:
                done.set()


def with_policy(answer: pb.HeartbeatResponse, offer: pb.ReportPolicy) -> pb.HeartbeatResponse:
    """A copy of ``answer`` (which may be shared by many streams) carrying ``offer``."""
    offered = pb.HeartbeatResponse()
    offered.CopyFrom(answer)
    offered.policy.CopyFrom(offer)
    return offered
