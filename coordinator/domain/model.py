"""The coordinator's domain model: jobs, their members, and what is said about them.

A *job* is a name plus a *generation*: every world that forms under a name gets the next
generation number, and member ids belong to exactly one generation, so nothing from an earlier
run (a member id, an address, a port) can leak into a later one.

Plain data only: no I/O, no clocks, no asyncio. State changes go through :mod:`transitions`; the
operations that make them are in :mod:`membership`; the stored form is in :mod:`records`.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.common.messages import Progress, WorkerEndpoint

__all__ = [
    "MAX_HISTORY",
    "ElasticRange",
    "EventKind",
    "FailureReason",
    "Job",
    "JobEvent",
    "JobMemory",
    "JobState",
    "JoinSpec",
    "Member",
    "MemberRequest",
    "MemberState",
    "Progress",
    "Stall",
    "Ticket",
    "WorkerEndpoint",
]

#: Earlier generations kept per job name, for ``status``; older ones stay in the state store only.
MAX_HISTORY = 100


class JobState(str, enum.Enum):
    FORMING = "FORMING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    # An elastic job's generation that ended so that the world re-forms (a re-rendezvous): a
    # member died or asked for it. Not a failure; the next generation is no restart.
    RESTARTED = "RESTARTED"

    @property
    def ended(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.RESTARTED)


class MemberState(str, enum.Enum):
    JOINING = "JOINING"
    RUNNING = "RUNNING"
    LEFT = "LEFT"
    FAILED = "FAILED"


@dataclass(frozen=True)
class JobEvent:
    """Something every member of a job must hear about; ``rank``/``host`` name the member, and
    ``failure`` says why it failed (MEMBER_FAILED, JOB_FAILED)."""

    kind: EventKind
    job: str
    generation: int
    time: float
    rank: int | None = None
    host: str = ""
    reason: str = ""
    failure: FailureReason | None = None


@dataclass(frozen=True)
class MemberRequest:
    """One member of a join: the rank it asks for (None = deal one) and its local index."""

    local_rank: int
    rank: int | None = None


@dataclass(frozen=True)
class ElasticRange:
    """How many members an elastic world forms with (torchrun's ``--nnodes MIN:MAX``), and its
    last call: once ``min_members`` have joined, the world forms when ``last_call`` seconds pass
    without a new arrival (see :mod:`.elastic`). Checked by ``validation.join_spec``."""

    min_members: int
    max_members: int
    last_call: float

    def describe(self) -> str:
        return f"min_members {self.min_members}, max_members {self.max_members}"


@dataclass(frozen=True)
class JoinSpec:
    """A validated join request (see ``validation.join_spec``). ``elastic`` is set for an elastic
    job (``world_size`` is then its max_members); ``rejoin_member_id``/``rejoin_secret`` name the
    member of the running generation that this join re-forms (a re-rendezvous)."""

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
    elastic: ElasticRange | None = None
    rejoin_member_id: str = ""
    rejoin_secret: str = field(default="", repr=False)


@dataclass(frozen=True)
class Stall:
    """Ranks waiting in collective ``seq`` for ranks that have not entered it (see
    :func:`liveness.find_stall`).

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
            f"({self.op or 'unknown op'}) for rank(s) {rank_list(self.blocking)}, which have not entered it"
        )


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
    # Why it failed, as a bounded value (None unless FAILED); ``reason`` is the text for people.
    failure: FailureReason | None = None
    last_heartbeat: float = 0.0
    # Monotonic time the last report about this member arrived (its age aside). Not persisted.
    last_report: float = 0.0
    progress: Progress = field(default_factory=Progress)
    # Its /metrics endpoint, as its reports name it; persisted (a standby's /sd reads it from etcd).
    metrics_address: str = ""
    # The /metrics endpoints of the workers it started that are not members (a torchrun node's
    # workers), as its last report listed them; persisted. /sd lists one target per endpoint.
    worker_endpoints: tuple[WorkerEndpoint, ...] = ()
    # Monotonic time of the last sign of life; not persisted (a restarted coordinator restarts it).
    last_seen: float = 0.0
    # False from the world's formation until the member's Join was answered (its state written):
    # until then it cannot report, and is judged by the join timeout instead. Not persisted: a
    # restored member was written, so it was (or is being) answered.
    answered: bool = True
    # Monotonic time the stream that last carried this member's reports broke, while no newer
    # report came; None while its stream is up. Not persisted.
    lost_at: float | None = None
    # The stream that last carried a report of this member (its .reporters.Reporter; tests may
    # pass any token), so that the end of an older stream, replaced by a newer one, does not count
    # as a loss.
    stream: object | None = field(default=None, repr=False)
    # Its last report came fresh over an open by-exception stream, which stands for it: the
    # liveness sweep does not visit it (it is not in JobMemory.judged; see .reporters). Memory only.
    trusted: bool = False
    # SHA-256 of the join id of the Join that brought it ("" when none was sent). Persisted, so a
    # Join resent after a take-over or restart gets its world's answer (see :mod:`.resent_joins`).
    join_digest: str = ""
    # Which join call of its generation brought the member (0, 1, ...): two agents on one host
    # each get a contiguous block, in the order they joined. Only needed until the world forms.
    join_call: int = 0
    # The secret this member last proved it holds, so that the report that repeats it every beat
    # is checked without hashing it again (see check_secret). Memory only.
    verified_secret: bytes = field(default=b"", repr=False)
    # Elastic jobs: the rank this host had in the generation it re-joins from (a re-rendezvous), so
    # that survivors keep their order in the next world. Only needed until the world forms.
    previous_rank: int | None = None

    def check_secret(self, secret: str) -> bool:
        # compare_digest: constant time either way, so the cache tells an attacker nothing (bytes:
        # it refuses str with non-ASCII characters, which a client may send).
        sent = secret.encode()
        if self.verified_secret and hmac.compare_digest(self.verified_secret, sent):
            return True
        if hmac.compare_digest(self.secret_digest, digest(secret)):
            self.verified_secret = sent
            return True
        return False


@dataclass
class JobMemory:
    """What the coordinator keeps of a job generation in memory only, beside its stored record
    (every other field of :class:`Job`, see :mod:`~sarcomm.coordinator.storage.records`): indexes
    derived from the members, links to the generations around it, and the elastic rendezvous's
    bookkeeping. A coordinator that restarts or takes over starts these afresh."""

    # Requested ranks of a forming world, kept up to date so a join checks in O(1), not O(members).
    requested: dict[int, Member] = field(default_factory=dict)
    # How many Join calls brought members to this generation (the next one's Member.join_call).
    join_calls: int = 0
    # The ended generation this forming one replaces: put back if every join withdraws, so the
    # name keeps its history and status.
    previous: Job | None = None
    # The collective whose stall was last logged, so each stall is logged once.
    logged_stall: int = 0
    # The next generation, forming behind this running one: the members parked in it wait (their
    # Joins are resent to a coordinator that takes over).
    successor: Job | None = None
    # Monotonic time of a forming elastic generation's last arrival.
    last_arrival: float = 0.0
    # Monotonic time a member of this generation was last heard from for the first time (its
    # first report to this coordinator); 0.0 while none was. Members never heard from are not
    # failed for silence while first reports keep coming (see liveness.silence_verdict); a
    # restarted coordinator hears every member for the first time again.
    first_heard: float = 0.0
    # Once formed: the members before this index are no longer RUNNING (see any_running).
    running_from: int = 0
    # A generation that ended RESTARTED: its members that were alive then. The generation after
    # it: those members by id, expected back: each re-join is known (and keeps its place in the
    # rank order) although its generation was forgotten, and the world forms at once when all
    # are back (see .elastic, rule 1).
    survivors: tuple[Member, ...] = ()
    returning: dict[str, Member] = field(default_factory=dict)
    # Why a parked generation was sent away without forming (None while it may form), and how many
    # of its first members fitted into the world then (the rest were beyond max_members).
    withdrawn: str | None = None
    room: int = 0
    # Once formed: the members the liveness sweep judges, by id, in the order of ``members``: all
    # of them, but those whose open by-exception stream stands for them (``Member.trusted``, see
    # .reporters). Members that stopped running leave it at the next sweep.
    judged: dict[str, Member] = field(default_factory=dict)
    # Members a by-exception report said are quiet (inside one collective for quiet_seconds), with
    # the collective they were in: while one still is, the job's progress is asked for (see
    # .by_exception). Monotonic time it was asked for last (0.0: never).
    quiet: dict[str, tuple[Member, int]] = field(default_factory=dict)
    progress_asked: float = 0.0


@dataclass
class Job:
    """One generation of a job: the fields here are its stored record (:mod:`records` writes and
    reads each of them), ``memory`` what only this coordinator's memory holds."""

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
    # Elastic jobs (None: a fixed world_size). See :mod:`.elastic` for the fields below.
    elastic: ElasticRange | None = None
    # Why no new world forms under this job while this generation runs (a member finished or closed
    # its rendezvous); None while it is open.
    closed: str | None = None
    # Generations of this name that ended in a re-rendezvous (RESTARTED), not in a failure.
    rerendezvous_count: int = 0
    # What this coordinator keeps of the generation in memory only (see JobMemory).
    memory: JobMemory = field(default_factory=JobMemory, repr=False)

    @property
    def label(self) -> str:
        return f"job {self.name!r} generation {self.generation}"

    def ranked_members(self) -> list[Member]:
        return sorted(self.members, key=lambda m: (m.rank is None, m.rank or 0, m.joined_at))

    def failed_member(self) -> Member | None:
        """The member whose failure failed the job (not a peer its agent stopped afterwards), or
        any failed member when that one is not known."""
        failed = [m for m in self.members if m.state is MemberState.FAILED]
        return next((m for m in failed if m.rank == self.failed_rank), failed[0] if failed else None)

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


@dataclass(frozen=True)
class Ticket:
    """What a join call holds while it waits: its job and its members, in request order."""

    job: Job
    members: tuple[Member, ...]
    secrets: tuple[str, ...]
    # Handed to a Join sent again (the same join id) rather than made for it: see :mod:`.resent_joins`.
    resent: bool = False


#: Random bytes of a member secret and of a member id.
SECRET_BYTES = 24
MEMBER_ID_BYTES = 8
RANDOM_BYTES_PER_MEMBER = SECRET_BYTES + MEMBER_ID_BYTES


def new_members(
    spec: JoinSpec, joined_at: float, join_call: int, join_id: str
) -> tuple[list[Member], list[str]]:
    """The members a Join brings, in request order, and their secrets (only digests are kept)."""
    members: list[Member] = []
    issued: list[str] = []
    # The randomness of every member at once, one read of the OS's random source for the Join
    # instead of two per member (system calls, tens of thousands for a big world). Each secret and
    # id is what secrets.token_urlsafe(24) and token_hex(8) would make of the same bytes.
    random = secrets.token_bytes(RANDOM_BYTES_PER_MEMBER * len(spec.members))
    for i, request in enumerate(spec.members):
        own = random[i * RANDOM_BYTES_PER_MEMBER : (i + 1) * RANDOM_BYTES_PER_MEMBER]
        secret = base64.urlsafe_b64encode(own[:SECRET_BYTES]).rstrip(b"=").decode("ascii")
        members.append(
            Member(
                member_id=own[SECRET_BYTES:].hex(),
                secret_digest=digest(secret),
                host=spec.host,
                local_rank=request.local_rank,
                requested_rank=request.rank,
                store_port=spec.store_port,
                interfaces=spec.interfaces,
                peer_address=spec.peer_address,
                socket_name=spec.socket_name,
                joined_at=joined_at,
                join_call=join_call,
                join_digest=digest(join_id) if join_id else "",
            )
        )
        issued.append(secret)
    return members, issued


def digest(secret: str) -> str:
    """The stored form of a member secret (SHA-256, hex)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def member_rank(member: Member) -> int:
    """The rank of a member of a formed world."""
    if member.rank is None:  # only members of formed worlds reach here; None would be a bug
        raise RuntimeError(f"member {member.member_id} of a formed world has no rank")
    return member.rank


def rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    """``0, 1, 2``, cut after ``limit`` ranks with the count."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")


@dataclass(frozen=True)
class StoredState:
    """What a coordinator starts from: the latest generation of every stored job name, and the
    highest generation ever stored per name (so numbering continues for forgotten names)."""

    jobs: list[Job] = field(default_factory=list)
    generations: dict[str, int] = field(default_factory=dict)


def withdraw_members(job: Job, leaving: Sequence[Member]) -> None:
    """Take the members of one Join (appended together, in order) out of forming ``job``.

    When a big world does not form in time, its Joins give up one after another in the order
    they came: each one's members are then the first of the list, cut off without looking at the
    rest (rebuilding the list for each Join would make the give-up of a big world quadratic)."""
    count = len(leaving)
    members = job.members
    gone = {id(m) for m in leaving}
    fits = 0 < count <= len(members)
    if fits and all(a is b for a, b in zip(members, leaving, strict=False)):
        del members[:count]
    elif fits and all(a is b for a, b in zip(members[-count:], leaving, strict=True)):
        del members[-count:]
    else:
        job.members = [m for m in members if id(m) not in gone]
    if job.memory.requested:
        job.memory.requested = {r: m for r, m in job.memory.requested.items() if id(m) not in gone}


def any_running(job: Job) -> bool:
    """Whether a member of ``job`` is RUNNING, asked after every exit of every member.

    Once a world has formed no member becomes RUNNING again (LEFT and FAILED are final), so the
    members before the first running one found last time need no second look: a job's exits cost
    one pass over its members in all, not one each (which would make a big job's end quadratic)."""
    members = job.members
    if job.state is JobState.FORMING:
        return any(m.state is MemberState.RUNNING for m in members)
    i, count = job.memory.running_from, len(members)
    while i < count and members[i].state is not MemberState.RUNNING:
        i += 1
    job.memory.running_from = i
    return i < count
