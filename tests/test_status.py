"""``sar-coordinator status`` against a live coordinator: a running, a finished and a failed job.

The members are driven with the generated stub (join, one heartbeat with progress, leave), so
the table's every column has a known value; the command runs as its own process, as users run it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO_PB as LO

HEADER = ["RANK", "HOST", "INTERFACE", "ADDRESS", "STATE", "EXIT", "HEARTBEAT", "LAST COLLECTIVE"]


@pytest.fixture
def coord(start_coordinator: StartCoordinator) -> CoordinatorProcess:
    # Members here heartbeat once and then stay silent: a long liveness keeps a running job running.
    return start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")


@pytest.fixture
async def stub(coord: CoordinatorProcess) -> AsyncIterator[pb_grpc.CoordinatorAsyncStub]:
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        yield pb_grpc.CoordinatorStub(channel)


async def form(stub: pb_grpc.CoordinatorAsyncStub, job: str) -> list[pb.Assignment]:
    """A world of 2: host a gets rank 0, host b rank 1; returns their assignments by rank."""
    requests = [
        pb.JoinRequest(job=job, world_size=2, host=host, interfaces=[LO], store_port=29500 + i,
                       members=[pb.MemberSpec(rank=i, local_rank=0)])
        for i, host in enumerate(("a", "b"))
    ]  # fmt: skip
    responses = await asyncio.gather(*(stub.Join(r, timeout=10) for r in requests))
    return [r.assignments[0] for r in responses]


async def heartbeat(stub: pb_grpc.CoordinatorAsyncStub, reports: list[pb.MemberReport]) -> None:
    call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=reports)]), timeout=5)
    # Read to the end: the request iterator's end half-closes the stream, an orderly end. (A
    # cancelled stream reads as a dead reporter, whose members the coordinator then fails.)
    async for _ in call:
        pass


async def leave(stub: pb_grpc.CoordinatorAsyncStub, member: pb.Assignment, code: int) -> None:
    request = pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=code)
    await stub.Leave(request, timeout=5)


def status(coord: CoordinatorProcess, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "sarcomm.coordinator.cli", "status", "--coord", coord.grpc_target, *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def table(text: str, job: str) -> tuple[str, list[str], list[list[str]]]:
    """The job's header line, its other lines before the table, and the rows split on runs of 2+
    spaces (cells hold single spaces, e.g. "0.2s ago")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"job {job} "))
    block = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("job "):
            break
        block.append(line.strip())
    at = next(i for i, line in enumerate(block) if line.startswith("RANK"))
    rows = [re.split(r" {2,}", line) for line in block[at:]]
    return lines[start], block[:at], rows


async def test_status_of_a_running_job_shows_members_heartbeats_and_each_ranks_collective(
    stub: pb_grpc.CoordinatorAsyncStub, coord: CoordinatorProcess
) -> None:
    a, b = await form(stub, "live")
    since = time.time() - 2.0
    await heartbeat(
        stub,
        [
            pb.MemberReport(member_id=a.member_id, secret=a.secret,
                            progress=pb.Progress(seq=7, op="all_to_all", in_collective=True, since=since)),
            pb.MemberReport(member_id=b.member_id, secret=b.secret,
                            progress=pb.Progress(seq=6, op="all_reduce", in_collective=False, since=since)),
        ],
    )  # fmt: skip
    header, notes, rows = table(status(coord), "live")
    assert header == "job live  generation 1  RUNNING  world_size 2  master 127.0.0.1:29500  restarts 0"
    assert notes == []
    assert rows[0] == HEADER
    by_rank = {row[0]: row for row in rows[1:]}
    assert sorted(by_rank) == ["0", "1"]
    assert by_rank["0"][1:6] == ["a", "lo", "127.0.0.1", "RUNNING", "-"]
    assert by_rank["1"][1:6] == ["b", "lo", "127.0.0.1", "RUNNING", "-"]
    for rank in ("0", "1"):
        assert re.fullmatch(r"\d+\.\ds ago", by_rank[rank][6]), by_rank[rank]
    # Rank 0 is inside collective #7 (entered about 2 s ago); rank 1 finished #6.
    assert re.fullmatch(r"#7 all_to_all \(in, [2-9]\.\ds ago\)", by_rank["0"][7]), by_rank["0"]
    assert re.fullmatch(r"#6 all_reduce \(after, [2-9]\.\ds ago\)", by_rank["1"][7]), by_rank["1"]


async def test_status_of_a_finished_job_shows_every_member_left_with_code_0(
    stub: pb_grpc.CoordinatorAsyncStub, coord: CoordinatorProcess
) -> None:
    members = await form(stub, "done")
    for member in members:
        await leave(stub, member, 0)
    header, notes, rows = table(status(coord, "--job", "done"), "done")
    assert header.startswith("job done  generation 1  FINISHED  world_size 2  master 127.0.0.1:29500")
    assert notes == []
    for row in rows[1:]:
        # Left cleanly; no heartbeat and no collective was ever reported.
        assert row[4:] == ["LEFT", "0", "-", "-"], row


async def test_status_of_a_failed_job_names_the_failed_rank_and_a_rerun_counts_as_a_restart(
    stub: pb_grpc.CoordinatorAsyncStub, coord: CoordinatorProcess
) -> None:
    _, b = await form(stub, "broken")
    await leave(stub, b, 3)
    text = status(coord, "--job", "broken")
    header, notes, rows = table(text, "broken")
    assert header.startswith("job broken  generation 1  FAILED  world_size 2")
    assert notes == ["reason: rank 1 on host b failed: exited with code 3"]
    by_rank = {row[0]: row for row in rows[1:]}
    assert by_rank["1"][4:6] == ["FAILED (exited with code 3)", "3"]
    assert by_rank["0"][4:6] == ["RUNNING", "-"]  # not told yet: its agent would stop it now
    # --json holds the same, machine-readable.
    document = json.loads(status(coord, "--job", "broken", "--json"))
    (job,) = document["jobs"]
    assert (job["state"], job["reason"]) == ("FAILED", "rank 1 on host b failed: exited with code 3")
    assert [(m["rank"], m["state"], m["exit_code"]) for m in job["members"]] == [
        (0, "RUNNING", 0),
        (1, "FAILED", 3),
    ]
    # The same job formed again after its failure is a restart.
    await form(stub, "broken")
    header, _, rows = table(status(coord, "--job", "broken"), "broken")
    assert header.startswith("job broken  generation 2  RUNNING  world_size 2")
    assert header.endswith("restarts 1")
    assert {row[4] for row in rows[1:]} == {"RUNNING"}
    metrics = coord.get_text("/metrics")
    assert "sar_coordinator_restarts_total 1.0" in metrics


async def test_status_with_no_jobs_and_an_unknown_job_says_so(coord: CoordinatorProcess) -> None:
    assert status(coord).strip() == "no jobs"
    assert status(coord, "--job", "nosuch").strip() == "no jobs"


async def big_job(stub: pb_grpc.CoordinatorAsyncStub, name: str, size: int) -> list[pb.Assignment]:
    """A world of ``size`` members formed by one Join (host big); its assignments by rank."""
    request = pb.JoinRequest(
        job=name, world_size=size, host="big", interfaces=[LO], store_port=29500,
        members=[pb.MemberSpec(local_rank=k) for k in range(size)],
    )  # fmt: skip
    response = await stub.Join(request, timeout=20)
    return sorted(response.assignments, key=lambda a: a.rank)


async def test_status_of_a_big_job_counts_its_members_and_lists_only_the_failed_and_those_asked_for(
    stub: pb_grpc.CoordinatorAsyncStub, coord: CoordinatorProcess
) -> None:
    members = await big_job(stub, "huge", 100)
    await leave(stub, members[7], 3)
    header, notes, rows = table(status(coord, "--job", "huge"), "huge")
    assert header.startswith("job huge  generation 1  FAILED  world_size 100")
    assert notes == [
        "reason: rank 7 on host big failed: exited with code 3",
        "members: 99 RUNNING, 1 FAILED; 1 of 100 listed (the failed ones and the ranks others wait for; "
        "--all lists every member, --members 0-15,100 the ranks given)",
    ]
    assert [row[:6] for row in rows[1:]] == [
        ["7", "big", "lo", "127.0.0.1", "FAILED (exited with code 3)", "3"]
    ]
    # The rest on request: some ranks, or every one of them (a page of members per call).
    _, _, rows = table(status(coord, "--job", "huge", "--members", "0-2,99"), "huge")
    assert [row[0] for row in rows[1:]] == ["0", "1", "2", "99"]
    _, notes, rows = table(status(coord, "--job", "huge", "--all"), "huge")
    assert [row[0] for row in rows[1:]] == [str(r) for r in range(100)]
    assert notes == ["reason: rank 7 on host big failed: exited with code 3"]
    document = json.loads(status(coord, "--job", "huge", "--json"))
    (job,) = document["jobs"]
    assert job["member_counts"] == {"RUNNING": 99, "FAILED": 1}
    assert [m["rank"] for m in job["members"]] == [7]


async def test_list_jobs_pages_members_in_rank_order_and_filters_them_by_state(
    stub: pb_grpc.CoordinatorAsyncStub, coord: CoordinatorProcess
) -> None:
    members = await big_job(stub, "paged", 10)
    await leave(stub, members[4], 0)

    async def ranks(**selection: object) -> list[int]:
        (job,) = (await stub.ListJobs(pb.ListJobsRequest(job="paged", **selection), timeout=5)).jobs  # type: ignore[arg-type]
        assert dict(job.member_counts) == {"RUNNING": 9, "LEFT": 1}
        return [m.rank for m in job.members]

    assert await ranks() == list(range(10))
    assert await ranks(member_limit=3, member_offset=8) == [8, 9]
    assert await ranks(member_states=["LEFT"]) == [4]
    assert await ranks(member_states=["RUNNING"], member_limit=2, member_offset=3) == [3, 5]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ListJobs(pb.ListJobsRequest(member_states=["GONE"]), timeout=5)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "member_states[0] 'GONE' must be one of JOINING, RUNNING, LEFT, FAILED"
