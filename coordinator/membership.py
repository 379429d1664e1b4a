"""Membership and rendezvous: the coordinator's domain logic, free of gRPC and HTTP.

A *job* is a name plus a *generation*: every world that forms under a name gets the next
generation number, and member ids belong to exactly one generation, so nothing from an earlier
run (a member id, an address, a port) can leak into a later one.

States::

    job:    FORMING --(world_size members joined)--> RUNNING --(all left with 0)--> FINISHED
                                                        \\--(a member failed)-----> FAILED
    member: JOINING --> RUNNING --> LEFT (exit code 0) | FAILED (non-zero exit, missed beats,
                                                                 connection lost)

Liveness: a member is alive while reports about it arrive and say it showed a sign of life
recently (``age``: an agent reports each rank's own alive stamp, so a stopped rank of a healthy
agent ages). It fails when that sign is older than the liveness timeout (interval x misses), or,
sooner, when the stream that carried its reports breaks (its process or agent died: the kernel
closes the connection) and no report about it arrives within ``lost_grace``. A restored member
gets ``restore_grace`` to reconnect before it is judged.

Stalls: the progress each report carries (the sequence number of the collective a rank is in or
finished last) shows, when some ranks have waited in collective #k for longer than
``stall_threshold``, which ranks have not entered #k: the ones everybody waits for (:meth:`stall`).

All methods are synchronous and run on the event loop thread; the only asynchronous piece is the
per-generation ``formed`` event that pending joins wait on. Every change a client is told about is
written to the store before the method returns.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from sarcomm.common.interfaces import InterfaceInfo, address_on, choose_interface
from sarcomm.coordinator.store import StateStore

log = logging.getLogger(__name__)


class JobState(str, enum.Enum):
    FORMING = "FORMING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"

    @property
    def ended(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED)


class MemberState(str, enum.Enum):
    JOINING = "JOINING"
    RUNNING = "RUNNING"
    LEFT = "LEFT"
    FAILED = "FAILED"


class EventKind(str, enum.Enum):
    WORLD_FORMED = "WORLD_FORMED"
    MEMBER_FAILED = "MEMBER_FAILED"
    JOB_FINISHED = "JOB_FINISHED"
    JOB_FAILED = "JOB_FAILED"


@dataclass(frozen=True)
class JobEvent:
    """Something every member of a job must hear about; ``rank``/``host`` name the member."""

    kind: EventKind
    job: str
    generation: int
    time: float
    rank: int | None = None
    host: str = ""
    reason: str = ""


@dataclass(frozen=True)
class MemberRequest:
    """One member of a join: the rank it asks for (None = deal one) and its local index."""

    local_rank: int
    rank: int | None = None


@dataclass(frozen=True)
class JoinSpec:
    """A validated join request (see ``validation.join_spec``)."""

    job: str
    world_size: int
    host: str
    interfaces: tuple[InterfaceInfo, ...]
    members: tuple[MemberRequest, ...]
    store_port: int
    socket_name: str = ""
    generation: int = 0
    backend: str = ""
    peer_address: str | None = None
    max_restarts: int = 0


@dataclass(frozen=True)
class Progress:
    """Where a rank is in its sequence of collectives (see the proto's ``Progress``)."""

    seq: int = 0
    op: str = ""
    in_collective: bool = False
    since: float = 0.0


@dataclass(frozen=True)
class Stall:
    """Ranks waiting in collective ``seq`` for ranks that have not entered it (see :meth:`Membership.stall`).

    ``since`` is the (rank-clock) Unix time the first waiting rank entered ``seq``; ``waited`` the
    seconds it has waited when this was computed.
    """

    seq: int
    op: str
    since: float
    waited: float
    waiting: tuple[int, ...]
    blocking: tuple[int, ...]

    def describe(self) -> str:
        """One line, e.g. ``3 rank(s) have waited 41.0 s in collective #812 (all_reduce) for rank(s) 2``."""
        return (
            f"{len(self.waiting)} rank(s) have waited {self.waited:.1f} s in collective #{self.seq} "
            f"({self.op or 'unknown op'}) for rank(s) {_rank_list(self.blocking)}, which have not entered it"
        )


#: How often the liveness sweep looks for stalls to log (seconds of the monotonic clock).
STALL_CHECK_PERIOD_S = 1.0
#: Earlier generations kept per job name, for ``status``; older ones stay in the state store only.
MAX_HISTORY = 100


@dataclass
class Member:
    member_id: str
    secret_digest: str
    host: str
    local_rank: int
    requested_rank: int | None
    store_port: int
    interfaces: tuple[InterfaceInfo, ...]
    peer_address: str | None
    socket_name: str
    joined_at: float
    state: MemberState = MemberState.JOINING
    rank: int | None = None
    interface: str = ""
    address: str = ""
    exit_code: int | None = None
    reason: str = ""
    last_heartbeat: float = 0.0
    progress: Progress = field(default_factory=Progress)
    metrics_address: str = ""
    # Monotonic time of the last sign of life; not persisted (a restarted coordinator restarts it).
    last_seen: float = 0.0
    # Monotonic time the stream that last carried this member's reports broke, while no newer
    # report came; None while its stream is up. Not persisted.
    lost_at: float | None = None
    # The stream that last carried a report of this member (an opaque token of the service), so
    # that the end of an older stream, replaced by a newer one, does not count as a loss.
    stream: object | None = field(default=None, repr=False)
    # Which join call of its generation brought the member (0, 1, ...): two agents on one host
    # each get a contiguous block, in the order they joined. Only needed until the world forms.
    join_call: int = 0
    # The secret this member last proved it holds: a report repeats it every beat, and hashing it
    # each time was a visible share of the coordinator's CPU at 4096 reports a second. Memory only.
    verified_secret: bytes = field(default=b"", repr=False)

    def check_secret(self, secret: str) -> bool:
        # compare_digest: constant time either way, so the cache tells an attacker nothing (bytes:
        # it refuses str with non-ASCII characters, which a client may send).
        sent = secret.encode()
        if self.verified_secret and hmac.compare_digest(self.verified_secret, sent):
            return True
        if hmac.compare_digest(self.secret_digest, _digest(secret)):
            self.verified_secret = sent
            return True
        return False

    def to_record(self) -> dict[str, Any]:
        return {
            "member_id": self.member_id,
            "secret_digest": self.secret_digest,
            "host": self.host,
            "local_rank": self.local_rank,
            "requested_rank": self.requested_rank,
            "store_port": self.store_port,
            "interfaces": [
                {
                    "name": i.name,
                    "addresses": list(i.addresses),
                    "kind": int(i.kind),
                    "default_route": i.default_route,
                }
                for i in self.interfaces
            ],
            "peer_address": self.peer_address,
            "socket_name": self.socket_name,
            "joined_at": self.joined_at,
            "state": self.state.value,
            "rank": self.rank,
            "interface": self.interface,
            "address": self.address,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "last_heartbeat": self.last_heartbeat,
            "metrics_address": self.metrics_address,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Member:
        from sarcomm.common.interfaces import InterfaceKind

        interfaces = tuple(
            InterfaceInfo(i["name"], tuple(i["addresses"]), InterfaceKind(i["kind"]), i["default_route"])
            for i in record["interfaces"]
        )
        return cls(
            member_id=record["member_id"],
            secret_digest=record["secret_digest"],
            host=record["host"],
            local_rank=record["local_rank"],
            requested_rank=record["requested_rank"],
            store_port=record["store_port"],
            interfaces=interfaces,
            peer_address=record["peer_address"],
            socket_name=record["socket_name"],
            joined_at=record["joined_at"],
            state=MemberState(record["state"]),
            rank=record["rank"],
            interface=record["interface"],
            address=record["address"],
            exit_code=record["exit_code"],
            reason=record["reason"],
            last_heartbeat=record["last_heartbeat"],
            metrics_address=record["metrics_address"],
        )


@dataclass
class Job:
    name: str
    generation: int
    world_size: int
    created: float
    backend: str = ""
    state: JobState = JobState.FORMING
    formed: float = 0.0
    ended: float = 0.0
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    reason: str = ""
    # The rank whose failure failed this generation (None while none has): monitoring names it as
    # the rank that is down, and not the peers its agents then stopped, which fail too.
    failed_rank: int | None = None
    # The largest --max-restarts the agents of this generation asked for (0: none or not told).
    max_restarts: int = 0
    # Summaries of earlier generations under this name, oldest first (see generation_record).
    history: list[dict[str, Any]] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)
    # Set when the world forms or the job is abandoned; pending joins wait on it. Not persisted.
    formed_event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # Requested ranks of a forming world, kept up to date so a join checks in O(1), not O(members).
    requested: dict[int, Member] = field(default_factory=dict, repr=False)
    join_calls: int = field(default=0, repr=False)
    # The ended generation this forming one replaces: put back if every join withdraws, so the
    # name keeps its history and status. Not persisted.
    previous: Job | None = field(default=None, repr=False)
    # The collective whose stall was last logged, so each stall is logged once.
    logged_stall: int = field(default=0, repr=False)

    @property
    def label(self) -> str:
        return f"job {self.name!r} generation {self.generation}"

    def ranked_members(self) -> list[Member]:
        return sorted(self.members, key=lambda m: (m.rank is None, m.rank or 0, m.joined_at))

    def generation_record(self) -> dict[str, Any]:
        """This generation in a few fields, as the next generation's history keeps it."""
        return {
            "generation": self.generation,
            "state": self.state.value,
            "formed": self.formed,
            "ended": self.ended,
            "reason": self.reason,
            "failed_rank": self.failed_rank,
        }

    def to_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "generation": self.generation,
            "world_size": self.world_size,
            "created": self.created,
            "backend": self.backend,
            "state": self.state.value,
            "formed": self.formed,
            "ended": self.ended,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "restart_count": self.restart_count,
            "reason": self.reason,
            "failed_rank": self.failed_rank,
            "max_restarts": self.max_restarts,
            "history": self.history,
            "members": [m.to_record() for m in self.members],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Job:
        job = cls(
            name=record["name"],
            generation=record["generation"],
            world_size=record["world_size"],
            created=record["created"],
            backend=record["backend"],
            state=JobState(record["state"]),
            formed=record["formed"],
            ended=record["ended"],
            master_addr=record["master_addr"],
            master_port=record["master_port"],
            restart_count=record["restart_count"],
            reason=record["reason"],
            # .get: state files written before the field existed hold no such key.
            failed_rank=record.get("failed_rank"),
            max_restarts=record.get("max_restarts", 0),
            history=record.get("history", []),
            members=[Member.from_record(m) for m in record["members"]],
        )
        if job.state is not JobState.FORMING:
            job.formed_event.set()
        return job


@dataclass(frozen=True)
class _Plan:
    """How a complete world forms: each member's rank, and each host's interface and address."""

    ranks: dict[str, int]
    per_host: dict[tuple[str, str | None, str], tuple[str, str]]


@dataclass(frozen=True)
class Ticket:
    """What a join call holds while it waits: its job and its members, in request order."""

    job: Job
    members: tuple[Member, ...]
    secrets: tuple[str, ...]


EventListener = Callable[[JobEvent], None]


class Membership:
    """Jobs, their members and generations; the coordinator's single source of truth.

    ``clock`` is monotonic (liveness), ``wall`` is Unix time (what users see). ``lost_grace`` is
    how long a member whose stream broke may take to report again (default: a third of the
    liveness timeout, one heartbeat interval at the default misses); ``restore_grace`` how long
    members restored from the store have to reconnect before they are judged (at least the
    liveness timeout);
    ``stall_threshold`` how long ranks must wait in one collective before :meth:`stall` names
    the ranks they wait for. ``persist`` is told of every job whose stored record changed (default:
    write it to ``store`` at once).
    """

    def __init__(
        self,
        store: StateStore,
        *,
        liveness_timeout: float,
        max_jobs: int = 1024,
        max_ended_jobs: int = 1024,
        lost_grace: float | None = None,
        restore_grace: float = 0.0,
        stall_threshold: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        persist: Callable[[Job], None] | None = None,
    ) -> None:
        self._store = store
        # Called with each job whose record changed; by default it is written at once. The server
        # passes persistence.WriteBehind.mark, which coalesces the writes off the event loop.
        self._persist = persist or (lambda job: store.save_job(job.to_record()))
        self._liveness_timeout = liveness_timeout
        self._lost_grace = lost_grace if lost_grace is not None else liveness_timeout / 3
        self._restore_grace = max(restore_grace, liveness_timeout)
        self.stall_threshold = stall_threshold
        self._max_jobs = max_jobs
        self._max_ended_jobs = max_ended_jobs
        self._clock = clock
        self._wall = wall
        self._jobs: dict[str, Job] = {}
        self._members: dict[str, tuple[Job, Member]] = {}
        self._listeners: list[EventListener] = []
        self._stall_checked = float("-inf")
        self._restore()

    # -- queries ---------------------------------------------------------------------------------

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
        self._listeners.append(listener)

    # -- join ------------------------------------------------------------------------------------

    def join(self, spec: JoinSpec) -> Ticket:
        """Add the members of ``spec`` to the job's forming world; form it if it is now complete.

        Returns at once; the caller waits on ``ticket.job.formed_event`` and then reads the
        assignment with :meth:`assignment`.

        Raises:
            FailedPreconditionError: the job is running, has another world size, is full, or the
                request names a generation that is not the forming one.
            AlreadyExistsError: a requested rank is taken.
            ResourceExhaustedError: the coordinator already holds ``max_jobs`` active jobs.
        """
        # A fresh generation is built aside and adopted only once every check below has passed:
        # a refused join must leave the previous generation (and its members) exactly as it was.
        job = self._forming_job(spec)
        if spec.world_size != job.world_size:
            raise FailedPreconditionError(
                f"world_size {spec.world_size} does not match {job.label}, which was created with "
                f"world_size {job.world_size}; every member of a job must ask for the same world size"
            )
        if spec.generation and spec.generation != job.generation:
            raise FailedPreconditionError(
                f"generation {spec.generation} is stale: {job.label} is forming now; a member of an "
                f"older generation cannot join a newer one (join with generation 0 to start afresh)"
            )
        joined = len(job.members)
        if joined + len(spec.members) > job.world_size:
            raise FailedPreconditionError(
                f"members: joining {len(spec.members)} more would make {joined + len(spec.members)} "
                f"members in {job.label}, which has world_size {job.world_size}"
            )
        for request in spec.members:
            if request.rank is not None and request.rank in job.requested:
                holder = job.requested[request.rank]
                raise AlreadyExistsError(
                    f"rank {request.rank} is already taken in {job.label} by a member on host "
                    f"{holder.host!r}; each rank can be requested once"
                )
        job.max_restarts = max(job.max_restarts, spec.max_restarts)
        now = self._wall()
        ticket_members: list[Member] = []
        ticket_secrets: list[str] = []
        join_call = job.join_calls
        for request in spec.members:
            secret = secrets.token_urlsafe(24)
            member = Member(
                member_id=secrets.token_hex(8),
                secret_digest=_digest(secret),
                host=spec.host,
                local_rank=request.local_rank,
                requested_rank=request.rank,
                store_port=spec.store_port,
                interfaces=spec.interfaces,
                peer_address=spec.peer_address,
                socket_name=spec.socket_name,
                joined_at=now,
                join_call=join_call,
            )
            ticket_members.append(member)
            ticket_secrets.append(secret)
        # The last join forms the world: choose ranks and interfaces before anything changes, so
        # that a choice that fails leaves the job as it was instead of full and never formed.
        plan = (
            self._plan(job, [*job.members, *ticket_members])
            if len(job.members) + len(ticket_members) == job.world_size
            else None
        )
        if self._jobs.get(job.name) is not job:
            self._adopt(job)
        for member, request in zip(ticket_members, spec.members, strict=True):
            job.members.append(member)
            if request.rank is not None:
                job.requested[request.rank] = member
        # DEBUG: a world of thousands would otherwise log thousands of lines while forming.
        job.join_calls += 1
        log.debug(
            "%s: host %s joined with %d member(s); %d of %d joined",
            job.label,
            spec.host,
            len(spec.members),
            len(job.members),
            job.world_size,
        )
        if plan is not None:
            self._form(job, plan)
        return Ticket(job, tuple(ticket_members), tuple(ticket_secrets))

    def abandon(self, ticket: Ticket) -> None:
        """Withdraw a join whose caller gave up (deadline, cancel) before the world formed."""
        job = ticket.job
        if job.state is not JobState.FORMING:
            return
        gone = {m.member_id for m in ticket.members}
        job.members = [m for m in job.members if m.member_id not in gone]
        job.requested = {r: m for r, m in job.requested.items() if m.member_id not in gone}
        log.info("%s: %d member(s) withdrew before the world formed", job.label, len(gone))
        if not job.members and self._jobs.get(job.name) is job:
            # Nobody is waiting any more: the next join starts the generation afresh. The ended
            # generation it would have replaced comes back, so status keeps showing it.
            if job.previous is not None:
                self._jobs[job.name] = job.previous
            else:
                del self._jobs[job.name]

    def missing_description(self, job: Job) -> str:
        """Which ranks a forming job still lacks, as if it formed now."""
        ranks = _deal_ranks(job.world_size, job.members)
        missing = sorted(set(range(job.world_size)) - set(ranks.values()))
        shown = ", ".join(str(r) for r in missing[:16]) + (", ..." if len(missing) > 16 else "")
        return f"{len(job.members)} of {job.world_size} members joined; ranks missing: {shown}"

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
        previous = job.generation if job is not None else self._store.last_generation(spec.job)
        # A world formed right after a failed one is a restart (an agent's --max-restarts, or the
        # user running the job again): counted so status and the restarts metric can show it.
        restarts = job.restart_count + 1 if job is not None and job.state is JobState.FAILED else 0
        ended = job
        job = Job(
            name=spec.job,
            generation=previous + 1,
            world_size=spec.world_size,
            created=self._wall(),
            backend=spec.backend,
            restart_count=restarts,
            history=[*ended.history, ended.generation_record()][-MAX_HISTORY:] if ended else [],
            previous=ended,
        )
        # Not adopted yet (see join): until then nothing of the previous generation changes.
        return job

    def _adopt(self, job: Job) -> None:
        """Make a fresh generation from :meth:`_forming_job` the job's current one."""
        if job.generation > 1:
            # Members of the ended generation are forgotten: their ids can never act again.
            for member_id in [k for k, (j, _) in self._members.items() if j.name == job.name]:
                del self._members[member_id]
        self._jobs[job.name] = job

    def _forget_old_ended_jobs(self) -> None:
        """Keep at most ``max_ended_jobs`` finished or failed jobs in memory, the newest.

        Without this, every distinct job name ever used would stay in memory for ever. Forgotten
        jobs stay in the state store, which also keeps their generation numbers growing.
        """
        # Only jobs that are over for every member: a failed job's live members still report.
        ended = [j for j in self._jobs.values() if j.state.ended and j.ended]
        excess = len(ended) - self._max_ended_jobs
        if excess <= 0:
            return
        ended.sort(key=lambda j: (j.ended or j.formed or j.created, j.name))
        for job in ended[:excess]:
            del self._jobs[job.name]
            for member in job.members:
                self._members.pop(member.member_id, None)
        log.debug("forgot %d ended job(s) beyond max_ended_jobs %d", excess, self._max_ended_jobs)

    def _plan(self, job: Job, members: Sequence[Member]) -> _Plan:
        """Ranks and interfaces for a world of ``members``; raises before anything changes.

        Members of one host share the interface choice: computed once per host, not once per rank.
        (validation.join_spec already ensured each host has a dialable address.)
        """
        single_host = all(_is_loopback(m.peer_address) for m in members)
        ranks = _deal_ranks(job.world_size, members)
        per_host: dict[tuple[str, str | None, str], tuple[str, str]] = {}
        for m in members:
            key = (m.host, m.peer_address, m.socket_name)
            if key not in per_host:
                iface = choose_interface(
                    m.interfaces, m.peer_address, m.socket_name, single_host=single_host, host=m.host
                )
                address = address_on(iface)
                # Every address handed out (MASTER_ADDR above all) must be one that the member
                # itself reported on that interface: nothing else a client sends, and nothing of
                # another job, can steer ranks elsewhere. The choice rules guarantee it; this keeps
                # it guaranteed should they change.
                if parse_address(address) not in {parse_address(a) for a in iface.addresses}:
                    raise InvalidArgumentError(
                        f"interfaces of host {m.host!r}: address {address!r} chosen on {iface.name!r} "
                        f"is not one the host reported there"
                    )
                per_host[key] = (iface.name, address)
        return _Plan(ranks, per_host)

    def _form(self, job: Job, plan: _Plan) -> None:
        ranks, per_host = plan.ranks, plan.per_host
        now_mono = self._clock()
        for member in job.members:
            member.interface, member.address = per_host[
                (member.host, member.peer_address, member.socket_name)
            ]
            member.rank = ranks[member.member_id]
            member.state = MemberState.RUNNING
            member.last_seen = now_mono
            self._members[member.member_id] = (job, member)
        master = next(m for m in job.members if m.rank == 0)
        job.master_addr = master.address
        job.master_port = master.store_port
        job.state = JobState.RUNNING
        job.formed = self._wall()
        job.previous = None  # the new world replaces the ended one for good
        self._persist(job)
        job.formed_event.set()
        log.info(
            "%s: world formed, %d ranks, master %s:%d on %s",
            job.label,
            job.world_size,
            job.master_addr,
            job.master_port,
            master.interface,
        )
        self._emit(JobEvent(EventKind.WORLD_FORMED, job.name, job.generation, job.formed))

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
    ) -> tuple[Job, Member]:
        """Record a report about a member; returns its job and member.

        ``age`` is how many seconds ago the member itself last showed a sign of life (0: now; an
        agent reports a rank's own alive stamp, which stops moving when the rank is stopped or
        wedged). ``stream`` identifies the stream that carried the report (see :meth:`stream_lost`).
        """
        job, member = self.authenticate(member_id, secret)
        now = self._clock()
        seen = now - age
        # max: a report delayed in transit, or reordered with a fresher one, never moves it back;
        # but the first report of a restored member ends its grace (a last_seen in the future).
        member.last_seen = seen if member.last_seen > now else max(member.last_seen, seen)
        member.last_heartbeat = max(member.last_heartbeat, self._wall() - age)
        member.lost_at = None
        member.stream = stream
        if progress is not None:
            member.progress = progress
        if metrics_address and metrics_address != member.metrics_address:
            member.metrics_address = metrics_address
            self._persist(job)
        return job, member

    def leave(self, member_id: str, secret: str, exit_code: int, reason: str = "") -> Job:
        """Record that a member is done; a non-zero exit code fails the job.

        Idempotent: leaving twice returns the job unchanged.
        """
        job, member = self.authenticate(member_id, secret)
        if member.state in (MemberState.LEFT, MemberState.FAILED):
            return job
        member.exit_code = exit_code
        if exit_code == 0:
            member.state = MemberState.LEFT
            member.reason = reason or "exited with code 0"
            log.debug("%s: rank %s on %s left with code 0", job.label, member.rank, member.host)
        else:
            own_reason = reason or f"exited with code {exit_code}"
            # A rank whose process died takes its connections with it: its peers' collectives fail
            # at once and their exit may reach us before its broken stream is judged. When a member
            # of this job already has a broken stream, that one is the cause: blame it first.
            for other in job.members:
                if other is not member and other.state is MemberState.RUNNING and other.lost_at is not None:
                    self._fail_member(
                        job,
                        other,
                        f"connection lost: its heartbeat stream broke (process or agent gone), and then "
                        f"rank {member.rank} on host {member.host} {own_reason}",
                    )
            self._fail_member(job, member, own_reason)
        self._settle(job)
        self._persist(job)
        return job

    def stream_lost(self, stream: object, member_ids: Iterable[str]) -> None:
        """The stream ``stream``, which carried reports of ``member_ids``, broke without an orderly
        end: its process (or the agent reporting for it) most likely died, since the kernel closes
        a dead process's connections. Each of those members that no newer stream reports fails
        once ``lost_grace`` has passed without a report (see :meth:`sweep`)."""
        now = self._clock()
        lost: list[Member] = []
        for member_id in member_ids:
            found = self._members.get(member_id)
            if found is None:
                continue
            member = found[1]
            if member.stream is stream and member.state is MemberState.RUNNING and member.lost_at is None:
                member.lost_at = now
                lost.append(member)
        if lost:
            log.info(
                "the heartbeat stream of rank(s) %s on host %s broke; judging them in %g s unless they "
                "report again", _rank_list(sorted(_rank(m) for m in lost)), lost[0].host, self._lost_grace,
            )  # fmt: skip

    def sweep(self) -> list[tuple[Job, Member]]:
        """Fail every running member silent for longer than the liveness timeout, or whose stream
        broke ``lost_grace`` ago without a report since; log stalls (once each)."""
        now = self._clock()
        failed: list[tuple[Job, Member]] = []
        # A stall is named after tens of seconds: looking for one each second is plenty (sweeps run
        # four times an interval, and comparing every rank's progress is the costly part of them).
        check_stalls = now - self._stall_checked >= STALL_CHECK_PERIOD_S
        if check_stalls:
            self._stall_checked = now
        for job in list(self._jobs.values()):
            # A failed job's silent members are judged too: otherwise a rank that died after (or
            # while) another failed stays RUNNING and the job never ends.
            if job.state not in (JobState.RUNNING, JobState.FAILED) or job.ended:
                continue
            changed = False
            for member in job.members:
                if member.state is not MemberState.RUNNING:
                    continue
                silent = now - member.last_seen
                if member.lost_at is not None and now - member.lost_at > self._lost_grace:
                    reason = (
                        f"connection lost: its heartbeat stream broke and no report came within "
                        f"{self._lost_grace:g} s (process or agent gone)"
                    )
                elif silent > self._liveness_timeout:
                    reason = f"missed heartbeats: silent for {silent:.1f} s"
                else:
                    continue
                self._fail_member(job, member, reason)
                failed.append((job, member))
                changed = True
            if changed:
                self._settle(job)
                self._persist(job)
            elif job.state is JobState.RUNNING and check_stalls:
                self._log_stall(job)
        return failed

    def stall(self, job: Job) -> Stall | None:
        """The ranks of running ``job`` that the others wait for, or None.

        Ranks make the same sequence of collectives, so sequence numbers line up across them: when
        ranks have been inside collective #k (the highest number any rank reports) for longer than
        ``stall_threshold``, the live ranks whose last collective is below k have not entered it.
        None while nobody has waited that long, or when every rank is in #k (then nobody holds it).
        """
        if job.state is not JobState.RUNNING:
            return None
        live = [m for m in job.members if m.state is MemberState.RUNNING and m.rank is not None]
        if not live:
            return None
        top = max(m.progress.seq for m in live)
        if top == 0:
            return None
        waiting = [m for m in live if m.progress.seq == top and m.progress.in_collective]
        if not waiting:
            return None
        since = min(m.progress.since for m in waiting)
        waited = self._wall() - since
        if waited < self.stall_threshold:
            return None
        blocking = [m for m in live if m.progress.seq < top]
        if not blocking:
            return None
        return Stall(
            seq=top,
            op=waiting[0].progress.op,
            since=since,
            waited=waited,
            waiting=tuple(sorted(_rank(m) for m in waiting)),
            blocking=tuple(sorted(_rank(m) for m in blocking)),
        )

    def _log_stall(self, job: Job) -> None:
        stall = self.stall(job)
        if stall is not None and stall.seq != job.logged_stall:
            job.logged_stall = stall.seq
            hosts = sorted({m.host for m in job.members if m.rank in stall.blocking})
            log.warning("%s: %s (on host(s) %s)", job.label, stall.describe(), ", ".join(hosts))

    def _fail_member(self, job: Job, member: Member, reason: str) -> None:
        member.state = MemberState.FAILED
        member.reason = reason
        now = self._wall()
        log.warning("%s: rank %s on host %s failed: %s", job.label, member.rank, member.host, reason)
        if job.state is JobState.RUNNING:
            job.state = JobState.FAILED
            job.failed_rank = member.rank
            job.reason = f"rank {member.rank} on host {member.host} failed: {reason}"
            self._emit(
                JobEvent(
                    EventKind.MEMBER_FAILED, job.name, job.generation, now, member.rank, member.host, reason
                )
            )
            self._emit(
                JobEvent(
                    EventKind.JOB_FAILED, job.name, job.generation, now, member.rank, member.host, job.reason
                )
            )

    def _settle(self, job: Job) -> None:
        """Finish a job whose members are all gone."""
        if any(m.state is MemberState.RUNNING for m in job.members):
            return
        if job.state is JobState.RUNNING:
            job.state = JobState.FINISHED
            job.ended = self._wall()
            log.info("%s: finished, every rank exited with code 0", job.label)
            self._emit(JobEvent(EventKind.JOB_FINISHED, job.name, job.generation, job.ended))
        elif job.state is JobState.FAILED and not job.ended:
            job.ended = self._wall()
        for member in job.members:
            self._members.pop(member.member_id, None)
        self._forget_old_ended_jobs()

    def _emit(self, event: JobEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not stop the others from hearing
                log.exception("event listener failed on %s", event)

    # -- persistence -----------------------------------------------------------------------------

    def _restore(self) -> None:
        # A restored member is judged only after restore_grace: its reporter needs time to notice
        # the outage and reconnect (backoff with jitter), and the liveness timeout alone can be
        # shorter than that.
        now = self._clock() + self._restore_grace - self._liveness_timeout
        for record in self._store.load_jobs():
            job = Job.from_record(record)
            if job.state is JobState.FORMING:
                continue
            self._jobs[job.name] = job
            for member in job.members:
                member.last_seen = now
                if member.state is MemberState.RUNNING:
                    self._members[member.member_id] = (job, member)
        if self._jobs:
            log.info("restored %d job(s) from the state store", len(self._jobs))
        self._forget_old_ended_jobs()


def _rank(member: Member) -> int:
    if member.rank is None:  # only members of formed worlds reach here; None would be a bug
        raise RuntimeError(f"member {member.member_id} of a formed world has no rank")
    return member.rank


def _rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _is_loopback(address: str | None) -> bool:
    import ipaddress

    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _deal_ranks(world_size: int, members: Sequence[Member]) -> dict[str, int]:
    """Ranks for ``members``: requested ranks as asked, the rest dealt so each host's are contiguous.

    Hosts are served in the order they first joined; within a host, by local rank. A host gets the
    first run of free ranks long enough for all its members, or the lowest free ranks if no run
    is long enough (requested ranks can fragment the range).
    """
    ranks = {m.member_id: m.requested_rank for m in members if m.requested_rank is not None}
    free = sorted(set(range(world_size)) - set(ranks.values()))
    by_host: dict[str, list[Member]] = {}
    for member in members:
        if member.requested_rank is None:
            by_host.setdefault(member.host, []).append(member)
    if not ranks:
        # The common case, nobody asked for a rank: deal in one pass, host by host in join order.
        dealt = (m for host_members in by_host.values() for m in _by_local_rank(host_members))
        return {m.member_id: rank for rank, m in enumerate(dealt)}
    for host_members in by_host.values():
        want = len(host_members)
        start = _first_run(free, want)
        chosen = free[start : start + want] if start is not None else free[:want]
        for member, rank in zip(_by_local_rank(host_members), chosen, strict=False):
            ranks[member.member_id] = rank
        taken = set(chosen)
        free = [r for r in free if r not in taken]
    return ranks


def _by_local_rank(members: list[Member]) -> list[Member]:
    return sorted(members, key=lambda m: (m.join_call, m.local_rank))


def _first_run(free: list[int], length: int) -> int | None:
    """Index in sorted ``free`` where ``length`` consecutive integers start, or None."""
    run_start = 0
    for i in range(len(free)):
        if i > 0 and free[i] != free[i - 1] + 1:
            run_start = i
        if i - run_start + 1 >= length:
            return run_start
    return None
