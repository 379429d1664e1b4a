"""Raw abuse on the coordinator's gRPC and HTTP ports, while a job runs alongside.

Random bytes, HTTP/1.1 and a TLS ClientHello to the gRPC port, broken HTTP/2 after a valid
preface, half-open connections held throughout, 10,000 rapid connects, oversized messages and
headers. Throughout, the gRPC health check must answer SERVING every time it is asked, and the job
formed beside it must keep its members alive (heartbeats) and finish correctly.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.messages import MemberReport
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO, wait_for_async

RAPID_CONNECTS = 10_000
HALF_OPEN = 300
# A health check must answer within this, every time, while the abuse lasts.
HEALTH_DEADLINE_S = 2.0
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP1_TO_GRPC = b"GET / HTTP/1.1\r\nHost: coordinator\r\n\r\n"
BIG_HEADER = b"GET /healthz HTTP/1.1\r\nHost: c\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
BIG_BODY = b"POST /v1/jobs HTTP/1.1\r\nHost: c\r\nContent-Length: 5000000\r\n\r\n" + b"x" * 5_000_000


def _connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _send_and_drain(port: int, payload: bytes, read: bool = True) -> None:
    """Send ``payload`` and read whatever comes back until the peer closes (or 2 s pass)."""
    try:
        with _connect(port) as sock:
            sock.sendall(payload)
            sock.settimeout(2.0)
            while read and sock.recv(65536):
                pass
    except OSError:
        pass  # being cut off is a fine answer to garbage


def _random_bytes(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def _h2_garbage(rng: random.Random) -> bytes:
    """A valid preface, then frames with random types, flags, stream ids and lengths."""
    frames = b""
    for _ in range(rng.randint(1, 8)):
        body = rng.randbytes(rng.randint(0, 300))
        length = rng.choice([len(body), rng.randint(0, 2**24 - 1)])
        frames += struct.pack(">I", length)[1:] + bytes([rng.randint(0, 255), rng.randint(0, 255)])
        frames += struct.pack(">I", rng.randint(0, 2**31 - 1)) + body
    return H2_PREFACE + frames


def _tls_client_hello(port: int) -> None:
    context = ssl.create_default_context()
    try:
        with _connect(port) as sock, context.wrap_socket(sock, server_hostname="127.0.0.1"):
            pass
    except (ssl.SSLError, OSError):
        pass


def _rapid_connects(port: int, count: int) -> int:
    """Connect and close ``count`` times, half with a reset (SO_LINGER 0); returns those accepted."""
    accepted = 0
    for i in range(count):
        try:
            sock = _connect(port, timeout=5)
        except OSError:
            continue
        accepted += 1
        if i % 2:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    return accepted


def _abuse(coord: CoordinatorProcess, stop_half_open: threading.Event) -> dict[str, int]:
    """Everything, from threads; returns counts of what was done."""
    rng = random.Random(7)
    grpc_port, http_port = coord.grpc_port, coord.http_port
    done: dict[str, int] = {}
    held: list[socket.socket] = []
    # Half-open connections: some silent, some with a partial preface or request line; held
    # until the end (the coordinator drops the gRPC ones after its handshake timeout).
    for i in range(HALF_OPEN):
        port = grpc_port if i % 3 else http_port
        try:
            sock = _connect(port)
            sock.sendall([b"", b"PRI * HTTP/2.0\r\n", b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n"][i % 3])
            held.append(sock)
        except OSError:
            pass
    done["half_open"] = len(held)
    with futures.ThreadPoolExecutor(8) as pool:

        def garbage(size: int) -> bytes:
            return _random_bytes(rng, rng.randint(1, size))

        work: list[tuple[Callable[..., None], tuple[object, ...]]] = [
            *((_send_and_drain, (grpc_port, garbage(65536))) for _ in range(100)),
            *((_send_and_drain, (http_port, garbage(65536))) for _ in range(100)),
            *((_send_and_drain, (grpc_port, _h2_garbage(rng))) for _ in range(100)),
            *((_send_and_drain, (grpc_port, HTTP1_TO_GRPC)) for _ in range(50)),
            *((_tls_client_hello, (port,)) for port in (grpc_port, http_port) for _ in range(20)),
            # Oversized on HTTP: a 100 KB header line, a 5 MB body nobody asked for.
            *((_send_and_drain, (http_port, BIG_HEADER)) for _ in range(10)),
            *((_send_and_drain, (http_port, BIG_BODY)) for _ in range(4)),
        ]
        jobs = [pool.submit(function, *args) for function, args in work]
        for job in jobs:
            job.result()
        done["garbage_connections"] = len(jobs)
        per_thread = RAPID_CONNECTS // 4
        rapid = [pool.submit(_rapid_connects, grpc_port, per_thread) for _ in range(3)]
        rapid.append(pool.submit(_rapid_connects, http_port, RAPID_CONNECTS - 3 * per_thread))
        done["rapid_connects"] = sum(r.result() for r in rapid)
    stop_half_open.wait(30)
    for sock in held:
        sock.close()
    return done


async def _health_monitor(target: str, stop: asyncio.Event, results: list[tuple[float, str]]) -> None:
    """Ask grpc.health.v1 every 50 ms until ``stop``; record each answer (or failure)."""
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            started = time.monotonic()
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_DEADLINE_S)
                results.append(
                    (
                        time.monotonic() - started,
                        health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status),
                    )
                )
            except grpc.aio.AioRpcError as error:
                results.append((time.monotonic() - started, f"{error.code().name}: {error.details()}"))
            await asyncio.sleep(0.05)


async def test_raw_abuse_leaves_the_coordinator_serving_and_a_job_alongside_finishing(
    start_coordinator: StartCoordinator,
) -> None:
    coord = start_coordinator(
        "--heartbeat-interval", "1", "--join-timeout", "60", "--max-message-bytes", "1048576"
    )
    assert coord.proc is not None
    process = psutil.Process(coord.proc.pid)
    stop = asyncio.Event()
    checks: list[tuple[float, str]] = []
    monitor = asyncio.ensure_future(_health_monitor(coord.grpc_target, stop, checks))
    async with CoordinatorClient(coord.grpc_target, timeout=10) as client:
        members = await asyncio.wait_for(
            asyncio.gather(*(client.join("alongside", 2, host=f"h{i}", interfaces=[LO]) for i in range(2))),
            20,
        )
        reports = [MemberReport(m.member_id, m.secret) for m in members]
        async with client.heartbeats(lambda: reports, 0.25) as beats:
            replies: list[object] = []

            async def collect() -> None:
                async for reply in beats:
                    replies.append(reply)

            collector = asyncio.ensure_future(collect())
            release = threading.Event()
            abuse = asyncio.ensure_future(asyncio.to_thread(_abuse, coord, release))
            # Oversized gRPC messages while the rest goes on: refused, the channel stays usable.
            async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                for _ in range(5):
                    request = pb.JoinRequest(job="big", world_size=1, host="h" * 2_000_000)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Join(request, timeout=10)
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # The half-open connections stay held while 20 more health checks (about a second)
            # and the heartbeats go on.
            checks_before = len(checks)
            await wait_for_async(
                lambda: len(checks) >= checks_before + 20,
                30,
                what=lambda: f"20 health checks during the abuse: {checks[-3:]}",
            )
            release.set()
            done = await asyncio.wait_for(abuse, 240)
            # The job alongside: its members stayed alive through all of it, and it finishes.
            jobs = await client.list_jobs("alongside")
            assert [(j.state, sorted(m.state for m in j.members)) for j in jobs] == [
                ("RUNNING", ["RUNNING", "RUNNING"])
            ]
            collector.cancel()
        states = [await client.leave(m.member_id, m.secret, 0) for m in members]
    assert states == ["RUNNING", "FINISHED"]
    stop.set()
    await monitor
    failures = [c for c in checks if c[1] != "SERVING"]
    assert not failures, failures[:5]
    assert len(checks) >= 20
    assert done["rapid_connects"] >= RAPID_CONNECTS * 0.99
    assert done["half_open"] >= HALF_OPEN * 0.99
    assert len(replies) > 0
    assert process.is_running()
    # A job formed now still works, and nothing went wrong inside.
    async with CoordinatorClient(coord.grpc_target, timeout=10) as client:
        after = await asyncio.wait_for(
            asyncio.gather(*(client.join("after", 2, host=f"h{i}", interfaces=[LO]) for i in range(2))), 20
        )
        assert sorted(m.rank for m in after) == [0, 1]
    log = coord.log()
    assert "failed unexpectedly" not in log
    assert "Traceback" not in log
    print(f"abuse: {done}; {len(checks)} health checks, slowest {max(c[0] for c in checks):.3f} s; "
          f"coordinator RSS {process.memory_info().rss / 2**20:.0f} MiB, pid {os.getpid()}")  # fmt: skip
