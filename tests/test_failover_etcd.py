"""The failing-over client against real replicas: ``sar-coordinator --store etcd://...`` twice on
a real three-member etcd cluster (tests/etcd_cluster.py), one leading, one standing by.

What tests/test_failover.py checks with a stand-in standby and a coordinator moved by hand, here
with the real thing: joins through the standby's hint, heartbeat and watch streams re-attaching
to the new leader when the leader is SIGKILLed or hangs (SIGSTOP: its lease runs out, its
connection stays up), no member failed, a Join waiting at the dying leader resent to the new
one (the world forms once), ``status`` with both addresses, and a ``sar-worker`` job
running through a take-over to FINISHED with correct values, and ``coord_ip_init`` given the list.
Skipped, saying so, only without the
etcd binary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event, MemberReport
from tests.conftest import CoordinatorProcess
from tests.etcd_cluster import EtcdCluster
from tests.failover_job import AGENT_DEADLINE_S, agent_job, answering
from tests.helpers import LO, free_port, stays_false, stays_false_async, wait_for, wait_for_async

#: The leader's lease: a standby takes over within this after the leader stops renewing it.
TTL_S = 2
GRACE_S = 5.0
#: How long two fresh coordinators may take to elect one and have the other name it (generous: the
#: two cores here are shared, and etcd's first elections are slow under load).
ELECTION_S = 30.0
LIVENESS_S = 0.5 * 3
DEADLINE_S = 20.0
_FAILED = ("missed heartbeats", "connection lost")


@pytest.fixture
def replicas(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
    """(leader, standby): two coordinators on one etcd prefix, once one leads and the other
    names it."""
    coords = [
        CoordinatorProcess(
            grpc_port=free_port(), http_port=free_port(), state_path=None,
            args=["--store", etcd_cluster.url("clients"), "--leader-ttl", str(TTL_S),
                  "--heartbeat-interval", "0.5", "--heartbeat-misses", "3",
                  "--reconnect-grace", str(GRACE_S), "--shutdown-grace", "1", "--join-timeout", "60"],
            log_path=tmp_path / f"coordinator{i}.log",
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        for coord in coords:
            coord.start()
        leading = wait_for(
            lambda: [c for c in coords if _role(c) == "leader"] or None,
            ELECTION_S,
            what="one coordinator to lead",
        )
        leader = leading[0]
        standby = next(c for c in coords if c is not leader)
        wait_for(
            lambda: _named_leader(standby) == leader.grpc_target,
            ELECTION_S,
            what="the standby to know the leader",
        )
        yield leader, standby
    finally:
        for coord in coords:
            if coord.proc is not None:
                coord.proc.send_signal(signal.SIGCONT)
                coord.stop()


def _role(coord: CoordinatorProcess) -> str:
    try:
        return str(dict(coord.get_json("/healthz"))["role"])  # type: ignore[call-overload]
    except OSError:
        return "down"


def _named_leader(coord: CoordinatorProcess) -> str:
    """The leader ``coord``'s /healthz names ("" when it cannot be asked now)."""
    try:
        return str(dict(coord.get_json("/healthz")).get("leader", ""))  # type: ignore[call-overload]
    except OSError:
        return ""


def _failed_anyone(coord: CoordinatorProcess) -> bool:
    return any(text in coord.log() for text in _FAILED)


async def test_a_client_given_the_standby_first_joins_at_the_leader_through_its_hint(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], caplog: pytest.LogCaptureFixture
) -> None:
    leader, standby = replicas
    caplog.set_level(logging.WARNING, logger="sarcomm.common.client.replicas")
    async with CoordinatorClient(f"{standby.grpc_target},{leader.grpc_target}", timeout=10.0) as client:
        member = await asyncio.wait_for(client.join("etcd-hint", 1, host="h", interfaces=[LO]), DEADLINE_S)
        assert client.target == leader.grpc_target
        assert (
            await asyncio.wait_for(client.leave(member.member_id, member.secret, 0), DEADLINE_S) == "FINISHED"
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "sarcomm.common.client.replicas"]
    assert lines == [f"following the leader at {leader.grpc_target} ({standby.grpc_target} is a standby)"]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_heartbeats_and_watch_follow_the_new_leader_and_no_member_fails(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], how: str
) -> None:
    leader, standby = replicas
    answered_by: list[str] = []
    events: list[Event] = []
    async with CoordinatorClient(f"{leader.grpc_target},{standby.grpc_target}", timeout=10.0) as client:
        joined = await asyncio.wait_for(
            client.join_many("etcd-moves", 2, nproc=2, host="h", interfaces=[LO]), DEADLINE_S
        )

        def reports() -> list[MemberReport]:
            return [MemberReport(m.member_id, m.secret) for m in joined.assignments]

        async def watch() -> None:
            async for event in client.watch("etcd-moves"):
                events.append(event)
                if event.kind is EventKind.JOB_FINISHED:
                    return

        watcher = asyncio.ensure_future(watch())
        async with client.heartbeats(reports, 0.25) as stream:

            async def read() -> None:
                async for reply in stream:
                    assert not reply.unknown_members, reply
                    answered_by.append(client.target)

            reader = asyncio.ensure_future(read())
            await wait_for_async(
                lambda: answered_by and events, DEADLINE_S, what="a heartbeat answer and an event"
            )
            assert leader.proc is not None
            leader.proc.send_signal(getattr(signal, how))
            struck = time.monotonic()
            await wait_for_async(
                lambda: standby.grpc_target in answered_by,
                TTL_S + GRACE_S,
                what=lambda: f"heartbeats answered by the new leader; its log:\n{standby.log()}",
                interval=0.02,
            )
            reattached = time.monotonic() - struck
            logging.getLogger(__name__).warning(
                "%s of the leader: heartbeats re-attached to the new leader after %.2f s (TTL %d s)",
                how, reattached, TTL_S,
            )  # fmt: skip
            # Through the grace and a whole liveness window after it, nobody is failed.
            await stays_false_async(
                lambda: _failed_anyone(standby),
                GRACE_S + LIVENESS_S + 1.0,
                what="the new leader failing a member",
            )
            jobs = await client.list_jobs("etcd-moves")
            assert [(j.state, [m.state for m in j.members]) for j in jobs] == [("RUNNING", ["RUNNING"] * 2)]
            reader.cancel()
        for m in joined.assignments:
            await asyncio.wait_for(client.leave(m.member_id, m.secret, 0), DEADLINE_S)
        await asyncio.wait_for(watcher, DEADLINE_S)
    # A SIGKILL breaks the stream at once; a hung leader is left once its reports go unanswered
    # (heartbeats.SILENT_MIN_S) and the standby leads (the TTL): both within the grace.
    assert reattached < (TTL_S + 2.0 if how == "SIGKILL" else GRACE_S), reattached
    assert [e.kind for e in events] == [EventKind.WORLD_FORMED, EventKind.JOB_FINISHED]


async def test_status_with_both_addresses_names_the_leader_and_the_standby(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess],
) -> None:
    leader, standby = replicas
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sarcomm.coordinator.cli", "status", "--json",
        "--coord", f"{standby.grpc_target},{leader.grpc_target}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    view = json.loads(out)
    assert view["coordinators"] == [
        {"address": standby.grpc_target, "role": "standby", "reason": ""},
        {"address": leader.grpc_target, "role": "leader", "reason": ""},
    ]


def test_a_sar_worker_job_runs_through_a_take_over_and_finishes(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], tmp_path: Path
) -> None:
    leader, standby = replicas
    with agent_job(f"{leader.grpc_target},{standby.grpc_target}", "etcd-agent", tmp_path) as running:
        leader.kill()
        wait_for(
            lambda: f"following the leader at {standby.grpc_target}" in running.log_text(),
            TTL_S + GRACE_S,
            what=lambda: f"the agent following the new leader; agent:\n{running.log_text()}",
        )
        stays_false(
            lambda: running.agent.poll() is not None or _failed_anyone(standby),
            GRACE_S + LIVENESS_S + 1.0,
            what=lambda: f"the agent exiting or the new leader failing a member:\n{standby.log()}",
        )
        running.finish()
    running.check_ranks()
    job = {j["job"]: j for j in standby.get_json("/v1/jobs")["jobs"]}["etcd-agent"]  # type: ignore[index]
    assert (job["state"], job["generation"]) == ("FINISHED", 1)
    assert {m["state"] for m in job["members"]} == {"LEFT"}


def test_coord_ip_init_with_the_list_registers_at_the_leader_and_exports_the_whole_list(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess], tmp_path: Path
) -> None:
    leader, standby = replicas
    coord = f"{standby.grpc_target},{leader.grpc_target}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    env["SARCOMM_HEARTBEAT_INTERVAL"] = "0.25"
    script = str(Path(__file__).parent / "scripts" / "sar_startup_rank.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "train", str(rank), "2", coord, "etcd-sar", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=AGENT_DEADLINE_S)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{outputs[rank]}"
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["rank"], seen["world_size"]) == (rank, 2)
        assert seen["env"]["SAR_COORD"] == coord
        assert seen["params"] == [[1.0] * 6, [1.0] * 2]  # rank 0's parameters everywhere
        assert seen["grads"] == [[3.0] * 6, [3.0] * 2]  # 1 + 2
    job = {j["job"]: j for j in leader.get_json("/v1/jobs")["jobs"]}["etcd-sar"]  # type: ignore[index]
    assert job["state"] == "FINISHED"
    assert {m["state"] for m in job["members"]} == {"LEFT"}


async def test_a_join_waiting_when_the_leader_dies_is_resent_to_the_new_one_and_the_world_forms_once(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess],
) -> None:
    leader, standby = replicas
    targets = f"{leader.grpc_target},{standby.grpc_target}"
    async with (
        CoordinatorClient(targets, timeout=10.0) as first,
        CoordinatorClient(targets, timeout=10.0) as second,
    ):
        waiting = asyncio.ensure_future(first.join("etcd-forming", 2, host="a", interfaces=[LO]))
        await wait_for_async(
            lambda: _members(leader, "etcd-forming") == 1, DEADLINE_S, what="the first member to be joined"
        )
        assert leader.proc is not None
        leader.proc.kill()
        leader.proc.wait(10)
        # The Join in flight goes on at the new leader (same join_id: the same member).
        other = await asyncio.wait_for(second.join("etcd-forming", 2, host="b", interfaces=[LO]), DEADLINE_S)
        mine = await asyncio.wait_for(waiting, DEADLINE_S)
    assert (mine.generation, other.generation) == (1, 1)
    assert sorted([mine.rank, other.rank]) == [0, 1]
    assert mine.member_id != other.member_id
    job = {j["job"]: j for j in standby.get_json("/v1/jobs")["jobs"]}["etcd-forming"]  # type: ignore[index]
    assert (job["state"], job["generation"], len(job["members"])) == ("RUNNING", 1, 2)


def _members(coord: CoordinatorProcess, job: str) -> int:
    try:
        jobs = {j["job"]: j for j in coord.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    except OSError:
        return 0
    return len(jobs[job]["members"]) if job in jobs else 0


async def test_a_join_waiting_at_a_hung_leader_goes_to_the_new_one_once_the_heartbeats_do(
    replicas: tuple[CoordinatorProcess, CoordinatorProcess],
) -> None:
    # SIGSTOP: the leader's connection stays up, so the waiting Join hears nothing; the same
    # client's heartbeat stream finds its reports unanswered, follows the new leader, and the Join
    # goes there too (without that, only keepalive would end it, ~20 s later).
    leader, standby = replicas
    targets = f"{leader.grpc_target},{standby.grpc_target}"
    # The second member's client is new and lists the standby first: a client that first meets a
    # stopped leader gets a connection from its kernel and waits on it until keepalive gives up
    # (15 s + 5 s); only a client that saw it answer before can tell that it stopped.
    async with (
        CoordinatorClient(targets, timeout=10.0) as client,
        CoordinatorClient(f"{standby.grpc_target},{leader.grpc_target}", timeout=10.0) as other,
    ):
        running = await asyncio.wait_for(
            client.join("etcd-running", 1, host="a", interfaces=[LO]), DEADLINE_S
        )
        async with answering(client, running) as answers:
            waiting = asyncio.ensure_future(client.join("etcd-hung", 2, host="a", interfaces=[LO]))
            await wait_for_async(
                lambda: _members(leader, "etcd-hung") == 1, DEADLINE_S, what="the Join to wait"
            )
            assert leader.proc is not None
            leader.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await wait_for_async(
                lambda: standby.grpc_target in answers, TTL_S + GRACE_S, what="heartbeats moved"
            )
            second = await asyncio.wait_for(other.join("etcd-hung", 2, host="b", interfaces=[LO]), DEADLINE_S)
            first = await asyncio.wait_for(waiting, 5.0)
            formed = time.monotonic() - stopped
    assert formed < TTL_S + GRACE_S, formed
    assert (first.generation, second.generation) == (1, 1)
    assert sorted([first.rank, second.rank]) == [0, 1]
