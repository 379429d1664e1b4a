"""The Coordinator servicer of a replica that shares an etcd store: the leader's term serves each
call; a standby answers every call with :class:`NotLeaderError` (UNAVAILABLE, the leader's address
in the trailing metadata, set by the interceptor), and so does a leader that steps down while a
call is in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from sarcomm.common.errors import NotLeaderError
from sarcomm.coordinator.term import Term
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext[Any, Any]


class LeaderRouter(pb_grpc.CoordinatorServicer):
    """``term()`` is the current term (None while standing by); ``not_leader()`` the error then."""

    def __init__(self, term: Callable[[], Term | None], not_leader: Callable[[], NotLeaderError]) -> None:
        self._term = term
        self._not_leader = not_leader

    def _serving(self) -> Term:
        term = self._term()
        if term is None or term.ended:
            raise self._not_leader()
        return term

    async def Join(self, request: pb.JoinRequest, context: Context) -> pb.JoinResponse:
        term = self._serving()
        with term.call(self._not_leader):
            return await term.service.Join(request, context)

    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveResponse:
        term = self._serving()
        with term.call(self._not_leader):
            return await term.service.Leave(request, context)

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        term = self._serving()
        with term.call(self._not_leader):
            return await term.service.ListJobs(request, context)

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: Context
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        term = self._serving()
        with term.call(self._not_leader):
            async for response in term.service.Heartbeat(request_iterator, context):
                yield response

    async def Watch(self, request: pb.WatchRequest, context: Context) -> AsyncIterator[pb.JobEvent]:
        term = self._serving()
        with term.call(self._not_leader):
            async for event in term.service.Watch(request, context):
                yield event
