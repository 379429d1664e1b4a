"""Failover without etcd: the leader is SIGKILLed and a second ``sar-coordinator`` on the same
SQLite ``--state`` starts on the other address of the list, restoring the jobs and giving members
``--reconnect-grace``. Heartbeat and watch streams re-attach within the grace, and a ``sar-worker``
job runs on through the move and finishes, with nobody failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event, HeartbeatReply, MemberReport
from tests.conftest import CoordinatorProcess
from tests.failover_job import DEADLINE_S, agent_job
from tests.helpers import LO, free_port, stays_false, stays_false_async, wait_for, wait_for_async

# The grace a restored member gets to re-attach (the coordinator's --reconnect-grace here), and
# the liveness rule: a member judged after 0.5 s x 3 of silence once the grace is over.
GRACE_S = 4.0
LIVENESS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "3", "--reconnect-grace", str(GRACE_S))


# -- heartbeat and watch streams across a failover -------------------------------------------------


@pytest.fixture
def moving(tmp_path: Path, real_processes: None) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
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
