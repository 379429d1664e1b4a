"""A rank's process tree never outlives its ``sar-worker``, whatever the command is.

Real coordinator, real agent, commands that do not import sarcomm (``sleep``, a shell that leaves a
background child). The agent is SIGKILLed (it can clean nothing up itself) and the process table,
not the agent's word, says what is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sarcomm.worker.agent.config import STOP_GRACE_S
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


STUBBORN = str(Path(__file__).parent / "scripts" / "stubborn_rank.py")
#: How long after the agent's grace its exit may take: the launchers end their trees at once (a
#: few hundred milliseconds), with slack for a loaded machine.
AFTER_GRACE_S = 8.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start_stubborn(
    coordinator: CoordinatorProcess, agents: list[subprocess.Popen[bytes]], tmp_path: Path, job: str
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """An agent running one stubborn rank (see ``stubborn_rank.py``), once the rank runs: the agent
    and the pids of its tree (the launcher, the rank, the rank's helper in its own session)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    pid_file = tmp_path / "pids"
    # The agent's stdout and stderr go to files: nothing the test does waits on a pipe.
    with (tmp_path / "agent.out").open("wb") as out, (tmp_path / "agent.err").open("wb") as err:
        agent = subprocess.Popen(
            [*SAR_WORKER, "--coord", coordinator.grpc_target, "--job", job,
             "--world-size", "1", "--heartbeat-interval", "0.25", "--", sys.executable, STUBBORN,
             str(pid_file)],
            stdout=out, stderr=err, env=env,
        )  # fmt: skip
    agents.append(agent)

    def started() -> list[int] | None:
        assert agent.poll() is None, f"agent exited with {agent.returncode}: {_agent_log(tmp_path)}"
        if not pid_file.exists():
            return None
        rank, helper = (int(p) for p in pid_file.read_text().split())
        (launcher,) = psutil.Process(agent.pid).children()
        return [launcher.pid, rank, helper]

    tree = wait_for(started, START_S, what="the stubborn rank to start its helper")
    helper = psutil.Process(tree[2])
    assert os.getsid(helper.pid) == helper.pid != os.getsid(tree[1])  # the helper has a session of its own
    return agent, tree


def _agent_log(tmp_path: Path) -> str:
    return (tmp_path / "agent.err").read_text(errors="replace")[-3000:]


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids a test may leave running when it fails; killed at the end whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signals", [1, 2], ids=["sigterm-then-the-grace", "sigterm-twice"])
def test_sigterm_to_an_agent_whose_rank_ignores_it_ends_the_whole_tree_helper_in_its_own_session_too(
    coordinator: CoordinatorProcess,
    agents: list[subprocess.Popen[bytes]],
    leftovers: list[int],
    tmp_path: Path,
    signals: int,
) -> None:
    agent, tree = _start_stubborn(coordinator, agents, tmp_path, f"stubborn{signals}")
    leftovers.extend(tree)
    sent = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    if signals == 2:
        # A second one once the first was taken (two pending ones are one): the user is in a
        # hurry, the ranks are killed without the grace.
        wait_for(
            lambda: "got SIGTERM; forwarding it to the ranks" in _agent_log(tmp_path),
            START_S,
            what="the agent to take the first SIGTERM",
        )
        agent.send_signal(signal.SIGTERM)
    bound = (STOP_GRACE_S if signals == 1 else 0.0) + AFTER_GRACE_S
    try:
        code = agent.wait(bound)
    except subprocess.TimeoutExpired:
        left = [pid for pid in tree if not _gone(pid)]
        pytest.fail(
            f"agent still running {bound:g} s after SIGTERM; its tree's processes left: {left}\n"
            f"{_agent_log(tmp_path)}"
        )
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGKILL, _agent_log(tmp_path)  # the rank ended by SIGKILL
    # By its launcher: the agent never had to SIGKILL the group (which would kill the launcher first).
    assert "did not end their process trees" not in _agent_log(tmp_path)
    if signals == 1:
        assert took >= STOP_GRACE_S, f"the rank got {took:.1f} s, less than the grace"
        assert f"still running {STOP_GRACE_S:g} s after SIGTERM" in _agent_log(tmp_path)
    # The rank, its launcher and the helper in its own session: every one gone, none re-parented.
    ended = wait_for(
        lambda: all(_gone(pid) for pid in tree),
        GONE_S,
        what=lambda: f"the tree {tree} to end; left: {[pid for pid in tree if not _gone(pid)]}",
    )
    assert ended


def test_an_agent_whose_rank_launcher_is_killed_does_not_wait_for_pipes_an_orphan_holds(
    coordinator: CoordinatorProcess,
    agents: list[subprocess.Popen[bytes]],
    leftovers: list[int],
    tmp_path: Path,
) -> None:
    agent, (launcher, rank, helper) = _start_stubborn(coordinator, agents, tmp_path, "orphan")
    leftovers.extend((launcher, rank, helper))
    # Killed alone, the launcher can clean nothing: the rank dies with it (its parent-death
    # signal), the helper lives on outside the group, holding the rank's stdout and stderr.
    os.kill(launcher, signal.SIGKILL)
    try:
        code = agent.wait(AFTER_GRACE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"agent still running {AFTER_GRACE_S:g} s after its rank died\n{_agent_log(tmp_path)}")
    assert code == 128 + signal.SIGKILL, _agent_log(tmp_path)
    assert "rank 0 on host" in _agent_log(tmp_path).splitlines()[-1]
    assert not _gone(helper)  # what held the pipes (the fixture ends it)
