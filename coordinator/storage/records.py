"""Jobs and members as the state store keeps them (JSON-ready dicts), and back.

The domain (:mod:`model`) knows nothing of this form; the store (:mod:`store`) knows nothing of
the domain. :func:`load_state` reads at start what the domain needs from storage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sarcomm.common.constants import FailureReason
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.domain.model import ElasticRange, Job, JobState, Member, MemberState, StoredState
from sarcomm.coordinator.storage.store import StateStore, encode_job


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
    )


def job_record(job: Job) -> dict[str, Any]:
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
        "members": [member_record(m) for m in job.members],
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
