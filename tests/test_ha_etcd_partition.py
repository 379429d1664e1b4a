"""A leading coordinator cut off from etcd by a network partition (a network namespace whose link
to etcd goes down) stops leading within its lease TTL, ends its calls UNAVAILABLE, and the other
coordinator takes over; at no moment do both lead. A world that was forming on the cut-off leader
forms once on the new one: one generation, distinct ranks.

The coordinator under test runs in its own network namespace with two links to the root
namespace: one to etcd (cut) and one the test reaches it through (kept), so its health can be
watched through the partition.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, netns_unavailable
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster, running_cluster
from tests.etcd_replicas import (
    SERVICE,
    LeadershipRecorder,
    health,
    jobs,
    join,
    leader_hint,
    leader_history,
    leader_of,
    role,
)
from tests.helpers import LO_PB, free_port, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.etcd]

TTL_S = 2
ETCD_SIDE, ETCD_NS_SIDE = "10.80.0.1", "10.80.0.2"
TEST_SIDE, TEST_NS_SIDE = "10.81.0.1", "10.81.0.2"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@pytest.fixture
def namespace() -> Iterator[tuple[str, str]]:
    """A network namespace with eth0 (to etcd, 10.80.0.2) and eth1 (to the test, 10.81.0.2).
    Yields (namespace, root-side name of the etcd link)."""
    reason = netns_unavailable() or ETCD_MISSING
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    name, etcd_link, test_link = f"sarco{tag}", f"sare{tag}", f"sart{tag}"
    result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {result.stderr.strip()}")
    try:
        for root_side, ns_side, ours, theirs in (
            (etcd_link, "eth0", ETCD_SIDE, ETCD_NS_SIDE),
            (test_link, "eth1", TEST_SIDE, TEST_NS_SIDE),
        ):
            _ip("link", "add", root_side, "type", "veth", "peer", "name", ns_side, "netns", name)
            _ip("addr", "add", f"{ours}/24", "dev", root_side)
            _ip("link", "set", root_side, "up")
            _ip("-n", name, "addr", "add", f"{theirs}/24", "dev", ns_side)
            _ip("-n", name, "link", "set", ns_side, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield name, etcd_link
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)
        for link in (etcd_link, test_link):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30, check=False)


@pytest.fixture
def cluster(tmp_path: Path, namespace: tuple[str, str]) -> Iterator[EtcdCluster]:
    with running_cluster(tmp_path / "etcd", extra_hosts=(ETCD_SIDE,)) as etcd:
        yield etcd


def _args(url: str) -> list[str]:
    return [
        "--store",
        url,
        "--leader-ttl",
        str(TTL_S),
        "--heartbeat-interval",
        "0.5",
        "--shutdown-grace",
        "1",
    ]


def test_a_leader_cut_off_from_etcd_stops_leading_within_the_ttl_and_the_other_takes_over(
    tmp_path: Path, namespace: tuple[str, str], cluster: EtcdCluster
) -> None:
    ns, etcd_link = namespace
    grpc_port = free_port()
    cut_off = CoordinatorProcess(
        grpc_port=grpc_port,
        http_port=free_port(),
        state_path=None,
        args=[*_args(cluster.url("part", host=ETCD_SIDE)), "--advertise", f"{TEST_NS_SIDE}:{grpc_port}"],
        log_path=tmp_path / "cut_off.log",
        command=["ip", "netns", "exec", ns, sys.executable, "-m", "sarcomm.coordinator.cli"],
        host=TEST_NS_SIDE,
        listen_host="0.0.0.0",
    )
    other = CoordinatorProcess(
        grpc_port=free_port(),
        http_port=free_port(),
        state_path=None,
        args=_args(cluster.url("part")),
        log_path=tmp_path / "other.log",
    )
    recorder: LeadershipRecorder | None = None
    try:
        cut_off.start()
        # Only once the first leads, so that the one in the namespace is the leader.
        wait_for(lambda: role(cut_off) == "leader", 15, what="the namespaced coordinator to lead")
        other.start()
        recorder = LeadershipRecorder([cut_off, other])
        assert role(other) == "standby"
        before = join(cut_off.grpc_target, "before").assignments[0]
        # Its member's heartbeat stream, open on the leader through the cut.
        stream = HeartbeatStream(cut_off.grpc_target, before)
        # A world of 2 forming on the leader: one member waits in its Join.
        channel = grpc.insecure_channel(cut_off.grpc_target)
        waiting = pb_grpc.CoordinatorStub(channel).Join.future(
            pb.JoinRequest(
                job="forming",
                world_size=2,
                host="a",
                interfaces=[LO_PB],
                store_port=29500,
                members=[pb.MemberSpec()],
            ),
            timeout=30,
        )
        wait_for(lambda: "forming" in jobs(cut_off), 10, what="the first member to be waiting")

        cut = time.monotonic()
        _ip("link", "set", etcd_link, "down")
        wait_for(
            lambda: health(cut_off.grpc_target, SERVICE) == "NOT_SERVING",
            TTL_S + 2,
            what="the cut-off leader to stop serving",
            interval=0.02,
        )
        stopped = time.monotonic() - cut
        print(f"the cut-off leader stopped leading {stopped:.2f} s after the cut (TTL {TTL_S} s)")
        assert stopped <= TTL_S + 0.3
        # Its waiting Join ends UNAVAILABLE (the client goes elsewhere), and so does every new call.
        wait_for(waiting.done, 5, what="the waiting Join to end")
        error = waiting.exception()
        assert isinstance(error, grpc.RpcError)
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        channel.close()
        # The open heartbeat stream ends UNAVAILABLE too, with the (empty: unknown) leader hint,
        # so that its client re-attaches elsewhere.
        ended = stream.ended(5)
        assert ended.code() is grpc.StatusCode.UNAVAILABLE
        assert leader_hint(ended) == ""
        assert "stands by and no leader is known" in str(ended.details())
        with pytest.raises(grpc.RpcError) as refused:
            join(cut_off.grpc_target, "during")
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

        leader = leader_of([cut_off, other], timeout=TTL_S + 5)
        assert leader is other
        took = time.monotonic() - cut
        print(f"the other coordinator leads {took:.2f} s after the cut")
        assert set(jobs(other)) >= {"before"}
        # The forming world forms once there: both members join the new leader.
        first = _join_pair(other.grpc_target)
        assert [a.generation for a in first] == [1, 1]
        assert sorted(a.assignments[0].rank for a in first) == [0, 1]

        _ip("link", "set", etcd_link, "up")
        # Healed: the cut-off one stands by and names the leader.
        wait_for(
            lambda: (
                cut_off.get_json("/healthz")
                == {"status": "SERVING", "role": "standby", "leader": other.grpc_target}
            ),
            15,
            what="the healed coordinator to stand by naming the leader",
        )
        with pytest.raises(grpc.RpcError) as hinted:
            join(cut_off.grpc_target, "after")
        assert leader_hint(hinted.value) == other.grpc_target
    finally:
        if recorder is not None:
            recorder.close()
        for coord in (cut_off, other):
            if coord.proc is not None:
                coord.stop()
    assert recorder.both == []
    # etcd's own record: the key was created twice (each creation one lease), in order.
    history = leader_history(cluster, "/part/leader")
    creates = list(dict.fromkeys(rev for kind, rev, _ in history if kind == "PUT"))
    assert len(creates) == 2, history
    assert creates == sorted(creates)
    assert len({(rev, lease) for kind, rev, lease in history if kind == "PUT"}) == 2, history


class HeartbeatStream:
    """One member's long-lived heartbeat stream (a report every 0.2 s), read in a thread."""

    def __init__(self, target: str, member: pb.Assignment) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stop = threading.Event()
        self._error: grpc.RpcError | None = None
        report = pb.HeartbeatRequest(
            reports=[pb.MemberReport(member_id=member.member_id, secret=member.secret)]
        )

        def reports() -> Iterator[pb.HeartbeatRequest]:
            while not self._stop.is_set():
                yield report
                self._stop.wait(0.2)

        self._call = pb_grpc.CoordinatorStub(self._channel).Heartbeat(reports(), timeout=60)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as error:
            self._error = error

    def ended(self, timeout: float) -> grpc.RpcError:
        """The error the stream ended with, within ``timeout`` seconds."""
        self._thread.join(timeout)
        self._stop.set()
        self._channel.close()
        assert self._error is not None, "the heartbeat stream did not end with an error"
        return self._error


def _join_pair(target: str) -> list[pb.JoinResponse]:
    channel = grpc.insecure_channel(target)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        calls = [
            stub.Join.future(
                pb.JoinRequest(
                    job="forming",
                    world_size=2,
                    host=h,
                    interfaces=[LO_PB],
                    store_port=29500,
                    members=[pb.MemberSpec()],
                ),
                timeout=20,
            )
            for h in ("a", "b")
        ]
        return [call.result() for call in calls]
    finally:
        channel.close()
