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
from sarcomm.worker.endpoints import EndpointNote, clear_notes, note_endpoint, read_notes
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
async def test_bad_worker_endpoint_is_refused_naming_the_field(
    coord: InProcessCoordinator,
    stub: pb_grpc.CoordinatorAsyncStub,
    entries: tuple[tuple[int, int, str], ...],
    message: str,
) -> None:
    node0, _ = await form_nodes(stub, "bad")
    report = pb.MemberReport(
        member_id=node0.member_id, secret=node0.secret, worker_endpoints=endpoints(*entries)
    )
    call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=[report], closing=True)]), timeout=WAIT_S)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    expected = message.format(field="reports[0].worker_endpoints.endpoints", host=coord.member("bad", 0).host)
    assert details.startswith(expected), details
    assert await sd(coord, "bad") == []


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
    note_endpoint(tmp_path, EndpointNote(3, 1, "0.0.0.0", 9101, generation=2))
    note_endpoint(tmp_path, EndpointNote(2, 0, "127.0.0.1", 9100, generation=2))
    note_endpoint(tmp_path, EndpointNote(4, 0, "0.0.0.0", 9102, generation=1))  # an earlier world's
    (tmp_path / "rank-9.json").write_text("{half a no")  # never a note: passed over
    (tmp_path / "unrelated.txt").write_text("x")
    assert read_notes(tmp_path, 2) == [
        EndpointNote(2, 0, "127.0.0.1", 9100, 2),
        EndpointNote(3, 1, "0.0.0.0", 9101, 2),
    ]
    clear_notes(tmp_path)
    assert read_notes(tmp_path, 2) == []
    assert (tmp_path / "unrelated.txt").exists()
    assert read_notes(tmp_path / "gone", 1) == []


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
