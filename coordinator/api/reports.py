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

A report's monitoring fields (its progress, its metrics endpoint, its workers' endpoints) cost only
themselves when they break a rule (:func:`check_report`, :func:`check_own`): the field, or the one
entry of the list, is dropped and the rest of the report taken; the coordinator's log and the
reporter hear each refusal once per stream (:meth:`StreamReports.tell`), and a report that repeats
the same refused values takes the short way (it is compared with what was sent, not with what was
kept). A member is never failed for its metrics endpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import Progress, WorkerEndpoint
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.domain.model import Job, Member
from sarcomm.coordinator.domain.reporters import Reporter
from sarcomm.v1 import coordinator_pb2 as pb

#: Members one stream remembers at most (an agent reports its own few; a stream past this many
#: starts afresh and takes the full way for each again).
MAX_REMEMBERED = 65536

#: A list of workers' endpoints as a report sent it: (rank, local rank, metrics address) each.
SentEndpoints = tuple[tuple[int, int, str], ...]
#: (secret, the membership's (job, member) pair it was checked with, the digest checked, the metrics
#: address and the workers' endpoints as sent (None: never sent on this stream))
Accepted = tuple[str, tuple[Job, Member], str, str, SentEndpoints | None]


@dataclass
class CheckedReport:
    """One report taken the full way: its fields as the rules keep them (``address`` ``""`` and
    ``progress``/``endpoints`` None when refused or absent), what it sent, and one line per
    refused field."""

    member_id: str
    secret: str
    age: float
    progress: Progress | None
    address: str
    endpoints: tuple[WorkerEndpoint, ...] | None
    sent_address: str
    sent_endpoints: SentEndpoints | None
    refused: list[str] = field(default_factory=list)


def check_report(report: pb.MemberReport, where: str) -> CheckedReport:
    """``report`` (``where``: how the request names it, ``reports[i]``) checked field by field.

    Raises:
        InvalidArgumentError: its member id, secret or age breaks its rule (the request is refused).
    """
    member_id = validation.member_id(report.member_id, f"{where}.member_id")
    secret = validation.secret(report.secret, f"{where}.secret")
    age = validation.age_seconds(report.age_seconds, f"{where}.age_seconds")
    refused: list[str] = []
    progress = None
    if report.HasField("progress"):
        try:
            progress = validation.progress(report.progress, f"{where}.progress")
        except InvalidArgumentError as error:
            refused.append(str(error))
    address = report.metrics_address
    try:
        validation.metrics_address(address, f"{where}.metrics_address")
    except InvalidArgumentError as error:
        refused.append(str(error))
        address = ""
    endpoints = sent = None
    if report.HasField("worker_endpoints"):
        listed = report.worker_endpoints.endpoints
        sent = tuple((e.rank, e.local_rank, e.metrics_address) for e in listed)
        endpoints, dropped = validation.worker_endpoints(listed, f"{where}.worker_endpoints.endpoints")
        refused.extend(dropped)
    return CheckedReport(
        member_id, secret, age, progress, address, endpoints, report.metrics_address, sent, refused
    )


def check_own(checked: CheckedReport, member: Member, where: str) -> None:
    """Drop from ``checked`` the endpoints that are not on ``member``'s own host (each checked once
    per new value: a value the member already holds passed before)."""
    address = checked.address
    if address and address != member.metrics_address:
        try:
            own = validation.own_metrics_address
            own(address, f"{where}.metrics_address", member.host, member.interfaces)
        except InvalidArgumentError as error:
            checked.refused.append(str(error))
            checked.address = ""
    endpoints = checked.endpoints
    if endpoints is None or endpoints == member.worker_endpoints:
        return
    kept: list[WorkerEndpoint] = []
    # Each entry's index in the list as sent (the refusal names it as the reporter wrote it).
    index: dict[int, int] = {}
    for i, sent in enumerate(checked.sent_endpoints or ()):
        index.setdefault(sent[0], i)
    for endpoint in endpoints:
        j = index[endpoint.rank]
        try:
            validation.own_metrics_address(
                endpoint.address,
                f"{where}.worker_endpoints.endpoints[{j}].metrics_address",
                member.host,
                member.interfaces,
            )
        except InvalidArgumentError as error:
            checked.refused.append(str(error))
            continue
        kept.append(endpoint)
    checked.endpoints = tuple(kept)


class StreamReports:
    """One Heartbeat stream: its identity, the members it reported, the jobs it watches, and what
    its reports looked like when they were accepted."""

    def __init__(self) -> None:
        # The stream as the membership knows it (Member.stream): whether it reports by exception,
        # its lease, the members it reported.
        self.reporter = Reporter()
        self.token = self.reporter
        self.reported: set[str] = self.reporter.members
        self.watched: set[str] = set()
        self._accepted: dict[str, Accepted] = {}
        # The refusals last told of each member (see tell).
        self._told: dict[str, frozenset[str]] = {}

    def accepted(self, checked: CheckedReport, found: tuple[Job, Member]) -> None:
        """``checked`` was taken the full way (``found``: its job and member as the membership
        holds them)."""
        if len(self._accepted) >= MAX_REMEMBERED:
            self._accepted.clear()
        member_id, sent = checked.member_id, checked.sent_endpoints
        if sent is None:  # not sent: unchanged
            before = self._accepted.get(member_id)
            sent = before[4] if before is not None else None
        digest = found[1].secret_digest
        self._accepted[member_id] = (checked.secret, found, digest, checked.sent_address, sent)

    def tell(self, member_id: str, refused: list[str]) -> list[str]:
        """Of ``refused`` (a report's refusals), those not told of ``member_id`` on this stream the
        last time: a reporter that keeps sending a bad value hears of it once."""
        lines = frozenset(refused)
        told = self._told.get(member_id, frozenset())
        if lines != told:
            if len(self._told) >= MAX_REMEMBERED:
                self._told.clear()
            self._told[member_id] = lines
        return [line for line in refused if line not in told]

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
            secret, found, digest, sent_address, sent_endpoints = entry
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
            # Compared with what was sent (and checked) before: a refused value sent again is
            # refused again, and was told already.
            if address and address != sent_address:
                return None
            if report.HasField("worker_endpoints"):
                # A torchrun node's workers (one member, a few endpoints): the same list again?
                listed = report.worker_endpoints.endpoints
                if (
                    sent_endpoints is None
                    or len(listed) != len(sent_endpoints)
                    or any(
                        (e.rank, e.local_rank, e.metrics_address) != k
                        for e, k in zip(listed, sent_endpoints, strict=True)
                    )
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
