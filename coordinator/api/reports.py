"""What one Heartbeat stream has reported, and the short way for the reports that repeat it.

A member's first report on a stream takes the full way (:meth:`CoordinatorService._handle_reports`):
every field checked, the secret checked against its digest, the metrics endpoint against the
member's host. An agent then sends the same member id, secret and endpoint every interval, with
only its age and progress new; at 32,768 ranks that is 32,768 reports a second, and the full way
cost ~11 us of the coordinator's loop per report (measured in process, 8-report requests), most
of it checking again what had not changed. :meth:`StreamReports.take` takes a request whose every
report repeats what this stream already had accepted (the member still current, its secret digest
the one it was checked against) and whose age and progress pass the same rules as
:mod:`validation`'s, and gives each report's (member, progress, age) for
:meth:`Membership.beats`. Anything else (a new member, another secret, a new endpoint or list of
workers' endpoints, a value a rule refuses, or unknown) goes the full way, which answers it exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sarcomm.common.messages import Progress
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.domain.model import Job, Member
from sarcomm.v1 import coordinator_pb2 as pb

#: Members one stream remembers at most (an agent reports its own few; a stream past this many
#: starts afresh and takes the full way for each again).
MAX_REMEMBERED = 65536

#: (secret, the membership's (job, member) pair it was checked with, the digest checked)
Accepted = tuple[str, tuple[Job, Member], str]


class StreamReports:
    """One Heartbeat stream: its identity, the members it reported, the jobs it watches, and what
    its reports looked like when they were accepted."""

    def __init__(self) -> None:
        # The stream's identity for the membership (Member.stream).
        self.token = object()
        self.reported: set[str] = set()
        self.watched: set[str] = set()
        self._accepted: dict[str, Accepted] = {}

    def accepted(self, member_id: str, secret: str, found: tuple[Job, Member]) -> None:
        """A report of ``member_id`` with ``secret`` was taken the full way (``found``: its job and
        member as the membership holds them)."""
        if len(self._accepted) >= MAX_REMEMBERED:
            self._accepted.clear()
        self._accepted[member_id] = (secret, found, found[1].secret_digest)

    def take(
        self, request: pb.HeartbeatRequest, current: Callable[[str], tuple[Job, Member] | None]
    ) -> list[tuple[Member, Progress | None, float]] | None:
        """Each report's (member, progress, age) when every report repeats an accepted one (see
        the module), else None. ``current`` is the membership's :meth:`~Membership.current`."""
        reports = request.reports
        if len(reports) > validation.MAX_REPORTS:
            return None
        accepted = self._accepted
        taken: list[tuple[Member, Progress | None, float]] = []
        for report in reports:
            member_id = report.member_id
            entry = accepted.get(member_id)
            if entry is None:
                return None
            secret, found, digest = entry
            member = found[1]
            # Still the member it was (current), with the secret it was checked against.
            if secret != report.secret or digest is not member.secret_digest:
                return None
            if current(member_id) is not found:
                return None
            age = report.age_seconds
            if not 0.0 <= age < math.inf:  # validation.age_seconds (NaN fails too)
                return None
            address = report.metrics_address
            if address and address != member.metrics_address:
                return None
            if report.HasField("worker_endpoints"):
                # A torchrun node's workers (one member, a few endpoints): the same list again?
                known = member.worker_endpoints
                listed = report.worker_endpoints.endpoints
                if len(listed) != len(known) or any(
                    (e.rank, e.local_rank, e.metrics_address) != k for e, k in zip(listed, known, strict=True)
                ):
                    return None
            progress = None
            if report.HasField("progress"):
                sent = report.progress
                seq, op, since = sent.seq, sent.op, sent.since
                # validation.progress: seq >= 0, a valid op name, a finite since (inf - inf is NaN).
                if seq < 0 or since - since != 0.0 or not validation.valid_op(op):
                    return None
                progress = Progress(seq, op, sent.in_collective, since)
            taken.append((member, progress, age))
        return taken
