"""Domain objects as the messages and JSON that clients see; secrets never leave through here."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from sarcomm.common.messages import failure_to_proto
from sarcomm.coordinator.domain.elastic import waiting
from sarcomm.coordinator.domain.model import Job, JobEvent, JobState, Member, MemberState, Stall
from sarcomm.coordinator.domain.reporters import last_sign_of_life
from sarcomm.v1 import coordinator_pb2 as pb

#: The proto's number of a failure reason (shared with the clients, which read it back).
failure_message = failure_to_proto


#: Why a generation shows FORMING although its world formed (see :func:`job_state`).
UNANNOUNCED = (
    "its world formed, but no member has been told its rank: the coordinator could not write its "
    "state yet (see its log), and answers the Joins once it can"
)


def job_state(job: Job) -> str:
    """The state ``job`` is shown in: its own, except that a world formed in memory of which no
    member has learned (no Join of it answered: its state could not be written, e.g. a full disk)
    shows FORMING, not RUNNING: nothing runs until a member is told its rank."""
    if job.state is JobState.RUNNING and job.members and not any(m.answered for m in job.members):
        return JobState.FORMING.value
    return job.state.value


def member_state(member: Member) -> str:
    """The state ``member`` is shown in: JOINING until its Join is answered (see :func:`job_state`)."""
    if member.state is MemberState.RUNNING and not member.answered:
        return MemberState.JOINING.value
    return member.state.value


def event_message(event: JobEvent) -> pb.JobEvent:
    return pb.JobEvent(
        # EventKind's numbers are the proto's (sarcomm.common.constants).
        kind=pb.JobEvent.Kind.ValueType(event.kind),
        job=event.job,
        generation=event.generation,
        rank=event.rank if event.rank is not None else -1,
        host=event.host,
        reason=event.reason,
        time=event.time,
        failure=failure_message(event.failure),
    )


def member_status(member: Member) -> pb.MemberStatus:
    return pb.MemberStatus(
        member_id=member.member_id,
        rank=member.rank if member.rank is not None else -1,
        local_rank=member.local_rank,
        host=member.host,
        address=member.address,
        interface=member.interface,
        state=member_state(member),
        exit_code=member.exit_code or 0,
        reason=member.reason,
        last_heartbeat=last_sign_of_life(member),
        progress=pb.Progress(
            seq=member.progress.seq,
            op=member.progress.op,
            in_collective=member.progress.in_collective,
            since=member.progress.since,
        ),
        metrics_address=member.metrics_address,
        failure=failure_message(member.failure),
    )


def stall_message(stall: Stall) -> pb.Stall:
    return pb.Stall(
        seq=stall.seq,
        op=stall.op,
        since=stall.since,
        waited_seconds=stall.waited,
        waiting_ranks=list(stall.waiting),
        blocking_ranks=list(stall.blocking),
    )


def _generation_record(record: dict[str, Any]) -> pb.GenerationRecord:
    failed = record.get("failed_rank")
    return pb.GenerationRecord(
        generation=record["generation"],
        state=record["state"],
        formed=record["formed"],
        ended=record["ended"],
        reason=record["reason"],
        failed_rank=failed if failed is not None else -1,
    )


def job_status(job: Job, stall: Stall | None = None, members: Sequence[Member] | None = None) -> pb.JobStatus:
    """``job`` as a message; ``stall`` is the membership's :meth:`~Membership.stall` of it;
    ``members`` the ones to list (default: every one, in rank order)."""
    counts = Counter(member_state(m) for m in job.members)
    state = job_state(job)
    return pb.JobStatus(
        job=job.name,
        generation=job.generation,
        state=state,
        world_size=job.world_size,
        master_addr=job.master_addr,
        master_port=job.master_port,
        restart_count=job.restart_count,
        created=job.created,
        formed=job.formed,
        ended=job.ended,
        members=[member_status(m) for m in (job.ranked_members() if members is None else members)],
        reason=UNANNOUNCED if state != job.state.value else job.reason,
        stall=stall_message(stall) if stall is not None else None,
        history=[_generation_record(r) for r in job.history],
        max_restarts=job.max_restarts,
        member_counts=counts,
        rerendezvous_count=job.rerendezvous_count,
        min_members=job.elastic.min_members if job.elastic else 0,
        max_members=job.elastic.max_members if job.elastic else 0,
        waiting_members=waiting(job),
        closed=job.closed is not None,
        parked_members=len(job.memory.successor.members) if job.memory.successor is not None else 0,
    )


@dataclass(frozen=True)
class MemberSelection:
    """Which members a ``ListJobs`` answer lists (see ``ListJobsRequest``): ``limit`` (0: no
    limit) from the ``offset``-th on, in rank order, of those in ``states`` (empty: any)."""

    limit: int = 0
    offset: int = 0
    states: frozenset[str] = frozenset()

    def of(self, job: Job) -> list[Member] | None:
        """The members of ``job`` to list; None: every one (no selection)."""
        if not (self.limit or self.offset or self.states):
            return None
        ranked = job.ranked_members()
        if self.states:
            ranked = [m for m in ranked if member_state(m) in self.states]
        return ranked[self.offset : self.offset + self.limit] if self.limit else ranked[self.offset :]


def jobs_message(
    jobs: list[Job],
    stall_of: Callable[[Job], Stall | None] | None = None,
    selection: MemberSelection = MemberSelection(),
) -> pb.ListJobsResponse:
    """``jobs`` as the ``ListJobsResponse``; ``stall_of`` is the membership's ``stall``;
    ``selection`` which members are listed.

    Reads the live jobs: call it on the event loop. The message is a copy, safe to use anywhere.
    """
    return pb.ListJobsResponse(
        jobs=[job_status(j, stall_of(j) if stall_of else None, selection.of(j)) for j in jobs]
    )


#: Members converted between two turns of the event loop (~2 ms of work; see jobs_json).
MEMBERS_PER_STEP = 1024


def member_view(member: Member) -> dict[str, Any]:
    """``member`` as ``/v1/jobs`` shows it: :func:`member_status` as protobuf's JSON mapping writes
    it (every field present, enums by name), ``progress.seq`` a number; made directly from the
    member, ~10x faster than through the message (32,768 members: 0.2 s against 3 s)."""
    progress = member.progress
    return {
        "member_id": member.member_id,
        "rank": member.rank if member.rank is not None else -1,
        "local_rank": member.local_rank,
        "host": member.host,
        "address": member.address,
        "interface": member.interface,
        "state": member_state(member),
        "exit_code": member.exit_code or 0,
        "reason": member.reason,
        "last_heartbeat": _json_double(last_sign_of_life(member)),
        "progress": {
            "seq": progress.seq,
            "op": progress.op,
            "in_collective": progress.in_collective,
            "since": _json_double(progress.since),
        },
        "metrics_address": member.metrics_address,
        "failure": pb.FailureReason.Name(failure_message(member.failure)),
    }


def _json_double(value: float) -> float | str:
    # protobuf's JSON mapping writes a double that is not finite as a string.
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


async def jobs_json(
    jobs: list[Job], stall_of: Callable[[Job], Stall | None], pause: Callable[[], Awaitable[None]]
) -> str:
    """The ``/v1/jobs`` document of ``jobs``: each job as :func:`job_status` in protobuf's JSON
    mapping (every field present, ``stall`` only while a job has one), members by
    :func:`member_view`; ``stall_of`` is the membership's ``stall``.

    It must stay on the event loop: in a thread it would hold the GIL that gRPC's poller needs for
    every event, and heartbeat acks waited hundreds of milliseconds (measured). So it awaits
    ``pause`` every MEMBERS_PER_STEP members, and heartbeats go through in between; what it keeps
    across a pause is text, which the garbage collector does not track (thousands of dicts kept
    there would be promoted to its oldest generation and bring on a full collection sooner). A job
    of up to MEMBERS_PER_STEP members is read in one step; a larger one's members piece by piece,
    each piece as it is when made.
    """
    documents: list[str] = []
    for job in jobs:
        status = job_status(job, stall_of(job), members=())
        head = _as_dict(status)
        if "stall" in head:
            head["stall"]["seq"] = int(head["stall"]["seq"])
        members = job.ranked_members()
        pieces: list[str] = []
        for start in range(0, len(members), MEMBERS_PER_STEP):
            piece = [member_view(m) for m in members[start : start + MEMBERS_PER_STEP]]
            pieces.append(json.dumps(piece)[1:-1])
            await pause()
        # The members go last: the head's closing brace gives way to them.
        members_text = ", ".join(p for p in pieces if p)
        documents.append(json.dumps(head)[:-1] + f', "members": [{members_text}]}}')
    return '{"jobs": [' + ", ".join(documents) + "]}"


def _as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
