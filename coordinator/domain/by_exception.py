"""Reports by exception on the membership's side: which members the sweep judges, leases, and
when a job's progress is asked for.

:class:`ReportsByException` keeps, per formed job, the members the liveness sweep must judge
(``JobMemory.judged``): every member, but those *trusted* (see :mod:`.reporters`): a fresh report
over an open by-exception stream takes a member out; a report saying it is silent, a report over
a per-interval stream, or the end of its stream puts it back. A per-interval reporter's members
are never trusted, so the sweep judges them exactly as before. Once a second
(:meth:`ReportsByException.check`) it fails the trusted members of every stream whose lease ran
out and asks again for the progress of jobs with a member still reported quiet.

Like :class:`~.sweep.LivenessSweep`, it acts through the membership's
:class:`~.context.MembershipContext` and changes states only through its state machine.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable

from sarcomm.common.constants import FailureReason
from sarcomm.common.messages import Progress
from sarcomm.coordinator.domain import policy
from sarcomm.coordinator.domain.context import MembershipContext
from sarcomm.coordinator.domain.model import Job, JobState, Member, MemberState, member_rank, rank_list
from sarcomm.coordinator.domain.policy import LEASE_PERIODS
from sarcomm.coordinator.domain.reporters import Reporter, lease_expired, lease_reason

log = logging.getLogger(__name__)

__all__ = ["ReportsByException", "judge", "trust"]


def trust(job: Job, member: Member) -> None:
    """``member``'s open by-exception stream stands for it: the sweep stops visiting it."""
    member.trusted = True
    job.memory.judged.pop(member.member_id, None)


def judge(job: Job, member: Member) -> None:
    """``member`` is judged by the sweep again (only a RUNNING one needs it)."""
    member.trusted = False
    if member.state is MemberState.RUNNING:
        job.memory.judged[member.member_id] = member


class ReportsByException:
    """The by-exception part of a :class:`~sarcomm.coordinator.domain.membership.Membership`."""

    def __init__(self, context: MembershipContext) -> None:
        self._m = context
        # The open by-exception streams (their leases are checked).
        self.reporters: set[Reporter] = set()
        # When each stream's lease may run out at the earliest, soonest first: a check looks only
        # at the streams due (a stream renewed since is put back with its new deadline), not at
        # every stream each second (8,192 of them at 65,536 ranks: ~7 ms a check, measured).
        self._deadlines: list[tuple[float, int, Reporter]] = []
        self._pushed = itertools.count()
        #: Told of each job whose members' progress is wanted now (the service pushes
        #: ``progress_wanted`` to the job's by-exception streams); the server sets it.
        self.ask_progress: Callable[[Job], object] = lambda job: None

    def took_policy(self, reporter: Reporter, lease_seconds: float) -> None:
        """``reporter``'s stream reports by exception from now on, under a lease of
        ``lease_seconds``: the members whose last report on it was fresh are trusted."""
        m = self._m
        reporter.by_exception = True
        reporter.lease_seconds = lease_seconds
        reporter.renewed(m.clock.monotonic(), m.clock.wall())
        self.reporters.add(reporter)
        self._due(reporter)
        silence = m.timeouts.silence
        for member_id in reporter.members:
            found = m.member(member_id)
            if found is None:
                continue
            job, member = found
            fresh = member.last_report - member.last_seen < silence
            if member.stream is reporter and member.state is MemberState.RUNNING and fresh:
                trust(job, member)

    def _due(self, reporter: Reporter) -> None:
        deadline = reporter.last_message + LEASE_PERIODS * reporter.lease_seconds
        heapq.heappush(self._deadlines, (deadline, next(self._pushed), reporter))

    def renew(self, reporter: Reporter) -> None:
        """A request arrived on by-exception ``reporter``'s stream: its lease is renewed."""
        reporter.renewed(self._m.clock.monotonic(), self._m.clock.wall())

    def reported(
        self, job: Job, member: Member, stream: object | None, progress: Progress | None, age: float
    ) -> None:
        """A report of ``member`` arrived over ``stream`` (after ``liveness.note_report``)."""
        if not (isinstance(stream, Reporter) and stream.by_exception):
            if member.trusted:  # now reported by a per-interval stream: judged as its reports say
                judge(job, member)
            return
        m = self._m
        if member.state is not MemberState.RUNNING:
            return
        if age < m.timeouts.silence:
            if not member.trusted:
                trust(job, member)
        elif member.trusted:
            judge(job, member)  # its reporter says it went silent: judged from its age
        if progress is not None:
            self._quiet_report(job, member, progress)

    def _quiet_report(self, job: Job, member: Member, progress: Progress) -> None:
        m = self._m
        quiet = job.memory.quiet
        inside = m.clock.wall() - progress.since
        if progress.in_collective and inside >= policy.quiet_seconds(m.timeouts.stall):
            first = not quiet
            quiet[member.member_id] = (member, progress.seq)
            if first:
                self._ask(job, m.clock.monotonic())
        else:
            quiet.pop(member.member_id, None)

    def progress_wanted(self, job: Job) -> bool:
        """Whether to ask ``job``'s reporters for its progress now (``status`` of the job): not
        when it was asked within progress_seconds / 2, since its reporters still send each change
        every interval then (a ``status --watch`` must not make every agent send every report
        each time). Counts as asked."""
        now = self._m.clock.monotonic()
        asked = job.memory.progress_asked
        if asked and now - asked < policy.progress_seconds(self._m.timeouts.stall) / 2:
            return False
        job.memory.progress_asked = now
        return True

    def _ask(self, job: Job, now: float) -> None:
        job.memory.progress_asked = now
        log.info("%s: a rank is quiet in a collective; asking its reporters for progress", job.label)
        self.ask_progress(job)

    def ended(self, reporter: Reporter) -> None:
        """``reporter``'s stream ended (broken or closed): the members it stood for are judged
        again, as alive until now (the stream, which keepalive pings proved, stood for them)."""
        if not reporter.open:
            return
        reporter.open = False
        self.reporters.discard(reporter)
        m = self._m
        now = m.clock.monotonic()
        for member_id in reporter.members:
            found = m.member(member_id)
            if found is None:
                continue
            job, member = found
            if member.stream is reporter and member.trusted:
                member.last_seen = max(member.last_seen, now)
                member.last_report = now
                judge(job, member)

    def excuse(self, seconds: float) -> None:
        """The coordinator was not listening for ``seconds``: leases do not run meanwhile."""
        for reporter in self.reporters:
            reporter.last_message += seconds

    def check(self) -> list[tuple[Job, Member]]:
        """Fail the trusted members of each stream whose lease ran out; ask again for the
        progress of jobs a member of which is still reported quiet. Returns the failed members."""
        m = self._m
        now = m.clock.monotonic()
        failed: list[tuple[Job, Member]] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] < now:
            reporter = heapq.heappop(deadlines)[2]
            if reporter not in self.reporters:
                continue  # its stream ended
            if lease_expired(reporter, now):
                failed += self._expire(reporter, now)
            else:
                self._due(reporter)  # renewed since (or its lease grew): due later
        again = policy.progress_seconds(m.timeouts.stall) / 2
        for job in m.jobs():
            quiet = job.memory.quiet
            if not quiet:
                continue
            for member_id, (member, seq) in list(quiet.items()):
                progress = member.progress
                moved = progress.seq != seq or not progress.in_collective
                if moved or member.state is not MemberState.RUNNING:
                    del quiet[member_id]
            if quiet and now - job.memory.progress_asked >= again:
                self._ask(job, now)
        return failed

    def _expire(self, reporter: Reporter, now: float) -> list[tuple[Job, Member]]:
        m = self._m
        reason = lease_reason(reporter, now)
        reporter.open = False
        self.reporters.discard(reporter)
        failed: list[tuple[Job, Member]] = []
        changed: dict[str, Job] = {}
        for member_id in sorted(reporter.members):
            found = m.member(member_id)
            if found is None:
                continue
            job, member = found
            if member.stream is not reporter or not member.trusted or member.state is not MemberState.RUNNING:
                continue
            member.trusted = False
            m.machine.member_to(job, member, MemberState.FAILED, reason, FailureReason.MISSED_HEARTBEATS)
            failed.append((job, member))
            changed[job.name] = job
        if failed:
            ranks = rank_list(sorted(member_rank(member) for _, member in failed))
            log.warning("rank(s) %s on host %s failed: %s", ranks, failed[0][1].host, reason)
        for job in changed.values():
            m.changed(job)
        return failed

    def check_invariants(self, jobs: list[Job]) -> None:
        """Raise AssertionError when the judged members disagree with the jobs (for tests)."""
        for reporter in self.reporters:
            assert reporter.open, "a reporter whose stream ended is registered"
            assert reporter.by_exception, "a per-interval reporter is registered"
        for job in jobs:
            if job.memory.judged:
                ids = {id(member) for member in job.members}
                for member_id, member in job.memory.judged.items():
                    assert member.member_id == member_id, f"{member_id} judged as {member.member_id}"
                    assert id(member) in ids, f"{job.label}: judged {member_id} is not its member"
                    assert not member.trusted, f"{job.label}: {member_id} both trusted and judged"
            for member in job.members:
                if member.state is not MemberState.RUNNING or job.state is JobState.FORMING:
                    continue
                name = f"{job.label}: trusted {member.member_id}"
                if member.trusted:
                    stream = member.stream
                    assert isinstance(stream, Reporter), f"{name} has no reporter"
                    assert stream in self.reporters, f"{name}: its stream is over"
                    assert member.member_id in stream.members, f"{name} by a stream that never reported it"
                    assert member.lost_at is None, f"{name} has a broken stream"
                else:
                    assert job.memory.judged.get(member.member_id) is member, (
                        f"{job.label}: running {member.member_id} neither trusted nor judged"
                    )
