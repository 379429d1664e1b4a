"""HeartbeatStream's reports by exception (issue 28), in process on port 0.

The peer is a scripted ``Heartbeat`` servicer (a real gRPC server on loopback) that plays a
coordinator offering a :class:`ReportPolicy` and records every request: what the reporter sends,
and when, is the subject here; the coordinator's judgement of it is the coordinator's tests'. The
other way round, a reporter by exception against today's coordinator (which offers nothing) keeps
reporting every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from sarcomm.common.client import heartbeats
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.heartbeats import HeartbeatStream
from sarcomm.common.messages import MemberReport, Progress, ReportPolicy
from sarcomm.v1 import coordinator_pb2 as pb
from tests.coordinator_fixture import in_process_coordinator
from tests.helpers import FakeClock, free_port, stays_false_async, wait_for_async
from tests.test_coordinator_clock import form

pytestmark = pytest.mark.fast

JOB = "job"
#: The service the generated code registers (only its Heartbeat is played here).
SERVICE = "sarcomm.v1.Coordinator"
STARTED = time.time()
POLICY = ReportPolicy(lease_seconds=0.5, silence_seconds=2.0, quiet_seconds=5.0, progress_seconds=10.0)


@dataclass
class Scripted:
    """Answers each Heartbeat request at once (offering ``policy`` on a stream's first answer),
    pushes what :meth:`push` is given, and records (monotonic time, request) per stream."""

    policy: ReportPolicy | None
    streams: list[list[tuple[float, pb.HeartbeatRequest]]] = field(default_factory=list)
    pushes: asyncio.Queue[pb.HeartbeatResponse] = field(default_factory=asyncio.Queue)
    #: End each stream after this many requests (None: never).
    end_after: int | None = None

    def push(self, response: pb.HeartbeatResponse) -> None:
        self.pushes.put_nowait(response)

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[pb.HeartbeatRequest, pb.HeartbeatResponse],
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        seen: list[tuple[float, pb.HeartbeatRequest]] = []
        self.streams.append(seen)
        inbox: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()

        async def read() -> None:
            async for request in request_iterator:
                inbox.put_nowait(request)
            inbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                got_request = asyncio.ensure_future(inbox.get())
                got_push = asyncio.ensure_future(self.pushes.get())
                done, pending = await asyncio.wait(
                    {got_request, got_push}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    task.cancel()
                if got_push in done:
                    yield got_push.result()
                if got_request not in done:
                    continue
                request = got_request.result()
                if request is None or request.closing:
                    return
                seen.append((time.monotonic(), request))
                answer = pb.HeartbeatResponse(heartbeat_interval_seconds=0.0)
                if len(seen) == 1 and self.policy is not None:
                    answer.policy.CopyFrom(self.policy.to_proto())
                yield answer
                if self.end_after is not None and len(seen) >= self.end_after:
                    return
        finally:
            reader.cancel()


@contextlib.asynccontextmanager
async def reporting(
    policy: ReportPolicy | None,
    reports: Callable[[], list[MemberReport]],
    interval: float,
    *,
    by_exception: bool = True,
    end_after: int | None = None,
    other_replica: str = "",
) -> AsyncIterator[tuple[Scripted, HeartbeatStream]]:
    """A scripted peer offering ``policy`` and a stream reporting ``reports()`` to it (listed
    before ``other_replica`` when one is given)."""
    server = grpc.aio.server()
    peer = Scripted(policy, end_after=end_after)
    heartbeat = grpc.stream_stream_rpc_method_handler(
        peer.Heartbeat,
        request_deserializer=pb.HeartbeatRequest.FromString,
        response_serializer=pb.HeartbeatResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": heartbeat}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with (
            CoordinatorClient(
                ",".join(filter(None, (f"127.0.0.1:{port}", other_replica))), timeout=5.0
            ) as client,
            client.heartbeats(reports, interval, by_exception=by_exception, job=JOB) as stream,
        ):
            yield peer, stream
    finally:
        await server.stop(0)


def members(
    seq: Callable[[], int] = lambda: 1, ids: tuple[tuple[str, str], ...] = (("m0", "s"), ("m1", "s"))
) -> Callable[[], list[MemberReport]]:
    def reports() -> list[MemberReport]:
        return [
            MemberReport(m, s, Progress(seq(), "", False, STARTED), "127.0.0.1:9000", 0.0) for m, s in ids
        ]

    return reports


def shape(request: pb.HeartbeatRequest) -> tuple[bool, tuple[str, ...]]:
    return request.by_exception, tuple(r.member_id for r in request.reports)


def requests(peer: Scripted, count: int, stream: int = 0) -> bool:
    return len(peer.streams) > stream and len(peer.streams[stream]) >= count


async def test_the_reporter_takes_the_offer_sends_one_full_report_then_only_leases() -> None:
    async with reporting(POLICY, members(), 0.05) as (peer, stream):
        await wait_for_async(lambda: requests(peer, 4), 10, what="3 requests after the offer")
        assert stream.policy == POLICY
    seen = peer.streams[0]
    # Per-interval first (a coordinator that offers nothing is judged as before), then every member
    # once by exception at once (the switch), then empty requests: the lease, one each lease period.
    assert [shape(r) for _, r in seen[:4]] == [
        (False, ("m0", "m1")), (True, ("m0", "m1")), (True, ()), (True, ()),
    ]  # fmt: skip
    assert seen[1][0] - seen[0][0] < 0.04  # the switch goes at once, not after an interval
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(seen[1:])]
    assert all(gap >= POLICY.lease_seconds - 0.01 for gap in gaps), gaps


async def test_with_replicas_the_lease_is_renewed_often_enough_to_leave_a_hung_leader_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # REPLICATED_LEASE_S (5 s) made short to be seen here; the policy's 60 s lease would let a hung
    # leader go unnoticed past the new leader's grace.
    monkeypatch.setattr(heartbeats, "REPLICATED_LEASE_S", 0.3)
    policy = ReportPolicy(60.0, 2.0, 5.0, 10.0)
    async with reporting(policy, members(), 0.05, other_replica=f"127.0.0.1:{free_port()}") as (peer, stream):
        await wait_for_async(lambda: requests(peer, 4), 10, what="2 leases")
        assert stream.policy == policy  # as offered; only the renewals come sooner
    seen = peer.streams[0]
    assert [shape(r) for _, r in seen[2:4]] == [(True, ()), (True, ())]
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(seen[1:4])]
    assert all(0.29 <= gap < 5.0 for gap in gaps), gaps


async def test_progress_wanted_is_answered_at_once_with_every_member_then_with_changes() -> None:
    seq = [1]
    # An interval far longer than the test: what goes early goes because the ask woke the writer.
    async with reporting(ReportPolicy(60.0, 2.0, 5.0, 10.0), members(lambda: seq[0]), 30.0) as (peer, stream):
        await wait_for_async(lambda: stream.policy is not None and requests(peer, 2), 10, what="the switch")
        asked = time.monotonic()
        peer.push(pb.HeartbeatResponse(progress_wanted=[JOB]))
        await wait_for_async(lambda: requests(peer, 3), 10, what="the answer to the ask")
        assert peer.streams[0][2][0] - asked < 1.0
        assert shape(peer.streams[0][2][1]) == (True, ("m0", "m1"))
        # An ask for another job wakes the writer; nothing changed: nothing goes.
        peer.push(pb.HeartbeatResponse(progress_wanted=["other"]))
        await stays_false_async(lambda: requests(peer, 4), 0.3, what="a request without a change")
        # Within progress_seconds of the ask a change goes, at the writer's next turn (woken here).
        seq[0] = 2
        peer.push(pb.HeartbeatResponse(progress_wanted=["other"]))
        await wait_for_async(lambda: requests(peer, 4), 10, what="the change")
    assert shape(peer.streams[0][3][1]) == (True, ("m0", "m1"))
    assert [r.progress.seq for r in peer.streams[0][3][1].reports] == [2, 2]


async def test_a_new_stream_starts_over_per_interval_and_takes_the_offer_again() -> None:
    async with reporting(POLICY, members(), 0.05, end_after=3) as (peer, _):
        await wait_for_async(lambda: requests(peer, 2, stream=1), 10, what="a second stream")
    for seen in peer.streams[:2]:
        assert [shape(r) for _, r in seen[:2]] == [(False, ("m0", "m1")), (True, ("m0", "m1"))]


async def test_an_old_reporter_ignores_the_offer() -> None:
    async with reporting(POLICY, members(), 0.05, by_exception=False) as (peer, stream):
        await wait_for_async(lambda: requests(peer, 5), 10, what="5 requests")
        assert stream.policy is None
    assert all(shape(r) == (False, ("m0", "m1")) for _, r in peer.streams[0])


async def test_a_reporter_by_exception_reports_every_interval_to_a_coordinator_that_offers_nothing() -> None:
    async with reporting(None, members(), 0.05) as (peer, stream):
        await wait_for_async(lambda: requests(peer, 5), 10, what="5 requests")
        assert stream.policy is None
    assert all(shape(r) == (False, ("m0", "m1")) for _, r in peer.streams[0])
    # A coordinator told to take per-interval reports offers nothing: the reporter stays per-interval.
    async with in_process_coordinator(FakeClock(), report_policy="per-second") as coord:
        ids = tuple((a.member_id, a.secret) for a in await form(coord, JOB, 2))
        async with (
            coord.client() as client,
            client.heartbeats(members(ids=ids), 0.05, by_exception=True, job=JOB) as real,
        ):
            await wait_for_async(lambda: real.requests_sent >= 5 and real.connected, 10, what="5 requests")
            assert real.policy is None


async def test_a_reporter_by_exception_takes_the_real_coordinators_offer() -> None:
    async with in_process_coordinator(FakeClock(), report_policy="exception") as coord:
        ids = tuple((a.member_id, a.secret) for a in await form(coord, JOB, 2))
        async with (
            coord.client() as client,
            client.heartbeats(members(ids=ids), 0.05, by_exception=True, job=JOB) as stream,
        ):
            await wait_for_async(lambda: stream.policy is not None, 10, what="the offer taken")
            # The full report by exception goes at once; then nothing for a lease period (10 s at least).
            await wait_for_async(lambda: stream.requests_sent >= 2, 10, what="the switch")
            sent = stream.requests_sent
            await stays_false_async(
                lambda: stream.requests_sent > sent, 0.5, what="a request within the lease"
            )
            assert stream.policy is not None
            assert stream.policy.lease_seconds >= 10.0
            assert all(coord.member(JOB, r).state.name == "RUNNING" for r in (0, 1))


async def test_an_old_reporter_stays_per_interval_against_the_real_coordinators_offer() -> None:
    async with in_process_coordinator(FakeClock(), report_policy="exception") as coord:
        ids = tuple((a.member_id, a.secret) for a in await form(coord, JOB, 2))
        async with coord.client() as client, client.heartbeats(members(ids=ids), 0.05) as stream:
            await wait_for_async(
                lambda: stream.requests_sent >= 5 and stream.connected, 10, what="5 requests"
            )
            assert stream.policy is None
            assert all(coord.member(JOB, r).state.name == "RUNNING" for r in (0, 1))
