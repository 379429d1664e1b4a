"""``torchrun --rdzv-backend=sarcomm``: real torchrun nodes (``python -m torch.distributed.run``), real
gloo workers with checked all_reduce values, one real coordinator for the module.

Each node is an agent with its workers on loopback; the tests kill, stop or add nodes while the
workers train and read back every step the workers made (``tests/scripts/torchrun_train.py``).
The worlds that form and finish have two workers per node (node-contiguous ranks, local ranks);
the tests whose subject is a node (lost, added, beyond MAX, a failover) give each node one worker:
every worker imports torch (seconds of CPU each), and the rendezvous is the same either way.
The timings they print (``-s``) are what docs/torchrun.md quotes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CoordinatorProcess
from tests.etcd_replicas import role as _role
from tests.helpers import wait_for
from tests.test_ha_etcd_clients import replicas  # noqa: F401  (the two-coordinator fixture)
from tests.torchrun_nodes import SLOW_S, Node, records, torchrun_args, wait_for_training

pytestmark = pytest.mark.timeout(900)


class Nodes:
    """Starts torchrun nodes for one test and kills what is left of them at its end."""

    def __init__(self, coord: CoordinatorProcess, tmp_path: Path) -> None:
        self.coord = coord
        self.tmp_path = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.started: list[Node] = []

    def start(self, job: str, nnodes: str, endpoint: str = "", **kwargs: Any) -> Node:
        name = f"node{len(self.started)}"
        args = torchrun_args(endpoint or self.coord.grpc_target, job, self.out, nnodes=nnodes, **kwargs)
        node = Node(name, args, self.tmp_path / f"{name}.log").start()
        self.started.append(node)
        return node

    def stop_training(self) -> None:
        (self.out / "stop").touch()

    def logs(self) -> str:
        text = "\n".join(f"--- {n.name}\n{n.log()}" for n in self.started)
        return f"{text}\n--- coordinator\n{self.coord.log()}"

    def group_rank(self, node: Node, generation: int) -> int:
        """The node rank ``node``'s workers had in ``generation``."""
        pids = {p.pid for p in node.processes()}
        mine = [r for r in records(self.out) if r["generation"] == generation and r["pid"] in pids]
        ranks = {r["group_rank"] for r in mine}
        assert len(ranks) == 1, f"{node.name} in generation {generation}: node ranks {ranks}"
        return int(ranks.pop())


@pytest.fixture
def nodes(module_coordinator: CoordinatorProcess, tmp_path: Path) -> Iterator[Nodes]:
    started = Nodes(module_coordinator, tmp_path)
    yield started
    for node in started.started:
        node.stop()


def job_status(coord: CoordinatorProcess, job: str) -> dict[str, Any]:
    view = coord.get_json("/v1/jobs")
    assert isinstance(view, dict)
    found = [j for j in view["jobs"] if j["job"] == job]
    assert found, f"no job {job!r} at the coordinator"
    return dict(found[0])


def steps(out: Path, generation: int) -> list[dict[str, Any]]:
    return [r for r in records(out) if r["generation"] == generation and "ok" in r]


def every_value_right(out: Path) -> bool:
    """Whether every all_reduce of every generation gave the right value."""
    return all(r["ok"] for r in records(out) if "ok" in r)


def wait_for_more_steps(out: Path, generation: int, ranks: int, more: int) -> None:
    """Block until each of the ``ranks`` ranks of ``generation`` made ``more`` steps beyond the
    furthest step made so far (the generation trains on, with nothing ending it meanwhile)."""
    done = max(r["step"] for r in steps(out, generation))
    wait_for_training(out, generation, ranks, steps=done + more)


# -- worlds that form and finish ----------------------------------------------------------------------


@pytest.mark.parametrize(("count", "sar_init"), [(2, True), (3, False)], ids=["2-nodes-sar-init", "3-nodes"])
def test_nodes_train_with_distinct_node_contiguous_ranks_and_finish(
    nodes: Nodes, count: int, sar_init: bool
) -> None:
    job = f"world{count}"
    started = [
        nodes.start(job, str(count), script_args=["--sar-init"] if sar_init else []) for _ in range(count)
    ]
    wait_for_training(nodes.out, 1, 2 * count, steps=3)
    nodes.stop_training()
    codes = [node.wait() for node in started]
    assert codes == [0] * count, nodes.logs()
    made = steps(nodes.out, 1)
    assert all(r["ok"] for r in made), "an all_reduce gave a wrong value"
    by_rank = {r["rank"]: r for r in made}
    assert sorted(by_rank) == list(range(2 * count))
    for r in by_rank.values():
        assert r["rank"] == r["group_rank"] * 2 + r["local_rank"]  # node-contiguous
        assert (r["world"], r["group_world"], r["local_world"]) == (2 * count, count, 2)
        assert (r["job"], r["gloo_ifname"], r["use_agent_store"]) == (job, "lo", "True")
    status = job_status(nodes.coord, job)
    assert (status["state"], status["world_size"], status["generation"]) == ("FINISHED", count, 1)
    assert [(m["state"], m["exit_code"]) for m in status["members"]] == [("LEFT", 0)] * count


# -- nodes that go ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "max_restarts"), [(signal.SIGKILL, 3), (signal.SIGSTOP, 0)], ids=["SIGKILL", "SIGSTOP"]
)
def test_lost_node_survivors_reform_and_train_on(
    nodes: Nodes, sig: signal.Signals, max_restarts: int
) -> None:
    """A node killed (its agent and workers) or stopped (a hung host) while a world of 3 trains:
    the two others stop their workers and re-form at 2 (MIN), keeping their order, and train on;
    the coordinator counts a re-rendezvous, no restart. Stopped workers block in gloo, so sarcomm's
    signal comes first and torch spends no restart either (--max-restarts 0 still re-forms)."""
    job = f"lost-{sig.name}"
    first, victim, last = (nodes.start(job, "2:3", nproc=1, max_restarts=max_restarts) for _ in range(3))
    wait_for_training(nodes.out, 1, 3)
    ordered = sorted((first, victim, last), key=lambda n: nodes.group_rank(n, 1))
    first, victim, last = ordered  # the middle node goes: the last one must move up
    lost_at = time.time()
    victim.signal_all(sig)
    reformed = wait_for_training(nodes.out, 2, 2)
    print(f"\n{sig.name}: the survivors trained again {reformed - lost_at:.1f} s after the node was lost")
    assert (nodes.group_rank(first, 2), nodes.group_rank(last, 2)) == (0, 1)
    nodes.stop_training()
    assert [first.wait(), last.wait()] == [0, 0], nodes.logs()
    assert every_value_right(nodes.out)
    made = steps(nodes.out, 2)
    assert {r["world"] for r in made} == {2}
    torch_restarts = {r["restart_count"] for r in made}
    print(f"{sig.name}: torch's restart count in the re-formed world: {sorted(torch_restarts)}")
    if sig is signal.SIGSTOP:
        assert torch_restarts == {0}  # the workers blocked: sarcomm's signal came first
    status = job_status(nodes.coord, job)
    assert (status["state"], status["generation"], status["world_size"]) == ("FINISHED", 2, 2)
    assert (status["restart_count"], status["rerendezvous_count"]) == (0, 1)
    [record] = status["history"]
    assert record["state"] == "RESTARTED"
    assert record["reason"].startswith("re-rendezvous: rank 1 on host ")
    lost = "connection lost" if sig is signal.SIGKILL else "missed heartbeats"
    assert lost in record["reason"]


def test_third_node_scales_world_up_without_restart_and_a_fourth_waits_beyond_max(nodes: Nodes) -> None:
    """--nnodes 2:3: a third node started while a world of 2 trains is counted waiting, and the
    running nodes re-form at 3 (scale-up) without spending a restart. MAX reached: a fourth node
    then waits uncounted (the world does not re-form), and is sent away once the job finishes
    (its rendezvous closed)."""
    job = "scale-up"
    started = [nodes.start(job, "2:3", nproc=1) for _ in range(2)]
    wait_for_training(nodes.out, 1, 2)
    joined_at = time.time()
    started.append(nodes.start(job, "2:3", nproc=1))
    reformed = wait_for_training(nodes.out, 2, 3)
    print(f"\nscale-up: a world of 3 trained {reformed - joined_at:.1f} s after the third node started")
    extra = nodes.start(job, "2:3", nproc=1)
    wait_for(
        lambda: job_status(nodes.coord, job)["parked_members"] == 1,
        SLOW_S,
        what="the fourth node to be parked behind the running world",
    )
    status = job_status(nodes.coord, job)
    assert (status["generation"], status["waiting_members"]) == (2, 0)  # beyond MAX: not counted
    wait_for_more_steps(nodes.out, 2, 3, more=5)
    assert job_status(nodes.coord, job)["generation"] == 2
    nodes.stop_training()
    assert [node.wait() for node in started] == [0, 0, 0], nodes.logs()
    extra.wait()  # exits 1 on torch 2.13: its launcher fails on the graceful exit's empty result
    assert "waited beyond --nnodes MAX and exits" in extra.log(), extra.log()
    assert not steps(nodes.out, 3)
    assert every_value_right(nodes.out)
    made = steps(nodes.out, 2)
    assert {(r["world"], r["restart_count"]) for r in made} == {(3, 0)}
    status = job_status(nodes.coord, job)
    assert (status["state"], status["world_size"], status["restart_count"]) == ("FINISHED", 3, 0)
    assert status["history"][0]["reason"].endswith("re-joins; 1 member(s) wait to join")


# -- a worker that fails ------------------------------------------------------------------------------


def test_failed_worker_ends_job_with_its_exit_code(nodes: Nodes) -> None:
    """--max-restarts 0 and a worker that exits 3 by itself: its node fails the job (torchrun
    reports the worker's code), and the other node hears it at once and stops too. (Both nodes
    of MIN are needed, so no last call is waited for: the world forms when the second joins.)"""
    job = "worker-fails"
    fail = ["--fail-rank", "1", "--fail-code", "3", "--fail-after", "3"]
    started = [
        nodes.start(job, "2:3", nproc=1, conf="last_call_timeout=0", script_args=fail) for _ in range(2)
    ]
    codes = [node.wait() for node in started]
    assert all(code != 0 for code in codes), nodes.logs()
    failing = next(n for n in started if "exitcode  : 3" in n.log())
    assert "rank 1 fails on purpose with code 3" in failing.log()
    assert every_value_right(nodes.out)
    status = job_status(nodes.coord, job)
    assert status["state"] == "FAILED"
    assert "exited with code 3" in status["reason"], status["reason"]


# -- replicas on etcd: the leader dies mid-job --------------------------------------------------------


def test_job_trains_through_leader_loss_and_handles_a_later_node_loss(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess],  # noqa: F811  (the fixture, imported)
    tmp_path: Path,
) -> None:
    """Two coordinators on etcd, the torchrun nodes given both: the leader is SIGKILLed while a
    world of 3 trains; the workers never notice (collectives do not go through the coordinator),
    the agents' streams move to the new leader, and a node lost afterwards is still handled there.

    A SIGKILLed node's peers see gloo's reset connection within milliseconds: a survivor's worker
    can fail before sarcomm's word of the loss arrives, and torch then spends a restart on the
    re-formation (docs/torchrun.md, "--max-restarts: what to set"). With none to spend, that node
    would leave and the other would wait alone for the join timeout, as the SIGKILL case of
    test_lost_node_survivors_reform_and_train_on says too."""
    leader, standby = replicas
    nodes = Nodes(standby, tmp_path)
    endpoint = f"{leader.grpc_target},{standby.grpc_target}"
    job = "failover"
    try:
        started = [nodes.start(job, "2:3", endpoint=endpoint, nproc=1, max_restarts=3) for _ in range(3)]
        wait_for_training(nodes.out, 1, 3)
        leader.kill()
        wait_for(lambda: _role(standby) == "leader", SLOW_S, what="the standby to lead")
        wait_for_more_steps(nodes.out, 1, 3, more=5)
        wait_for(
            lambda: all(m["last_heartbeat"] > time.time() - 3 for m in job_status(standby, job)["members"]),
            SLOW_S,
            what="every node to report to the new leader",
        )
        first, victim, last = sorted(started, key=lambda n: nodes.group_rank(n, 1))
        victim.signal_all(signal.SIGKILL)
        wait_for_training(nodes.out, 2, 2)
        nodes.stop_training()
        assert [first.wait(), last.wait()] == [0, 0], nodes.logs()
        assert every_value_right(nodes.out)
        status = job_status(standby, job)
        assert (status["state"], status["generation"], status["rerendezvous_count"]) == ("FINISHED", 2, 1)
        assert status["history"][0]["state"] == "RESTARTED"
    finally:
        for node in nodes.started:
            node.stop()
