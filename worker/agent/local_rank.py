"""One local rank as the agent sees it (:class:`LocalRank`): its member at the coordinator, its
launcher process, its progress record and output, and the heartbeat report made from them; and
what the agent does to all its ranks at once (signal them, list their processes).

Pure bookkeeping and ``/proc`` reads: the decisions are :mod:`.decisions`', the I/O loop is
:mod:`.supervisor`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sarcomm.common.addresses import host_port
from sarcomm.common.messages import MemberReport, Progress
from sarcomm.worker.agent.decisions import liveness_age, process_runs
from sarcomm.worker.agent.output import RankOutput
from sarcomm.worker.agent.rank_process import RankProcess, process_state
from sarcomm.worker.progress import ProgressReader

__all__ = ["LocalRank", "rank_processes", "signal_ranks"]

log = logging.getLogger(__name__)


@dataclass
class LocalRank:
    """One local rank of this agent: its member, its launcher process, its progress record and
    output, and what the agent learned of it."""

    index: int
    rank: int
    member_id: str
    secret: str = field(repr=False)
    #: Where this rank's /metrics endpoint is reachable: its address on its interface, or the
    #: --metrics-host it listens on.
    address: str
    progress: ProgressReader
    output: RankOutput
    #: Its launcher, once started (whether it still runs is the decisions' :class:`RunState`'s to say).
    proc: RankProcess | None = None
    stale: bool = False
    #: Whether this rank's own exit was a failure (not the agent's stop): its tail was shown.
    failed: bool = False
    #: Unix time the kernel last said this rank's process runs (set when it starts).
    seen_running: float = 0.0

    def report(self, now: float, stale_after: float, label: str = "") -> MemberReport:
        """This rank's heartbeat report, with the age of its last sign of life (Unix time ``now``).

        Signs of life (:func:`~sarcomm.worker.agent.decisions.liveness_age`): the alive stamp of
        the rank's progress record, and the kernel's word that the rank's process runs (its state
        in ``/proc``, read once per report). A rank that is stopped or dead stops both, its age
        grows and the coordinator judges it by the interval x misses rule, counted from its last
        sign. A rank whose Python is busy (the GIL held by a long C call) stops stamping but runs:
        it stays alive, and once its stamp is older than ``stale_after`` the agent logs it. The
        stamped progress is what tells the coordinator about stalls.
        """
        record = self.progress.read()
        # The record names the process that stamps it (the rank itself, below its launcher).
        pid = record.pid if record is not None and record.pid > 0 else self.proc.pid if self.proc else 0
        state = process_state(pid) if pid > 0 else None
        if pid <= 0 or process_runs(state):  # no process to ask: alive while the agent runs it
            self.seen_running = now
        age = liveness_age(now, record.stamp if record is not None else None, self.seen_running)
        if record is None:
            return MemberReport(self.member_id, self.secret, age=age)
        # A stamp in the future keeps an exiting rank alive (see services.EXIT_GRACE_S).
        stamp_age = max(0.0, now - record.stamp)
        if stamp_age > stale_after:
            if not self.stale:
                self.stale = True
                log.warning(
                    "%s: rank %d has not stamped its progress for %.1f s (last in %s #%d); its process "
                    "is %s", label, self.rank, stamp_age, record.op or "no collective", record.seq,
                    "running (busy: its Python does not get the GIL)" if process_runs(state)
                    else f"not running (state {state or 'gone'})",
                )  # fmt: skip
        elif self.stale:
            self.stale = False
            log.info("%s: rank %d stamps its progress again", label, self.rank)
        progress = Progress(record.seq, record.op, record.in_collective, record.since)
        # The rank binds its metrics port itself (possibly any free one) and notes it in the record.
        metrics_address = host_port(self.address, record.metrics_port) if record.metrics_port else ""
        return MemberReport(self.member_id, self.secret, progress, metrics_address, age)


def signal_ranks(ranks: Iterable[LocalRank], signum: int) -> None:
    """Signal each of ``ranks``' process group (the rank and the children it started)."""
    for r in ranks:
        if r.proc is not None:
            r.proc.signal_group(signum)


def rank_processes(ranks: Sequence[LocalRank]) -> dict[int, RankProcess]:
    """The started ranks' processes, by global rank."""
    return {r.rank: r.proc for r in ranks if r.proc is not None}
