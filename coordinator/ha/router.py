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
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext[Any, Any]


def _unary(name: str) -> Callable[..., Any]:
    async def route(self: Any, request: Any, context: Context) -> Any:
        term = self._serving()
        with term.call(self._not_leader):
            return await getattr(term.service, name)(request, context)

    return route


def _streaming(name: str) -> Callable[..., Any]:
    async def route(self: Any, request: Any, context: Context) -> AsyncIterator[Any]:
        term = self._serving()
        with term.call(self._not_leader):
            async for message in getattr(term.service, name)(request, context):
                yield message

    return route


def _reader_writer(name: str) -> Callable[..., Any]:
    """A streaming RPC that the service serves in the reader-writer form (it writes its answers
    with ``context.write`` and returns None; see CoordinatorService.Heartbeat)."""

    async def route(self: Any, request_iterator: Any, context: Context) -> None:
        term = self._serving()
        with term.call(self._not_leader):
            await getattr(term.service, name)(request_iterator, context)

    return route


class LeaderRouter(pb_grpc.CoordinatorServicer):
    """``term()`` is the current term (None while standing by); ``not_leader()`` the error then.

    Every method of the ``Coordinator`` service is routed the same way: one router per kind of
    call (unary, server-streaming, reader-writer streaming), named below once per RPC
    (tests/test_router.py checks that every RPC of the service descriptor is routed, in the form
    the service serves it, so a new RPC cannot be forgotten here)."""

    def __init__(self, term: Callable[[], Term | None], not_leader: Callable[[], NotLeaderError]) -> None:
        self._term = term
        self._not_leader = not_leader

    def _serving(self) -> Term:
        term = self._term()
        if term is None or term.ended:
            raise self._not_leader()
        return term

    Join = _unary("Join")
    Leave = _unary("Leave")
    ListJobs = _unary("ListJobs")
    Heartbeat = _reader_writer("Heartbeat")
    Watch = _streaming("Watch")
