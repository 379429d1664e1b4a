"""Validation rules and the membership's all-or-nothing changes, without a network."""

from __future__ import annotations

from typing import Any

import pytest

from sarcomm.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.config import Limits
from sarcomm.coordinator.domain.membership import JobState, JoinSpec, MemberRequest, Membership
from sarcomm.v1 import coordinator_pb2 as pb
from tests.helpers import LO_PB as LO
from tests.helpers import FakeClock

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")


def join(**fields: Any) -> pb.JoinRequest:
    base: dict[str, Any] = {"job": "j", "world_size": 2, "host": "h", "interfaces": [LO], "store_port": 29500}
    return pb.JoinRequest(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (
            {"world_size": 70_000},
            ResourceExhaustedError,
            r"^world_size 70000 must be in 1\.\.65536: the coordinator's limit max_world_size",
        ),
        (
            {"interfaces": [pb.NetworkInterface(name="eth0", addresses=["fe80::1%\x1b[31m"])]},
            InvalidArgumentError,
            r"^interfaces\[0\]\.addresses\[0\] 'fe80::1%\\x1b\[31m' must be an IPv4 or IPv6 address",
        ),
        (
            {"interfaces": [pb.NetworkInterface(name="eth0", addresses=["fe80::1%" + "a" * 70])]},
            InvalidArgumentError,
            r"at most 64 characters$",
        ),
        (
            {"interfaces": [pb.NetworkInterface(name="eth0", addresses=["10.0.0.1/24"])]},
            InvalidArgumentError,
            r"^interfaces\[0\]\.addresses\[0\] '10\.0\.0\.1/24' must be an IPv4 or IPv6 address",
        ),
        ({"job": "a\nb"}, InvalidArgumentError, r"^job 'a\\nb' must be 1 to 128 letters"),
        ({"host": "x" * 300}, InvalidArgumentError, r"^host 'xxx.*\.\.\.x' must be 1 to 253 letters"),
    ],
)
def test_join_fields_are_refused_naming_field_shortened_value_and_rule(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        validation.join_spec(join(**fields), "127.0.0.1", Limits())


def test_report_fields_are_refused_naming_field_value_and_rule() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^m '10\.0\.0\.1:8_0' must be IP:PORT"):
        validation.metrics_address("10.0.0.1:8_0", "m")
    with pytest.raises(InvalidArgumentError, match=r"^m '\[fe80::1%\\x1b\]:80' must be IP:PORT"):
        validation.metrics_address("[fe80::1%\x1b]:80", "m")
    assert validation.metrics_address("[fd00::1]:9100", "m") == "[fd00::1]:9100"
    with pytest.raises(InvalidArgumentError, match=r"^p\.op 'all\\x1b\[2J' must be at most 64 letters"):
        validation.progress(pb.Progress(op="all\x1b[2J"), "p")
    with pytest.raises(InvalidArgumentError, match=r"^reason 'killed\\x1b\[31m' must be printable text"):
        validation.reason("killed\x1b[31m")
    assert validation.reason("line one\n\tline two") == "line one\n\tline two"
    with pytest.raises(InvalidArgumentError, match=r"^s '<300 characters>' must be at most 256 characters"):
        validation.secret("s" * 300, "s")
    with pytest.raises(InvalidArgumentError, match=r"^reports '<4097 entries>' must hold at most 4096"):
        validation.report_count(4097)
    with pytest.raises(InvalidArgumentError, match=r"^generation -1 must be >= 0"):
        validation.watch_generation(-1)


def test_limits_refuse_nonsense_values() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^max_streams 0 must be an integer >= 1"):
        Limits(max_streams=0)
    with pytest.raises(InvalidArgumentError, match=r"^max_message_bytes 100 must be at least 1024 bytes"):
        Limits(max_message_bytes=100)


# -- membership: a refused change changes nothing ------------------------------------------------


def spec(host: str, job: str = "j", world_size: int = 2, generation: int = 0, **kw: Any) -> JoinSpec:
    fields: dict[str, Any] = {
        "interfaces": (InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK),),
        "members": (MemberRequest(local_rank=0),),
        "store_port": 29500,
        "peer_address": "127.0.0.1",
        **kw,
    }
    return JoinSpec(job=job, world_size=world_size, host=host, generation=generation, **fields)


def finished(membership: Membership, job: str) -> None:
    tickets = [membership.join(spec("a", job)), membership.join(spec("b", job))]
    for ticket in tickets:
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            membership.leave(member.member_id, secret, 0)


def test_a_refused_join_leaves_the_ended_generation_as_it_was(clock: FakeClock) -> None:
    membership = Membership(liveness_timeout=3.0, clock=clock)
    finished(membership, "j")
    before = membership.job("j")
    assert before is not None
    with pytest.raises(FailedPreconditionError, match=r"generation 7 is stale"):
        membership.join(spec("a", generation=7))
    # Not replaced by an empty forming generation: status still shows the finished one.
    assert membership.job("j") is before
    assert before.state is JobState.FINISHED


def test_a_world_whose_interface_choice_fails_is_not_left_full_and_unformed(clock: FakeClock) -> None:
    membership = Membership(liveness_timeout=3.0, clock=clock)
    first = membership.join(spec("a"))
    # A host whose loopback has no address (and nothing else): every member connected over
    # loopback, so the single-host rule looks at loopback, which has nothing to hand out.
    bare = (
        InterfaceInfo("lo", (), InterfaceKind.LOOPBACK),
        InterfaceInfo("eth0", ("fe80::1",), InterfaceKind.PHYSICAL),
    )
    with pytest.raises(InvalidArgumentError, match=r"has no address other hosts could dial"):
        membership.join(spec("b", interfaces=bare))
    job = membership.job("j")
    assert job is not None
    assert [m.member_id for m in job.members] == [first.members[0].member_id]
    assert job.state is JobState.FORMING
    # The world still forms with a proper second member.
    membership.join(spec("c"))
    formed = membership.job("j")  # the same job, read again (mypy would keep FORMING from above)
    assert formed is job
    assert formed.state is JobState.RUNNING


def test_a_single_host_world_with_an_addressless_loopback_uses_its_routable_interface(
    clock: FakeClock,
) -> None:
    membership = Membership(liveness_timeout=3.0, clock=clock)
    interfaces = (
        InterfaceInfo("lo", (), InterfaceKind.LOOPBACK),
        InterfaceInfo("eth0", ("10.1.2.3",), InterfaceKind.PHYSICAL, default_route=True),
    )
    membership.join(spec("a", world_size=1, interfaces=interfaces))
    job = membership.job("j")
    assert job is not None
    assert job.master_addr == "10.1.2.3"


def test_ended_jobs_beyond_max_ended_jobs_are_forgotten_oldest_first(clock: FakeClock) -> None:
    membership = Membership(liveness_timeout=3.0, max_ended_jobs=2, clock=clock)
    for name in ("one", "two", "three"):
        clock.advance(10)
        finished(membership, name)
    assert [j.name for j in membership.jobs()] == ["three", "two"]
    # Forgotten in memory only: the name's next generation continues the numbering.
    membership.join(spec("a", job="one"))
    job = membership.job("one")
    assert job is not None
    assert job.generation == 2


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
