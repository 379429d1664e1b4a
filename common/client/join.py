"""A Join's request and answer: the fields :meth:`CoordinatorClient.join_many
<sarcomm.common.client.coordinator_client.CoordinatorClient.join_many>` takes, checked and put in a
``JoinRequest``, and the coordinator's ``JoinResponse`` as a :class:`JoinResult`. No I/O but the
host's name, interfaces and a free port where the caller gives none; the call itself, its deadline
and its retries are the client's."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from sarcomm.common import durations, netinfo
from sarcomm.common.constants import DEFAULT_JOIN_TIMEOUT, JOIN_ANSWER_SLACK_S
from sarcomm.common.errors import InvalidArgumentError, JobClosedError, SarcommError
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.common.messages import Assignment, JoinResult, interface_to_proto
from sarcomm.v1 import coordinator_pb2 as pb

__all__ = ["join_deadline", "join_request", "join_result"]


def join_request(
    job: str,
    world_size: int,
    *,
    nproc: int,
    ranks: Sequence[int] | None,
    local_ranks: Sequence[int] | None,
    host: str | None,
    interfaces: Sequence[InterfaceInfo] | None,
    socket_name: str,
    store_port: int,
    generation: int,
    join_timeout: float | None,
    backend: str,
    max_restarts: int,
    min_members: int,
    max_members: int,
    last_call_timeout: float,
    rejoin: tuple[str, str] | None,
) -> pb.JoinRequest:
    """The ``JoinRequest`` of :meth:`~sarcomm.common.client.coordinator_client.CoordinatorClient.
    join_many`'s arguments (documented there), with a fresh ``join_id``: the same on every try of
    this join, so the coordinator answers each try with the first one's members.

    Raises:
        InvalidArgumentError: ``ranks`` or ``local_ranks`` not one per member, a non-positive
            ``join_timeout``, or a field that does not fit its protobuf type.
    """
    if ranks is not None and len(ranks) != nproc:
        raise InvalidArgumentError(f"ranks={list(ranks)!r} must have nproc={nproc} entries, one per member.")
    if local_ranks is not None and len(local_ranks) != nproc:
        raise InvalidArgumentError(
            f"local_ranks={list(local_ranks)!r} must have nproc={nproc} entries, one per member."
        )
    if join_timeout is not None:
        durations.checked(join_timeout, f"join_timeout={join_timeout!r}")
    members: list[pb.MemberSpec] = []
    try:
        for i in range(nproc):
            # On the wire a member's local rank is its index in this request (the coordinator
            # checks 0..nproc-1); a process that joins alone may still be local rank 3 of its
            # host, which the answer carries from ``local_ranks``.
            spec = pb.MemberSpec(local_rank=i)
            if ranks is not None:
                spec.rank = ranks[i]
            members.append(spec)
        request = pb.JoinRequest(
            job=job,
            world_size=world_size,
            host=host if host is not None else netinfo.host_name(),
            interfaces=[
                interface_to_proto(i)
                for i in (interfaces if interfaces is not None else netinfo.local_interfaces())
            ],
            members=members,
            # The coordinator needs a port for rank 0's store; a free one is a fine default for
            # callers that do not hold one (racy in theory, which is why the agent reserves).
            store_port=store_port or netinfo.free_port(),
            socket_name=socket_name,
            generation=generation,
            join_timeout_seconds=join_timeout or 0.0,
            backend=backend,
            max_restarts=max_restarts,
            min_members=min_members,
            max_members=max_members,
            last_call_timeout_seconds=last_call_timeout,
            rejoin_member_id=rejoin[0] if rejoin else "",
            rejoin_secret=rejoin[1] if rejoin else "",
        )
    except (ValueError, TypeError) as exc:  # protobuf: int32 overflow, wrong types
        raise InvalidArgumentError(f"A Join field does not fit its protobuf type: {exc}") from exc
    # The same on every try of this join (Replicas.call sends it again while nothing answers it: a
    # broken connection, a new leader, a coordinator that cannot write its state).
    request.join_id = secrets.token_hex(16)
    return request


def join_result(
    resp: pb.JoinResponse,
    nproc: int,
    local_ranks: Sequence[int] | None,
    local_world_size: int | None,
    target: str,
) -> JoinResult:
    """The coordinator's answer to a Join of ``nproc`` members as a :class:`JoinResult`, one
    :class:`Assignment` per member in request order (local ranks ``local_ranks``, default
    ``0..nproc-1``, on a host of ``local_world_size`` members, default ``nproc``).

    Raises:
        JobClosedError: the elastic job's rendezvous is closed.
        SarcommError: the coordinator at ``target`` answered with another number of members.
    """
    if resp.closed:
        raise JobClosedError(resp.closed_reason, beyond_max=resp.beyond_max)
    if len(resp.assignments) != nproc:
        raise SarcommError(
            f"The coordinator at {target} answered Join for job {resp.job!r} with "
            f"{len(resp.assignments)} assignments for {nproc} members."
        )
    lranks = list(local_ranks) if local_ranks is not None else list(range(nproc))
    lworld = nproc if local_world_size is None else local_world_size
    assignments = tuple(
        Assignment(
            rank=a.rank,
            world_size=resp.world_size,
            local_rank=lranks[i],
            local_world_size=lworld,
            master_addr=resp.master_addr,
            master_port=resp.master_port,
            interface=resp.interface,
            address=resp.address,
            generation=resp.generation,
            member_id=a.member_id,
            secret=a.secret,
            job=resp.job,
            restart_count=resp.restart_count,
        )
        for i, a in enumerate(resp.assignments)
    )
    return JoinResult(
        job=resp.job,
        generation=resp.generation,
        world_size=resp.world_size,
        master_addr=resp.master_addr,
        master_port=resp.master_port,
        interface=resp.interface,
        address=resp.address,
        restart_count=resp.restart_count,
        heartbeat_interval=resp.heartbeat_interval_seconds,
        assignments=assignments,
    )


def join_deadline(join_timeout: float | None, timeout: float) -> float:
    """The deadline of a Join, in seconds. With a ``join_timeout`` it is the caller's: the join
    timeout bounds everything, reaching the coordinator included, plus :data:`JOIN_ANSWER_SLACK_S`
    for the coordinator's answer (the world, or why it did not form) to arrive. Without one, the
    coordinator's ``--join-timeout`` decides, assumed to be at most :data:`DEFAULT_JOIN_TIMEOUT`,
    plus ``timeout`` (the client's call deadline) to reach a coordinator not up yet."""
    if join_timeout is not None:
        return join_timeout + JOIN_ANSWER_SLACK_S
    return DEFAULT_JOIN_TIMEOUT + timeout
