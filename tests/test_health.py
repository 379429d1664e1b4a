"""Failure detection and reaction with real processes: ranks killed, stopped, cut off; agents
killed; restarts; a coordinator killed mid-job. The membership rules behind them, with a fake
clock and no process: tests/test_health_rules.py.

The world tests run a real coordinator (heartbeat interval 0.5 s x 3 misses: a member is dead
after 1.5 s of silence), real ``sar-worker`` agents or self-registered processes, and ranks that
run gloo all_reduce in a loop (``scripts/health_rank.py``). A thread watches the job through the
``Watch`` stream, so each test measures when the coordinator told the job, not when it polled.
Every wait has a deadline; none waits for gloo's timeout (the ranks' groups have 300 s).

The partition test builds hosts out of network namespaces joined by a bridge in a namespace of its
own (the root namespace's iptables may drop bridged traffic); it needs root and ``ip``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import SarcommError
from sarcomm.common.messages import Event
from tests.conftest import CoordinatorProcess, StartCoordinator, netns_unavailable
from tests.helpers import SAR_WORKER, free_port, stays_false, wait_for

SCRIPTS = Path(__file__).parent / "scripts"
RANK_SCRIPT = str(SCRIPTS / "health_rank.py")
INTERVAL_S, MISSES = 0.5, 3
#: The issue's bound for a silent member: interval x misses + 1 s.
DETECT_S = INTERVAL_S * MISSES + 1.0
#: The issue's bound from a rank's SIGKILL to the last other rank stopping.
KILL_STOP_S = 3.0
#: Bounds start-up (torch imports on 2 busy cores, rendezvous) and every other wait.
START_DEADLINE_S = 90.0
END_DEADLINE_S = 30.0


# -- helpers -----------------------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    env.update(extra)
    return env


class World:
    """Agents or self-registered ranks of one job, a Watch on it, and its control directory.

    ``target`` is what agents and the Watch are given as ``--coord`` (default ``coord``'s address;
    the failover tests give every replica's, ``a,b``); ``coord``'s log goes into failure messages.
    """

    def __init__(self, coord: CoordinatorProcess, job: str, control: Path, target: str | None = None) -> None:
        self.coord, self.job, self.control = coord, job, control
        self.target = target or coord.grpc_target
        self.procs: list[subprocess.Popen[str]] = []
        self.events: list[tuple[float, Event]] = []
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._watcher = threading.Thread(
            target=self._loop.run_until_complete, args=(self._watch(),), daemon=True
        )
        self._watcher.start()

    async def _watch(self) -> None:
        # One long Watch (the coordinator's events are not replayed: a gap between two streams
        # could lose one), reconnected only when the coordinator goes away; close() cancels it.
        self._task = asyncio.current_task()
        try:
            while not self._stop.is_set():
                try:
                    async with CoordinatorClient(self.target, timeout=5.0) as client:
                        async for event in client.watch(self.job, timeout=600.0):
                            self.events.append((time.monotonic(), event))
                except SarcommError:
                    await asyncio.sleep(0.1)  # a pause before reconnecting, not a wait
        except asyncio.CancelledError:
            return

    def agent(self, *flags: str, netns: str | None = None, coord: str | None = None) -> subprocess.Popen[str]:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen(
            [*prefix, *SAR_WORKER, "--coord", coord or self.target,
             "--job", self.job, "--heartbeat-interval", "0.25", "--join-timeout", "60", "--backend", "gloo",
             *flags, "--", sys.executable, RANK_SCRIPT, str(self.control)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_clean_env(),
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def library_rank(self, rank: int, world: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, RANK_SCRIPT, str(self.control), self.coord.grpc_target, self.job, str(rank),
             str(world)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=_clean_env(SARCOMM_HEARTBEAT_INTERVAL="0.25"),
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def pids(self, ranks: range) -> dict[int, int]:
        """Each rank's pid once it runs collectives."""

        def started() -> dict[int, int] | None:
            files = {r: self.control / f"rank{r}.pid" for r in ranks}
            if all(f.exists() for f in files.values()):
                return {r: int(f.read_text()) for r, f in files.items()}
            for proc in self.procs:
                if proc.poll() is not None:
                    stderr = proc.stderr.read() if proc.stderr else ""
                    pytest.fail(f"{proc.args!r} exited with {proc.returncode} before the world ran:\n"
                                f"{stderr}\n{self.coord.log()}")  # fmt: skip
            return None

        return wait_for(started, START_DEADLINE_S, what=lambda: f"the ranks to start: {self.coord.log()}")

    def failure(self, after: float, deadline_s: float = END_DEADLINE_S) -> tuple[float, Event]:
        """The first MEMBER_FAILED told after monotonic time ``after``, and when."""

        def told() -> tuple[float, Event] | None:
            for seen, event in list(self.events):
                if seen >= after and event.kind is EventKind.MEMBER_FAILED:
                    return seen, event
            return None

        return wait_for(
            told,
            deadline_s,
            what=lambda: f"a MEMBER_FAILED; events {self.events}\n{self.coord.log()}",
            interval=0.01,
        )

    def wait(self, proc: subprocess.Popen[str], timeout: float = END_DEADLINE_S) -> tuple[int, str]:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.args!r} still running after {timeout} s\n{self.coord.log()}")
        return proc.returncode, stderr

    def result(self, rank: int, generation: int = 1) -> dict[str, object]:
        data = json.loads((self.control / f"rank{rank}.gen{generation}.json").read_text())
        assert isinstance(data, dict)
        return data

    def close(self) -> None:
        self._stop.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        # Ranks of a killed agent (or a stopped rank) may be left: never leave a process behind.
        for pid_file in self.control.glob("rank*.pid"):
            pid = int(pid_file.read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._watcher.join(5)
        if not self._watcher.is_alive():
            self._loop.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its agent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stopped_by(pids: dict[int, int], start: float, deadline_s: float) -> float:
    """Seconds from monotonic ``start`` until every process of ``pids`` is gone."""
    wait_for(
        lambda: not any(_alive(p) for p in pids.values()),
        max(start + deadline_s - time.monotonic(), 0.0),
        what=lambda: (
            f"rank(s) {[r for r, p in pids.items() if _alive(p)]} to stop {deadline_s} s after the fault"
        ),
        interval=0.005,
    )
    return time.monotonic() - start


def _job(coord: CoordinatorProcess, job: str) -> dict[str, object]:
    jobs = {j["job"]: j for j in coord.get_json(f"/v1/jobs?job={job}")["jobs"]}  # type: ignore[index]
    found = jobs[job]
    assert isinstance(found, dict)
    return found


def _progress(coord: CoordinatorProcess, job: str) -> dict[int, int]:
    """Each rank's last reported progress seq (collectives it has entered)."""
    members = _job(coord, job)["members"]
    assert isinstance(members, list)
    return {int(m["rank"]): int(m["progress"]["seq"]) for m in members}


def _status(coord: CoordinatorProcess, job: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "sarcomm.coordinator.cli", "status", "--coord", coord.grpc_target,
         "--job", job],
        capture_output=True, text=True, timeout=30, env=_clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def coord(start_coordinator: StartCoordinator) -> CoordinatorProcess:
    return start_coordinator(
        "--heartbeat-interval", str(INTERVAL_S), "--heartbeat-misses", str(MISSES), "--join-timeout", "90",
        "--stall-threshold", "0.5", "--shutdown-grace", "1",
    )  # fmt: skip


@pytest.fixture
def world_factory(tmp_path: Path) -> Iterator[Callable[[CoordinatorProcess, str], World]]:
    worlds: list[World] = []

    def make(coordinator: CoordinatorProcess, job: str) -> World:
        control = tmp_path / job
        control.mkdir()
        worlds.append(World(coordinator, job, control))
        return worlds[-1]

    yield make
    for world in worlds:
        world.close()


# -- agent mode --------------------------------------------------------------------------------


def test_agents_name_a_straggler_then_stop_every_rank_within_3s_of_a_sigkill(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "kill4")
    a = world.agent("--world-size", "4", "--nproc-per-node", "2", "--rank", "0")
    b = world.agent("--world-size", "4", "--nproc-per-node", "2", "--rank", "2")
    pids = world.pids(range(4))

    # Rank 3 is alive but late before every all_reduce: the others wait for it in the collective,
    # and the coordinator (--stall-threshold 0.5) names it in /v1/jobs, the metric and status.
    (world.control / "slow").write_text("3")
    seen = {"json": False, "metric": False, "status": False}

    def named() -> bool:
        stall = _job(coord, "kill4").get("stall")
        if isinstance(stall, dict) and stall["blocking_ranks"] == [3]:
            assert stall["op"] == "all_reduce"
            assert stall["waiting_ranks"] == [0, 1, 2]
            assert stall["waited_seconds"] >= 0.5
            seen["json"] = True
        metrics = coord.get_text("/metrics")
        seen["metric"] = seen["metric"] or bool(
            re.search(
                r'sar_coordinator_rank_blocking_seconds\{job="kill4",op="all_reduce",rank="3"\}', metrics
            )
        )
        if seen["json"] and not seen["status"]:
            text = _status(coord, "kill4")
            seen["status"] = (
                "in collective #" in text and "(all_reduce) for rank(s) 3, which have not" in text
            )
        return all(seen.values())

    wait_for(
        named, END_DEADLINE_S, what=lambda: f"the stall to be named (seen: {seen}): {_job(coord, 'kill4')}"
    )
    (world.control / "slow").unlink()
    assert all(_alive(p) for p in pids.values()), "a straggler is not a failure"

    # Back in the loop at full speed: rank 3 may be inside its last slow pause, so every rank
    # must finish two more all_reduce calls (its progress seq moves by 2) before the kill.
    before = _progress(coord, "kill4")
    wait_for(
        lambda: all(seq >= before[r] + 2 for r, seq in _progress(coord, "kill4").items()),
        END_DEADLINE_S,
        what=f"every rank to run two more all_reduce calls after {before}",
    )
    started = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    others = {r: p for r, p in pids.items() if r != 1}
    stopped_after = _stopped_by(others, started, KILL_STOP_S + 5)
    told_at, event = world.failure(started)
    assert stopped_after <= KILL_STOP_S, f"last rank stopped {stopped_after:.2f} s after the kill"
    assert (event.rank, event.reason) == (1, "killed by signal 9 (SIGKILL)")
    code_a, err_a = world.wait(a)
    code_b, err_b = world.wait(b)
    assert code_a == 128 + signal.SIGKILL, err_a
    assert code_b != 0, err_b
    for err in (err_a, err_b):
        last = err.strip().splitlines()[-1]
        assert re.search(r"rank 1 on host \S+ failed: killed by signal 9", last), last
    state = _job(coord, "kill4")
    assert state["state"] == "FAILED"
    assert str(state["reason"]).startswith("rank 1 on host")
    assert "rank 1 on host" in _status(coord, "kill4")
    print(
        f"rank SIGKILL: told after {told_at - started:.2f} s, last rank stopped after {stopped_after:.2f} s"
    )


def test_a_sigstopped_rank_that_the_others_wait_for_is_detected_and_every_rank_stopped(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "stop2")
    a = world.agent("--world-size", "2", "--rank", "0")
    b = world.agent("--world-size", "2", "--rank", "1")
    pids = world.pids(range(2))
    started = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)  # alive, hung: its agent is fine and keeps reporting
    told_at, event = world.failure(started)
    assert told_at - started <= DETECT_S, f"told after {told_at - started:.2f} s"
    assert event.rank == 1
    assert event.reason.startswith("missed heartbeats")
    _stopped_by(pids, started, END_DEADLINE_S)
    for proc in (a, b):
        code, err = world.wait(proc)
        assert code != 0, err
        assert "rank 1 on host" in err.strip().splitlines()[-1], err
    # Rank 0 was waiting for rank 1 inside all_reduce when it was stopped.
    assert "rank 1 on host" in _status(coord, "stop2")
    assert "missed heartbeats" in str(_job(coord, "stop2")["reason"])


def test_a_sigkilled_agent_is_detected_and_its_orphaned_ranks_stop_too(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "agent2")
    a = world.agent("--world-size", "2", "--rank", "0")
    b = world.agent("--world-size", "2", "--rank", "1")
    pids = world.pids(range(2))
    started = time.monotonic()
    b.kill()
    told_at, event = world.failure(started)
    # Its stream broke: judged after one interval, well inside the silence rule.
    assert told_at - started <= DETECT_S, f"told after {told_at - started:.2f} s"
    assert event.rank == 1
    assert event.reason.startswith("connection lost")
    # Rank 0 is stopped by its agent; rank 1, whose agent is gone, stops itself.
    _stopped_by(pids, started, END_DEADLINE_S)
    code, err = world.wait(a)
    assert code != 0
    assert "rank 1 on host" in err.strip().splitlines()[-1], err
    assert "connection lost" in _status(coord, "agent2")


def test_max_restarts_1_restarts_as_generation_2_after_a_sigkill_with_correct_results(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "again4")
    flags = ("--world-size", "4", "--nproc-per-node", "2", "--max-restarts", "1")
    a = world.agent(*flags, "--rank", "0")
    b = world.agent(*flags, "--rank", "2")
    pids = world.pids(range(4))
    os.kill(pids[1], signal.SIGKILL)
    for proc in (a, b):
        code, err = world.wait(proc, START_DEADLINE_S)
        assert code == 0, err
    for rank in range(4):
        result = world.result(rank, generation=2)
        assert (result["restarts"], result["wrong"], result["iterations"]) == (1, 0, 20), result
    state = _job(coord, "again4")
    assert (state["state"], state["generation"], state["restart_count"], state["max_restarts"]) == (
        "FINISHED", 2, 1, 1,
    )  # fmt: skip
    history = state["history"]
    assert isinstance(history, list)
    assert [(h["generation"], h["state"], h["failed_rank"]) for h in history] == [(1, "FAILED", 1)]
    assert "killed by signal 9" in history[0]["reason"]
    text = _status(coord, "again4")
    assert "restarts 1 of 1" in text
    assert re.search(r"generation 1 FAILED: rank 1 on host \S+ failed: killed by signal 9", text), text


# -- library mode (self-registered processes, PeerFailedError) ---------------------------------


def test_library_sigkill_of_a_rank_raises_peer_failed_error_on_every_other_rank_within_3s(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "lib4")
    procs = [world.library_rank(r, 4) for r in range(4)]
    pids = world.pids(range(4))
    wall_started, started = time.time(), time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    stopped_after = _stopped_by({r: p for r, p in pids.items() if r != 2}, started, KILL_STOP_S + 5)
    assert stopped_after <= KILL_STOP_S, f"last rank stopped {stopped_after:.2f} s after the kill"
    for rank in (0, 1, 3):
        code, err = world.wait(procs[rank])
        assert code == 3, err
        error = world.result(rank)["error"]
        assert isinstance(error, dict)
        assert error["rank"] == 2
        assert re.search(r"rank 2 on host \S+ failed: connection lost", error["message"]), error
        assert error["raised_at"] - wall_started <= KILL_STOP_S
    assert "connection lost" in str(_job(coord, "lib4")["reason"])


def test_library_sigstop_unblocks_collectives_already_waiting_with_peer_failed_error(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "libstop3")
    procs = [world.library_rank(r, 3) for r in range(3)]
    pids = world.pids(range(3))
    wall_started, started = time.time(), time.monotonic()
    # Rank 1's process is stopped, sockets open: gloo alone would wait 300 s in the all_reduce the
    # others are in. The coordinator's verdict aborts their process groups.
    os.kill(pids[1], signal.SIGSTOP)
    told_at, event = world.failure(started)
    assert told_at - started <= DETECT_S, f"told after {told_at - started:.2f} s"
    assert (event.rank, event.reason[:17]) == (1, "missed heartbeats")
    _stopped_by({0: pids[0], 2: pids[2]}, started, END_DEADLINE_S)
    for rank in (0, 2):
        code, err = world.wait(procs[rank])
        assert code == 3, err
        error = world.result(rank)["error"]
        assert isinstance(error, dict)
        assert error["rank"] == 1
        assert "missed heartbeats" in error["message"]
        # Raised in the collective that was waiting, moments after the verdict.
        assert error["raised_at"] - wall_started <= DETECT_S + 1.0, error
    os.kill(pids[1], signal.SIGKILL)


# -- coordinator restart -----------------------------------------------------------------------


def test_a_job_survives_a_coordinator_sigkill_and_a_later_failure_is_still_told(
    coord: CoordinatorProcess, world_factory: Callable[[CoordinatorProcess, str], World]
) -> None:
    world = world_factory(coord, "outage2")
    a = world.agent("--world-size", "2", "--rank", "0")
    b = world.agent("--world-size", "2", "--rank", "1")
    pids = world.pids(range(2))
    before = _job(coord, "outage2")
    coord.kill()
    # The subject is time passing: an outage longer than the liveness timeout, through which
    # the ranks keep running (nobody may be judged for it once the coordinator is back).
    stays_false(
        lambda: [r for r, p in pids.items() if not _alive(p)], 1.5, what="a rank stopping during the outage"
    )
    restarted = time.time()
    coord.start()

    # Members reconnect (backoff and jitter) and report again; the ranks never stopped.
    def reconnected() -> dict[str, object] | None:
        job = _job(coord, "outage2")
        members = job["members"]
        assert isinstance(members, list)
        ok = all(m["last_heartbeat"] > restarted and m["progress"]["seq"] > 0 for m in members)
        return job if ok else None

    after = wait_for(
        reconnected, END_DEADLINE_S, what=lambda: f"members to reconnect\n{coord.log()}", interval=0.1
    )
    members = after["members"]
    assert isinstance(members, list)
    assert all(_alive(p) for p in pids.values())
    assert (after["job"], after["generation"], after["state"]) == (
        before["job"],
        before["generation"],
        "RUNNING",
    )
    members_before = before["members"]
    assert isinstance(members_before, list)
    assert [(m["member_id"], m["rank"], m["state"]) for m in members] == [
        (m["member_id"], m["rank"], m["state"]) for m in members_before
    ]
    # The ranks kept running collectives through the outage.
    progress_before = {m["rank"]: m["progress"]["seq"] for m in members_before}
    assert all(m["progress"]["seq"] > progress_before[m["rank"]] for m in members)

    # The subject is time passing: past the liveness timeout the job still runs, nobody judged.
    stays_false(
        lambda: _job(coord, "outage2")["state"] != "RUNNING",
        2 * INTERVAL_S * MISSES,
        what="the job leaving RUNNING after the restart",
    )
    assert _job(coord, "outage2")["state"] == "RUNNING"
    started = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    told_at, event = world.failure(started)
    assert told_at - started <= KILL_STOP_S
    assert event.rank == 1
    for proc in (a, b):
        code, err = world.wait(proc)
        assert code != 0
        assert "rank 1 on host" in err.strip().splitlines()[-1], err
    assert _job(coord, "outage2")["state"] == "FAILED"


# -- partition (network namespaces) ------------------------------------------------------------


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@pytest.fixture
def hosts() -> Iterator[tuple[str, list[str]]]:
    """Three hosts (namespaces with eth0 at 10.79.0.11-13) and the root namespace at 10.79.0.1, on
    one bridge that lives in a switch namespace of its own. Yields (coordinator address, hosts)."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    switch, names = f"sarsw{tag}", [f"sarh{tag}-{i}" for i in range(3)]
    head = f"sarhd{tag}"
    created: list[str] = []
    try:
        for name in (switch, *names):
            result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {result.stderr.strip()}")
            created.append(name)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("link", "add", head, "type", "veth", "peer", "name", "up0", "netns", switch)
        _ip("addr", "add", "10.79.0.1/24", "dev", head)
        _ip("link", "set", head, "up")
        ports = ["up0"]
        for i, name in enumerate(names, start=1):
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                f"up{i}",
                "netns",
                switch,
            )
            _ip("-n", name, "addr", "add", f"10.79.0.{10 + i}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "eth0", "up")
            ports.append(f"up{i}")
        for port in ports:
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
        yield "10.79.0.1", names
    finally:
        for name in created:  # deleting a namespace deletes its veth ends and their peers
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", head], capture_output=True, timeout=30, check=False)


@pytest.mark.netns
def test_a_host_cut_off_by_taking_its_link_down_is_detected_and_the_others_stopped(
    start_coordinator: StartCoordinator,
    hosts: tuple[str, list[str]],
    world_factory: Callable[[CoordinatorProcess, str], World],
) -> None:
    address, names = hosts
    port = free_port()
    coordinator = start_coordinator(
        "--listen", f"0.0.0.0:{port}", "--heartbeat-interval", str(INTERVAL_S), "--heartbeat-misses",
        str(MISSES), "--join-timeout", "90", "--shutdown-grace", "1",
    )  # fmt: skip
    coordinator.grpc_port = port  # the fixture's loopback target reaches 0.0.0.0 too
    world = world_factory(coordinator, "cut3")
    agents = [
        world.agent("--world-size", "3", "--rank", str(i), netns=name, coord=f"{address}:{port}")
        for i, name in enumerate(names)
    ]
    pids = world.pids(range(3))
    started = time.monotonic()
    _ip("-n", names[2], "link", "set", "eth0", "down")  # host 2 and its rank 2 are cut off
    told_at, event = world.failure(started)
    assert told_at - started <= DETECT_S, f"told after {told_at - started:.2f} s"
    assert event.rank == 2
    assert event.reason.startswith("missed heartbeats")
    _stopped_by({0: pids[0], 1: pids[1]}, started, END_DEADLINE_S)
    for proc in agents[:2]:
        code, err = world.wait(proc)
        assert code != 0, err
        assert "rank 2 on host" in err.strip().splitlines()[-1], err
    text = _status(coordinator, "cut3")
    assert "rank 2 on host" in text
    assert "missed heartbeats" in text
    # Host 2 hears nothing (it is cut off); its agent and rank are killed by the test's cleanup.
