"""Workers that are not members (torchrun's, under ``--rdzv-backend=sarcomm``) in ``/sd``: the
member's reports carry their endpoints (``MemberReport.worker_endpoints``), the coordinator checks,
keeps and persists them, and ``/sd`` lists one target per worker, labelled with the worker's rank.

In process: a real coordinator on port 0 (gRPC and HTTP) with a fake clock, the generated stub
on one Heartbeat stream (so that the stream's short way for repeated reports is exercised too), a
real SQLite state file; the notes a worker leaves for its agent, and the port it serves on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import MemberReport, WorkerEndpoint
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.storage.records import (
    JobEncoder,
    job_record,
    load_state,
    member_from_record,
    member_record,
    write_at_once,
)
from sarcomm.coordinator.storage.store import SqliteStore
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from sarcomm.worker.endpoints import (
    MAX_NOTES,
    EndpointNote,
    NoteReader,
    clear_notes,
    note_endpoint,
    read_notes,
)
from sarcomm.worker.launch_env import node_worker_metrics_port
from tests.coordinator_fixture import InProcessCoordinator, in_process_coordinator
from tests.helpers import LO_PB, FakeClock, spec

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")

WAIT_S = 10.0


class Stream:
    """One Heartbeat stream of the generated stub: each :meth:`send` waits for its answer."""

    def __init__(self, stub: pb_grpc.CoordinatorAsyncStub) -> None:
        self._outgoing: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()
        self.call = stub.Heartbeat(self._requests(), timeout=60)

    async def _requests(self) -> AsyncIterator[pb.HeartbeatRequest]:
        while (item := await self._outgoing.get()) is not None:
            yield item

    async def send(self, *reports: pb.MemberReport) -> pb.HeartbeatResponse:
        self._outgoing.put_nowait(pb.HeartbeatRequest(reports=list(reports)))
        answer = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert isinstance(answer, pb.HeartbeatResponse), answer
        return answer

    async def close(self) -> None:
        self._outgoing.put_nowait(pb.HeartbeatRequest(closing=True))
        self._outgoing.put_nowait(None)
        # Read to the end (an answer to the closing request, then the stream's end).
        while isinstance(await asyncio.wait_for(self.call.read(), WAIT_S), pb.HeartbeatResponse):
            pass


def endpoints(*entries: tuple[int, int, str]) -> pb.WorkerEndpoints:
    return pb.WorkerEndpoints(
        endpoints=[pb.WorkerEndpoint(rank=r, local_rank=lr, metrics_address=a) for r, lr, a in entries]
    )


async def sd(coord: InProcessCoordinator, job: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{coord.coordinator.http_port}/sd"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        groups: list[dict[str, Any]] = await response.json()
    return [g for g in groups if g["labels"]["job"] == job]


async def form_nodes(stub: pb_grpc.CoordinatorAsyncStub, job: str) -> list[pb.Assignment]:
    """Two torchrun-like nodes (hosts a and b, one member each) in one world."""

    def join(host: str) -> Any:
        request = pb.JoinRequest(
            job=job, world_size=2, host=host, interfaces=[LO_PB], store_port=29500, members=[pb.MemberSpec()]
        )
        return stub.Join(request, timeout=WAIT_S)

    answers = await asyncio.gather(join("a"), join("b"))
    return sorted((a.assignments[0] for a in answers), key=lambda m: m.rank)


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(FakeClock(), state=tmp_path / "state.sqlite") as coordinator:
        yield coordinator


@pytest.fixture
async def stub(coord: InProcessCoordinator) -> AsyncIterator[pb_grpc.CoordinatorAsyncStub]:
    async with grpc.aio.insecure_channel(coord.target) as channel:
        yield pb_grpc.CoordinatorStub(channel)


async def test_sd_lists_one_group_per_worker_endpoint_with_its_rank_and_node(
    coord: InProcessCoordinator, stub: pb_grpc.CoordinatorAsyncStub
) -> None:
    node0, node1 = await form_nodes(stub, "tr")
    stream = Stream(stub)
    beat0 = pb.MemberReport(
        member_id=node0.member_id,
        secret=node0.secret,
        worker_endpoints=endpoints((0, 0, "0.0.0.0:9100"), (1, 1, "127.0.0.1:9101")),
    )
    beat1 = pb.MemberReport(
        member_id=node1.member_id, secret=node1.secret, worker_endpoints=endpoints((2, 0, "0.0.0.0:9200"))
    )
    await stream.send(beat0, beat1)
    groups = sorted(await sd(coord, "tr"), key=lambda g: int(g["labels"]["rank"]))
    # A wildcard listener is listed at the node's address; the node itself serves no /metrics.
    assert [g["targets"] for g in groups] == [["127.0.0.1:9100"], ["127.0.0.1:9101"], ["127.0.0.1:9200"]]
    host0, host1 = coord.member("tr", 0).host, coord.member("tr", 1).host
    assert {host0, host1} == {"a", "b"}
    assert [g["labels"] for g in groups] == [
        {"job": "tr", "rank": "0", "host": host0, "generation": "1", "node_rank": "0", "local_rank": "0"},
        {"job": "tr", "rank": "1", "host": host0, "generation": "1", "node_rank": "0", "local_rank": "1"},
        {"job": "tr", "rank": "2", "host": host1, "generation": "1", "node_rank": "1", "local_rank": "0"},
    ]

    # The same reports again take the stream's short way, and so do reports without the list
    # (unchanged); a changed list replaces the old one (node 0's worker 1 gone, worker 3 new) and
    # an empty one clears node 1's.
    await stream.send(beat0, beat1)
    await stream.send(
        pb.MemberReport(member_id=node0.member_id, secret=node0.secret),
        pb.MemberReport(member_id=node1.member_id, secret=node1.secret),
    )
    assert len(await sd(coord, "tr")) == 3
    del beat0.worker_endpoints.endpoints[1]
    beat0.worker_endpoints.endpoints.extend(endpoints((3, 1, "0.0.0.0:9103")).endpoints)
    del beat1.worker_endpoints.endpoints[:]
    await stream.send(beat0, beat1)
    groups = await sd(coord, "tr")
    assert sorted(g["labels"]["rank"] for g in groups) == ["0", "3"]
    member = coord.member("tr", 0)
    assert member.worker_endpoints == (
        WorkerEndpoint(0, 0, "0.0.0.0:9100"),
        WorkerEndpoint(3, 1, "0.0.0.0:9103"),
    )

    # A node that leaves takes its workers' targets with it.
    await stub.Leave(
        pb.LeaveRequest(member_id=node0.member_id, secret=node0.secret, exit_code=0), timeout=WAIT_S
    )
    assert await sd(coord, "tr") == []
    await stream.close()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            ((0, 0, "10.9.9.9:9100"),),
            "{field}[0].metrics_address '10.9.9.9:9100' must be on an address of the member's own host "
            "'{host}' (it reported 127.0.0.1), or on 0.0.0.0",
        ),
        (
            ((0, 0, "0.0.0.0:9100"), (0, 1, "0.0.0.0:9101")),
            "{field}[1].rank 0 must be a worker's global rank: >= 0 and distinct",
        ),
        (((-1, 0, "0.0.0.0:9100"),), "{field}[0].rank -1 must be a worker's global rank"),
        (((0, 0, "localhost:9100"),), "{field}[0].metrics_address 'localhost:9100' must be IP:PORT"),
        (((0, 0, ""),), "{field}[0].metrics_address '' must be IP:PORT of the worker's"),
    ],
    ids=["not-its-host", "same-rank-twice", "negative-rank", "host-name", "empty"],
)
async def test_bad_worker_endpoint_costs_that_endpoint_not_the_node(
    coord: InProcessCoordinator,
    stub: pb_grpc.CoordinatorAsyncStub,
    entries: tuple[tuple[int, int, str], ...],
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bad entry is dropped and told once (the answer's ``refused``, the coordinator's log);
    the node's report is taken, its good workers listed, and the node stays in its world."""
    node0, node1 = await form_nodes(stub, "bad")
    good = (7, 5, "0.0.0.0:9107")
    report = pb.MemberReport(
        member_id=node0.member_id, secret=node0.secret, worker_endpoints=endpoints(*entries, good)
    )
    other = pb.MemberReport(member_id=node1.member_id, secret=node1.secret)
    stream = Stream(stub)
    answer = await stream.send(report, other)
    expected = message.format(field="reports[0].worker_endpoints.endpoints", host=coord.member("bad", 0).host)
    assert len(answer.refused) == 1, answer.refused
    assert answer.refused[0].startswith(expected), answer.refused
    assert not answer.unknown_members
    kept = ["0", "7"] if len(entries) == 2 else ["7"]  # the first of two rank 0s stays
    assert sorted(g["labels"]["rank"] for g in await sd(coord, "bad")) == kept
    logged = [r.getMessage() for r in caplog.records if expected in r.getMessage()]
    assert len(logged) == 1, logged
    assert "dropped from its heartbeat, the rest was taken" in logged[0]
    # Sent again (every interval): not told again, still taken; both nodes run on.
    for _ in range(3):
        answer = await stream.send(report, other)
        assert list(answer.refused) == []
        assert not answer.unknown_members
    assert len([r for r in caplog.records if expected in r.getMessage()]) == 1
    coord.sweep()
    assert [coord.member("bad", r).state.name for r in (0, 1)] == ["RUNNING", "RUNNING"]
    await stream.close()


async def test_the_agents_stream_logs_a_refused_endpoint_once_and_keeps_beating(
    coord: InProcessCoordinator, stub: pb_grpc.CoordinatorAsyncStub, caplog: pytest.LogCaptureFixture
) -> None:
    """The client side of the same: what a torchrun agent's heartbeat stream does with ``refused``."""
    node0, _ = await form_nodes(stub, "agent")
    listed = (WorkerEndpoint(0, 0, "10.9.9.9:9100"), WorkerEndpoint(1, 1, "0.0.0.0:9101"))
    report = MemberReport(node0.member_id, node0.secret, worker_endpoints=listed)
    async with coord.client() as client, client.heartbeats(lambda: [report], 0.05) as stream:
        replies = [await asyncio.wait_for(anext(stream), WAIT_S) for _ in range(3)]
    assert [len(r.refused) for r in replies] == [1, 0, 0]
    assert replies[0].refused[0].startswith("reports[0].worker_endpoints.endpoints[0].metrics_address '10.9")
    assert all(not r.unknown_members for r in replies)
    warned = [r.getMessage() for r in caplog.records if "dropped from a heartbeat" in r.getMessage()]
    assert len(warned) == 1, warned
    assert [g["labels"]["rank"] for g in await sd(coord, "agent")] == ["1"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("metrics_address", "10.9.9.9:9100", "reports[0].metrics_address '10.9.9.9:9100' must be on an"),
        ("metrics_address", "nowhere", "reports[0].metrics_address 'nowhere' must be IP:PORT"),
        ("progress", pb.Progress(seq=-1), "reports[0].progress.seq -1 must be >= 0"),
    ],
    ids=["endpoint-not-its-host", "endpoint-not-ip-port", "progress"],
)
async def test_bad_monitoring_field_of_a_report_costs_only_itself(
    coord: InProcessCoordinator, stub: pb_grpc.CoordinatorAsyncStub, field: str, value: Any, message: str
) -> None:
    """The same root as the workers' endpoints: a member's own metrics endpoint and its progress
    are monitoring too."""
    node0, _ = await form_nodes(stub, "mon")
    report = pb.MemberReport(member_id=node0.member_id, secret=node0.secret)
    if field == "progress":
        report.progress.CopyFrom(value)
    else:
        report.metrics_address = value
    stream = Stream(stub)
    answer = await stream.send(report)
    assert len(answer.refused) == 1, answer.refused
    assert answer.refused[0].startswith(message), answer.refused
    assert not answer.unknown_members
    member = coord.member("mon", 0)
    assert member.metrics_address == ""
    assert member.last_report > 0
    await stream.close()


def test_worker_endpoints_survive_a_restart_of_the_coordinator(tmp_path: Path) -> None:
    """Persisted with the member (SQLite here; etcd keeps the same record): a restarted coordinator
    or a new leader lists them again. The record's text is still exactly the encoder's."""
    store = SqliteStore(tmp_path / "state.sqlite")
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock, persist=write_at_once(store))
    tickets = [membership.join(spec(h, None, job="p", world_size=2)) for h in ("a", "b")]
    job = tickets[0].job
    member, secret = tickets[0].members[0], tickets[0].secrets[0]
    listed = (WorkerEndpoint(0, 0, "0.0.0.0:9100"), WorkerEndpoint(1, 1, "127.0.0.1:9101"))
    membership.heartbeat(member.member_id, secret, None, "", worker_endpoints=listed)
    assert JobEncoder().encode(job).record_json == json.dumps(job_record(job))

    restored = load_state(store)
    again = next(m for j in restored.jobs for m in j.members if m.member_id == member.member_id)
    assert again.worker_endpoints == listed
    others = [m for j in restored.jobs for m in j.members if m.member_id != member.member_id]
    assert [m.worker_endpoints for m in others] == [()]
    # A record written before the field existed reads as none.
    old = member_record(again)
    del old["worker_endpoints"]
    assert member_from_record(old).worker_endpoints == ()
    store.close()


def test_member_report_carries_worker_endpoints_on_the_wire_present_even_when_empty() -> None:
    report = MemberReport("m", "s", worker_endpoints=(WorkerEndpoint(5, 1, "10.0.0.2:9101"),))
    sent = report.to_proto()
    wire = [(e.rank, e.local_rank, e.metrics_address) for e in sent.worker_endpoints.endpoints]
    assert wire == [(5, 1, "10.0.0.2:9101")]
    # An empty list is sent ("none yet", which clears); None sends nothing (unchanged).
    assert MemberReport("m", "s", worker_endpoints=()).to_proto().HasField("worker_endpoints")
    assert not MemberReport("m", "s").to_proto().HasField("worker_endpoints")


# -- the worker's side: its note for the agent, and its port ----------------------------------------


def test_notes_are_read_back_by_rank_for_their_generation_only(tmp_path: Path) -> None:
    # Node 1 of a world of 2 nodes x 2 workers: ranks 2 and 3.
    note_endpoint(
        tmp_path, EndpointNote(3, 1, "0.0.0.0", 9101, 2, node_rank=1, local_world_size=2, world_size=4)
    )
    note_endpoint(tmp_path, EndpointNote(2, 0, "127.0.0.1", 9100, 2, 1, 2, 4))
    (tmp_path / "rank-9.json").write_text("{half a no")  # never a note: passed over
    (tmp_path / "unrelated.txt").write_text("x")
    assert read_notes(tmp_path, 2, node_rank=1) == [
        EndpointNote(2, 0, "127.0.0.1", 9100, 2, 1, 2, 4),
        EndpointNote(3, 1, "0.0.0.0", 9101, 2, 1, 2, 4),
    ]
    assert read_notes(tmp_path, 1, node_rank=1) == []  # an earlier world's
    assert read_notes(tmp_path, 2, node_rank=0) == []  # another node's
    clear_notes(tmp_path)
    assert read_notes(tmp_path, 2, node_rank=1) == []
    assert (tmp_path / "unrelated.txt").exists()
    assert read_notes(tmp_path / "gone", 1, node_rank=0) == []


def test_notes_for_ranks_outside_the_nodes_workers_are_never_listed(tmp_path: Path) -> None:
    """A world of one worker whose directory also holds notes for ranks 5 and 999999 (copies of
    the real one with another rank, and one that claims a larger world): only rank 0 is read."""
    real = EndpointNote(0, 0, "0.0.0.0", 9100, 1, node_rank=0, local_world_size=1, world_size=1)
    note_endpoint(tmp_path, real)
    for rank, local_rank, local_size, world in ((5, 0, 1, 1), (999999, 0, 1, 1), (5, 5, 6, 6)):
        note_endpoint(tmp_path, EndpointNote(rank, local_rank, "0.0.0.0", 9200, 1, 0, local_size, world))
    # A note of rank 7 in a file named for rank 8, and one that places itself outside its world.
    (tmp_path / "rank-8.json").write_text(
        json.dumps(EndpointNote(7, 0, "0.0.0.0", 9300, 1, 0, 1, 1).__dict__)
    )
    assert read_notes(tmp_path, 1, node_rank=0) == [real]
    alone = tmp_path / "alone"
    alone.mkdir()
    note_endpoint(alone, EndpointNote(5, 0, "0.0.0.0", 9200, 1, 0, 1, 1))  # rank 5 of a world of 1
    assert read_notes(alone, 1, node_rank=0) == []


def test_junk_named_like_notes_never_starves_the_real_ones_and_the_work_is_bounded(tmp_path: Path) -> None:
    """Junk files whose names sort ahead of ``rank-0.json`` (before, only the first 1,024 names
    were read and the real worker was never listed), and junk named for real ranks."""
    for i in range(MAX_NOTES + 100):
        (tmp_path / f"rank--{i}.json").write_text("{}")  # not a rank: never read
    real = EndpointNote(0, 0, "0.0.0.0", 9100, 1, node_rank=0, local_world_size=1, world_size=1)
    note_endpoint(tmp_path, real)
    assert read_notes(tmp_path, 1, node_rank=0) == [real]
    # Node 1 of a world of 2 x 1, its real note behind more junk notes of lower ranks than one
    # pass reads: found on the second pass, then read by its name alone.
    for rank in range(1, MAX_NOTES + 100):
        (tmp_path / f"rank-{rank}.json").write_text("junk")
    first = MAX_NOTES + 100
    second = EndpointNote(first, 0, "0.0.0.0", 9101, 1, node_rank=1, local_world_size=1, world_size=first + 1)
    note_endpoint(tmp_path, second)
    reader = NoteReader(tmp_path, 1, node_rank=1)
    assert reader.read() == []  # the first MAX_NOTES candidates: junk, and rank 0 of node 0
    assert reader.read() == [second]
    assert reader.read() == [second]


@pytest.mark.parametrize(
    ("env", "port"),
    [
        ({}, 0),
        ({"LOCAL_RANK": "3"}, 0),
        ({"SAR_METRICS_PORT": "0", "LOCAL_RANK": "1"}, 0),
        ({"SAR_METRICS_PORT": "9100", "LOCAL_RANK": "0"}, 9100),
        ({"SAR_METRICS_PORT": "9100", "LOCAL_RANK": "3"}, 9103),
        ({"SAR_METRICS_PORT": "-1", "LOCAL_RANK": "3"}, None),
    ],
)
def test_torchrun_worker_serves_on_the_first_port_plus_its_local_rank(
    env: dict[str, str], port: int | None
) -> None:
    assert node_worker_metrics_port(env) == port


def test_torchrun_worker_port_beyond_65535_is_refused_saying_what_to_set() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        node_worker_metrics_port({"SAR_METRICS_PORT": "65535", "LOCAL_RANK": "1"})
    assert str(caught.value) == (
        "SAR_METRICS_PORT=65535 gives local rank 1 port 65536, beyond 65535: set a first port of at most "
        "65536 minus --nproc-per-node (or 0: any free port)."
    )
