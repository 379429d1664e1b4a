"""The liveness side of the membership: streams that broke or ended, the sweep that fails silent
members, and stalls.

:class:`LivenessSweep` applies the rules of :mod:`liveness` to the membership's own jobs and
members, through the :class:`~.context.MembershipContext` it is given; it is kept in a module of
its own for size, and changes states only through the membership's state machine.
:class:`~sarcomm.coordinator.domain.membership.Membership` offers its methods under the same names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from sarcomm.coordinator.domain import liveness
from sarcomm.coordinator.domain.by_exception import ReportsByException
from sarcomm.coordinator.domain.context import MembershipContext
from sarcomm.coordinator.domain.model import (
    Job,
    JobState,
    Member,
    MemberState,
    Stall,
    member_rank,
    rank_list,
)
from sarcomm.coordinator.domain.reporters import Reporter

log = logging.getLogger(__name__)

__all__ = ["STALL_CHECK_PERIOD_S", "LivenessSweep"]

#: How often the liveness sweep looks for stalls to log (seconds of the monotonic clock).
STALL_CHECK_PERIOD_S = 1.0


class LivenessSweep:
    """The liveness part of a :class:`~sarcomm.coordinator.domain.membership.Membership`."""

    def __init__(
        self,
        context: MembershipContext,
        form_if_ready: Callable[[Job], bool],
        by_exception: ReportsByException,
    ) -> None:
        self._m = context
        self._by_exception = by_exception
        # An elastic world's last call (see .elastic): the sweep is the clock that calls it.
        self._form_if_ready = form_if_ready
        self._stall_checked = float("-inf")

    def stream_lost(self, stream: object, member_ids: Iterable[str]) -> None:
        """The stream ``stream``, which carried reports of ``member_ids``, broke without an orderly
        end: its process (or the agent reporting for it) most likely died, since the kernel closes
        a dead process's connections. Each of those members that no newer stream reports fails
        once ``lost_grace`` has passed without a report (see :meth:`sweep`)."""
        m = self._m
        if isinstance(stream, Reporter):
            self._by_exception.ended(stream)  # its trusted members: alive until now, judged again
        now = m.clock.monotonic()
        lost: list[Member] = []
        for member_id in member_ids:
            found = m.member(member_id)
            if found is None:
                continue
            member = found[1]
            if member.stream is stream and member.state is MemberState.RUNNING and member.lost_at is None:
                member.lost_at = now
                lost.append(member)
        if lost:
            ranks = rank_list(sorted(member_rank(m) for m in lost))
            log.info(
                "the heartbeat stream of rank(s) %s on host %s broke; judging them in %g s unless they "
                "report again", ranks, lost[0].host, m.timeouts.lost_grace,
            )  # fmt: skip

    def stream_closed(self, stream: object, member_ids: Iterable[str]) -> None:
        """The stream ``stream`` ended in order: its members are judged by their reports alone
        from now on (a quiet member of an open stream is not, see :mod:`liveness`)."""
        m = self._m
        if isinstance(stream, Reporter):
            self._by_exception.ended(stream)
        for member_id in member_ids:
            found = m.member(member_id)
            if found is not None and found[1].stream is stream:
                found[1].stream = None

    def sweep(self, excused: float = 0.0) -> list[tuple[Job, Member]]:
        """Fail every running member silent for longer than the liveness timeout, or whose stream
        broke ``lost_grace`` ago without a report since; log stalls (once each).

        ``excused``: seconds the coordinator itself was not listening since the last sweep (its
        loop or process held up: see :func:`liveness.excuse`); they do not count as silence."""
        m = self._m
        now = m.clock.monotonic()
        failed: list[tuple[Job, Member]] = []
        if excused > 0:
            for _, member in m.members():
                liveness.excuse(member, excused)
            self._by_exception.excuse(excused)
        # A stall is named after tens of seconds: looking for one each second is plenty (sweeps run
        # four times an interval, and comparing every rank's progress is the costly part of them).
        # Leases run for tens of seconds too: checked as often.
        check_stalls = now - self._stall_checked >= STALL_CHECK_PERIOD_S
        if check_stalls:
            self._stall_checked = now
            failed += self._by_exception.check()
        t = m.timeouts
        for job in m.jobs():
            if job.state is JobState.FORMING:
                self._form_if_ready(job)  # an elastic world's last call (its Joins look too)
                continue
            # A failed job's silent members are judged too: otherwise a rank that died after (or
            # while) another failed stays RUNNING and the job never ends.
            if job.state not in (JobState.RUNNING, JobState.FAILED) or job.ended:
                continue
            changed = False
            for member, (failure, reason) in liveness.silent_members(
                job, now, t.liveness, t.lost_grace, t.answer
            ):
                m.machine.member_to(job, member, MemberState.FAILED, reason, failure)
                failed.append((job, member))
                changed = True
            if changed:
                m.changed(job)
            elif job.state is JobState.RUNNING and check_stalls and (job.memory.judged or job.memory.quiet):
                # A job whose every member an open by-exception stream stands for has no stall to
                # name until one is reported quiet (quiet_seconds, half the stall threshold): its
                # members' progress is not compared each second.
                self._log_stall(job)
        return failed

    def stall(self, job: Job) -> Stall | None:
        """The ranks of running ``job`` that the others wait for, or None (see
        :func:`liveness.find_stall`; the threshold is ``stall_threshold``)."""
        m = self._m
        return liveness.find_stall(job, m.clock.wall(), m.timeouts.stall)

    def _log_stall(self, job: Job) -> None:
        line = liveness.new_stall_line(job, self.stall(job))
        if line:
            log.warning("%s", line)
