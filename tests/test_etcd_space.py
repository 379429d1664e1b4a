"""etcd's history stays bounded, and a full etcd is said so, survived and recovered from.

A real one-member etcd started with a small ``--quota-backend-bytes`` and no auto-compaction of
its own (etcd's default), and a real coordinator on it. The churn is raw gRPC: jobs of members
whose hosts report many interfaces of random IPv6 addresses (they hardly compress, so each
record is ~0.3 MB) join, then leave one by one, and re-form under the next generation; every
leave rewrites the record.

- With the leader compacting (``--etcd-compaction-retention 1``), a churn several times the quota
  in bytes sent to etcd runs to the end: no NOSPACE, no alarm, the database under the quota.
- With compaction off (``0``), the same churn reaches NOSPACE: the refused call gets
  RESOURCE_EXHAUSTED naming the alarm and the commands that free space, the coordinator logs
  it once, still answers reads and a running job's heartbeat stream, shows its store's size and
  quota on ``/metrics`` and the shipped alert fires on a real Prometheus. After the test
  compacts, defragments and disarms with etcdctl, writes go through again by themselves: the
  change kept meanwhile is in etcd, and new jobs run, with no restart.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.etcd_churn import CALL_TIMEOUT_S, NoSpace, churn_generation, db_size, sent_to_etcd
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster
from tests.helpers import LO_PB, wait_for
from tests.test_prometheus import PROMETHEUS, PROMTOOL, Prometheus, prometheus_config

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(bool(ETCD_MISSING), reason=ETCD_MISSING)]

#: etcd's quota here: small, so that the churn fills it in seconds.
QUOTA_BYTES = 16 * 1024 * 1024
#: The churn with compaction on sends etcd this many times the quota (the database then settles
#: at ~70 % of it: the records of the finished generations, which stay, and 1 s of revisions).
CHURN_QUOTAS = 2.5
PREFIX = "space"
# Members are judged after minutes of silence: the churn never heartbeats.
QUIET = ["--heartbeat-interval", "60", "--reconnect-grace", "120", "--join-timeout", "120"]
STORE_ALERTS = "sarcomm-store-alerts.yml"


def metric(coord: CoordinatorProcess, name: str) -> float | None:
    with urllib.request.urlopen(f"{coord.http_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(rf"(?m)^{name} ([0-9.e+]+)$", text)
    return float(found.group(1)) if found else None


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=1, extra_args=["--quota-backend-bytes", str(QUOTA_BYTES)])
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def stubs() -> Iterator[list[grpc.Channel]]:
    channels: list[grpc.Channel] = []
    yield channels
    for channel in channels:
        channel.close()


def _stub(channels: list[grpc.Channel], coord: CoordinatorProcess) -> pb_grpc.CoordinatorStub:
    channels.append(grpc.insecure_channel(coord.grpc_target))
    return pb_grpc.CoordinatorStub(channels[-1])


def _start(start: StartCoordinator, cluster: EtcdCluster, retention: str) -> CoordinatorProcess:
    coord = start(
        "--store", cluster.url(PREFIX), "--leader-ttl", "2", "--etcd-compaction-retention", retention, *QUIET,
        state=False,
    )  # fmt: skip
    wait_for(lambda: coord.get_json("/healthz")["role"] == "leader", 20, what="the coordinator to lead")  # type: ignore[index]
    return coord


def test_a_churn_of_several_quotas_runs_to_the_end_while_the_leader_compacts(
    small_etcd: EtcdCluster, start_coordinator: StartCoordinator, stubs: list[grpc.Channel]
) -> None:
    coord = _start(start_coordinator, small_etcd, "1")
    stub = _stub(stubs, coord)
    began, generation = sent_to_etcd(small_etcd), 0
    while sent_to_etcd(small_etcd) - began < CHURN_QUOTAS * QUOTA_BYTES:
        generation += 1
        churn_generation(stub, "churn", generation)
    sent = sent_to_etcd(small_etcd) - began
    assert small_etcd.etcdctl("alarm", "list").strip() == ""
    print(
        f"sent {sent} bytes to etcd in {generation} generations; its database is {db_size(small_etcd)} bytes"
    )
    assert db_size(small_etcd) < QUOTA_BYTES
    # The coordinator compacted: etcd no longer has the first revisions.
    with pytest.raises(RuntimeError, match="required revision has been compacted"):
        small_etcd.etcdctl("get", "--rev", "2", f"/{PREFIX}/leader")
    assert sent >= CHURN_QUOTAS * QUOTA_BYTES
    size = metric(coord, "sar_coordinator_store_bytes")
    assert size is not None
    assert 0 < size < QUOTA_BYTES
    assert metric(coord, "sar_coordinator_store_quota_bytes") == QUOTA_BYTES
    assert "NOSPACE" not in coord.log()


def _store_alert_prometheus(directory: Path, coord: CoordinatorProcess) -> Prometheus:
    config = prometheus_config(directory, f"{coord.http_url}/sd")
    alerts = directory / "rules" / STORE_ALERTS
    alerts.write_text(re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 0s", alerts.read_text()))
    return Prometheus(config, directory.parent / "tsdb", directory.parent / "prometheus.log")


def test_a_full_etcd_is_named_survived_and_recovered_from_without_a_restart(
    small_etcd: EtcdCluster, start_coordinator: StartCoordinator, stubs: list[grpc.Channel], tmp_path: Path
) -> None:
    coord = _start(start_coordinator, small_etcd, "0")
    stub = _stub(stubs, coord)
    prom = (
        _store_alert_prometheus(tmp_path / "prometheus", coord)
        if PROMETHEUS is not None and PROMTOOL is not None
        else None
    )
    try:
        # A job that runs through it all: one member, reporting on a stream.
        steady = stub.Join(
            pb.JoinRequest(job="steady", world_size=1, host="s0", interfaces=[LO_PB], store_port=29500,
                           members=[pb.MemberSpec(local_rank=0)], join_id="steady-s0"),
            timeout=CALL_TIMEOUT_S,
        ).assignments[0]  # fmt: skip
        refused: NoSpace | None = None
        generation = 0
        while refused is None:
            generation += 1
            assert generation < 20, "no NOSPACE after 20 generations of churn"
            try:
                churn_generation(stub, "churn", generation)
            except NoSpace as error:
                refused = error
        # The refusal says what happened and what to do, in one line.
        assert "NOSPACE alarm" in refused.details
        assert "\n" not in refused.details
        for command in ("etcdctl compact", "etcdctl defrag", "etcdctl alarm disarm"):
            assert command in refused.details
        assert "--etcd-compaction-retention is 0" in refused.details
        assert "NOSPACE" in small_etcd.etcdctl("alarm", "list")
        # Reads and the running job's stream go on.
        listed = stub.ListJobs(pb.ListJobsRequest(), timeout=CALL_TIMEOUT_S)
        assert {"churn", "steady"} <= {job.job for job in listed.jobs}
        report = pb.MemberReport(member_id=steady.member_id, secret=steady.secret)
        answers = list(
            stub.Heartbeat(
                iter([pb.HeartbeatRequest(reports=[report], closing=True)]), timeout=CALL_TIMEOUT_S
            )
        )
        assert answers
        assert not answers[-1].unknown_members
        # More changes are refused the same way, and logged once.
        with pytest.raises(NoSpace, match="NOSPACE alarm"):
            churn_generation(stub, "other", 1)
        assert metric(coord, "sar_coordinator_store_quota_bytes") == QUOTA_BYTES
        if prom is not None:
            wait_for(
                lambda: prom.firing("SarCoordinatorStoreNearQuota"),
                30,
                what="the store alert to fire",
                interval=0.25,
            )
        writes = [line for line in coord.log().splitlines() if "persistence" in line and "NOSPACE" in line]
        assert len(writes) == 1, coord.log()
        # The operator frees space; the coordinator writes what it kept, by itself.
        status = json.loads(small_etcd.etcdctl("endpoint", "status", "-w", "json"))
        small_etcd.etcdctl("compact", str(status[0]["Status"]["header"]["revision"]))
        small_etcd.etcdctl("defrag")
        small_etcd.etcdctl("alarm", "disarm")
        wait_for(
            lambda: "the store takes writes again" in coord.log(), 20, what="the coordinator to write again"
        )
        client = EtcdClient(EtcdSettings(small_etcd.url()), timeout=10)
        try:
            stored = {r["name"]: r for r in EtcdStore(client, "/" + PREFIX).load_jobs()}
        finally:
            client.close()
        # What the refused call changed is in etcd now: the generation its Join formed, and the
        # member its Leave took out.
        assert stored["churn"]["generation"] == generation
        if refused.member is not None:
            (left,) = [m for m in stored["churn"]["members"] if m["member_id"] == refused.member.member_id]
            assert left["state"] != "RUNNING", left["state"]
        assert "steady" in stored
        # New jobs run, with no restart.
        churn_generation(stub, "after", 1)
        assert db_size(small_etcd) < QUOTA_BYTES
    finally:
        if prom is not None:
            prom.stop()
