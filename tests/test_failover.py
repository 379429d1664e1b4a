"""Clients of a coordinator with replicas (``--coord a:50051,b:50051``): the list's one parse rule,
the failover plan, and real calls, streams, ``status`` and a ``sar-worker`` job through standbys,
dead addresses and a coordinator that moves.

The leaders are real ``sar-coordinator`` processes. The standby is :class:`tests.standby.Standby`
(a real gRPC server keeping the standby's contract; its docstring says why it stands in for the
etcd-backed one). A failover of the leader is a real one of the same state: the leader is
SIGKILLed and a second ``sar-coordinator`` on the same SQLite ``--state`` starts on the other
address of the list, restoring the jobs and giving members ``--reconnect-grace``.
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
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.addresses import parse_targets
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.failover import BACKOFF_MAX_S, Failover
from sarcomm.common.client.heartbeats import SILENT_MIN_S as HEARTBEAT_SILENT_S
from sarcomm.common.client.replicas import CONNECT_S
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import CoordinatorUnavailableError, InvalidArgumentError, NotLeaderError
from sarcomm.common.messages import Event, HeartbeatReply, MemberReport
from sarcomm.worker.agent import cli as worker_cli
from sarcomm.worker.agent.config import AgentConfig
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.failover_job import agent_job, answering
from tests.helpers import LO, SAR_WORKER, free_port, stays_false, stays_false_async, wait_for, wait_for_async
from tests.standby import Standby

# Bounds every wait of a test on a coordinator.
DEADLINE_S = 20.0
# The grace a restored member gets to re-attach (the coordinator's --reconnect-grace here), and
# the liveness rule: a member judged after 0.5 s x 3 of silence once the grace is over.
GRACE_S = 4.0
# Bounds a sar-worker's whole run: torch imports, rendezvous, collectives, shutdown.
LIVENESS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "3", "--reconnect-grace", str(GRACE_S))


# -- one parse rule for the list ---------------------------------------------------------------


def test_parse_targets_keeps_a_single_address_and_splits_a_list() -> None:
    assert parse_targets("head:50051") == ("head:50051",)
    assert parse_targets("a:50051, b:50051 ,[fd00::1]:50051") == ("a:50051", "b:50051", "[fd00::1]:50051")
    assert parse_targets("unix:/run/a.sock,b:1") == ("unix:/run/a.sock", "b:1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "a:1,,b:2",
            "The item 2 of the coordinator address list 'a:1,,b:2' is blank: give addresses separated "
            "by single commas, e.g. a:50051,b:50051.",
        ),
        (
            "a:1,b:2,",
            "The item 3 of the coordinator address list 'a:1,b:2,' is blank: give addresses separated "
            "by single commas, e.g. a:50051,b:50051.",
        ),
        (
            "a:1,b:2,a:1",
            "The item 3 of the coordinator address list 'a:1,b:2,a:1' repeats item 1 ('a:1'): give each "
            "coordinator once.",
        ),
        (
            "a:1,b:70000",
            "The item 2 of the coordinator address list 'a:1,b:70000' is wrong: The coordinator address "
            "'b:70000' must have the form HOST:PORT (e.g. head:50051 or [fd00::1]:50051) with a port in "
            "1..65535.",
        ),
        (
            "a:1,http://b:9400",
            "The item 2 of the coordinator address list 'a:1,http://b:9400' is wrong: The coordinator "
            "address 'http://b:9400' has the scheme 'http', which gRPC does not dial: give HOST:PORT of "
            "sar-coordinator's --listen (e.g. head:50051), not a URL of its --http port.",
        ),
    ],
)
def test_parse_targets_names_the_item_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_targets(text)
    assert str(caught.value) == message


def test_sar_worker_takes_a_list_from_the_flag_or_sar_coord_and_names_a_bad_item() -> None:
    config, *_ = worker_cli.parse(
        ["--coord", "a:1, b:2", "--job", "j", "--world-size", "1", "--", "true"], {}
    )
    assert config.coord == "a:1,b:2"
    config, *_ = worker_cli.parse(
        ["--job", "j", "--world-size", "1", "--", "true"], {"SARCOMM_COORD": "a:1,b:2"}
    )
    assert config.coord == "a:1,b:2"
    with pytest.raises(InvalidArgumentError) as caught:
        worker_cli.parse(["--coord", "a:1,a:1", "--job", "j", "--world-size", "1", "--", "true"], {})
    assert str(caught.value) == (
        "--coord 'a:1,a:1': The item 2 of the coordinator address list 'a:1,a:1' repeats item 1 "
        "('a:1'): give each coordinator once."
    )
    # A single address keeps its message of before.
    with pytest.raises(InvalidArgumentError) as caught:
        worker_cli.parse(["--coord", "a:0", "--job", "j", "--world-size", "1", "--", "true"], {})
    assert str(caught.value) == "--coord 'a:0' must be HOST:PORT with a port in 1..65535."


def test_an_agent_config_keeps_one_form_of_the_list_and_refuses_a_bad_one() -> None:
    config = AgentConfig(coord=" a:1 , b:2", job="j", world_size=1, command=("x",))
    assert config.coord == "a:1,b:2"  # what the ranks get in SAR_COORD
    with pytest.raises(InvalidArgumentError, match=r"repeats item 1"):
        AgentConfig(coord="a:1,a:1", job="j", world_size=1, command=("x",))


def test_client_refuses_a_bad_list_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError, match=r"item 2 .* is blank"):
        CoordinatorClient("a:1, ,b:2")


# -- the failover plan (pure) --------------------------------------------------------------------


def _plan(*targets: str) -> Failover:
    # The jitter's upper end: the backoff itself.
    return Failover(targets, uniform=lambda low, high: high)


def test_failover_follows_a_hint_at_once_even_to_an_address_not_in_the_list() -> None:
    plan = _plan("a:1", "b:1")
    assert plan.not_leader("a:1", "c:1") == 0.0
    assert plan.current == "c:1"
    assert plan.targets == ["a:1", "b:1", "c:1"]
    assert plan.succeeded("c:1") == "following the leader at c:1 (a:1 is a standby)"
    assert plan.succeeded("c:1") is None  # the same leader: nothing to say


def test_failover_tries_each_replica_once_a_round_then_backs_off_doubling_to_the_cap() -> None:
    plan = _plan("a:1", "b:1", "c:1")
    delays = []
    for _ in range(9):
        delays.append(plan.unreachable(plan.current))
    # Within a round the next replica at once; after each round a doubling wait, capped.
    assert delays == [0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0, 0.4]
    for _ in range(30):
        assert plan.unreachable(plan.current) <= BACKOFF_MAX_S
    assert plan.succeeded("b:1") == "following the leader at b:1 (a:1 is unreachable; c:1 is unreachable)"
    assert plan.unreachable("b:1") == 0.0  # a success resets the round and the backoff


def test_failover_ignores_a_stale_hint_to_a_replica_that_just_failed() -> None:
    plan = _plan("a:1", "b:1")
    plan.succeeded("a:1")
    assert plan.unreachable("a:1") == 0.0  # the leader died: try b at once
    assert plan.current == "b:1"
    # b has not noticed yet and still names a: the round is over, wait, then start again from a.
    assert plan.not_leader("b:1", "a:1") == 0.1
    assert plan.current == "a:1"
    assert plan.not_leader("b:1", "") == 0.0  # a late answer from b while a is tried: noted only
    assert plan.current == "a:1"


def test_a_standby_that_knows_no_leader_sends_the_call_on_and_a_single_address_waits() -> None:
    plan = _plan("a:1", "b:1")
    assert plan.not_leader("a:1", "") == 0.0
    assert plan.current == "b:1"
    single = _plan("a:1")
    assert single.not_leader("a:1", "") == 0.1
    assert single.current == "a:1"


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


# -- heartbeat and watch streams across a failover -------------------------------------------------


@pytest.fixture
def moving(tmp_path: Path) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
    """Two coordinators on one SQLite state: ``a`` started, ``b`` (the other address) not yet."""
    state = tmp_path / "state.sqlite"
    a, b = (
        CoordinatorProcess(
            grpc_port=free_port(), http_port=free_port(), state_path=state,
            args=[*LIVENESS, "--join-timeout", "60"], log_path=tmp_path / f"{name}.log",
        )
        for name in ("a", "b")
    )  # fmt: skip
    a.start()
    yield a, b
    for coord in (a, b):
        if coord.proc is not None:
            coord.stop()


async def test_heartbeats_and_watch_reattach_to_the_coordinator_on_the_other_address_within_the_grace(
    moving: tuple[CoordinatorProcess, CoordinatorProcess],
) -> None:
    a, b = moving
    replies: list[tuple[str, HeartbeatReply]] = []
    async with CoordinatorClient(f"{a.grpc_target},{b.grpc_target}", timeout=10.0) as client:
        joined = await asyncio.wait_for(
            client.join_many("moved", 2, nproc=2, host="h", interfaces=[LO]), DEADLINE_S
        )
        members = joined.assignments

        def reports() -> list[MemberReport]:
            return [MemberReport(m.member_id, m.secret) for m in members]

        events: list[Event] = []

        async def watch() -> None:
            async for event in client.watch("moved"):
                events.append(event)
                if event.kind is EventKind.JOB_FINISHED:
                    return

        watcher = asyncio.ensure_future(watch())
        async with client.heartbeats(reports, 0.25) as stream:

            async def read() -> None:
                async for reply in stream:
                    replies.append((client.target, reply))

            reader = asyncio.ensure_future(read())
            await wait_for_async(lambda: replies, DEADLINE_S, what="a first heartbeat answer from a")
            await wait_for_async(lambda: events, DEADLINE_S, what="the watch's first event")
            await asyncio.to_thread(a.kill)
            killed = time.monotonic()
            await asyncio.to_thread(b.start)
            await wait_for_async(
                lambda: any(target == b.grpc_target for target, _ in replies),
                GRACE_S,
                what=lambda: f"heartbeats answered by b within the grace; b's log:\n{b.log()}",
            )
            reattached = time.monotonic() - killed
            logging.getLogger(__name__).warning(
                "heartbeats re-attached to b %.2f s after a was SIGKILLed (b's start-up included)", reattached
            )
            # Past the grace and a whole liveness window, every member is still running at b.
            await stays_false_async(
                lambda: "missed heartbeats" in b.log() or "connection lost" in b.log(),
                GRACE_S + 0.5 * 3 + 1.0,
                what="b failing a member",
            )
            jobs = await client.list_jobs("moved")
            assert [(j.state, sorted(m.state for m in j.members)) for j in jobs] == [
                ("RUNNING", ["RUNNING", "RUNNING"])
            ]
            reader.cancel()
        for m in members:
            await asyncio.wait_for(client.leave(m.member_id, m.secret, 0), DEADLINE_S)
        await asyncio.wait_for(watcher, DEADLINE_S)
    assert reattached < GRACE_S
    assert not any(set(r.unknown_members) for _, r in replies)
    # The watch saw the world formed once (not again on re-attaching) and the end from b.
    assert [e.kind for e in events] == [EventKind.WORLD_FORMED, EventKind.JOB_FINISHED]


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


# -- a sar-worker job across a move of its coordinator -------------------------------------------


def test_an_agent_job_runs_on_while_its_coordinator_moves_to_the_other_address_and_finishes(
    moving: tuple[CoordinatorProcess, CoordinatorProcess], tmp_path: Path
) -> None:
    a, b = moving
    with agent_job(f"{a.grpc_target},{b.grpc_target}", "moves", tmp_path) as job:
        a.kill()
        b.start()
        wait_for(
            lambda: f"following the leader at {b.grpc_target}" in job.log_text(),
            GRACE_S,
            what=lambda: f"the agent following b within the grace; agent:\n{job.log_text()}",
        )
        # Past the grace and a whole liveness window: the ranks still run, b fails nobody.
        stays_false(
            lambda: (
                job.agent.poll() is not None or "missed heartbeats" in b.log() or "connection lost" in b.log()
            ),
            GRACE_S + 0.5 * 3 + 1.0,
            what=lambda: f"the agent exiting or b failing a member; b:\n{b.log()}",
        )
        job.finish()
    job.check_ranks()
    jobs = {j["job"]: j for j in b.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    assert jobs["moves"]["state"] == "FINISHED"
    assert {m["state"] for m in jobs["moves"]["members"]} == {"LEFT"}
    assert jobs["moves"]["generation"] == 1
