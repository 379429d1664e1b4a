"""WriteBehind: coalesced job writes off the loop, durable before the answers that need it.

A real SQLite file, then a real etcd cluster (every test runs on both stores); the only stand-in
is a store wrapper that counts the batches (and, in one test, fails the way a full disk does).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.errors import CoordinatorUnavailableError, StoreLimitError
from sarcomm.common.messages import WorkerEndpoint
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.coordinator.storage.persistence import WriteBehind
from sarcomm.coordinator.storage.records import JobEncoder, job_record
from sarcomm.coordinator.storage.store import JobRow, SqliteStore, StateStore, encode_job
from tests.conftest import STORES
from tests.etcd_cluster import EtcdCluster
from tests.helpers import FakeClock, spec, stays_false_async, wait_for_async
from tests.test_etcd_store import lead

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")


class CountingStore:
    """A store (SQLite or etcd) that counts the batches written to it and can fail the next ones."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.batches: list[list[str]] = []
        self.fail_next = 0

    def load_jobs(self) -> list[dict[str, Any]]:
        return self.inner.load_jobs()

    def last_generations(self) -> dict[str, int]:
        return self.inner.last_generations()

    def write_rows(self, rows: list[JobRow]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise sqlite3.OperationalError("database or disk is full")
        refused: StoreLimitError | None = None
        try:
            self.inner.write_rows(rows)
        except StoreLimitError as error:  # the others were written
            refused = error
        # Counted once written: a test that waits for a batch may then read it back.
        self.batches.append(
            [
                f"{row.name}#{row.generation}:{len(json.loads(row.record_json)['members'])}"
                for row in rows
                if refused is None or row.key not in refused.refused
            ]
        )
        if refused is not None:
            raise refused

    def close(self) -> None:
        self.inner.close()


def stored(store: CountingStore) -> dict[str, dict[str, Any]]:
    """What the store holds now, read back from it."""
    return {record["name"]: record for record in store.inner.load_jobs()}


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CountingStore]:
    if request.param == "sqlite":
        yield CountingStore(SqliteStore(tmp_path / "state.sqlite"))
        return
    cluster: EtcdCluster = request.getfixturevalue("module_etcd_cluster")
    prefix = request.getfixturevalue("etcd_prefix")
    client = EtcdClient(EtcdSettings(cluster.url(prefix)))
    etcd = EtcdStore(client, "/" + prefix)
    lead(client, etcd)
    yield CountingStore(etcd)
    client.close()


async def test_many_changes_of_one_job_are_written_once_and_durable_waits_for_it(
    store: CountingStore,
) -> None:
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    tickets = [membership.join(spec(f"h{i}", job="big", world_size=64)) for i in range(64)]
    assert tickets[0].job.formed
    # Every member leaves, each a change of the job's record, all before the flush runs.
    for ticket in tickets:
        membership.leave(ticket.members[0].member_id, ticket.secrets[0], 0)
    assert not store.batches  # nothing written on the caller's path
    await writes.durable()
    assert store.batches == [["big#1:64"]]
    record = stored(store)["big"]
    assert record["state"] == "FINISHED"
    assert {m["state"] for m in record["members"]} == {"LEFT"}
    await writes.close()
    store.close()


def test_job_encoder_writes_exactly_the_full_encoding_as_members_change() -> None:
    """The encoder re-encodes only changed members; its text must be json.dumps(job_record(job))
    at every step: forming, formed, reports (metrics endpoint, heartbeat times), leaves, failures."""
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock)
    encoder = JobEncoder()
    tickets = [membership.join(spec(f"h{i}", None, None, job="j", world_size=6)) for i in range(2)]
    job = tickets[0].job

    def same() -> None:
        row = encoder.encode(job)
        assert (row.name, row.generation, row.state) == (job.name, job.generation, job.state.value)
        assert row.record_json == json.dumps(job_record(job))
        assert row == encode_job(job_record(job))  # the same pieces as the whole record's

    same()
    tickets.append(membership.join(spec("h2", None, None, job="j", world_size=6)))
    same()  # formed: every member got a rank, an interface and an address
    members = [(m.member_id, s) for t in tickets for m, s in zip(t.members, t.secrets, strict=True)]
    for i, (member_id, secret) in enumerate(members):
        clock.advance(0.25)
        membership.heartbeat(member_id, secret, None, f"127.0.0.1:{9000 + i}" if i % 2 else "")
        same()
    membership.leave(*members[0], 0)
    same()
    membership.leave(*members[1], 3, "exited with code 3")  # fails the job and the rest of it
    same()
    clock.advance(10)
    membership.sweep()
    same()


def test_job_encoder_cut_from_one_whole_encoding_matches_across_the_stores_pieces() -> None:
    """When most members changed, the encoder encodes the member list once and cuts it into the
    members' JSON: the row must still equal encode_job's, over several MEMBERS_PER_PIECE chunks,
    and the kept pieces must serve the next, partial, change."""
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, clock=clock)
    encoder = JobEncoder()
    tickets = [membership.join(spec(f"h{i}", *([None] * 8), job="big", world_size=600)) for i in range(75)]
    job = tickets[0].job
    assert job.state.value == "RUNNING"
    assert encoder.encode(job) == encode_job(job_record(job))  # every member new: the whole way
    members = [(m.member_id, s) for t in tickets for m, s in zip(t.members, t.secrets, strict=True)]
    # A fifth of them change (member by member), then three fifths (the whole way again).
    for step, count in enumerate((120, 360)):
        clock.advance(1.0)
        for i, (member_id, secret) in enumerate(members[:count]):
            membership.heartbeat(member_id, secret, None, f"127.0.0.1:{10000 + 1000 * step + i}")
        assert encoder.encode(job) == encode_job(job_record(job))


async def test_a_change_nobody_waits_for_gathers_longer_and_an_answer_brings_its_flush_forward(
    store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sarcomm.coordinator.storage.persistence.MAX_UNANSWERED_DELAY_S", 60.0)
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    ticket = membership.join(spec("a", job="j", world_size=1))
    await writes.durable()
    # As after a flush of a big job: the next one is paced by what that one cost.
    writes._last_cost = 10.0
    endpoints = (WorkerEndpoint(rank=0, local_rank=0, address="127.0.0.1:9100"),)
    member_id = ticket.members[0].member_id
    membership.heartbeat(member_id, ticket.secrets[0], None, "", worker_endpoints=endpoints)
    await stays_false_async(lambda: len(store.batches) > 1, 0.5, what="the endpoints' paced write")
    # A Leave's answer waits for it now: written at the pace answers get (0.1 s at most).
    membership.leave(member_id, ticket.secrets[0], 0)
    await asyncio.wait_for(writes.durable(), 5)
    assert len(store.batches) == 2
    assert stored(store)["j"]["members"][0]["worker_endpoints"] == [[0, 0, "127.0.0.1:9100"]]


async def test_durable_returns_at_once_when_nothing_is_pending(store: CountingStore) -> None:
    writes = WriteBehind(store)
    await asyncio.wait_for(writes.durable(), 1)
    assert store.batches == []
    await writes.close()


async def test_changes_marked_while_a_batch_is_written_go_into_the_next_one(store: CountingStore) -> None:
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    a = membership.join(spec("a", job="one", world_size=1))
    waiting_for_one = asyncio.ensure_future(writes.durable())
    await wait_for_async(lambda: store.batches, 5, what="the first batch to be taken and written")
    b = membership.join(spec("b", job="two", world_size=1))
    await writes.durable()
    await waiting_for_one
    assert store.batches == [["one#1:1"], ["two#1:1"]]
    assert set(stored(store)) == {"one", "two"}
    assert a.job.formed
    assert b.job.formed
    await writes.close()


async def test_a_failed_write_is_an_unavailable_error_and_is_retried(
    store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sarcomm.coordinator.storage.persistence.RETRY_DELAY_S", 0.05)
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    store.fail_next = 1
    membership.join(spec("a", job="j", world_size=1))
    with pytest.raises(CoordinatorUnavailableError, match=r"could not write its state.*disk is full"):
        await writes.durable()
    # Nothing was lost: the job is written by the retry, without any new change.
    await wait_for_async(lambda: store.batches, 5, what="the retry to write the job")
    assert store.batches == [["j#1:1"]]
    assert stored(store)["j"]["state"] == "RUNNING"
    await writes.close()


async def test_close_writes_what_is_still_marked_and_later_marks_write_at_once(store: CountingStore) -> None:
    writes = WriteBehind(store, delay=60.0)  # a flush that would not come on its own
    clock = FakeClock()
    membership = Membership(liveness_timeout=3.0, persist=writes.mark, clock=clock)
    membership.join(spec("a", job="j", world_size=1))
    await writes.close()
    assert store.batches == [["j#1:1"]]
    clock.advance(10)  # the member goes silent: the sweep fails it after close, written at once
    assert membership.sweep()
    assert stored(store)["j"]["state"] == "FAILED"


async def test_large_answers_pause_the_collector_only_while_they_compute() -> None:
    """/metrics, /sd and /v1/jobs build 4096-rank answers with the collector off in between
    pauses (see http.collector_paused); it must be back on whatever happens to the handler."""
    import gc

    from sarcomm.coordinator.api import http

    assert gc.isenabled()
    seen: list[bool] = []

    async def handler() -> None:
        with http.collector_paused():
            seen.append(gc.isenabled())
            await http._let_others_run()  # other tasks run with the collector on
            seen.append(gc.isenabled())
            await asyncio.Event().wait()  # until cancelled, like a handler cut off mid-answer

    async def other() -> None:
        seen.append(gc.isenabled())

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0)
    await other()
    await wait_for_async(lambda: len(seen) == 3, 5, what="the handler to run again after the others")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False, True, False]
    assert gc.isenabled()


async def test_a_record_the_store_can_never_take_fails_its_job_alone_and_is_not_retried(
    store: CountingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sarcomm.coordinator.storage.persistence.RETRY_DELAY_S", 0.05)
    if isinstance(store.inner, SqliteStore):
        # SQLite's own bound on one row's text, lowered from 1 GB so that a test can reach it.
        if not hasattr(sqlite3, "SQLITE_LIMIT_LENGTH"):
            pytest.skip("Python < 3.11 cannot set SQLite's limits")
        store.inner._db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 64 * 1024)
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    big = membership.join(spec("a", job="big", world_size=1)).job
    # One member larger than one etcd request may be, and than the row SQLite now takes: random
    # text does not compress.
    big.members[0].reason = base64.b64encode(os.urandom(1536 * 1024)).decode()
    small = membership.join(spec("b", job="small", world_size=1)).job
    with pytest.raises(StoreLimitError, match=r"^job 'big' generation 1: .*(etcd|SQLite)"):
        await writes.durable(big)
    await writes.durable(small)  # the same batch: written
    assert set(stored(store)) == {"small"}
    # Not re-queued: later batches carry the other jobs' changes alone, and are not refused.
    other = membership.join(spec("c", job="other", world_size=1)).job
    await writes.durable(other)
    assert store.batches == [["small#1:1"], ["other#1:1"]]
    # The job stays refused for its callers until a change of it is written.
    with pytest.raises(StoreLimitError):
        await writes.durable(big)
    big.members[0].reason = ""
    writes.mark(big)
    await writes.durable(big)
    assert set(stored(store)) == {"big", "small", "other"}
    await writes.close()
    store.close()
