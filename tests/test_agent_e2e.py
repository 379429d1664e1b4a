"""``sar-worker`` end to end: real coordinator, real agents, real rank processes on loopback.

The command line and what it hands the ranks: tests/test_agent_cli.py; the agent's decisions:
tests/test_agent_decisions.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.messages import MemberReport, Progress
from sarcomm.worker.agent import cli
from sarcomm.worker.agent.local_rank import LocalRank
from sarcomm.worker.agent.output import RankOutput
from sarcomm.worker.agent.rank_process import process_state
from sarcomm.worker.progress import ProgressReader, ProgressWriter
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import SAR_WORKER, free_port_run, stays_false, wait_for

SCRIPTS = Path(__file__).parent / "scripts"
RANK_SCRIPT = str(SCRIPTS / "agent_rank.py")
# Bounds each agent's whole run: torch imports, rendezvous, collectives, shutdown.
AGENT_DEADLINE_S = 120.0
# How fast a failure must reach every agent: the seconds the design promises, with slack.
FAILURE_DEADLINE_S = 20.0

CONTRACT = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SAR_COORD",
    "SAR_JOB", "SAR_GENERATION", "SAR_BACKEND", "SAR_SOCKET_NAME", "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "CCL_SOCKET_IFNAME",
)  # fmt: skip


class Agents:
    """``sar-worker`` processes started by a test; all are killed at the end whatever happens."""

    def __init__(self, coord: CoordinatorProcess) -> None:
        self.coord = coord
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, job: str, *flags: str, command: list[str]) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
        env["TEST_AGENT"] = name
        env["TEST_COORD_HTTP"] = self.coord.http_url
        proc = subprocess.Popen(
            [
                *SAR_WORKER, "--coord", self.coord.grpc_target, "--job", job,
                "--heartbeat-interval", "0.25", "--join-timeout", "60", *flags, "--", *command,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen[str], timeout: float = AGENT_DEADLINE_S) -> tuple[int, str]:
        """Exit code and stderr of ``proc``; fails the test after ``timeout`` seconds."""
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            _, stderr = proc.communicate(timeout=10)
            pytest.fail(f"agent still running after {timeout} s:\n{stderr}\ncoordinator:\n{self.coord.log()}")
        return proc.returncode, stderr

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def agents(coordinator: CoordinatorProcess) -> Iterator[Agents]:
    started = Agents(coordinator)
    yield started
    started.kill()


def job_state(coord: CoordinatorProcess, job: str) -> dict[str, object]:
    jobs = {j["job"]: j for j in coord.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    return jobs[job]  # type: ignore[no-any-return]


# -- end to end --------------------------------------------------------------------------------


def test_two_agents_with_two_ranks_each_run_gloo_collectives(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    metrics_port = free_port_run(2)  # agent a's local ranks take P and P+1
    command = [sys.executable, RANK_SCRIPT, "collectives", str(tmp_path)]
    a = agents.start("a", "e2e", "--world-size", "4", "--nproc-per-node", "2", "--backend", "gloo",
                     "--metrics-port", str(metrics_port), command=command)  # fmt: skip
    b = agents.start(
        "b", "e2e", "--world-size", "4", "--nproc-per-node", "2", "--backend", "gloo", command=command
    )
    for proc in (a, b):
        code, stderr = agents.wait(proc)
        assert code == 0, stderr
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    by_agent = {name: sorted(r for r, s in seen.items() if s["agent"] == name) for name in ("a", "b")}
    master = {(s["env"]["MASTER_ADDR"], s["env"]["MASTER_PORT"]) for s in seen.values()}
    assert len(master) == 1
    for rank, s in seen.items():
        env = s["env"]
        assert all(env[name] is not None for name in CONTRACT), env
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "4", "2")
        assert env["LOCAL_RANK"] == str(by_agent[s["agent"]].index(rank))
        assert (env["SAR_COORD"], env["SAR_JOB"], env["SAR_GENERATION"]) == (
            coordinator.grpc_target,
            "e2e",
            "1",
        )
        assert env["SAR_BACKEND"] == "gloo"
        assert env["SAR_RESTART_COUNT"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        iface = env["SAR_SOCKET_NAME"]
        assert iface == "lo"
        assert {
            env[n]
            for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "CCL_SOCKET_IFNAME")
        } == {iface}
        assert env["SAR_MEMBER_ID"]
        assert env["SAR_MEMBER_SECRET"]
        expected_metrics = metrics_port + int(env["LOCAL_RANK"]) if s["agent"] == "a" else 0
        assert env["SAR_METRICS_PORT"] == str(expected_metrics)
        info = s["info"]
        assert (info["rank"], info["world_size"], info["job"], info["generation"]) == (rank, 4, "e2e", 1)
        assert info["backend"] == "gloo"
        # all_reduce(SUM) of [r+1, 10(r+1)] over ranks 0..3.
        assert s["all_reduce"] == [10.0, 100.0]
        # all_to_all with unequal sizes: from rank src, src+rank+1 values of 100*src+rank.
        assert s["all_to_all"] == [[float(100 * src + rank)] * (src + rank + 1) for src in range(4)]
        # Agent a fixed the ports (P + local rank); agent b let each rank bind any free one.
        if s["agent"] == "a":
            assert s["metrics_port"] == expected_metrics
        for op in ("all_reduce", "all_to_all"):
            count = re.search(
                rf'sar_collective_duration_seconds_count{{backend="gloo",op="{op}"}} (\S+)', s["metrics"]
            )
            assert count is not None, (rank, op)
            assert float(count[1]) >= 1, (rank, op)
        targets = {int(g["labels"]["rank"]): (g["targets"], g["labels"]["host"]) for g in s["sd"]}
        assert sorted(targets) == [0, 1, 2, 3], s["sd"]
        assert targets[rank][0] == [f"127.0.0.1:{s['metrics_port']}"]
        assert targets[rank][1]
    state = job_state(coordinator, "e2e")
    assert state["state"] == "FINISHED"
    assert {m["state"] for m in state["members"]} == {"LEFT"}  # type: ignore[attr-defined]
    # Each agent's ranks are contiguous, although both agents run on this one host.
    assert sorted([by_agent["a"], by_agent["b"]]) == [[0, 1], [2, 3]], by_agent


def test_a_failing_rank_sets_its_agents_exit_code_and_stops_the_other_agent(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    command = [sys.executable, RANK_SCRIPT, "fail", str(tmp_path), "1", "3"]
    a = agents.start(
        "a", "fail", "--world-size", "4", "--nproc-per-node", "2", "--rank", "0", command=command
    )
    b = agents.start(
        "b", "fail", "--world-size", "4", "--nproc-per-node", "2", "--rank", "2", command=command
    )
    started = time.monotonic()
    code_a, err_a = agents.wait(a, FAILURE_DEADLINE_S + 30)
    code_b, err_b = agents.wait(b, FAILURE_DEADLINE_S + 30)
    # The surviving ranks sleep 60 s unless stopped: finishing well before shows they were stopped.
    assert time.monotonic() - started < FAILURE_DEADLINE_S + 15
    assert code_a == 3, err_a
    assert "rank 1 on host" in err_a.splitlines()[-1]
    assert "exited with code 3" in err_a.splitlines()[-1]
    assert code_b != 0, err_b
    last_b = err_b.splitlines()[-1]
    assert "rank 1 on host" in last_b, err_b
    assert "exited with code 3" in last_b
    assert "stopped local rank(s) 2, 3" in last_b
    state = job_state(coordinator, "fail")
    assert state["state"] == "FAILED"
    assert "rank 1" in str(state["reason"])


def test_sigterm_to_an_agent_stops_its_ranks_and_fails_the_job_everywhere(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    # No rank fails by itself (rank 9 does not exist): everyone waits until stopped.
    command = [sys.executable, RANK_SCRIPT, "fail", str(tmp_path), "9", "3"]
    a = agents.start("a", "term", "--world-size", "2", "--rank", "0", command=command)
    b = agents.start("b", "term", "--world-size", "2", "--rank", "1", command=command)

    def started() -> bool:
        assert a.poll() is None
        assert b.poll() is None
        return all((tmp_path / f"rank{r}.started").exists() for r in (0, 1))

    wait_for(started, AGENT_DEADLINE_S, what="ranks 0 and 1 to start")
    a.send_signal(signal.SIGTERM)
    code_a, err_a = agents.wait(a, FAILURE_DEADLINE_S)
    code_b, err_b = agents.wait(b, FAILURE_DEADLINE_S)
    assert code_a == 128 + signal.SIGTERM, err_a
    assert "rank 0 on host" in err_a.splitlines()[-1]
    assert code_b != 0, err_b
    assert "rank 0 on host" in err_b.splitlines()[-1]
    assert "killed by signal 15" in err_b.splitlines()[-1]


def test_a_wedged_rank_is_detected_through_its_stale_progress_stamp(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    command = [sys.executable, RANK_SCRIPT, "hang", str(tmp_path), "1"]
    a = agents.start("a", "hang", "--world-size", "2", "--rank", "0", command=command)
    b = agents.start("b", "hang", "--world-size", "2", "--rank", "1", command=command)
    started = time.monotonic()
    code_a, err_a = agents.wait(a, FAILURE_DEADLINE_S + 30)
    code_b, err_b = agents.wait(b, FAILURE_DEADLINE_S + 30)
    # Everyone else sleeps 60 s unless stopped.
    assert time.monotonic() - started < FAILURE_DEADLINE_S + 15
    for code, err in ((code_a, err_a), (code_b, err_b)):
        assert code != 0, err
        assert "rank 1 on host" in err.splitlines()[-1], err
        assert "missed heartbeats" in err.splitlines()[-1], err


def test_ranks_keep_running_while_the_coordinator_restarts(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    # Generous misses: the restarted coordinator gives restored members that long to reconnect.
    coord = start_coordinator(
        "--heartbeat-interval", "0.5", "--heartbeat-misses", "10", "--join-timeout", "60"
    )
    agents = Agents(coord)
    try:
        command = [sys.executable, RANK_SCRIPT, "sleep", str(tmp_path), "6"]
        a = agents.start("a", "restarted", "--world-size", "2", "--rank", "0", command=command)
        b = agents.start("b", "restarted", "--world-size", "2", "--rank", "1", command=command)
        wait_for(
            lambda: all((tmp_path / f"rank{r}.started").exists() for r in (0, 1)),
            AGENT_DEADLINE_S,
            what="ranks 0 and 1 to start",
        )
        coord.stop()
        assert not any((tmp_path / f"rank{r}.done").exists() for r in (0, 1)), "ranks finished too early"
        # The subject is time passing: the coordinator stays down a second while the agents and
        # their ranks keep running.
        stays_false(
            lambda: [p.args for p in (a, b) if p.poll() is not None],
            1.0,
            what="an agent exiting while the coordinator is down",
        )
        coord.start()
        for proc in (a, b):
            code, stderr = agents.wait(proc)
            assert code == 0, stderr
        assert job_state(coord, "restarted")["state"] == "FINISHED"
    finally:
        agents.kill()


def test_a_coordinator_restarted_with_a_shorter_interval_fails_no_healthy_member(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    coord = start_coordinator("--heartbeat-interval", "1", "--heartbeat-misses", "3", "--join-timeout", "60")
    agents = Agents(coord)
    try:
        # The agents beat once a second, as the coordinator asked when they joined.
        command = [sys.executable, RANK_SCRIPT, "sleep", str(tmp_path), "8"]
        a = agents.start("a", "repaced", "--world-size", "2", "--rank", "0", "--heartbeat-interval", "1",
                         command=command)  # fmt: skip
        b = agents.start("b", "repaced", "--world-size", "2", "--rank", "1", "--heartbeat-interval", "1",
                         command=command)  # fmt: skip
        wait_for(
            lambda: all((tmp_path / f"rank{r}.started").exists() for r in (0, 1)),
            AGENT_DEADLINE_S,
            what="ranks 0 and 1 to start",
        )
        coord.stop()
        # Back with a silence limit (0.2 s x 2) shorter than the agents' interval: the answers to
        # their first reports tell them the new interval, and they follow it.
        coord.args = ["--heartbeat-interval", "0.2", "--heartbeat-misses", "2", "--join-timeout", "60"]
        coord.start()
        for proc in (a, b):
            code, stderr = agents.wait(proc)
            assert code == 0, stderr
            assert "the coordinator at" in stderr
            assert "expects reports every 0.2 s" in stderr
        state = job_state(coord, "repaced")
        assert state["state"] == "FINISHED"
        assert "missed heartbeats" not in coord.log()
    finally:
        agents.kill()


def test_max_restarts_rejoins_the_next_generation_and_reruns_every_rank(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    command = [sys.executable, RANK_SCRIPT, "restart", str(tmp_path), "1", "5"]
    flags = ("--world-size", "4", "--nproc-per-node", "2", "--max-restarts", "1")
    a = agents.start("a", "again", *flags, "--rank", "0", command=command)
    b = agents.start("b", "again", *flags, "--rank", "2", command=command)
    for proc in (a, b):
        code, stderr = agents.wait(proc)
        assert code == 0, stderr
    for rank in range(4):
        assert (tmp_path / f"rank{rank}.restart1").read_text() == "2"
    state = job_state(coordinator, "again")
    assert (state["state"], state["generation"]) == ("FINISHED", 2)


def test_a_socket_name_that_does_not_exist_is_refused_before_joining(coordinator: CoordinatorProcess) -> None:
    proc = subprocess.run(
        [*SAR_WORKER, "--coord", coordinator.grpc_target, "--job", "nic",
         "--world-size", "1", "--socket-name", "nosuch9", "--", "true"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "SAR_SOCKET_NAME": ""},
    )  # fmt: skip
    assert proc.returncode == cli.EXIT_USAGE
    assert "socket_name 'nosuch9' is not an interface of host" in proc.stderr
    assert "lo" in proc.stderr.split("it has:")[-1]
    assert coordinator.get_json("/v1/jobs") == {"jobs": []}


# -- a rank's reports -------------------------------------------------------------------------


@pytest.mark.integration  # a `sleep` process stands in for a rank
def test_rank_report_carries_progress_and_the_age_of_the_ranks_last_sign_of_life(tmp_path: Path) -> None:
    path = tmp_path / "rank0.progress"
    rank = LocalRank(
        0, 0, "m0", "s0", "10.0.0.2", ProgressReader(path), RankOutput(0, 0, tag="", console=None, files=None)
    )
    # No record yet (a program without sarcomm's library): alive while its process is.
    assert rank.report(time.time(), 1.0) == MemberReport("m0", "s0", None, "")
    # The record names the rank's process: here a `sleep` the test stops and continues.
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        writer = ProgressWriter(path)
        writer._pid = sleeper.pid
        seq = writer.enter("all_to_all")
        record = writer.publish(stamp=100.0)
        report = rank.report(100.5, 1.0)
        assert report.progress == Progress(seq, "all_to_all", True, record.since)
        assert report.metrics_address == ""  # no endpoint yet
        # The port the rank bound reaches the report with the next stamp, on the rank's address.
        writer.metrics_port = 9001
        writer.publish(stamp=100.6)
        report = rank.report(100.7, 1.0)
        assert report.metrics_address == "10.0.0.2:9001"
        assert report.age == 0.0  # its process runs
        # A busy rank (its Python holds the GIL) stamps no more but runs: alive, logged as stale.
        assert rank.report(150.0, 1.0).age == 0.0
        stale_while_busy = rank.stale
        # A stopped rank: its age grows from when the kernel last said it ran.
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(sleeper.pid) == "T", 10, what="the sleep to stop")
        assert rank.report(151.5, 1.0).age == pytest.approx(1.5)
        os.kill(sleeper.pid, signal.SIGCONT)
        wait_for(lambda: process_state(sleeper.pid) != "T", 10, what="the sleep to continue")
        writer.publish(stamp=152.0)
        assert rank.report(152.1, 1.0).age == 0.0
        stale_after_a_stamp = rank.stale
        assert stale_while_busy
        assert not stale_after_a_stamp
        # A dead one likewise (gone from the process table once reaped).
        sleeper.kill()
        sleeper.wait(10)
        writer.publish(stamp=153.0)
        assert rank.report(155.0, 1.0).age == pytest.approx(2.0)
        writer.close()
    finally:
        sleeper.kill()
        sleeper.wait(10)
    rank.progress.close()


def test_an_agent_slower_than_the_coordinator_beats_at_the_coordinators_interval(
    agents: Agents, coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    # The coordinator expects a report every 0.5 s (silent after 1.5 s); this agent is told 2 s.
    # It must follow the coordinator, or its healthy rank is declared dead mid-run.
    command = [sys.executable, RANK_SCRIPT, "sleep", str(tmp_path), "4"]
    proc = agents.start("a", "paced", "--world-size", "1", "--heartbeat-interval", "2", command=command)
    code, stderr = agents.wait(proc)
    assert code == 0, stderr
    assert "heartbeating every 0.5 s, the coordinator's interval" in stderr
    assert job_state(coordinator, "paced")["state"] == "FINISHED"
