"""The reporter's side of reports by exception (issue 28): :func:`decide`, pure, explicit times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from sarcomm.common.client.by_exception import SentState, decide
from sarcomm.common.messages import MemberReport, Progress, ReportPolicy, WorkerEndpoint

pytestmark = pytest.mark.fast

POLICY = ReportPolicy(lease_seconds=20.0, silence_seconds=2.0, quiet_seconds=5.0, progress_seconds=10.0)
T0 = 1_000_000.0
JOB = "job"


def member(
    name: str,
    seq: int = 1,
    *,
    in_collective: bool = False,
    since: float = T0,
    age: float = 0.1,
    metrics: str = "10.0.0.1:9000",
    close_job: bool = False,
    endpoints: tuple[WorkerEndpoint, ...] | None = None,
) -> MemberReport:
    progress = Progress(seq, "all_reduce" if in_collective else "", in_collective, since)
    return MemberReport(name, "s", progress, metrics, age, close_job, endpoints)


def names(
    reports: Sequence[MemberReport],
    now: float,
    state: SentState,
    asked: Mapping[str, float] | None = None,
) -> list[str]:
    return [r.member_id for r in decide(reports, POLICY, now, asked or {}, state, JOB).reports]


def started(*reports: MemberReport) -> SentState:
    """A state after the first request by exception (every member sent at T0)."""
    state = SentState()
    assert names(reports, T0, state) == [r.member_id for r in reports]
    return state


def test_first_decision_sends_every_member_then_nothing_until_the_lease() -> None:
    a, b = member("a"), member("b")
    state = started(a, b)
    for t in (1.0, 5.0, 19.9):
        decision = decide([a, b], POLICY, T0 + t, {}, state, JOB)
        assert decision.reports == ()
        assert not decision.lease
        assert not decision.send
    decision = decide([a, b], POLICY, T0 + 20.0, {}, state, JOB)
    assert decision.reports == ()
    assert decision.lease
    assert decision.send
    # The lease counts from the last request, the renewal included.
    assert not decide([a, b], POLICY, T0 + 39.9, {}, state, JOB).lease
    assert decide([a, b], POLICY, T0 + 40.0, {}, state, JOB).lease


def test_no_members_renews_the_lease_at_once_then_each_lease_period() -> None:
    state = SentState()
    assert decide([], POLICY, T0, {}, state, JOB).lease
    assert not decide([], POLICY, T0 + 1, {}, state, JOB).lease


def test_a_report_sent_restarts_the_lease_period() -> None:
    state = started(member("a"))
    assert names([member("a", metrics="10.0.0.1:9001")], T0 + 15, state) == ["a"]
    assert not decide([member("a", metrics="10.0.0.1:9001")], POLICY, T0 + 34, {}, state, JOB).lease
    assert decide([member("a", metrics="10.0.0.1:9001")], POLICY, T0 + 35, {}, state, JOB).lease


def test_busy_ranks_progressing_are_not_sent() -> None:
    state = started(member("a", 1), member("b", 1))
    for t in range(1, 19):
        busy = [member("a", t * 10, in_collective=True, since=T0 + t), member("b", t * 10 + 1)]
        assert names(busy, T0 + t + 0.5, state) == []


def test_silence_is_sent_once_and_fresh_again_once() -> None:
    state = started(member("a"), member("b"))
    assert names([member("a", age=1.9), member("b")], T0 + 1, state) == []
    assert names([member("a", age=2.0), member("b")], T0 + 2, state) == ["a"]
    assert names([member("a", age=3.0), member("b")], T0 + 3, state) == []
    assert names([member("a", age=9.0), member("b")], T0 + 9, state) == []
    assert names([member("a", age=0.1), member("b")], T0 + 10, state) == ["a"]
    assert names([member("a", age=0.5), member("b")], T0 + 11, state) == []


def test_quiet_in_one_collective_is_sent_once_then_when_it_moves() -> None:
    stuck = member("a", 7, in_collective=True, since=T0)
    state = started(stuck)
    assert names([stuck], T0 + 5.0, state) == []  # not longer than quiet_seconds yet
    assert names([stuck], T0 + 5.1, state) == ["a"]
    assert names([stuck], T0 + 6.0, state) == []
    assert names([stuck], T0 + 15.0, state) == []
    # Moves: out of the collective, same seq.
    assert names([member("a", 7, since=T0 + 16)], T0 + 16, state) == ["a"]
    assert names([member("a", 8, in_collective=True, since=T0 + 17)], T0 + 17, state) == []


def test_quiet_then_a_new_collective_is_a_move_and_a_new_quiet_one_is_sent_again() -> None:
    state = started(member("a", 7, in_collective=True, since=T0))
    assert names([member("a", 7, in_collective=True, since=T0)], T0 + 6, state) == ["a"]
    nxt = member("a", 8, in_collective=True, since=T0 + 7)
    assert names([nxt], T0 + 7, state) == ["a"]  # moved
    assert names([nxt], T0 + 10, state) == []
    assert names([nxt], T0 + 12.5, state) == ["a"]  # quiet in the new one: once more
    assert names([nxt], T0 + 13, state) == []


def test_outside_a_collective_a_rank_is_never_quiet() -> None:
    idle = member("a", 3, since=T0)
    state = started(idle)
    for t in (10, 20, 60):
        decision = decide([idle], POLICY, T0 + t, {}, state, JOB)
        assert decision.reports == ()
    assert decision.lease


def test_metrics_address_and_worker_endpoints_changes_are_sent() -> None:
    state = started(member("a", metrics=""))
    assert names([member("a", metrics="")], T0 + 1, state) == []
    assert names([member("a", metrics="10.0.0.1:9000")], T0 + 2, state) == ["a"]
    assert names([member("a", metrics="10.0.0.1:9000")], T0 + 3, state) == []
    one = (WorkerEndpoint(0, 0, "10.0.0.1:9100"),)
    two = (*one, WorkerEndpoint(1, 1, "10.0.0.1:9101"))
    assert names([member("a", endpoints=one)], T0 + 4, state) == ["a"]
    assert names([member("a", endpoints=one)], T0 + 5, state) == []
    assert names([member("a")], T0 + 6, state) == []  # None: none sent, the coordinator keeps them
    assert names([member("a", endpoints=two)], T0 + 7, state) == ["a"]
    assert names([member("a", endpoints=())], T0 + 8, state) == ["a"]


def test_close_job_is_sent_each_time_it_is_asked() -> None:
    state = started(member("a"))
    assert names([member("a", close_job=True)], T0 + 1, state) == ["a"]
    assert names([member("a", close_job=True)], T0 + 2, state) == ["a"]
    assert names([member("a")], T0 + 3, state) == []


def test_progress_wanted_sends_all_at_once_then_changes_for_progress_seconds() -> None:
    state = started(member("a", 1), member("b", 1))
    asked = {JOB: T0 + 5}
    assert names([member("a", 1), member("b", 1)], T0 + 5.01, state, asked) == ["a", "b"]
    assert names([member("a", 2), member("b", 1)], T0 + 6, state, asked) == ["a"]
    assert names([member("a", 2), member("b", 1)], T0 + 7, state, asked) == []
    assert names([member("a", 3), member("b", 2)], T0 + 15, state, asked) == ["a", "b"]
    # Past progress_seconds: changes are no longer sent.
    assert names([member("a", 4), member("b", 3)], T0 + 15.1, state, asked) == []
    # Asked again: all at once again.
    asked = {JOB: T0 + 20}
    assert names([member("a", 4), member("b", 3)], T0 + 20, state, asked) == ["a", "b"]


def test_progress_wanted_for_another_job_sends_nothing() -> None:
    state = started(member("a", 1))
    assert names([member("a", 2)], T0 + 1, state, {"other": T0 + 1}) == []


def test_a_member_gone_is_forgotten_and_sent_in_full_if_it_comes_back() -> None:
    state = started(member("a"), member("b"))
    assert names([member("a")], T0 + 1, state) == []
    assert set(state.members) == {"a"}
    assert names([member("a"), member("b")], T0 + 2, state) == ["b"]


def test_a_member_sent_for_one_reason_carries_its_whole_state() -> None:
    state = started(member("a", 7, in_collective=True, since=T0))
    # Quiet and silent at once (a SIGSTOPped rank inside a collective): one report, both noted.
    report = member("a", 7, in_collective=True, since=T0, age=6.0)
    decision = decide([report], POLICY, T0 + 6, {}, state, JOB)
    assert decision.reports == (report,)
    assert names([member("a", 7, in_collective=True, since=T0, age=7.0)], T0 + 7, state) == []
