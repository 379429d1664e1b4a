"""``torchrun --rdzv-backend=sarcomm`` workers in the coordinator's ``/sd``: real torchrun nodes
(``python -m torch.distributed.run``), each with two gloo workers that train through sarcomm's
library (``tests/scripts/torchrun_metrics.py``), one real coordinator.

The coordinator's members are the nodes; each worker's library serves ``/metrics`` and notes it in
its node's ``SAR_ENDPOINTS_DIR``; the node's heartbeats carry the endpoints; ``/sd`` lists one
target per worker, labelled with the worker's global rank. Scraping each target gives that
worker's own collective metrics.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import WaitTimeout, free_port_run, sd_groups, wait_for
from tests.torchrun_nodes import SLOW_S, TRAIN, Node, records, torchrun_args, wait_for_training

pytestmark = pytest.mark.timeout(600)

METRICS_SCRIPT = Path(__file__).resolve().parent / "scripts" / "torchrun_metrics.py"


@dataclass
class PrefixedNode(Node):
    """A :class:`Node` whose command runs behind ``prefix`` (``ip netns exec NAME``: it execs, so
    the agent keeps the pid)."""

    prefix: list[str] = field(default_factory=list)

    def start(self) -> PrefixedNode:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "torch.distributed.run", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        return self


class MetricsNodes:
    """torchrun nodes running ``torchrun_metrics.py`` for one test; kills what is left at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.started: list[Node] = []

    def start(
        self,
        coord: str,
        job: str,
        nnodes: str,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        script_args: tuple[str, ...] = (),
    ) -> Node:
        name = f"node{len(self.started)}"
        args = torchrun_args(coord, job, self.out, nnodes=nnodes, script_args=script_args)
        args[args.index(str(TRAIN))] = str(METRICS_SCRIPT)
        node = PrefixedNode(name, args, self.tmp_path / f"{name}.log", env=env or {}, prefix=prefix or [])
        self.started.append(node.start())
        return node

    def stop_training(self) -> None:
        (self.out / "stop").touch()

    def logs(self, coord: CoordinatorProcess) -> str:
        text = "\n".join(f"--- {n.name}\n{n.log()}" for n in self.started)
        return f"{text}\n--- coordinator\n{coord.log()}"

    def wait_for_training(self, coord: CoordinatorProcess, ranks: int, steps: int) -> None:
        """Every one of ``ranks`` workers of generation 1 made ``steps`` steps; on a timeout the
        error carries every node's log and the coordinator's."""
        try:
            wait_for_training(self.out, 1, ranks, steps=steps)
        except WaitTimeout as error:
            raise AssertionError(f"{error}\n{self.logs(coord)}") from None

    def stop(self) -> None:
        for node in self.started:
            node.stop()


@pytest.fixture
def metrics_nodes(tmp_path: Path) -> Iterator[MetricsNodes]:
    started = MetricsNodes(tmp_path)
    yield started
    started.stop()


def scrape(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
        return str(response.read().decode())


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return None


def wait_for_workers_in_sd(coord: CoordinatorProcess, job: str, ranks: int) -> list[dict[str, Any]]:
    def listed() -> list[dict[str, Any]] | None:
        groups = sd_groups(coord.http_url, job)
        return groups if len(groups) == ranks else None

    groups = wait_for(listed, SLOW_S, what=f"/sd to list the {ranks} workers of job {job!r}", interval=0.2)
    return sorted(groups, key=lambda g: int(g["labels"]["rank"]))


def check_scraped_metrics(groups: list[dict[str, Any]], job: str) -> None:
    """Each target is that worker's own endpoint: its ``sar_worker_info`` has the group's rank, and
    its all_reduces were counted."""
    for group in groups:
        (target,) = group["targets"]
        text = scrape(target)
        rank = group["labels"]["rank"]
        info = sample(text, "sar_worker_info", job=job, rank=rank, generation="1", backend="gloo")
        assert info == 1.0, f"{target} (rank {rank}):\n{text[:3000]}"
        count = sample(text, "sar_collective_duration_seconds_count", op="all_reduce", backend="gloo")
        assert count is not None, f"{target} (rank {rank}) counted no all_reduce"
        assert count > 0, f"{target} (rank {rank}) counted no all_reduce"


def test_sd_lists_every_torchrun_worker_and_each_scrape_is_that_ranks_metrics(
    module_coordinator: CoordinatorProcess, metrics_nodes: MetricsNodes
) -> None:
    """Two nodes x two workers. Node A sets SAR_METRICS_PORT=P (its local rank i serves on P + i),
    node B leaves it unset (any free port). /sd lists the four workers with their global ranks,
    node ranks and local ranks; scraping each gives that rank's metrics; once the job finished, /sd
    lists none of them."""
    coord, job = module_coordinator, "sd2"
    first = free_port_run(2)
    node_a = metrics_nodes.start(coord.grpc_target, job, "2", env={"SAR_METRICS_PORT": str(first)})
    node_b = metrics_nodes.start(coord.grpc_target, job, "2")
    metrics_nodes.wait_for_training(coord, 4, steps=3)
    groups = wait_for_workers_in_sd(coord, job, 4)

    steps = [r for r in records(metrics_nodes.out) if "ok" in r]
    assert steps
    assert all(r["ok"] for r in steps), "an all_reduce gave a wrong value"
    worker = {r["rank"]: r for r in steps}
    assert sorted(worker) == [0, 1, 2, 3]
    for group in groups:
        labels = group["labels"]
        mine = worker[int(labels["rank"])]
        assert labels == {
            "job": job,
            "rank": str(mine["rank"]),
            "host": labels["host"],
            "generation": "1",
            "node_rank": str(mine["group_rank"]),
            "local_rank": str(mine["local_rank"]),
        }
        assert group["targets"] == [f"127.0.0.1:{mine['metrics_port']}"]
    node_a_pids = {p.pid for p in node_a.processes()}
    ports_a = sorted(r["metrics_port"] for r in worker.values() if r["pid"] in node_a_pids)
    assert ports_a == [first, first + 1], "SAR_METRICS_PORT=P gives local rank i the port P + i"
    check_scraped_metrics(groups, job)

    metrics_nodes.stop_training()
    assert [node_a.wait(), node_b.wait()] == [0, 0], metrics_nodes.logs(coord)
    assert sd_groups(coord.http_url, job) == []


def test_a_bad_note_and_a_bad_metrics_port_cost_only_the_endpoints_never_the_job(
    module_coordinator: CoordinatorProcess, metrics_nodes: MetricsNodes
) -> None:
    """One node x two workers with SAR_METRICS_PORT=65535: local rank 1's port would be 65536, so
    it trains without an endpoint, saying so once; local rank 0 rewrites its note to an address not
    on its host, which the coordinator drops, saying so once in its log and to the agent. The node
    keeps its place and the job ends FINISHED (before: local rank 1 died with a traceback, and a
    bad note failed the node for silence, the job ending RESTARTED)."""
    coord, job = module_coordinator, "badnote"
    node = metrics_nodes.start(
        coord.grpc_target,
        job,
        "1",
        env={"SAR_METRICS_PORT": "65535"},
        script_args=("--forge-note", "10.9.9.9"),
    )
    metrics_nodes.wait_for_training(coord, 2, steps=3)
    wait_for(
        lambda: "dropped from a heartbeat" in node.log(),
        30,
        what=lambda: f"the agent told\n{metrics_nodes.logs(coord)}",
    )
    assert sd_groups(coord.http_url, job) == []
    metrics_nodes.stop_training()
    assert node.wait() == 0, metrics_nodes.logs(coord)
    steps = [r for r in records(metrics_nodes.out) if "ok" in r]
    assert steps
    assert all(r["ok"] for r in steps), "an all_reduce gave a wrong value"
    assert {r["rank"] for r in steps} == {0, 1}
    jobs = coord.get_json(f"/v1/jobs?job={job}")
    assert isinstance(jobs, dict)
    assert [j["state"] for j in jobs["jobs"]] == ["FINISHED"], metrics_nodes.logs(coord)
    log = node.log()
    assert log.count("SAR_METRICS_PORT=65535 gives local rank 1 port 65536") == 1, log
    assert log.count("Training goes on without the /metrics endpoint.") == 1, log
    assert (
        log.count(
            "dropped from a heartbeat: reports[0].worker_endpoints.endpoints[0].metrics_address '10.9.9.9:"
        )
        == 1
    )
    told = [line for line in coord.log().splitlines() if f"job={job} member=" in line]
    assert len(told) == 1, coord.log()
    assert told[0].endswith("; dropped from its heartbeat, the rest was taken"), told
    assert "Traceback" not in log
