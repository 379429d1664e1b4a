"""A Join sent again (the same ``join_id``) is the same request: it is answered with its own
members, never with another Join's, before and after a restart or a take-over; and a try that
gives up does not withdraw the members that its resend still waits for.

In process on port 0 with raw ``sarcomm.v1`` stubs: the tests craft Joins that no client sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest

from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import MemberReport
from sarcomm.coordinator.domain.model import JobState
from sarcomm.coordinator.domain.resent_joins import JoinIdentity
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.coordinator_fixture import InProcessCoordinator, in_process_coordinator
from tests.helpers import LO_PB, FakeClock, spec, wait_for_async

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")

#: Bounds each wait for something the coordinator does at once.
WAIT_S = 10.0
#: The join id of h1's Join, which the other requests reuse.
JOIN_ID = "a" * 32
#: What every refusal ends with.
RULE = (
    "a Join sent again must repeat its first try (job, host, world_size, members, their ranks and "
    "local ranks, store_port, socket_name, interfaces); give each new Join a fresh random join_id"
)
ETH_PB = pb.NetworkInterface(name="eth0", addresses=["10.9.9.9"], kind=pb.INTERFACE_KIND_PHYSICAL)


def join_request(
    host: str = "h1",
    *,
    job: str = "seat",
    world_size: int = 2,
    members: int = 2,
    ranks: Sequence[int] | None = None,
    store_port: int = 29500,
    interfaces: Sequence[pb.NetworkInterface] = (LO_PB,),
    join_id: str = JOIN_ID,
    join_timeout_seconds: float = 0.0,
) -> pb.JoinRequest:
    specs = [pb.MemberSpec(local_rank=i) for i in range(members)]
    for member, rank in zip(specs, ranks or (), strict=False):
        member.rank = rank
    return pb.JoinRequest(
        job=job,
        world_size=world_size,
        host=host,
        interfaces=list(interfaces),
        members=specs,
        store_port=store_port,
        join_id=join_id,
        join_timeout_seconds=join_timeout_seconds,
    )


@contextlib.asynccontextmanager
async def stub(coord: InProcessCoordinator) -> AsyncIterator[pb_grpc.CoordinatorAsyncStub]:
    """A raw stub on a connection of its own."""
    async with grpc.aio.insecure_channel(coord.target) as channel:
        yield pb_grpc.CoordinatorStub(channel)


async def refused(coord: InProcessCoordinator, request: pb.JoinRequest) -> grpc.aio.AioRpcError:
    """The refusal of ``request`` (which must come at once, not after a wait)."""
    async with stub(coord) as raw:
        try:
            answer = await raw.Join(request, timeout=WAIT_S)
        except grpc.aio.AioRpcError as error:
            return error
    pytest.fail(f"answered with another Join's members: {answer}")


def assert_first_world(coord: InProcessCoordinator) -> None:
    """h1's world is as its Join made it: running, world size 2, its two members."""
    job = coord.coordinator.membership.job("seat")
    assert job is not None
    assert (job.state, job.world_size, [m.host for m in job.members]) == (JobState.RUNNING, 2, ["h1", "h1"])


async def authenticated(coord: InProcessCoordinator, answer: pb.JoinResponse) -> bool:
    """Whether every member of ``answer`` is accepted with its secret (one heartbeat)."""
    async with coord.client() as client:
        reply = await client.heartbeat([MemberReport(a.member_id, a.secret) for a in answer.assignments])
    return not reply.unknown_members


def join_waiters(coord: InProcessCoordinator) -> int:
    """Join calls the coordinator holds now."""
    term = coord.coordinator.term
    assert term is not None
    return term.service._join_waiters


# (what the reusing Join changes, the difference the refusal names)
CHANGES: list[tuple[dict[str, Any], str]] = [
    ({"host": "intruder"}, "host 'h1' then, 'intruder' now"),
    ({"world_size": 3}, "world_size 2 then, 3 now"),
    ({"members": 1}, "members 2 then, 1 now"),
    ({"ranks": [1, 0]}, "members.rank [any, any] then, [1, 0] now"),
    ({"store_port": 29600}, "store_port 29500 then, 29600 now"),
    ({"job": "other"}, "job 'seat' then, 'other' now"),
    ({"interfaces": [LO_PB, ETH_PB]}, "interfaces 'lo 127.0.0.1' then, 'lo 127.0.0.1; eth0 10.9.9.9' now"),
]


@pytest.mark.parametrize(("change", "difference"), CHANGES, ids=[next(iter(c)) for c, _ in CHANGES])
async def test_join_refuses_a_join_id_reused_with_other_content_and_keeps_the_first_members(
    change: dict[str, Any], difference: str
) -> None:
    async with in_process_coordinator(FakeClock()) as coord:
        async with stub(coord) as raw:
            first = await raw.Join(join_request(), timeout=WAIT_S)
            # The true resend is still the same request: the same answer.
            again = await raw.Join(join_request(join_timeout_seconds=30), timeout=WAIT_S)
        assert again == first
        error = await refused(coord, join_request(**{"host": "h1", **change}))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS
        assert error.details() == f"join_id '{JOIN_ID}' names another Join ({difference}): {RULE}"
        assert await authenticated(coord, first)
        assert_first_world(coord)
        assert coord.coordinator.membership.job("other") is None


def test_join_identity_names_interfaces_that_differ_in_kind_or_default_route_only() -> None:
    first = spec("h1", None)
    sent = replace(first, interfaces=(InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.PHYSICAL, True),))
    assert JoinIdentity.of_spec(first).differences(JoinIdentity.of_spec(sent)) == [
        "interfaces 'lo 127.0.0.1 loopback' then, 'lo 127.0.0.1 physical default route' now"
    ]


async def test_join_names_every_difference_of_a_reused_join_id() -> None:
    async with in_process_coordinator(FakeClock()) as coord:
        async with stub(coord) as raw:
            await raw.Join(join_request(), timeout=WAIT_S)
        error = await refused(coord, join_request("intruder", world_size=3, members=1))
    assert error.details() == (
        f"join_id '{JOIN_ID}' names another Join (host 'h1' then, 'intruder' now; world_size 2 then, 3 "
        f"now; members 2 then, 1 now): {RULE}"
    )


async def test_join_refuses_a_join_id_reused_while_its_world_forms() -> None:
    async with in_process_coordinator(FakeClock()) as coord, stub(coord) as raw:
        waiting = asyncio.ensure_future(raw.Join(join_request(world_size=3), timeout=WAIT_S * 3))
        await wait_for_async(lambda: join_waiters(coord) == 1, WAIT_S, what="h1's Join to wait")
        # Another host reusing the id gets nothing of h1's, at once (it does not wait with it).
        error = await refused(coord, join_request("intruder", world_size=3, members=1))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS
        assert "host 'h1' then, 'intruder' now" in (error.details() or "")
        last = await asyncio.wait_for(
            raw.Join(join_request("h2", world_size=3, members=1, join_id="b" * 32), timeout=WAIT_S), WAIT_S
        )
        first = await asyncio.wait_for(waiting, WAIT_S)
    assert (first.world_size, len(first.assignments), len(last.assignments)) == (3, 2, 1)
    assert {a.rank for a in [*first.assignments, *last.assignments]} == {0, 1, 2}


@pytest.mark.parametrize("change", [{"host": "intruder"}, {"world_size": 3, "members": 1}])
async def test_join_refuses_a_join_id_reused_after_a_restart_and_the_first_secrets_still_work(
    state_backend: dict[str, Any], change: dict[str, Any]
) -> None:
    # Both stores: a restart on SQLite, and on etcd the next leader taking over the same jobs.
    async with in_process_coordinator(FakeClock(), **state_backend) as first, stub(first) as raw:
        answered = await raw.Join(join_request(), timeout=WAIT_S)
    async with in_process_coordinator(FakeClock(monotonic=5.0), **state_backend) as second:
        error = await refused(second, join_request(**{"host": "h1", **change}))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS
        assert (error.details() or "").startswith(f"join_id '{JOIN_ID}' names another Join (")
        # h1's members keep their secrets: the refused Join changed nothing of them.
        assert await authenticated(second, answered)
        assert_first_world(second)


async def test_join_still_answers_the_true_resend_after_a_restart_once_a_reused_id_was_refused(
    state_backend: dict[str, Any],
) -> None:
    async with in_process_coordinator(FakeClock(), **state_backend) as first, stub(first) as raw:
        answered = await raw.Join(join_request(), timeout=WAIT_S)
    async with in_process_coordinator(FakeClock(monotonic=5.0), **state_backend) as second:
        error = await refused(second, join_request("intruder"))
        assert error.code() is grpc.StatusCode.ALREADY_EXISTS
        # The answer to h1 was lost with the first coordinator: its resend gets its own members.
        async with stub(second) as raw:
            again = await raw.Join(join_request(join_timeout_seconds=30), timeout=WAIT_S)
        assert [(a.rank, a.member_id) for a in again.assignments] == [
            (a.rank, a.member_id) for a in answered.assignments
        ]
        assert await authenticated(second, again)
        # Sent once more, the same answer (the same secrets); reused, still nothing.
        async with stub(second) as raw:
            assert await raw.Join(join_request(), timeout=WAIT_S) == again
        assert (await refused(second, join_request("intruder"))).code() is grpc.StatusCode.ALREADY_EXISTS
        assert await authenticated(second, again)


@pytest.mark.parametrize("gives_up", ["cancelled", "timed out"])
async def test_a_try_that_gives_up_leaves_its_members_to_the_resend_still_waiting(gives_up: str) -> None:
    # The client's first try waits on one connection; the client sends the same Join again on a
    # new one (the old one looked dead); then the first try ends. The resend must still form the
    # world with h1: the members are withdrawn only when no call waits for them any more.
    async with in_process_coordinator(FakeClock()) as coord, stub(coord) as old, stub(coord) as new:
        timeout = 1.0 if gives_up == "timed out" else 0.0
        stale = old.Join(join_request("h0", members=1, join_timeout_seconds=timeout), timeout=WAIT_S * 3)
        await wait_for_async(lambda: join_waiters(coord) == 1, WAIT_S, what="the first try to wait")
        resend = asyncio.ensure_future(new.Join(join_request("h0", members=1), timeout=WAIT_S * 3))
        await wait_for_async(lambda: join_waiters(coord) == 2, WAIT_S, what="the resend to wait")
        if gives_up == "cancelled":
            stale.cancel()
        with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
            await stale
        await wait_for_async(lambda: join_waiters(coord) == 1, WAIT_S, what="the first try to end")
        other = await asyncio.wait_for(
            new.Join(join_request("h1", members=1, join_id="b" * 32), timeout=WAIT_S), WAIT_S
        )
        answer = await asyncio.wait_for(resend, WAIT_S)
    assert (answer.generation, answer.world_size) == (other.generation, 2)
    assert {answer.assignments[0].rank, other.assignments[0].rank} == {0, 1}
