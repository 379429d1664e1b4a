"""What the ``sar-worker`` agent's decisions take and give: the events (a rank started or exited,
the coordinator reported a failure or the rendezvous' status, a signal, ...), the actions (log,
stop the ranks, report a ``Leave``, join again, exit) and how a run ended. Plain frozen values; the
rules that turn one into the other are :func:`sarcomm.worker.agent.decisions.decide`'s, which
re-exports every name here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sarcomm.common.messages import Event

__all__ = [
    "Action",
    "AgentEvent",
    "AgentResult",
    "AwaitVerdict",
    "Exit",
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
    "ShowTail",
    "SignalRanks",
    "SpawnFailed",
    "StopRanks",
    "StopReason",
    "StopRequested",
    "StreamBroke",
    "VerdictDue",
]


@dataclass(frozen=True)
class AgentResult:
    """How a run ended: the exit code, and one line naming the failure ("" on success)."""

    exit_code: int
    message: str = ""


class StopReason(enum.Enum):
    """Why the agent is stopping its ranks."""

    RANK_FAILED = "a local rank failed"
    PEER_FAILED = "the coordinator reported a failed rank"
    SIGNAL = "the agent got a signal"
    RERENDEZVOUS = "the world re-forms"


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


@dataclass(frozen=True)
class Restarting:
    """The coordinator ended this generation of an elastic job on purpose (``JOB_RESTARTING``)."""

    event: Event


@dataclass(frozen=True)
class RendezvousStatus:
    """What a heartbeat answer says of this elastic generation's rendezvous: ``waiting`` ranks wait
    to join the next one; ``closed``: no new world forms under the job while it runs."""

    waiting: int
    closed: bool


@dataclass(frozen=True)
class VerdictDue:
    """The held exits' wait for the coordinator's verdict is over (see :class:`HoldExit`)."""


AgentEvent = (
    RankStarted
    | SpawnFailed
    | RankExited
    | PeerFailed
    | StreamBroke
    | StopRequested
    | RanksDone
    | Finished
    | Restarting
    | RendezvousStatus
    | VerdictDue
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
class HoldExit:
    """Local rank ``index`` exited; keep reporting it alive to the coordinator and send
    :class:`VerdictDue` once the verdict had time to come (its ``Leave`` waits in the state)."""

    index: int


@dataclass(frozen=True)
class Rejoin:
    """Join the elastic job's next generation naming this agent's member (no restart counted)."""


@dataclass(frozen=True)
class Exit:
    """End the agent with ``result``."""

    result: AgentResult


#: The actions that end a generation's run: what the agent does next.
RunEnd = Restart | Rejoin | Exit

Action = Log | ShowTail | StopRanks | SignalRanks | ReportLeave | AwaitVerdict | HoldExit | RunEnd
