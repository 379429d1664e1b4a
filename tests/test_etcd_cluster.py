"""The etcd test fixture itself: three members that form, survive one loss, lose and regain the
quorum, and leave no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.etcd_cluster import ETCD_MISSING, EtcdCluster, running_cluster
from tests.helpers import wait_for

pytestmark = pytest.mark.etcd


def test_the_cluster_forms_keeps_data_through_one_kill_and_regains_a_lost_quorum(
    etcd_cluster: EtcdCluster,
) -> None:
    etcd_cluster.etcdctl("put", "/fixture/a", "1")
    follower = etcd_cluster.follower_index()
    etcd_cluster.kill(follower)
    assert not etcd_cluster.members[follower].running
    # Two of three still commit.
    etcd_cluster.etcdctl("put", "/fixture/b", "2")
    etcd_cluster.restart(follower)
    # The raft leader killed: the other two elect one and commit again.
    leader = etcd_cluster.leader_index()
    etcd_cluster.kill(leader)
    etcd_cluster.wait_healthy()
    assert etcd_cluster.leader_index() != leader
    etcd_cluster.restart(leader)
    assert etcd_cluster.etcdctl("get", "/fixture/b", "--print-value-only").strip() == "2"

    stopped = etcd_cluster.lose_quorum()
    assert stopped == [1, 2]
    wait_for(
        lambda: not etcd_cluster.healthy(etcd_cluster.members[0]),
        10,
        what="the last member to report itself unhealthy without the quorum",
    )
    with pytest.raises(RuntimeError, match="failed"):
        etcd_cluster.etcdctl("put", "/fixture/c", "3", timeout=1)
    etcd_cluster.regain_quorum(stopped)
    assert etcd_cluster.etcdctl("get", "/fixture/a", "--print-value-only").strip() == "1"


def test_close_leaves_no_process_behind(tmp_path: Path) -> None:
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    with running_cluster(tmp_path / "etcd", enable_v2=True) as cluster:
        procs = [m.proc for m in cluster.members]
        assert cluster.url("jobs").startswith("etcd://127.0.0.1:")
    for proc in procs:
        assert proc is not None
        assert proc.poll() is not None
