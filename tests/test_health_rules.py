"""The membership rules behind failure detection, with a fake clock and no process: a rank's own
silence (its age), a broken stream's grace, the reconnect grace of restored members, stalls naming
who has not entered the collective, the blame when several fail, the history of ended generations,
and the settings of these rules. The same with real processes: tests/test_health.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.coordinator import cli
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain.membership import (
    JobState,
    JoinSpec,
    MemberRequest,
    Membership,
    MemberState,
    Progress,
)
from sarcomm.coordinator.storage.store import SqliteStore
from tests.helpers import LO, FakeClock, assigned_rank
from tests.test_membership import stored_membership

# Every operation of every Membership here checks its invariants after it (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("membership_invariants")


def _formed(membership: Membership, world_size: int = 3) -> list[str]:
    tickets = [
        membership.join(
            JoinSpec(job="j", world_size=world_size, host=f"h{r}", interfaces=(LO,),
                     members=(MemberRequest(local_rank=0, rank=r),), store_port=29500,
                     peer_address="127.0.0.1", max_restarts=2)
        )
        for r in range(world_size)
    ]  # fmt: skip
    return [t.members[0].member_id for t in tickets]


def _membership(clock: FakeClock, **kwargs: float) -> Membership:
    return Membership(liveness_timeout=3.0, clock=clock, **kwargs)  # type: ignore[arg-type]


def _secret_free(membership: Membership, member_id: str) -> None:
    """Let the tests report without the secret: the rules under test come after authentication."""
    membership._members[member_id][1].check_secret = lambda secret: True  # type: ignore[method-assign]


def _report(membership: Membership, member_id: str, **kwargs: object) -> None:
    _secret_free(membership, member_id)
    membership.heartbeat(member_id, "", kwargs.pop("progress", None), "", **kwargs)  # type: ignore[arg-type]


def test_a_rank_reported_with_a_growing_age_fails_by_its_own_silence() -> None:
    clock = FakeClock()
    membership = _membership(clock)
    ids = _formed(membership)
    start = clock.monotonic()
    for step in range(1, 5):  # its agent keeps reporting it, but its own stamp stopped at the start
        clock.advance(0.9 if step > 1 else 1.0)  # to start + step
        for member_id in ids:
            _report(membership, member_id, age=float(step) if member_id == ids[1] else 0.0)
        clock.advance(0.1)
        failed = membership.sweep()
        if failed:
            break
    assert [m.rank for _, m in failed] == [1]
    # 3 s after its last stamp, not after the agent's last report
    assert clock.monotonic() - start == pytest.approx(3.1)
    assert failed[0][1].reason == "missed heartbeats: silent for 3.1 s"


def test_a_broken_stream_fails_its_members_after_the_grace_unless_a_newer_stream_reports() -> None:
    clock = FakeClock()
    membership = _membership(clock, lost_grace=0.5)
    ids = _formed(membership)
    old, new = object(), object()
    for member_id in ids:
        _report(membership, member_id, stream=old)
    _report(membership, ids[0], stream=new)  # rank 0's reporter already reopened its stream
    membership.stream_lost(old, ids)
    clock.advance(0.4)
    assert membership.sweep() == []
    _report(membership, ids[2], stream=new)  # rank 2 came back within the grace
    clock.advance(0.2)
    failed = membership.sweep()
    assert [m.rank for _, m in failed] == [1]
    assert failed[0][1].reason.startswith("connection lost")
    assert failed[0][0].state is JobState.FAILED


def test_restored_members_get_the_reconnect_grace_then_the_silence_rule(tmp_path: Path) -> None:
    clock = FakeClock()
    store = SqliteStore(tmp_path / "state.sqlite")
    ids = _formed(stored_membership(store, clock))
    restored = stored_membership(store, clock, restore_grace=10.0)
    clock.advance(9.0)
    assert restored.sweep() == []
    _report(restored, ids[0])  # rank 0 reconnected: from now on the usual rule
    clock.advance(1.5)
    # The grace is over, but a member of the job first reported 1.5 s ago: reconnections are still
    # arriving (liveness.starting), so the ones not heard from yet wait one liveness timeout more.
    assert restored.sweep() == []
    _report(restored, ids[0])
    clock.advance(1.6)
    failed = restored.sweep()
    assert sorted(assigned_rank(m) for _, m in failed) == [1, 2]  # 3.1 s after the last first report
    clock.advance(10.0)
    assert restored.job("j") is not None


def test_stall_names_the_ranks_that_have_not_entered_the_collective_the_others_wait_in() -> None:
    clock = FakeClock()
    membership = _membership(clock, stall_threshold=30.0)
    ids = _formed(membership)
    job = membership.job("j")
    assert job is not None
    start = clock.wall()
    _report(membership, ids[0], progress=Progress(8, "all_reduce", True, start))
    _report(membership, ids[1], progress=Progress(7, "all_to_all", False, start - 1.0))
    _report(membership, ids[2], progress=Progress(8, "all_reduce", True, start + 1.0))
    clock.advance(29.0)
    assert membership.stall(job) is None  # not waited long enough
    clock.advance(2.0)
    stall = membership.stall(job)
    assert stall is not None
    assert (stall.seq, stall.op, stall.waiting, stall.blocking, stall.waited) == (
        8, "all_reduce", (0, 2), (1,), 31.0,
    )  # fmt: skip
    assert stall.describe() == (
        "2 rank(s) have waited 31.0 s in collective #8 (all_reduce) for rank(s) 1, which have not entered it"
    )
    _report(membership, ids[1], progress=Progress(8, "all_reduce", True, clock.wall()))
    assert membership.stall(job) is None  # everyone is in #8: nobody to name


def test_history_keeps_each_ended_generation_and_survives_an_abandoned_rejoin() -> None:
    clock = FakeClock()
    membership = _membership(clock)
    ids = _formed(membership)
    _secret_free(membership, ids[1])
    membership.leave(ids[1], "", -9, "killed by signal 9 (SIGKILL)")
    second = membership.join(
        JoinSpec(job="j", world_size=3, host="h0", interfaces=(LO,), members=(MemberRequest(0, 0),),
                 store_port=29500, peer_address="127.0.0.1")
    )  # fmt: skip
    assert second.job.history[0]["reason"] == "rank 1 on host h1 failed: killed by signal 9 (SIGKILL)"
    assert second.job.history[0]["failed_rank"] == 1
    membership.abandon(second)
    back = membership.job("j")
    assert back is not None
    assert (back.generation, back.state, back.max_restarts) == (1, JobState.FAILED, 2)
    assert [m.state for m in back.members].count(MemberState.FAILED) == 1


def test_the_new_settings_name_field_value_and_rule() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^stall_threshold 0 must be a positive number of seconds"
    ):
        CoordinatorConfig(stall_threshold=0)
    with pytest.raises(
        InvalidArgumentError,
        match=r"^reconnect_grace -1 must be a number of seconds >= 0, at most 604800 \(a week\)$",
    ):
        CoordinatorConfig(reconnect_grace=-1)
    with pytest.raises(InvalidArgumentError, match=r"^reports\[2\]\.age_seconds -1\.0 must be a finite"):
        validation.age_seconds(-1.0, "reports[2].age_seconds")
    args = cli.parse_args(["--reconnect-grace", "4"], {"SARCOMM_STALL_THRESHOLD": "12"})
    config = cli.config_from_args(args)
    assert (config.stall_threshold, config.reconnect_grace) == (12.0, 4.0)


def test_a_peer_that_exits_after_a_broken_stream_does_not_take_the_blame() -> None:
    # A killed container: its connections close at once, so a peer's collective fails and that
    # peer's non-zero exit can arrive while the dead rank's broken stream is still in its grace.
    clock = FakeClock()
    membership = _membership(clock, lost_grace=0.5)
    ids = _formed(membership)
    stream = object()
    for member_id in ids:
        _report(membership, member_id, stream=stream if member_id == ids[2] else object())
    membership.stream_lost(stream, [ids[2]])
    _secret_free(membership, ids[1])
    job = membership.leave(ids[1], "", 1, "exited with code 1")
    assert job.state is JobState.FAILED
    assert job.failed_rank == 2
    assert job.reason.startswith("rank 2 on host h2 failed: connection lost")
    assert "rank 1 on host h1 exited with code 1" in job.reason


def test_a_failed_jobs_silent_member_is_judged_so_the_job_ends() -> None:
    clock = FakeClock()
    membership = _membership(clock)
    ids = _formed(membership)
    _secret_free(membership, ids[0])
    _secret_free(membership, ids[1])
    membership.leave(ids[0], "", 1, "exited with code 1")  # fails the job
    membership.leave(ids[1], "", 143, "stopped")
    clock.advance(3.5)  # rank 2 never reports again
    failed = membership.sweep()
    assert [m.rank for _, m in failed] == [2]
    job = failed[0][0]
    assert job.state is JobState.FAILED
    assert job.failed_rank == 0  # the first failure keeps the blame
    assert job.ended
