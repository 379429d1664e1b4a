"""What one coordinator does faster for a big job must be what it did before: reports taken the
short way (api.reports) change members and answer exactly as the full checks do, and ``/v1/jobs``
made from the members is protobuf's JSON of the status message. And what let a big job's members
fail for silence must not: time the coordinator itself was not listening is excused."""

from __future__ import annotations

import asyncio
import copy
import math
import signal

import grpc
from google.protobuf import json_format

from sarcomm.common.constants import FailureReason
from sarcomm.common.errors import SarcommError
from sarcomm.common.messages import Progress
from sarcomm.coordinator.api.events import EventHub, FormedWaiters
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.api.reports import StreamReports
from sarcomm.coordinator.api.service import CoordinatorService
from sarcomm.coordinator.api.views import member_status, member_view
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain.membership import Membership, Ticket
from sarcomm.coordinator.domain.model import Job, Member
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import StartCoordinator
from tests.helpers import LO_PB, FakeClock, spec


def _service(clock: FakeClock) -> tuple[Membership, CoordinatorService, list[str]]:
    """A service over a fresh membership whose persist calls are listed (job names)."""
    persisted: list[str] = []
    membership = Membership(liveness_timeout=3.0, clock=clock, persist=lambda job: persisted.append(job.name))

    async def durable(job: Job) -> None:
        return None

    config = CoordinatorConfig(heartbeat_interval=1.0)
    service = CoordinatorService(
        membership, EventHub(), CoordinatorMetrics(membership), config, durable, FormedWaiters()
    )
    return membership, service, persisted


def _members(membership: Membership) -> list[tuple[object, ...]]:
    job = membership.job("j")
    assert job is not None
    return [
        (
            m.rank,
            m.state,
            m.last_seen,
            m.last_heartbeat,
            m.last_report,
            m.lost_at,
            m.progress,
            m.metrics_address,
        )
        for m in job.members
    ]


def _report(ticket: Ticket, i: int, **fields: object) -> pb.MemberReport:
    base: dict[str, object] = {"member_id": ticket.members[i].member_id, "secret": ticket.secrets[i]}
    return pb.MemberReport(**{**base, **fields})  # type: ignore[arg-type]


def _requests(ticket: Ticket) -> list[pb.HeartbeatRequest]:
    """A stream's requests: first reports, repeats (the short way), and every kind of request
    that must leave it (new endpoint, another secret, a value a rule refuses, a member gone)."""

    def both(**fields: object) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(reports=[_report(ticket, 0, **fields), _report(ticket, 1, **fields)])

    progress = pb.Progress(seq=3, op="all_reduce", in_collective=True, since=1000.0)
    return [
        both(metrics_address="127.0.0.1:9100", progress=progress),
        both(metrics_address="127.0.0.1:9100", progress=progress, age_seconds=0.5),
        both(progress=pb.Progress(seq=4, op="all_to_all", since=1001.0), age_seconds=0.25),
        both(),  # no progress: kept as it was
        both(metrics_address="127.0.0.1:9200"),  # a new endpoint: checked and written
        pb.HeartbeatRequest(reports=[_report(ticket, 0), _report(ticket, 1, secret="wrong")]),
        both(age_seconds=math.nan),
        both(age_seconds=math.inf),
        both(progress=pb.Progress(seq=-1, op="all_reduce")),
        both(progress=pb.Progress(seq=5, op="bad op!")),
        both(progress=pb.Progress(seq=5, op="x" * 65)),
        both(progress=pb.Progress(seq=5, op="all_reduce", since=math.inf)),
        both(metrics_address="10.9.9.9:9100"),  # not an address of the member's host
        pb.HeartbeatRequest(reports=[_report(ticket, 0), pb.MemberReport(member_id="abc", secret="s")]),
        both(progress=pb.Progress(seq=6, op="barrier", since=1002.0)),
    ]


def _run(short_way: bool) -> tuple[list[object], list[list[tuple[object, ...]]], list[str]]:
    clock = FakeClock()
    membership, service, persisted = _service(clock)
    ticket = membership.join(spec("h", None, None, job="j", world_size=2))
    membership.answered(ticket)
    state = StreamReports()
    if not short_way:
        state.take = lambda *args: None  # type: ignore[method-assign]
    ids = {m.member_id: f"member {i}" for i, m in enumerate(ticket.members)}

    def handle(request: pb.HeartbeatRequest) -> object:
        answer = service._handle_reports(request, state, asyncio.Queue())
        if isinstance(answer, SarcommError):
            return str(answer)
        # Member ids are random: compared by which member they are.
        return (
            [ids.get(i, i) for i in answer.unknown_members],
            list(answer.events),
            answer.heartbeat_interval_seconds,
        )

    answers: list[object] = []
    snapshots = []
    for request in _requests(ticket):
        clock.advance(0.5)
        answers.append(handle(request))
        snapshots.append(_members(membership))
    # Both leave: their next reports are of members the coordinator no longer knows.
    membership.leave(ticket.members[1].member_id, ticket.secrets[1], 0)
    membership.leave(ticket.members[0].member_id, ticket.secrets[0], 0)
    clock.advance(0.5)
    answers.append(handle(_requests(ticket)[3]))
    return answers, snapshots, persisted


def test_reports_taken_the_short_way_change_members_and_answer_as_the_full_checks_do() -> None:
    assert _run(short_way=True) == _run(short_way=False)


def test_a_repeated_report_is_taken_the_short_way_and_anything_new_is_not() -> None:
    clock = FakeClock()
    membership, service, _ = _service(clock)
    ticket = membership.join(spec("h", None, None, job="j", world_size=2))
    membership.answered(ticket)
    state = StreamReports()
    requests = _requests(ticket)
    assert state.take(requests[0], membership.current) is None  # first reports: the full way
    service._handle_reports(requests[0], state, asyncio.Queue())
    taken = state.take(requests[2], membership.current)
    assert taken is not None
    assert [(m.member_id, p, age) for m, p, age in taken] == [
        (ticket.members[i].member_id, Progress(4, "all_to_all", False, 1001.0), 0.25) for i in range(2)
    ]
    for new in requests[4:14]:
        assert state.take(new, membership.current) is None, new


def _member_json_via_message(member: Member) -> dict[str, object]:
    view = json_format.MessageToDict(
        member_status(member), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    view["progress"]["seq"] = int(view["progress"]["seq"])
    return view


def test_member_view_is_protobufs_json_of_the_member_status() -> None:
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock)
    forming = membership.join(spec("f", job="forming", world_size=2)).members[0]
    ticket = membership.join(spec("h", None, None, None, job="j", world_size=3))
    running, failed, left = ticket.members
    membership.heartbeat(running.member_id, ticket.secrets[0], Progress(2**40, "all_gather", True, 5.5), "")
    membership.heartbeat(failed.member_id, ticket.secrets[1], None, "127.0.0.1:9100", age=0.25)
    membership.leave(left.member_id, ticket.secrets[2], 0)
    membership.leave(failed.member_id, ticket.secrets[1], -9, "killed by signal 9")
    odd = copy.copy(running)
    odd.progress = Progress(1, "x", False, math.inf)
    for member in (forming, running, failed, left, odd):
        assert member_view(member) == _member_json_via_message(member)
    assert failed.failure is FailureReason.KILLED


def test_a_late_sweep_excuses_the_time_the_coordinator_was_not_listening() -> None:
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock)
    ticket = membership.join(spec("h", job="j", world_size=1))
    membership.answered(ticket)
    membership.heartbeat(ticket.members[0].member_id, ticket.secrets[0], None, "")
    clock.advance(5.0)  # 5 s without a sweep: the coordinator was held up for 4.75 of them
    assert membership.sweep(excused=4.75) == []
    clock.advance(2.5)  # silent 2.75 s of the time it listened
    assert membership.sweep() == []
    clock.advance(0.5)  # 3.25 s
    assert [m.member_id for _, m in membership.sweep()] == [ticket.members[0].member_id]


async def test_a_coordinator_stopped_after_answering_fails_no_member_whose_first_reports_wait_for_it(
    start_coordinator: StartCoordinator,
) -> None:
    """SIGSTOP the coordinator for three liveness timeouts right after it answered a Join, while the
    members start reporting: once it runs again, its overdue sweep comes before the reports queued
    meanwhile; that time is its own, not its members' silence (before, both failed for missed
    heartbeats)."""
    coord = start_coordinator("--heartbeat-interval", "0.25", "--heartbeat-misses", "4")
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        joined = await stub.Join(
            pb.JoinRequest(job="paused", world_size=2, host="h", interfaces=[LO_PB], store_port=29500,
                           members=[pb.MemberSpec(local_rank=0), pb.MemberSpec(local_rank=1)]),
            timeout=10,
        )  # fmt: skip
        request = pb.HeartbeatRequest(
            reports=[pb.MemberReport(member_id=a.member_id, secret=a.secret) for a in joined.assignments]
        )
        # grpc.aio lets a stream-stream call be written to (grpc-stubs wants an iterator).
        call = stub.Heartbeat(timeout=60, wait_for_ready=True)  # type: ignore[call-arg]
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await call.write(request)
                await asyncio.sleep(0.1)
            await call.write(pb.HeartbeatRequest(closing=True))
            await call.done_writing()

        async def drain() -> None:
            async for _ in call:
                pass

        # Held up right after the answer: the first reports wait in its queues (as 4096 agents'
        # first reports wait behind their 4096 new streams).
        assert coord.proc is not None
        coord.proc.send_signal(signal.SIGSTOP)
        try:
            tasks = [asyncio.ensure_future(beat()), asyncio.ensure_future(drain())]
            await asyncio.sleep(3.0)
        finally:
            coord.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    (job,) = coord.get_json("/v1/jobs?job=paused")["jobs"]  # type: ignore[index]
    assert (job["state"], [m["state"] for m in job["members"]]) == ("RUNNING", ["RUNNING", "RUNNING"]), job
