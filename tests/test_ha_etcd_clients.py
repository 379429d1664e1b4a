"""Clients and SAR-style ranks following a real take-over: ``sar-coordinator --store etcd://...``
twice under one prefix of the module's three-member etcd cluster (tests/etcd_cluster.py), one
leading, one standing by.

Heartbeat and watch streams re-attach to the new leader when the leader is SIGKILLed or hangs
(SIGSTOP: its lease runs out, its connection stays up) and no member is failed; a Join waiting at a
hung leader goes to the new one once the heartbeats do (the world forms once); ``coord_ip_init``
given the list registers through the standby's hint and hands the ranks the whole list.

Elsewhere: the client's side with a stand-in standby (tests/test_failover_client.py), the election
and take-over themselves (tests/test_ha_etcd.py), ``sar-worker`` agents and gloo ranks through a
take-over, a Join resent included (tests/test_ha_etcd_e2e.py).
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
from tests.etcd_replicas import named_leader, role
from tests.failover_job import AGENT_DEADLINE_S, DEADLINE_S, answering
from tests.helpers import LO, free_port, stays_false_async, wait_for, wait_for_async

#: The leader's lease: a standby takes over within this after the leader stops renewing it.
TTL_S = 2
GRACE_S = 5.0
#: How long two fresh coordinators may take to elect one and have the other name it (generous: the
#: two cores here are shared, and etcd's first elections are slow under load).
ELECTION_S = 30.0
LIVENESS_S = 0.5 * 3
_FAILED = ("missed heartbeats", "connection lost")


@pytest.fixture
def replicas(
    module_etcd_cluster: EtcdCluster, etcd_prefix: str, tmp_path: Path
) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
    """(leader, standby): two coordinators on one etcd prefix, once one leads and the other
    names it."""
    coords = [
        CoordinatorProcess(
            grpc_port=free_port(), http_port=free_port(), state_path=None,
            args=["--store", module_etcd_cluster.url(etcd_prefix), "--leader-ttl", str(TTL_S),
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
            lambda: [c for c in coords if role(c) == "leader"] or None,
            ELECTION_S,
            what="one coordinator to lead",
        )
        leader = leading[0]
        standby = next(c for c in coords if c is not leader)
        wait_for(
            lambda: named_leader(standby) == leader.grpc_target,
            ELECTION_S,
            what="the standby to know the leader",
        )
        yield leader, standby
    finally:
        for coord in coords:
            if coord.proc is not None:
                coord.proc.send_signal(signal.SIGCONT)
                coord.stop()


def _failed_anyone(coord: CoordinatorProcess) -> bool:
    return any(text in coord.log() for text in _FAILED)


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
