"""The stored form of jobs and members (coordinator/storage/records.py): every field of a member
is either stored (one entry of ``MEMBER_FIELDS``, from which the record, its reading, the
encoder's change key and its split are all made) or declared memory-only, and every stored field
survives a write and a read and, changed, reaches the encoder's text. In process, no store."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from sarcomm.common.constants import FailureReason
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import WorkerEndpoint
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import ElasticRange, Job, JobState, Member, MemberState
from sarcomm.coordinator.storage.records import (
    MEMBER_FIELDS,
    MEMBER_MEMORY_ONLY,
    JobEncoder,
    _halves,
    job_from_record,
    job_record,
    member_from_record,
    member_record,
)
from tests.helpers import FakeClock, spec

#: A value other than the one a fresh member of _job() holds, for every stored member field.
_OTHER: dict[str, Any] = {
    "member_id": "feedfacefeedface",
    "secret_digest": "0" * 64,
    "host": "elsewhere",
    "local_rank": 7,
    "requested_rank": 5,
    "store_port": 29999,
    "interfaces": (InterfaceInfo("ib0", ("10.9.0.1",), InterfaceKind.PHYSICAL, False),),
    "peer_address": "10.9.0.9",
    "socket_name": "ib0",
    "joined_at": 123.5,
    "state": MemberState.FAILED,
    "rank": 3,
    "interface": "ib0",
    "address": "10.9.0.1",
    "exit_code": 9,
    "reason": 'said "stop", then }, {"member_id": x',
    "failure": FailureReason.KILLED,
    "last_heartbeat": 1.7e9,
    "metrics_address": "10.9.0.1:9100",
    "join_digest": "1" * 64,
    "worker_endpoints": (WorkerEndpoint(rank=4, local_rank=1, address="10.9.0.1:9101"),),
}


def _job() -> Job:
    membership = Membership(liveness_timeout=3.0, clock=FakeClock())
    job = membership.join(spec("h0", None, None, job="j", world_size=2)).job
    assert job.state is JobState.RUNNING
    return job


def test_every_member_field_is_stored_or_declared_memory_only() -> None:
    stored = [f.name for f in MEMBER_FIELDS]
    assert len(set(stored)) == len(stored)
    assert not set(stored) & MEMBER_MEMORY_ONLY
    assert set(stored) | MEMBER_MEMORY_ONLY == {f.name for f in dataclasses.fields(Member)}, (
        "a field of Member is neither in records.MEMBER_FIELDS nor in records.MEMBER_MEMORY_ONLY"
    )
    assert set(stored) == set(_OTHER), "give the new stored field a value in _OTHER"


@pytest.mark.parametrize("name", [f.name for f in MEMBER_FIELDS])
def test_a_changed_stored_member_field_is_written_read_back_and_reencoded(name: str) -> None:
    job = _job()
    encoder = JobEncoder()
    encoder.encode(job)
    member = job.members[1]
    assert getattr(member, name) != _OTHER[name]
    setattr(member, name, _OTHER[name])
    row = encoder.encode(job)  # one member of two changed: encoded on its own, not the whole list
    assert row.record_json == json.dumps(job_record(job))
    read = member_from_record(json.loads(json.dumps(member_record(member))))
    assert getattr(read, name) == _OTHER[name]
    assert read == dataclasses.replace(member, **{k: getattr(read, k) for k in MEMBER_MEMORY_ONLY})


def test_a_record_written_before_the_later_fields_existed_reads_with_their_defaults() -> None:
    record = member_record(_job().members[0])
    for name in ("failure", "join_digest", "worker_endpoints"):
        del record[name]
    member = member_from_record(record)
    assert (member.failure, member.join_digest, member.worker_endpoints) == (None, "", ())


def test_the_split_around_last_heartbeat_does_not_depend_on_the_order_of_keys() -> None:
    rest = {k: v for k, v in member_record(_job().members[0]).items() if k != "last_heartbeat"}
    beat = {"last_heartbeat": 12.25}
    for first in (True, False):
        ordered = {**beat, **rest} if first else {**rest, **beat}
        text = json.dumps(ordered)
        before, after = _halves(text)
        assert before.endswith('"last_heartbeat": ')
        assert before + "12.25" + after == text


def test_every_stored_job_field_is_written_and_read_back() -> None:
    job = _job()
    job.elastic = ElasticRange(1, 4, 2.0)
    job.closed = "rank 0 on host h0 finished"
    job.failed_rank, job.max_restarts, job.rerendezvous_count = 1, 2, 3
    persisted = {f.name for f in dataclasses.fields(Job)} - {"memory"}
    assert set(job_record(job)) == persisted, "every field of Job but its memory is stored"
    read = job_from_record(json.loads(json.dumps(job_record(job))))
    assert {name: getattr(read, name) for name in persisted - {"members"}} == {
        name: getattr(job, name) for name in persisted - {"members"}
    }
    job.closed = None  # open: stored as "" as before, and read back as open
    assert job_record(job)["closed"] == ""
    assert job_from_record(json.loads(json.dumps(job_record(job)))).closed is None
