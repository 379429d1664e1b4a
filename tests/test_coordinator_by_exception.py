"""Reports by exception, the coordinator's side, in process with a fake clock.

A real coordinator (gRPC on loopback port 0) spoken to over raw Heartbeat streams as a reporter by
exception speaks (``protos/sarcomm/v1/coordinator.proto``: ``by_exception``, ``ReportPolicy``,
``progress_wanted``); only time is fake: the test moves the clock and runs the sweep itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from sarcomm.common.constants import FailureReason
from sarcomm.common.messages import Assignment
from sarcomm.coordinator.domain import policy
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import Member as DomainMember
from sarcomm.coordinator.domain.model import MemberState
from sarcomm.coordinator.domain.reporters import Reporter
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import StartCoordinator
from tests.coordinator_fixture import LOOPBACK, InProcessCoordinator, in_process_coordinator
from tests.helpers import LO_PB as LO
from tests.helpers import FakeClock, spec, wait_for_async

pytestmark = pytest.mark.usefixtures("membership_invariants")

#: Bounds each wait for something the coordinator does at once (an answer on a stream).
WAIT_S = 10.0
#: How long "nothing arrived" is watched for.
NOTHING_S = 0.3
#: A member as a Join's answer names it (the client's or the wire's form).
Member = Assignment | pb.Assignment


class Stream:
    """One raw Heartbeat stream: requests put in, answers read out (a task reads them into a
    queue: cancelling a read would cancel the call)."""

    def __init__(self, stub: pb_grpc.CoordinatorAsyncStub) -> None:
        self._outgoing: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()
        self._answers: asyncio.Queue[pb.HeartbeatResponse] = asyncio.Queue()
        self.call = stub.Heartbeat(self._requests(), timeout=120)
        self._reader = asyncio.ensure_future(self._read_all())

    async def _requests(self) -> AsyncIterator[pb.HeartbeatRequest]:
        while (item := await self._outgoing.get()) is not None:
            yield item

    async def _read_all(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for answer in self.call:
                self._answers.put_nowait(answer)

    async def send(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Send ``request`` and read the next answer (its own, unless something was pushed)."""
        self._outgoing.put_nowait(request)
        return await self.read()

    async def read(self) -> pb.HeartbeatResponse:
        return await asyncio.wait_for(self._answers.get(), WAIT_S)

    async def nothing(self) -> None:
        """Nothing more arrives for a moment."""
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(self._answers.get(), NOTHING_S)

    async def take_policy(self, assignments: Sequence[Member]) -> pb.ReportPolicy:
        """A new reporter's start: a full report, then (offered the policy) an empty
        by-exception request; returns the policy."""
        first = await self.send(pb.HeartbeatRequest(reports=full(assignments)))
        assert first.HasField("policy")
        await self.send(pb.HeartbeatRequest(by_exception=True))
        return first.policy

    async def renew(self) -> None:
        await self.send(pb.HeartbeatRequest(by_exception=True))

    def close(self) -> None:
        """Half-close the stream (an orderly end); its reader ends with it."""
        self._outgoing.put_nowait(None)

    def break_(self) -> None:
        """Cancel the call, as a reporter that died leaves it."""
        self.call.cancel()
        self._reader.cancel()


def full(
    assignments: Sequence[Member], age_seconds: float = 0.0, progress: pb.Progress | None = None
) -> list[pb.MemberReport]:
    """A report of each of ``assignments``' members."""
    return [
        pb.MemberReport(member_id=a.member_id, secret=a.secret, age_seconds=age_seconds, progress=progress)
        for a in assignments
    ]


@contextlib.asynccontextmanager
async def stub_of(coord: InProcessCoordinator) -> AsyncIterator[pb_grpc.CoordinatorAsyncStub]:
    async with grpc.aio.insecure_channel(coord.target) as channel:
        yield pb_grpc.CoordinatorStub(channel)


async def form(coord: InProcessCoordinator, job: str, hosts: int, nproc: int) -> list[list[Assignment]]:
    """A world of ``hosts`` agents ``h0``, ``h1``... of ``nproc`` ranks each; their assignments."""

    async def one(host: int) -> list[Assignment]:
        async with coord.client() as client:
            joined = await client.join_many(
                job, hosts * nproc, nproc=nproc, host=f"h{host}", interfaces=LOOPBACK, store_port=29500
            )
            return list(joined.assignments)

    return list(await asyncio.gather(*(one(h) for h in range(hosts))))


def states(coord: InProcessCoordinator, job: str) -> list[MemberState]:
    found = coord.coordinator.membership.job(job)
    assert found is not None
    return [m.state for m in found.ranked_members()]


def judged(coord: InProcessCoordinator, job: str) -> int:
    found = coord.coordinator.membership.job(job)
    assert found is not None
    return len(found.memory.judged)


def test_policy_numbers_follow_the_settings_and_bound_lease_traffic() -> None:
    offer = policy.report_policy(1.0, 3, 30.0, streams=1)
    assert (offer.lease_seconds, offer.silence_seconds, offer.quiet_seconds, offer.progress_seconds) == (
        10.0, 2.0, 15.0, 30.0,
    )  # fmt: skip
    assert policy.lease_seconds(4096) == 32.0
    assert policy.lease_seconds(10**6) == 60.0
    for streams in (1, 100, 1280, 4096, 7680):  # beyond: 60 s, the cap
        assert streams / policy.lease_seconds(streams) <= 128  # renewals a second, all streams
    assert policy.reoffer(10.0, 2048) is None  # 16 s: not twice 10
    assert policy.reoffer(10.0, 4096) == 32.0
    assert policy.silence_seconds(2.0, 1) == 1.0  # one miss: reported before it is judged


async def test_policy_offered_on_the_first_answer_only() -> None:
    async with (
        in_process_coordinator(FakeClock(), report_policy="exception") as coord,
        stub_of(coord) as stub,
    ):
        (agent,) = await form(coord, "offer", 1, 2)
        stream = Stream(stub)
        first = await stream.send(pb.HeartbeatRequest(reports=full(agent)))
        assert first.policy == pb.ReportPolicy(
            lease_seconds=10.0, silence_seconds=2.0, quiet_seconds=15.0, progress_seconds=30.0
        )
        second = await stream.send(pb.HeartbeatRequest(reports=full(agent)))
        assert not second.HasField("policy")
        stream.close()


async def test_per_second_coordinator_never_offers_and_judges_as_before() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="per-second") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "old", 1, 2)
        stream = Stream(stub)
        first = await stream.send(pb.HeartbeatRequest(reports=full(agent)))
        assert not first.HasField("policy")
        # A stray by_exception is not taken: the members stay judged by their reports.
        answer = await stream.send(pb.HeartbeatRequest(reports=full(agent), by_exception=True))
        assert not answer.HasField("policy")
        assert judged(coord, "old") == 2
        assert not coord.coordinator.membership.by_exception.reporters
        stream.close()


async def test_members_of_an_open_by_exception_stream_stay_running_unvisited_for_minutes() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "quiet", 1, 4)
        stream = Stream(stub)
        offered = await stream.take_policy(agent)
        assert judged(coord, "quiet") == 0  # the sweep visits none of them
        for _ in range(30):  # five minutes, a lease renewal every 10 s
            clock.advance(offered.lease_seconds)
            await stream.renew()
            assert coord.sweep() == []
        assert states(coord, "quiet") == [MemberState.RUNNING] * 4
        (job,) = (await stub.ListJobs(pb.ListJobsRequest(), timeout=WAIT_S)).jobs
        # Its last sign of life: the stream's last message, not its last report five minutes ago.
        assert {m.last_heartbeat for m in job.members} == {clock.wall()}
        stream.close()


async def test_lease_expiry_fails_the_streams_members_with_the_reason() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        agents = await form(coord, "stuck", 2, 2)
        stuck, healthy = Stream(stub), Stream(stub)
        offered = await stuck.take_policy(agents[0])
        await healthy.take_policy(agents[1])
        clock.advance(2 * offered.lease_seconds - 1)
        await healthy.renew()
        assert coord.sweep() == []
        clock.advance(1.5)
        coord.sweep()  # (or the coordinator's own sweep, at the same instant)
        job = coord.coordinator.membership.job("stuck")
        assert job is not None
        by_id = {m.member_id: m for m in job.members}
        assert [by_id[a.member_id].state for a in agents[1]] == [MemberState.RUNNING] * 2
        for member in (by_id[a.member_id] for a in agents[0]):
            assert member.state is MemberState.FAILED
            assert member.failure is FailureReason.MISSED_HEARTBEATS
            assert member.reason.startswith("missed heartbeats: its reporter renewed no lease in 2 x 10 s")
            assert "loop is stuck" in member.reason
        stuck.close()
        healthy.close()


async def test_a_broken_by_exception_stream_is_judged_after_lost_grace() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "broken", 1, 2)
        stream = Stream(stub)
        await stream.take_policy(agent)
        clock.advance(100.0)  # long after the last report
        await stream.renew()
        stream.break_()  # the agent died: its connection broke
        member = coord.member("broken", 0)
        await wait_for_async(lambda: member.lost_at is not None, WAIT_S, what="the broken stream seen")
        clock.advance(0.9)  # lost_grace is one interval
        assert coord.sweep() == []
        clock.advance(0.2)
        coord.sweep()
        assert states(coord, "broken") == [MemberState.FAILED] * 2
        assert member.failure is FailureReason.CONNECTION_LOST


async def test_an_orderly_closed_by_exception_stream_leaves_its_members_one_liveness_timeout() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "closed", 1, 1)
        stream = Stream(stub)
        await stream.take_policy(agent)
        clock.advance(60.0)
        await stream.send(pb.HeartbeatRequest(by_exception=True, closing=True))
        stream.close()
        member = coord.member("closed", 0)
        await wait_for_async(lambda: member.stream is None, WAIT_S, what="the stream's end seen")
        clock.advance(2.9)
        assert coord.sweep() == []
        clock.advance(0.2)
        coord.sweep()
        assert states(coord, "closed") == [MemberState.FAILED]


async def test_a_rank_reported_silent_fails_at_interval_times_misses() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "silent", 1, 2)
        stream = Stream(stub)
        offered = await stream.take_policy(agent)
        clock.advance(40.0)
        # Rank 1's own sign of life is silence_seconds old: its reporter says so, once.
        silent = full(agent[1:], age_seconds=offered.silence_seconds)
        await stream.send(pb.HeartbeatRequest(reports=silent, by_exception=True))
        assert judged(coord, "silent") == 1
        clock.advance(0.95)  # its sign of life 2.95 s old: alive
        assert coord.sweep() == []
        clock.advance(0.1)
        coord.sweep()
        assert coord.member("silent", 1).failure is FailureReason.MISSED_HEARTBEATS
        assert states(coord, "silent") == [MemberState.RUNNING, MemberState.FAILED]
        stream.close()


async def test_a_silent_rank_that_comes_back_is_trusted_again() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "back", 1, 1)
        stream = Stream(stub)
        await stream.take_policy(agent)
        await stream.send(pb.HeartbeatRequest(reports=full(agent, age_seconds=2.0), by_exception=True))
        assert judged(coord, "back") == 1
        await stream.send(pb.HeartbeatRequest(reports=full(agent, age_seconds=0.1), by_exception=True))
        assert judged(coord, "back") == 0
        clock.advance(30.0)
        await stream.renew()
        assert coord.sweep() == []
        stream.close()


def in_collective(seq: int, since: float) -> pb.Progress:
    return pb.Progress(seq=seq, op="all_reduce", in_collective=True, since=since)


async def test_a_quiet_rank_asks_its_jobs_by_exception_streams_for_progress_then_the_stall_is_named() -> None:
    clock = FakeClock()
    # A stall named after 8 s: reported quiet after 4, asked again every 4 (within one 10 s lease).
    async with (
        in_process_coordinator(clock, stall_threshold=8.0, report_policy="exception") as coord,
        stub_of(coord) as stub,
    ):
        agents = await form(coord, "stall", 3, 1)
        (other,) = await form(coord, "other", 1, 1)
        waiting, blocking, old = Stream(stub), Stream(stub), Stream(stub)
        elsewhere = Stream(stub)
        await waiting.take_policy(agents[0])
        await blocking.take_policy(agents[1])
        # An old reporter: never switches (its members judged per interval as before).
        await old.send(pb.HeartbeatRequest(reports=full(agents[2])))
        await elsewhere.take_policy(other)
        clock.advance(5.0)
        entered = clock.wall() - 4.5
        quiet = full(agents[0], progress=in_collective(5, entered))
        await waiting.send(pb.HeartbeatRequest(reports=quiet, by_exception=True))
        for stream in (waiting, blocking):
            pushed = await stream.read()
            assert list(pushed.progress_wanted) == ["stall"]
        await old.nothing()
        await elsewhere.nothing()
        # Each asked reporter answers with its members' progress: h1's rank never entered #5.
        await waiting.send(pb.HeartbeatRequest(reports=quiet, by_exception=True))
        behind = full(agents[1], progress=pb.Progress(seq=4, op="all_reduce", since=entered - 1))
        await blocking.send(pb.HeartbeatRequest(reports=behind, by_exception=True))
        await old.send(pb.HeartbeatRequest(reports=full(agents[2], progress=in_collective(5, entered))))
        clock.advance(4.0)  # 8.5 s in the collective: past the stall threshold
        job = coord.coordinator.membership.job("stall")
        assert job is not None
        stall = coord.coordinator.membership.stall(job)
        assert stall is not None
        ranks = [agent[0].rank for agent in agents]
        assert (stall.seq, stall.waiting, stall.blocking) == (5, tuple(sorted(ranks[::2])), (ranks[1],))
        # Still quiet progress_seconds / 2 later: asked again.
        assert coord.sweep() == []
        assert list((await waiting.read()).progress_wanted) == ["stall"]
        for stream in (waiting, blocking, old, elsewhere):
            stream.close()


async def test_status_of_one_job_asks_for_progress_and_waits_for_the_answers() -> None:
    clock = FakeClock()
    async with in_process_coordinator(clock, report_policy="exception") as coord, stub_of(coord) as stub:
        (agent,) = await form(coord, "asked", 1, 1)
        stream = Stream(stub)
        await stream.take_policy(agent)
        loop = asyncio.get_running_loop()

        async def status() -> pb.ListJobsResponse:
            return await stub.ListJobs(pb.ListJobsRequest(job="asked"), timeout=WAIT_S)

        asking = asyncio.ensure_future(status())
        pushed = await stream.read()
        assert list(pushed.progress_wanted) == ["asked"]
        started = loop.time()
        answer = full(agent, progress=pb.Progress(seq=9, op="all_reduce", since=clock.wall()))
        await stream.send(pb.HeartbeatRequest(reports=answer, by_exception=True))
        answered = await asyncio.wait_for(asking, WAIT_S)
        assert answered.jobs[0].members[0].progress.seq == 9  # the answer's progress is shown
        assert loop.time() - started < 0.9  # it ended when the stream answered, not at the bound
        # Asked again at once: its reporter still sends each change, nothing is asked or awaited.
        started = loop.time()
        await status()
        await stream.nothing()
        assert loop.time() - started < 0.9
        # Later, a reporter that does not answer holds status up for the bound only.
        clock.advance(15.0)  # progress_seconds / 2
        await stream.renew()
        started = loop.time()
        silent = asyncio.ensure_future(status())
        await stream.read()
        await asyncio.wait_for(silent, WAIT_S)
        assert 0.9 <= loop.time() - started < 3.0
        stream.close()


async def test_heartbeat_streams_are_counted_by_protocol() -> None:
    async with (
        in_process_coordinator(FakeClock(), report_policy="exception") as coord,
        stub_of(coord) as stub,
    ):
        (agent,) = await form(coord, "counted", 1, 1)
        stream = Stream(stub)
        await stream.take_policy(agent)
        await stream.renew()
        registry = coord.coordinator.metrics.registry

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert sample("sar_coordinator_heartbeat_streams", protocol="exception") == 1.0
        assert sample("sar_coordinator_heartbeat_streams", protocol="per-second") == 0.0
        assert sample("sar_coordinator_leases_total") == 2.0
        stream.close()
        await wait_for_async(
            lambda: sample("sar_coordinator_heartbeat_streams", protocol="exception") == 0.0,
            WAIT_S,
            what="the stream's end counted",
        )


async def test_a_real_coordinator_keeps_a_quiet_by_exception_agent_and_fails_it_when_its_stream_breaks(
    start_coordinator: StartCoordinator,
) -> None:
    """The protocol against a ``sar-coordinator`` process (interval 0.5 s: liveness 1.5 s)."""
    coordinator = start_coordinator(
        "--heartbeat-interval", "0.5", "--join-timeout", "60", "--report-policy", "exception"
    )  # fmt: skip
    async with grpc.aio.insecure_channel(coordinator.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        joined = await stub.Join(
            pb.JoinRequest(
                job="process", world_size=2, host="a", interfaces=[LO], store_port=29500,
                members=[pb.MemberSpec(local_rank=0), pb.MemberSpec(local_rank=1)],
            ),
            timeout=WAIT_S,
        )  # fmt: skip
        agent = list(joined.assignments)
        stream = Stream(stub)
        offered = await stream.take_policy(agent)
        assert offered.silence_seconds == 1.0  # 0.5 s x (3 - 1)

        def job() -> dict[str, Any]:
            found = coordinator.get_json("/v1/jobs?job=process")
            assert isinstance(found, dict)
            return dict(found["jobs"][0])

        # Past the liveness timeout without a message: the open stream stands for its members.
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + 2.0
        while loop.time() < quiet_until:
            await stream.nothing()
        # status of the job asks for progress; the agent answers at once.
        asking = asyncio.ensure_future(asyncio.to_thread(job))
        assert list((await stream.read()).progress_wanted) == ["process"]
        await stream.send(pb.HeartbeatRequest(reports=full(agent), by_exception=True))
        shown = await asyncio.wait_for(asking, WAIT_S)
        assert [m["state"] for m in shown["members"]] == ["RUNNING", "RUNNING"]
        broke = loop.time()
        stream.break_()  # the agent dies
        await wait_for_async(
            lambda: asyncio.to_thread(lambda: job()["state"] == "FAILED"), WAIT_S, what="the job failed"
        )
        assert loop.time() - broke < 3.0  # lost grace 0.5 s, sweeps every 0.125 s


# -- the domain alone (Membership, a fake clock): streams that move between reporters ----------


def domain_world(clock: FakeClock) -> tuple[Membership, list[DomainMember]]:
    """A running world of one host's 2 members, each reported once (fresh) over one stream."""
    membership = Membership(liveness_timeout=3.0, clock=clock)
    (ticket,) = [membership.join(spec("h0", 0, 1, job="dom", world_size=2))]
    return membership, list(ticket.members)


def reported_over(membership: Membership, members: list[DomainMember], stream: Reporter) -> None:
    stream.members.update(m.member_id for m in members)
    membership.beats([(m, None, 0.0) for m in members], stream)


def test_a_trusted_member_reported_by_a_per_interval_stream_is_judged_again() -> None:
    clock = FakeClock()
    membership, members = domain_world(clock)
    fast, old = Reporter(), Reporter()
    reported_over(membership, members, fast)
    membership.took_policy(fast, 10.0)
    assert all(m.trusted for m in members)
    reported_over(membership, members[:1], old)  # an old reporter took over member 0
    assert [m.trusted for m in members] == [False, True]
    clock.advance(3.5)  # its per-interval stream ends: member 0 is judged by its last report, as before
    membership.stream_closed(old, [members[0].member_id])
    membership.sweep()
    assert [m.state for m in members] == [MemberState.FAILED, MemberState.RUNNING]


def test_the_end_of_a_replaced_by_exception_stream_leaves_its_former_members_alone() -> None:
    clock = FakeClock()
    membership, members = domain_world(clock)
    first, second = Reporter(), Reporter()
    reported_over(membership, members, first)
    membership.took_policy(first, 10.0)
    # The agent reconnected: a new stream's full report, then the switch; the old one breaks late.
    reported_over(membership, members, second)
    membership.took_policy(second, 10.0)
    membership.stream_lost(first, [m.member_id for m in members])
    assert all(m.trusted and m.lost_at is None for m in members)
    clock.advance(60.0)
    membership.by_exception.renew(second)
    assert membership.sweep() == []
    assert not first.open
    assert second.open
