"""Joins sent again: one Join, however many tries, gets one set of members, and its ``join_id``
never gets another Join's.

A client sends the same Join again (the same message, its ``join_id`` included) when it got no
answer: gRPC retried an UNAVAILABLE answer, the connection looked dead, the client followed a new
leader, or the coordinator restarted. :class:`JoinIds` recognises those tries by their join id.

**What a resend may and may not change.** A resend must repeat what identifies its Join and what
its world is planned on (:class:`JoinIdentity`): the job, host, world_size, its members (how
many, their local ranks and requested ranks), store_port, socket_name and interfaces. It may come
over another connection (another peer address) and with another join_timeout_seconds; the first
try's generation, backend and max_restarts stand. A Join whose join id is known but which differs
in any of those is not a resend and gets nothing of the first Join: it is refused
(ALREADY_EXISTS) naming the join id and each difference, the value first sent and the value sent
now. The refusal changes nothing: the first Join's members and secrets stay as they were.

**Before a restart** every try of a Join waits on one ticket (its members and their secrets),
kept while its generation is current. A try that gives up (its deadline, its caller hung up)
withdraws the members only when it was the last call waiting on them: the resend that replaced it
on a new connection still forms the world.

**After a restart or take-over** the tickets are gone (they lived in memory), but members keep the
digest of the join id that brought them (persisted with them, on SQLite and etcd alike), and what
identifies a Join is in their records too. A resend is recognised and answered with the same
members, ranks and master, and with fresh secrets: only digests are stored, and the client never
received the first ones. That is why it is honoured only while none of those members has reported
to this coordinator: the client sends again only a Join it got no answer to, so a member that
reported had its answer, and its secret must not change under it (the Join is refused as for a
running job instead). A Join with another identity is refused as above, before any secret changes.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sarcomm.common.errors import AlreadyExistsError, shorten
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.coordinator.domain.model import (
    EventKind,
    Job,
    JobEvent,
    JobState,
    JoinSpec,
    Member,
    MemberState,
    Ticket,
    digest,
)

log = logging.getLogger(__name__)

#: What the refusal of a reused join id says a resend must repeat, and what to do instead.
RESEND_RULE = (
    "a Join sent again must repeat its first try (job, host, world_size, members, their ranks and "
    "local ranks, store_port, socket_name, interfaces); give each new Join a fresh random join_id"
)


@dataclass(frozen=True)
class JoinIdentity:
    """What identifies a Join: every try of it must send the same (see the module)."""

    job: str
    host: str
    world_size: int
    members: int
    ranks: tuple[int | None, ...]
    local_ranks: tuple[int, ...]
    store_port: int
    socket_name: str
    interfaces: tuple[InterfaceInfo, ...]

    @classmethod
    def of_spec(cls, spec: JoinSpec) -> JoinIdentity:
        """The identity of a Join as sent."""
        return cls(
            job=spec.job,
            host=spec.host,
            world_size=spec.world_size,
            members=len(spec.members),
            ranks=tuple(m.rank for m in spec.members),
            local_ranks=tuple(m.local_rank for m in spec.members),
            store_port=spec.store_port,
            socket_name=spec.socket_name,
            interfaces=spec.interfaces,
        )

    @classmethod
    def of_members(cls, job: Job, members: Sequence[Member]) -> JoinIdentity:
        """The identity of the Join that brought ``members`` (at least one) into ``job``, from what
        the members keep: the same in memory and as restored from the store."""
        first = members[0]
        return cls(
            job=job.name,
            host=first.host,
            world_size=job.world_size,
            members=len(members),
            ranks=tuple(m.requested_rank for m in members),
            local_ranks=tuple(m.local_rank for m in members),
            store_port=first.store_port,
            socket_name=first.socket_name,
            interfaces=first.interfaces,
        )

    def differences(self, sent: JoinIdentity) -> list[str]:
        """How ``sent`` differs from this one, each as ``field <value then> then, <value now> now``."""
        found = []
        for field in dataclasses.fields(self):
            then, now = getattr(self, field.name), getattr(sent, field.name)
            if then == now or (field.name in ("ranks", "local_ranks") and self.members != sent.members):
                continue  # per-member lists differ anyway when the number of members does
            name = {"ranks": "members.rank", "local_ranks": "members.local_rank"}.get(field.name, field.name)
            shown = _shown(then), _shown(now)
            if shown[0] == shown[1]:  # interfaces that differ in kind or default route only
                shown = _shown(then, detailed=True), _shown(now, detailed=True)
            found.append(f"{name} {shown[0]} then, {shown[1]} now")
        return found


def _shown(value: object, detailed: bool = False) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], InterfaceInfo):
        return shorten("; ".join(_interface(i, detailed) for i in value), 120)
    if isinstance(value, tuple):
        return "[" + ", ".join("any" if v is None else str(v) for v in value) + "]"
    return shorten(value)


def _interface(interface: InterfaceInfo, detailed: bool) -> str:
    shown = " ".join([interface.name, *interface.addresses])
    if detailed:
        shown += f" {interface.kind.name.lower()}" + (" default route" if interface.default_route else "")
    return shown


@dataclass
class _Entry:
    """One join id of a current generation: its job's name, its ticket (None for one restored
    from the store and not sent again yet) and how many calls wait on the ticket now."""

    job: str
    ticket: Ticket | None
    calls: int = 0


class JoinIds:
    """The Joins with a join id of the current generations, by the digest of their join id.

    ``current`` gives a job name's current generation (the membership's); ``persist`` is told of a
    job whose members got fresh secrets (see the module). Plain data and synchronous, like the
    membership that owns it.
    """

    def __init__(self, current: Callable[[str], Job | None], persist: Callable[[Job], None]) -> None:
        self._current = current
        self._persist = persist
        self._entries: dict[str, _Entry] = {}
        # The digests of each job name's entries, so that an ended generation drops them at once.
        self._by_job: dict[str, set[str]] = {}

    def __len__(self) -> int:
        """How many join ids it holds now."""
        return len(self._entries)

    def restore(self, job: Job) -> None:
        """Know the join ids of a running ``job`` read from the store (by their digests)."""
        if job.state is not JobState.RUNNING:
            return
        for member in job.members:
            if member.join_digest and member.join_digest not in self._entries:
                self._add(member.join_digest, _Entry(job.name, None))

    def resend(self, spec: JoinSpec, join_id: str) -> Ticket | None:
        """The ticket of an earlier try of this Join (``resent`` set), with this call counted as one
        more waiting on it; None when ``join_id`` is "" or names no Join of a current generation,
        or its members were already heard from after a restart (see the module).

        Raises:
            AlreadyExistsError: ``join_id`` is another Join's: ``spec`` differs from what it sent.
        """
        if not join_id:
            return None
        key = digest(join_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        job = self._current(entry.job)
        members = self._members(entry, job, key)
        if job is None or not members:
            self._drop(key)
            return None
        if entry.ticket is not None:
            job = entry.ticket.job  # the current generation, or the one parked behind it
        differences = JoinIdentity.of_members(job, members).differences(JoinIdentity.of_spec(spec))
        if differences:
            log.warning(
                "%s: refused a Join from host %r that reuses the join id of another Join (%s)",
                job.label, spec.host, "; ".join(differences),
            )  # fmt: skip
            raise AlreadyExistsError(
                f"join_id {shorten(join_id)} names another Join ({'; '.join(differences)}): {RESEND_RULE}"
            )
        if entry.ticket is None:
            entry.ticket = reissue(job, members)
            if entry.ticket is None:
                return None
            self._persist(job)
            log.info(
                "%s: a Join from host %r sent again after a restart answered again", job.label, spec.host
            )
        entry.calls += 1
        return dataclasses.replace(entry.ticket, resent=True)

    def _members(self, entry: _Entry, job: Job | None, key: str) -> Sequence[Member]:
        """The members ``entry``'s Join brought into ``job`` (or, parked, into the generation
        waiting behind it: an elastic job's successor), or none once that generation is over."""
        if job is None or job.state.ended:
            return ()
        if entry.ticket is not None:
            mine = entry.ticket.job
            return entry.ticket.members if mine is job or mine is job.memory.successor else ()
        if job.state is not JobState.RUNNING:
            return ()
        return [m for m in job.members if m.join_digest == key]

    def add(self, ticket: Ticket) -> None:
        """Know the new Join ``ticket`` (whose members carry its join id's digest); its call waits."""
        key = ticket.members[0].join_digest
        if key:
            self._add(key, _Entry(ticket.job.name, ticket, calls=1))

    def release(self, ticket: Ticket) -> bool:
        """One call waiting on ``ticket`` is gone; whether it was the last one. The last one of a
        world that has not formed takes the join id with it: its members are withdrawn."""
        key = ticket.members[0].join_digest
        entry = self._entries.get(key) if key else None
        if entry is None or entry.ticket is None or entry.ticket.members is not ticket.members:
            return True
        entry.calls = max(0, entry.calls - 1)
        if entry.calls:
            return False
        if ticket.job.state is JobState.FORMING:
            self._drop(key)
        return True

    def forget_ended(self, event: JobEvent) -> None:
        """A listener of the membership's events: a generation that ended takes its join ids along
        (they hold its members' secrets and the whole generation); a Join sent again after that
        joins the next one. A re-rendezvous (JOB_RESTARTING) ends one generation of a job that
        goes on: its join ids go, those of the next generation (joins parked behind it, re-joins)
        stay."""
        if event.kind in (EventKind.JOB_FINISHED, EventKind.JOB_FAILED):
            for key in self._by_job.pop(event.job, set()):
                self._entries.pop(key, None)
        elif event.kind is EventKind.JOB_RESTARTING:
            for key in list(self._by_job.get(event.job, ())):
                ticket = self._entries[key].ticket
                # No ticket: restored from the store for the generation running then, over now.
                if ticket is None or ticket.job.generation <= event.generation:
                    self._drop(key)

    def _add(self, key: str, entry: _Entry) -> None:
        self._drop(key)
        self._entries[key] = entry
        self._by_job.setdefault(entry.job, set()).add(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            keys = self._by_job.get(entry.job)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_job[entry.job]

    def check_invariants(self) -> None:
        """Raise AssertionError when the two maps disagree (for tests: see
        :meth:`~.membership.Membership.check_invariants`)."""
        by_job = {(entry.job, key) for key, entry in self._entries.items()}
        assert by_job == {(job, key) for job, keys in self._by_job.items() for key in keys}, (
            "join ids out of step"
        )
        assert all(self._by_job.values()), "an empty set of join ids kept"


def reissue(job: Job, members: Sequence[Member]) -> Ticket | None:
    """A ticket for ``members`` of running ``job`` (brought by one Join before a restart), with new
    secrets; None when one of them is no longer running or was heard from since the restart."""
    if any(m.state is not MemberState.RUNNING or m.last_report for m in members):
        return None
    issued = []
    for member in members:
        secret = secrets.token_urlsafe(24)
        member.secret_digest = digest(secret)
        member.verified_secret = b""
        issued.append(secret)
    # job.members keeps the order members joined in, so this is the first answer's order too.
    return Ticket(job, tuple(members), tuple(issued))
