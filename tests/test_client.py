"""``CoordinatorClient`` against a live ``sar-coordinator``: assignments, every refusal's status and
message, events, and waiting for a coordinator that is not up yet."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from sarcomm.common.addresses import validate_target
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import (
    AlreadyExistsError,
    CoordinatorUnavailableError,
    FailedPreconditionError,
    InvalidArgumentError,
    JoinTimeoutError,
    UnauthenticatedError,
)
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import Assignment, Event, MemberReport
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO, free_port, wait_for_async

T = TypeVar("T")

ETH = InterfaceInfo("eth7", ("10.9.8.7",), InterfaceKind.PHYSICAL, default_route=True)

# Bounds every wait of a test on the coordinator.
DEADLINE_S = 15.0
# How a watch tells a failure: as it happens, or as the job's state when the stream opens after it.
FAILED = (EventKind.MEMBER_FAILED, EventKind.JOB_FAILED)


async def within(awaitable: Awaitable[T], seconds: float = DEADLINE_S) -> T:
    return await asyncio.wait_for(awaitable, seconds)


async def joined_count(client: CoordinatorClient, job: str) -> int:
    jobs = await client.list_jobs(job)
    return len(jobs[0].members) if jobs else 0


async def form(client: CoordinatorClient, job: str, world_size: int = 2) -> list[Assignment]:
    """A whole world of one-member joins, as separate hosts."""
    return list(
        await within(
            asyncio.gather(
                *(client.join(job, world_size, host=f"host{i}", interfaces=[LO]) for i in range(world_size))
            )
        )
    )


async def assert_serves(client: CoordinatorClient) -> None:
    """The coordinator still forms a fresh job and finishes it."""
    job = f"after-{time.monotonic_ns()}"
    members = await form(client, job)
    assert sorted(m.rank for m in members) == [0, 1]
    states = [await within(client.leave(m.member_id, m.secret, 0)) for m in members]
    assert states[-1] == "FINISHED"


@pytest.fixture
async def client(coordinator: CoordinatorProcess) -> AsyncIterator[CoordinatorClient]:
    async with CoordinatorClient(coordinator.grpc_target, timeout=10.0) as c:
        yield c


# -- assignments -------------------------------------------------------------------------------


async def test_join_assigns_distinct_ranks_one_master_and_leave_finishes_the_job(
    client: CoordinatorClient, coordinator: CoordinatorProcess
) -> None:
    members = await form(client, "basic")
    assert sorted(m.rank for m in members) == [0, 1]
    assert {(m.master_addr, m.master_port) for m in members} == {
        (members[0].master_addr, members[0].master_port)
    }
    assert members[0].master_addr == "127.0.0.1"
    assert 1 <= members[0].master_port <= 65535
    for m in members:
        assert (m.world_size, m.local_rank, m.local_world_size, m.job) == (2, 0, 1, "basic")
        assert (m.interface, m.address, m.generation, m.restart_count) == ("lo", "127.0.0.1", 1, 0)
        assert m.member_id
        assert m.secret
        assert m.secret not in repr(m)
    first = await within(client.leave(members[0].member_id, members[0].secret, 0))
    assert first == "RUNNING"
    last = await within(client.leave(members[1].member_id, members[1].secret, 0))
    assert last == "FINISHED"
    jobs = await within(client.list_jobs("basic"))
    assert [(j.job, j.state, j.generation) for j in jobs] == [("basic", "FINISHED", 1)]
    assert {j["job"]: j["state"] for j in coordinator.get_json("/v1/jobs")["jobs"]}["basic"] == "FINISHED"  # type: ignore[index]


async def test_join_many_honours_requested_ranks_and_deals_the_rest_contiguously(
    client: CoordinatorClient,
) -> None:
    pinned, dealt = await within(
        asyncio.gather(
            client.join_many("many", 4, nproc=2, ranks=[2, 3], host="a", interfaces=[LO]),
            client.join_many("many", 4, nproc=2, host="b", interfaces=[LO]),
        )
    )
    assert pinned.ranks == (2, 3)
    assert dealt.ranks == (0, 1)
    assert [a.local_rank for a in dealt.assignments] == [0, 1]
    assert {a.local_world_size for a in dealt.assignments} == {2}
    assert pinned.generation == dealt.generation == 1
    assert (pinned.master_addr, pinned.master_port) == (dealt.master_addr, dealt.master_port)


async def test_join_alone_keeps_the_callers_local_rank(client: CoordinatorClient) -> None:
    member = await within(
        client.join("alone", 1, host="a", interfaces=[LO], local_rank=3, local_world_size=4)
    )
    assert (member.rank, member.local_rank, member.local_world_size) == (0, 3, 4)


# -- refusals: status, message, and the coordinator keeps serving ------------------------------------


async def test_join_refuses_a_rank_that_is_taken_with_already_exists(client: CoordinatorClient) -> None:
    first = asyncio.ensure_future(client.join("dup", 2, rank=0, host="a", interfaces=[LO]))
    await wait_for_async(
        lambda: _has_members(client, "dup", 1), DEADLINE_S, what="the first member of job dup"
    )
    with pytest.raises(AlreadyExistsError, match=r"rank 0 is already taken in job 'dup' generation 1"):
        await within(client.join("dup", 2, rank=0, host="b", interfaces=[LO]))
    # The refused join corrupted nothing: rank 1 completes the world.
    second = await within(client.join("dup", 2, rank=1, host="c", interfaces=[LO]))
    assert ((await within(first)).rank, second.rank) == (0, 1)
    await assert_serves(client)


async def test_join_refuses_another_world_size_with_failed_precondition_naming_both(
    client: CoordinatorClient,
) -> None:
    pending = asyncio.ensure_future(client.join("sizes", 2, host="a", interfaces=[LO]))
    await wait_for_async(
        lambda: _has_members(client, "sizes", 1), DEADLINE_S, what="the first member of job sizes"
    )
    with pytest.raises(FailedPreconditionError) as caught:
        await within(client.join("sizes", 3, host="b", interfaces=[LO]))
    message = str(caught.value)
    assert "world_size 3" in message
    assert "world_size 2" in message
    await within(client.join("sizes", 2, host="b", interfaces=[LO]))
    await within(pending)
    await assert_serves(client)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"job": "range", "world_size": 2, "rank": 5},
            r"members\[0\]\.rank 5 must be in 0\.\.1 \(world_size 2\)",
        ),
        ({"job": "", "world_size": 2}, r"job '' must be 1 to 128 letters"),
        ({"job": "zero", "world_size": 0}, r"world_size 0 must be in 1\.\."),
        ({"job": "bad name", "world_size": 1}, r"job 'bad name' must be"),
    ],
)
async def test_join_refuses_invalid_fields_with_invalid_argument_naming_field_value_rule(
    client: CoordinatorClient, kwargs: dict[str, object], pattern: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=pattern):
        await within(client.join(interfaces=[LO], **kwargs))  # type: ignore[arg-type]
    await assert_serves(client)


async def test_join_refuses_a_missing_socket_name_naming_the_interfaces_that_exist(
    client: CoordinatorClient,
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await within(client.join("iface", 1, host="h1", interfaces=[LO, ETH], socket_name="ib9"))
    message = str(caught.value)
    assert "socket_name 'ib9'" in message
    assert "eth7" in message
    assert "lo" in message
    await assert_serves(client)


async def test_join_times_out_with_deadline_exceeded_naming_joined_count_and_missing_ranks(
    client: CoordinatorClient,
) -> None:
    started = time.monotonic()
    with pytest.raises(JoinTimeoutError) as caught:
        await within(client.join("late", 3, rank=0, host="a", interfaces=[LO], join_timeout=1.0))
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 5.0
    message = str(caught.value)
    assert "1 of 3 members joined" in message
    assert "ranks missing: 1, 2" in message
    # The timed-out member withdrew: a full world can still form under the same name.
    assert (await form(client, "late", 2))[0].generation >= 1
    await assert_serves(client)


async def test_join_refuses_a_stale_generation_with_failed_precondition(client: CoordinatorClient) -> None:
    members = await form(client, "gens")
    assert {m.generation for m in members} == {1}
    for m in members:
        await within(client.leave(m.member_id, m.secret, 0))
    with pytest.raises(FailedPreconditionError, match=r"generation 1 is stale"):
        await within(client.join("gens", 2, host="a", interfaces=[LO], generation=1))
    again = await within(
        asyncio.gather(
            client.join("gens", 2, host="a", interfaces=[LO], generation=2),
            client.join("gens", 2, host="b", interfaces=[LO]),
        )
    )
    assert {m.generation for m in again} == {2}
    await assert_serves(client)


async def test_calls_with_a_wrong_secret_are_unauthenticated(client: CoordinatorClient) -> None:
    members = await form(client, "secret")
    with pytest.raises(UnauthenticatedError):
        await within(client.leave(members[0].member_id, "not-the-secret", 0))
    with pytest.raises(UnauthenticatedError):
        await within(client.heartbeat([MemberReport(members[0].member_id, "not-the-secret")]))
    await assert_serves(client)


# -- heartbeats and events ---------------------------------------------------------------------


async def test_heartbeat_acks_known_members_and_names_unknown_ones(client: CoordinatorClient) -> None:
    members = await form(client, "beat")
    reply = await within(client.heartbeat([MemberReport(m.member_id, m.secret) for m in members]))
    assert reply.unknown_members == ()
    assert reply.events == ()
    reply = await within(client.heartbeat([MemberReport("00ff00ff", "x")]))
    assert reply.unknown_members == ("00ff00ff",)


async def test_heartbeat_stream_delivers_a_peer_failure_as_member_failed(client: CoordinatorClient) -> None:
    survivor, failing = await form(client, "stream")
    events: list[Event] = []
    async with client.heartbeats(lambda: [MemberReport(survivor.member_id, survivor.secret)], 0.2) as stream:
        first = await within(stream.__anext__())
        assert first.unknown_members == ()
        await within(client.leave(failing.member_id, failing.secret, 3, "boom"))

        async def failure_seen() -> None:
            async for reply in stream:
                events.extend(reply.events)
                if any(e.kind is EventKind.MEMBER_FAILED for e in events):
                    return

        await within(failure_seen(), 5.0)
        assert stream.connected
    failed = next(e for e in events if e.kind is EventKind.MEMBER_FAILED)
    # form() joins host0, host1, ... in order; the second member is the one that failed.
    assert (failed.job, failed.generation, failed.rank, failed.host, failed.reason) == (
        "stream", 1, failing.rank, "host1", "boom",
    )  # fmt: skip
    assert failed.describe() == f"rank {failing.rank} on host {failed.host} failed: boom"


async def test_heartbeat_stream_raises_when_the_callback_breaks(client: CoordinatorClient) -> None:
    def broken() -> list[MemberReport]:
        raise RuntimeError("no reports today")

    async with client.heartbeats(broken, 0.1) as stream:
        with pytest.raises(RuntimeError, match="no reports today"):
            await within(stream.__anext__())


async def test_first_answer_waits_for_the_coordinators_first_reply_and_never_on_an_ended_stream(
    client: CoordinatorClient,
) -> None:
    """What ``coord_ip_init`` waits on before it returns (tests/test_gil_liveness.py says why)."""
    (member,) = await form(client, "first", 1)
    stream = client.heartbeats(lambda: [MemberReport(member.member_id, member.secret)], 0.2)
    assert await within(stream.first_answer(DEADLINE_S), 1.0) is False  # not started: no wait
    async with stream:
        assert await within(stream.first_answer(DEADLINE_S)) is True
        assert stream.connected
        assert await within(stream.first_answer(DEADLINE_S), 1.0) is True  # once answered, at once
    assert stream.ended

    def broken() -> list[MemberReport]:
        raise RuntimeError("no reports today")

    async with client.heartbeats(broken, 0.1) as refused:
        # Ends before anything is sent: the wait returns then, not after its timeout.
        assert await within(refused.first_answer(DEADLINE_S), 5.0) is False
        assert refused.ended
        with pytest.raises(RuntimeError, match="no reports today"):
            await within(refused.__anext__())


async def test_watch_yields_world_formed_then_member_failed(client: CoordinatorClient) -> None:
    _, b = await form(client, "watched")
    seen: list[Event] = []

    async def watch() -> None:
        async for event in client.watch("watched", timeout=10.0):
            seen.append(event)
            if event.kind is EventKind.MEMBER_FAILED:
                return

    watcher = asyncio.ensure_future(watch())
    await wait_for_async(lambda: seen, DEADLINE_S, what="a first event")
    assert seen[0].kind is EventKind.WORLD_FORMED
    await within(client.leave(b.member_id, b.secret, -9, "killed by signal 9"))
    await within(watcher)
    assert (seen[-1].rank, seen[-1].reason) == (b.rank, "killed by signal 9")


# -- reaching the coordinator ------------------------------------------------------------------


@pytest.mark.integration  # the coordinator starts as a process
async def test_client_waits_for_a_coordinator_that_starts_late(tmp_path: Path) -> None:
    late = CoordinatorProcess(
        grpc_port=free_port(),
        http_port=free_port(),
        state_path=None,
        args=["--heartbeat-interval", "0.5"],
        log_path=tmp_path / "late.log",
    )
    starter = threading.Timer(1.5, late.start)
    try:
        async with CoordinatorClient(late.grpc_target, timeout=20.0) as c:
            starter.start()
            started = time.monotonic()
            member = await within(c.join("late-start", 1, host="a", interfaces=[LO]), 25.0)
            assert time.monotonic() - started >= 1.0
            assert member.rank == 0
            assert await within(c.leave(member.member_id, member.secret, 0)) == "FINISHED"
    finally:
        starter.cancel()
        starter.join(30)
        if late.proc is not None:
            late.stop()


@pytest.mark.integration  # a real coordinator, killed and restarted
async def test_a_waiting_join_outlives_restarts_of_its_one_coordinator_and_the_world_forms_once(
    tmp_path: Path,
) -> None:
    # One address is a list of one: a Join waiting there when the coordinator stops (SIGTERM
    # cancels the calls in flight) or dies (SIGKILL breaks the connection) is sent again, the same
    # Join, when it is back, until the join deadline, however often that happens.
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=tmp_path / "state.sqlite",
        args=["--heartbeat-interval", "0.5", "--shutdown-grace", "0"], log_path=tmp_path / "c.log",
    )  # fmt: skip
    coord.start()
    try:
        async with CoordinatorClient(coord.grpc_target, timeout=10.0) as c:
            waiting = asyncio.ensure_future(
                c.join("restarts", 2, host="a", interfaces=[LO], join_timeout=120.0)
            )
            for stop in (coord.kill, coord.stop) * 2:
                await wait_for_async(
                    lambda: _has_members(c, "restarts", 1), DEADLINE_S * 2, what="the Join to wait"
                )
                assert not waiting.done()
                await asyncio.to_thread(stop)
                await asyncio.to_thread(coord.start)
            other = await within(c.join("restarts", 2, host="b", interfaces=[LO]), DEADLINE_S * 2)
            first = await within(waiting, DEADLINE_S * 2)
            assert {first.rank, other.rank} == {0, 1}
            assert first.generation == other.generation == 1
            jobs = await within(c.list_jobs("restarts"))
            assert sorted(m.host for m in jobs[0].members) == ["a", "b"]
    finally:
        if coord.proc is not None:
            coord.stop()


@pytest.mark.integration  # a real coordinator, killed and restarted
async def test_a_watch_of_one_coordinator_reattaches_when_it_restarts_and_tells_a_later_failure(
    tmp_path: Path,
) -> None:
    # One address is a list of one: the stream is opened again when the coordinator is back.
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=tmp_path / "state.sqlite",
        args=["--heartbeat-interval", "0.5", "--heartbeat-misses", "600"], log_path=tmp_path / "c.log",
    )  # fmt: skip
    coord.start()
    try:
        async with CoordinatorClient(coord.grpc_target, timeout=10.0) as c:
            _, b = await form(c, "rewatched")
            seen: list[Event] = []

            async def watch() -> None:
                async for event in c.watch("rewatched", timeout=120.0):
                    seen.append(event)
                    if event.kind in FAILED:
                        return

            watcher = asyncio.ensure_future(watch())
            await wait_for_async(lambda: seen, DEADLINE_S, what="the watch's first event")
            await asyncio.to_thread(coord.kill)
            await asyncio.to_thread(coord.start)
            await within(c.leave(b.member_id, b.secret, 3, "boom"), DEADLINE_S * 2)
            await within(watcher, DEADLINE_S * 2)
        # The world formed once (the state a new stream starts with is not yielded again); the
        # failure is told as it happens, or as the job's state when the watch re-attached after it.
        assert [e.kind for e in seen[:-1]] == [EventKind.WORLD_FORMED]
        assert (seen[-1].kind in FAILED, seen[-1].rank) == (True, b.rank)
        assert seen[-1].reason.endswith("boom"), seen[-1]
    finally:
        if coord.proc is not None:
            coord.stop()


async def test_unreachable_coordinator_is_unavailable_naming_target_and_cause() -> None:
    target = f"127.0.0.1:{free_port()}"
    async with CoordinatorClient(target, timeout=1.0) as c:
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await within(c.list_jobs())
        assert time.monotonic() - started < 5.0
    assert target in str(caught.value)
    # Named by its cause, whether the probe or the 1 s deadline came first.
    assert "connection refused" in str(caught.value)


async def test_token_is_sent_as_bearer_metadata(start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    coord = start_coordinator("--heartbeat-interval", "0.5", "--token-file", str(token_file))
    async with CoordinatorClient(coord.grpc_target, timeout=5.0) as anonymous:
        with pytest.raises(UnauthenticatedError):
            await within(anonymous.list_jobs())
    async with CoordinatorClient(coord.grpc_target, "s3cret-token", timeout=5.0) as c:
        assert await within(c.list_jobs()) == []


# -- pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target", ["head:50051", "10.0.0.1:1", "[fd00::1]:50051", "dns:///head:50051", "unix:/run/s"]
)
def test_validate_target_accepts_addresses_and_uris(target: str) -> None:
    assert validate_target(target) == target


@pytest.mark.parametrize("target", ["head", "head:", ":50051", "head:0", "head:70000", "a b:1", ""])
def test_validate_target_rejects_malformed_addresses(target: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"must have the form HOST:PORT"):
        validate_target(target)


def test_client_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(InvalidArgumentError, match=r"timeout=0 must be a positive number of seconds"):
        CoordinatorClient("head:50051", timeout=0)


def test_event_describe_names_rank_host_and_reason() -> None:
    event = Event(EventKind.MEMBER_FAILED, "j", 2, 3, "n1", "exited with code 3")
    assert event.describe() == "rank 3 on host n1 failed: exited with code 3"
    assert Event(EventKind.MEMBER_FAILED, "j", 2, -1).describe() == "a rank failed: no reason given"


async def _has_members(client: CoordinatorClient, job: str, count: int) -> bool:
    return await joined_count(client, job) >= count
