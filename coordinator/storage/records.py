"""Jobs and members as the state store keeps them (JSON-ready dicts), and back.

The domain (:mod:`model`) knows nothing of this form; the store (:mod:`store`) knows nothing of
the domain. :func:`load_state` reads at start what the domain needs from storage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from sarcomm.common.constants import FailureReason
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import WorkerEndpoint
from sarcomm.coordinator.domain.model import ElasticRange, Job, JobState, Member, MemberState, StoredState
from sarcomm.coordinator.storage.store import MEMBERS_PER_PIECE, JobRow, StateStore, encode_job


def load_state(store: StateStore) -> StoredState:
    """Read and decode everything the membership needs from ``store``; blocks on the store."""
    return StoredState([job_from_record(r) for r in store.load_jobs()], store.last_generations())


def write_at_once(store: StateStore) -> Callable[[Job], None]:
    """A ``persist`` for the membership that writes each changed job before returning (tests,
    tools; the server coalesces through :class:`persistence.WriteBehind`)."""
    return lambda job: store.write_rows([encode_job(job_record(job))])


def member_record(member: Member) -> dict[str, Any]:
    return {
        "member_id": member.member_id,
        "secret_digest": member.secret_digest,
        "host": member.host,
        "local_rank": member.local_rank,
        "requested_rank": member.requested_rank,
        "store_port": member.store_port,
        "interfaces": [
            {
                "name": i.name,
                "addresses": list(i.addresses),
                "kind": int(i.kind),
                "default_route": i.default_route,
            }
            for i in member.interfaces
        ],
        "peer_address": member.peer_address,
        "socket_name": member.socket_name,
        "joined_at": member.joined_at,
        "state": member.state.value,
        "rank": member.rank,
        "interface": member.interface,
        "address": member.address,
        "exit_code": member.exit_code,
        "reason": member.reason,
        "failure": member.failure.value if member.failure is not None else None,
        "last_heartbeat": member.last_heartbeat,
        "metrics_address": member.metrics_address,
        "join_digest": member.join_digest,
        "worker_endpoints": [list(e) for e in member.worker_endpoints],
    }


def member_from_record(record: dict[str, Any]) -> Member:
    interfaces = tuple(
        InterfaceInfo(i["name"], tuple(i["addresses"]), InterfaceKind(i["kind"]), i["default_route"])
        for i in record["interfaces"]
    )
    # .get: state files written before the field existed hold no such key.
    failure = record.get("failure")
    return Member(
        member_id=record["member_id"],
        secret_digest=record["secret_digest"],
        host=record["host"],
        local_rank=record["local_rank"],
        requested_rank=record["requested_rank"],
        store_port=record["store_port"],
        interfaces=interfaces,
        peer_address=record["peer_address"],
        socket_name=record["socket_name"],
        joined_at=record["joined_at"],
        state=MemberState(record["state"]),
        rank=record["rank"],
        interface=record["interface"],
        address=record["address"],
        exit_code=record["exit_code"],
        reason=record["reason"],
        failure=FailureReason(failure) if failure is not None else None,
        last_heartbeat=record["last_heartbeat"],
        metrics_address=record["metrics_address"],
        join_digest=record.get("join_digest", ""),
        worker_endpoints=tuple(WorkerEndpoint(*e) for e in record.get("worker_endpoints", ())),
    )


def job_record(job: Job) -> dict[str, Any]:
    return {**job_record_head(job), "members": [member_record(m) for m in job.members]}


def job_record_head(job: Job) -> dict[str, Any]:
    """:func:`job_record` but its members."""
    return {
        "name": job.name,
        "generation": job.generation,
        "world_size": job.world_size,
        "created": job.created,
        "backend": job.backend,
        "state": job.state.value,
        "formed": job.formed,
        "ended": job.ended,
        "master_addr": job.master_addr,
        "master_port": job.master_port,
        "restart_count": job.restart_count,
        "reason": job.reason,
        "failed_rank": job.failed_rank,
        "max_restarts": job.max_restarts,
        "history": job.history,
        "elastic": (
            [job.elastic.min_members, job.elastic.max_members, job.elastic.last_call] if job.elastic else None
        ),
        "closed": job.closed,
        "rerendezvous_count": job.rerendezvous_count,
    }


def job_from_record(record: dict[str, Any]) -> Job:
    return Job(
        name=record["name"],
        generation=record["generation"],
        world_size=record["world_size"],
        created=record["created"],
        backend=record["backend"],
        state=JobState(record["state"]),
        formed=record["formed"],
        ended=record["ended"],
        master_addr=record["master_addr"],
        master_port=record["master_port"],
        restart_count=record["restart_count"],
        reason=record["reason"],
        # .get: state files written before the field existed hold no such key.
        failed_rank=record.get("failed_rank"),
        max_restarts=record.get("max_restarts", 0),
        history=record.get("history", []),
        members=[member_from_record(m) for m in record["members"]],
        elastic=ElasticRange(*elastic) if (elastic := record.get("elastic")) else None,
        closed=record.get("closed", ""),
        rerendezvous_count=record.get("rerendezvous_count", 0),
    )


def _member_key(member: Member) -> tuple[Any, ...]:
    """Every persisted field of ``member`` but ``last_heartbeat`` (see :class:`JobEncoder`)."""
    return (
        member.member_id, member.secret_digest, member.host, member.local_rank, member.requested_rank,
        member.store_port, member.interfaces, member.peer_address, member.socket_name, member.joined_at,
        member.state, member.rank, member.interface, member.address, member.exit_code, member.reason,
        member.failure, member.metrics_address, member.join_digest, member.worker_endpoints,
    )  # fmt: skip


def _json_number(value: float) -> str:
    # json.dumps writes a finite float as float.__repr__ does; anything else goes through json.
    return float.__repr__(value) if type(value) is float and math.isfinite(value) else json.dumps(value)


class JobEncoder:
    """The stored JSON of one job generation, encoding again only the members that changed.

    :func:`encode_job` of :func:`job_record` encodes every member at every write: ~10 us a member,
    a third of a second for a 32,768-member job, and its members' first reports (each names its
    metrics endpoint, a change) made the coordinator encode it again at every flush for seconds
    while the heartbeats waited. Here each member's JSON is kept with the fields it was made from
    and made again only when one of them changed. ``last_heartbeat`` moves with every report, so it
    is written between the two kept halves of the member's JSON instead of being one of those
    fields. The text is exactly ``json.dumps(job_record(job))``.
    """

    def __init__(self) -> None:
        # member_id -> (the fields it was encoded from, JSON before last_heartbeat's value, after it)
        self._members: dict[str, tuple[tuple[Any, ...], str, str]] = {}

    def encode(self, job: Job) -> JobRow:
        """The row of ``job``'s record (as :func:`encode_job` makes it); call on the event loop."""
        kept = self._members
        keys = [_member_key(m) for m in job.members]
        changed = sum(
            1 for m, key in zip(job.members, keys, strict=True) if _stale(kept.get(m.member_id), key)
        )
        if changed * 2 > len(keys):
            # Most members changed (a world just formed, or every member reported at once): one
            # encoding of the whole member list is cheaper than one per member, and it is cut into
            # the members' pieces for the next time.
            pieces = self._encode_whole(job, keys)
        else:
            fresh: dict[str, tuple[tuple[Any, ...], str, str]] = {}
            pieces = []
            for member, key in zip(job.members, keys, strict=True):
                entry = kept.get(member.member_id)
                if entry is None or entry[0] != key:
                    entry = (key, *_halves(json.dumps(member_record(member))))
                fresh[member.member_id] = entry
                pieces.append(entry[1] + _json_number(member.last_heartbeat) + entry[2])
            # Members that left the record (a withdrawn join) are dropped with the old map.
            self._members = fresh
        # In the store's pieces of MEMBERS_PER_PIECE (etcd keeps each chunk of pieces apart).
        chunks = tuple(
            "[" + ", ".join(pieces[start : start + MEMBERS_PER_PIECE]) + "]"
            for start in range(0, len(pieces), MEMBERS_PER_PIECE)
        )
        return JobRow(job.name, job.generation, job.state.value, json.dumps(job_record_head(job)), chunks)

    def _encode_whole(self, job: Job, keys: list[tuple[Any, ...]]) -> list[str]:
        """Every member's JSON, from one encoding of the member list; kept in halves for next time."""
        fresh: dict[str, tuple[tuple[Any, ...], str, str]] = {}
        pieces: list[str] = []
        if job.members:
            # Each member's JSON starts with its id, and no string inside one can hold the
            # unescaped '}, {"member_id": ' that separates two (json escapes every quote in one).
            parts = json.dumps([member_record(m) for m in job.members])[1:-1].split("}, " + _MEMBER_START)
            last = len(parts) - 1
            pieces = [
                (_MEMBER_START if i else "") + part + ("}" if i < last else "")
                for i, part in enumerate(parts)
            ]
            for member, key, piece in zip(job.members, keys, pieces, strict=True):
                fresh[member.member_id] = (key, *_halves(piece))
        self._members = fresh
        return pieces


#: How a member's JSON starts (member_record's first field).
_MEMBER_START = '{"member_id": '


def _stale(entry: tuple[tuple[Any, ...], str, str] | None, key: tuple[Any, ...]) -> bool:
    return entry is None or entry[0] != key


def _halves(member_json: str) -> tuple[str, str]:
    """A member's JSON before ``last_heartbeat``'s value (its key included) and after it."""
    before, marker, after = member_json.partition(', "last_heartbeat": ')
    # The number ends where the next key, metrics_address, begins.
    return before + marker, after[after.index(', "metrics_address": ') :]
