"""A churn of big job records through a real coordinator on etcd, with raw gRPC calls: the one
tests/test_etcd_space.py and benchmarks/etcd_history.py drive.

A generation of a job is HOSTS members, one per host, each host reporting INTERFACES interfaces of
32 random IPv6 addresses (random: they hardly compress, so the record is ~0.3 MB compressed),
joining, then leaving one by one: every leave rewrites the job's record. The next generation
re-forms under the same name (the record of each finished generation stays stored).
"""

from __future__ import annotations

import ipaddress
import json
import random
import re
import urllib.request

import grpc

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.etcd_cluster import EtcdCluster
from tests.helpers import LO_PB

#: Hosts per job (one member each) and interfaces per host (32 random IPv6 addresses each).
HOSTS = 16
INTERFACES = 24
CALL_TIMEOUT_S = 30.0


class NoSpace(Exception):
    """A churn call was refused RESOURCE_EXHAUSTED; ``details`` is what the client read."""

    def __init__(self, details: str, member: pb.Assignment | None) -> None:
        super().__init__(details)
        self.details = details
        self.member = member


def _interfaces() -> list[pb.NetworkInterface]:
    reported = [LO_PB]
    for i in range(INTERFACES):
        addresses = [str(ipaddress.IPv6Address(0xFD << 120 | random.getrandbits(120))) for _ in range(32)]
        reported.append(
            pb.NetworkInterface(name=f"eth{i}", addresses=addresses, kind=pb.INTERFACE_KIND_PHYSICAL)
        )
    return reported


def _call(what: str, call: grpc.Future, member: pb.Assignment | None = None) -> object:  # type: ignore[type-arg]
    try:
        return call.result(timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise NoSpace(str(error.details()), member) from None
        raise AssertionError(f"{what}: {error.code()} {error.details()}") from None


def churn_generation(stub: pb_grpc.CoordinatorStub, job: str, generation: int) -> None:
    """One generation of ``job``: HOSTS members join, then leave one by one (each leave rewrites
    the record). Raises :class:`NoSpace` at the first call refused RESOURCE_EXHAUSTED."""
    joins = [
        stub.Join.future(
            pb.JoinRequest(
                job=job, world_size=HOSTS, host=f"h{i}", interfaces=_interfaces(), store_port=29500,
                members=[pb.MemberSpec(local_rank=0)], join_id=f"{job}-{generation}-h{i}",
            ),
            timeout=CALL_TIMEOUT_S,
        )
        for i in range(HOSTS)
    ]  # fmt: skip
    members = [_call("Join", join).assignments[0] for join in joins]  # type: ignore[attr-defined]
    for member in members:
        request = pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=0)
        _call("Leave", stub.Leave.future(request, timeout=CALL_TIMEOUT_S), member)


def sent_to_etcd(cluster: EtcdCluster) -> int:
    """Bytes etcd's clients sent it so far (etcd's own counter)."""
    with urllib.request.urlopen(f"http://{cluster.endpoints[0]}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(r"(?m)^etcd_network_client_grpc_received_bytes_total ([0-9.e+]+)$", text)
    assert found is not None, "etcd's /metrics has no etcd_network_client_grpc_received_bytes_total"
    return int(float(found.group(1)))


def db_size(cluster: EtcdCluster) -> int:
    status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json"))
    return int(status[0]["Status"]["dbSize"])
