"""Membership and rendezvous: the operations on jobs and members, free of gRPC, HTTP and storage.

:class:`Membership` joins members into forming worlds, records their reports, their leaving and
their silence, and names stalls. It decides; :mod:`transitions` makes every state change (checked
against the diagram there) and emits the events; :mod:`ranks` lays out a world;
:mod:`join_rules` says whether a Join may add its members; :mod:`liveness` holds the judging
rules, which :mod:`sweep` applies. What it needs from storage is given to it at start
(:class:`model.StoredState`), and every job whose stored record changed is handed to ``persist``
before the method returns. Time comes from a :class:`clock.Clock`. A restored member gets
``restore_grace`` to reconnect before it is judged. All methods are synchronous (the event
loop's thread); the service's Join waits for the WORLD_FORMED event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from sarcomm.common.errors import (
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from sarcomm.common.messages import Progress, WorkerEndpoint
from sarcomm.coordinator.domain import liveness, resent_joins
from sarcomm.coordinator.domain.by_exception import ReportsByException
from sarcomm.coordinator.domain.clock import SYSTEM_CLOCK, Clock
from sarcomm.coordinator.domain.context import MembershipContext, Timeouts
from sarcomm.coordinator.domain.elastic import ElasticRendezvous
from sarcomm.coordinator.domain.join_rules import check_fixed_join
from sarcomm.coordinator.domain.member_index import MemberIndex
from sarcomm.coordinator.domain.model import (
    MAX_HISTORY,
    EventKind,
    Job,
    JobEvent,
    JobState,
    JoinSpec,
    Member,
    MemberRequest,
    MemberState,
    Stall,
    StoredState,
    Ticket,
    any_running,
    new_members,
    withdraw_members,
)
from sarcomm.coordinator.domain.ranks import Plan, host_key, plan_world
from sarcomm.coordinator.domain.reporters import Reporter
from sarcomm.coordinator.domain.sweep import LivenessSweep
from sarcomm.coordinator.domain.transitions import EventListener, StateMachine

log = logging.getLogger(__name__)

# Re-exported: callers and tests name the domain types through this module.
__all__ = [
    "EventKind", "EventListener", "Job", "JobEvent", "JobState", "JoinSpec", "Member", "MemberRequest",
    "MemberState", "Membership", "Progress", "Stall", "Ticket",
]  # fmt: skip


class Membership:
    """Jobs, their members and generations; the coordinator's single source of truth.

    ``clock`` gives monotonic time (liveness) and wall time (what users see). ``lost_grace`` is
    how long a member whose stream broke may take to report again (default: a third of the
    liveness timeout, one heartbeat interval at the default misses); ``restore_grace`` how long
    members restored from ``stored`` have to reconnect before they are judged (at least the
    liveness timeout); ``stall_threshold`` how long ranks must wait in one collective before
    :meth:`stall` names the ranks they wait for; ``answer_timeout`` how long a formed world's
    members wait for their Join's answer before they are judged (the join timeout); ``silence``
    how old a member's sign of life is when a reporter by exception reports it (default: two
    thirds of the liveness timeout, ``policy.silence_seconds`` at 3 misses). ``persist``
    is told of every job whose stored record changed (default: nobody: memory only).
    """

    def __init__(
        self,
        *,
        liveness_timeout: float,
        stored: StoredState | None = None,
        max_jobs: int = 1024,
        max_ended_jobs: int = 1024,
        lost_grace: float | None = None,
        restore_grace: float = 0.0,
        stall_threshold: float = 30.0,
        answer_timeout: float = 600.0,
        silence: float | None = None,
        clock: Clock = SYSTEM_CLOCK,
        persist: Callable[[Job], None] | None = None,
    ) -> None:
        # Called with each job whose record changed. The server passes persistence.WriteBehind.mark,
        # which coalesces the writes off the event loop.
        self._persist = persist or (lambda job: None)
        self._timeouts = Timeouts(
            liveness_timeout,
            lost_grace if lost_grace is not None else liveness_timeout / 3,
            answer_timeout,
            stall_threshold,
            silence if silence is not None else liveness_timeout * 2 / 3,
        )
        self._restore_grace = max(restore_grace, liveness_timeout)
        self._max_jobs = max_jobs
        self._max_ended_jobs = max_ended_jobs
        self._clock = clock
        self._machine = StateMachine(clock.wall)
        self._jobs: dict[str, Job] = {}
        # The members of formed worlds by id, with their job: what authenticates a report.
        self._members = MemberIndex()
        # The highest generation of each name as last seen outside _jobs (consulted only for names
        # not in _jobs): numbering continues after a job is forgotten in memory (max_ended_jobs)
        # or was only in the store. A few bytes a name.
        self._generations: dict[str, int] = {}
        # The Joins sent with a join id, so that a resend gets its own members and nobody else's.
        self._join_ids = resent_joins.JoinIds(self._jobs.get, self._persist)
        self._machine.add_listener(self._join_ids.forget_ended)
        context = MembershipContext(
            clock=clock, machine=self._machine, timeouts=self._timeouts, job=self._jobs.get,
            jobs=lambda: list(self._jobs.values()), member=self._members.get, members=self._members.values,
            forming_job=self._forming_job, adopt=self._adopt, form=self._form, changed=self._changed,
            persist=self._persist,
        )  # fmt: skip
        # Elastic jobs (torchrun's --nnodes MIN:MAX): their joins, re-joins, closing (see .elastic).
        self.elastic = ElasticRendezvous(context)
        # Streams that report by exception: trusted members, leases, progress asked for (see .by_exception).
        self.by_exception = ReportsByException(context)
        # Broken and ended streams, the sweep of silent members, stalls (see .sweep).
        self._sweep = LivenessSweep(context, self.elastic.form_if_ready, self.by_exception)
        self._restore(stored or StoredState())

    def jobs(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.name)

    def job(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def live_members(self) -> Iterable[tuple[Job, Member]]:
        """Members of running jobs that are still alive, for service discovery."""
        for job in self._jobs.values():
            if job.state is JobState.RUNNING:
                for member in job.members:
                    if member.state is MemberState.RUNNING:
                        yield job, member

    def add_listener(self, listener: EventListener) -> None:
        """Hear every job event (world formed, member failed, job finished or failed)."""
        self._machine.add_listener(listener)

    # -- join ------------------------------------------------------------------------------------

    def join(self, spec: JoinSpec, join_id: str = "") -> Ticket:
        """Add the members of ``spec`` to the job's forming world; form it if it is now complete.

        Returns at once; the caller waits for the WORLD_FORMED event of ``ticket.job`` (unless it
        is already RUNNING) and then reads the members' assignments from the ticket. A Join sent
        again (``join_id`` of an earlier try of it) gets that try's ticket, ``resent`` set, and
        counts as one more call waiting on it (see :mod:`resent_joins` for what a resend may change).

        Raises:
            FailedPreconditionError: the job is running, has another world size, is full, or the
                request names a generation that is not the forming one.
            AlreadyExistsError: a requested rank is taken, or ``join_id`` is another Join's.
            ResourceExhaustedError: the coordinator already holds ``max_jobs`` active jobs.
        """
        resent = self._join_ids.resend(spec, join_id)
        if resent is not None:
            return resent
        if spec.elastic is not None:
            elastic = self.elastic.join(spec, join_id)
            self._join_ids.add(elastic)
            return elastic
        # A fresh generation is built aside and adopted only once every check below has passed:
        # a refused join must leave the previous generation (and its members) exactly as it was.
        job = self._forming_job(spec)
        check_fixed_join(job, spec)
        job.max_restarts = max(job.max_restarts, spec.max_restarts)
        ticket_members, ticket_secrets = new_members(spec, self._clock.wall(), job.memory.join_calls, join_id)
        # The last join forms the world: choose ranks and interfaces before anything changes, so
        # that a choice that fails leaves the job as it was instead of full and never formed.
        plan = (
            plan_world(job.world_size, [*job.members, *ticket_members])
            if len(job.members) + len(ticket_members) == job.world_size
            else None
        )
        if self._jobs.get(job.name) is not job:
            self._adopt(job)
        for member, request in zip(ticket_members, spec.members, strict=True):
            job.members.append(member)
            if request.rank is not None:
                job.memory.requested[request.rank] = member
        job.memory.join_calls += 1
        # DEBUG: a world of thousands would otherwise log thousands of lines while forming.
        log.debug(
            "%s: host %s joined with %d member(s); %d of %d joined",
            job.label,
            spec.host,
            len(spec.members),
            len(job.members),
            job.world_size,
        )
        ticket = Ticket(job, tuple(ticket_members), tuple(ticket_secrets))
        self._join_ids.add(ticket)
        if plan is not None:
            self._form(job, plan)
        return ticket

    def answered(self, ticket: Ticket, answered: bool = True) -> None:
        """Whether ``ticket``'s Join was answered (see :func:`liveness.mark_answered`)."""
        liveness.mark_answered(ticket.members, self._clock.monotonic(), answered)

    def abandon(self, ticket: Ticket) -> None:
        """A call waiting on ``ticket`` gave up (deadline, cancel): withdraw its members if the world
        has not formed and no other call (a resend of the same Join) still waits on them."""
        job = ticket.job
        if not self._join_ids.release(ticket):
            log.info(
                "%s: a try of a Join from host %s gave up; a resend of it still waits",
                job.label,
                ticket.members[0].host,
            )
            return
        if job.state is not JobState.FORMING:
            return
        withdraw_members(job, ticket.members)
        log.info("%s: %d member(s) withdrew before the world formed", job.label, len(ticket.members))
        self.elastic.abandoned(job)
        if not job.members and self._jobs.get(job.name) is job:
            # Nobody is waiting any more: the next join starts the generation afresh. The ended
            # generation it would have replaced comes back, so status keeps showing it.
            if job.memory.previous is not None:
                self._jobs[job.name] = job.memory.previous
            else:
                del self._jobs[job.name]

    def _forming_job(self, spec: JoinSpec) -> Job:
        job = self._jobs.get(spec.job)
        if job is not None and job.state is JobState.FORMING:
            return job
        if job is not None and job.state is JobState.RUNNING:
            raise FailedPreconditionError(
                f"job {spec.job!r}: generation {job.generation} is running with world_size "
                f"{job.world_size}; a new world can form under this name once it has finished or failed"
            )
        active = sum(1 for j in self._jobs.values() if not j.state.ended)
        if active >= self._max_jobs:
            raise ResourceExhaustedError(
                f"job {spec.job!r}: the coordinator already holds {active} active jobs, its limit "
                f"max_jobs {self._max_jobs}"
            )
        previous = job.generation if job is not None else self._generations.get(spec.job, 0)
        # A world formed right after a failed one is a restart (an agent's --max-restarts, or the
        # user running the job again): counted so status and the restarts metric can show it.
        restarts = job.restart_count + 1 if job is not None and job.state is JobState.FAILED else 0
        ended = job
        job = Job(
            name=spec.job,
            generation=previous + 1,
            world_size=spec.world_size,
            created=self._clock.wall(),
            backend=spec.backend,
            restart_count=restarts,
            history=[*ended.history, ended.generation_record()][-MAX_HISTORY:] if ended else [],
            elastic=spec.elastic,
        )
        job.memory.previous = ended
        if ended is not None and ended.state is JobState.RESTARTED:
            self.elastic.inherit(job, ended)  # a re-rendezvous: no restart, survivors expected back
        # Not adopted yet (see join): until then nothing of the previous generation changes.
        return job

    def _adopt(self, job: Job) -> None:
        """Make a fresh generation from :meth:`_forming_job` the job's current one."""
        ended = self._jobs.get(job.name)
        if ended is not None:
            # Members of the ended generation are forgotten: their ids can never act again.
            self._members.unindex(ended.members)
        self._jobs[job.name] = job

    def _forget_old_ended_jobs(self) -> None:
        """Keep at most ``max_ended_jobs`` finished or failed jobs in memory, the newest.

        Without this, every distinct job name ever used would stay in memory for ever. Forgotten
        jobs stay in the state store; their generation numbers stay here, so they keep growing.
        """
        # Only jobs that are over for every member: a failed job's live members still report.
        ended = [j for j in self._jobs.values() if j.state.ended and j.ended]
        excess = len(ended) - self._max_ended_jobs
        if excess <= 0:
            return
        ended.sort(key=lambda j: (j.ended or j.formed or j.created, j.name))
        for job in ended[:excess]:
            del self._jobs[job.name]
            self._generations[job.name] = job.generation
            self._members.unindex(job.members)
        log.debug("forgot %d ended job(s) beyond max_ended_jobs %d", excess, self._max_ended_jobs)

    def _form(self, job: Job, plan: Plan) -> None:
        ranks, per_host = plan.ranks, plan.per_host
        now_mono = self._clock.monotonic()
        self._machine.members_running(job, job.members)
        for member in job.members:
            member.interface, member.address = per_host[host_key(member)]
            member.rank = ranks[member.member_id]
            member.last_seen = now_mono
            job.memory.judged[member.member_id] = member
        self._members.index(job, job.members)
        master = next(m for m in job.members if m.rank == 0)
        job.master_addr = master.address
        job.master_port = master.store_port
        log.info(
            "%s: world formed, %d ranks, master %s:%d on %s",
            job.label,
            job.world_size,
            job.master_addr,
            job.master_port,
            master.interface,
        )
        self._machine.job_to(job, JobState.RUNNING)
        # Marked before any Join waiting on the event resumes: its answer awaits this write.
        self._persist(job)

    # -- running members -------------------------------------------------------------------------

    def authenticate(self, member_id: str, secret: str) -> tuple[Job, Member]:
        """The member ``member_id`` of a current generation, if ``secret`` is its own.

        Raises:
            NotFoundError: no current generation has that member (it left, or its job moved on).
            UnauthenticatedError: the secret is not the member's.
        """
        found = self._members.get(member_id)
        if found is None:
            raise NotFoundError(
                f"member_id {member_id[:32]!r} is not a member of any current job generation; "
                f"its job ended or moved to a newer generation"
            )
        if not found[1].check_secret(secret):
            raise UnauthenticatedError("the member secret does not match")
        return found

    def heartbeat(
        self,
        member_id: str,
        secret: str,
        progress: Progress | None,
        metrics_address: str,
        age: float = 0.0,
        stream: object | None = None,
        worker_endpoints: tuple[WorkerEndpoint, ...] | None = None,
    ) -> tuple[Job, Member]:
        """Record a report about a member; returns its job and member.

        ``age`` is how many seconds ago the member itself last showed a sign of life (0: now; an
        agent reports a rank's own alive stamp, which stops moving when the rank is stopped or
        wedged). ``stream`` identifies the stream that carried the report (see :meth:`stream_lost`).
        ``worker_endpoints``: the full list of its workers' endpoints (replaces the last one; None:
        unchanged).
        """
        job, member = self.authenticate(member_id, secret)
        now = self._clock.monotonic()
        if not member.last_report:
            job.memory.first_heard = now  # its first report: the job is still starting (liveness.starting)
        liveness.note_report(member, now, self._clock.wall(), progress, age, stream)
        self.by_exception.reported(job, member, stream, progress, age)
        changed = worker_endpoints is not None and worker_endpoints != member.worker_endpoints
        if changed and worker_endpoints is not None:
            member.worker_endpoints = worker_endpoints
        if metrics_address and metrics_address != member.metrics_address:
            # Written (paced): a standby's /sd and a restarted coordinator read it from the store.
            member.metrics_address = metrics_address
            changed = True
        if changed:
            self._persist(job)
        return job, member

    def current(self, member_id: str) -> tuple[Job, Member] | None:
        """The member ``member_id`` of a current generation and its job, without checking a secret:
        for a caller that authenticated it before (the same pair while it stays current)."""
        return self._members.get(member_id)

    def beats(self, reports: Iterable[tuple[Member, Progress | None, float]], stream: object | None) -> None:
        """Record reports (member, progress, age) of members that :meth:`heartbeat` recorded
        before, with the same secret and metrics endpoint: what :meth:`heartbeat` does for them,
        at one instant for all (one request's reports arrive together)."""
        now = self._clock.monotonic()
        wall = self._clock.wall()
        # Only a by-exception stream's report (few: what changed), or one of a member such a stream
        # stood for, changes whether the sweep judges it (see .by_exception).
        exceptional = isinstance(stream, Reporter) and stream.by_exception
        for member, progress, age in reports:
            liveness.note_report(member, now, wall, progress, age, stream)
            if (exceptional or member.trusted) and (found := self._members.get(member.member_id)):
                self.by_exception.reported(found[0], member, stream, progress, age)

    def leave(self, member_id: str, secret: str, exit_code: int, reason: str = "") -> Job:
        """Record that a member is done; a non-zero exit code fails the job.

        Idempotent: leaving twice returns the job unchanged.
        """
        job, member = self.authenticate(member_id, secret)
        if member.state in (MemberState.LEFT, MemberState.FAILED):
            return job
        member.exit_code = exit_code
        if exit_code == 0:
            self._machine.member_to(job, member, MemberState.LEFT, reason or "exited with code 0")
            log.debug("%s: rank %s on host %s left with code 0", job.label, member.rank, member.host)
        else:
            failure, own_reason = liveness.exit_verdict(exit_code, reason)
            # A rank whose process died takes its connections with it: its peers' collectives fail
            # at once and their exit may reach us before its broken stream is judged. When a member
            # of this job already has a broken stream, that one is the cause: blame it first.
            # Asked only while the job runs (its first failure): a failed job's later exits each
            # asking again would make a big job's end quadratic.
            suspects = job.members if job.state is JobState.RUNNING else ()
            for other in suspects:
                if other is not member and other.state is MemberState.RUNNING and other.lost_at is not None:
                    blame, text = liveness.connection_lost_blame(member.rank, member.host, own_reason)
                    self._machine.member_to(job, other, MemberState.FAILED, text, blame)
            # In an elastic job that loss ended the generation for a re-rendezvous, which let this
            # member go (LEFT) with the other survivors: its exit is the loss's doing.
            if member.state is MemberState.RUNNING:
                self._machine.member_to(job, member, MemberState.FAILED, own_reason, failure)
        self.elastic.left(job, member)
        self._changed(job)
        return job

    def close_job(self, member_id: str, secret: str) -> Job:
        """Close the rendezvous of the elastic job of ``member_id`` (torch's ``set_closed``; see
        :mod:`.elastic`, rule 5); nothing for a fixed job or one that is not running.

        Raises:
            NotFoundError, UnauthenticatedError: as :meth:`authenticate`.
        """
        job, member = self.authenticate(member_id, secret)
        self.elastic.close(job, f"rank {member.rank} on host {member.host} closed it")
        return job

    # -- liveness (see .sweep) ---------------------------------------------------------------------

    def stream_lost(self, stream: object, member_ids: Iterable[str]) -> None:
        """See :meth:`.sweep.LivenessSweep.stream_lost`: the members of a stream that broke."""
        self._sweep.stream_lost(stream, member_ids)

    def stream_closed(self, stream: object, member_ids: Iterable[str]) -> None:
        """See :meth:`.sweep.LivenessSweep.stream_closed`: the members of a stream that ended."""
        self._sweep.stream_closed(stream, member_ids)

    def took_policy(self, reporter: Reporter, lease_seconds: float) -> None:
        """See :meth:`.by_exception.ReportsByException.took_policy`: a stream reports by exception."""
        self.by_exception.took_policy(reporter, lease_seconds)

    def sweep(self, excused: float = 0.0) -> list[tuple[Job, Member]]:
        """See :meth:`.sweep.LivenessSweep.sweep`: fail the silent members, log stalls."""
        return self._sweep.sweep(excused)

    def stall(self, job: Job) -> Stall | None:
        """See :meth:`.sweep.LivenessSweep.stall`: the ranks of ``job`` the others wait for."""
        return self._sweep.stall(job)

    def _changed(self, job: Job) -> None:
        """After members of ``job`` changed: settle it, let an elastic job's next generation go on
        (see :mod:`.elastic`), and persist it."""
        self._settle(job)
        self.elastic.changed(job)
        self._persist(job)

    def _settle(self, job: Job) -> None:
        """Finish a job whose members are all gone."""
        if any_running(job):
            return
        if job.state is JobState.RUNNING:
            self._machine.job_to(job, JobState.FINISHED)
        elif job.state is JobState.FAILED and not job.ended:
            job.ended = self._clock.wall()
        self._members.unindex(job.members)
        self._forget_old_ended_jobs()

    def _restore(self, stored: StoredState) -> None:
        # A restored member is judged only after restore_grace: its reporter needs time to notice
        # the outage and reconnect (backoff with jitter), and the liveness timeout alone can be
        # shorter than that.
        now = self._clock.monotonic() + self._restore_grace - self._timeouts.liveness
        self._generations.update(stored.generations)
        for job in stored.jobs:
            if job.state is JobState.FORMING:
                continue
            self._jobs[job.name] = job
            self._join_ids.restore(job)
            for member in job.members:
                member.last_seen = now
            running = [m for m in job.members if m.state is MemberState.RUNNING]
            job.memory.judged.update((m.member_id, m) for m in running)
            self._members.index(job, running)
        if self._jobs:
            log.info("restored %d job(s) from the state store", len(self._jobs))
        self._forget_old_ended_jobs()

    def check_invariants(self) -> None:
        """Raise AssertionError when the membership's indexes disagree with its jobs (see
        :meth:`.member_index.MemberIndex.check`). For tests, after every operation
        (``membership_invariants`` in tests/conftest.py): it walks every job and member."""
        self._members.check(self._jobs)
        self._join_ids.check_invariants()
        self.by_exception.check_invariants(list(self._jobs.values()))
