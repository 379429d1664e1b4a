"""``sar-coordinator status``: jobs, members, health and each rank's last collective, as a table.

Given the replicas of a coordinator (``--coord a:50051,b:50051``), it first shows each one's role
(leader, standby, or down with the reason), then the leader's jobs. A job of more than
:data:`SUMMARY_MEMBERS` members is summarised (its members counted by state, the failed ones and
the ranks the others wait for listed) instead of 32,768 rows; ``--all`` lists every member and
``--members 0-15,100`` the ranks given, a page of members per call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import json_format

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.replicas import ReplicaRole
from sarcomm.common.errors import CoordinatorUnavailableError, InvalidArgumentError
from sarcomm.common.tls import ClientTls
from sarcomm.v1 import coordinator_pb2 as pb

#: Jobs of more members than this are summarised: members counted by state, the failed ones and
#: the ranks others wait for listed (``--all`` lists every member, ``--members`` some ranks).
SUMMARY_MEMBERS = 64
#: Members per ListJobs call when listing many (a 32,768-member job does not fit one answer).
PAGE_MEMBERS = 4096
#: Ranks others wait for listed at most in a summary (the stall line names them all).
BLOCKING_LISTED = 16


@dataclass(frozen=True)
class MemberView:
    """Which members ``status`` lists: a summary of big jobs (the default), ``every`` member,
    or the members of ``ranks`` (inclusive ranges)."""

    every: bool = False
    ranks: tuple[tuple[int, int], ...] = ()


def parse_ranks(text: str) -> tuple[tuple[int, int], ...]:
    """``0-7,100`` as ((0, 7), (100, 100)).

    Raises:
        InvalidArgumentError: a part is not N or N-M with 0 <= N <= M.
    """
    ranges = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isdigit() and (high.isdigit() if dash else True)) or (dash and int(high) < int(low)):
            raise InvalidArgumentError(
                f"{part.strip()!r} must be a rank N or a range N-M with N <= M, e.g. --members 0-7,100"
            )
        ranges.append((int(low), int(high) if dash else int(low)))
    return tuple(ranges)


async def fetch_jobs(
    target: str,
    job: str = "",
    timeout: float = 10.0,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    view: MemberView = MemberView(every=True),
) -> pb.ListJobsResponse:
    """The coordinator's view of ``job`` (all jobs when empty), the members chosen by ``view``
    (default: every one); waits up to ``timeout`` seconds per call.

    ``token`` is sent as ``authorization: Bearer <token>``; ``tls`` makes the channel TLS.

    Raises:
        SarcommError: as :meth:`CoordinatorClient.list_jobs` raises it (a refused token, a TLS
            failure named by side, a coordinator not reached within ``timeout`` ...).
    """
    async with CoordinatorClient(target, token, timeout=timeout, tls=tls) as client:
        return await _jobs(client, job, view)


async def fetch_status(
    target: str,
    job: str = "",
    timeout: float = 10.0,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    view: MemberView = MemberView(),
) -> tuple[list[ReplicaRole], pb.ListJobsResponse]:
    """Each replica's role (none for a single address) and the leader's view of ``job``, as
    :func:`fetch_jobs` (default: big jobs summarised); waits up to ``timeout`` seconds.

    Raises:
        CoordinatorUnavailableError: no replica leads (the message names each one's role).
        SarcommError: as :func:`fetch_jobs`.
    """
    async with CoordinatorClient(target, token, timeout=timeout, tls=tls) as client:
        if len(client.targets) == 1:
            return [], await _jobs(client, job, view)
        roles = await client.roles(timeout)
        if not any(r.role == "leader" for r in roles):
            raise CoordinatorUnavailableError(
                f"No coordinator of {', '.join(client.targets)} leads: {_describe_roles(roles)}."
            )
        return roles, await _jobs(client, job, view)


async def _jobs(client: CoordinatorClient, job: str, view: MemberView) -> pb.ListJobsResponse:
    """The jobs with the members ``view`` asks for, a page of members per call."""
    first = await client.list_jobs(job, member_limit=PAGE_MEMBERS if view.every else SUMMARY_MEMBERS)
    for status in first:
        total = sum(status.member_counts.values())
        if len(status.members) >= total and not view.ranks:
            continue  # all there (or a coordinator that does not count: it lists every member)
        if view.every:
            members = await _members(client, status.job, len(status.members), total)
        elif view.ranks:
            # In a formed world rank R is the R-th member in rank order.
            members = []
            for low, high in view.ranks:
                members += await _members(client, status.job, low, high + 1)
            members = [m for m in members if any(low <= m.rank <= high for low, high in view.ranks)]
        else:
            members = await _notable(client, status)
        keep = list(status.members)[: len(status.members) if view.every else 0]
        del status.members[:]
        status.members.extend(sorted({m.member_id: m for m in [*keep, *members]}.values(), key=_rank_order))
    return pb.ListJobsResponse(jobs=first)


async def _members(client: CoordinatorClient, job: str, start: int, end: int) -> list[pb.MemberStatus]:
    """Members ``start`` to ``end`` (exclusive) of ``job`` in rank order, a page per call."""
    members: list[pb.MemberStatus] = []
    at = start
    while at < end:
        page = await client.list_jobs(job, member_limit=min(PAGE_MEMBERS, end - at), member_offset=at)
        listed = list(page[0].members) if page and page[0].job == job else []
        members += listed
        if not listed:
            break
        at += len(listed)
    return members


async def _notable(client: CoordinatorClient, status: pb.JobStatus) -> list[pb.MemberStatus]:
    """The members a summary lists: the failed ones (the first SUMMARY_MEMBERS), then the ranks
    the others wait for (the first BLOCKING_LISTED; in a running world rank R is the R-th)."""
    failed = await client.list_jobs(status.job, member_limit=SUMMARY_MEMBERS, member_states=["FAILED"])
    members = list(failed[0].members) if failed else []
    if status.HasField("stall"):
        for rank in list(status.stall.blocking_ranks)[:BLOCKING_LISTED]:
            members += [m for m in await _members(client, status.job, rank, rank + 1) if m.rank == rank]
    return members


def _rank_order(member: pb.MemberStatus) -> tuple[bool, int]:
    return (member.rank < 0, member.rank)


def _describe_roles(roles: Sequence[ReplicaRole]) -> str:
    return "; ".join(f"{r.address} is {r.role}" + (f" ({r.reason})" if r.reason else "") for r in roles)


def render_roles(roles: Sequence[ReplicaRole]) -> str:
    """The replicas' table: address, role, and why a replica is down."""
    rows = [
        ["COORDINATOR", "ROLE"],
        *([r.address, f"{r.role} ({r.reason})" if r.reason else r.role] for r in roles),
    ]
    return "\n".join(_table(rows))


def _ago(timestamp: float, now: float) -> str:
    if not timestamp:
        return "-"
    seconds = max(0.0, now - timestamp)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render(response: pb.ListJobsResponse, now: float | None = None) -> str:
    """Human-readable table of every job and its members."""
    now = time.time() if now is None else now
    if not response.jobs:
        return "no jobs"
    lines: list[str] = []
    for job in response.jobs:
        master = f"{job.master_addr}:{job.master_port}" if job.master_addr else "-"
        restarts = str(job.restart_count)
        if job.max_restarts:
            restarts += f" of {job.max_restarts}"
        if job.state == "FAILED" and job.max_restarts and job.restart_count >= job.max_restarts:
            restarts += " (none left)"
        size = str(job.world_size)
        if job.max_members:
            size += f" (elastic {job.min_members}..{job.max_members}"
            size += f", {job.waiting_members} waiting" if job.waiting_members else ""
            beyond = job.parked_members - job.waiting_members
            size += f", {beyond} beyond max" if beyond > 0 else ""
            size += ", closed)" if job.closed and job.state == "RUNNING" else ")"
        lines.append(
            f"job {job.job}  generation {job.generation}  {job.state}  world_size {size}  "
            f"master {master}  restarts {restarts}"
            + (f"  re-rendezvous {job.rerendezvous_count}" if job.rerendezvous_count else "")
        )
        if job.reason:
            lines.append(f"  reason: {job.reason}")
        if job.HasField("stall"):
            lines.append(f"  stalled: {_describe_stall(job.stall)}")
        for record in job.history:
            why = f": {record.reason}" if record.reason else ""
            lines.append(f"  generation {record.generation} {record.state}{why}")
        total = sum(job.member_counts.values())
        if len(job.members) < total:
            counts = ", ".join(f"{job.member_counts[s]} {s}" for s in _STATES if job.member_counts.get(s))
            lines.append(
                f"  members: {counts}; {len(job.members)} of {total} listed (the failed ones and the ranks "
                "others wait for; --all lists every member, --members 0-15,100 the ranks given)"
            )
            if not job.members:
                lines.append("")
                continue
        rows = [["RANK", "HOST", "INTERFACE", "ADDRESS", "STATE", "EXIT", "HEARTBEAT", "LAST COLLECTIVE"]]
        for m in job.members:
            progress = m.progress
            if progress.seq:
                where = "in" if progress.in_collective else "after"
                last = f"#{progress.seq} {progress.op} ({where}, {_ago(progress.since, now)})"
            else:
                last = "-"
            exit_code = str(m.exit_code) if m.state in ("LEFT", "FAILED") else "-"
            state = m.state if not m.reason or m.state == "LEFT" else f"{m.state} ({m.reason})"
            rows.append(
                [
                    str(m.rank),
                    m.host,
                    m.interface or "-",
                    m.address or "-",
                    state,
                    exit_code,
                    _ago(m.last_heartbeat, now),
                    last,
                ]
            )
        lines.extend("  " + line for line in _table(rows))
        lines.append("")
    return "\n".join(lines).rstrip()


#: Member states in the order a summary counts them.
_STATES = ("JOINING", "RUNNING", "LEFT", "FAILED")


def _describe_stall(stall: pb.Stall) -> str:
    blocking = ", ".join(str(r) for r in stall.blocking_ranks[:16])
    if len(stall.blocking_ranks) > 16:
        blocking += f", ... ({len(stall.blocking_ranks)} in all)"
    return (
        f"{len(stall.waiting_ranks)} rank(s) have waited {stall.waited_seconds:.1f} s in collective "
        f"#{stall.seq} ({stall.op or 'unknown op'}) for rank(s) {blocking}, which have not entered it"
    )


def render_json(response: pb.ListJobsResponse, roles: Sequence[ReplicaRole] = ()) -> str:
    """The jobs as JSON (``sarcomm.v1.ListJobsResponse``'s fields); with replicas, also
    ``coordinators``: each one's ``address``, ``role`` and ``reason``."""
    view = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if roles:
        view["coordinators"] = [{"address": r.address, "role": r.role, "reason": r.reason} for r in roles]
    return json.dumps(view, indent=2)
