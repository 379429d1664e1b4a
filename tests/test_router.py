"""The router that serves every Coordinator call from the seat's current term (SQLite and etcd alike)."""

from __future__ import annotations

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
        kind = "async_generator" if method.server_streaming else "coroutine"
        code = routed.__code__
        is_generator = bool(code.co_flags & 0x200)  # CO_ASYNC_GENERATOR
        assert is_generator == (kind == "async_generator"), method.name
