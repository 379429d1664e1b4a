"""What turns the world outside the ``sar-worker`` agent into its decisions' events: the heartbeat
stream's answers (a peer failed, the generation re-forms, ranks wait to join), SIGINT and SIGTERM,
and a rank's exit. Each source puts its events on the run's queue; :mod:`.supervisor` takes them
off one at a time, hands each to :func:`~sarcomm.worker.agent.decisions.decide` and carries out the
actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import SarcommError
from sarcomm.common.messages import JoinResult, MemberReport
from sarcomm.worker.agent.events import (
    AgentEvent,
    PeerFailed,
    RankExited,
    RendezvousStatus,
    Restarting,
    StopRequested,
    StreamBroke,
)
from sarcomm.worker.agent.local_rank import LocalRank
from sarcomm.worker.agent.output import EXIT_DRAIN_S

__all__ = ["forward_signals", "heartbeat", "wait_exit"]

log = logging.getLogger(__name__)


async def heartbeat(
    client: CoordinatorClient,
    joined: JoinResult,
    reports: Callable[[], list[MemberReport]],
    interval: float,
    events: asyncio.Queue[AgentEvent],
    label: str,
    re_forming: Callable[[], bool],
) -> None:
    """One stream for all of ``joined``'s local ranks, each beat made of ``reports()``; what its
    answers say of this generation becomes events. ``re_forming()`` says whether the world is
    re-forming (the coordinator then forgets the generation's members: no warning).

    The stream reports by exception when the coordinator offers it (issue 28): ``reports()`` still
    reads every rank each interval (local and cheap), but only changes go (a rank silent or fresh
    again, quiet in a collective or moving again, its metrics address, progress asked for), with a
    lease renewal when nothing changed. Exits go by ``Leave`` as before."""
    mine = {a.member_id for a in joined.assignments}
    warned_unknown = False
    status = RendezvousStatus(0, False)
    try:
        async with client.heartbeats(reports, interval, by_exception=True, job=joined.job) as stream:
            async for reply in stream:
                for event in reply.events:
                    if event.job != joined.job or event.generation != joined.generation:
                        continue
                    if event.kind in (EventKind.MEMBER_FAILED, EventKind.JOB_FAILED):
                        events.put_nowait(PeerFailed(event))
                    elif event.kind is EventKind.JOB_RESTARTING:
                        events.put_nowait(Restarting(event))
                said = next(
                    (RendezvousStatus(r.waiting, r.closed) for r in reply.rendezvous
                     if r.job == joined.job and r.generation == joined.generation), status,
                )  # fmt: skip
                if said != status:
                    status = said
                    events.put_nowait(said)
                unknown = mine.intersection(reply.unknown_members)
                if unknown and not warned_unknown and not re_forming():
                    warned_unknown = True
                    log.warning(
                        "%s: the coordinator no longer knows %d local member(s); ranks keep running",
                        label, len(unknown),
                    )  # fmt: skip
    except SarcommError as exc:
        events.put_nowait(StreamBroke(str(exc)))
    except Exception:  # a bug here must not take the ranks down; the coordinator will notice
        log.exception("%s: heartbeats stopped; ranks keep running", label)


async def wait_exit(r: LocalRank, events: asyncio.Queue[AgentEvent]) -> None:
    """Report ``r``'s exit once its process exited and what it wrote is passed on, so that its
    last lines come before the line about its exit; waits at most :data:`EXIT_DRAIN_S` for that."""
    if r.proc is not None:
        returncode = await r.proc.wait()
        await r.output.drained(EXIT_DRAIN_S)
        events.put_nowait(RankExited(r.index, returncode))


@contextlib.contextmanager
def forward_signals(events: asyncio.Queue[AgentEvent]) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into events while the ranks run; restore handlers afterwards."""
    loop = asyncio.get_running_loop()
    installed: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, events.put_nowait, StopRequested(signum))
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no such API
            log.debug("cannot handle signal %d here; it keeps its default action", signum)
        else:
            installed.append(signum)
    try:
        yield
    finally:
        for installed_signum in installed:
            loop.remove_signal_handler(installed_signum)
