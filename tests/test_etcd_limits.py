"""Jobs of every size the limits admit, on real coordinators sharing a real three-member etcd.

- A job whose record is larger than one etcd request (a 32,768-member world; 64 members that
  report 64 interfaces of 32 addresses each) is stored, read back by a standby and by the leader
  that takes over, and the other jobs go on while it is written.
- A record etcd can never take (here: etcd started with a small ``--max-request-bytes``) fails
  its own job's Joins at once, RESOURCE_EXHAUSTED naming the limit; every other job goes on.
- Deployments on nested prefixes (``/a`` and ``/a/jobs/team``) never see each other's jobs.

Jobs are driven with raw gRPC calls, so every status is seen as a client sees it.
"""

from __future__ import annotations

import ipaddress
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster, running_cluster
from tests.helpers import LO_PB, wait_for

# Members are judged after 3 minutes of silence: these tests never heartbeat.
QUIET = ["--heartbeat-interval", "60", "--reconnect-grace", "120", "--join-timeout", "300"]
#: etcd's default --max-request-bytes.
ETCD_REQUEST_LIMIT = 1536 * 1024


def _coordinator(start: StartCoordinator, url: str, *extra: str) -> CoordinatorProcess:
    return start("--store", url, "--leader-ttl", "2", *QUIET, *extra, state=False)


def _role(coord: CoordinatorProcess) -> str:
    try:
        return str(coord.get_json("/healthz")["role"])  # type: ignore[index]
    except OSError:
        return "down"


def _leading(coord: CoordinatorProcess) -> CoordinatorProcess:
    wait_for(lambda: _role(coord) == "leader", 20, what=f"{coord.grpc_target} to lead")
    return coord


def _join_request(job: str, world: int, host: str, members: int = 1, interfaces: int = 0) -> pb.JoinRequest:
    """A Join of ``members`` members on ``host``, reporting ``lo`` and ``interfaces`` more
    interfaces of 32 random IPv6 addresses each (random: they hardly compress)."""
    reported = [LO_PB]
    for i in range(interfaces):
        addresses = [str(ipaddress.IPv6Address(0xFD << 120 | random.getrandbits(120))) for _ in range(32)]
        reported.append(
            pb.NetworkInterface(name=f"eth{i}", addresses=addresses, kind=pb.INTERFACE_KIND_PHYSICAL)
        )
    return pb.JoinRequest(
        job=job,
        world_size=world,
        host=host,
        interfaces=reported,
        store_port=29500,
        members=[pb.MemberSpec(local_rank=k) for k in range(members)],
        join_id=f"{job}-{host}",
    )


@pytest.fixture
def channel_to() -> Iterator[dict[str, grpc.Channel]]:
    """Channels by target, closed at the end."""
    channels: dict[str, grpc.Channel] = {}
    yield channels
    for channel in channels.values():
        channel.close()


def _stub(channels: dict[str, grpc.Channel], coord: CoordinatorProcess) -> pb_grpc.CoordinatorStub:
    if coord.grpc_target not in channels:
        channels[coord.grpc_target] = grpc.insecure_channel(
            coord.grpc_target, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
    return pb_grpc.CoordinatorStub(channels[coord.grpc_target])


def _answers(
    futures: list[grpc.CallFuture[pb.JoinResponse]], timeout: float
) -> list[pb.JoinResponse | grpc.RpcError]:
    """Each call's answer or its error, once all are done."""
    deadline = time.monotonic() + timeout
    results: list[pb.JoinResponse | grpc.RpcError] = []
    for future in futures:
        try:
            results.append(future.result(timeout=max(0.1, deadline - time.monotonic())))
        except grpc.RpcError as error:
            results.append(error)
    return results


def _small_job_goes_on(stub: pb_grpc.CoordinatorStub, job: str) -> float:
    """A one-member job joins and leaves; returns how long that took (seconds)."""
    began = time.monotonic()
    joined = stub.Join(_join_request(job, 1, f"{job}-host"), timeout=20)
    member = joined.assignments[0]
    stub.Leave(pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=0), timeout=20)
    return time.monotonic() - began


def _stored_bytes(cluster: EtcdCluster, prefix: str) -> int:
    """The bytes of every job record and member chunk stored under ``prefix``."""
    client = EtcdClient(EtcdSettings(cluster.url()), timeout=10)
    try:
        return sum(
            len(kv.value)
            for space in ("@jobs", "@members")
            for kv in client.range_prefix(f"/{prefix}/{space}/".encode())
        )
    finally:
        client.close()


def _jobs(coord: CoordinatorProcess, job: str = "") -> dict[str, dict[str, object]]:
    """``/v1/jobs`` by job name (a 32,768-member job is ~10 MB of JSON: a generous deadline)."""
    url = f"{coord.http_url}/v1/jobs" + (f"?job={job}" if job else "")
    with urllib.request.urlopen(url, timeout=60) as answer:
        document = json.loads(answer.read())
    return {str(j["job"]): j for j in document["jobs"]}


def test_64_members_with_64_interfaces_of_32_addresses_are_stored_and_other_jobs_go_on(
    etcd_cluster: EtcdCluster, start_coordinator: StartCoordinator, channel_to: dict[str, grpc.Channel]
) -> None:
    leader = _leading(_coordinator(start_coordinator, etcd_cluster.url("wide")))
    standby = _coordinator(start_coordinator, etcd_cluster.url("wide"))
    stub = _stub(channel_to, leader)
    # ~2.4 MB compressed: more than etcd takes in one request (1.5 MiB).
    requests = [_join_request("wide", 64, f"h{i}", interfaces=63) for i in range(64)]
    futures = [stub.Join.future(r, timeout=120) for r in requests]
    # While the wide job forms and is written, other jobs join and leave.
    took = [_small_job_goes_on(stub, f"small{i}") for i in range(3)]
    answers = _answers(futures, 120)
    refused = [a for a in answers if isinstance(a, grpc.RpcError)]
    assert not refused, f"{len(refused)} Joins refused, e.g. {refused[0].code()}: {refused[0].details()}"
    assert max(took) < 15, took
    # The standby reads it from etcd, whole.
    wide = wait_for(lambda: _jobs(standby, "wide").get("wide"), 15, what="the standby to read the wide job")
    assert wide["state"] == "RUNNING"
    assert len(wide["members"]) == 64  # type: ignore[arg-type]
    assert sorted(_jobs(standby)) == ["small0", "small1", "small2", "wide"]
    assert _stored_bytes(etcd_cluster, "wide") > ETCD_REQUEST_LIMIT


@pytest.fixture
def small_request_etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """An etcd cluster that takes requests of at most 256 KiB (its default is 1.5 MiB)."""
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    with running_cluster(tmp_path / "etcd", extra_args=["--max-request-bytes", str(256 * 1024)]) as cluster:
        yield cluster


def test_a_job_etcd_can_never_store_fails_its_joins_at_once_naming_the_limit_and_others_go_on(
    small_request_etcd: EtcdCluster, start_coordinator: StartCoordinator, channel_to: dict[str, grpc.Channel]
) -> None:
    leader = _leading(_coordinator(start_coordinator, small_request_etcd.url("limited")))
    stub = _stub(channel_to, leader)
    assert _small_job_goes_on(stub, "before") < 15
    requests = [_join_request("wide", 64, f"h{i}", interfaces=63) for i in range(64)]
    futures = [stub.Join.future(r, timeout=120) for r in requests]
    took = [_small_job_goes_on(stub, f"during{i}") for i in range(3)]
    began = time.monotonic()
    answers = _answers(futures, 120)
    assert time.monotonic() - began < 30
    for answer in answers:
        assert isinstance(answer, grpc.RpcError), "a Join of a job etcd cannot store was answered"
        assert answer.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, answer.details()
        details = str(answer.details())
        assert details.startswith("job 'wide' generation 1: its record is not stored: etcd at 127.0.0.1:"), (
            details
        )
        assert "request is too large, larger than etcd's --max-request-bytes (1.5 MiB by default)" in details
    assert max(took) < 15, took
    # Not written again and again: later jobs are not held up by it.
    assert _small_job_goes_on(stub, "after") < 15
    assert "retrying in" not in leader.log()
    assert sorted(_jobs(leader)) == ["after", "before", "during0", "during1", "during2", "wide"]


def test_a_32768_member_job_is_stored_and_a_new_leader_takes_it_over_whole(
    etcd_cluster: EtcdCluster, start_coordinator: StartCoordinator, channel_to: dict[str, grpc.Channel]
) -> None:
    world, per_host = 32768, 64
    leader = _leading(_coordinator(start_coordinator, etcd_cluster.url("huge")))
    standby = _coordinator(start_coordinator, etcd_cluster.url("huge"))
    stub = _stub(channel_to, leader)
    requests = [_join_request("huge", world, f"node{i}", members=per_host) for i in range(world // per_host)]
    answers = _answers([stub.Join.future(r, timeout=240) for r in requests], 240)
    refused = [a for a in answers if isinstance(a, grpc.RpcError)]
    assert not refused, f"{len(refused)} Joins refused, e.g. {refused[0].code()}: {refused[0].details()}"
    assigned = {
        a.member_id: a
        for answer in answers
        if isinstance(answer, pb.JoinResponse)
        for a in answer.assignments
    }
    assert len(assigned) == world
    assert _stored_bytes(etcd_cluster, "huge") > ETCD_REQUEST_LIMIT

    leader.kill()
    _leading(standby)
    huge = _jobs(standby, "huge")["huge"]
    assert huge["state"] == "RUNNING"
    assert huge["generation"] == 1
    members = huge["members"]
    assert isinstance(members, list)
    assert {m["member_id"]: m["rank"] for m in members} == {i: a.rank for i, a in assigned.items()}
    # Each member's secret came through: one leaves on the new leader with its own.
    last = max(assigned.values(), key=lambda a: a.rank)
    left = _stub(channel_to, standby).Leave(
        pb.LeaveRequest(member_id=last.member_id, secret=last.secret, exit_code=0), timeout=30
    )
    assert left.job_state == "RUNNING"


def test_deployments_on_nested_prefixes_never_see_each_others_jobs(
    etcd_cluster: EtcdCluster, start_coordinator: StartCoordinator, channel_to: dict[str, grpc.Channel]
) -> None:
    outer = _leading(_coordinator(start_coordinator, etcd_cluster.url("a")))
    inner = _leading(_coordinator(start_coordinator, etcd_cluster.url("a/jobs/team")))
    for coord, jobs in ((outer, ["x", "team"]), (inner, ["x", "jobs"])):
        for job in jobs:
            _stub(channel_to, coord).Join(_join_request(job, 1, "h"), timeout=20)
    assert sorted(_jobs(outer)) == ["team", "x"]
    assert sorted(_jobs(inner)) == ["jobs", "x"]
    # And a standby of each, reading etcd, sees the same.
    for prefix, expected in (("a", ["team", "x"]), ("a/jobs/team", ["jobs", "x"])):
        standby = _coordinator(start_coordinator, etcd_cluster.url(prefix))
        assert _role(standby) != "leader"
        assert sorted(_jobs(standby)) == expected
