"""Coordinators sharing an etcd store: the election, the standby's refusals naming the leader,
take-over within the TTL (SIGKILL, SIGTERM, a paused leader), etcd losing a member or its quorum,
and an etcd that cannot be reached.

Real ``sar-coordinator`` processes on a real three-member etcd cluster (tests/etcd_cluster.py): the
module's, under a prefix of each test's own, or a test's own where it kills etcd members. Jobs are
driven with raw gRPC calls (tests/etcd_replicas.py) so that every answer, status and trailing
metadata is seen as a client sees it. How clients and agents follow a take-over:
tests/test_ha_etcd_clients.py and tests/test_ha_etcd_e2e.py.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess
from tests.etcd_cluster import EtcdCluster
from tests.etcd_replicas import (
    SERVICE,
    LeadershipRecorder,
    call,
    health,
    jobs,
    join,
    leader_hint,
    leader_history,
    leader_of,
    role,
)
from tests.helpers import free_port, free_ports, sd_groups, wait_for

TTL_S = 2


def _start(url: str, tmp_path: Path, index: int) -> CoordinatorProcess:
    grpc_port, http_port = free_ports(2)
    coord = CoordinatorProcess(
        grpc_port=grpc_port,
        http_port=http_port,
        state_path=None,
        args=[
            "--store",
            url,
            "--leader-ttl",
            str(TTL_S),
            "--heartbeat-interval",
            "0.5",
            "--reconnect-grace",
            "5",
            "--shutdown-grace",
            "1",
        ],
        log_path=tmp_path / f"coordinator{index}.log",
    )
    coord.start()
    return coord


@contextlib.contextmanager
def _pair(url: str, tmp_path: Path) -> Iterator[list[CoordinatorProcess]]:
    coords: list[CoordinatorProcess] = []
    try:
        for i in range(2):
            coords.append(_start(url, tmp_path, i))
        yield coords
    finally:
        for coord in coords:
            coord.stop()


@pytest.fixture
def pair(
    module_etcd_cluster: EtcdCluster, etcd_prefix: str, tmp_path: Path
) -> Iterator[list[CoordinatorProcess]]:
    """Two coordinators under this test's prefix of the module's etcd cluster."""
    with _pair(module_etcd_cluster.url(etcd_prefix), tmp_path) as coords:
        yield coords


@pytest.fixture
def pair_on_own_etcd(etcd_cluster: EtcdCluster, tmp_path: Path) -> Iterator[list[CoordinatorProcess]]:
    """Two coordinators on an etcd cluster of this test's own, whose members it may kill."""
    with _pair(etcd_cluster.url("ha"), tmp_path) as coords:
        yield coords


def _metric(coord: CoordinatorProcess, name: str) -> float:
    for line in coord.get_text("/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {coord.http_url}/metrics")


class Reporter:
    """A member's reports, like a failing-over client's (simplified): one short heartbeat stream
    every 0.2 s to the first coordinator of ``targets`` that takes it; standbys and unreachable
    ones are skipped. ``answered`` counts the reports a coordinator took."""

    def __init__(self, targets: list[str], member: pb.Assignment, metrics_address: str = "") -> None:
        self._targets = targets
        report = pb.MemberReport(
            member_id=member.member_id, secret=member.secret, metrics_address=metrics_address
        )
        self._report = pb.HeartbeatRequest(reports=[report], closing=True)
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        channels = [grpc.insecure_channel(t) for t in self._targets]
        try:
            while not self._stop.is_set():
                for channel in channels:
                    try:
                        for _ in pb_grpc.CoordinatorStub(channel).Heartbeat(iter([self._report]), timeout=2):
                            pass
                    except grpc.RpcError:
                        continue
                    self.answered += 1
                    break
                self._stop.wait(0.2)
        finally:
            for channel in channels:
                channel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_one_leads_the_standby_refuses_naming_it_and_takes_over_within_the_ttl_after_a_sigkill(
    pair: list[CoordinatorProcess], module_etcd_cluster: EtcdCluster, etcd_prefix: str
) -> None:
    recorder = LeadershipRecorder(pair)
    leader = leader_of(pair)
    standby = next(c for c in pair if c is not leader)
    # A standby names the leader from its next round on (a quarter second at most).
    naming = {"status": "SERVING", "role": "standby", "leader": leader.grpc_target}
    wait_for(lambda: standby.get_json("/healthz") == naming, 5, what="the standby to name the leader")
    joined = join(leader.grpc_target, "ha1")
    assert joined.generation == 1
    reporter = Reporter([leader.grpc_target, standby.grpc_target], joined.assignments[0], "127.0.0.1:9999")
    # /sd on the standby, read from etcd: Prometheus can be pointed at every replica.
    wait_for(
        lambda: [g["targets"] for g in sd_groups(standby.http_url, "ha1")] == [["127.0.0.1:9999"]],
        10,
        what="the standby's /sd to list the member's metrics endpoint",
    )

    # The standby: every Coordinator RPC UNAVAILABLE with the leader's address in the trailers.
    with pytest.raises(grpc.RpcError) as refused:
        call(standby.grpc_target, "ListJobs", pb.ListJobsRequest())
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert f"the leader is {leader.grpc_target}" in str(refused.value.details())
    assert leader_hint(refused.value) == leader.grpc_target
    assert health(standby.grpc_target, SERVICE) == "NOT_SERVING"
    assert health(standby.grpc_target, "") == "SERVING"
    assert health(leader.grpc_target, SERVICE) == "SERVING"
    assert _metric(standby, "sar_coordinator_leader") == 0
    assert _metric(leader, "sar_coordinator_leader") == 1
    # /v1/jobs on the standby: read from etcd.
    assert jobs(standby)["ha1"]["state"] == "RUNNING"  # type: ignore[index]

    killed = time.monotonic()
    leader.kill()
    wait_for(lambda: role(standby) == "leader", TTL_S + 5, what="the standby to take over", interval=0.02)
    took = time.monotonic() - killed
    print(f"take-over after a SIGKILL of the leader: {took:.2f} s (leader TTL {TTL_S} s)")
    assert took <= TTL_S + 1
    assert health(standby.grpc_target, SERVICE) == "SERVING"
    reported = reporter.answered
    wait_for(lambda: reporter.answered > reported, 5, what="the member to report to the new leader")
    assert jobs(standby)["ha1"]["state"] == "RUNNING"  # type: ignore[index]
    assert _metric(standby, "sar_coordinator_leader_changes_total") == 1
    # The new leader serves: the next generation of another job forms there.
    assert join(standby.grpc_target, "ha2").generation == 1
    recorder.close()
    reporter.close()
    assert recorder.both == []

    history = leader_history(module_etcd_cluster, f"/{etcd_prefix}/leader")
    puts = [(rev, lease) for kind, rev, lease in history if kind == "PUT"]
    creates = list(dict.fromkeys(rev for rev, _ in puts))
    assert len(creates) == 2, history
    assert creates == sorted(creates)
    # Each creation has one owner (lease) for its whole life.
    assert len(set(puts)) == len(creates), history


def test_one_etcd_member_killed_changes_nothing(
    pair_on_own_etcd: list[CoordinatorProcess], etcd_cluster: EtcdCluster
) -> None:
    pair = pair_on_own_etcd
    leader = leader_of(pair)
    join(leader.grpc_target, "one")
    etcd_cluster.kill(etcd_cluster.follower_index())
    assert join(leader.grpc_target, "two").generation == 1
    assert leader_of(pair) is leader
    assert _metric(leader, "sar_coordinator_leader_changes_total") == 0
    assert set(jobs(leader)) == {"one", "two"}


def test_quorum_lost_refuses_changes_naming_etcd_and_recovers_with_no_job_lost(
    pair_on_own_etcd: list[CoordinatorProcess], etcd_cluster: EtcdCluster
) -> None:
    pair = pair_on_own_etcd
    leader = leader_of(pair)
    reporter = Reporter([c.grpc_target for c in pair], join(leader.grpc_target, "kept").assignments[0])
    stopped = etcd_cluster.lose_quorum()
    # Within the TTL nobody leads (no lease can be renewed), and nobody names a leader it cannot
    # see any more; calls are refused naming etcd.
    wait_for(
        lambda: all(
            c.get_json("/healthz") == {"status": "SERVING", "role": "standby", "leader": ""} for c in pair
        ),
        TTL_S + 3,
        what="both to stop leading and to name no leader",
    )
    for coord in pair:
        with pytest.raises(grpc.RpcError) as refused:
            join(coord.grpc_target, "during")
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "etcd at" in str(refused.value.details())
        assert "quorum" in str(refused.value.details())
    # A standby that cannot read etcd says so on /v1/jobs instead of showing stale jobs.
    with pytest.raises(urllib.error.HTTPError) as unreadable:
        pair[0].get_json("/v1/jobs")
    assert unreadable.value.code == 503
    assert "etcd at" in unreadable.value.read().decode()
    etcd_cluster.regain_quorum(stopped)
    back = leader_of(pair, timeout=30)
    # Its member reported to the new leader within the reconnect grace: nothing was lost or failed.
    reported = reporter.answered
    wait_for(lambda: reporter.answered > reported, 5, what="the member to report to the leader again")
    reporter.close()
    kept = jobs(back)["kept"]
    assert kept["state"] == "RUNNING", kept  # type: ignore[index]
    assert kept["generation"] == 1  # type: ignore[index]
    assert join(back.grpc_target, "after").generation == 1


def test_a_leader_stopped_in_order_hands_over_at_once(pair: list[CoordinatorProcess]) -> None:
    leader = leader_of(pair)
    standby = next(c for c in pair if c is not leader)
    join(leader.grpc_target, "orderly")
    stopped = time.monotonic()
    assert leader.stop(signal.SIGTERM) == 0
    wait_for(lambda: role(standby) == "leader", TTL_S + 5, what="the standby to take over", interval=0.02)
    took = time.monotonic() - stopped
    print(f"take-over after SIGTERM of the leader: {took:.2f} s")
    assert took < TTL_S
    assert jobs(standby)["orderly"]["state"] == "RUNNING"  # type: ignore[index]


@pytest.mark.integration  # no etcd: nothing answers at the address it is given
def test_a_coordinator_whose_etcd_is_unreachable_stays_up_and_refuses_naming_etcd(tmp_path: Path) -> None:
    grpc_port, http_port = free_ports(2)
    coord = CoordinatorProcess(
        grpc_port=grpc_port,
        http_port=http_port,
        state_path=None,
        args=["--store", f"etcd://127.0.0.1:{free_port()}/nowhere", "--leader-ttl", "1"],
        log_path=tmp_path / "coordinator.log",
    )
    coord.start()
    try:
        assert coord.get_json("/healthz") == {"status": "SERVING", "role": "standby", "leader": ""}
        assert health(coord.grpc_target, SERVICE) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as refused:
            join(coord.grpc_target, "nowhere")
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "etcd at 127.0.0.1:" in str(refused.value.details())
        assert leader_hint(refused.value) == ""
    finally:
        assert coord.stop() == 0


def test_a_leader_paused_past_its_ttl_stands_by_when_it_resumes(pair: list[CoordinatorProcess]) -> None:
    leader = leader_of(pair)
    standby = next(c for c in pair if c is not leader)
    assert leader.proc is not None
    joined = join(leader.grpc_target, "paused")
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: role(standby) == "leader", TTL_S + 5, what="the standby to take over")
        # Calls the paused leader took meanwhile wait in its socket; it must not answer them as leader.
        channel = grpc.insecure_channel(leader.grpc_target)
        pending = pb_grpc.CoordinatorStub(channel).ListJobs.future(pb.ListJobsRequest(), timeout=10)
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    wait_for(pending.done, 10, what="the resumed coordinator to answer")
    error = pending.exception()
    channel.close()
    assert isinstance(error, grpc.RpcError), pending.result()
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    wait_for(
        lambda: (
            leader.get_json("/healthz")
            == {"status": "SERVING", "role": "standby", "leader": standby.grpc_target}
        ),
        10,
        what="the resumed coordinator to stand by naming the new leader",
    )
    assert jobs(standby)["paused"]["generation"] == joined.generation  # type: ignore[index]
