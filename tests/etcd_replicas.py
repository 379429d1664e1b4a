"""Looking at coordinators that share an etcd store, as a client or an operator sees them: each
one's role and the leader it names (``/healthz``), its gRPC health, its jobs, a raw Join, the
leader hint in a refusal's trailing metadata, a recorder that two never lead at once, and etcd's
own history of the leader key. For the HA tests (tests/test_ha_etcd*.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sarcomm.common.errors import LEADER_METADATA_KEY
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess
from tests.etcd_cluster import EtcdCluster
from tests.helpers import LO_PB, wait_for

#: The gRPC health service name a leader serves and a standby does not.
SERVICE = "sarcomm.v1.Coordinator"


def role(coord: CoordinatorProcess) -> str:
    """``leader`` or ``standby`` as ``coord``'s /healthz says, or ``down`` when it does not answer."""
    try:
        return str(dict(coord.get_json("/healthz"))["role"])  # type: ignore[call-overload]
    except OSError:
        return "down"


def named_leader(coord: CoordinatorProcess) -> str:
    """The leader ``coord``'s /healthz names ("" when it names none or cannot be asked now)."""
    try:
        return str(dict(coord.get_json("/healthz")).get("leader", ""))  # type: ignore[call-overload]
    except OSError:
        return ""


def leader_of(coords: list[CoordinatorProcess], timeout: float = 15) -> CoordinatorProcess:
    """The one running coordinator of ``coords`` that leads, once exactly one does (waits up to
    ``timeout`` seconds; raises :class:`tests.helpers.WaitTimeout`)."""

    def one() -> CoordinatorProcess | None:
        leading = [c for c in coords if c.proc is not None and c.proc.poll() is None and role(c) == "leader"]
        return leading[0] if len(leading) == 1 else None

    return wait_for(one, timeout, what="exactly one coordinator to lead")


def call(target: str, method: str, request: object, timeout: float = 10) -> object:
    """One unary Coordinator RPC on a fresh channel (raises ``grpc.RpcError`` as a client sees it)."""
    channel = grpc.insecure_channel(target)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        return getattr(stub, method)(request, timeout=timeout)
    finally:
        channel.close()


def join(target: str, job: str) -> pb.JoinResponse:
    """A Join of a one-member world ``job`` at ``target``: the world forms at once."""
    request = pb.JoinRequest(
        job=job, world_size=1, host="h", interfaces=[LO_PB], store_port=29500, members=[pb.MemberSpec()]
    )
    answer = call(target, "Join", request)
    assert isinstance(answer, pb.JoinResponse)
    return answer


def health(target: str, service: str) -> str:
    """``SERVING`` or ``NOT_SERVING``: the gRPC health of ``service`` at ``target``."""
    channel = grpc.insecure_channel(target)
    try:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
    finally:
        channel.close()


def jobs(coord: CoordinatorProcess) -> dict[str, object]:
    """``coord``'s /v1/jobs by job name (a standby reads them from etcd)."""
    return {str(j["job"]): j for j in coord.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]


def leader_hint(error: grpc.RpcError) -> str:
    """The leader's address in an UNAVAILABLE answer's trailing metadata (as clients read it)."""
    answer = cast(grpc.Call, error)
    for key, value in answer.trailing_metadata() or ():
        if key == LEADER_METADATA_KEY:
            return str(value)
    raise AssertionError(f"no {LEADER_METADATA_KEY} in the trailing metadata of {error!r}")


class LeadershipRecorder:
    """Both coordinators' /healthz polled through the test: never two leaders at one moment."""

    def __init__(self, coords: list[CoordinatorProcess]) -> None:
        self._coords = coords
        self.both: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if sum(role(c) == "leader" for c in self._coords) > 1:
                self.both.append(time.monotonic())
            self._stop.wait(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def leader_history(cluster: EtcdCluster, key: str) -> list[tuple[str, int, int]]:
    """Every change of the leader key from etcd's history: (PUT or DELETE, create revision, lease)."""
    proc = subprocess.Popen(
        ["etcdctl", "--endpoints", ",".join(m.endpoint for m in cluster.members if m.running),
         "watch", key, "--rev", "1", "-w", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
        text=True,
    )  # fmt: skip
    events: list[tuple[str, int, int]] = []
    try:
        assert proc.stdout is not None
        # The history arrives at once: read until the current revision's event is there.
        current = int(cluster.get_json(key)["header"]["revision"])  # type: ignore[index]
        for line in proc.stdout:
            answer = json.loads(line)
            for event in answer.get("Events", []):
                kv = event["kv"]
                events.append(
                    (event.get("type", "PUT"), int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))
                )
            if int(answer["Header"]["revision"]) >= current or not answer.get("Events"):
                break
    finally:
        proc.kill()
        proc.wait(5)
    return events
