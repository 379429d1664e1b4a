"""Liveness, stalls and restarts at the service level, in process, with a fake clock.

A real coordinator (gRPC and HTTP on loopback port 0) and real clients; only time is fake: the
test moves the clock and runs the sweep itself (see ``tests/coordinator_fixture.py``), so each
verdict is checked at the exact instant it becomes due, without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.common.messages import Assignment, Event, MemberReport, Progress
from sarcomm.coordinator.domain.model import MemberState
from sarcomm.coordinator.status import render
from sarcomm.v1 import coordinator_pb2 as pb
from tests.coordinator_fixture import LOOPBACK, InProcessCoordinator, in_process_coordinator
from tests.helpers import FakeClock

#: Bounds each wait for something the coordinator does at once (an event on a stream).
WAIT_S = 10.0


async def form(coord: InProcessCoordinator, job: str, world_size: int) -> list[Assignment]:
    """A world of ``world_size`` single-rank hosts ``h0``, ``h1``, ...; rank i on host hi."""

    async def one(rank: int) -> Assignment:
        async with coord.client() as client:
            return await client.join(
                job, world_size, rank, host=f"h{rank}", interfaces=LOOPBACK, store_port=29500
            )

    return list(await asyncio.gather(*(one(r) for r in range(world_size))))


async def report(coord: InProcessCoordinator, *members: Assignment, progress: Progress | None = None) -> None:
    """One heartbeat for ``members``, over a stream that ends in order."""
    async with coord.client() as client:
        await client.heartbeat([MemberReport(m.member_id, m.secret, progress=progress) for m in members])


@contextlib.asynccontextmanager
async def watching(coord: InProcessCoordinator, job: str) -> AsyncIterator[asyncio.Queue[Event]]:
    """The job's events, as a Watch stream delivers them, in a queue."""
    queue: asyncio.Queue[Event] = asyncio.Queue()

    async def pump() -> None:
        async with coord.client() as client:
            async for event in client.watch(job, timeout=60.0):
                queue.put_nowait(event)

    task = asyncio.ensure_future(pump())
    try:
        yield queue
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def next_event(queue: asyncio.Queue[Event], kind: EventKind) -> Event:
    while True:
        event = await asyncio.wait_for(queue.get(), WAIT_S)
        if event.kind is kind:
            return event


def failures_counted(coord: InProcessCoordinator, reason: str) -> float:
    value = coord.coordinator.metrics.registry.get_sample_value(
        "sar_coordinator_member_failures_total", {"reason": reason}
    )
    return value or 0.0


async def test_a_silent_member_fails_when_the_clock_passes_interval_x_misses_and_not_before() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, heartbeat_interval=1.0, heartbeat_misses=3) as coord:
        a, b = await form(coord, "quiet", 2)
        async with watching(coord, "quiet") as events:
            assert (await next_event(events, EventKind.WORLD_FORMED)).generation == 1
            await report(coord, a, b)
            clock.advance(3.0)  # exactly interval x misses: not yet "longer than"
            await report(coord, a)
            coord.sweep()
            assert coord.member("quiet", 1).state is MemberState.RUNNING
            assert events.empty()
            clock.advance(0.001)
            coord.sweep()
            silent = coord.member("quiet", 1)
            assert (silent.state, silent.failure) == (MemberState.FAILED, FailureReason.MISSED_HEARTBEATS)
            assert silent.reason == "missed heartbeats: silent for 3.0 s"
            assert coord.member("quiet", 0).state is MemberState.RUNNING
            # Every rank is told, with the reason as a value beside the text.
            event = await next_event(events, EventKind.MEMBER_FAILED)
            assert (event.rank, event.host, event.failure) == (1, "h1", FailureReason.MISSED_HEARTBEATS)
            assert event.reason == "missed heartbeats: silent for 3.0 s"
        async with coord.client() as client:
            (job,) = await client.list_jobs("quiet")
        by_rank = {m.rank: m for m in job.members}
        assert by_rank[1].failure == pb.FAILURE_REASON_MISSED_HEARTBEATS
        assert by_rank[0].failure == pb.FAILURE_REASON_UNSPECIFIED
        assert failures_counted(coord, "missed_heartbeats") == 1
        assert failures_counted(coord, "connection_lost") == 0


async def test_a_member_that_exits_non_zero_fails_the_job_with_a_typed_reason() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock) as coord:
        _, b = await form(coord, "crash", 2)
        async with watching(coord, "crash") as events:
            await next_event(events, EventKind.WORLD_FORMED)  # the watch is subscribed
            async with coord.client() as client:
                assert (
                    await client.leave(b.member_id, b.secret, -9, "killed by signal 9 (SIGKILL)") == "FAILED"
                )
            event = await next_event(events, EventKind.MEMBER_FAILED)
            assert (event.rank, event.failure) == (1, FailureReason.KILLED)
            job_failed = await next_event(events, EventKind.JOB_FAILED)
            assert job_failed.failure is FailureReason.KILLED
        assert failures_counted(coord, "killed") == 1


async def test_a_stall_is_reported_once_ranks_waited_past_the_threshold_and_not_before() -> None:
    clock = FakeClock()
    # A liveness timeout (20 s x 3) longer than the stall threshold: the ranks stay alive throughout.
    async with in_process_coordinator(clock, stall_threshold=30.0, heartbeat_interval=20.0) as coord:
        a, b = await form(coord, "stuck", 2)
        entered = clock.wall()
        await report(coord, a, progress=Progress(seq=5, op="all_reduce", in_collective=True, since=entered))
        await report(coord, b, progress=Progress(seq=4, op="all_to_all", in_collective=False, since=entered))
        clock.advance(29.9)
        assert coord.sweep() == []
        async with coord.client() as client:
            (job,) = await client.list_jobs("stuck")
            assert not job.HasField("stall")
            clock.advance(0.2)
            assert coord.sweep() == []
            (job,) = await client.list_jobs("stuck")
        assert job.HasField("stall")
        stall = job.stall
        assert (stall.seq, stall.op, list(stall.waiting_ranks), list(stall.blocking_ranks)) == (
            5, "all_reduce", [0], [1],
        )  # fmt: skip
        assert abs(job.stall.waited_seconds - 30.1) < 1e-6
        assert "1 rank(s) have waited 30.1 s in collective #5 (all_reduce) for rank(s) 1" in render(
            pb.ListJobsResponse(jobs=[job]), now=clock.wall()
        )


async def test_restored_members_get_the_restore_grace_before_they_are_judged(
    state_backend: dict[str, Any],
) -> None:
    # Both stores: a restart on SQLite, and on etcd the next leader taking over the same jobs.
    async with in_process_coordinator(FakeClock(), **state_backend) as first:
        a, b = await form(first, "again", 2)
        await report(first, a, b)
    # A new process: its monotonic clock starts anywhere.
    clock = FakeClock(monotonic=5.0)
    async with in_process_coordinator(clock, reconnect_grace=10.0, **state_backend) as second:
        assert [second.member("again", r).state for r in (0, 1)] == [MemberState.RUNNING] * 2
        clock.advance(9.9)  # far past interval x misses (3 s), still within the grace
        second.sweep()
        assert [second.member("again", r).state for r in (0, 1)] == [MemberState.RUNNING] * 2
        await report(second, a)  # rank 0's reporter reconnected: the secret survived the restart
        clock.advance(0.2)  # the grace is over, but rank 0 first reported 0.2 s ago: reconnections
        second.sweep()  # are still arriving, and rank 1 waits one liveness timeout more
        assert second.member("again", 1).state is MemberState.RUNNING
        await report(second, a)
        clock.advance(2.9)  # 3.1 s since the last first report: rank 1 has not reported since the restart
        second.sweep()
        judged = second.member("again", 1)
        assert (judged.state, judged.failure) == (MemberState.FAILED, FailureReason.MISSED_HEARTBEATS)
        assert second.member("again", 0).state is MemberState.RUNNING


def _join_request(job: str, join_id: str) -> pb.JoinRequest:
    """One host bringing a whole world of two members, as an agent with ``--nproc-per-node 2``."""
    return pb.JoinRequest(
        job=job,
        world_size=2,
        host="h0",
        interfaces=[pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)],
        members=[pb.MemberSpec(local_rank=0), pb.MemberSpec(local_rank=1)],
        store_port=29500,
        join_id=join_id,
    )


async def test_a_join_resent_after_a_takeover_gets_its_world_with_new_secrets(
    state_backend: dict[str, Any],
) -> None:
    # The answer to a Join that formed the world is lost with the coordinator that wrote it (a
    # leader SIGKILLed, a restart): the client sends the same Join (same join_id) to the one that
    # holds the state now, and gets the same world back, not FAILED_PRECONDITION "running".
    async with in_process_coordinator(FakeClock(), **state_backend) as first, first.client() as client:
        answered = await client.stub.Join(_join_request("lost", "a" * 32), timeout=WAIT_S)
    async with in_process_coordinator(FakeClock(monotonic=5.0), **state_backend) as second:
        async with second.client() as client:
            again = await client.stub.Join(_join_request("lost", "a" * 32), timeout=WAIT_S)
            # Another join id brought no member of this world: a running job is refused as before.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.stub.Join(_join_request("lost", "b" * 32), timeout=WAIT_S)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert (again.generation, again.master_addr, again.master_port) == (
            answered.generation, answered.master_addr, answered.master_port,
        )  # fmt: skip
        assert [(a.rank, a.member_id) for a in again.assignments] == [
            (a.rank, a.member_id) for a in answered.assignments
        ]
        # Fresh secrets (only digests were stored); the new ones are the ones that count.
        assert {a.secret for a in again.assignments}.isdisjoint(a.secret for a in answered.assignments)
        members = [
            Assignment(rank=a.rank, world_size=2, local_rank=a.local_rank, local_world_size=2,
                       master_addr=again.master_addr, master_port=again.master_port, interface="lo",
                       address="127.0.0.1", generation=again.generation, member_id=a.member_id,
                       secret=a.secret, job="lost", restart_count=0)
            for a in again.assignments
        ]  # fmt: skip
        await report(second, *members)
        # A resend to the same coordinator is the ordinary retry: the same answer, same secrets.
        async with second.client() as client:
            repeated = await client.stub.Join(_join_request("lost", "a" * 32), timeout=WAIT_S)
        assert [a.secret for a in repeated.assignments] == [a.secret for a in again.assignments]
    async with in_process_coordinator(FakeClock(monotonic=9.0), **state_backend) as third:
        await report(third, *members)  # the secrets issued again were stored
        assert [third.member("lost", r).last_report > 0 for r in (0, 1)] == [True, True]
        # Once its members were heard from, the join id is not answered again: a member that
        # reported had its answer, and its secret must not change under it.
        async with third.client() as client:
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.stub.Join(_join_request("lost", "a" * 32), timeout=WAIT_S)
        assert late.value.code() is grpc.StatusCode.FAILED_PRECONDITION
