"""Elastic worlds: a job whose world forms with between min_members and max_members (torchrun's
``--nnodes MIN:MAX``, one member per node) and re-forms, a *re-rendezvous*, when members come or go.

The rules (a fixed world, ``JoinSpec.elastic`` None, follows none of them):

1. **Forming.** A world forms at once when max_members have joined; with min_members or more, at
   once when every member expected has joined (after a re-rendezvous: the previous generation's
   members that were alive when it ended, and those parked behind it), else when the *last call*
   has passed: ``last_call`` seconds without a new arrival.
2. **Parked.** A join while the job's world runs goes into the next generation (the running one's
   ``successor``) and waits there. The running members learn on their heartbeat stream how many
   wait (:func:`waiting`: at most max_members minus the running world; beyond it a join waits
   uncounted, as torch's redundancy list does) and re-form a larger world by re-joining (rule 4).
3. **Members that go.** A member that dies, hangs or is cut off (missed heartbeats, connection lost)
   ends the generation as a re-rendezvous (RESTARTED, JOB_RESTARTING; see :mod:`.transitions`):
   every survivor hears it at once, and the survivors and the parked members form the next
   generation. A member that exits non-zero fails the job as in a fixed world.
4. **Re-join.** A join that names a member of the running generation (``rejoin_member_id`` and its
   secret: torchrun's agent re-rendezvousing) ends that generation as a re-rendezvous too, and
   joins the next one. Survivors keep their order: ranks go to returning members first, in the
   order of their previous ranks, then to newcomers in the order they joined. A member of that
   generation whose stream had already broken is failed first, as the re-join's cause (connection
   lost), so the generation's end names the node that was lost.
5. **Closed.** A member that leaves (its work done, or failed) or asks to close (``close_job``:
   torch's ``set_closed``) closes the job's rendezvous: the running world goes on, but no new world
   forms under the job while this generation runs. Joins are answered closed
   (:class:`~sarcomm.common.errors.JobClosedError`; ``beyond_max`` for one parked while the world
   was full), and the parked ones are sent away with the same answer. Once the generation has
   ended, the job's name starts afresh with the next join, as a fixed job's does.

:class:`ElasticRendezvous` applies these rules to the membership's own jobs and members, through
the :class:`~.context.MembershipContext` it is given; it is kept in a module of its own for size,
and changes states only through the membership's state machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sarcomm.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    JobClosedError,
    UnauthenticatedError,
)
from sarcomm.coordinator.domain import liveness
from sarcomm.coordinator.domain.context import MembershipContext
from sarcomm.coordinator.domain.model import (
    MAX_HISTORY,
    Job,
    JobState,
    JoinSpec,
    Member,
    MemberState,
    Ticket,
    new_members,
)
from sarcomm.coordinator.domain.ranks import plan_world

log = logging.getLogger(__name__)

__all__ = ["ElasticRendezvous", "check_range", "waiting"]


def waiting(job: Job) -> int:
    """Rule 2: how many members parked behind running ``job`` fit in its next world; 0 for a fixed
    job, one that is not running, or a closed one.

    O(1) (every heartbeat answer of an elastic job carries it): a running elastic world that is
    not closed has all its ``world_size`` members running (one that goes ends the generation, one
    that leaves closes it), so its room is max_members minus world_size."""
    if (
        job.elastic is None
        or job.memory.successor is None
        or job.closed is not None
        or job.state is not JobState.RUNNING
    ):
        return 0
    return max(0, min(len(job.memory.successor.members), job.elastic.max_members - job.world_size))


class ElasticRendezvous:
    """The elastic part of a :class:`~sarcomm.coordinator.domain.membership.Membership` (the rules
    in this module's docstring), acting through the membership's ``context``. ``wake`` is called
    with a forming generation whose Join calls should look again (it was adopted, so its last call
    counts now; or it was sent away): the service sets it to wake them (default: nobody)."""

    def __init__(self, context: MembershipContext) -> None:
        self._m = context
        self.wake: Callable[[Job], None] = lambda job: None

    # -- joining -----------------------------------------------------------------------------------

    def join(self, spec: JoinSpec, join_id: str) -> Ticket:
        """Rules 1, 2 and 4 for a Join of an elastic job (or a re-join); returns at once with the
        ticket, as :meth:`Membership.join` does.

        Raises:
            JobClosedError: the job's rendezvous is closed (rule 5).
            FailedPreconditionError: the job runs a fixed world, or another range of members; the
                next generation has max_members waiting already; a re-join of a job that ended.
            UnauthenticatedError: ``rejoin_secret`` is not the member's.
            InvalidArgumentError: ``rejoin_member_id`` is a member of another job.
        """
        m = self._m
        previous_rank = self._rejoin(spec) if spec.rejoin_member_id else None
        current = m.job(spec.job)
        parked = current is not None and current.state is JobState.RUNNING
        job = self._park(current, spec) if current is not None and parked else m.forming_job(spec)
        check_range(job, spec)
        total = len(job.members) + len(spec.members)
        if total > job.world_size:
            raise FailedPreconditionError(
                f"members: joining {len(spec.members)} more would make {total} members in {job.label}, "
                f"which has max_members {job.world_size}"
            )
        members, issued = new_members(spec, m.clock.wall(), job.memory.join_calls, join_id)
        for member in members:
            member.previous_rank = previous_rank
        if not parked and m.job(job.name) is not job:
            m.adopt(job)
        job.members.extend(members)
        job.memory.join_calls += 1
        job.memory.last_arrival = m.clock.monotonic()
        log.debug(
            "%s: host %s joined with %d member(s)%s; %d joined (%s)", job.label, spec.host, len(members),
            " (parked behind the running world)" if parked else "", len(job.members), spec.elastic,
        )  # fmt: skip
        if not parked:
            self.form_if_ready(job)
        return Ticket(job, tuple(members), tuple(issued))

    def _rejoin(self, spec: JoinSpec) -> int | None:
        """Rule 4: end the running generation of the member ``spec`` names; that member's rank
        there (None when it is not known any more: it then joins as a newcomer)."""
        m = self._m
        found = m.member(spec.rejoin_member_id)
        if found is None:
            back = _returning(m.job(spec.job)).get(spec.rejoin_member_id)
            if back is None:
                return None
            if not back.check_secret(spec.rejoin_secret):
                raise UnauthenticatedError("rejoin_secret does not match the secret of rejoin_member_id")
            return back.rank
        job, member = found
        if not member.check_secret(spec.rejoin_secret):
            raise UnauthenticatedError("rejoin_secret does not match the secret of rejoin_member_id")
        if job.name != spec.job:
            raise InvalidArgumentError(
                f"rejoin_member_id {spec.rejoin_member_id!r} is a member of job {job.name!r}, not of "
                f"job {spec.job!r}; a member re-joins its own job"
            )
        if job.state is JobState.RUNNING and job.closed is not None:
            raise JobClosedError(_closed_text(job))
        if job.state is JobState.RUNNING:
            self._blame_lost_peers(job, member)
        if job.state is JobState.RUNNING:
            why = f"rank {member.rank} on host {member.host} re-joins"
            if waiting(job):
                why += f"; {waiting(job)} member(s) wait to join"
            m.machine.job_to(job, JobState.RESTARTED, why=why)
            m.changed(job)
        elif job.state.ended and job.state is not JobState.RESTARTED:
            raise JobClosedError(
                f"{job.label} {job.state.value.lower()}"
                + (f" ({job.reason})" if job.reason else "")
                + "; its rendezvous is closed: no new world forms from it"
            )
        return member.rank

    def _blame_lost_peers(self, job: Job, member: Member) -> None:
        """A node whose worker failed (torch spent a restart on it) re-joins ``job`` at once, and
        a dead peer is the likeliest cause: gloo sees the reset connection within milliseconds,
        before the peer's broken stream is judged (lost_grace). A member of ``job`` whose stream
        already broke fails now as that cause, as it does when a survivor exits first (see
        :meth:`~.membership.Membership.leave`), and its loss re-forms the generation."""
        m = self._m
        for other in job.members:
            if other is not member and other.state is MemberState.RUNNING and other.lost_at is not None:
                blame, text = liveness.connection_lost_blame(member.rank, member.host, "re-joined")
                m.machine.member_to(job, other, MemberState.FAILED, text, blame)

    def _park(self, running: Job, spec: JoinSpec) -> Job:
        """Rule 2: the next generation behind ``running``, where a join waits."""
        if running.elastic is None:
            return self._m.forming_job(spec)  # raises: a fixed world runs under this name
        check_range(running, spec)
        if running.closed is not None:
            raise JobClosedError(
                _closed_text(running), beyond_max=running.world_size >= running.elastic.max_members
            )
        successor = running.memory.successor
        if successor is None:
            successor = Job(
                name=running.name,
                generation=running.generation + 1,
                world_size=running.elastic.max_members,
                created=self._m.clock.wall(),
                backend=spec.backend,
                elastic=running.elastic,
            )
            running.memory.successor = successor
        return successor

    # -- forming -----------------------------------------------------------------------------------

    def form_if_ready(self, job: Job) -> bool:
        """Rule 1: form ``job`` if it is the job's forming elastic generation and may form now;
        True when it formed.

        Raises:
            InvalidArgumentError: a host has no interface the rules can choose (see
                :func:`~sarcomm.coordinator.domain.ranks.plan_world`).
        """
        m = self._m
        if job.elastic is None or job.state is not JobState.FORMING or m.job(job.name) is not job:
            return False
        joined = len(job.members)
        if joined < job.elastic.min_members:
            return False
        # Counted only after a re-rendezvous (survivors expected back): asked at every Join of a
        # world of thousands, a count over its members each time made forming it quadratic.
        complete = joined >= job.elastic.max_members or (
            bool(job.memory.returning)
            and sum(1 for member in job.members if member.previous_rank is not None)
            >= len(job.memory.returning)
        )
        if not complete and m.clock.monotonic() - job.memory.last_arrival < job.elastic.last_call:
            return False
        # Returning members first, in their previous order (rule 4); ranks then deal by join order.
        job.members.sort(key=lambda x: (x.previous_rank is None, x.previous_rank or 0, x.join_call))
        for call, member in enumerate(job.members):
            member.join_call = call
        job.world_size = joined
        m.form(job, plan_world(joined, job.members))
        return True

    def form_in(self, job: Job) -> float | None:
        """Seconds until the last call may form ``job`` (0: now), or None while it cannot (too few
        members, parked behind a running world, formed or sent away)."""
        m = self._m
        if job.elastic is None or job.state is not JobState.FORMING or m.job(job.name) is not job:
            return None
        if len(job.members) < job.elastic.min_members:
            return None
        return max(0.0, job.memory.last_arrival + job.elastic.last_call - m.clock.monotonic())

    # -- generations ending ------------------------------------------------------------------------

    def changed(self, job: Job) -> None:
        """After ``job`` (a generation) changed: a re-rendezvous hands its parked members on to the
        next generation (rules 1, 3); an end or a close sends them away (rule 5)."""
        if job.elastic is None or job.memory.successor is None:
            return
        successor = job.memory.successor
        if job.state is JobState.RESTARTED:
            job.memory.successor = None
            self.inherit(successor, job)
            successor.memory.last_arrival = self._m.clock.monotonic()
            self._m.adopt(successor)
            self.form_if_ready(successor)
            self.wake(successor)
        elif job.state.ended or job.closed is not None:
            job.memory.successor = None
            successor.memory.withdrawn = (
                _closed_text(job) if job.closed is not None else f"{job.label} {job.state.value.lower()}"
            )
            successor.memory.room = job.elastic.max_members - job.world_size
            log.info(
                "%s: %d parked member(s) sent away: %s",
                job.label,
                len(successor.members),
                successor.memory.withdrawn,
            )
            self.wake(successor)

    def inherit(self, job: Job, ended: Job) -> None:
        """What generation ``job`` takes over from ``ended``, which ended RESTARTED: its history and
        counts, and who is expected back (rule 1)."""
        job.memory.previous = ended
        job.history = [*ended.history, ended.generation_record()][-MAX_HISTORY:]
        job.restart_count = ended.restart_count
        job.max_restarts = max(job.max_restarts, ended.max_restarts)
        job.rerendezvous_count = ended.rerendezvous_count + 1
        job.memory.returning = _returning(ended)

    def withdrawn(self, ticket: Ticket) -> JobClosedError | None:
        """The closed answer for ``ticket``, parked in a generation that was sent away; else None."""
        job = ticket.job
        if job.memory.withdrawn is None:
            return None
        index = next((i for i, m in enumerate(job.members) if m is ticket.members[0]), 0)
        return JobClosedError(job.memory.withdrawn, beyond_max=index >= job.memory.room)

    def abandoned(self, job: Job) -> None:
        """Every member parked in ``job`` withdrew: the running generation has no successor."""
        current = self._m.job(job.name)
        if not job.members and current is not None and current.memory.successor is job:
            current.memory.successor = None

    # -- closing -----------------------------------------------------------------------------------

    def close(self, job: Job, why: str) -> None:
        """Rule 5: close the rendezvous of running elastic ``job`` (no-op otherwise)."""
        if job.elastic is None or job.closed is not None or job.state is not JobState.RUNNING:
            return
        job.closed = why
        log.info("%s: rendezvous closed: %s", job.label, why)
        self.changed(job)
        self._m.persist(job)

    def left(self, job: Job, member: Member) -> None:
        """Rule 5 after ``member`` left ``job``: its work is done (or failed), so no new world
        forms from this generation."""
        if member.state is MemberState.LEFT:
            self.close(job, f"rank {member.rank} on host {member.host} finished")


def _returning(job: Job | None) -> dict[str, Member]:
    """The members expected back in the generation after ``job`` (RESTARTED) or in ``job`` (the
    one after it), by id."""
    if job is None:
        return {}
    if job.state is JobState.RESTARTED:
        return {member.member_id: member for member in job.memory.survivors}
    return job.memory.returning


def check_range(job: Job, spec: JoinSpec) -> None:
    if job.elastic is None or spec.elastic is None:
        if job.elastic is not spec.elastic:
            kind = "an elastic" if job.elastic is not None else "a fixed"
            raise FailedPreconditionError(
                f"{job.label} is {kind} world; every member of a job must ask for the same: "
                f"world_size for a fixed world, min_members and max_members for an elastic one"
            )
        return
    if (job.elastic.min_members, job.elastic.max_members) != (
        spec.elastic.min_members,
        spec.elastic.max_members,
    ):
        raise FailedPreconditionError(
            f"{spec.elastic.describe()} does not match {job.label}, which was created with "
            f"{job.elastic.describe()}; every member of a job must ask for the same range"
        )


def _closed_text(job: Job) -> str:
    return (
        f"the rendezvous of {job.label} is closed ({job.closed}): no new world forms under it while it runs"
    )
