"""Property-based tests (hypothesis) over every request message.

Random and boundary values never crash the coordinator, never leave a job half-changed, and always
get a documented status code. Two levels:

- in process, many examples: a request goes through ``validation`` and ``Membership`` exactly as
  the service sends it; a refusal leaves the whole state as it was, an acceptance changes only the
  job it names, and every address handed out is one a member of that job reported;
- over the wire, against a real ``sar-coordinator``: every RPC with random messages and random
  bytes, jobs formed beforehand stay exactly as they were, and the coordinator stays SERVING.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import SarcommError
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.config import Limits
from sarcomm.coordinator.domain.membership import JobState, Membership
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess
from tests.helpers import FakeClock, free_port, wait_for

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")

#: Every status a request may get: those of sarcomm's error hierarchy (errors.py), and OK.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
INT32 = (-(2**31), -1, 0, 1, 2, 3, 4, 255, 256, 65535, 65536, 2**31 - 1)
DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 0.1, 1e308, float("inf"), float("-inf"), float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
)
BOUNDARY_TEXT = [
    "", "a", "gnn", "victim", "forming", "a" * 128, "a" * 129, "a" * 253, "a" * 254, "-x", "x y", "é",
    "\x00", "\x1b[31m", "lo", "eth0", "127.0.0.1", "::1", "fe80::1%eth0", "fe80::1%\x1b", "10.0.0.1",
    "0.0.0.0", "255.255.255.255", "1.2.3.4/24", "[::1]:80", "10.0.0.1:9100", "10.0.0.1:0",
    "10.0.0.1:8_0", "gloo", "nccl", "all_reduce", "a" * 5000,
]  # fmt: skip
TEXT = st.one_of(st.sampled_from(BOUNDARY_TEXT), st.text(max_size=80))
INTS = st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))
SMALL = st.one_of(st.sampled_from((0, 1, 2, 3)), INTS)

INTERFACES = st.builds(
    pb.NetworkInterface,
    name=st.one_of(st.sampled_from(["lo", "eth0", "eth1", "docker0"]), TEXT),
    addresses=st.lists(
        st.one_of(st.sampled_from(["127.0.0.1", "10.0.0.5", "fd00::5", "::1"]), TEXT), max_size=4
    ),
    kind=st.integers(0, 7),
    default_route=st.booleans(),
)
MEMBERS = st.builds(
    lambda rank, local_rank, has_rank: (
        pb.MemberSpec(rank=rank, local_rank=local_rank) if has_rank else pb.MemberSpec(local_rank=local_rank)
    ),
    SMALL,
    SMALL,
    st.booleans(),
)
# Each request field: values that pass (so that whole requests get through and change state) and
# anything at all. A request takes the passing value for most fields and a random one for a few,
# so examples reach every rule one at a time, and also whole valid requests.
_LO = pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)
_ETH = pb.NetworkInterface(
    name="eth0", addresses=["10.0.0.7", "fd00::7"], kind=pb.INTERFACE_KIND_PHYSICAL, default_route=True
)
JOIN_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "job": (st.sampled_from(["victim", "forming", "fresh", "fresh2"]), TEXT),
    "world_size": (st.sampled_from((1, 2, 3)), INTS),
    "host": (st.sampled_from(["h1", "h2", "h3"]), TEXT),
    "interfaces": (st.sampled_from([[_LO], [_LO, _ETH], [_ETH]]), st.lists(INTERFACES, max_size=4)),
    "members": (st.sampled_from([[], [pb.MemberSpec(local_rank=0)]]), st.lists(MEMBERS, max_size=4)),
    "store_port": (st.just(29500), INTS),
    "socket_name": (st.sampled_from(["", "lo"]), TEXT),
    "generation": (st.just(0), SMALL),
    "join_timeout_seconds": (st.just(0.0), DOUBLES),
    "backend": (st.sampled_from(["", "gloo"]), TEXT),
    "max_restarts": (st.just(0), SMALL),
}


@st.composite
def _mostly_valid(draw: st.DrawFn, message: type[Any], fields: dict[str, Any]) -> Any:
    randomized = draw(st.one_of(st.just(0), st.integers(1, 2), st.just(len(fields))))
    chosen = set(draw(st.permutations(sorted(fields)))[:randomized])
    values = {name: draw(fields[name][1] if name in chosen else fields[name][0]) for name in fields}
    return message(**values)


JOINS = _mostly_valid(pb.JoinRequest, JOIN_FIELDS)
PROGRESS = st.builds(
    pb.Progress, seq=st.integers(-(2**63), 2**63 - 1), op=TEXT, in_collective=st.booleans(), since=DOUBLES
)


def _victims_state(membership: Membership) -> list[str]:
    """Everything of every job that a request could change, as comparable text."""
    rows = []
    for job in membership.jobs():
        rows.append(
            repr((job.name, job.generation, job.state, job.world_size, job.master_addr, job.master_port))
        )
        for m in job.members:
            rows.append(
                repr(
                    (
                        m.member_id,
                        m.rank,
                        m.state,
                        m.last_seen,
                        m.last_heartbeat,
                        m.metrics_address,
                        m.progress,
                    )
                )
            )
    return rows


def _world() -> tuple[Membership, list[tuple[str, str]]]:
    """A membership with a running job ``victim`` (2 ranks) and ``forming`` (1 of 3 joined)."""
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock)
    limits = Limits()
    secrets: list[tuple[str, str]] = []
    for job, world, hosts in (("victim", 2, ("a", "b")), ("forming", 3, ("c",))):
        for host in hosts:
            eth0 = pb.NetworkInterface(
                name="eth0", addresses=[f"10.0.0.{len(secrets) + 1}"], kind=pb.INTERFACE_KIND_PHYSICAL
            )
            request = pb.JoinRequest(
                job=job, world_size=world, host=host, store_port=29500, interfaces=[eth0]
            )
            ticket = membership.join(validation.join_spec(request, "10.9.9.9", limits))
            secrets += [(m.member_id, s) for m, s in zip(ticket.members, ticket.secrets, strict=True)]
    return membership, secrets


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=JOINS, peer=st.sampled_from([None, "127.0.0.1", "10.0.0.9", "::1"]))
def test_join_in_process_refuses_whole_or_changes_only_its_job(
    request: pb.JoinRequest, peer: str | None
) -> None:
    membership, _ = _world()
    before = _victims_state(membership)
    others_before = {j.name: _victims_state_of(membership, j.name) for j in membership.jobs()}
    try:
        spec = validation.join_spec(request, peer, Limits(max_world_size=1024))
        ticket = membership.join(spec)
    except SarcommError as error:
        event(f"refused {error.code}")
        assert grpc.StatusCode[error.code] in DOCUMENTED  # noqa: PT017 (the property, not a test of one error)
        assert _victims_state(membership) == before
        return
    event(f"accepted, job {ticket.job.state.value}")
    for name, rows in others_before.items():
        if name != spec.job:
            assert _victims_state_of(membership, name) == rows
    job = ticket.job
    if job.state is JobState.RUNNING:
        # Every address handed out is one the member reported on the interface it was given.
        for member in job.members:
            on_interface = [i for i in member.interfaces if i.name == member.interface]
            reported = {parse_address(a) for i in on_interface for a in i.addresses}
            assert parse_address(member.address) in reported
        master = next(m for m in job.members if m.rank == 0)
        assert (job.master_addr, job.master_port) == (master.address, master.store_port)
        assert sorted(m.rank for m in job.members if m.rank is not None) == list(range(job.world_size))


@settings(max_examples=300, deadline=None)
@given(
    pick=st.integers(0, 2),
    secret_pick=st.integers(0, 3),
    member_id=TEXT,
    random_secret=TEXT,
    exit_code=INTS,
    reason=TEXT,
    progress=st.one_of(st.none(), PROGRESS),
    metrics_address=TEXT,
    age=DOUBLES,
)
def test_leave_and_heartbeat_in_process_refuse_other_members_and_bad_fields(
    pick: int, secret_pick: int, member_id: str, random_secret: str, exit_code: int, reason: str,
    progress: pb.Progress | None, metrics_address: str, age: float,
) -> None:  # fmt: skip
    membership, secrets = _world()
    before = _victims_state(membership)
    target = secrets[pick][0] if pick < 2 else member_id
    # Another member's secret, a random one, or none: never the member's own.
    secret = (secrets[(pick + 1) % 2][1], secrets[2][1], random_secret, "")[secret_pick]
    for action in ("leave", "heartbeat"):
        try:
            checked_id = validation.member_id(target)
            checked_secret = validation.secret(secret)
            if action == "leave":
                membership.leave(
                    checked_id, checked_secret, validation.exit_code(exit_code), validation.reason(reason)
                )
            else:
                checked = validation.progress(progress, "progress") if progress is not None else None
                address = validation.metrics_address(metrics_address, "metrics_address")
                membership.heartbeat(
                    checked_id, checked_secret, checked, address, age=validation.age_seconds(age, "age")
                )
        except SarcommError as error:
            assert grpc.StatusCode[error.code] in DOCUMENTED  # noqa: PT017 (the property, not a test of one error)
        else:
            pytest.fail(f"{action} with another member's secret was accepted")
        assert _victims_state(membership) == before


def _victims_state_of(membership: Membership, name: str) -> list[str]:
    job = membership.job(name)
    if job is None:
        return []
    return [repr((job.generation, job.state, len(job.members), job.master_addr))] + [
        repr((m.member_id, m.rank, m.state, m.last_heartbeat)) for m in job.members
    ]


# -- over the wire -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_coordinator(
    tmp_path_factory: pytest.TempPathFactory, real_processes: None
) -> Iterator[CoordinatorProcess]:
    # Long liveness: the victims never report. A short join timeout: random valid joins of worlds
    # that never form give up quickly instead of holding the test.
    directory = tmp_path_factory.mktemp("fuzz")
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=directory / "state.sqlite",
        args=["--heartbeat-interval", "600", "--join-timeout", "0.3"], log_path=directory / "coordinator.log",
    )  # fmt: skip
    coord.start()
    yield coord
    coord.stop()


@pytest.fixture(scope="module")
def wire(fuzz_coordinator: CoordinatorProcess) -> Iterator[dict[str, Any]]:
    channel = grpc.insecure_channel(fuzz_coordinator.grpc_target)
    stub = pb_grpc.CoordinatorStub(channel)
    iface = [pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)]
    with futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda host: stub.Join(
                    pb.JoinRequest(job="victim", world_size=2, host=host, interfaces=iface, store_port=29500),
                    timeout=10,
                ),
                ("a", "b"),
            )
        )
    members = [(a.member_id, a.secret) for answer in answers for a in answer.assignments]
    yield {"stub": stub, "channel": channel, "members": members, "coord": fuzz_coordinator}
    channel.close()


def _status(call: Any) -> grpc.StatusCode:
    """The status ``call()`` ends with; recorded as a hypothesis event (--hypothesis-show-statistics)."""
    code = _code(call)
    event(f"status {code.name}")
    return code


def _code(call: Any) -> grpc.StatusCode:
    """The status ``call()`` ends with (OK when it answered)."""
    code = grpc.StatusCode.OK
    try:
        result = call()
        if hasattr(result, "__next__"):
            for _ in result:
                break
    except grpc.RpcError as error:
        code = error.code()
    return code


def _victim(wire: dict[str, Any]) -> str:
    """The victim job as the coordinator shows it, less what the clock alone moves: once an
    accepted report put its ranks in a collective for longer than the stall threshold, the view's
    ``stall.waited_seconds`` grows between two reads with no request in between."""
    reply = wire["stub"].ListJobs(pb.ListJobsRequest(job="victim"), timeout=5)
    for job in reply.jobs:
        if job.HasField("stall"):
            job.stall.ClearField("waited_seconds")
    return str(reply)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=JOINS)
def test_join_over_the_wire_gets_a_documented_status_and_leaves_other_jobs_alone(
    wire: dict[str, Any], request: pb.JoinRequest
) -> None:
    before = _victim(wire)
    code = _status(lambda: wire["stub"].Join(request, timeout=2))
    assert code in DOCUMENTED
    assert _victim(wire) == before


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    reports=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 2),
            TEXT,
            TEXT,
            st.one_of(st.none(), st.just(pb.Progress(seq=3, op="all_reduce", since=1.0)), PROGRESS),
            st.one_of(st.just(""), st.just("127.0.0.1:9100"), TEXT),
            st.one_of(st.just(0.0), DOUBLES),
        ),
        max_size=4,
    )
)
def test_heartbeat_over_the_wire_is_taken_whole_or_not_at_all(
    wire: dict[str, Any], reports: list[Any]
) -> None:
    members = wire["members"]
    messages = []
    for pick, secret_pick, member_id, secret, progress, metrics_address, age in reports:
        target = members[pick][0] if pick < 2 else member_id
        # The member's own secret (the request may still be refused for another report or field),
        # another member's, or a random one.
        chosen = (members[pick % 2][1], members[(pick + 1) % 2][1], secret)[secret_pick]
        report = pb.MemberReport(
            member_id=target, secret=chosen, metrics_address=metrics_address, age_seconds=age
        )
        if progress is not None:
            report.progress.CopyFrom(progress)
        messages.append(report)
    before = _victim(wire)
    code = _status(lambda: wire["stub"].Heartbeat(iter([pb.HeartbeatRequest(reports=messages)]), timeout=5))
    assert code in DOCUMENTED
    if code != grpc.StatusCode.OK:
        assert _victim(wire) == before


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 2), member_id=TEXT, secret=TEXT, exit_code=INTS, reason=TEXT)
def test_leave_over_the_wire_with_another_secret_is_refused_and_changes_nothing(
    wire: dict[str, Any], pick: int, member_id: str, secret: str, exit_code: int, reason: str
) -> None:
    members = wire["members"]
    target = members[pick][0] if pick < 2 else member_id
    for wrong in (members[(pick + 1) % 2][1], secret):
        before = _victim(wire)
        request = pb.LeaveRequest(member_id=target, secret=wrong, exit_code=exit_code, reason=reason)
        code = _status(functools.partial(wire["stub"].Leave, request, timeout=5))
        assert code in DOCUMENTED - {grpc.StatusCode.OK}
        assert _victim(wire) == before


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=st.one_of(st.just("victim"), TEXT), generation=INTS, listed=TEXT)
def test_watch_and_list_jobs_over_the_wire_get_documented_statuses(
    wire: dict[str, Any], job: str, generation: int, listed: str
) -> None:
    stub = wire["stub"]
    assert (
        _status(lambda: stub.Watch(pb.WatchRequest(job=job, generation=generation), timeout=0.3))
        in DOCUMENTED
    )
    assert _status(lambda: stub.ListJobs(pb.ListJobsRequest(job=listed), timeout=5)) in DOCUMENTED


METHODS = [
    ("Join", "unary_unary"), ("Leave", "unary_unary"), ("ListJobs", "unary_unary"),
    ("Watch", "unary_stream"), ("Heartbeat", "stream_stream"),
]  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=512))
def test_random_bytes_to_every_method_get_a_documented_status(
    wire: dict[str, Any], method: tuple[str, str], payload: bytes
) -> None:
    name, kind = method
    callable_ = getattr(wire["channel"], kind)(f"/sarcomm.v1.Coordinator/{name}")
    before = _victim(wire)
    argument: Any = iter([payload]) if kind == "stream_stream" else payload
    assert _status(lambda: callable_(argument, timeout=1)) in DOCUMENTED
    assert _victim(wire) == before


def _rpcs_handled(coord: CoordinatorProcess) -> float:
    """All gRPC calls the coordinator has counted (``sar_coordinator_rpcs_total``)."""
    text = coord.get_text("/metrics")
    return sum(float(v) for v in re.findall(r"^sar_coordinator_rpcs_total\{[^}]*\} (\S+)$", text, re.M))


#: Random payloads per method that the last test sends itself.
OWN_FUZZ_PER_METHOD = 20


def test_after_the_fuzzing_the_coordinator_is_serving_and_logged_no_internal_error(
    wire: dict[str, Any],
) -> None:
    coord: CoordinatorProcess = wire["coord"]
    # Fuzz here too (seeded random bytes to every method): run alone, or after the other tests
    # were deselected, this test still checks a coordinator that has just been fuzzed.
    rng = random.Random(411)
    handled_before = _rpcs_handled(coord)
    for name, kind in METHODS:
        callable_ = getattr(wire["channel"], kind)(f"/sarcomm.v1.Coordinator/{name}")
        for _ in range(OWN_FUZZ_PER_METHOD):
            payload = rng.randbytes(rng.randint(0, 512))
            argument: Any = iter([payload]) if kind == "stream_stream" else payload
            assert _code(functools.partial(callable_, argument, timeout=1)) in DOCUMENTED
    # Every call reached the coordinator's handlers (counted there), not just the channel.
    sent = len(METHODS) * OWN_FUZZ_PER_METHOD
    wait_for(
        lambda: _rpcs_handled(coord) >= handled_before + sent,
        10,
        what=lambda: f"the coordinator to count {sent} more calls than {handled_before}",
    )
    health = health_pb2_grpc.HealthStub(wire["channel"])
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    assert coord.proc is not None
    assert coord.proc.poll() is None
    log = Path(coord.log_path).read_text()
    assert "failed unexpectedly" not in log
    assert "Traceback" not in log
    # The victims are exactly as they were formed.
    jobs = wire["stub"].ListJobs(pb.ListJobsRequest(job="victim"), timeout=5).jobs
    assert [(j.state, [m.state for m in j.members]) for j in jobs] == [("RUNNING", ["RUNNING", "RUNNING"])]
