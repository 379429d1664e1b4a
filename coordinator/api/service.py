"""The ``sarcomm.v1.Coordinator`` gRPC servicer: translation between messages and the domain.

Logic lives in :mod:`membership`; checks in :mod:`validation`; the mapping of errors to status
codes in :mod:`interceptor`. Handlers here only convert, wait and stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sarcomm.common.constants import JOIN_ANSWER_SLACK_S
from sarcomm.common.errors import (
    FailedPreconditionError,
    JobClosedError,
    JoinTimeoutError,
    NotFoundError,
    ResourceExhaustedError,
    SarcommError,
)
from sarcomm.common.interfaces import parse_peer
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.api.events import EventHub, FormedWaiters, ProgressWanted, Pushed
from sarcomm.coordinator.api.exception_streams import ExceptionStreams
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.api.reports import CheckedReport, StreamReports, check_own, check_report
from sarcomm.coordinator.api.views import event_message, failure_message, jobs_message
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain import ranks
from sarcomm.coordinator.domain.elastic import waiting
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import EventKind, Job, JobEvent, JobState
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# How long the end of a heartbeat stream that was not announced (``closing``) waits for grpc to
# cancel the call, which tells a dead reporter from a half-close.
_CANCEL_GRACE_S = 0.25
# Events whose Heartbeat answers are kept for the next streams they reach.
EVENT_ANSWERS = 64


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        membership: Membership,
        events: EventHub,
        metrics: CoordinatorMetrics,
        config: CoordinatorConfig,
        durable: Callable[[Job], Awaitable[None]],
        formed: FormedWaiters,
    ) -> None:
        self._membership = membership
        # Join calls wait here for their world; the membership's WORLD_FORMED events set it.
        self._formed = formed
        # Awaited before an answer that reports a change (a formed world, a leave): what a client
        # was told must survive a crash (see persistence.WriteBehind.durable).
        self._durable = durable
        self._events = events
        self._metrics = metrics
        self._config = config
        # Join calls waiting for their world now (see Limits.max_join_waiters).
        self._join_waiters = 0
        # The answer to a report that changes nothing the reporter must hear (shared: nothing changes
        # it once built).
        self._ack = pb.HeartbeatResponse(heartbeat_interval_seconds=config.heartbeat_interval)
        self._event_answers: dict[tuple[JobEvent, ...], pb.HeartbeatResponse] = {}
        self._failure_events: dict[tuple[str, int, float], pb.JobEvent] = {}
        # Reports by exception: the offer, the switch, leases, progress asked for.
        self.streams = ExceptionStreams(membership, events, config)

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.JoinResponse:
        limits = self._config.limits
        spec = validation.join_spec(request, parse_peer(context.peer()), limits)
        if self._join_waiters >= limits.max_join_waiters:
            raise ResourceExhaustedError(
                f"job {spec.job!r}: the coordinator already holds {self._join_waiters} waiting joins, its "
                f"limit max_join_waiters (--max-join-waiters) {limits.max_join_waiters}; retry later"
            )
        # A Join sent again (same join_id) waits on its first try's ticket (see resent_joins).
        try:
            ticket = self._membership.join(
                spec, validation.join_id(request.join_id) if request.join_id else ""
            )
        except JobClosedError as refused:
            return self._closed_answer(spec.job, refused)
        if not ticket.resent:
            self._metrics.joins.inc(len(spec.members))
        job = ticket.job
        timeout = min(request.join_timeout_seconds or self._config.join_timeout, self._config.join_timeout)
        left = context.time_remaining()
        # The client's deadline is its join timeout plus JOIN_ANSWER_SLACK_S: the wait ends in time
        # for the answer (why the world did not form) to reach it, even if the request came late.
        wait = timeout if left is None else max(0.0, min(timeout, left - JOIN_ANSWER_SLACK_S))
        self._join_waiters += 1
        try:
            await self._wait_formed(job, wait)
        except TimeoutError:
            missing = ranks.describe_missing(job)
            self._membership.abandon(ticket)
            raise JoinTimeoutError(
                f"join_timeout_seconds {timeout:g}: {job.label} did not form in time: {missing}"
            ) from None
        except asyncio.CancelledError:
            # The caller hung up or its own deadline passed: its members must not count any more
            # (unless a resend of the same Join still waits on them).
            self._membership.abandon(ticket)
            raise
        finally:
            self._join_waiters -= 1
        closed = self._membership.elastic.withdrawn(ticket)
        if closed is not None:
            return self._closed_answer(spec.job, closed)
        if job.state is JobState.FORMING:
            raise FailedPreconditionError(f"{job.label} was abandoned before its world formed")
        # Not told yet: until the world is written and this answer goes, its members show JOINING
        # and a world none of whose members was told shows FORMING (views.job_state).
        self._membership.answered(ticket, False)
        try:
            # When the state cannot be written (a full disk: CoordinatorUnavailableError), no answer
            # and so no liveness yet; the client sends this Join again (same join_id) and gets the
            # answer once it is written.
            await self._durable(job)
        except asyncio.CancelledError:
            # The caller hung up: its members are judged by their silence, as answered ones are.
            self._membership.answered(ticket)
            raise
        self._membership.answered(ticket)
        first = ticket.members[0]
        return pb.JoinResponse(
            job=job.name,
            generation=job.generation,
            world_size=job.world_size,
            master_addr=job.master_addr,
            master_port=job.master_port,
            interface=first.interface,
            address=first.address,
            restart_count=job.restart_count,
            heartbeat_interval_seconds=self._config.heartbeat_interval,
            assignments=[
                pb.Assignment(rank=_rank(m.rank), local_rank=m.local_rank, member_id=m.member_id, secret=s)
                for m, s in zip(ticket.members, ticket.secrets, strict=True)
            ],
        )

    async def _wait_formed(self, job: Job, timeout: float) -> None:
        """Return once ``job`` (a generation) is no longer FORMING, or was sent away (an elastic
        one parked behind a world whose rendezvous closed). An elastic one forms at its last call,
        which these waits drive (and the liveness sweep, as a backstop).

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if job.elastic is None:
            await self._formed.wait(job, timeout)
            return
        elastic = self._membership.elastic
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while job.state is JobState.FORMING and job.memory.withdrawn is None:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            due = elastic.form_in(job)
            try:
                await self._formed.wait(job, left if due is None else min(left, due))
            except TimeoutError:
                if due is None or loop.time() >= deadline:
                    raise
                elastic.form_if_ready(job)

    def _closed_answer(self, job: str, closed: JobClosedError) -> pb.JoinResponse:
        """The answer to a Join of an elastic job whose rendezvous is closed (no assignments)."""
        log.info("job %r: a Join answered closed: %s", job, closed)
        return pb.JoinResponse(
            job=job,
            closed=True,
            beyond_max=closed.beyond_max,
            closed_reason=str(closed),
            heartbeat_interval_seconds=self._config.heartbeat_interval,
        )

    # The reader-writer form of a streaming handler (it writes with context.write and returns
    # None), which grpc.aio serves but the generated stub does not type.
    async def Heartbeat(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        # Each request is read, handled and answered in this one task (the reader-writer form of a
        # gRPC handler): an answer is written before the next request is read, so a client that
        # writes but never reads stops being read once HTTP/2 flow control holds the answers back.
        # Pushed events are written by a task of their own, so a failure reaches the reporter at
        # once, not at its next beat; one write at a time (gRPC allows no more).
        events: asyncio.Queue[Pushed] = asyncio.Queue(256)
        # This stream's identity and the members it reported: if it breaks (cancelled, connection
        # gone) instead of ending in order, those members' reporter most likely died.
        state = StreamReports()
        writing = asyncio.Lock()
        broken = True
        closing = False  # the reporter said it ends the stream in order

        async def forward_events() -> None:
            while True:
                # Every event queued goes in one answer: a failure is announced as MEMBER_FAILED
                # and JOB_FAILED together, one write per stream instead of two.
                pushed = [await events.get()]
                while not events.empty():
                    pushed.append(events.get_nowait())
                async with writing:
                    try:
                        await context.write(self._pushed_answer(pushed))
                    except Exception:  # the call ended meanwhile: its reading side settles it
                        log.debug("an event for a Heartbeat stream that had ended was dropped")
                        return

        forwarder = asyncio.create_task(forward_events())
        streams = self.streams
        first = True
        self._metrics.heartbeat_streams.labels("per-second").inc()
        try:
            async for request in request_iterator:
                closing = closing or request.closing
                was = state.reporter.by_exception
                longer = streams.request(request, state.reporter, events)
                answer = self._handle_reports(request, state, events)
                if isinstance(answer, SarcommError):
                    broken = False  # our own refusal ends it; the reporter is alive
                    raise answer
                if first:
                    answer = streams.first_answer(answer, state.reporter)  # the policy on offer
                    first = False
                elif longer is not None:
                    answer = streams.reoffered(answer, longer)
                if state.reporter.by_exception:
                    if not was:
                        self._metrics.heartbeat_streams.labels("per-second").dec()
                        self._metrics.heartbeat_streams.labels("exception").inc()
                    if not request.reports:
                        self._metrics.leases.inc()
                async with writing:
                    await context.write(answer)
            if not closing:
                # grpc ends the requests of a client whose connection died just like a half-close,
                # and cancels the call a moment later: a client that did not say it was closing
                # gets that moment to turn out dead (measured: the cancellation follows within ms).
                await asyncio.sleep(_CANCEL_GRACE_S)
            broken = False  # the reporter half-closed: an orderly end
        finally:
            forwarder.cancel()
            streams.ended(events)
            protocol = "exception" if state.reporter.by_exception else "per-second"
            self._metrics.heartbeat_streams.labels(protocol).dec()
            for job in state.watched:
                self._events.unsubscribe(job, events)
            if broken and state.reported:
                self._membership.stream_lost(state.token, state.reported)
            elif state.reported:
                self._membership.stream_closed(state.token, state.reported)

    def _pushed_answer(self, pushed: list[Pushed]) -> pb.HeartbeatResponse:
        """The answer that pushes ``pushed``: job events, and the jobs whose progress is wanted."""
        events = tuple(e for e in pushed if isinstance(e, JobEvent))
        wanted = sorted({p.job for p in pushed if isinstance(p, ProgressWanted)})
        if not wanted:
            return self._event_answer(events)
        answer = pb.HeartbeatResponse(
            events=[event_message(e) for e in events],
            heartbeat_interval_seconds=self._config.heartbeat_interval,
            progress_wanted=wanted,
        )
        self._metrics.progress_asks.inc(len(wanted))
        return answer

    def _event_answer(self, pushed: tuple[JobEvent, ...]) -> pb.HeartbeatResponse:
        """The answer that pushes ``pushed`` to a reporter: built once for every stream they reach
        (a failure in a 4096-agent job reaches 4096 streams at once)."""
        answer = self._event_answers.get(pushed)
        if answer is None:
            if len(self._event_answers) >= EVENT_ANSWERS:
                self._event_answers.clear()
            answer = self._event_answers[pushed] = pb.HeartbeatResponse(
                events=[event_message(e) for e in pushed],
                heartbeat_interval_seconds=self._config.heartbeat_interval,
            )
        return answer

    def _handle_reports(
        self, request: pb.HeartbeatRequest, state: StreamReports, events: asyncio.Queue[Pushed]
    ) -> pb.HeartbeatResponse | SarcommError:
        taken = state.take(request, self._membership.current)
        if taken is not None:
            # Every report repeats one accepted before (see reports.StreamReports): nothing to check.
            self._membership.beats(taken, state.token)
            self._metrics.heartbeats.inc(len(taken))
            watched_elastic = self._elastic_jobs(state.watched)
            if not watched_elastic:
                return self._ack
            # An elastic job's reporters hear how its rendezvous stands on every answer.
            answer = pb.HeartbeatResponse(heartbeat_interval_seconds=self._config.heartbeat_interval)
            self._rendezvous_states(answer, watched_elastic, {}, state.reported)
            return answer
        response = pb.HeartbeatResponse(heartbeat_interval_seconds=self._config.heartbeat_interval)
        watched, reported = state.watched, state.reported
        try:
            # A request's members are checked, every known member's secret too, before the first
            # report is recorded: a bad id, secret or age refuses the request. A bad monitoring
            # field (progress, a metrics endpoint) costs only itself (reports.check_report).
            validation.report_count(len(request.reports))
            checked = [check_report(report, f"reports[{i}]") for i, report in enumerate(request.reports)]
            known: list[CheckedReport] = []
            for i, report in enumerate(checked):
                try:
                    _, member = self._membership.authenticate(report.member_id, report.secret)
                except SarcommError as error:
                    if not isinstance(error, NotFoundError):
                        raise
                    response.unknown_members.append(report.member_id)
                    continue
                check_own(report, member, f"reports[{i}]")
                known.append(report)
            elastic: dict[str, Job] = {}
            for report in known:
                member_id = report.member_id
                reported.add(member_id)  # first: the stream stands for it once recorded
                job, _ = self._membership.heartbeat(
                    member_id,
                    report.secret,
                    report.progress,
                    report.address,
                    age=report.age,
                    stream=state.token,
                    worker_endpoints=report.endpoints,
                )
                if report.refused:
                    self._refused(response, job, member_id, state.tell(member_id, report.refused))
                if job.elastic is not None:
                    elastic[job.name] = job
                found = self._membership.current(member_id)
                if found is not None:
                    state.accepted(report, found)
                self._metrics.heartbeats.inc()
                if job.name not in watched:
                    watched.add(job.name)
                    self._events.subscribe(job.name, events)
                    if job.state is JobState.FAILED:
                        # Subscribed after the failure was announced: tell this reporter now.
                        response.events.append(self._failure_event(job.name))
            if elastic:
                closing = {r.member_id: r.secret for r in request.reports if r.close_job}
                self._rendezvous_states(response, elastic, closing, reported)
        except SarcommError as error:
            return error
        return response

    @staticmethod
    def _refused(response: pb.HeartbeatResponse, job: Job, member_id: str, lines: list[str]) -> None:
        """Tell the coordinator's log and the reporter (once each, see StreamReports.tell) what was
        dropped from a member's report."""
        for line in lines:
            log.warning(
                "job=%s member=%s: %s; dropped from its heartbeat, the rest was taken",
                job.name, member_id, line,
            )  # fmt: skip
        response.refused.extend(lines)

    def _elastic_jobs(self, names: set[str]) -> dict[str, Job]:
        """The elastic jobs among ``names`` (a stream's watched jobs), by name."""
        found: dict[str, Job] = {}
        for name in names:  # every request of every stream asks: no generator, no comprehension
            job = self._membership.job(name)
            if job is not None and job.elastic is not None:
                found[name] = job
        return found

    def _rendezvous_states(
        self, response: pb.HeartbeatResponse, jobs: dict[str, Job], closing: dict[str, str], known: set[str]
    ) -> None:
        """Close the rendezvous of the jobs whose reports ask so, then tell how every elastic job
        of the reports stands (what torchrun's num_nodes_waiting() and is_closed() answer)."""
        for member_id, secret in closing.items():
            if member_id in known:
                self._membership.close_job(member_id, secret)
        for job in jobs.values():
            response.rendezvous.append(
                pb.RendezvousState(
                    job=job.name,
                    generation=job.generation,
                    waiting_members=waiting(job),
                    closed=job.closed is not None,
                )
            )

    def _failure_event(self, job_name: str) -> pb.JobEvent:
        job = self._membership.job(job_name)
        assert job is not None
        # Made once per failed generation (and time it shows): every stream of a failed 4096-agent
        # job that subscribes afterwards is told, and finding the member is O(members).
        key = (job.name, job.generation, job.ended or job.formed)
        cached = self._failure_events.get(key)
        if cached is not None:
            return cached
        if len(self._failure_events) >= EVENT_ANSWERS:
            self._failure_events.clear()
        # The member whose failure failed the job, not a peer that its agent stopped afterwards.
        failed = job.failed_member()
        event = self._failure_events[key] = pb.JobEvent(
            kind=pb.JobEvent.JOB_FAILED,
            job=job.name,
            generation=job.generation,
            rank=failed.rank if failed and failed.rank is not None else -1,
            host=failed.host if failed else "",
            reason=job.reason,
            time=job.ended or job.formed,
            failure=failure_message(failed.failure if failed else None),
        )
        return event

    async def Leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LeaveResponse:
        member_id = validation.member_id(request.member_id)
        secret = validation.secret(request.secret)
        exit_code = validation.exit_code(request.exit_code)
        reason = validation.reason(request.reason)
        job = self._membership.leave(member_id, secret, exit_code, reason)
        await self._durable(job)
        return pb.LeaveResponse(job_state=job.state.value)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.JobEvent]:
        name = validation.job_name(request.job)
        validation.watch_generation(request.generation)
        queue = self._events.subscribe(name)
        try:
            job = self._membership.job(name)
            if job is not None and job.state is JobState.FAILED:
                yield self._failure_event(name)
            elif job is not None and job.state is not JobState.FORMING:
                kind = EventKind.JOB_FINISHED if job.state is JobState.FINISHED else EventKind.WORLD_FORMED
                yield event_message(JobEvent(kind, job.name, job.generation, job.ended or job.formed))
            while True:
                event = await queue.get()
                if not isinstance(event, JobEvent):  # progress asks go to Heartbeat streams only
                    continue
                if request.generation and event.generation < request.generation:
                    continue
                yield event_message(event)
        finally:
            self._events.unsubscribe(name, queue)

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListJobsResponse:
        selection = validation.member_selection(request)
        if request.job:
            name = validation.job_name(request.job)
            if not (request.member_offset or request.member_states):
                # Its by-exception reporters report its members' progress first (a bounded wait;
                # status's further pages and its list of failed members do not ask again).
                await self.streams.gather(name)
            job = self._membership.job(name)
            return jobs_message([job] if job else [], self._membership.stall, selection)
        return jobs_message(self._membership.jobs(), self._membership.stall, selection)


def _rank(rank: int | None) -> int:
    # Every member of a formed world has a rank; None here would be a bug in membership.
    if rank is None:
        raise RuntimeError("a member of a formed world has no rank")
    return rank
