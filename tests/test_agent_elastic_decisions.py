"""The agent's decisions in an elastic job (``--world-size MIN:MAX``, rule 7 of
sarcomm.worker.agent.decisions), without processes or a coordinator: re-rendezvous, scale-up, held
exits, a closed rendezvous. End to end: tests/test_agent_elastic.py."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event
from sarcomm.worker.agent.decisions import (
    EXIT_PEER_FAILED,
    Action,
    AgentEvent,
    AgentResult,
    Exit,
    Finished,
    HoldExit,
    Log,
    PeerFailed,
    RankExited,
    RanksDone,
    RankStarted,
    Rejoin,
    RendezvousStatus,
    ReportLeave,
    Restart,
    Restarting,
    RunState,
    ShowTail,
    SignalRanks,
    StopRanks,
    StopReason,
    StopRequested,
    VerdictDue,
    decide,
)

LABEL = "job=j ranks=[2, 3] generation=4"
LOST = "re-rendezvous: rank 7 on host h9 failed: connection lost"


def _started(elastic: bool = True, max_restarts: int = 0) -> RunState:
    state = RunState(
        job="j",
        generation=4,
        host="h1",
        label=LABEL,
        ranks=(2, 3),
        max_restarts=max_restarts,
        elastic=elastic,
    )
    for index in range(2):
        state, _ = decide(state, RankStarted(index))
    return state


def _run(state: RunState, events: Sequence[AgentEvent]) -> tuple[RunState, list[Action]]:
    every: list[Action] = []
    for event in events:
        state, actions = decide(state, event)
        every += actions
    return state, every


def _restarting(reason: str = LOST, rank: int = 7) -> Restarting:
    return Restarting(Event(EventKind.JOB_RESTARTING, "j", 4, rank, "h9", reason))


def _member_failed(rank: int = 7, reason: str = "connection lost") -> PeerFailed:
    return PeerFailed(Event(EventKind.MEMBER_FAILED, "j", 4, rank, "h9", reason))


def test_decide_stops_the_ranks_and_rejoins_without_a_restart_if_the_generation_restarts() -> None:
    state, actions = _run(_started(), [_member_failed(), _restarting()])
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: {LOST}; stopping local rank(s) 2, 3 to re-form it"),
        StopRanks(StopReason.RERENDEZVOUS, signal.SIGTERM),
    ]
    # The stopped ranks report no Leave (a non-zero one would fail the job) and are still reported alive.
    state, actions = _run(state, [RankExited(0, -15), RankExited(1, 1)])
    assert not any(isinstance(a, ReportLeave | ShowTail) for a in actions)
    assert [state.reported_alive(0), state.reported_alive(1)] == [True, True]
    assert state.settled
    state, actions = decide(state, RanksDone())
    assert actions == []
    assert decide(state, Finished())[1] == [
        Log(logging.WARNING, f"{LABEL}: joining the next generation ({LOST}); no restart counted"),
        Rejoin(),
    ]


def test_decide_re_forms_a_larger_world_if_ranks_wait_to_join() -> None:
    state, actions = decide(_started(), RendezvousStatus(waiting=2, closed=False))
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: 2 rank(s) wait to join; stopping local rank(s) 2, 3 to re-form a "
            "larger world"),
        StopRanks(StopReason.RERENDEZVOUS, signal.SIGTERM),
    ]  # fmt: skip
    # The generation the agent's own re-join ends: heard, nothing more to do.
    state, actions = _run(
        state, [_restarting("re-rendezvous: rank 2 on host h1 re-joins"), RendezvousStatus(0, False)]
    )
    assert actions == []
    state, _ = _run(state, [RankExited(0, -15), RankExited(1, -15), RanksDone()])
    assert decide(state, Finished())[1][-1] == Rejoin()


def test_decide_ignores_waiting_ranks_if_fixed_closed_or_a_rank_finished() -> None:
    assert decide(_started(elastic=False), RendezvousStatus(1, False))[1] == []
    assert decide(_started(elastic=False), _restarting())[1] == []
    closed, _ = decide(_started(), RendezvousStatus(0, True))
    assert closed.closed
    assert decide(closed, RendezvousStatus(1, True))[1] == []
    finished, actions = decide(_started(), RankExited(0, 0))
    assert actions[-1] == ReportLeave(0, 0, "exited with code 0")  # its Leave closes the rendezvous
    assert decide(finished, RendezvousStatus(1, False))[1] == []


def test_decide_fails_like_a_peer_failure_if_the_generation_restarts_after_the_rendezvous_closed() -> None:
    state, _ = decide(_started(), RankExited(0, 0))
    state, actions = decide(state, _restarting())
    what = (
        f"the job failed: {LOST}; the rendezvous is closed (a rank finished), so the world does not re-form"
    )
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: {what}; stopping local rank(s) 3"),
        StopRanks(StopReason.PEER_FAILED, signal.SIGTERM),
    ]
    state, _ = _run(state, [RankExited(1, -15), RanksDone()])
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(EXIT_PEER_FAILED, f"job j generation 4: {what}; stopped local rank(s) 3"))
    ]


def test_decide_holds_a_failed_ranks_leave_and_drops_it_if_the_generation_restarts() -> None:
    state, actions = decide(_started(), RankExited(1, 1))
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: rank 3 on host h1 exited with code 1"),
        ShowTail(1),
        StopRanks(StopReason.RANK_FAILED, signal.SIGTERM),
        HoldExit(1),
    ]
    # The rank the agent stopped is held too: its Leave would fail the job just as well.
    state, actions = decide(state, RankExited(0, -15))
    assert actions[-1] == HoldExit(0)
    assert [leave.index for leave in state.held] == [1, 0]
    assert not state.settled
    assert [state.reported_alive(0), state.reported_alive(1)] == [True, True]
    # The verdict: a peer was lost, which is why the rank failed. No Leave, no restart: re-join.
    state, actions = _run(state, [_member_failed(), _restarting()])
    assert actions == [Log(logging.WARNING, f"{LABEL}: {LOST}; the world re-forms")]
    assert state.settled
    assert decide(state, VerdictDue()) == (state, [])
    state, actions = decide(state, RanksDone())
    assert actions == []
    assert decide(state, Finished())[1][-1] == Rejoin()


def test_decide_reports_the_held_leaves_and_fails_if_no_verdict_comes() -> None:
    state, _ = _run(_started(max_restarts=1), [RankExited(1, 3), RankExited(0, -15)])
    state, actions = decide(state, VerdictDue())
    stopped = "killed by signal 15 (SIGTERM), stopped by sar-worker because a local rank failed"
    assert actions == [ReportLeave(1, 3, "exited with code 3"), ReportLeave(0, -15, stopped)]
    assert state.settled
    state, _ = decide(state, RanksDone())
    message = "job j generation 4: rank 3 on host h1 failed: exited with code 3"
    assert decide(state, Finished())[1] == [
        Log(logging.WARNING, f"{LABEL}: {message}; restart 1 of 1, joining generation 5"),
        Restart(restarts=1, generation=5),
    ]


def test_decide_acts_on_the_job_failed_that_follows_a_member_failed_in_an_elastic_job() -> None:
    state, actions = decide(_started(), _member_failed(7, "exited with code 3"))
    assert actions == []
    why = "rank 7 on host h9 failed: exited with code 3"
    state, actions = decide(state, PeerFailed(Event(EventKind.JOB_FAILED, "j", 4, 7, "h9", why)))
    assert actions == [
        Log(logging.ERROR, f"{LABEL}: the job failed: {why}; stopping local rank(s) 2, 3"),
        StopRanks(StopReason.PEER_FAILED, signal.SIGTERM),
    ]
    # Leaves of ranks stopped for a failed job are reported at once: the job has failed already.
    assert decide(state, RankExited(0, -15))[1][-1] == ReportLeave(
        0, -15, "killed by signal 15 (SIGTERM), stopped by sar-worker because the coordinator reported a "
        "failed rank",
    )  # fmt: skip


def test_decide_moves_the_blame_to_the_peer_the_job_failed_names_after_a_held_exit() -> None:
    state, _ = decide(_started(), RankExited(1, 1))
    why = "rank 7 on host h9 failed: exited with code 3"
    state, actions = decide(state, PeerFailed(Event(EventKind.JOB_FAILED, "j", 4, 7, "h9", why)))
    message = f"job j generation 4: {why}; local rank(s) 3 failed after it"
    assert actions == [ReportLeave(1, 1, "exited with code 1"), Log(logging.ERROR, f"{LABEL}: {message}")]
    state, _ = _run(state, [RankExited(0, -15), RanksDone()])
    assert decide(state, Finished())[1] == [Exit(AgentResult(EXIT_PEER_FAILED, message))]


def test_decide_takes_an_interrupted_elastic_agents_ranks_out_without_a_failed_leave() -> None:
    state, _ = decide(_started(max_restarts=2), RankExited(1, 1))
    state, actions = decide(state, StopRequested(signal.SIGTERM))
    assert state.held == ()
    assert actions == [
        Log(logging.WARNING, f"{LABEL}: got SIGTERM; forwarding it to the ranks"),
        SignalRanks(signal.SIGTERM),
    ]
    state, actions = decide(state, RankExited(0, -15))
    assert not any(isinstance(a, ReportLeave | HoldExit) for a in actions)
    # Interrupted: no re-forming, no restart.
    state, actions = _run(state, [_restarting(), RanksDone()])
    assert not any(isinstance(a, StopRanks) for a in actions)
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(1, "job j generation 4: rank 3 on host h1 failed: exited with code 1"))
    ]


def test_decide_exits_128_plus_the_signal_if_interrupted_while_the_world_re_forms() -> None:
    state, _ = decide(_started(), RendezvousStatus(1, False))
    state, actions = decide(state, StopRequested(signal.SIGINT))
    assert actions[-1] == SignalRanks(signal.SIGINT)
    state, _ = _run(state, [RankExited(0, -2), RankExited(1, -2), RanksDone()])
    assert decide(state, Finished())[1] == [
        Exit(AgentResult(130, "job j generation 4: interrupted by SIGINT while the world re-forms"))
    ]
