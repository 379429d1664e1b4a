"""What the ``sar-worker`` agent decides while its ranks run, as a pure function.

:func:`decide` takes the state of one generation's run and one event (a rank started, failed to
start or exited, the coordinator reported a failure, the heartbeat stream broke, the agent got a
signal, the ranks are all done, the run is over; in an elastic job the generation re-forms or ranks
wait to join) and returns the new state and the actions to take (log a line, stop or signal the
ranks, report a rank's ``Leave``, wait for the coordinator's verdict, restart, join again, exit);
both are in :mod:`sarcomm.worker.agent.events`, re-exported here. No I/O happens here:
:mod:`sarcomm.worker.agent.supervisor` carries the actions out, so every rule below is
unit-tested without processes or a coordinator.

The rules:

1. Blame: the first failure decides the exit code and the message. A local rank's non-zero exit
   is one, unless the agent is already stopping its ranks because of a failure (then the exit is
   the stop's doing). A rank killed by signal N exits 128+N (:func:`exit_code_of`); a rank that
   could not be started counts as exit 127.
2. A peer's failure (the coordinator's ``MEMBER_FAILED`` or ``JOB_FAILED`` of this generation)
   before any of its own makes the agent stop its ranks and exit :data:`EXIT_PEER_FAILED` with a
   line naming the failed rank, its host and the reason.
3. A peer's death fails gloo collectives at once ("Connection closed by peer"), so a local rank
   may exit before the coordinator's verdict on that peer arrives. The coordinator announces only
   a generation's first failure, so a ``MEMBER_FAILED`` naming another host's rank, arriving while
   the blame is on a local rank's own exit, moves the blame there (exit :data:`EXIT_PEER_FAILED`).
   Once all ranks are done, a run whose blame is local waits briefly for such a verdict
   (:class:`AwaitVerdict`), unless the agent was interrupted.
4. Signals: the first SIGINT/SIGTERM is forwarded to the ranks (starting a graceful stop when
   none runs yet); a second one kills them. An interrupted run is never restarted.
5. Restarts: a failed run that was not interrupted joins the next generation again, up to
   ``--max-restarts`` times; otherwise the agent exits with the failure's code.
6. Liveness (:func:`liveness_age`): a rank shows a sign of life by its library's stamp or by the
   kernel's word that its process runs (:func:`process_runs`: any state but stopped, zombie or
   gone). The stamp needs the rank's Python, the kernel's word does not: a rank whose Python holds
   the GIL for minutes (a long C call, 8 ranks on 2 cores) is alive, a stopped or dead one is not.
   The stamp alone still tells progress and stalls.
7. Elastic worlds (``--world-size MIN:MAX``), as torchrun's agent does it: when the coordinator
   ends the generation on purpose (:class:`Restarting`: a peer was lost, another agent re-joins)
   or agents wait to join (:class:`RendezvousStatus` with ``waiting`` > 0: scale-up), the agent
   stops its ranks, reports no ``Leave`` for them, and joins the next generation naming its
   member (:class:`Rejoin`); ``--max-restarts`` is not spent. A local rank's non-zero exit is
   held (:class:`HoldExit`: no ``Leave`` yet, the rank still reported alive) until the coordinator's
   verdict: a peer's death fails gloo collectives at once, before the coordinator has judged the
   peer lost, and a ``Leave`` with a non-zero code would fail the job instead of re-forming it.
   When the verdict is a re-rendezvous the held exits are dropped; when none comes in time
   (:class:`VerdictDue`) they are reported, and the failure is the run's (rules 1, 5). A closed
   rendezvous (a member finished: a local rank exited 0, or the coordinator says it is closed) or an
   interrupted run never re-forms: a re-rendezvous then fails the run like a peer's failure.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event
from sarcomm.worker.agent.events import (
    Action,
    AgentEvent,
    AgentResult,
    AwaitVerdict,
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
    RunEnd,
    ShowTail,
    SignalRanks,
    SpawnFailed,
    StopRanks,
    StopReason,
    StopRequested,
    StreamBroke,
    VerdictDue,
)

__all__ = [
    "EXIT_PEER_FAILED",
    "EXIT_SPAWN_FAILED",
    "Action",
    "AgentEvent",
    "AgentResult",
    "AwaitVerdict",
    "Exit",
    "Failure",
    "Finished",
    "HoldExit",
    "Log",
    "PeerFailed",
    "RankExited",
    "RankStarted",
    "RanksDone",
    "Rejoin",
    "RendezvousStatus",
    "ReportLeave",
    "Restart",
    "Restarting",
    "RunEnd",
    "RunState",
    "ShowTail",
    "SignalRanks",
    "SpawnFailed",
    "StopRanks",
    "StopReason",
    "StopRequested",
    "StreamBroke",
    "VerdictDue",
    "decide",
    "describe_exit",
    "exit_code_of",
    "finish",
    "liveness_age",
    "process_runs",
]

#: Exit code of an agent whose own ranks were fine but which stopped them because a rank on
#: another host failed.
EXIT_PEER_FAILED = 1
#: Exit code of a rank whose command could not be started (as a shell reports "command not found").
EXIT_SPAWN_FAILED = 127

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # torch, a dependency, requires typing_extensions
    from typing_extensions import assert_never

_V = TypeVar("_V")

#: The kernel's states of a process that does not run: stopped, traced, zombie, dead.
_NOT_RUNNING = frozenset("TtZXx")


def process_runs(state: str | None) -> bool:
    """Whether a process in kernel state ``state`` (``/proc/PID/stat``; None: gone) runs."""
    return state is not None and state not in _NOT_RUNNING


def liveness_age(now: float, stamp: float | None, seen_running: float) -> float:
    """Seconds before ``now`` that a rank last showed a sign of life: its own ``stamp`` (None: it
    keeps none) or ``seen_running``, when the kernel last said its process runs (Unix times)."""
    newest = seen_running if stamp is None else max(stamp, seen_running)
    return max(0.0, now - newest)


def exit_code_of(returncode: int) -> int:
    """A process exit code as a shell reports it: the code, or 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exited with code 3``, or ``killed by signal 9 (SIGKILL)`` for a negative return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class Failure:
    """The failure that decides the run's exit code, and its one-line message."""

    exit_code: int
    message: str


# -- state -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunState:
    """One generation's run as far as the decisions go.

    ``ranks`` holds the global rank of each local rank (by local index), ``started`` whether its
    process was started, ``returncodes`` its return code once it exited (None while it runs or
    before it started). ``local_blame`` says whether ``failure`` blames a local rank's own exit
    (rule 3); ``interrupted`` is the first signal the agent got; ``finishing`` is set once all ranks
    are done. Rule 7 (``elastic``): ``held`` are the ``Leave`` reports that wait for the verdict,
    ``rerendezvous`` says why the generation re-forms ("" while it does not), ``closed`` that it
    never will.
    """

    job: str
    generation: int
    host: str
    label: str
    ranks: tuple[int, ...]
    restarts: int = 0
    max_restarts: int = 0
    started: tuple[bool, ...] = ()
    returncodes: tuple[int | None, ...] = ()
    failure: Failure | None = None
    local_blame: bool = False
    stopping: StopReason | None = None
    interrupted: int | None = None
    finishing: bool = False
    elastic: bool = False
    held: tuple[ReportLeave, ...] = ()
    rerendezvous: str = ""
    closed: bool = False

    def __post_init__(self) -> None:
        if not self.started:
            object.__setattr__(self, "started", (False,) * len(self.ranks))
        if not self.returncodes:
            object.__setattr__(self, "returncodes", (None,) * len(self.ranks))
        if not len(self.started) == len(self.returncodes) == len(self.ranks):
            raise ValueError(
                f"started ({len(self.started)}) and returncodes ({len(self.returncodes)}) must have "
                f"one entry per rank ({len(self.ranks)})."
            )

    def running(self, index: int) -> bool:
        """Whether local rank ``index`` runs: started and not exited."""
        return self.started[index] and self.returncodes[index] is None

    @property
    def any_running(self) -> bool:
        return any(self.running(i) for i in range(len(self.ranks)))

    @property
    def prefix(self) -> str:
        return f"job {self.job} generation {self.generation}"

    def reported_alive(self, index: int) -> bool:
        """Whether local rank ``index`` no longer runs but is still reported alive: its exit is
        held, or it was stopped for a re-rendezvous (rule 7)."""
        if self.running(index) or not self.started[index]:
            return False
        return bool(self.rerendezvous) or any(leave.index == index for leave in self.held)

    @property
    def settled(self) -> bool:
        """No local rank runs and no exit waits for the verdict."""
        return not self.any_running and not self.held


def _with(sequence: Sequence[_V], index: int, value: _V) -> tuple[_V, ...]:
    items = list(sequence)
    items[index] = value
    return tuple(items)


def _stop(state: RunState, reason: StopReason, signum: int = signal.SIGTERM) -> tuple[RunState, list[Action]]:
    """Begin stopping the ranks, once per run."""
    if state.stopping is not None:
        return state, []
    return dataclasses.replace(state, stopping=reason), [StopRanks(reason, signum)]


def _caused_elsewhere(state: RunState, event: Event) -> Failure | None:
    """The failure to report instead of a local rank's own exit, when the coordinator names a rank
    of another host as its generation's first failure (rule 3); None otherwise."""
    failed = EventKind.JOB_FAILED if state.elastic else EventKind.MEMBER_FAILED
    if event.kind is not failed or event.rank < 0 or event.rank in state.ranks:
        return None
    failed_ranks = ", ".join(
        str(rank) for rank, code in zip(state.ranks, state.returncodes, strict=True) if code not in (None, 0)
    )
    # A job's failure names its cause itself ("rank R on host H failed: ...").
    what = event.reason if event.kind is EventKind.JOB_FAILED else event.describe()
    return Failure(EXIT_PEER_FAILED, f"{state.prefix}: {what}; local rank(s) {failed_ranks} failed after it")


def decide(state: RunState, event: AgentEvent) -> tuple[RunState, list[Action]]:
    """The new state and the actions for ``event`` (see the module docstring for the rules).

    Every kind of event has its case: mypy fails on an :data:`AgentEvent` added without one."""
    match event:
        case RankStarted(index=index):
            return dataclasses.replace(state, started=_with(state.started, index, True)), []
        case SpawnFailed():
            return _spawn_failed(state, event)
        case RankExited():
            return _rank_exited(state, event)
        case PeerFailed(event=coordinator_event):
            return _peer_failed(state, coordinator_event)
        case StreamBroke(reason=reason):
            # Collectives do not depend on the coordinator: the ranks keep running without it.
            return state, [
                Log(logging.ERROR, f"{state.label}: heartbeats stopped: {reason}; ranks keep running")
            ]
        case StopRequested(signum=signum):
            return _stop_requested(state, signum)
        case Restarting(event=coordinator_event):
            return _restarting(state, coordinator_event)
        case RendezvousStatus():
            return _waiting_or_closed(state, event)
        case VerdictDue():
            return dataclasses.replace(state, held=()), list(state.held)
        case RanksDone():
            verdict: list[Action] = (
                [AwaitVerdict()] if state.local_blame and state.interrupted is None else []
            )
            return dataclasses.replace(state, finishing=True), verdict
        case Finished():
            lines, end = finish(state)
            return state, [*lines, end]
        case _:
            assert_never(event)


def _spawn_failed(state: RunState, event: SpawnFailed) -> tuple[RunState, list[Action]]:
    rank = state.ranks[event.index]
    failure = state.failure or Failure(
        EXIT_SPAWN_FAILED, f"{state.prefix}: rank {rank} on host {state.host} failed: {event.reason}"
    )
    state = dataclasses.replace(
        state, failure=failure, returncodes=_with(state.returncodes, event.index, EXIT_SPAWN_FAILED)
    )
    # The rank never ran; reporting it failed makes the other hosts stop too.
    actions: list[Action] = [
        Log(logging.ERROR, f"{state.label}: rank {rank} {event.reason}"),
        ReportLeave(event.index, EXIT_SPAWN_FAILED, event.reason),
    ]
    state, stop = _stop(state, StopReason.RANK_FAILED)
    return state, actions + stop


def _rank_exited(state: RunState, event: RankExited) -> tuple[RunState, list[Action]]:
    code, rank = event.returncode, state.ranks[event.index]
    state = dataclasses.replace(state, returncodes=_with(state.returncodes, event.index, code))
    reason = describe_exit(code)
    actions: list[Action] = []
    if state.stopping is StopReason.RERENDEZVOUS:
        # The coordinator lets it go with its generation (rule 7): no Leave, which would end it.
        return state, [
            Log(logging.INFO, f"{state.label}: rank {rank} {reason}, stopped to re-form the world")
        ]
    if code == 0:
        actions.append(Log(logging.INFO, f"{state.label}: rank {rank} exited with code 0"))
        state = dataclasses.replace(state, closed=state.closed or state.elastic)
    elif state.stopping in (StopReason.RANK_FAILED, StopReason.PEER_FAILED):
        reason = f"{reason}, stopped by sar-worker because {state.stopping.value}"
        actions.append(Log(logging.INFO, f"{state.label}: rank {rank} {reason}"))
    else:
        actions.append(Log(logging.ERROR, f"{state.label}: rank {rank} on host {state.host} {reason}"))
        actions.append(ShowTail(event.index))
        if state.failure is None:
            failure = Failure(
                exit_code_of(code), f"{state.prefix}: rank {rank} on host {state.host} failed: {reason}"
            )
            state = dataclasses.replace(state, failure=failure, local_blame=True)
        state, stop = _stop(state, StopReason.RANK_FAILED)
        actions += stop
    leave = ReportLeave(event.index, code, reason)
    if code == 0 or not state.elastic:
        return state, [*actions, leave]
    if state.interrupted is not None:
        # Rule 7: an interrupted agent takes its ranks out of the world (a node taken away): the
        # coordinator judges them gone and the others re-form without them, as torchrun's do.
        return state, actions
    if state.held or state.local_blame:
        # Rule 7: a lost peer may be the cause; the verdict decides whether this is a failure.
        return dataclasses.replace(state, held=(*state.held, leave)), [*actions, HoldExit(event.index)]
    return state, [*actions, leave]


def _peer_failed(state: RunState, event: Event) -> tuple[RunState, list[Action]]:
    if state.elastic and event.kind is EventKind.MEMBER_FAILED:
        # What follows it decides: JOB_FAILED (a failure) or JOB_RESTARTING (the world re-forms).
        return state, []
    if state.rerendezvous:
        return state, []
    if state.held:  # the verdict is a failure: report the held exits now
        state, released = dataclasses.replace(state, held=()), list(state.held)
        later, after = _peer_failed(state, event)
        return later, released + after
    if state.failure is None and state.stopping is None and not state.finishing:
        what = (
            event.describe()
            if event.kind is EventKind.MEMBER_FAILED
            else f"the job failed: {event.reason or 'no reason given'}"
        )
        stopped = ", ".join(str(rank) for i, rank in enumerate(state.ranks) if state.running(i))
        failure = Failure(EXIT_PEER_FAILED, f"{state.prefix}: {what}; stopped local rank(s) {stopped}")
        state = dataclasses.replace(state, failure=failure)
        actions: list[Action] = [
            Log(logging.ERROR, f"{state.label}: {what}; stopping local rank(s) {stopped}")
        ]
        state, stop = _stop(state, StopReason.PEER_FAILED)
        return state, actions + stop
    cause = _caused_elsewhere(state, event) if state.local_blame else None
    if cause is None:
        return state, []
    state = dataclasses.replace(state, failure=cause, local_blame=False)
    return state, [Log(logging.ERROR, f"{state.label}: {cause.message}")]


def _stop_requested(state: RunState, signum: int) -> tuple[RunState, list[Action]]:
    if state.finishing:  # the ranks are gone; nothing left to forward it to
        return state, []
    name = signal.Signals(signum).name
    if state.interrupted is not None:
        # A second signal: the user is in a hurry.
        return state, [
            Log(logging.WARNING, f"{state.label}: got {name} again; killing the ranks"),
            SignalRanks(signal.SIGKILL),
        ]
    state = dataclasses.replace(state, interrupted=signum, held=())  # rule 7: held exits go unreported
    if state.rerendezvous and state.failure is None:
        # The ranks exit as the stop makes them: the interruption is the run's end.
        failure = Failure(
            exit_code_of(-signum), f"{state.prefix}: interrupted by {name} while the world re-forms"
        )
        state = dataclasses.replace(state, failure=failure)
    actions: list[Action] = [Log(logging.WARNING, f"{state.label}: got {name}; forwarding it to the ranks")]
    if state.stopping is None:
        state, stop = _stop(state, StopReason.SIGNAL, signum)
        return state, actions + stop
    return state, [*actions, SignalRanks(signum)]


def finish(state: RunState) -> tuple[list[Log], RunEnd]:
    """How a run whose loose ends are tied up ends (:class:`Finished`): the lines to log, and the
    one thing the agent does next (join the re-formed world, restart, or exit)."""
    failure = state.failure
    if state.rerendezvous and failure is None:
        return [
            Log(logging.WARNING, f"{state.label}: joining the next generation ({state.rerendezvous}); "
                f"no restart counted"),
        ], Rejoin()  # fmt: skip
    if failure is None:
        return [Log(logging.INFO, f"{state.label}: every local rank exited with code 0")], Exit(
            AgentResult(0)
        )
    if state.interrupted is None and state.restarts < state.max_restarts:
        # The coordinator forms the next world under the next generation number; asking for it
        # (not 0) keeps this host out of any later world if it falls behind.
        restart = Restart(state.restarts + 1, state.generation + 1)
        return [
            Log(
                logging.WARNING,
                f"{state.label}: {failure.message}; restart {restart.restarts} of {state.max_restarts}, "
                f"joining generation {restart.generation}",
            ),
        ], restart
    return [], Exit(AgentResult(failure.exit_code, failure.message))


def _restarting(state: RunState, event: Event) -> tuple[RunState, list[Action]]:
    """Rule 7: the coordinator ended the generation for a re-rendezvous."""
    if state.rerendezvous or not state.elastic or state.interrupted is not None:
        return state, []  # an interrupted run ends as the user's signal makes it
    why = event.reason or "the coordinator ended the generation"
    if state.closed or (state.failure is not None and not state.held):
        # No new world for this agent: a closed rendezvous, or a failure already reported.
        if state.closed:
            why += "; the rendezvous is closed (a rank finished), so the world does not re-form"
        return _peer_failed(state, dataclasses.replace(event, kind=EventKind.JOB_FAILED, reason=why))
    stopped = ", ".join(str(rank) for i, rank in enumerate(state.ranks) if state.running(i))
    state = dataclasses.replace(state, rerendezvous=why, held=(), failure=None, local_blame=False)
    if not stopped:
        return state, [Log(logging.WARNING, f"{state.label}: {why}; the world re-forms")]
    line = Log(logging.WARNING, f"{state.label}: {why}; stopping local rank(s) {stopped} to re-form it")
    state, stop = _re_form(state)
    return state, [line, *stop]


def _waiting_or_closed(state: RunState, status: RendezvousStatus) -> tuple[RunState, list[Action]]:
    """Rule 7: ranks that wait to join make the running world re-form larger (scale-up)."""
    if not state.elastic:
        return state, []
    state = dataclasses.replace(state, closed=state.closed or status.closed)
    quiet = state.failure is None and state.stopping is None and not state.held and not state.finishing
    if status.waiting <= 0 or state.closed or state.interrupted is not None or not quiet:
        return state, []
    why = f"{status.waiting} rank(s) wait to join"
    stopped = ", ".join(str(rank) for i, rank in enumerate(state.ranks) if state.running(i))
    state = dataclasses.replace(state, rerendezvous=why)
    line = Log(
        logging.WARNING, f"{state.label}: {why}; stopping local rank(s) {stopped} to re-form a larger world"
    )
    state, stop = _re_form(state)
    return state, [line, *stop]


def _re_form(state: RunState) -> tuple[RunState, list[Action]]:
    """Stop the ranks for a re-rendezvous (a stop already under way goes on as it is)."""
    if state.stopping is not None:
        return dataclasses.replace(state, stopping=StopReason.RERENDEZVOUS), []
    return _stop(state, StopReason.RERENDEZVOUS)
