"""What a reporter by exception sends (issue 28): a pure decision over one interval's reports.

A reporter that took the coordinator's :class:`~sarcomm.common.messages.ReportPolicy` (the proto's
``ReportPolicy`` comment is the spec) still makes a report of every member each interval, locally
and cheaply, and hands them to :func:`decide` with the Unix time, the policy, the jobs whose
progress the coordinator asked for (and when), and what it last sent (:class:`SentState`). The
answer says which reports go now (often none) and whether an empty request is due to renew the
stream's lease. A member is sent when, and only when:

- it is new to this stream's record (the first request by exception carries every member: a full
  report that also tells the coordinator the reporter switched);
- its age crosses ``silence_seconds`` (judged silent: once), or it is fresh again after that;
- it has been inside one collective (same ``seq``, ``in_collective``) for longer than
  ``quiet_seconds`` (once per collective), or it moves (another ``seq``, or out of the collective)
  after having been reported quiet;
- its metrics address or its worker endpoints differ from what was last sent;
- it asks to close its job (``close_job``: each report that asks goes);
- the coordinator asked for its job's progress: every member of the job at the first decision after
  the ask, then each member whose progress differs from what was last sent, each interval, until
  ``progress_seconds`` after the ask.

With nothing to send and ``lease_seconds`` passed since the last request: an empty request. No I/O,
no clock: times come in, the caller keeps the state (one per stream: a new stream starts empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sarcomm.common.messages import MemberReport, Progress, ReportPolicy, WorkerEndpoint

__all__ = ["Decision", "MemberSent", "SentState", "decide"]


@dataclass(frozen=True)
class MemberSent:
    """What the coordinator last heard of one member, and what the reporter concluded from it."""

    progress: Progress | None
    metrics_address: str
    worker_endpoints: tuple[WorkerEndpoint, ...] | None
    #: Whether the last report sent said it silent (its age at least ``silence_seconds``).
    silent: bool
    #: The ``seq`` of the collective it was reported quiet in (None: not reported quiet).
    quiet_seq: int | None = None


@dataclass
class SentState:
    """A reporter's record for one stream: per member what it last sent, when it last sent any
    request (Unix time; None: none by exception yet), and the progress asks already answered
    (job: the time of the ask)."""

    members: dict[str, MemberSent] = field(default_factory=dict)
    last_request: float | None = None
    answered: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """The reports to send now (in the order given), and whether an empty request is due instead."""

    reports: tuple[MemberReport, ...]
    lease: bool

    @property
    def send(self) -> bool:
        """Whether a request goes now (reports, or an empty lease renewal)."""
        return bool(self.reports) or self.lease


def _quiet(report: MemberReport, now: float, quiet_seconds: float) -> bool:
    p = report.progress
    return p is not None and p.in_collective and now - p.since > quiet_seconds


def decide(
    reports: Sequence[MemberReport],
    policy: ReportPolicy,
    now: float,
    asked: Mapping[str, float],
    state: SentState,
    job: str,
) -> Decision:
    """Decide what goes now, and update ``state`` as if it went (the caller sends it).

    ``reports`` are every member's reports this interval (all of ``job``); ``asked`` maps a job to
    the Unix time the coordinator last asked for its progress (``progress_wanted``)."""
    asked_at = asked.get(job)
    answered_at = state.answered.get(job)
    ask_new = asked_at is not None and (answered_at is None or asked_at > answered_at)
    in_window = asked_at is not None and now - asked_at <= policy.progress_seconds
    if ask_new and asked_at is not None:
        state.answered[job] = asked_at
    out: list[MemberReport] = []
    seen: set[str] = set()
    for report in reports:
        seen.add(report.member_id)
        before = state.members.get(report.member_id)
        silent = report.age >= policy.silence_seconds
        quiet = _quiet(report, now, policy.quiet_seconds)
        p = report.progress
        quiet_seq = before.quiet_seq if before is not None else None
        if before is None:
            due = True
        else:
            moved = quiet_seq is not None and (p is None or p.seq != quiet_seq or not p.in_collective)
            newly_quiet = quiet and p is not None and p.seq != quiet_seq
            endpoints_changed = report.worker_endpoints not in (None, before.worker_endpoints)
            due = (
                silent != before.silent
                or newly_quiet
                or moved
                or report.metrics_address != before.metrics_address
                or endpoints_changed
                or report.close_job
                or ask_new
                or (in_window and p != before.progress)
            )
        if not due:
            continue
        out.append(report)
        if quiet and p is not None:
            quiet_seq = p.seq
        elif quiet_seq is not None and (p is None or p.seq != quiet_seq or not p.in_collective):
            quiet_seq = None
        endpoints = report.worker_endpoints
        if endpoints is None and before is not None:
            endpoints = before.worker_endpoints  # none sent: the coordinator keeps what it had
        state.members[report.member_id] = MemberSent(p, report.metrics_address, endpoints, silent, quiet_seq)
    for gone in state.members.keys() - seen:  # exited: told by Leave, not here
        del state.members[gone]
    lease = not out and (state.last_request is None or now - state.last_request >= policy.lease_seconds)
    if out or lease:
        state.last_request = now
    return Decision(tuple(out), lease)
