"""Membership and rendezvous logic, with an in-memory store and a fake clock (no network)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from sarcomm.coordinator.domain.membership import (
    EventKind,
    JobEvent,
    JobState,
    JoinSpec,
    Membership,
    MemberState,
    Ticket,
)
from sarcomm.coordinator.domain.model import Job, Member
from sarcomm.coordinator.domain.ranks import describe_missing
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.coordinator.storage.records import load_state, write_at_once
from sarcomm.coordinator.storage.store import SqliteStore, StateStore
from tests.conftest import STORES
from tests.etcd_cluster import EtcdCluster
from tests.helpers import FakeClock, assigned_rank, spec
from tests.test_etcd_store import lead

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")


def stored_membership(store: StateStore, clock: FakeClock, **settings: Any) -> Membership:
    """A membership restored from ``store`` that writes every change to it at once."""
    return Membership(
        stored=load_state(store), persist=write_at_once(store), clock=clock, liveness_timeout=3.0, **settings
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> list[JobEvent]:
    return []


@pytest.fixture
def membership(clock: FakeClock, events: list[JobEvent]) -> Membership:
    m = Membership(liveness_timeout=3.0, clock=clock)
    m.add_listener(events.append)
    return m


def form(membership: Membership, *specs: JoinSpec) -> list[Ticket]:
    return [membership.join(s) for s in specs]


def test_join_forms_world_with_contiguous_ranks_per_host(
    membership: Membership, events: list[JobEvent]
) -> None:
    a, b = form(membership, spec("a", None, None), spec("b", None, None))
    assert a.job.state is JobState.RUNNING
    # What the waiting joins hear (the service's waiters; no asyncio object in the domain).
    assert [(e.kind, e.generation) for e in events] == [(EventKind.WORLD_FORMED, 1)]
    assert [m.rank for m in a.members] == [0, 1]
    assert [m.rank for m in b.members] == [2, 3]
    assert a.job.master_addr == "127.0.0.1"
    assert a.job.master_port == 29500
    assert {m.member_id for m in a.members + b.members} == {m.member_id for m in a.job.members}


def test_join_honours_requested_ranks_and_deals_the_rest_contiguously(membership: Membership) -> None:
    a, b, c = form(membership, spec("a", 1), spec("b", None, None), spec("c", 3))
    assert [m.rank for m in a.members] == [1]
    assert [m.rank for m in c.members] == [3]
    # Only 0 and 2 are left: no contiguous run of two exists, so host b gets the lowest two free.
    assert sorted(assigned_rank(m) for m in b.members) == [0, 2]


def test_join_keeps_a_host_contiguous_when_requested_ranks_leave_a_gap(membership: Membership) -> None:
    tickets = form(
        membership,
        spec("a", 0, job="j", world_size=6),
        spec("b", None, None, job="j", world_size=6),
        spec("c", 2, job="j", world_size=6),
        spec("d", None, None, job="j", world_size=6),
    )
    b, d = tickets[1], tickets[3]
    assert [m.rank for m in b.members] == [3, 4]  # 1 is free but alone; 3,4 is the first run of two
    assert sorted(assigned_rank(m) for m in d.members) == [1, 5]


def test_join_master_is_rank_zeros_address_on_its_interface(membership: Membership) -> None:
    first = membership.join(spec("a", 1, peer="10.0.0.1", address="10.0.0.1", port=1111))
    second = membership.join(spec("b", 0, peer="10.0.0.2", address="10.0.0.2", port=2222))
    form(
        membership,
        spec("c", peer="10.0.0.3", address="10.0.0.3"),
        spec("d", peer="10.0.0.4", address="10.0.0.4"),
    )
    job = first.job
    assert job.master_addr == "10.0.0.2"
    assert job.master_port == 2222
    assert second.members[0].interface == "eth0"
    assert first.members[0].address == "10.0.0.1"


def test_join_uses_routable_interface_if_any_member_is_remote(membership: Membership) -> None:
    local = membership.join(spec("a", 0, peer="127.0.0.1", address="10.0.0.1"))
    form(
        membership,
        spec("b", peer="10.0.0.2", address="10.0.0.2"),
        spec("c", peer="10.0.0.3", address="10.0.0.3"),
        spec("d", peer="10.0.0.4", address="10.0.0.4"),
    )
    assert local.members[0].interface == "eth0"
    assert local.job.master_addr == "10.0.0.1"


def test_join_raises_already_exists_if_rank_taken(membership: Membership) -> None:
    membership.join(spec("a", 2))
    with pytest.raises(
        AlreadyExistsError,
        match=r"^rank 2 is already taken in job 'gnn' generation 1 by a "
        r"member on host 'a'; each rank can be requested once$",
    ):
        membership.join(spec("b", 2))


def test_join_raises_failed_precondition_if_world_size_differs(membership: Membership) -> None:
    membership.join(spec("a"))
    with pytest.raises(
        FailedPreconditionError,
        match=r"^world_size 8 does not match job 'gnn' generation 1, "
        r"which was created with world_size 4",
    ):
        membership.join(spec("b", world_size=8))


def test_join_raises_failed_precondition_if_job_is_running(membership: Membership) -> None:
    form(membership, spec("a", None, None), spec("b", None, None))
    with pytest.raises(FailedPreconditionError, match=r"generation 1 is running with world_size 4"):
        membership.join(spec("c"))


def test_join_raises_failed_precondition_if_too_many_members(membership: Membership) -> None:
    membership.join(spec("a", None, None, None))
    with pytest.raises(FailedPreconditionError, match=r"^members: joining 2 more would make 5 members"):
        membership.join(spec("b", None, None))


def test_join_raises_failed_precondition_if_generation_is_stale(membership: Membership) -> None:
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    for ticket in tickets:
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            membership.leave(member.member_id, secret, 0)
    assert tickets[0].job.state is JobState.FINISHED
    with pytest.raises(
        FailedPreconditionError,
        match=r"^generation 1 is stale: job 'gnn' generation 2 is "
        r"forming now",
    ):
        membership.join(spec("a", generation=1))
    assert membership.join(spec("a", generation=2)).job.generation == 2


def test_join_raises_resource_exhausted_if_max_jobs_active(clock: FakeClock) -> None:
    membership = Membership(liveness_timeout=3.0, max_jobs=2, clock=clock)
    membership.join(spec("a", job="one"))
    membership.join(spec("a", job="two"))
    with pytest.raises(ResourceExhaustedError, match=r"already holds 2 active jobs, its limit max_jobs 2"):
        membership.join(spec("a", job="three"))


def test_abandon_frees_requested_rank_and_forgets_empty_job(membership: Membership) -> None:
    ticket = membership.join(spec("a", 2))
    membership.abandon(ticket)
    assert membership.job("gnn") is None
    assert membership.join(spec("b", 2)).members[0].requested_rank == 2


def test_missing_description_names_joined_count_and_free_ranks(membership: Membership) -> None:
    ticket = membership.join(spec("a", 0, None))
    assert describe_missing(ticket.job) == "2 of 4 members joined; ranks missing: 2, 3"


def test_leave_finishes_job_when_all_exit_zero(membership: Membership, events: list[JobEvent]) -> None:
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    for ticket in tickets:
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            assert membership.leave(member.member_id, secret, 0).name == "gnn"
    job = tickets[0].job
    assert job.state is JobState.FINISHED
    assert all(m.state is MemberState.LEFT for m in job.members)
    assert [e.kind for e in events] == [EventKind.WORLD_FORMED, EventKind.JOB_FINISHED]


def test_leave_with_nonzero_code_fails_job_and_names_rank(
    membership: Membership, events: list[JobEvent]
) -> None:
    a, _ = form(membership, spec("a", None, None), spec("b", None, None))
    membership.leave(a.members[1].member_id, a.secrets[1], 3)
    assert a.job.state is JobState.FAILED
    assert a.job.reason == "rank 1 on host a failed: exited with code 3"
    failed = [e for e in events if e.kind is EventKind.MEMBER_FAILED]
    assert [(e.rank, e.host, e.reason) for e in failed] == [(1, "a", "exited with code 3")]


def test_leave_raises_unauthenticated_if_secret_wrong(membership: Membership) -> None:
    a, b = form(membership, spec("a", None, None), spec("b", None, None))
    with pytest.raises(UnauthenticatedError):
        membership.leave(a.members[0].member_id, b.secrets[0], 1)
    assert a.job.state is JobState.RUNNING


def test_a_member_that_proved_its_secret_still_refuses_any_other(membership: Membership) -> None:
    a, b = form(membership, spec("a", None, None), spec("b", None, None))
    member_id, secret = a.members[0].member_id, a.secrets[0]
    membership.heartbeat(member_id, secret, None, "")  # proved once: the check is cached from now on
    membership.heartbeat(member_id, secret, None, "")
    for wrong in (b.secrets[0], secret[:-1], secret + "x", "", "sécrèt ✓"):
        with pytest.raises(UnauthenticatedError):
            membership.heartbeat(member_id, wrong, None, "")
    membership.heartbeat(member_id, secret, None, "")


def test_heartbeat_raises_not_found_if_member_of_old_generation(membership: Membership) -> None:
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    old_id, old_secret = tickets[0].members[0].member_id, tickets[0].secrets[0]
    membership.leave(old_id, old_secret, 9)  # fails generation 1
    membership.join(spec("a"))  # generation 2 forms under the same name
    with pytest.raises(NotFoundError, match=r"is not a member of any current job generation"):
        membership.heartbeat(old_id, old_secret, None, "")


def test_sweep_fails_silent_member_after_liveness_timeout(
    membership: Membership, clock: FakeClock, events: list[JobEvent]
) -> None:
    a, b = form(membership, spec("a", None, None), spec("b", None, None))
    for ticket in (a, b):  # every member heard from once
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            membership.heartbeat(member.member_id, secret, None, "")
    clock.advance(2.0)
    for ticket in (a, b):
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            if member.rank != 3:
                membership.heartbeat(member.member_id, secret, None, "")
    assert membership.sweep() == []
    clock.advance(1.5)  # rank 3 silent for 3.5 s > 3 s; the others for 1.5 s
    failed = membership.sweep()
    assert [(m.rank, m.host) for _, m in failed] == [(3, "b")]
    assert re.fullmatch(r"missed heartbeats: silent for 3\.5 s", failed[0][1].reason)
    assert a.job.state is JobState.FAILED
    assert [e.kind for e in events][-2:] == [EventKind.MEMBER_FAILED, EventKind.JOB_FAILED]


@pytest.fixture(params=STORES)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], StateStore]]:
    """Opens the same state again, as the next coordinator would: the SQLite file, or the etcd
    prefix with the leader key taken afresh (the previous holder's lease revoked)."""
    if request.param == "sqlite":
        yield lambda: SqliteStore(tmp_path / "state.sqlite")
        return
    cluster: EtcdCluster = request.getfixturevalue("module_etcd_cluster")
    prefix = request.getfixturevalue("etcd_prefix")
    client = EtcdClient(EtcdSettings(cluster.url(prefix)))
    leases: list[int] = []

    def open_etcd() -> StateStore:
        for lease in leases:
            client.revoke(lease)
        store = EtcdStore(client, "/" + prefix)
        leases[:] = [lead(client, store)]
        return store

    yield open_etcd
    client.close()


def test_restore_keeps_jobs_and_members_across_restart(
    reopen: Callable[[], StateStore], clock: FakeClock
) -> None:
    store = reopen()
    first = stored_membership(store, clock)
    a, _ = form(first, spec("a", None, None), spec("b", None, None))
    store.close()  # the first coordinator is gone: a second one may not share its state
    restored = stored_membership(reopen(), clock)
    job = restored.job("gnn")
    assert job is not None
    assert (job.state, job.generation, job.master_port) == (JobState.RUNNING, 1, 29500)
    assert [m.rank for m in job.ranked_members()] == [0, 1, 2, 3]
    # Secrets survive as digests: the member can still act after the restart.
    restored.leave(a.members[0].member_id, a.secrets[0], 0)
    assert restored.job("gnn").members[0].state is MemberState.LEFT  # type: ignore[union-attr]


def test_generation_grows_across_restart_and_name_reuse(
    reopen: Callable[[], StateStore], clock: FakeClock
) -> None:
    store = reopen()
    first = stored_membership(store, clock)
    tickets = form(first, spec("a", None, None), spec("b", None, None))
    first.leave(tickets[0].members[0].member_id, tickets[0].secrets[0], 1)
    store.close()
    restored = stored_membership(reopen(), clock)
    assert restored.join(spec("a")).job.generation == 2


def test_join_keeps_each_agent_contiguous_if_two_share_a_host(membership: Membership) -> None:
    first, second = form(membership, spec("same", None, None), spec("same", None, None))
    assert [m.rank for m in first.members] == [0, 1]
    assert [m.rank for m in second.members] == [2, 3]


def _report_all(tickets: list[Ticket], membership: Membership, but: frozenset[int] = frozenset()) -> None:
    for ticket in tickets:
        for member, secret in zip(ticket.members, ticket.secrets, strict=True):
            if member.rank not in but:
                membership.heartbeat(member.member_id, secret, None, "")


def test_never_heard_member_is_not_failed_while_its_job_starts(
    membership: Membership, clock: FakeClock
) -> None:
    """Streams still being accepted: a member never heard from is not failed while first reports
    of its job keep coming; it fails one liveness timeout (3 s) after the last of them."""
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    secrets = {m.member_id: s for t in tickets for m, s in zip(t.members, t.secrets, strict=True)}
    members = sorted((m for t in tickets for m in t.members), key=lambda m: m.rank or 0)
    late = members[-2:]
    heard: list[Member] = []
    answered = clock.monotonic()

    def beat(*more: Member) -> None:
        heard.extend(more)
        for member in heard:
            membership.heartbeat(member.member_id, secrets[member.member_id], None, "")

    # The other members' first reports trickle in, one every 2 s after the answers.
    for member in members[:-2]:
        clock.advance(2.0)
        beat(member)
        assert membership.sweep() == []
    # The first late one's first report comes 2.9 s after the last first report.
    clock.advance(2.9)
    assert membership.sweep() == []
    beat(late[0])
    # That first report keeps the job starting: the second late one waits until 3 s after it.
    clock.advance(2.9)
    beat()
    assert membership.sweep() == []
    clock.advance(0.2)
    failed = membership.sweep()
    assert [m.member_id for _, m in failed] == [late[1].member_id]
    silent = clock.monotonic() - answered
    assert failed[0][1].reason == (
        f"missed heartbeats: never heard from in the {silent:.1f} s since its Join was answered (no "
        f"other member of its job first reported in the last 3 s)"
    )


def test_never_heard_member_of_a_job_nobody_reports_fails_after_the_timeout(
    membership: Membership, clock: FakeClock
) -> None:
    """No member ever reported (the job's processes died right after their answers): the liveness
    timeout alone, as before."""
    form(membership, spec("a", None, None), spec("b", None, None))
    clock.advance(3.0)
    assert membership.sweep() == []
    clock.advance(0.1)
    failed = membership.sweep()
    assert sorted(m.rank or 0 for _, m in failed) == [0, 1, 2, 3]
    assert failed[0][1].reason.startswith("missed heartbeats: never heard from in the 3.1 s")


def test_heard_member_gone_silent_is_failed_while_others_still_start(
    membership: Membership, clock: FakeClock
) -> None:
    """The start grace is for members never heard from: one that reported once and went silent is
    failed after the liveness timeout, however many first reports still arrive."""
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    first = tickets[0].members[0]
    membership.heartbeat(first.member_id, tickets[0].secrets[0], None, "")
    others = [(m, s) for t in tickets for m, s in zip(t.members, t.secrets, strict=True) if m is not first]
    failed: list[tuple[Job, Member]] = []
    for member, secret in others:  # first reports every 1.1 s keep the job starting
        clock.advance(1.1)
        membership.heartbeat(member.member_id, secret, None, "")
        failed += membership.sweep()
    for member, secret in others:
        membership.heartbeat(member.member_id, secret, None, "")
    clock.advance(0.1)
    failed += membership.sweep()
    assert [m.member_id for _, m in failed] == [first.member_id]
    assert failed[0][1].reason == "missed heartbeats: silent for 3.3 s"


def test_joins_giving_up_in_any_order_withdraw_exactly_their_members(membership: Membership) -> None:
    """The first Join (the usual order of timeouts), the last, and one in the middle give up: each
    time exactly its members go, the others keep their order, and the world still forms."""
    tickets = [membership.join(spec(h, None, None, world_size=10)) for h in "abcd"]
    job = tickets[0].job
    for gone in (tickets[0], tickets[3], tickets[1]):
        membership.abandon(gone)
    assert [(m.host, m.local_rank) for m in job.members] == [("c", 0), ("c", 1)]
    rest = [membership.join(spec(h, None, None, world_size=10)) for h in "efgh"]
    assert job.state is JobState.RUNNING
    assert [(m.host, m.rank) for m in job.members] == [
        (h, r) for r, h in enumerate(h for h in "cefgh" for _ in range(2))
    ]
    assert rest[-1].job is job


def test_missing_ranks_are_named_without_dealing_when_nobody_asked_for_one(
    membership: Membership, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Join of a world that did not form in time names the missing ranks as it gives up
    (32,768 in a burst): without requested ranks they are the ones after the joined members, and
    no rank is dealt for it."""
    ticket = membership.join(spec("a", None, None, world_size=40))
    membership.join(spec("b", None, world_size=40))

    def no_deal(*_: object) -> dict[str, int]:
        raise AssertionError("ranks were dealt to describe a world without requested ranks")

    monkeypatch.setattr("sarcomm.coordinator.domain.ranks.deal_ranks", no_deal)
    assert describe_missing(ticket.job) == (
        "3 of 40 members joined; ranks missing: 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, ..."
    )


def test_missing_ranks_with_requested_ones_are_dealt_as_the_world_would_form(membership: Membership) -> None:
    ticket = membership.join(spec("a", 0, 2, world_size=5))
    membership.join(spec("b", None, world_size=5))
    assert describe_missing(ticket.job) == "3 of 5 members joined; ranks missing: 3, 4"


def test_a_job_finishes_when_its_last_member_leaves_in_any_order(
    membership: Membership, events: list[JobEvent]
) -> None:
    """Members leave in an order unlike their ranks': the job finishes at the last one, not before
    (the running member found last time is remembered, and those before it are not looked at)."""
    tickets = form(membership, spec("a", None, None), spec("b", None, None))
    members = [(m, s) for t in tickets for m, s in zip(t.members, t.secrets, strict=True)]
    job = tickets[0].job
    for k in (2, 0, 3):
        membership.leave(members[k][0].member_id, members[k][1], 0)
        assert job.state is JobState.RUNNING
    membership.leave(members[1][0].member_id, members[1][1], 0)
    assert job.state is JobState.FINISHED
    assert [e.kind for e in events][-1] is EventKind.JOB_FINISHED
