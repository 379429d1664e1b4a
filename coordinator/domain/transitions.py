"""The one place where jobs and members change state: checked against the diagram, announced.

States::

    job:    FORMING --(world_size members joined)--> RUNNING --(all left with 0)--> FINISHED
                                                        \\--(a member failed)-----> FAILED
                                                        \\--(re-rendezvous)-------> RESTARTED
    member: JOINING --> RUNNING --> LEFT (exit code 0) | FAILED (non-zero exit, missed beats,
                                                                 connection lost)

:class:`StateMachine` is the only code that assigns ``Job.state`` or ``Member.state`` (records
read back from the store aside). Every change is checked against :data:`JOB_EDGES` and
:data:`MEMBER_EDGES`; a change the diagram does not allow raises :class:`IllegalTransitionError`, a
bug in the coordinator and never the doing of a client (requests are refused before anything
changes). Changes clients must hear of are emitted as :class:`~model.JobEvent` to the listeners:

==============================  =====================================
change                          events
==============================  =====================================
job FORMING -> RUNNING          WORLD_FORMED
job RUNNING -> FINISHED         JOB_FINISHED
job RUNNING -> FAILED           MEMBER_FAILED, then JOB_FAILED
job RUNNING -> RESTARTED        (MEMBER_FAILED, then) JOB_RESTARTING
==============================  =====================================

A member failing while its job is RUNNING fails the job; one failing in an already FAILED job
(a peer its agent stopped, a rank that died later) changes only the member. In an elastic job a
member that dies, hangs or is cut off (missed heartbeats, connection lost) is a change of
membership, not a failure: the generation ends RESTARTED (a re-rendezvous) and the survivors form
the next one; a member that exits non-zero still fails the job. A generation that ends RESTARTED
lets its running members go (LEFT): they join the next generation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.coordinator.domain.model import Job, JobEvent, JobState, Member, MemberState

log = logging.getLogger(__name__)

#: The job changes the diagram allows.
JOB_EDGES: Mapping[JobState, frozenset[JobState]] = {
    JobState.FORMING: frozenset({JobState.RUNNING}),
    JobState.RUNNING: frozenset({JobState.FINISHED, JobState.FAILED, JobState.RESTARTED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.RESTARTED: frozenset(),
}
#: The member changes the diagram allows.
MEMBER_EDGES: Mapping[MemberState, frozenset[MemberState]] = {
    MemberState.JOINING: frozenset({MemberState.RUNNING}),
    MemberState.RUNNING: frozenset({MemberState.LEFT, MemberState.FAILED}),
    MemberState.LEFT: frozenset(),
    MemberState.FAILED: frozenset(),
}

EventListener = Callable[[JobEvent], None]
_S = TypeVar("_S", JobState, MemberState)

#: The failures of an elastic job's member that change the membership instead of failing the job:
#: the member is gone (died, hung, cut off), not its program's own failure.
MEMBERSHIP_FAILURES = frozenset({FailureReason.MISSED_HEARTBEATS, FailureReason.CONNECTION_LOST})


class IllegalTransitionError(RuntimeError):
    """Raised when the coordinator's own code asks for a state change the diagram forbids."""


class StateMachine:
    """Applies state changes to jobs and members; ``wall`` stamps them (Unix seconds)."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self._listeners: list[EventListener] = []

    def add_listener(self, listener: EventListener) -> None:
        """Call ``listener`` with every event, on the caller's thread, in order."""
        self._listeners.append(listener)

    def job_to(self, job: Job, to: JobState, cause: Member | None = None, why: str = "") -> None:
        """Move ``job`` to ``to``; ``cause`` is the failed member for FAILED, and for RESTARTED
        when one failed (else ``why`` says what asked for the re-rendezvous).

        Raises:
            IllegalTransitionError: the diagram has no such edge from the job's state.
        """
        _check("job", job.label, JOB_EDGES, job.state, to)
        job.state = to
        if to is JobState.RUNNING:
            job.formed = self._wall()
            job.memory.previous = None  # the new world replaces the ended one for good
            self._emit(JobEvent(EventKind.WORLD_FORMED, job.name, job.generation, job.formed))
        elif to is JobState.FINISHED:
            job.ended = self._wall()
            log.info("%s: finished, every rank exited with code 0", job.label)
            self._emit(JobEvent(EventKind.JOB_FINISHED, job.name, job.generation, job.ended))
        elif to is JobState.FAILED:
            if cause is None:
                raise IllegalTransitionError(f"{job.label}: RUNNING -> FAILED needs the member that failed")
            now = self._wall()
            job.failed_rank = cause.rank
            job.reason = f"rank {cause.rank} on host {cause.host} failed: {cause.reason}"
            who = (job.name, job.generation, now, cause.rank, cause.host)
            self._emit(JobEvent(EventKind.MEMBER_FAILED, *who, cause.reason, cause.failure))
            self._emit(JobEvent(EventKind.JOB_FAILED, *who, job.reason, cause.failure))
        elif to is JobState.RESTARTED:
            self._restarted(job, cause, why)

    def _restarted(self, job: Job, cause: Member | None, why: str) -> None:
        """Announce a re-rendezvous and let the generation's running members go."""
        now = self._wall()
        job.ended = now
        if cause is not None:
            job.failed_rank = cause.rank
            job.reason = f"re-rendezvous: rank {cause.rank} on host {cause.host} failed: {cause.reason}"
            who = (job.name, job.generation, now, cause.rank, cause.host)
            self._emit(JobEvent(EventKind.MEMBER_FAILED, *who, cause.reason, cause.failure))
            restarting = JobEvent(EventKind.JOB_RESTARTING, *who, job.reason, cause.failure)
        else:
            job.reason = f"re-rendezvous: {why}"
            restarting = JobEvent(EventKind.JOB_RESTARTING, job.name, job.generation, now, reason=job.reason)
        log.info("%s: ends for a re-rendezvous (%s)", job.label, job.reason)
        # Those still alive are expected in the next generation (a broken stream: most likely dead).
        job.memory.survivors = tuple(
            m for m in job.members if m.state is MemberState.RUNNING and m.lost_at is None
        )
        for member in job.members:
            if member.state is MemberState.RUNNING:
                self.member_to(job, member, MemberState.LEFT, "left for the re-rendezvous")
        self._emit(restarting)

    def member_to(
        self,
        job: Job,
        member: Member,
        to: MemberState,
        reason: str = "",
        failure: FailureReason | None = None,
    ) -> None:
        """Move ``member`` of ``job`` to ``to``: RUNNING when the world forms, LEFT with a
        ``reason``, FAILED with a ``reason`` and a ``failure`` (which fails a RUNNING job).

        Raises:
            IllegalTransitionError: the diagram has no such edge, or FAILED comes without a
                ``failure``.
        """
        _check("member", f"{job.label} member {member.member_id}", MEMBER_EDGES, member.state, to)
        if to is MemberState.FAILED and failure is None:
            raise IllegalTransitionError(f"{job.label}: a member cannot fail without a failure reason")
        member.state = to
        if to is MemberState.RUNNING:
            return
        member.reason = reason
        if to is MemberState.FAILED:
            member.failure = failure
            log.warning("%s: rank %s on host %s failed: %s", job.label, member.rank, member.host, reason)
            if job.state is JobState.RUNNING:
                gone = job.elastic is not None and failure in MEMBERSHIP_FAILURES
                self.job_to(job, JobState.RESTARTED if gone else JobState.FAILED, cause=member)

    def members_running(self, job: Job, members: Iterable[Member]) -> None:
        """Move every one of ``members`` (of ``job``, whose world forms) from JOINING to RUNNING.

        :meth:`member_to` for thousands at once: the edge is checked by identity, not through the
        enums' hash (a 4096-rank world forms in one call, and every microsecond there is 4 ms).

        Raises:
            IllegalTransitionError: a member is not JOINING.
        """
        for member in members:
            if member.state is not MemberState.JOINING:
                _check("member", f"{job.label} member {member.member_id}", MEMBER_EDGES, member.state,
                       MemberState.RUNNING)  # fmt: skip
            member.state = MemberState.RUNNING

    def _emit(self, event: JobEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not stop the others from hearing
                log.exception("event listener failed on %s", event)


def _check(what: str, name: str, edges: Mapping[_S, frozenset[_S]], old: _S, new: _S) -> None:
    if new not in edges[old]:
        allowed = ", ".join(sorted(s.value for s in edges[old])) or "none"
        raise IllegalTransitionError(
            f"{name}: {what} state {old.value} -> {new.value} is not an edge of the state diagram "
            f"(allowed from {old.value}: {allowed})"
        )
