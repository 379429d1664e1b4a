"""The gRPC floor under ``big_job.py``: a server of ``sarcomm.v1.Coordinator`` with the same
``grpc.aio`` server and options as ``sar-coordinator`` (keepalive pings, limits) that does
nothing a coordinator decides. Its Join calls wait until ``world_size`` members have joined (a
barrier, as TCPStore's) and get a canned answer; every Heartbeat request gets the same ack without
being read. What it costs is what gRPC, the event loop and the kernel cost for the same calls: the
least any coordinator on this stack can spend, measured beside it in the same run (with as many
TCP connections: ``big_job.py`` counts them, one per simulated agent).

With ``--lease S`` the first answer of each Heartbeat stream offers a ``ReportPolicy`` with that
lease, as a coordinator that takes reports by exception does: the floor of that protocol (what gRPC
costs for the lease renewals of open streams, and their keepalive pings).

``python grpc_floor.py --listen HOST:PORT --http HOST:PORT [--lease S]`` runs until SIGTERM. Its HTTP side
answers ``/healthz`` and ``/metrics`` with the counters ``big_job.py`` reads:
``sar_coordinator_rendezvous_duration_seconds_sum`` (first Join to the last one joined, s),
``sar_coordinator_heartbeats_total`` (requests x members per Join) and
``sar_coordinator_gc_pause_seconds_sum`` (0).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import time
from typing import Any

import grpc
from aiohttp import web

from sarcomm.coordinator.domain.liveness import keepalive_settings
from sarcomm.coordinator.fdlimit import raise_open_file_limit
from sarcomm.v1 import coordinator_pb2 as pb

SERVICE = "sarcomm.v1.Coordinator"
LIVENESS_TIMEOUT_S = 3.0


class Floor:
    """Join as a barrier, Heartbeat as an ack, Leave as nothing."""

    def __init__(self, lease: float = 0.0) -> None:
        self.joined = 0
        self.ranks = 0
        self.members_per_join = 1
        self.first_join = 0.0
        self.formed = 0.0
        self.requests = 0
        self.world: asyncio.Future[None] | None = None
        self.ack = pb.HeartbeatResponse(heartbeat_interval_seconds=1.0).SerializeToString()
        # With a lease: the first answer of each stream offers reporting by exception.
        policy = pb.ReportPolicy(
            lease_seconds=lease, silence_seconds=3.0, quiet_seconds=5.0, progress_seconds=10.0
        )
        self.offer = (
            pb.HeartbeatResponse(heartbeat_interval_seconds=1.0, policy=policy).SerializeToString()
            if lease > 0
            else self.ack
        )

    async def join(self, raw: bytes, context: Any) -> bytes:
        request = pb.JoinRequest.FromString(raw)
        if self.world is None:
            self.world = asyncio.get_running_loop().create_future()
            self.first_join = time.time()
        count = max(1, len(request.members))
        self.members_per_join = count
        first_rank = self.ranks
        self.ranks += count
        if self.ranks >= request.world_size and not self.world.done():
            self.formed = time.time()
            self.world.set_result(None)
        await self.world
        assignments = [
            pb.Assignment(rank=first_rank + k, local_rank=k, member_id=os.urandom(8).hex(), secret="s" * 32)
            for k in range(count)
        ]
        return pb.JoinResponse(
            job=request.job, generation=1, world_size=request.world_size, master_addr="127.0.0.1",
            master_port=29500, interface="lo", address="127.0.0.1", heartbeat_interval_seconds=1.0,
            assignments=assignments,
        ).SerializeToString()  # fmt: skip

    async def heartbeat(self, requests: Any, context: Any) -> Any:
        answer = self.offer
        async for _ in requests:
            self.requests += 1
            yield answer
            answer = self.ack

    async def leave(self, raw: bytes, context: Any) -> bytes:
        return pb.LeaveResponse(job_state="RUNNING").SerializeToString()

    def metrics(self) -> str:
        formed = max(0.0, self.formed - self.first_join) if self.formed else 0.0
        return (
            f"sar_coordinator_rendezvous_duration_seconds_sum {formed}\n"
            f"sar_coordinator_heartbeats_total {self.requests * self.members_per_join}\n"
            "sar_coordinator_gc_pause_seconds_sum 0\n"
        )


async def serve(listen: str, http: str, lease: float) -> None:
    floor = Floor(lease)
    ping_every, answer_within = keepalive_settings(LIVENESS_TIMEOUT_S)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.keepalive_time_ms", int(ping_every * 1000)),
            ("grpc.keepalive_timeout_ms", int(answer_within * 1000)),
            ("grpc.http2.ping_timeout_ms", int(answer_within * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.server.max_pending_requests", 2 * 65536),
            ("grpc.server.max_pending_requests_hard_limit", 4 * 65536),
        ]
    )
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(floor.join),
        "Heartbeat": grpc.stream_stream_rpc_method_handler(floor.heartbeat),
        "Leave": grpc.unary_unary_rpc_method_handler(floor.leave),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    server.add_insecure_port(listen)
    await server.start()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=floor.metrics())

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "SERVING", "role": "leader"})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = http.rpartition(":")
    await web.TCPSite(runner, host, int(port)).start()
    # As the coordinator: what lives as long as the process is kept away from the collector.
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--http", required=True)
    parser.add_argument(
        "--lease", type=float, default=0.0, help="offer reporting by exception with this lease, s (0: never)"
    )
    args, _ = parser.parse_known_args()
    # As the coordinator: one descriptor per agent connection, so the hard limit's worth of them.
    raise_open_file_limit()
    try:
        import uvloop

        uvloop.run(serve(args.listen, args.http, args.lease))
    except ImportError:
        asyncio.run(serve(args.listen, args.http, args.lease))


if __name__ == "__main__":
    main()
