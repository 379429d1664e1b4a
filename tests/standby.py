"""A standby coordinator as the clients see it, for the failover tests of the client side.

Why it stands in: the real standby is ``sar-coordinator --store etcd://...`` when another
coordinator leads (branch etcd-store, not on this branch yet). What a client sees of it is the
contract in :mod:`sarcomm.common.errors`, and this server keeps exactly that contract over real
gRPC: every ``sarcomm.v1.Coordinator`` RPC (Join, Heartbeat, Leave, Watch, ListJobs) answered
UNAVAILABLE with a sentence and the trailing metadata ``sarcomm-leader`` = the leader's
``HOST:PORT`` (``""`` while none is known), and ``grpc.health.v1.Health`` NOT_SERVING for
``sarcomm.v1.Coordinator``. It runs in the test's process on a real port; the leader it names is a
real ``sar-coordinator``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sarcomm.common.client.channel import COORDINATOR_SERVICE
from sarcomm.common.errors import LEADER_METADATA_KEY
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

_Context = grpc.aio.ServicerContext[Any, Any]


class _Refusing(pb_grpc.CoordinatorServicer):
    """Refuses every call as a standby does; counts them by method."""

    def __init__(self, standby: Standby) -> None:
        self._standby = standby

    async def _refuse(self, method: str, context: _Context) -> NoReturn:
        self._standby.calls[method] = self._standby.calls.get(method, 0) + 1
        leader = self._standby.leader
        named = f"the leader is {leader}" if leader else "no leader is known yet"
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"this coordinator is a standby: {named}",
            trailing_metadata=((LEADER_METADATA_KEY, leader),),
        )

    async def Join(self, request: pb.JoinRequest, context: _Context) -> pb.JoinResponse:
        await self._refuse("Join", context)

    async def _refused_stream(self, method: str, context: _Context) -> list[Any]:
        """:meth:`_refuse` for a streaming method (typed as the no messages it sends)."""
        await self._refuse(method, context)

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: _Context
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        for message in await self._refused_stream("Heartbeat", context):
            yield message

    async def Leave(self, request: pb.LeaveRequest, context: _Context) -> pb.LeaveResponse:
        await self._refuse("Leave", context)

    async def Watch(self, request: pb.WatchRequest, context: _Context) -> AsyncIterator[pb.JobEvent]:
        for message in await self._refused_stream("Watch", context):
            yield message

    async def ListJobs(self, request: pb.ListJobsRequest, context: _Context) -> pb.ListJobsResponse:
        await self._refuse("ListJobs", context)


class Standby:
    """``async with Standby(leader) as s``: a standby on ``s.target`` naming ``leader`` (settable;
    "" = no leader known); ``s.calls`` counts the refused calls by method."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.calls: dict[str, int] = {}
        self._server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(_Refusing(self), self._server)
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> Standby:
        await self._health.set(COORDINATOR_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop(None)
