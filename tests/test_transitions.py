"""The state diagram's edges, enforced in one place, and the verdicts on leaving members."""

from __future__ import annotations

import pytest

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.coordinator.domain.liveness import exit_verdict
from sarcomm.coordinator.domain.model import Job, JobEvent, JobState, Member, MemberState
from sarcomm.coordinator.domain.transitions import IllegalTransitionError, StateMachine


def _job() -> tuple[Job, Member]:
    member = Member("m1", "", "h1", 0, None, 29500, (), None, "", 0.0, rank=3)
    return Job("j", 1, 1, 0.0, members=[member]), member


def test_job_to_raises_illegal_transition_if_the_diagram_has_no_such_edge() -> None:
    job, _ = _job()
    machine = StateMachine(lambda: 5.0)
    with pytest.raises(
        IllegalTransitionError,
        match=r"^job 'j' generation 1: job state FORMING -> FINISHED is not an edge of the state "
        r"diagram \(allowed from FORMING: RUNNING\)$",
    ):
        machine.job_to(job, JobState.FINISHED)
    assert job.state is JobState.FORMING


def test_member_to_raises_illegal_transition_if_an_ended_member_changes_again() -> None:
    job, member = _job()
    machine = StateMachine(lambda: 5.0)
    machine.member_to(job, member, MemberState.RUNNING)
    machine.member_to(job, member, MemberState.LEFT, "exited with code 0")
    with pytest.raises(IllegalTransitionError, match=r"member m1: member state LEFT -> FAILED .*none\)$"):
        machine.member_to(job, member, MemberState.FAILED, "late", FailureReason.REPORTED)


def test_member_to_failed_fails_a_running_job_and_emits_both_events() -> None:
    job, member = _job()
    events: list[JobEvent] = []
    machine = StateMachine(lambda: 5.0)
    machine.add_listener(events.append)
    machine.member_to(job, member, MemberState.RUNNING)
    machine.job_to(job, JobState.RUNNING)
    machine.member_to(job, member, MemberState.FAILED, "exited with code 2", FailureReason.EXIT_CODE)
    assert (job.state, job.failed_rank, job.reason) == (
        JobState.FAILED, 3, "rank 3 on host h1 failed: exited with code 2",
    )  # fmt: skip
    assert [(e.kind, e.failure) for e in events] == [
        (EventKind.WORLD_FORMED, None),
        (EventKind.MEMBER_FAILED, FailureReason.EXIT_CODE),
        (EventKind.JOB_FAILED, FailureReason.EXIT_CODE),
    ]


@pytest.mark.parametrize(
    ("exit_code", "reason", "expected"),
    [
        (-9, "killed by signal 9 (SIGKILL)", FailureReason.KILLED),
        (-15, "", FailureReason.KILLED),
        (137, "killed by signal 9", FailureReason.KILLED),
        (143, "", FailureReason.KILLED),
        (3, "", FailureReason.EXIT_CODE),
        (3, "exited with code 3", FailureReason.EXIT_CODE),
        (1, "exited with code 1, stopped by sar-worker because a peer failed", FailureReason.EXIT_CODE),
        (1, "uncaught ValueError: bad", FailureReason.REPORTED),
        (127, "could not start train.py: No such file", FailureReason.REPORTED),
    ],
)
def test_exit_verdict_names_the_failure_by_the_exit_code(
    exit_code: int, reason: str, expected: FailureReason
) -> None:
    failure, text = exit_verdict(exit_code, reason)
    assert failure is expected
    assert text == (reason or f"exited with code {exit_code}")
