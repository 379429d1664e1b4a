"""Clients following the leader among replicas (``--coord a:50051,b:50051``): real calls, streams,
``status`` and ``sar-worker`` through standbys, dead addresses and a coordinator that stops
answering.

The leaders are real ``sar-coordinator`` processes. The standby is :class:`tests.standby.Standby`
(a real gRPC server keeping the standby's contract; its docstring says why it stands in for the
etcd-backed one). The same with real etcd replicas and a take-over: tests/test_ha_etcd_clients.py;
a coordinator restarted on the other address of the list: tests/test_failover_sqlite_restart.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.heartbeats import SILENT_MIN_S as HEARTBEAT_SILENT_S
from sarcomm.common.client.replicas import CONNECT_S
from sarcomm.common.errors import CoordinatorUnavailableError, NotLeaderError
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.failover_job import DEADLINE_S, answering
from tests.helpers import LO, SAR_WORKER, free_port, wait_for, wait_for_async
from tests.standby import Standby

# The liveness rule: a member judged after 0.5 s x 3 of silence.
LIVENESS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "3")


# -- calls through standbys and dead addresses ---------------------------------------------------


@pytest.fixture
def leader(start_coordinator: StartCoordinator) -> CoordinatorProcess:
    return start_coordinator(*LIVENESS, "--join-timeout", "60")


async def _join_one(client: CoordinatorClient, job: str) -> int:
    assignment = await asyncio.wait_for(client.join(job, 1, host="h", interfaces=[LO]), DEADLINE_S)
    state = await asyncio.wait_for(client.leave(assignment.member_id, assignment.secret, 0), DEADLINE_S)
    assert state == "FINISHED"
    return assignment.rank


async def test_a_client_given_standby_then_leader_joins_through_the_hint(
    leader: CoordinatorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sarcomm.common.client.replicas")
    async with Standby(leader.grpc_target) as standby:
        async with CoordinatorClient(f"{standby.target},{leader.grpc_target}", timeout=10.0) as client:
            assert await _join_one(client, "hinted") == 0
            assert client.target == leader.grpc_target
            # Once the leader is known, calls go straight to it.
            assert [j.job for j in await client.list_jobs("hinted")] == ["hinted"]
        assert standby.calls == {"Join": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "sarcomm.common.client.replicas"]
    assert lines == [f"following the leader at {leader.grpc_target} ({standby.target} is a standby)"]


async def test_a_single_address_that_is_a_standby_is_followed_to_its_leader_at_its_first_refusal(
    leader: CoordinatorProcess,
) -> None:
    async with (
        Standby(leader.grpc_target) as standby,
        CoordinatorClient(standby.target, timeout=10.0) as client,
    ):
        assert await _join_one(client, "single-hinted") == 0
        assert client.target == leader.grpc_target
    # One retry layer, the one that reads the hint: no blind resend of the refusal first.
    assert standby.calls == {"Join": 1}


async def test_a_client_given_a_dead_address_then_the_leader_reaches_it_within_seconds(
    leader: CoordinatorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sarcomm.common.client.replicas")
    dead = f"127.0.0.1:{free_port()}"
    async with CoordinatorClient(f"{dead},{leader.grpc_target}", timeout=10.0) as client:
        started = time.monotonic()
        assert await _join_one(client, "past-dead") == 0
        # A refused connection fails at once; the bound is one replica's connect budget.
        assert time.monotonic() - started < CONNECT_S + 2.0
    lines = [r.getMessage() for r in caplog.records if r.name == "sarcomm.common.client.replicas"]
    assert lines == [f"following the leader at {leader.grpc_target} ({dead} is unreachable)"]


async def test_no_leader_among_the_replicas_ends_the_call_naming_each_ones_problem() -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with Standby("") as standby, CoordinatorClient(f"{dead},{standby.target}", timeout=3.0) as client:
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await client.leave("m", "s", 0)
        elapsed = time.monotonic() - started
    assert 2.5 < elapsed < 3.0 + CONNECT_S, elapsed
    assert str(caught.value) == (
        f"No coordinator of {dead}, {standby.target} led within the 3 s deadline of Leave: {dead} is "
        f"unreachable (connection refused: nothing accepts connections on {dead}: start "
        f"sar-coordinator there, or give the port of its --listen (default 50051)); {standby.target} "
        "is a standby that knows no leader."
    )


@pytest.mark.integration  # a sar-worker process
def test_sar_worker_given_replicas_it_cannot_use_names_each_ones_problem_within_seconds(
    tmp_path: Path,
) -> None:
    refused = f"127.0.0.1:{free_port()}"
    unresolved = f"no-such-coordinator.invalid:{free_port()}"
    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [*SAR_WORKER, "--coord", f"{refused},{unresolved}",
             "--job", "lost", "--world-size", "1", "--join-timeout", "120", "--", "true"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        said = wait_for(
            lambda: next((line for line in log.read_text().splitlines() if "leads yet" in line), None),
            10.0,
            what=lambda: f"the worker saying what is wrong with each replica; it wrote:\n{log.read_text()}",
        )
        assert worker.poll() is None  # still trying: a refused port or an unknown name may heal
    finally:
        worker.kill()
        worker.wait(10)
    assert (
        f"Join: no coordinator of {refused}, {unresolved} leads yet ({refused} is unreachable (connection "
        f"refused: nothing accepts connections on {refused}: start sar-coordinator there, or give the port "
        f"of its --listen (default 50051)); {unresolved} is unreachable (name not resolved: the host name "
        "'no-such-coordinator.invalid' does not resolve"
    ) in said, said
    assert re.search(r"still trying \(\d+ s so far, \d+ s left\)$", said), said


async def test_a_single_address_that_is_a_standby_knowing_no_leader_ends_in_not_leader_error() -> None:
    # One address is a list of one: a standby that knows no leader is asked again after the
    # failover backoff until the deadline, and its refusal is the error.
    async with Standby("") as standby, CoordinatorClient(standby.target, timeout=6.0) as client:
        with pytest.raises(NotLeaderError) as caught:
            await client.list_jobs()
    assert caught.value.leader == ""
    assert str(caught.value) == (
        f"The coordinator at {standby.target} is a standby (ListJobs): it knows no leader yet; this "
        "coordinator is a standby: no leader is known yet"
    )
    assert standby.calls["ListJobs"] >= 2  # asked again while the deadline lasted


# -- a coordinator that stops answering ----------------------------------------------------------


async def test_a_heartbeat_stream_whose_coordinator_stops_answering_moves_to_the_other(
    start_coordinator: StartCoordinator,
) -> None:
    # A SIGSTOPped coordinator is a hung or vanished host: its kernel keeps the connection up, so
    # only the missing answers tell. The other address is an independent coordinator here (the
    # subject is the client leaving a silent leader, not a shared state): it answers the reports
    # with "unknown member", which is an answer.
    a = start_coordinator(*LIVENESS)
    b = start_coordinator(*LIVENESS)
    async with CoordinatorClient(f"{a.grpc_target},{b.grpc_target}", timeout=10.0) as client:
        member = await asyncio.wait_for(client.join("hung", 1, host="h", interfaces=[LO]), DEADLINE_S)
        async with answering(client, member) as answered_by:
            await wait_for_async(lambda: a.grpc_target in answered_by, DEADLINE_S, what="an answer from a")
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                await wait_for_async(
                    lambda: b.grpc_target in answered_by, HEARTBEAT_SILENT_S + 3.0, what="an answer from b"
                )
                moved = time.monotonic() - stopped
            finally:
                a.proc.send_signal(signal.SIGCONT)
    assert HEARTBEAT_SILENT_S <= moved < HEARTBEAT_SILENT_S + 3.0, moved


# -- status --------------------------------------------------------------------------------------


async def _status(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sarcomm.coordinator.cli", "status", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_status_with_a_list_shows_each_replicas_role_and_the_leaders_jobs(
    start_coordinator: StartCoordinator,
) -> None:
    # The member never reports: a long liveness keeps its job running while status looks.
    leader = start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")
    dead = f"127.0.0.1:{free_port()}"
    async with Standby(leader.grpc_target) as standby, CoordinatorClient(leader.grpc_target) as client:
        member = await asyncio.wait_for(client.join("seen", 1, host="h", interfaces=[LO]), DEADLINE_S)
        coord = f"{standby.target},{leader.grpc_target},{dead}"
        code, out, err = await _status("--coord", coord)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["COORDINATOR", "ROLE"]
        assert lines[1].split() == [standby.target, "standby"]
        assert lines[2].split() == [leader.grpc_target, "leader"]
        assert lines[3].startswith(f"{dead}  ")
        assert lines[3].endswith(
            f"down (connection refused: nothing accepts connections on {dead}: start sar-coordinator "
            "there, or give the port of its --listen (default 50051))"
        )
        assert any(line.startswith("job seen  generation 1  RUNNING") for line in lines), out
        code, out, err = await _status("--coord", coord, "--json")
        assert code == 0, err
        view = json.loads(out)
        assert [(c["address"], c["role"]) for c in view["coordinators"]] == [
            (standby.target, "standby"), (leader.grpc_target, "leader"), (dead, "down")
        ]  # fmt: skip
        assert [j["job"] for j in view["jobs"]] == ["seen"]
        await client.leave(member.member_id, member.secret, 0)


@pytest.mark.integration  # the status command's process
async def test_status_with_no_leader_among_the_replicas_says_what_each_one_is() -> None:
    async with Standby("") as standby:
        dead = f"127.0.0.1:{free_port()}"
        code, _, err = await _status("--coord", f"{standby.target},{dead}")
    assert code == 2
    assert err.strip() == (
        f"sar-coordinator: No coordinator of {standby.target}, {dead} leads: {standby.target} is standby; "
        f"{dead} is down (connection refused: nothing accepts connections on {dead}: start sar-coordinator "
        "there, or give the port of its --listen (default 50051))."
    )
