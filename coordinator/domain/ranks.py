"""How a complete world is laid out: each member's rank, and each host's interface and address.

Pure functions of the members that joined; nothing here changes a member. :mod:`membership`
computes the :class:`Plan` before it changes anything, so a choice that fails leaves the job as it
was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.interfaces import InterfaceInfo, address_on, choose_interface
from sarcomm.coordinator.domain.model import Job, Member

#: (host, the address it connected from, its forced interface): members sharing it share a choice.
HostKey = tuple[str, str | None, str]


@dataclass(frozen=True)
class Plan:
    """How a complete world forms: each member's rank, and each host's interface and address."""

    ranks: dict[str, int]
    per_host: dict[HostKey, tuple[str, str]]


def host_key(member: Member) -> HostKey:
    return (member.host, member.peer_address, member.socket_name)


def plan_world(world_size: int, members: Sequence[Member]) -> Plan:
    """Ranks and interfaces for a world of ``members``.

    Members of one host share the interface choice: computed once per host, not once per rank.
    (validation.join_spec already ensured each host has a dialable address.)

    Raises:
        InvalidArgumentError: a host has no interface the rules can choose.
    """
    single_host = all(is_loopback(m.peer_address) for m in members)
    ranks = deal_ranks(world_size, members)
    per_host: dict[HostKey, tuple[str, str]] = {}
    # The choice is a function of what a host reported, not of its name: hosts that reported the
    # same (a host's members joining one by one, or hosts alike but for their names) share it.
    chosen: dict[tuple[tuple[InterfaceInfo, ...], str | None, str], tuple[str, str]] = {}
    for m in members:
        key = host_key(m)
        if key not in per_host:
            reported = (m.interfaces, m.peer_address, m.socket_name)
            choice = chosen.get(reported)
            if choice is None:
                choice = chosen[reported] = _choose(m, single_host)
            per_host[key] = choice
    return Plan(ranks, per_host)


def _choose(member: Member, single_host: bool) -> tuple[str, str]:
    """(interface, address) for ``member``'s host; raises as :func:`plan_world`."""
    iface = choose_interface(
        member.interfaces, member.peer_address, member.socket_name, single_host=single_host, host=member.host
    )
    address = address_on(iface)
    # Every address handed out (MASTER_ADDR above all) must be one that the member itself
    # reported on that interface: nothing else a client sends, and nothing of another job, can
    # steer ranks elsewhere. The choice rules guarantee it; this keeps it guaranteed should they
    # change.
    if parse_address(address) not in {parse_address(a) for a in iface.addresses}:
        raise InvalidArgumentError(
            f"interfaces of host {member.host!r}: address {address!r} chosen on {iface.name!r} "
            f"is not one the host reported there"
        )
    return iface.name, address


def missing_ranks(world_size: int, members: Sequence[Member]) -> list[int]:
    """The ranks no member of a forming world would get if it formed now."""
    return sorted(set(range(world_size)) - set(deal_ranks(world_size, members).values()))


def deal_ranks(world_size: int, members: Sequence[Member]) -> dict[str, int]:
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


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (as the coordinator saw a member connect from) is a loopback address."""
    parsed = parse_address(address) if address else None
    return parsed is not None and parsed.is_loopback


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


#: Missing ranks a description names, at most.
SHOWN_MISSING = 16


def describe_missing(job: Job) -> str:
    """Which ranks a forming job still lacks, as if it formed now.

    Every Join waiting on a world that does not form in time asks this as it gives up: 32,768 of
    them in a burst. When no member asked for a rank (the common case) the joined members get
    ranks 0..n-1 (see :func:`deal_ranks`), so the missing ones are n.. and nothing is dealt."""
    joined = len(job.members)
    if job.memory.requested:  # ranks some members asked for: dealt as the world would form
        missing: Sequence[int] = missing_ranks(job.world_size, job.members)
    else:
        missing = range(joined, job.world_size)
    more = ", ..." if len(missing) > SHOWN_MISSING else ""
    shown = ", ".join(str(r) for r in missing[:SHOWN_MISSING]) + more
    return f"{joined} of {job.world_size} members joined; ranks missing: {shown}"
