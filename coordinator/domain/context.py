"""What the membership's parts may use of it: :class:`~.elastic.ElasticRendezvous` and
:class:`~.sweep.LivenessSweep` act on the membership's jobs and members through a
:class:`MembershipContext` it gives them (torch's rendezvous passes its operations an explicit
context the same way), and nothing else of it is theirs: its indexes change only in
:class:`~.membership.Membership` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sarcomm.coordinator.domain.clock import Clock
from sarcomm.coordinator.domain.model import Job, JoinSpec, Member
from sarcomm.coordinator.domain.ranks import Plan
from sarcomm.coordinator.domain.transitions import StateMachine

__all__ = ["MembershipContext", "Timeouts"]


@dataclass
class Timeouts:
    """The membership's judging times, in seconds (see :class:`~.membership.Membership`)."""

    #: A running member silent for longer fails (interval x misses).
    liveness: float
    #: How long a member whose stream broke may take to report again.
    lost_grace: float
    #: A formed world's wait for its Join answers (``Member.answered``): the join timeout.
    answer: float = 600.0
    #: How long ranks wait in one collective before the ranks they wait for are named.
    stall: float = 30.0
    #: A by-exception report of a member whose own sign of life is this old says it went silent
    #: (``policy.silence_seconds``: interval x (misses - 1)); a younger one, that it is fresh.
    silence: float = 2.0


@dataclass(frozen=True)
class MembershipContext:
    """The membership as its parts see it. Every callable is the membership's own."""

    clock: Clock
    machine: StateMachine
    timeouts: Timeouts
    #: The current generation of a job name, or None.
    job: Callable[[str], Job | None]
    #: The current generations of every job name (a list: the caller may change them meanwhile).
    jobs: Callable[[], list[Job]]
    #: The current member of that id and its job (a formed world's, until its job settles), or None.
    member: Callable[[str], tuple[Job, Member] | None]
    #: Every such member and its job.
    members: Callable[[], Iterable[tuple[Job, Member]]]
    #: The forming generation a Join of ``spec`` goes to (built aside until adopted; may raise).
    forming_job: Callable[[JoinSpec], Job]
    #: Make a generation from ``forming_job`` the job's current one.
    adopt: Callable[[Job], None]
    #: Form a world by ``plan``: ranks, the master, RUNNING, persisted.
    form: Callable[[Job, Plan], None]
    #: After members of a job changed: settle it, go on with an elastic job, persist it.
    changed: Callable[[Job], None]
    #: Hand a job whose stored record changed to the store.
    persist: Callable[[Job], None]
