"""The coordinator process over real gRPC and HTTP: streams, events, health, reflection, shutdown.

Uses the generated stub directly, so these tests pin the wire contract independently of the
worker-side client.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sarcomm.common.constants import JOIN_ANSWER_SLACK_S
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator, store_args
from tests.helpers import LO_PB as LO
from tests.helpers import read_message, wait_for


def join_request(host: str, nproc: int, job: str = "rpc", world_size: int = 4, **kw: Any) -> pb.JoinRequest:
    return pb.JoinRequest(
        job=job,
        world_size=world_size,
        host=host,
        interfaces=[LO],
        store_port=29500,
        members=[pb.MemberSpec(local_rank=i) for i in range(nproc)],
        **kw,
    )


async def form(stub: pb_grpc.CoordinatorAsyncStub, job: str = "rpc") -> list[pb.JoinResponse]:
    return list(
        await asyncio.gather(
            stub.Join(join_request("a", 2, job), timeout=10), stub.Join(join_request("b", 2, job), timeout=10)
        )
    )


def reports(responses: list[pb.JoinResponse]) -> list[pb.MemberReport]:
    return [pb.MemberReport(member_id=a.member_id, secret=a.secret) for r in responses for a in r.assignments]


@pytest.fixture
async def stub(coordinator: CoordinatorProcess) -> AsyncIterator[pb_grpc.CoordinatorAsyncStub]:
    async with grpc.aio.insecure_channel(coordinator.grpc_target) as channel:
        yield pb_grpc.CoordinatorStub(channel)


async def test_heartbeat_stream_acks_and_pushes_failure_of_a_peer(
    stub: pb_grpc.CoordinatorAsyncStub, coordinator: CoordinatorProcess
) -> None:
    responses = await form(stub)
    outgoing: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.HeartbeatRequest]:
        while (item := await outgoing.get()) is not None:
            yield item

    call = stub.Heartbeat(requests(), timeout=20)
    outgoing.put_nowait(pb.HeartbeatRequest(reports=reports(responses)[:3]))
    ack = await read_message(call, pb.HeartbeatResponse, 5)
    assert list(ack.unknown_members) == []
    assert list(ack.events) == []
    # Rank 3 reports failure through Leave; the stream learns without sending anything more.
    failed = responses[1].assignments[1]
    await stub.Leave(
        pb.LeaveRequest(member_id=failed.member_id, secret=failed.secret, exit_code=7), timeout=5
    )
    pushed = await read_message(call, pb.HeartbeatResponse, 5)
    kinds = [e.kind for e in pushed.events]
    assert kinds[0] == pb.JobEvent.MEMBER_FAILED
    event = pushed.events[0]
    assert (event.rank, event.host, event.reason) == (failed.rank, "b", "exited with code 7")
    outgoing.put_nowait(None)
    call.cancel()
    jobs = coordinator.get_json("/v1/jobs")
    assert jobs["jobs"][0]["state"] == "FAILED"  # type: ignore[index]
    assert jobs["jobs"][0]["reason"] == f"rank {failed.rank} on host b failed: exited with code 7"  # type: ignore[index]


async def test_heartbeat_stream_answers_unauthenticated_if_secret_wrong(
    stub: pb_grpc.CoordinatorAsyncStub,
) -> None:
    responses = await form(stub)
    member = responses[0].assignments[0]
    call = stub.Heartbeat(
        iter(
            [
                pb.HeartbeatRequest(
                    reports=[pb.MemberReport(member_id=member.member_id, secret="not-the-secret")]
                )
            ]
        ),
        timeout=5,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_sweep_fails_job_and_watch_tells_if_member_goes_silent(
    stub: pb_grpc.CoordinatorAsyncStub, coordinator: CoordinatorProcess
) -> None:
    await form(stub, job="silent")
    watch = stub.Watch(pb.WatchRequest(job="silent"), timeout=15)
    first = await read_message(watch, pb.JobEvent, 5)
    assert first.kind == pb.JobEvent.WORLD_FORMED
    # Nobody heartbeats: the coordinator (0.5 s x 3 misses) must fail a member within ~2 s.
    failed = await read_message(watch, pb.JobEvent, 5)
    assert failed.kind == pb.JobEvent.MEMBER_FAILED
    assert failed.reason.startswith("missed heartbeats: never heard from in the ")
    watch.cancel()
    metrics = coordinator.get_text("/metrics")
    assert 'sar_coordinator_member_failures_total{reason="missed_heartbeats"}' in metrics


async def test_sd_lists_reported_metrics_endpoints_with_labels(
    stub: pb_grpc.CoordinatorAsyncStub, coordinator: CoordinatorProcess
) -> None:
    responses = await form(stub, job="sd")
    beats = reports(responses)
    rank_of = {a.member_id: (a.rank, r) for r in responses for a in r.assignments}
    for report in beats:
        report.metrics_address = f"0.0.0.0:{9100 + rank_of[report.member_id][0]}"
    host_of_rank = {rank: ("a" if response is responses[0] else "b") for rank, response in rank_of.values()}
    call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=beats)]), timeout=5)
    # Read to the end: the request iterator's end half-closes the stream, an orderly end. (A
    # cancelled stream reads as a dead reporter, whose members the coordinator then fails.)
    async for _ in call:
        pass
    groups = coordinator.get_json("/sd")
    assert isinstance(groups, list)
    workers = sorted(
        (g for g in groups if g["labels"]["job"] == "sd"), key=lambda g: int(g["labels"]["rank"])
    )
    assert [g["targets"] for g in workers] == [[f"127.0.0.1:{9100 + i}"] for i in range(4)]
    assert [g["labels"] for g in workers] == [
        {"job": "sd", "rank": str(i), "host": host_of_rank[i], "generation": "1"} for i in range(4)
    ]
    assert any(g["labels"]["job"] == "sar-coordinator" for g in groups)


async def test_join_says_why_the_world_did_not_form_before_the_callers_deadline(
    stub: pb_grpc.CoordinatorAsyncStub,
) -> None:
    # The coordinator (--join-timeout 60) stops waiting JOIN_ANSWER_SLACK_S before the call's own
    # deadline: the caller hears what is missing, not its own bare "Deadline Exceeded".
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Join(join_request("a", 1, "deadline"), timeout=JOIN_ANSWER_SLACK_S + 2)
    took = time.monotonic() - started
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    details = caught.value.details() or ""
    assert details.startswith(
        "join_timeout_seconds 60: job 'deadline' generation 1 did not form in time: 1 of 4 members joined"
    ), details
    assert 1.5 <= took < JOIN_ANSWER_SLACK_S + 2, took


async def test_health_serving_and_reflection_lists_services(coordinator: CoordinatorProcess) -> None:
    async with grpc.aio.insecure_channel(coordinator.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "sarcomm.v1.Coordinator"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"sarcomm.v1.Coordinator", "grpc.health.v1.Health"} <= names


async def test_sigterm_sets_not_serving_then_exits_cleanly(coordinator: CoordinatorProcess) -> None:
    async with grpc.aio.insecure_channel(coordinator.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=15)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        assert coordinator.proc is not None
        coordinator.proc.send_signal(signal.SIGTERM)
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await asyncio.to_thread(coordinator.proc.wait, 15) == 0
    assert "coordinator stopped" in coordinator.log()


def _until_leader(coord: CoordinatorProcess) -> None:
    """Wait until ``coord`` leads (at once on SQLite; on etcd once it holds the leader key)."""
    wait_for(lambda: dict(coord.get_json("/healthz"))["role"] == "leader", 15, what="it to lead")  # type: ignore[call-overload]


async def test_restart_with_same_state_keeps_job(
    start_coordinator: StartCoordinator, state_backend: dict[str, object]
) -> None:
    first: CoordinatorProcess = start_coordinator(
        "--heartbeat-interval", "5", *store_args(state_backend), state=False
    )
    await asyncio.to_thread(_until_leader, first)
    async with grpc.aio.insecure_channel(first.grpc_target) as channel:
        responses = await form(pb_grpc.CoordinatorStub(channel), job="keep")
    before = first.get_json("/v1/jobs")
    first.kill()
    first.start()
    # On etcd the killed leader's lease holds the key for its TTL: until then the restarted one
    # stands by (and answers /v1/jobs from etcd); then it leads again.
    after = first.get_json("/v1/jobs")
    assert after == before
    await asyncio.to_thread(_until_leader, first)
    assert first.get_json("/v1/jobs") == before
    async with grpc.aio.insecure_channel(first.grpc_target) as channel:
        member = responses[0].assignments[0]
        left = await pb_grpc.CoordinatorStub(channel).Leave(
            pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=0), timeout=5
        )
    assert left.job_state == "RUNNING"


# A member on host "a" that joins, streams reports until it is killed, and says when it streams.
_STREAMING_MEMBER = """
import asyncio, sys
import grpc
from sarcomm.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc

async def main(target):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        lo = pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)
        joined = await stub.Join(pb.JoinRequest(job="blame", world_size=2, host="a", interfaces=[lo],
            store_port=29500, members=[pb.MemberSpec(local_rank=0)]), timeout=20)
        member = joined.assignments[0]
        async def beats():
            while True:
                report = pb.MemberReport(member_id=member.member_id, secret=member.secret)
                yield pb.HeartbeatRequest(reports=[report])
                await asyncio.sleep(0.2)
        call = stub.Heartbeat(beats(), timeout=60)
        await call.read()
        print(member.rank, flush=True)
        async for _ in call:
            pass

asyncio.run(main(sys.argv[1]))
"""


async def test_a_peer_failing_right_after_a_host_is_killed_does_not_take_the_blame(
    stub: pb_grpc.CoordinatorAsyncStub, coordinator: CoordinatorProcess
) -> None:
    # A killed host closes its connections at once: the peer's collective fails and its non-zero
    # exit races the dead host's broken stream to the coordinator. The dead host must be blamed.
    killed = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything is awaited)
        [sys.executable, "-c", _STREAMING_MEMBER, coordinator.grpc_target], stdout=subprocess.PIPE, text=True
    )
    try:
        joined = await stub.Join(join_request("b", 1, "blame", world_size=2), timeout=20)
        peer = joined.assignments[0]
        call = stub.Heartbeat(
            iter(
                [pb.HeartbeatRequest(reports=[pb.MemberReport(member_id=peer.member_id, secret=peer.secret)])]
            ),
            timeout=30,
        )
        await asyncio.wait_for(call.read(), 5)
        assert killed.stdout is not None
        killed_rank = int(await asyncio.wait_for(asyncio.to_thread(killed.stdout.readline), 20))
        killed.kill()
        killed.wait(10)
        await asyncio.sleep(0)  # the peer fails at once: its Leave may race the broken stream
        await stub.Leave(
            pb.LeaveRequest(member_id=peer.member_id, secret=peer.secret, exit_code=1), timeout=10
        )
        job = coordinator.get_json("/v1/jobs?job=blame")["jobs"][0]  # type: ignore[index]
        assert job["state"] == "FAILED"
        assert job["reason"].startswith(f"rank {killed_rank} on host a failed: connection lost"), job[
            "reason"
        ]
        assert f"rank {peer.rank} on host b exited with code 1" in job["reason"]
        call.cancel()
    finally:
        killed.kill()
        killed.wait(10)
