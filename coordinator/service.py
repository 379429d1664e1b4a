"""The ``sarcomm.v1.Coordinator`` gRPC servicer: translation between messages and the domain.

Logic lives in :mod:`membership`; checks in :mod:`validation`; the mapping of errors to status
codes in :mod:`interceptor`. Handlers here only convert, wait and stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sarcomm.coordinator import validation
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.errors import FailedPreconditionError, JoinTimeoutError, SarcommError
from sarcomm.coordinator.events import EventHub
from sarcomm.coordinator.interfaces import parse_peer
from sarcomm.coordinator.membership import EventKind, JobEvent, JobState, Membership
from sarcomm.coordinator.metrics import CoordinatorMetrics
from sarcomm.coordinator.views import event_message, job_status
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_END_OF_STREAM = object()


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        membership: Membership,
        events: EventHub,
        metrics: CoordinatorMetrics,
        config: CoordinatorConfig,
    ) -> None:
        self._membership = membership
        self._events = events
        self._metrics = metrics
        self._config = config

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.JoinResponse:
        spec = validation.join_spec(request, parse_peer(context.peer()), self._config.limits)
        ticket = self._membership.join(spec)
        self._metrics.joins.inc(len(spec.members))
        job = ticket.job
        timeout = min(request.join_timeout_seconds or self._config.join_timeout, self._config.join_timeout)
        try:
            await asyncio.wait_for(job.formed_event.wait(), timeout)
        except TimeoutError:
            missing = self._membership.missing_description(job)
            self._membership.abandon(ticket)
            raise JoinTimeoutError(
                f"join_timeout_seconds {timeout:g}: {job.label} did not form in time: {missing}"
            ) from None
        except asyncio.CancelledError:
            # The caller hung up or its own deadline passed: its members must not count any more.
            self._membership.abandon(ticket)
            raise
        if job.state is JobState.FORMING:
            raise FailedPreconditionError(f"{job.label} was abandoned before its world formed")
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
            assignments=[
                pb.Assignment(rank=_rank(m.rank), local_rank=m.local_rank, member_id=m.member_id, secret=s)
                for m, s in zip(ticket.members, ticket.secrets, strict=True)
            ],
        )

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        # Acks and pushed events share one outbox so a failure reaches the reporter at once,
        # not at its next beat.
        outbox: asyncio.Queue[object] = asyncio.Queue()
        events: asyncio.Queue[JobEvent] = asyncio.Queue(256)
        watched: set[str] = set()

        async def read_reports() -> None:
            try:
                async for request in request_iterator:
                    outbox.put_nowait(self._handle_reports(request, watched, events))
            finally:
                outbox.put_nowait(_END_OF_STREAM)

        async def forward_events() -> None:
            while True:
                event = await events.get()
                outbox.put_nowait(pb.HeartbeatResponse(events=[event_message(event)]))

        reader = asyncio.create_task(read_reports())
        forwarder = asyncio.create_task(forward_events())
        try:
            while True:
                item = await outbox.get()
                if item is _END_OF_STREAM:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, pb.HeartbeatResponse)
                yield item
            await reader
        finally:
            reader.cancel()
            forwarder.cancel()
            for job in watched:
                self._events.unsubscribe(job, events)

    def _handle_reports(
        self, request: pb.HeartbeatRequest, watched: set[str], events: asyncio.Queue[JobEvent]
    ) -> pb.HeartbeatResponse | SarcommError:
        response = pb.HeartbeatResponse()
        try:
            for i, report in enumerate(request.reports):
                field = f"reports[{i}]"
                member_id = validation.member_id(report.member_id, f"{field}.member_id")
                progress = (
                    validation.progress(report.progress, f"{field}.progress")
                    if report.HasField("progress")
                    else None
                )
                address = validation.metrics_address(report.metrics_address, f"{field}.metrics_address")
                try:
                    job, _ = self._membership.heartbeat(member_id, report.secret, progress, address)
                except SarcommError as error:
                    if error.code is not grpc.StatusCode.NOT_FOUND:
                        raise
                    response.unknown_members.append(member_id)
                    continue
                self._metrics.heartbeats.inc()
                if job.name not in watched:
                    watched.add(job.name)
                    self._events.subscribe(job.name, events)
                    if job.state is JobState.FAILED:
                        # Subscribed after the failure was announced: tell this reporter now.
                        response.events.append(self._failure_event(job.name))
        except SarcommError as error:
            return error
        return response

    def _failure_event(self, job_name: str) -> pb.JobEvent:
        job = self._membership.job(job_name)
        assert job is not None
        failed = next((m for m in job.members if m.state.value == "FAILED"), None)
        return pb.JobEvent(
            kind=pb.JobEvent.JOB_FAILED,
            job=job.name,
            generation=job.generation,
            rank=failed.rank if failed and failed.rank is not None else -1,
            host=failed.host if failed else "",
            reason=job.reason,
            time=job.ended or job.formed,
        )

    async def Leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LeaveResponse:
        member_id = validation.member_id(request.member_id)
        exit_code = validation.exit_code(request.exit_code)
        reason = validation.reason(request.reason)
        job = self._membership.leave(member_id, request.secret, exit_code, reason)
        return pb.LeaveResponse(job_state=job.state.value)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.JobEvent]:
        name = validation.job_name(request.job)
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
                if request.generation and event.generation < request.generation:
                    continue
                yield event_message(event)
        finally:
            self._events.unsubscribe(name, queue)

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListJobsResponse:
        if request.job:
            name = validation.job_name(request.job)
            job = self._membership.job(name)
            return pb.ListJobsResponse(jobs=[job_status(job)] if job else [])
        return pb.ListJobsResponse(jobs=[job_status(j) for j in self._membership.jobs()])


def _rank(rank: int | None) -> int:
    # Every member of a formed world has a rank; None here would be a bug in membership.
    if rank is None:
        raise RuntimeError("a member of a formed world has no rank")
    return rank
