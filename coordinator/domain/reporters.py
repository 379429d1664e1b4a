"""Heartbeat streams as the membership sees them: :class:`Reporter`, and the open by-exception ones.

A stream's reporter (an agent, a self-registered rank, torchrun's plugin) reports its members
every interval, or, once it took the coordinator's :class:`~sarcomm.common.messages.ReportPolicy`
(``by_exception``), only what changed, renewing a lease with an empty request when nothing did.

A member whose last report came fresh over an open by-exception stream is *trusted*: its stream,
which the server's keepalive pings prove, stands for it, and the liveness sweep does not visit it
(``Member.trusted``, ``JobMemory.judged``). It is judged again, by the rules of :mod:`liveness`,
once its reporter says it went silent, once the stream ends (broken or closed), and it fails
with every member its stream trusts when the stream's lease runs out
(:func:`lease_expired`): the reporter's own loop is stuck while its connection still answers
pings, which nothing else would catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sarcomm.coordinator.domain.model import Member
from sarcomm.coordinator.domain.policy import LEASE_PERIODS

__all__ = ["Reporter", "last_sign_of_life", "lease_expired", "lease_reason"]


@dataclass(eq=False)
class Reporter:
    """One Heartbeat stream (the service's ``StreamReports`` holds it; ``Member.stream`` names it).

    Compared by identity: each stream is its own reporter."""

    #: Whether the stream reports by exception (it sent ``by_exception``); False: every interval.
    by_exception: bool = False
    #: The lease it was offered last (seconds; 0 until offered).
    lease_seconds: float = 0.0
    #: Monotonic time of its last request (any: an empty one renews the lease).
    last_message: float = 0.0
    #: Unix time of the same (what ``status`` shows as its trusted members' last heartbeat).
    last_message_wall: float = 0.0
    #: Ids of the members it reported.
    members: set[str] = field(default_factory=set)
    #: False once the stream ended (broken or closed) or its lease ran out.
    open: bool = True

    def renewed(self, now: float, wall: float) -> None:
        """A request arrived on the stream at monotonic ``now`` (Unix ``wall``)."""
        self.last_message = now
        self.last_message_wall = wall


def lease_expired(reporter: Reporter, now: float) -> bool:
    """Whether open by-exception ``reporter`` has sent nothing for :data:`LEASE_PERIODS` leases."""
    return now - reporter.last_message > LEASE_PERIODS * reporter.lease_seconds


def lease_reason(reporter: Reporter, now: float) -> str:
    """Why the members of a reporter whose lease ran out failed."""
    return (
        f"missed heartbeats: its reporter renewed no lease in {LEASE_PERIODS} x {reporter.lease_seconds:g} s "
        f"({now - reporter.last_message:.1f} s without a message: the agent's loop is stuck; its connection "
        "still answers pings)"
    )


def last_sign_of_life(member: Member) -> float:
    """Unix time of ``member``'s last sign of life, as ``status`` shows it (``last_heartbeat``):
    its last report, or, while its open by-exception stream stands for it, that stream's last
    message (its reporter would have reported it had its own sign of life grown old)."""
    stream = member.stream
    if member.trusted and isinstance(stream, Reporter) and stream.open:
        return max(member.last_heartbeat, stream.last_message_wall)
    return member.last_heartbeat
