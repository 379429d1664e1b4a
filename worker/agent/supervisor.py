"""The ``sar-worker`` agent: registers a host's local ranks, runs them, watches them.

One agent per host (or per group of local ranks):

1. checks its settings locally (``--socket-name`` exists here, ranks fit the world, ...);
2. reserves a TCP port for rank 0's store and joins the job with K members in one ``Join``;
3. releases the port and starts COMMAND once per local rank under the rank launcher
   (:class:`~sarcomm.worker.agent.rank_process.RankProcess`, through asyncio's ``subprocess_exec``: fork
   and exec happen in C, no Python code runs in a forked child of a process with gRPC threads),
   each in a new session so that a rank's own children can be signalled as a group;
4. keeps one heartbeat stream for all its ranks, forwards SIGINT/SIGTERM to them, reports
   ``Leave`` for each rank that exits;
5. stops its other ranks (SIGTERM, then after a grace period the launcher kills the rank's whole
   tree) when a rank fails or the coordinator reports a failure elsewhere, and optionally joins
   again (``--max-restarts``);
6. in an elastic job (``--world-size MIN:MAX``), stops its ranks when the coordinator ends the
   generation on purpose (a peer lost, another agent re-joining) or agents wait to join, and
   joins the next generation naming its member, without spending a restart (torchrun's agent's
   re-rendezvous; see rule 7 of :mod:`sarcomm.worker.agent.decisions`).

A rank's end is its launcher's exit, not the end of its pipes: a helper of the rank that left its
tree (killed launcher) may hold them open for ever; the agent reads them a bounded time longer.

The exit code is the command's: 0 when every rank exited 0, else the first failing rank's code
(128+N for a rank killed by signal N), or ``EXIT_PEER_FAILED`` when a rank elsewhere failed.

Every decision (blame, exit code, stopping, restarting) is made by the pure
:func:`sarcomm.worker.agent.decisions.decide`; this module only turns processes, signals and the
heartbeat stream into its events and carries out the actions it returns. The settings and the
ranks' environment are in :mod:`sarcomm.worker.agent.config`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from sarcomm.common import netinfo
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_MISSES
from sarcomm.common.errors import InvalidArgumentError, JobClosedError, SarcommError, shorten
from sarcomm.common.messages import JoinResult, MemberReport, paced_interval
from sarcomm.common.ports import PortBlock
from sarcomm.worker.agent.config import AgentConfig, rank_environment
from sarcomm.worker.agent.decisions import (
    AgentEvent,
    AgentResult,
    AwaitVerdict,
    Exit,
    HoldExit,
    Log,
    RanksDone,
    RankStarted,
    Rejoin,
    ReportLeave,
    Restart,
    RunEnd,
    RunState,
    ShowTail,
    SignalRanks,
    SpawnFailed,
    StopRanks,
    VerdictDue,
    decide,
    finish,
)
from sarcomm.worker.agent.event_sources import forward_signals, heartbeat, wait_exit
from sarcomm.worker.agent.local_rank import LocalRank, rank_processes, signal_ranks
from sarcomm.worker.agent.output import Console, RankOutput, log_paths, make_log_dir
from sarcomm.worker.agent.rank_process import (
    RankProcess,
    command_problem,
    kill_ranks,
    launch_command,
    wait_exits,
)
from sarcomm.worker.agent.rank_process import running as running_ranks
from sarcomm.worker.launch_env import metrics_report_host
from sarcomm.worker.progress import ProgressReader

__all__ = ["Agent", "log_failures"]

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # torch, a dependency, requires typing_extensions
    from typing_extensions import assert_never

log = logging.getLogger(__name__)

#: Seconds an elastic job's local rank exit is held for the coordinator's verdict (rule 7 of
#: :mod:`~sarcomm.worker.agent.decisions`), or (misses + 1) coordinator intervals if longer: a dead
#: peer's broken stream is judged after one interval (1 s by default), a silent peer after interval
#: x misses (3 s); no verdict by then, and the failure is the rank's own.
VERDICT_WAIT_S = 5.0


class Agent:
    """Runs one ``sar-worker``; ``await Agent(config).run()`` returns an
    :class:`~sarcomm.worker.agent.decisions.AgentResult`.

    ``environ`` is the environment the ranks inherit (default ``os.environ``).
    """

    def __init__(self, config: AgentConfig, environ: Mapping[str, str] | None = None) -> None:
        if not config.command:
            raise InvalidArgumentError(
                "COMMAND is missing: put it after '--', e.g. sar-worker ... -- python train.py"
            )
        self.config = config
        self._environ = dict(os.environ if environ is None else environ)
        self._host = netinfo.host_name()
        self._console: Console | None = None
        self._ports = PortBlock([])

    async def run(self) -> AgentResult:
        """Join, run the ranks, restart up to ``max_restarts`` times after a failure.

        Raises:
            InvalidArgumentError: ``--socket-name`` is not an interface of this host, ``--log-dir``
                cannot be created, or the coordinator refused a field.
            SarcommError: the coordinator refused or could not be reached (its subclasses).
        """
        config = self.config
        if config.socket_name:
            netinfo.check_socket_name(config.socket_name, host=self._host)
        if config.log_dir is not None and config.tee.files:
            make_log_dir(config.log_dir)
        generation = 0
        restarts = 0
        rejoin: tuple[str, str] | None = None
        self._console = Console() if config.tee.console else None
        try:
            async with CoordinatorClient(config.coord, config.token, tls=config.tls) as client:
                while True:
                    try:
                        joined = await self._join(client, generation, rejoin)
                    except JobClosedError as exc:
                        if not exc.beyond_max or rejoin is not None:
                            raise
                        # torchrun's agent beyond --nnodes MAX exits gracefully too: the job ran
                        # (and finished) without this host.
                        log.warning("job=%s: %s; this host waited beyond --world-size %s and exits",
                                    config.job, exc, config.world_text)  # fmt: skip
                        return AgentResult(0)
                    self._follow_coordinator_interval(joined)
                    end = await self._run_generation(client, joined, restarts)
                    match end:
                        case Restart():
                            restarts, generation, rejoin = end.restarts, end.generation, None
                        case Rejoin():
                            member = joined.assignments[0]
                            generation, rejoin = 0, (member.member_id, member.secret)
                        case Exit(result=result):
                            return result
                        case _:
                            assert_never(end)
        finally:
            self._ports.close()
            if self._console is not None:
                self._console.close()

    def _follow_coordinator_interval(self, joined: JoinResult) -> None:
        """Beat (and have the ranks stamp) as often as the coordinator expects, when it expects
        reports more often than ``--heartbeat-interval`` says."""
        interval = paced_interval(self.config.heartbeat_interval, joined.heartbeat_interval)
        if interval != self.config.heartbeat_interval:
            log.info(
                "job=%s ranks=%s generation=%d: heartbeating every %g s, the coordinator's interval "
                "(--heartbeat-interval %g is slower)",
                joined.job, list(joined.ranks), joined.generation, interval, self.config.heartbeat_interval,
            )  # fmt: skip
            self.config = dataclasses.replace(self.config, heartbeat_interval=interval)

    async def _join(
        self, client: CoordinatorClient, generation: int, rejoin: tuple[str, str] | None = None
    ) -> JoinResult:
        """Join for ``generation`` (0: the forming one); in an elastic job ``rejoin`` names this
        agent's member of the generation that re-forms (None: join as a newcomer)."""
        config = self.config
        # The store port is held from before Join until the answer, so no other process takes the
        # port rank 0's TCPStore will listen on if rank 0 lands here; the extra ports (SAR's
        # sampling workers', --extra-ports) until the next join or the end, if the store is here.
        self._ports.close()
        self._ports = PortBlock.reserve(config.extra_ports)
        try:
            elastic = config.min_world_size is not None
            joined = await client.join_many(
                config.job,
                0 if elastic else config.world_size,
                nproc=config.nproc_per_node,
                ranks=config.ranks,
                local_ranks=config.local_ranks,
                local_world_size=config.node_ranks,
                host=self._host,
                socket_name=config.socket_name,
                store_port=self._ports.store_port,
                generation=generation,
                join_timeout=config.join_timeout,
                backend=config.backend,
                max_restarts=config.max_restarts,
                min_members=config.min_world_size or 0,
                max_members=config.world_size if elastic else 0,
                last_call_timeout=config.last_call_timeout if elastic else 0.0,
                rejoin=rejoin,
            )
        except BaseException:
            self._ports.close()
            raise
        self._ports.keep_if_master(joined.master_port)
        return joined

    async def _run_generation(self, client: CoordinatorClient, joined: JoinResult, restarts: int) -> RunEnd:
        """Run one generation's ranks to the end; returns what the agent does next."""
        label = f"job={joined.job} ranks={list(joined.ranks)} generation={joined.generation}"
        with tempfile.TemporaryDirectory(prefix=f"sar-worker-{joined.job}-") as progress_dir:
            return await _Run(self, client, joined, restarts, label, Path(progress_dir)).run()


class _Run:
    """One generation's run: starts the ranks, turns what happens into events for
    :func:`~sarcomm.worker.agent.decisions.decide` and carries out its actions."""

    def __init__(
        self,
        agent: Agent,
        client: CoordinatorClient,
        joined: JoinResult,
        restarts: int,
        label: str,
        progress_dir: Path,
    ) -> None:
        config = agent.config
        self.agent, self.client, self.joined, self.label = agent, client, joined, label
        self.restart_count = max(restarts, joined.restart_count)
        self.ranks = [
            LocalRank(
                index=i,
                rank=a.rank,
                member_id=a.member_id,
                secret=a.secret,
                address=metrics_report_host(config.metrics_host, a.address),
                progress=ProgressReader(progress_dir / f"rank{a.rank}.progress"),
                output=RankOutput(
                    a.rank,
                    a.local_rank,
                    tag=config.output_tag,
                    console=agent._console,
                    files=log_paths(config.log_dir, joined.job, joined.generation, a.rank)
                    if config.log_dir is not None and config.tee.files
                    else None,
                ),
            )
            for i, a in enumerate(joined.assignments)
        ]
        # Whether a rank runs, and how it exited, is held here alone (started, returncodes).
        self.state = RunState(
            job=joined.job,
            generation=joined.generation,
            host=agent._host,
            label=label,
            ranks=tuple(r.rank for r in self.ranks),
            restarts=restarts,
            max_restarts=config.max_restarts,
            elastic=config.elastic,
        )
        # The rank's library stamps every interval; past two missed stamps the agent logs it (the
        # coordinator judges it, by the age each report carries).
        self.stale_after = 3 * config.heartbeat_interval
        #: What happened, in order, for :meth:`apply` (filled by :mod:`.event_sources`).
        self.events: asyncio.Queue[AgentEvent] = asyncio.Queue()
        self.background: set[asyncio.Task[None]] = set()
        self.stop_task: asyncio.Task[None] | None = None
        self.verdict_timer: asyncio.TimerHandle | None = None

    def running(self) -> list[LocalRank]:
        """The ranks whose processes run, as far as the decisions know (their exits not yet seen)."""
        return [r for r in self.ranks if self.state.running(r.index)]

    def reports(self) -> list[MemberReport]:
        now = time.time()
        reports = [r.report(now, self.stale_after, self.label) for r in self.running()]
        # Rule 7: a rank whose exit is held, or stopped for a re-rendezvous, is not gone: the
        # coordinator must not judge it lost before the verdict or the re-join.
        return reports + [
            MemberReport(r.member_id, r.secret, age=0.0)
            for r in self.ranks
            if self.state.reported_alive(r.index)
        ]

    def apply(self, event: AgentEvent) -> list[AwaitVerdict | RunEnd]:
        """Decide on ``event`` and carry out the actions but those the run's loop takes (returned).

        Every kind of action has its case: mypy fails on an :data:`Action` added without one."""
        self.state, actions = decide(self.state, event)
        rest: list[AwaitVerdict | RunEnd] = []
        for action in actions:
            match action:
                case Log(level=level, text=text):
                    log.log(level, "%s", text)
                case StopRanks(signum=signum):
                    self.stop_task = asyncio.ensure_future(self._stop(signum))
                case SignalRanks(signum=signal.SIGKILL):
                    self.background.add(
                        asyncio.ensure_future(kill_ranks(rank_processes(self.ranks), self.label))
                    )
                case SignalRanks(signum=signum):
                    signal_ranks(self.running(), signum)
                case ShowTail(index=index):
                    self.ranks[index].failed = True
                    self.background.add(asyncio.ensure_future(self._show_tail(self.ranks[index])))
                case ReportLeave():
                    self.background.add(asyncio.ensure_future(self._leave(action)))
                case HoldExit():
                    self._hold()
                case AwaitVerdict() | Restart() | Rejoin() | Exit():
                    rest.append(action)
                case _:
                    assert_never(action)
        return rest

    async def run(self) -> RunEnd:
        config, joined = self.agent.config, self.joined
        beats = asyncio.ensure_future(
            heartbeat(
                self.client, joined, self.reports, config.heartbeat_interval, self.events, self.label,
                lambda: bool(self.state.rerendezvous),
            )
        )  # fmt: skip
        with forward_signals(self.events):
            for r in self.ranks:
                env = rank_environment(
                    self.agent._environ, config, joined, r.index, self.restart_count, r.progress.path
                )
                started = await self._start(r, env)
                if isinstance(started, str):  # never ran: the decisions count it as exit 127
                    self.apply(SpawnFailed(r.index, started))
                    break
                r.proc = started
                r.seen_running = time.time()
                log.info(
                    "%s: started rank %d (process group %d): %s",
                    self.label,
                    r.rank,
                    started.pid,
                    " ".join(config.command),
                )
                r.output.start(started.stdout, started.stderr)
                self.apply(RankStarted(r.index))
                self.background.add(asyncio.ensure_future(wait_exit(r, self.events)))

            # A rank counts as exited once its exit is decided on, not when its process ended.
            while not self.state.settled:
                self.apply(await self.events.get())
        if self.verdict_timer is not None:
            self.verdict_timer.cancel()

        for action in self.apply(RanksDone()):
            if isinstance(action, AwaitVerdict):
                await self._await_verdict()
        beats.cancel()
        if self.stop_task is not None:
            self.background.add(self.stop_task)
        # Leave calls are bounded by the client's timeout; this bound only guards against a hang.
        done, pending = await asyncio.wait({beats, *self.background}, timeout=self.client.timeout + 5.0)
        for task in pending:
            task.cancel()
        log_failures(done, self.label)
        # Every line the ranks wrote is on the console and in the files before the last word.
        await asyncio.gather(*(r.output.drained() for r in self.ranks))
        for r in self.ranks:
            r.progress.close()
            await r.output.close()
            if r.proc is not None:
                r.proc.close()
        # What decide() answers to Finished, taken as its one end and the lines before it.
        lines, end = finish(self.state)
        for line in lines:
            log.log(line.level, "%s", line.text)
        return end

    async def _start(self, r: LocalRank, env: Mapping[str, str]) -> RankProcess | str:
        """Start rank ``r``'s process (its output files first); or why it could not be."""
        command = self.agent.config.command
        try:
            r.output.open_files()
        except OSError as exc:
            return f"could not open its output files: {exc}"
        problem = command_problem(command, env)
        try:
            if problem is not None:
                raise OSError(problem)
            # Through the launcher: the rank's whole process tree ends with this agent.
            return await RankProcess.start(launch_command(command), env)
        except OSError as exc:
            return f"could not start {shorten(command[0])}: {exc}"

    async def _leave(self, leave: ReportLeave) -> None:
        r, reason = self.ranks[leave.index], leave.reason
        if r.failed and r.output.files is not None:
            # Where to read all of it: shown by `status` and in the failure line of every rank.
            reason = f"{reason}; log: {self.agent._host}:{r.output.files[1]}"
        code = max(-255, min(255, leave.exit_code))
        try:
            state = await self.client.leave(r.member_id, r.secret, code, reason[:1024])
        except SarcommError as exc:
            log.warning("%s: could not report Leave of rank %d: %s", self.label, r.rank, exc)
        else:
            log.info("%s: rank %d left (%s); job is %s", self.label, r.rank, reason, state)

    async def _stop(self, signum: int) -> None:
        """Send ``signum`` to the running ranks' process groups; kill those left after the grace."""
        running = self.running()
        signal_ranks(running, signum)
        # A stopped (SIGSTOP) rank only acts on the signal once continued.
        signal_ranks(running, signal.SIGCONT)
        grace = self.agent.config.stop_grace
        processes = rank_processes(self.ranks)
        if not await wait_exits(processes.values(), grace):
            log.warning(
                "%s: rank(s) %s still running %g s after %s; killing them (SIGKILL to their whole "
                "process trees)",
                self.label, running_ranks(processes), grace, signal.Signals(signum).name,
            )  # fmt: skip
            await kill_ranks(processes, self.label)

    def _hold(self) -> None:
        """Send :class:`VerdictDue` once the coordinator had time to judge a lost peer (once)."""
        if self.verdict_timer is not None:
            return
        interval = self.joined.heartbeat_interval or DEFAULT_HEARTBEAT_INTERVAL
        wait = max(VERDICT_WAIT_S, (DEFAULT_HEARTBEAT_MISSES + 1) * interval)
        log.info(
            "%s: holding the failed rank's Leave up to %g s: a lost peer may be the cause", self.label, wait
        )
        loop = asyncio.get_running_loop()
        self.verdict_timer = loop.call_later(wait, self.events.put_nowait, VerdictDue())

    async def _show_tail(self, r: LocalRank) -> None:
        """Log the last lines ``r`` wrote (once its pipes ended, or after a bounded wait)."""
        await r.output.drained()
        stream, lines = r.output.tail()
        where = f"; all of it in {r.output.files[0]} and {r.output.files[1]}" if r.output.files else ""
        if not lines:
            log.error("%s: rank %d wrote no output%s", self.label, r.rank, where)
            return
        shown = "\n".join(f"    | {line}" for line in lines)
        log.error(
            "%s: last %d line(s) of rank %d's %s%s:\n%s", self.label, len(lines), r.rank, stream, where, shown
        )

    async def _await_verdict(self) -> None:
        """The verdict on a peer that failed first may still be on its way: report the local exits
        (the coordinator has announced the first failure before it answers them), then look at what
        the stream brought."""
        leaves = [task for task in self.background if not task.done()]
        if leaves:
            await asyncio.wait(leaves, timeout=self.client.timeout)
        await asyncio.sleep(min(0.2, self.agent.config.heartbeat_interval))
        while not self.events.empty():
            self.apply(self.events.get_nowait())


def log_failures(tasks: Iterable[asyncio.Task[None]], label: str) -> None:
    """Log each of the finished ``tasks`` that raised, with its traceback (a bug in the agent's own
    work, which must not end the run: the ranks' results are still reported)."""
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("%s: agent task failed", label, exc_info=error)
