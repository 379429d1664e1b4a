"""``sar-coordinator status``: jobs, members, health and each rank's last collective, as a table.

Given the replicas of a coordinator (``--coord a:50051,b:50051``), it first shows each one's role
(leader, standby, or down with the reason), then the leader's jobs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from google.protobuf import json_format

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.replicas import ReplicaRole
from sarcomm.common.errors import CoordinatorUnavailableError
from sarcomm.common.tls import ClientTls
from sarcomm.v1 import coordinator_pb2 as pb


async def fetch_jobs(
    target: str,
    job: str = "",
    timeout: float = 10.0,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
) -> pb.ListJobsResponse:
    """The coordinator's view of ``job`` (all jobs when empty); waits up to ``timeout`` seconds.

    ``token`` is sent as ``authorization: Bearer <token>``; ``tls`` makes the channel TLS.

    Raises:
        SarcommError: as :meth:`CoordinatorClient.list_jobs` raises it (a refused token, a TLS
            failure named by side, a coordinator not reached within ``timeout`` ...).
    """
    async with CoordinatorClient(target, token, timeout=timeout, tls=tls) as client:
        return pb.ListJobsResponse(jobs=await client.list_jobs(job))


async def fetch_status(
    target: str,
    job: str = "",
    timeout: float = 10.0,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
) -> tuple[list[ReplicaRole], pb.ListJobsResponse]:
    """Each replica's role (none for a single address) and the leader's view of ``job``, as
    :func:`fetch_jobs`; waits up to ``timeout`` seconds.

    Raises:
        CoordinatorUnavailableError: no replica leads (the message names each one's role).
        SarcommError: as :func:`fetch_jobs`.
    """
    async with CoordinatorClient(target, token, timeout=timeout, tls=tls) as client:
        if len(client.targets) == 1:
            return [], pb.ListJobsResponse(jobs=await client.list_jobs(job))
        roles = await client.roles(timeout)
        if not any(r.role == "leader" for r in roles):
            raise CoordinatorUnavailableError(
                f"No coordinator of {', '.join(client.targets)} leads: {_describe_roles(roles)}."
            )
        return roles, pb.ListJobsResponse(jobs=await client.list_jobs(job))


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
