"""The agent's decisions (sarcomm.worker.agent.decisions.decide) and its small pure rules (exit
codes, a rank's liveness age, the heartbeat pace), without processes or a coordinator."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

import pytest

from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event, paced_interval
from sarcomm.worker.agent.decisions import (
    EXIT_PEER_FAILED,
    EXIT_SPAWN_FAILED,
    Action,
    AgentEvent,
    AgentResult,
    AwaitVerdict,
    Exit,
    Finished,
    Log,
    PeerFailed,
    RankExited,
    RanksDone,
    RankStarted,
    ReportLeave,
    Restart,
    RunState,
    ShowTail,
    SignalRanks,
    SpawnFailed,
    StopRanks,
    StopReason,
    StopRequested,
    StreamBroke,
    decide,
    describe_exit,
    exit_code_of,
    liveness_age,
    process_runs,
)

LABEL = "job=j ranks=[2, 3] generation=4"


def _started(max_restarts: int = 0, restarts: int = 0) -> RunState:
    state = RunState(
        job="j",
        generation=4,
        host="h1",
        label=LABEL,
        ranks=(2, 3),
        restarts=restarts,
        max_restarts=max_restarts,
    )
    for index in range(2):
        state, actions = decide(state, RankStarted(index))
        assert actions == []
    return state


def _run(state: RunState, events: Sequence[AgentEvent]) -> tuple[RunState, list[Action]]:
    every: list[Action] = []
    for event in events:
        state, actions = decide(state, event)
        every += actions
    return state, every


def _failed(rank: int, host: str = "h2", reason: str = "exited with code 3") -> PeerFailed:
    return PeerFailed(Event(EventKind.MEMBER_FAILED, "j", 4, rank, host, reason))


def _end(state: RunState) -> list[Action]:
    state, _ = decide(state, RanksDone())
    return decide(state, Finished())[1]


def test_exit_code_of_is_the_code_or_128_plus_the_signal() -> None:
    assert exit_code_of(0) == 0
    assert exit_code_of(3) == 3
    assert exit_code_of(-signal.SIGKILL) == 137
    assert exit_code_of(-signal.SIGTERM) == 143
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-200) == "killed by signal 200 (signal 200)"


def test_decide_exits_0_if_every_rank_exits_0() -> None:
    state, actions = _run(_started(), [RankExited(0, 0), RankExited(1, 0)])
    assert actions == [
        Log(logging.INFO, f"{LABEL}: rank 2 exited with code 0"),
        ReportLeave(0, 0, "exited with code 0"),
        Log(logging.INFO, f"{LABEL}: rank 3 exited with code 0"),
        ReportLeave(1, 0, "exited with code 0"),
    ]
    assert not state.any_running
    assert _end(state) == [
        Log(logging.INFO, f"{LABEL}: every local rank exited with code 0"),
        Exit(AgentResult(0)),
    ]


def test_decide_blames_the_first_failing_rank_and_stops_the_others() -> None:
    state, actions = decide(_started(), RankExited(1, 3))
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: rank 3 on host h1 exited with code 3"),
        ShowTail(1),
        StopRanks(StopReason.RANK_FAILED, signal.SIGTERM),
        ReportLeave(1, 3, "exited with code 3"),
    ]
    assert state.local_blame
    assert state.stopping is StopReason.RANK_FAILED
    # The rank the agent stopped is the stop's doing, not a second failure.
    state, actions = decide(state, RankExited(0, -signal.SIGTERM))
    reason = "killed by signal 15 (SIGTERM), stopped by sar-worker because a local rank failed"
    assert actions == [Log(logging.INFO, f"{LABEL}: rank 2 {reason}"), ReportLeave(0, -15, reason)]
    assert state.failure is not None
    assert state.failure.exit_code == 3


def test_decide_waits_for_a_verdict_if_the_blame_is_local_and_takes_a_peer_that_failed_first() -> None:
    state, _ = _run(_started(), [RankExited(0, 1), RankExited(1, -signal.SIGTERM)])
    state, actions = decide(state, RanksDone())
    assert actions == [AwaitVerdict()]
    state, actions = decide(state, _failed(7, "h9", "connection lost"))
    message = (
        "job j generation 4: rank 7 on host h9 failed: connection lost; local rank(s) 2, 3 failed after it"
    )
    assert actions == [Log(logging.ERROR, f"{LABEL}: {message}")]
    assert decide(state, Finished())[1] == [Exit(AgentResult(EXIT_PEER_FAILED, message))]


def test_decide_keeps_the_local_blame_if_the_coordinator_names_a_local_rank() -> None:
    state, _ = _run(_started(), [RankExited(0, 2), RankExited(1, 0), RanksDone()])
    state, actions = decide(state, _failed(2, "h1"))
    assert actions == []
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(2, "job j generation 4: rank 2 on host h1 failed: exited with code 2"))
    ]


def test_decide_exits_1_naming_the_failed_peer_and_stops_the_ranks() -> None:
    state, actions = decide(_started(), _failed(5, "h2", "missed 3 heartbeats"))
    what = "rank 5 on host h2 failed: missed 3 heartbeats"
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: {what}; stopping local rank(s) 2, 3"),
        StopRanks(StopReason.PEER_FAILED, signal.SIGTERM),
    ]
    state, actions = _run(state, [RankExited(0, -15), RankExited(1, -15)])
    assert all(not isinstance(a, StopRanks) for a in actions)
    state, actions = decide(state, RanksDone())
    assert actions == []  # the blame is not local: nothing to wait for
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(EXIT_PEER_FAILED, f"job j generation 4: {what}; stopped local rank(s) 2, 3"))
    ]


def test_decide_reports_a_failed_job_with_its_reason() -> None:
    _state, actions = decide(_started(), PeerFailed(Event(EventKind.JOB_FAILED, "j", 4, -1, "", "")))
    assert actions[0] == Log(
        logging.ERROR, f"{LABEL}: the job failed: no reason given; stopping local rank(s) 2, 3"
    )


def test_decide_ignores_a_second_peer_failure_and_one_after_the_ranks_are_done() -> None:
    state, _ = decide(_started(), _failed(5))
    assert decide(state, _failed(6)) == (state, [])
    done, _ = _run(_started(), [RankExited(0, 0), RankExited(1, 0), RanksDone()])
    assert decide(done, _failed(5)) == (done, [])
    assert decide(done, Finished())[1][-1] == Exit(AgentResult(0))


def test_decide_counts_a_rank_killed_by_a_signal_as_128_plus_the_signal() -> None:
    state, actions = decide(_started(), RankExited(0, -signal.SIGKILL))
    assert actions[0] == Log(logging.ERROR, f"{LABEL}: rank 2 on host h1 killed by signal 9 (SIGKILL)")
    state, _ = _run(state, [RankExited(1, -15), RanksDone()])
    state, _ = decide(state, StreamBroke("gone"))
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(137, "job j generation 4: rank 2 on host h1 failed: killed by signal 9 (SIGKILL)"))
    ]


def test_decide_forwards_the_agents_sigterm_and_kills_on_a_second_signal() -> None:
    state, actions = decide(_started(max_restarts=3), StopRequested(signal.SIGTERM))
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: got SIGTERM; forwarding it to the ranks"),
        StopRanks(StopReason.SIGNAL, signal.SIGTERM),
    ]
    state, actions = decide(state, StopRequested(signal.SIGINT))
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: got SIGINT again; killing the ranks"),
        SignalRanks(signal.SIGKILL),
    ]
    # Ranks that die of the forwarded signal fail the run, which is not restarted: it was interrupted.
    state, _ = _run(state, [RankExited(0, -15), RankExited(1, -9)])
    state, actions = decide(state, RanksDone())
    assert actions == []
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(143, "job j generation 4: rank 2 on host h1 failed: killed by signal 15 (SIGTERM)"))
    ]


def test_decide_forwards_a_signal_while_already_stopping() -> None:
    state, _ = decide(_started(), _failed(5))
    state, actions = decide(state, StopRequested(signal.SIGINT))
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: got SIGINT; forwarding it to the ranks"),
        SignalRanks(signal.SIGINT),
    ]


def test_decide_ignores_signals_once_the_ranks_are_done() -> None:
    state, _ = _run(_started(), [RankExited(0, 0), RankExited(1, 0), RanksDone()])
    assert decide(state, StopRequested(signal.SIGTERM)) == (state, [])


def test_decide_restarts_up_to_max_restarts() -> None:
    events: list[AgentEvent] = [RankExited(0, 3), RankExited(1, -15), RanksDone()]
    message = "job j generation 4: rank 2 on host h1 failed: exited with code 3"
    state, _ = _run(_started(max_restarts=2, restarts=1), events)
    assert decide(state, Finished())[1] == [
        Log(logging.WARNING, f"{LABEL}: {message}; restart 2 of 2, joining generation 5"),
        Restart(restarts=2, generation=5),
    ]
    state, _ = _run(_started(max_restarts=2, restarts=2), events)
    assert decide(state, Finished())[1] == [Exit(AgentResult(3, message))]


def test_decide_fails_a_rank_that_could_not_start_with_127() -> None:
    state = RunState(job="j", generation=4, host="h1", label=LABEL, ranks=(2, 3))
    state, _ = decide(state, RankStarted(0))
    state, actions = decide(state, SpawnFailed(1, "could not start 'nosuch': No such file"))
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: rank 3 could not start 'nosuch': No such file"),
        ReportLeave(1, EXIT_SPAWN_FAILED, "could not start 'nosuch': No such file"),
        StopRanks(StopReason.RANK_FAILED, signal.SIGTERM),
    ]
    assert state.running(0)
    assert not state.running(1)
    state, _ = _run(state, [RankExited(0, -15), RanksDone()])
    assert decide(state, Finished())[1] == [
        Exit(
            AgentResult(
                127, "job j generation 4: rank 3 on host h1 failed: could not start 'nosuch': No such file"
            )
        )
    ]


def test_decide_logs_a_broken_stream_and_keeps_the_ranks_running() -> None:
    state = _started()
    assert decide(state, StreamBroke("the coordinator is gone")) == (
        state,
        [Log(logging.ERROR, f"{LABEL}: heartbeats stopped: the coordinator is gone; ranks keep running")],
    )


# -- small pure rules --------------------------------------------------------------------------


def test_liveness_age_takes_the_newest_sign_of_life() -> None:
    assert liveness_age(10.0, None, 7.0) == 3.0
    assert liveness_age(10.0, 9.0, 7.0) == 1.0
    assert liveness_age(10.0, 12.0, 7.0) == 0.0  # a stamp in the future keeps an exiting rank alive
    assert [process_runs(s) for s in ("R", "S", "D", "T", "t", "Z", None)] == [
        True, True, True, False, False, False, False,
    ]  # fmt: skip


def test_paced_interval_takes_the_shorter_of_ours_and_the_coordinators() -> None:
    assert paced_interval(2.0, 0.5) == 0.5
    assert paced_interval(0.25, 1.0) == 0.25
    assert paced_interval(1.0, 0.0) == 1.0  # an older coordinator does not say


def test_decide_refuses_an_event_it_has_no_rule_for() -> None:
    """An event without its case is a bug, not the run's end (it used to fall through to the exit);
    mypy finds the missing case first, this is the run-time side of it."""
    unknown: AgentEvent = object()  # type: ignore[assignment]

    with pytest.raises(AssertionError):
        decide(_started(), unknown)
