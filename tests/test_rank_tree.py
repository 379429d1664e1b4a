"""A rank's process tree never outlives its ``sar-worker``, whatever the command is.

Real coordinator, real agent, commands that do not import sarcomm (``sleep``, a shell that leaves a
background child). The agent is SIGKILLed (it can clean nothing up itself) and the process table,
not the agent's word, says what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER, wait_for

#: The rank launcher ends the tree with SIGTERM, then SIGKILL 2 s later; "within seconds".
GONE_S = 5.0
START_S = 60.0


@pytest.fixture
def agents(real_processes: None) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.parametrize(
    ("command", "sleeps"),
    [(["sleep", "300"], 1), (["sh", "-c", "sleep 300 & sleep 300"], 2)],
    ids=["sleep", "shell-with-background-child"],
)
def test_sigkill_of_an_agent_ends_its_ranks_whole_process_tree_within_seconds(
    coordinator: CoordinatorProcess,
    agents: list[subprocess.Popen[bytes]],
    command: list[str],
    sleeps: int,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    agent = subprocess.Popen(
        [*SAR_WORKER, "--coord", coordinator.grpc_target, "--job",
         f"tree{sleeps}", "--world-size", "1", "--heartbeat-interval", "0.25", "--", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    agents.append(agent)

    def running() -> list[psutil.Process] | None:
        assert agent.poll() is None, f"agent exited with {agent.returncode}: {coordinator.log()}"
        tree = _tree(agent.pid)
        found = [p for p in _alive(tree) if p.name() == "sleep"]
        return tree if len(found) == sleeps else None

    tree = wait_for(running, START_S, what=lambda: f"{sleeps} sleep process(es) under the agent")
    started = psutil.Process(agent.pid).create_time()
    assert started > 0
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    # Whatever the tree holds now (a process forked after the snapshot is a child of one in it).
    left = wait_for(
        lambda: not _alive(tree),
        GONE_S,
        what=lambda: f"the rank's tree to end; left: {[(p.pid, p.name()) for p in _alive(tree)]}",
        interval=0.05,
    )
    assert left
