"""``torchrun --rdzv-backend=sarcomm`` across two network stacks, where the interface matters: one
torchrun node in a network namespace of its own (a container, as it were: only ``lo`` and a veth,
its default route through the host), the other on the host. Both reach the coordinator over the
veth (10.84.0.1 on the host side, 10.84.0.2 inside).

The coordinator hands each node an interface, never ``lo`` (the nodes are on two network stacks):
the namespace's node its veth ``eth0``, the one address it has; the host's node its routable
interface (by the coordinator's rules a veth is avoided where a routable interface exists; on a
host without one, its veth end). The rendezvous exports the choice, so each worker's
``GLOO_SOCKET_IFNAME`` is its node's, and gloo's all_reduces cross the veth with checked values.
The workers' ``/metrics`` endpoints are listed in ``/sd`` at their node's address, and the host
scrapes the namespaced ones through the veth. The job ends FINISHED.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CoordinatorProcess, StartCoordinator, netns_unavailable
from tests.helpers import free_port, sd_groups
from tests.test_torchrun_sd import MetricsNodes, check_scraped_metrics, wait_for_workers_in_sd
from tests.torchrun_nodes import records

pytestmark = [pytest.mark.netns, pytest.mark.timeout(600)]

HOST_SIDE, NS_SIDE = "10.84.0.1", "10.84.0.2"
#: The namespace's end of the veth pair.
NS_LINK = "eth0"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@pytest.fixture
def namespace() -> Iterator[tuple[str, str]]:
    """A network namespace with ``eth0`` at 10.84.0.2, the peer of the host's veth end at
    10.84.0.1, and its default route through it (the host's own addresses are reached that way).
    Yields (namespace, the host end's name)."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    name, link = f"sartr{tag}", f"sartv{tag}"
    result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {result.stderr.strip()}")
    try:
        _ip("link", "add", link, "type", "veth", "peer", "name", NS_LINK, "netns", name)
        _ip("addr", "add", f"{HOST_SIDE}/24", "dev", link)
        _ip("link", "set", link, "up")
        _ip("-n", name, "addr", "add", f"{NS_SIDE}/24", "dev", NS_LINK)
        _ip("-n", name, "link", "set", NS_LINK, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "route", "add", "default", "via", HOST_SIDE)
        yield name, link
    finally:  # deleting the namespace deletes its veth end and the peer
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30, check=False)


@pytest.fixture
def metrics_nodes(tmp_path: Path) -> Iterator[MetricsNodes]:
    started = MetricsNodes(tmp_path)
    yield started
    started.stop()


def test_node_in_a_namespace_gets_its_veth_and_the_workers_train_over_it(
    start_coordinator: StartCoordinator, namespace: tuple[str, str], metrics_nodes: MetricsNodes
) -> None:
    ns, _ = namespace
    port = free_port()
    coord: CoordinatorProcess = start_coordinator(
        "--listen", f"0.0.0.0:{port}", "--heartbeat-interval", "0.5", "--join-timeout", "60"
    )
    coord.grpc_port = port  # the fixture's loopback target reaches 0.0.0.0 too
    endpoint, job = f"{HOST_SIDE}:{port}", "netns2"
    on_host = metrics_nodes.start(endpoint, job, "2")
    in_ns = metrics_nodes.start(endpoint, job, "2", prefix=["ip", "netns", "exec", ns])
    metrics_nodes.wait_for_training(coord, 4, steps=3)
    groups = wait_for_workers_in_sd(coord, job, 4)

    # The coordinator's choice per node: never lo; in the namespace its veth, eth0.
    view = coord.get_json("/v1/jobs")
    assert isinstance(view, dict)
    (status,) = [j for j in view["jobs"] if j["job"] == job]
    chosen = {m["rank"]: (m["interface"], m["address"]) for m in status["members"]}
    assert sorted(chosen) == [0, 1]
    assert (NS_LINK, NS_SIDE) in chosen.values(), chosen
    (host_choice,) = [c for c in chosen.values() if c != (NS_LINK, NS_SIDE)]
    assert host_choice[0] != "lo", chosen
    # ... and each node's workers were given it (GLOO_SOCKET_IFNAME), node-contiguous ranks.
    pids = {node.name: {p.pid for p in node.processes()} for node in (on_host, in_ns)}
    steps = [r for r in records(metrics_nodes.out) if "ok" in r]
    by_rank = {r["rank"]: r for r in steps}
    assert sorted(by_rank) == [0, 1, 2, 3]
    for r in by_rank.values():
        assert r["pid"] in pids[on_host.name] | pids[in_ns.name]
        mine = host_choice if r["pid"] in pids[on_host.name] else (NS_LINK, NS_SIDE)
        assert chosen[r["group_rank"]] == mine, (r, chosen)
        assert r["gloo_ifname"] == mine[0], r
        assert r["rank"] == r["group_rank"] * 2 + r["local_rank"]
    print(f"\ninterfaces handed out: host node {host_choice}, namespace node {(NS_LINK, NS_SIDE)}")
    # The workers' endpoints are listed at their node's address; the namespaced ones are reached
    # through the veth.
    targets = {g["labels"]["rank"]: g["targets"][0] for g in groups}
    for rank, r in by_rank.items():
        address = host_choice[1] if r["pid"] in pids[on_host.name] else NS_SIDE
        assert targets[str(rank)] == f"{address}:{r['metrics_port']}"
    check_scraped_metrics(groups, job)

    metrics_nodes.stop_training()
    assert [on_host.wait(), in_ns.wait()] == [0, 0], metrics_nodes.logs(coord)
    made = [r for r in records(metrics_nodes.out) if "ok" in r]
    assert all(r["ok"] for r in made), "an all_reduce gave a wrong value"
    view = coord.get_json("/v1/jobs")
    assert isinstance(view, dict)
    (status,) = [j for j in view["jobs"] if j["job"] == job]
    assert (status["state"], status["world_size"], status["generation"]) == ("FINISHED", 2, 1)
    assert [(m["state"], m["exit_code"]) for m in status["members"]] == [("LEFT", 0)] * 2
    assert sd_groups(coord.http_url, job) == []
