"""A full disk while a world forms: the shipped agents' Join is answered UNAVAILABLE naming the
state file and the cause, sent again (the same Join) until space returns, and the world forms
once, as generation 1, with distinct ranks. Real coordinator and agents, the state on a tiny
tmpfs that the test fills and frees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CoordinatorProcess
from tests.helpers import SAR_WORKER, free_port, wait_for

AGENT_DEADLINE_S = 120.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount a tmpfs"
)


@pytest.fixture
def small_disk(tmp_path: Path, real_processes: None) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def fill(disk: Path) -> Path:
    """Write a file until the file system is full; returns it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError:
                return filler
    finally:
        os.close(fd)


def coordinator_on(disk: Path, tmp_path: Path) -> CoordinatorProcess:
    """A started coordinator with its state file on ``disk``."""
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=disk / "state.sqlite",
        args=["--heartbeat-interval", "0.5"], log_path=tmp_path / "coordinator.log",
    )  # fmt: skip
    coord.start()
    return coord


def stop_all(agents: list[subprocess.Popen[str]], coord: CoordinatorProcess) -> None:
    """Kill the agents still running (a failed test), then stop the coordinator."""
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    coord.stop()


def clean_environment() -> dict[str, str]:
    """This process's environment without sarcomm's variables, for the agents."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}


def test_a_world_forming_on_a_full_disk_forms_once_when_space_returns(
    small_disk: Path, tmp_path: Path
) -> None:
    coord = coordinator_on(small_disk, tmp_path)
    agents: list[subprocess.Popen[str]] = []
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    try:
        filler = fill(small_disk)
        env = clean_environment()
        command = [
            *SAR_WORKER, "--coord", coord.grpc_target, "--job", "dfull",
            "--world-size", "2", "--join-timeout", "90", "--output-tag", "",
            "--", sys.executable, "-c", "import os; print('RANK', os.environ['RANK'])",
        ]  # fmt: skip
        for log in logs:
            agent = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env
            )
            agents.append(agent)
        # The world formed in memory but could not be written: the agents are told why, and wait.
        wait_for(
            lambda: all("could not write its state file" in log.read_text() for log in logs),
            60,
            what=lambda: (
                "both agents to report the full disk: " + " | ".join(p.read_text()[-500:] for p in logs)
            ),
        )
        warning = next(line for line in logs[0].read_text().splitlines() if "could not write" in line)
        assert f"its state file {small_disk / 'state.sqlite'} (database or disk is full)" in warning, warning
        assert all(agent.poll() is None for agent in agents)
        filler.unlink()
        outputs = []
        for agent in agents:
            out, _ = agent.communicate(timeout=AGENT_DEADLINE_S)
            assert agent.returncode == 0, out + "".join(p.read_text() for p in logs)
            outputs.append(out.strip())
        assert sorted(outputs) == ["RANK 0", "RANK 1"]
        jobs = coord.get_json("/v1/jobs")
        assert isinstance(jobs, dict)
        (job,) = jobs["jobs"]
        assert (job["job"], job["generation"], job["state"]) == ("dfull", 1, "FINISHED")
        assert sorted(m["rank"] for m in job["members"]) == [0, 1]
    finally:
        stop_all(agents, coord)


def test_a_world_that_cannot_be_written_is_not_shown_running_and_its_joins_end_naming_the_disk(
    small_disk: Path, tmp_path: Path
) -> None:
    """The disk stays full past the agents' join timeout: /v1/jobs never shows the world RUNNING
    (no member was told its rank), and each agent's last word names the full disk and what to do,
    not a bare deadline."""
    coord = coordinator_on(small_disk, tmp_path)
    agents: list[subprocess.Popen[str]] = []
    try:
        fill(small_disk)
        env = clean_environment()
        command = [
            *SAR_WORKER, "--coord", coord.grpc_target, "--job", "stuck", "--world-size", "2",
            "--join-timeout", "4", "--output-tag", "", "--", sys.executable, "-c", "pass",
        ]  # fmt: skip
        agents = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)
        ]
        seen: list[dict[str, Any]] = []

        def formed_unwritten() -> bool:
            jobs = coord.get_json("/v1/jobs")
            assert isinstance(jobs, dict)
            seen[:] = jobs["jobs"]
            return bool(seen) and len(seen[0]["members"]) == 2

        wait_for(formed_unwritten, 30, what=lambda: f"the world of two to form in memory: {seen}")
        (job,) = seen
        assert (job["state"], job["generation"]) == ("FORMING", 1), job
        assert "no member has been told its rank" in str(job["reason"]), job
        assert [m["state"] for m in job["members"]] == ["JOINING", "JOINING"], job
        metrics = coord.get_text("/metrics")
        assert 'sar_coordinator_jobs{state="FORMING"} 1.0' in metrics
        assert 'sar_coordinator_jobs{state="RUNNING"} 0.0' in metrics
        for agent in agents:
            _, err = agent.communicate(timeout=AGENT_DEADLINE_S)
            last = err.strip().splitlines()[-1]
            assert agent.returncode != 0, err
            assert "(database or disk is full): free space there" in last, err
            assert "did not answer Join within the client deadline" not in err, err
            assert "Traceback" not in err, err
        print(f"\nthe agents' last line: {last}")
    finally:
        stop_all(agents, coord)
