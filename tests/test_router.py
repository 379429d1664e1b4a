"""The router that serves every Coordinator call from the seat's current term (SQLite and etcd alike)."""

from __future__ import annotations

import inspect

from sarcomm.coordinator.api.service import CoordinatorService
from sarcomm.coordinator.ha.router import LeaderRouter
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc


def test_every_rpc_of_the_service_is_routed() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods
    assert methods, "the descriptor lists the service's RPCs"
    for method in methods:
        routed = LeaderRouter.__dict__.get(method.name)
        assert routed is not None, f"LeaderRouter does not route {method.name}"
        assert routed is not getattr(pb_grpc.CoordinatorServicer, method.name)
        # Routed in the form the service serves it: an async generator, or a coroutine (a unary
        # RPC, or a streaming one in the reader-writer form, which writes with context.write).
        served = getattr(CoordinatorService, method.name)
        if method.server_streaming:
            assert inspect.isasyncgenfunction(served) or inspect.iscoroutinefunction(served), method.name
        else:
            assert inspect.iscoroutinefunction(served), method.name
        assert inspect.isasyncgenfunction(routed) == inspect.isasyncgenfunction(served), method.name
        assert inspect.iscoroutinefunction(routed) == inspect.iscoroutinefunction(served), method.name
