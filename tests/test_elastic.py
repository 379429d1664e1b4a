"""Elastic worlds (torchrun's ``--nnodes MIN:MAX``) in the membership domain, with a fake clock:
the rules of :mod:`sarcomm.coordinator.domain.elastic`, one test (or a few) per rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sarcomm.common.errors import FailedPreconditionError, JobClosedError, UnauthenticatedError
from sarcomm.coordinator.domain.elastic import waiting
from sarcomm.coordinator.domain.membership import (
    EventKind,
    JobEvent,
    JobState,
    JoinSpec,
    Membership,
    MemberState,
    Ticket,
)
from sarcomm.coordinator.domain.model import ElasticRange, FailureReason
from sarcomm.coordinator.storage.records import load_state, write_at_once
from sarcomm.coordinator.storage.store import SqliteStore
from tests.helpers import FakeClock, assigned_rank, spec

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")

LIVENESS_S = 3.0
LAST_CALL_S = 2.0


def espec(
    host: str,
    *,
    job: str = "t",
    low: int = 2,
    high: int = 3,
    last_call: float = LAST_CALL_S,
    rejoin: Ticket | None = None,
) -> JoinSpec:
    """A one-member Join of an elastic job (a torchrun node); ``rejoin``: the ticket of the member
    of the running generation this node was (a re-rendezvous)."""
    base = spec(host, job=job, world_size=high)
    member = rejoin.members[0] if rejoin is not None else None
    return dataclasses.replace(
        base,
        elastic=ElasticRange(low, high, last_call),
        rejoin_member_id=member.member_id if member is not None else "",
        rejoin_secret=rejoin.secrets[0] if rejoin is not None else "",
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> list[JobEvent]:
    return []


@pytest.fixture
def membership(clock: FakeClock, events: list[JobEvent]) -> Membership:
    m = Membership(liveness_timeout=LIVENESS_S, clock=clock)
    m.add_listener(events.append)
    return m


def state(ticket: Ticket) -> JobState:
    """The state of ``ticket``'s generation now (a call: mypy does not carry a narrowed state over)."""
    return ticket.job.state


def kinds(events: list[JobEvent]) -> list[tuple[EventKind, int]]:
    return [(e.kind, e.generation) for e in events]


def running_world(
    membership: Membership, clock: FakeClock, *hosts: str, low: int = 2, high: int = 3
) -> list[Ticket]:
    """A running world of one member per host (formed at max, or at the last call)."""
    tickets = [membership.join(espec(h, low=low, high=high)) for h in hosts]
    if tickets[0].job.state is JobState.FORMING:
        clock.advance(LAST_CALL_S)
        membership.sweep()
    assert tickets[0].job.state is JobState.RUNNING
    return tickets


def report(membership: Membership, *tickets: Ticket) -> None:
    for t in tickets:
        membership.heartbeat(t.members[0].member_id, t.secrets[0], None, "")


# -- rule 1: forming --------------------------------------------------------------------------------


def test_join_forms_at_once_if_max_members_joined(membership: Membership, events: list[JobEvent]) -> None:
    a, b, c = (membership.join(espec(h)) for h in "abc")
    assert state(a) is JobState.RUNNING
    assert a.job.world_size == 3
    assert [assigned_rank(t.members[0]) for t in (a, b, c)] == [0, 1, 2]
    assert kinds(events) == [(EventKind.WORLD_FORMED, 1)]


def test_join_forms_at_last_call_if_min_members_joined(membership: Membership, clock: FakeClock) -> None:
    a = membership.join(espec("a"))
    membership.join(espec("b"))
    assert membership.elastic.form_in(a.job) == LAST_CALL_S
    clock.advance(LAST_CALL_S - 0.1)
    assert not membership.elastic.form_if_ready(a.job)
    assert state(a) is JobState.FORMING
    clock.advance(0.1)
    assert membership.elastic.form_if_ready(a.job)
    assert state(a) is JobState.RUNNING
    assert a.job.world_size == 2


def test_last_call_starts_again_if_another_member_arrives(membership: Membership, clock: FakeClock) -> None:
    a = membership.join(espec("a", high=4))
    membership.join(espec("b", high=4))
    clock.advance(LAST_CALL_S - 0.5)
    membership.join(espec("c", high=4))
    clock.advance(1.0)
    membership.sweep()
    assert state(a) is JobState.FORMING  # 1 s after c: its last call has 1 s to go
    clock.advance(1.0)
    membership.sweep()
    assert state(a) is JobState.RUNNING
    assert a.job.world_size == 3


def test_join_never_forms_if_fewer_than_min_members(membership: Membership, clock: FakeClock) -> None:
    a = membership.join(espec("a"))
    clock.advance(100 * LAST_CALL_S)
    membership.sweep()
    assert state(a) is JobState.FORMING
    assert membership.elastic.form_in(a.job) is None


def test_join_raises_failed_precondition_if_range_differs(membership: Membership) -> None:
    membership.join(espec("a"))
    with pytest.raises(
        FailedPreconditionError,
        match=r"^min_members 1, max_members 3 does not match job 't' generation 1, which was created "
        r"with min_members 2, max_members 3; every member of a job must ask for the same range$",
    ):
        membership.join(espec("b", low=1))


def test_join_raises_failed_precondition_if_fixed_and_elastic_mix(membership: Membership) -> None:
    membership.join(espec("a"))
    with pytest.raises(FailedPreconditionError, match=r"^job 't' generation 1 is an elastic world; "):
        membership.join(spec("b", job="t", world_size=3))
    membership.join(spec("c", job="f", world_size=3))
    with pytest.raises(FailedPreconditionError, match=r"^job 'f' generation 1 is a fixed world; "):
        membership.join(espec("d", job="f"))


# -- rule 2: parked ---------------------------------------------------------------------------------


def test_join_parks_and_counts_waiting_if_world_runs(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, _ = running_world(membership, clock, "a", "b")
    parked = membership.join(espec("c"))
    assert parked.job is not a.job
    assert state(parked) is JobState.FORMING
    assert parked.job.generation == 2
    assert state(a) is JobState.RUNNING
    assert waiting(a.job) == 1
    # Beyond max_members it waits uncounted (torch's redundancy list).
    membership.join(espec("d"))
    assert waiting(a.job) == 1
    assert kinds(events) == [(EventKind.WORLD_FORMED, 1)]


def test_waiting_is_zero_if_world_has_max_members(membership: Membership, clock: FakeClock) -> None:
    a, _, _ = running_world(membership, clock, "a", "b", "c")
    membership.join(espec("d"))
    assert waiting(a.job) == 0


def test_abandon_drops_parked_generation_if_last_parked_member_withdrew(
    membership: Membership, clock: FakeClock
) -> None:
    a, _ = running_world(membership, clock, "a", "b")
    parked = membership.join(espec("c"))
    membership.abandon(parked)
    assert waiting(a.job) == 0
    assert a.job.memory.successor is None


def test_parked_join_sent_again_gets_its_ticket_and_world_reforms_at_max(
    membership: Membership, clock: FakeClock
) -> None:
    """A parked Join sent again (its join_id: the client got no answer) waits on its first try's
    member instead of parking a second one, even once that try gave up; the survivors then
    re-join into a world of max_members."""
    a, b = running_world(membership, clock, "a", "b")
    join_id = "c" * 32
    c = membership.join(espec("c"), join_id)
    again = membership.join(espec("c"), join_id)
    assert again.resent
    assert again.members == c.members
    assert len(c.job.members) == 1
    assert waiting(a.job) == 1
    membership.abandon(c)  # the first try gave up: the resend still waits on the member
    assert c.job.members == list(again.members)
    a2 = membership.join(espec("a", rejoin=a))
    b2 = membership.join(espec("b", rejoin=b))
    assert state(again) is JobState.RUNNING
    assert again.job.world_size == 3
    assert [assigned_rank(t.members[0]) for t in (a2, b2, again)] == [0, 1, 2]


# -- rule 3: members that go ----------------------------------------------------------------------------


def test_member_loss_restarts_generation_if_elastic(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, b, _ = running_world(membership, clock, "a", "b", "c")
    report(membership, a, b)  # c is never heard from
    clock.advance(LIVENESS_S - 1)
    report(membership, a, b)
    clock.advance(1.5)
    failed = membership.sweep()
    assert [m.host for _, m in failed] == ["c"]
    job = a.job
    assert job.state is JobState.RESTARTED
    assert kinds(events)[1:] == [(EventKind.MEMBER_FAILED, 1), (EventKind.JOB_RESTARTING, 1)]
    restarting = events[-1]
    assert restarting.rank == 2
    assert restarting.host == "c"
    assert restarting.reason.startswith("re-rendezvous: rank 2 on host c failed: missed heartbeats")
    assert [m.state for m in job.members] == [MemberState.LEFT, MemberState.LEFT, MemberState.FAILED]
    assert [m.host for m in job.memory.survivors] == ["a", "b"]
    # The survivors re-join and form at once: both expected back, no last call.
    a2 = membership.join(espec("a", rejoin=a))
    b2 = membership.join(espec("b", rejoin=b))
    new = a2.job
    assert new.state is JobState.RUNNING
    assert new.generation == 2
    assert new.world_size == 2
    assert new.restart_count == 0
    assert new.rerendezvous_count == 1
    assert [(r["generation"], r["state"]) for r in new.history] == [(1, "RESTARTED")]
    assert [assigned_rank(t.members[0]) for t in (a2, b2)] == [0, 1]


def test_leave_nonzero_restarts_generation_if_a_member_of_it_was_lost_first(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    # A survivor's collective fails at once when a peer dies (gloo); its exit can come before the
    # peer's broken stream is judged. The loss is the cause: the generation re-forms.
    a, _, c = running_world(membership, clock, "a", "b", "c")
    stream = object()
    c.members[0].stream = stream
    membership.stream_lost(stream, [c.members[0].member_id])
    membership.leave(a.members[0].member_id, a.secrets[0], 1, "exited with code 1")
    job = a.job
    assert job.state is JobState.RESTARTED
    assert [m.state for m in job.members] == [MemberState.LEFT, MemberState.LEFT, MemberState.FAILED]
    assert kinds(events)[1:] == [(EventKind.MEMBER_FAILED, 1), (EventKind.JOB_RESTARTING, 1)]
    assert [m.host for m in job.memory.survivors] == ["a", "b"]
    assert not job.closed


def test_member_loss_fails_job_if_fixed(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    tickets = [membership.join(spec(h, job="f", world_size=2)) for h in "ab"]
    report(membership, tickets[0])  # b is never heard from
    clock.advance(LIVENESS_S + 1)
    report(membership, tickets[0])
    membership.sweep()
    assert tickets[0].job.state is JobState.FAILED
    assert EventKind.JOB_RESTARTING not in [e.kind for e in events]


def test_exit_nonzero_fails_elastic_job_and_closes_it(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, b = running_world(membership, clock, "a", "b")
    parked = membership.join(espec("c"))
    membership.leave(a.members[0].member_id, a.secrets[0], 3)
    assert state(a) is JobState.FAILED
    assert kinds(events)[-1] == (EventKind.JOB_FAILED, 1)
    assert parked.job.memory.withdrawn == "job 't' generation 1 failed"
    with pytest.raises(JobClosedError, match=r"^job 't' generation 1 failed \(rank 0 on host a failed: "):
        membership.join(espec("b", rejoin=b))


# -- rule 4: re-join ------------------------------------------------------------------------------------


def test_rejoin_restarts_generation_and_keeps_rank_order(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, b, c = running_world(membership, clock, "a", "b", "c", high=4)
    # c re-joins first, a newcomer d next, then b and a: returning members keep their old order.
    c2 = membership.join(espec("c", high=4, rejoin=c))
    assert state(a) is JobState.RESTARTED
    assert kinds(events)[-1] == (EventKind.JOB_RESTARTING, 1)
    assert events[-1].reason == "re-rendezvous: rank 2 on host c re-joins"
    d = membership.join(espec("d", high=4))  # a newcomer, between the returning ones
    b2 = membership.join(espec("b", high=4, rejoin=b))
    a2 = membership.join(espec("a", high=4, rejoin=a))
    assert state(a2) is JobState.RUNNING  # max_members: at once
    assert [assigned_rank(t.members[0]) for t in (a2, b2, c2, d)] == [0, 1, 2, 3]


def test_rejoin_first_fails_a_member_whose_stream_broke_as_its_cause(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    # A dead peer's reset connection fails a survivor's gloo collective within milliseconds; torch
    # spends a restart and the survivor's node re-joins before the peer's broken stream is judged
    # (lost_grace). The generation's end names the lost node, not the survivor.
    a, b, _ = running_world(membership, clock, "a", "b", "c")
    stream = object()
    b.members[0].stream = stream
    membership.stream_lost(stream, [b.members[0].member_id])
    membership.join(espec("a", rejoin=a))
    lost = b.members[0]
    assert (lost.state, lost.failure) == (MemberState.FAILED, FailureReason.CONNECTION_LOST)
    assert lost.reason == (
        "connection lost: its heartbeat stream broke (process or agent gone), "
        "and then rank 0 on host a re-joined"
    )
    assert state(a) is JobState.RESTARTED
    assert kinds(events)[1:] == [(EventKind.MEMBER_FAILED, 1), (EventKind.JOB_RESTARTING, 1)]
    assert events[-1].reason.startswith("re-rendezvous: rank 1 on host b failed: connection lost: ")
    assert [m.state for m in a.job.members] == [MemberState.LEFT, MemberState.FAILED, MemberState.LEFT]
    assert [m.host for m in a.job.memory.survivors] == ["a", "c"]


def test_rejoin_raises_unauthenticated_if_secret_is_wrong(membership: Membership, clock: FakeClock) -> None:
    a, _ = running_world(membership, clock, "a", "b")
    wrong = dataclasses.replace(espec("a", rejoin=a), rejoin_secret="not-it")
    with pytest.raises(UnauthenticatedError, match=r"^rejoin_secret does not match"):
        membership.join(wrong)
    assert state(a) is JobState.RUNNING


def test_rejoin_adopts_parked_members_and_forms_at_max(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, b = running_world(membership, clock, "a", "b")
    c = membership.join(espec("c"))
    assert waiting(a.job) == 1
    a2 = membership.join(espec("a", rejoin=a))
    assert a2.job is c.job
    assert state(c) is JobState.FORMING  # b is expected back
    assert set(c.job.memory.returning) == {a.members[0].member_id, b.members[0].member_id}
    b2 = membership.join(espec("b", rejoin=b))
    assert state(c) is JobState.RUNNING
    assert [assigned_rank(t.members[0]) for t in (a2, b2, c)] == [0, 1, 2]
    assert events[-2].reason == "re-rendezvous: rank 0 on host a re-joins; 1 member(s) wait to join"


def test_rejoin_forms_at_last_call_if_a_survivor_never_comes(
    membership: Membership, clock: FakeClock
) -> None:
    a, _ = running_world(membership, clock, "a", "b")
    a2 = membership.join(espec("a", rejoin=a))
    clock.advance(LAST_CALL_S)
    membership.sweep()
    assert state(a2) is JobState.FORMING  # only 1 of min 2
    membership.join(espec("c"))
    clock.advance(LAST_CALL_S)
    membership.sweep()
    assert state(a2) is JobState.RUNNING


# -- rule 5: closed -------------------------------------------------------------------------------------


def test_leave_closes_rendezvous_and_sends_parked_away(membership: Membership, clock: FakeClock) -> None:
    a, _, _ = running_world(membership, clock, "a", "b", "c", high=4)
    fits = membership.join(espec("d", high=4))
    beyond = membership.join(espec("e", high=4))
    membership.leave(a.members[0].member_id, a.secrets[0], 0)
    assert state(a) is JobState.RUNNING
    assert a.job.closed == "rank 0 on host a finished"
    assert waiting(a.job) == 0
    # One more fitted (max 4, world 3): a closed rendezvous; the other was beyond max_members.
    closed, closed_beyond = membership.elastic.withdrawn(fits), membership.elastic.withdrawn(beyond)
    assert closed is not None
    assert closed_beyond is not None
    assert not closed.beyond_max
    assert closed_beyond.beyond_max
    assert str(closed).startswith(
        "the rendezvous of job 't' generation 1 is closed (rank 0 on host a finished)"
    )


def test_join_raises_closed_if_rendezvous_closed(membership: Membership, clock: FakeClock) -> None:
    a, b = running_world(membership, clock, "a", "b")
    membership.close_job(a.members[0].member_id, a.secrets[0])
    with pytest.raises(
        JobClosedError,
        match=r"^the rendezvous of job 't' generation 1 is closed \(rank 0 on host a closed it\): "
        r"no new world forms under it while it runs$",
    ) as raised:
        membership.join(espec("c"))
    assert not raised.value.beyond_max
    with pytest.raises(JobClosedError):
        membership.join(espec("b", rejoin=b))
    assert state(a) is JobState.RUNNING
    membership.leave(a.members[0].member_id, a.secrets[0], 0)
    membership.leave(b.members[0].member_id, b.secrets[0], 0)
    assert state(a) is JobState.FINISHED
    # Once it has ended, the name starts afresh.
    assert membership.join(espec("a")).job.generation == 2


def test_closed_answer_is_beyond_max_if_world_was_full(membership: Membership, clock: FakeClock) -> None:
    a, _, _ = running_world(membership, clock, "a", "b", "c")
    membership.close_job(a.members[0].member_id, a.secrets[0])
    with pytest.raises(JobClosedError) as raised:
        membership.join(espec("d"))
    assert raised.value.beyond_max


# -- the state store ----------------------------------------------------------------------------------


def test_restored_job_stays_elastic_if_coordinator_restarts(tmp_path: Path, clock: FakeClock) -> None:
    store = SqliteStore(tmp_path / "state.sqlite")
    first = Membership(liveness_timeout=LIVENESS_S, clock=clock, persist=write_at_once(store))
    running_world(first, clock, "a", "b")
    second = Membership(liveness_timeout=LIVENESS_S, clock=clock, stored=load_state(store))
    job = second.job("t")
    assert job is not None
    assert job.elastic == ElasticRange(2, 3, LAST_CALL_S)
    clock.advance(100.0)
    second.sweep()
    assert job.state is JobState.RESTARTED
    store.close()


def test_join_ids_of_a_generation_go_with_its_re_rendezvous(membership: Membership) -> None:
    """A long elastic job that re-forms often keeps only its running generation's join ids (each
    holds its members' secrets and the whole generation): they went only when the job ended, so
    memory grew with every re-rendezvous. A Join sent again into the new generation still gets its
    own ticket."""
    ids = iter(f"{i:032x}" for i in range(10_000))
    a = membership.join(espec("a", low=2, high=2), next(ids))
    b = membership.join(espec("b", low=2, high=2), next(ids))
    for generation in range(2, 52):
        a_id, b_id = next(ids), next(ids)
        a = membership.join(espec("a", low=2, high=2, rejoin=a), a_id)
        b = membership.join(espec("b", low=2, high=2, rejoin=b), b_id)
        assert (a.job.generation, state(a)) == (generation, JobState.RUNNING)
        assert len(membership._join_ids) == 2
    again = membership.join(espec("b", low=2, high=2, rejoin=None), b_id)
    assert again.resent
    assert again.members == b.members
