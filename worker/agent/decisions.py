"""What the ``sar-worker`` agent decides while its ranks run, as a pure function.

:func:`decide` takes the state of one generation's run and one event (a rank started, failed to
start or exited, the coordinator reported a failure, the heartbeat stream broke, the agent got a
signal, the ranks are all done, the run is over) and returns the new state and the actions to take
(log a line, stop or signal the ranks, report a rank's ``Leave``, wait for the coordinator's
verdict, restart, exit). No I/O happens here: :mod:`sarcomm.worker.agent.supervisor` carries the actions out,
so every rule below is unit-tested without processes or a coordinator.

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
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from sarcomm.common.constants import EventKind
from sarcomm.common.messages import Event

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
    "Log",
    "PeerFailed",
    "RankExited",
    "RankStarted",
    "RanksDone",
    "ReportLeave",
    "Restart",
    "RunState",
    "ShowTail",
    "SignalRanks",
    "SpawnFailed",
    "StopRanks",
    "StopReason",
    "StopRequested",
    "StreamBroke",
    "decide",
    "describe_exit",
    "exit_code_of",
    "liveness_age",
    "process_runs",
]

#: Exit code of an agent whose own ranks were fine but which stopped them because a rank on
#: another host failed.
EXIT_PEER_FAILED = 1
#: Exit code of a rank whose command could not be started (as a shell reports "command not found").
EXIT_SPAWN_FAILED = 127

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


@dataclass(frozen=True)
class AgentResult:
    """How a run ended: the exit code, and one line naming the failure ("" on success)."""

    exit_code: int
    message: str = ""


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


class StopReason(enum.Enum):
    """Why the agent is stopping its ranks."""

    RANK_FAILED = "a local rank failed"
    PEER_FAILED = "the coordinator reported a failed rank"
    SIGNAL = "the agent got a signal"


@dataclass(frozen=True)
class Failure:
    """The failure that decides the run's exit code, and its one-line message."""

    exit_code: int
    message: str


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStarted:
    """Local rank ``index``'s process was started."""

    index: int


@dataclass(frozen=True)
class SpawnFailed:
    """Local rank ``index``'s command could not be started; ``reason`` says why."""

    index: int
    reason: str


@dataclass(frozen=True)
class RankExited:
    """Local rank ``index`` exited with ``returncode`` (negative: killed by that signal)."""

    index: int
    returncode: int


@dataclass(frozen=True)
class PeerFailed:
    """The coordinator reported a ``MEMBER_FAILED`` or ``JOB_FAILED`` of this generation."""

    event: Event


@dataclass(frozen=True)
class StreamBroke:
    """The heartbeat stream ended with an error (``reason``); the ranks keep running."""

    reason: str


@dataclass(frozen=True)
class StopRequested:
    """The agent got signal ``signum`` (SIGINT or SIGTERM)."""

    signum: int


@dataclass(frozen=True)
class RanksDone:
    """No local rank runs any more."""


@dataclass(frozen=True)
class Finished:
    """The run's loose ends (Leave calls, the heartbeat stream) are tied up: decide its end."""


AgentEvent = (
    RankStarted | SpawnFailed | RankExited | PeerFailed | StreamBroke | StopRequested | RanksDone | Finished
)


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Log:
    """Log ``text`` at ``level`` (a :mod:`logging` level)."""

    level: int
    text: str


@dataclass(frozen=True)
class StopRanks:
    """Stop the running ranks: ``signum`` to each one's process group, SIGKILL after the grace."""

    reason: StopReason
    signum: int


@dataclass(frozen=True)
class SignalRanks:
    """Send ``signum`` to each running rank's process group now."""

    signum: int


@dataclass(frozen=True)
class ReportLeave:
    """Report local rank ``index``'s ``Leave`` with ``exit_code`` and ``reason``."""

    index: int
    exit_code: int
    reason: str


@dataclass(frozen=True)
class ShowTail:
    """Print local rank ``index``'s last lines of output under its failure line."""

    index: int


@dataclass(frozen=True)
class AwaitVerdict:
    """Let the Leave calls finish and the stream bring a verdict on a peer that failed first."""


@dataclass(frozen=True)
class Restart:
    """Join again for ``generation`` as restart number ``restarts``."""

    restarts: int
    generation: int


@dataclass(frozen=True)
class Exit:
    """End the agent with ``result``."""

    result: AgentResult


Action = Log | ShowTail | StopRanks | SignalRanks | ReportLeave | AwaitVerdict | Restart | Exit


# -- state -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunState:
    """One generation's run as far as the decisions go.

    ``ranks`` holds the global rank of each local rank (by local index), ``started`` whether its
    process was started, ``returncodes`` its return code once it exited (None while it runs or
    before it started). ``local_blame`` says whether ``failure`` blames a local rank's own exit
    (rule 3); ``interrupted`` is the first signal the agent got; ``finishing`` is set once all ranks
    are done.
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
    if event.kind is not EventKind.MEMBER_FAILED or event.rank < 0 or event.rank in state.ranks:
        return None
    failed = ", ".join(
        str(rank) for rank, code in zip(state.ranks, state.returncodes, strict=True) if code not in (None, 0)
    )
    return Failure(
        EXIT_PEER_FAILED, f"{state.prefix}: {event.describe()}; local rank(s) {failed} failed after it"
    )


def decide(state: RunState, event: AgentEvent) -> tuple[RunState, list[Action]]:
    """The new state and the actions for ``event`` (see the module docstring for the rules)."""
    if isinstance(event, RankStarted):
        return dataclasses.replace(state, started=_with(state.started, event.index, True)), []
    if isinstance(event, SpawnFailed):
        return _spawn_failed(state, event)
    if isinstance(event, RankExited):
        return _rank_exited(state, event)
    if isinstance(event, PeerFailed):
        return _peer_failed(state, event.event)
    if isinstance(event, StreamBroke):
        # Collectives do not depend on the coordinator: the ranks keep running without it.
        return state, [
            Log(logging.ERROR, f"{state.label}: heartbeats stopped: {event.reason}; ranks keep running")
        ]
    if isinstance(event, StopRequested):
        return _stop_requested(state, event.signum)
    if isinstance(event, RanksDone):
        verdict: list[Action] = [AwaitVerdict()] if state.local_blame and state.interrupted is None else []
        return dataclasses.replace(state, finishing=True), verdict
    return state, _finished(state)


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
    if code == 0:
        actions.append(Log(logging.INFO, f"{state.label}: rank {rank} exited with code 0"))
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
    actions.append(ReportLeave(event.index, code, reason))
    return state, actions


def _peer_failed(state: RunState, event: Event) -> tuple[RunState, list[Action]]:
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
    state = dataclasses.replace(state, interrupted=signum)
    actions: list[Action] = [Log(logging.WARNING, f"{state.label}: got {name}; forwarding it to the ranks")]
    if state.stopping is None:
        state, stop = _stop(state, StopReason.SIGNAL, signum)
        return state, actions + stop
    return state, [*actions, SignalRanks(signum)]


def _finished(state: RunState) -> list[Action]:
    failure = state.failure
    if failure is None:
        return [
            Log(logging.INFO, f"{state.label}: every local rank exited with code 0"),
            Exit(AgentResult(0)),
        ]
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
            restart,
        ]
    return [Exit(AgentResult(failure.exit_code, failure.message))]
