"""The ``sar-worker`` agent: registers a host's local ranks, runs them, watches them.

One agent per host (or per group of local ranks):

1. checks its settings locally (``--socket-name`` exists here, ranks fit the world, ...);
2. reserves a TCP port for rank 0's store and joins the job with K members in one ``Join``;
3. releases the port and starts COMMAND once per local rank (``asyncio.create_subprocess_exec``:
   fork and exec happen in C, no Python code runs in a forked child of a process with gRPC
   threads), each in a new session so that a rank's own children can be signalled as a group;
4. keeps one heartbeat stream for all its ranks, forwards SIGINT/SIGTERM to them, reports
   ``Leave`` for each rank that exits;
5. stops its other ranks (SIGTERM, SIGKILL after a grace period) when a rank fails or the
   coordinator reports a failure elsewhere, and optionally joins again (``--max-restarts``).

The exit code is the command's: 0 when every rank exited 0, else the first failing rank's code
(128+N for a rank killed by signal N), or :data:`EXIT_PEER_FAILED` when a rank elsewhere failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sarcomm.common import netinfo
from sarcomm.common.addresses import host_port, validate_target
from sarcomm.common.client import CoordinatorClient
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import InvalidArgumentError, SarcommError, shorten
from sarcomm.common.messages import Event, JoinResult, MemberReport, Progress, paced_interval
from sarcomm.common.tls import ClientTls
from sarcomm.worker.progress import ProgressReader
from sarcomm.worker.startup import AGENT_PID_VARIABLE, BACKENDS, PROGRESS_FILE_VARIABLE

__all__ = [
    "EXIT_PEER_FAILED",
    "Agent",
    "AgentConfig",
    "AgentResult",
    "exit_code_of",
    "rank_environment",
]

log = logging.getLogger(__name__)

#: Exit code of an agent whose own ranks were fine but which stopped them because a rank on
#: another host failed.
EXIT_PEER_FAILED = 1

# Interface variables of the backends; all get the interface the coordinator chose.
_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "CCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class AgentConfig:
    """Settings of one agent, validated when built (messages name the flag, value and rule).

    Attributes:
        coord: coordinator address ``HOST:PORT``.
        job: job name.
        world_size: ranks in the whole job (>= 1).
        command: the program and arguments each local rank runs (empty only for subcommands).
        rank: global rank of local rank 0 (its ranks are ``rank..rank+nproc_per_node-1``);
            None lets the coordinator deal them (contiguous per host).
        nproc_per_node: local ranks this agent runs (1..world_size).
        backend: torch.distributed backend the ranks use (one of ``BACKENDS``).
        socket_name: interface to force ("" lets the coordinator choose).
        max_restarts: how often to join again and restart after a failure (default 0).
        metrics_port: where the ranks serve /metrics: P > 0 gives local rank i port P+i, 0 (the
            default) any free port, -1 no endpoint. The agent reports each bound port to the
            coordinator, which lists it in ``/sd``.
        join_timeout: seconds to wait for the world to form (None: the coordinator's default).
        heartbeat_interval: seconds between heartbeats (default 1; keep it at or below the
            coordinator's ``--heartbeat-interval``).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping ranks (default 10).
        token: bearer token for the coordinator, or None.
        tls: TLS settings for the coordinator connection (``--tls-ca``, ``--tls-cert``,
            ``--tls-key``), or None for plaintext.
    """

    coord: str
    job: str
    world_size: int
    command: tuple[str, ...] = ()
    rank: int | None = None
    nproc_per_node: int = 1
    backend: str = "auto"
    socket_name: str = ""
    max_restarts: int = 0
    metrics_port: int = 0
    join_timeout: float | None = None
    heartbeat_interval: float = 1.0
    stop_grace: float = 10.0
    token: str | None = field(default=None, repr=False)
    tls: ClientTls | None = None

    def __post_init__(self) -> None:
        validate_target(self.coord)
        if not self.job:
            raise InvalidArgumentError(
                "--job '' must name the job (1 to 128 letters, digits, '.', '_', '-')."
            )
        if self.world_size < 1:
            raise InvalidArgumentError(f"--world-size {self.world_size} must be an integer >= 1.")
        if not 1 <= self.nproc_per_node <= self.world_size:
            raise InvalidArgumentError(
                f"--nproc-per-node {self.nproc_per_node} must be in 1..--world-size ({self.world_size})."
            )
        if self.rank is not None and not 0 <= self.rank <= self.world_size - self.nproc_per_node:
            raise InvalidArgumentError(
                f"--rank {self.rank} must be in 0..{self.world_size - self.nproc_per_node}: the ranks "
                f"{self.rank}..{self.rank + self.nproc_per_node - 1} of this host's {self.nproc_per_node} "
                f"local ranks must fit in --world-size {self.world_size}."
            )
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                f"--backend {shorten(self.backend)} must be one of {', '.join(BACKENDS)}."
            )
        if self.max_restarts < 0:
            raise InvalidArgumentError(f"--max-restarts {self.max_restarts} must be an integer >= 0.")
        if self.metrics_port not in (METRICS_ANY_PORT, METRICS_OFF) and not (
            1 <= self.metrics_port <= 65536 - self.nproc_per_node
        ):
            raise InvalidArgumentError(
                f"--metrics-port {self.metrics_port} must be -1 (no metrics), 0 (any free port) or in "
                f"1..{65536 - self.nproc_per_node}, so that port + local rank stays a TCP port."
            )
        if self.join_timeout is not None and not self.join_timeout > 0:
            raise InvalidArgumentError(
                f"--join-timeout {self.join_timeout} must be a positive number of seconds."
            )
        if not self.heartbeat_interval > 0:
            raise InvalidArgumentError(
                f"--heartbeat-interval {self.heartbeat_interval} must be a positive number of seconds."
            )
        if not self.stop_grace >= 0:
            raise InvalidArgumentError(f"stop_grace {self.stop_grace} must be a number of seconds >= 0.")

    @property
    def ranks(self) -> list[int] | None:
        """Requested global ranks of the local ranks, or None."""
        return None if self.rank is None else list(range(self.rank, self.rank + self.nproc_per_node))


@dataclass(frozen=True)
class AgentResult:
    """How a run ended: the exit code, and one line naming the failure ("" on success)."""

    exit_code: int
    message: str = ""


def exit_code_of(returncode: int) -> int:
    """A process exit code as a shell reports it: the code, or 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


#: ``--metrics-port`` values with a meaning of their own.
METRICS_ANY_PORT = 0
METRICS_OFF = -1


def rank_metrics_port(first_port: int, local_rank: int) -> int:
    """``SAR_METRICS_PORT`` of a local rank: ``first_port + local_rank`` for a fixed first port,
    else ``first_port`` itself (0: any free port, -1: none)."""
    return first_port + local_rank if first_port > 0 else first_port


def omp_threads(local_ranks: int) -> int:
    """Intra-op threads per rank when the user set no ``OMP_NUM_THREADS``: this host's usable CPUs
    shared among its local ranks (at least 1).

    Without it every rank starts one OpenMP thread per CPU, and ranks that share a host
    oversubscribe it: OpenMP's spin-waiting then stalls the copies around collectives for tens of
    milliseconds (measured with 4 ranks on 2 cores: a 1 MiB all_to_all took 55 to 120 ms instead
    of 2 ms). torchrun guards against the same by setting 1.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_ranks))


def rank_environment(
    base: Mapping[str, str],
    config: AgentConfig,
    joined: JoinResult,
    index: int,
    restart_count: int,
    progress_file: Path | None = None,
) -> dict[str, str]:
    """The environment of local rank ``index``: ``base`` plus the contract's variables.

    Besides the contract's variables: ``SAR_MEMBER_ID``/``SAR_MEMBER_SECRET`` (the rank's identity
    at the coordinator), ``SAR_RESTART_COUNT``, ``SAR_METRICS_PORT`` (see :func:`rank_metrics_port`),
    ``SARCOMM_HEARTBEAT_INTERVAL`` (how often the rank's library stamps its progress record),
    ``SAR_AGENT_PID`` (the agent: a rank whose agent is gone stops, see
    :data:`~sarcomm.worker.startup.AGENT_PID_VARIABLE`), ``OMP_NUM_THREADS`` unless set (see
    :func:`omp_threads`) and,
    when given, ``SAR_PROGRESS_FILE`` (where it keeps that record for the agent to read).
    """
    member = joined.assignments[index]
    env = dict(base)
    env.update(
        {
            "RANK": str(member.rank),
            "WORLD_SIZE": str(joined.world_size),
            "LOCAL_RANK": str(member.local_rank),
            "LOCAL_WORLD_SIZE": str(member.local_world_size),
            "MASTER_ADDR": joined.master_addr,
            "MASTER_PORT": str(joined.master_port),
            "SAR_COORD": config.coord,
            "SAR_JOB": joined.job,
            "SAR_GENERATION": str(joined.generation),
            "SAR_BACKEND": config.backend,
            "SAR_SOCKET_NAME": joined.interface,
            "SAR_MEMBER_ID": member.member_id,
            "SAR_MEMBER_SECRET": member.secret,
            "SAR_RESTART_COUNT": str(restart_count),
            "SAR_METRICS_PORT": str(rank_metrics_port(config.metrics_port, member.local_rank)),
            "SARCOMM_HEARTBEAT_INTERVAL": str(config.heartbeat_interval),
            AGENT_PID_VARIABLE: str(os.getpid()),
        }
    )
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(omp_threads(config.nproc_per_node))
    if progress_file is not None:
        env[PROGRESS_FILE_VARIABLE] = str(progress_file)
    env.update({name: joined.interface for name in _IFNAME_VARIABLES})
    return env


class _Why(enum.Enum):
    """Why the agent is stopping its ranks."""

    RANK_FAILED = "a local rank failed"
    PEER_FAILED = "the coordinator reported a failed rank"
    SIGNAL = "the agent got a signal"


@dataclass
class _Rank:
    index: int
    rank: int
    member_id: str
    secret: str = field(repr=False)
    #: This rank's address on its interface: where its /metrics endpoint is reachable.
    address: str
    progress: ProgressReader
    proc: asyncio.subprocess.Process | None = None
    returncode: int | None = None
    stale: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    def report(self, now: float, stale_after: float, label: str = "") -> MemberReport:
        """This rank's heartbeat report, with the age of its own last sign of life.

        A rank whose library keeps a progress record is reported with its progress and the age of
        the record's alive stamp: a rank that is stopped or wedged (its process exists, so the agent
        is fine) stops stamping, its age grows, and the coordinator judges it by the same
        interval x misses rule as a silent reporter, counted from the rank's own last stamp. Once
        the age passes ``stale_after`` the agent logs it. A rank without a record (a program that
        does not use sarcomm's library) is alive while its process is (age 0).
        """
        record = self.progress.read()
        if record is None:
            return MemberReport(self.member_id, self.secret)
        # A stamp in the future vouches for an exiting rank (see startup.EXIT_GRACE_S).
        age = max(0.0, now - record.stamp)
        if age > stale_after:
            if not self.stale:
                self.stale = True
                log.warning(
                    "%s: rank %d has not stamped its progress for %.1f s (last in %s #%d); it is stopped "
                    "or wedged", label, self.rank, age, record.op or "no collective", record.seq,
                )  # fmt: skip
        elif self.stale:
            self.stale = False
            log.info("%s: rank %d stamps its progress again", label, self.rank)
        progress = Progress(record.seq, record.op, record.in_collective, record.since)
        # The rank binds its metrics port itself (possibly any free one) and notes it in the record.
        metrics_address = host_port(self.address, record.metrics_port) if record.metrics_port else ""
        return MemberReport(self.member_id, self.secret, progress, metrics_address, age)


@dataclass(frozen=True)
class _Exited:
    rank: _Rank
    returncode: int


@dataclass(frozen=True)
class _PeerFailed:
    event: Event


@dataclass(frozen=True)
class _Signalled:
    signum: int


@dataclass(frozen=True)
class _Failure:
    exit_code: int
    message: str


_Happening = _Exited | _PeerFailed | _Signalled


class Agent:
    """Runs one ``sar-worker``; ``await Agent(config).run()`` returns an :class:`AgentResult`.

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

    async def run(self) -> AgentResult:
        """Join, run the ranks, restart up to ``max_restarts`` times after a failure.

        Raises:
            InvalidArgumentError: ``--socket-name`` is not an interface of this host, or the
                coordinator refused a field.
            SarcommError: the coordinator refused or could not be reached (its subclasses).
        """
        config = self.config
        if config.socket_name:
            netinfo.check_socket_name(config.socket_name, host=self._host)
        generation = 0
        restarts = 0
        async with CoordinatorClient(config.coord, config.token, tls=config.tls) as client:
            while True:
                joined = await self._join(client, generation)
                self._follow_coordinator_interval(joined)
                result, restartable = await self._run_generation(client, joined, restarts)
                if result.exit_code == 0 or not restartable or restarts >= config.max_restarts:
                    return result
                restarts += 1
                # The coordinator forms the next world under the next generation number; asking for
                # it (not 0) keeps this host out of any later world if it falls behind.
                generation = joined.generation + 1
                log.warning(
                    "job=%s ranks=%s generation=%d: %s; restart %d of %d, joining generation %d",
                    config.job, list(joined.ranks), joined.generation, result.message, restarts,
                    config.max_restarts, generation,
                )  # fmt: skip

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

    async def _join(self, client: CoordinatorClient, generation: int) -> JoinResult:
        config = self.config
        # Held from before Join until just before the ranks start, so no other process takes the
        # port that rank 0's TCPStore will listen on if rank 0 lands here.
        reservation = netinfo.reserve_port("")
        try:
            return await client.join_many(
                config.job,
                config.world_size,
                nproc=config.nproc_per_node,
                ranks=config.ranks,
                host=self._host,
                socket_name=config.socket_name,
                store_port=int(reservation.getsockname()[1]),
                generation=generation,
                join_timeout=config.join_timeout,
                backend=config.backend,
                max_restarts=config.max_restarts,
            )
        finally:
            reservation.close()

    async def _run_generation(
        self, client: CoordinatorClient, joined: JoinResult, restarts: int
    ) -> tuple[AgentResult, bool]:
        """Run one generation's ranks to the end; returns the result and whether a restart may help."""
        label = f"job={joined.job} ranks={list(joined.ranks)} generation={joined.generation}"
        with tempfile.TemporaryDirectory(prefix=f"sar-worker-{joined.job}-") as progress_dir:
            return await self._run_ranks(client, joined, restarts, label, Path(progress_dir))

    async def _run_ranks(
        self, client: CoordinatorClient, joined: JoinResult, restarts: int, label: str, progress_dir: Path
    ) -> tuple[AgentResult, bool]:
        config = self.config
        restart_count = max(restarts, joined.restart_count)
        ranks = [
            _Rank(
                index=i,
                rank=a.rank,
                member_id=a.member_id,
                secret=a.secret,
                address=a.address,
                progress=ProgressReader(progress_dir / f"rank{a.rank}.progress"),
            )
            for i, a in enumerate(joined.assignments)
        ]
        # The rank's library stamps every interval; past two missed stamps the agent logs it (the
        # coordinator judges it, by the age each report carries).
        stale_after = 3 * config.heartbeat_interval
        happenings: asyncio.Queue[_Happening] = asyncio.Queue()
        background: set[asyncio.Task[None]] = set()
        failure: _Failure | None = None  # the first failure: it decides the exit code
        # Whether `failure` blames a local rank's own exit. A peer's death fails gloo collectives
        # at once ("Connection closed by peer"), so a local rank may exit before the coordinator's
        # verdict on that peer arrives; the coordinator announces only a generation's first failure,
        # so a MEMBER_FAILED naming another host's rank means that rank was the cause.
        local_blame = False
        stopping: _Why | None = None
        interrupted: int | None = None  # the signal the agent got, if any
        stop_task: asyncio.Task[None] | None = None

        def reports() -> list[MemberReport]:
            now = time.time()
            return [r.report(now, stale_after, label) for r in ranks if r.running]

        def begin_stop(why: _Why, signum: int = signal.SIGTERM) -> None:
            nonlocal stopping, stop_task
            if stopping is None:
                stopping = why
                stop_task = asyncio.ensure_future(self._stop(ranks, signum, label))

        def leave(r: _Rank, code: int, reason: str) -> None:
            background.add(asyncio.ensure_future(self._leave(client, r, code, reason, label)))

        heartbeat = asyncio.ensure_future(self._heartbeat(client, joined, reports, happenings, label))
        with _forward_signals(happenings):
            for r in ranks:
                env = rank_environment(self._environ, config, joined, r.index, restart_count, r.progress.path)
                try:
                    r.proc = await asyncio.create_subprocess_exec(
                        *config.command, env=env, start_new_session=True
                    )
                except OSError as exc:
                    reason = f"could not start {shorten(config.command[0])}: {exc}"
                    failure = _Failure(
                        127,
                        f"job {joined.job} generation {joined.generation}: rank {r.rank} on host "
                        f"{self._host} failed: {reason}",
                    )
                    log.error("%s: rank %d %s", label, r.rank, reason)
                    # The rank never ran; reporting it failed makes the other hosts stop too.
                    r.proc, r.returncode = None, 127
                    leave(r, 127, reason)
                    begin_stop(_Why.RANK_FAILED)
                    break
                log.info(
                    "%s: started rank %d (pid %d): %s", label, r.rank, r.proc.pid, " ".join(config.command)
                )
                background.add(asyncio.ensure_future(_wait_exit(r, happenings)))

            while any(r.running for r in ranks):
                item = await happenings.get()
                if isinstance(item, _Exited):
                    r, code = item.rank, item.returncode
                    r.returncode = code
                    reason = _describe_exit(code)
                    if code == 0:
                        log.info("%s: rank %d exited with code 0", label, r.rank)
                    elif stopping in (_Why.RANK_FAILED, _Why.PEER_FAILED):
                        reason = f"{reason}, stopped by sar-worker because {stopping.value}"
                        log.info("%s: rank %d %s", label, r.rank, reason)
                    else:
                        log.error("%s: rank %d on host %s %s", label, r.rank, self._host, reason)
                        if failure is None:
                            failure = _Failure(
                                exit_code_of(code),
                                f"job {joined.job} generation {joined.generation}: rank {r.rank} on host "
                                f"{self._host} failed: {reason}",
                            )
                            local_blame = True
                        begin_stop(_Why.RANK_FAILED)
                    leave(r, code, reason)
                elif isinstance(item, _PeerFailed):
                    if failure is None and stopping is None:
                        event = item.event
                        what = (
                            event.describe()
                            if event.kind is EventKind.MEMBER_FAILED
                            else f"the job failed: {event.reason or 'no reason given'}"
                        )
                        stopped = ", ".join(str(r.rank) for r in ranks if r.running)
                        failure = _Failure(
                            EXIT_PEER_FAILED,
                            f"job {joined.job} generation {joined.generation}: {what}; "
                            f"stopped local rank(s) {stopped}",
                        )
                        log.error("%s: %s; stopping local rank(s) %s", label, what, stopped)
                        begin_stop(_Why.PEER_FAILED)
                    elif local_blame and (cause := self._caused_elsewhere(item.event, ranks, joined)):
                        failure, local_blame = cause, False
                        log.error("%s: %s", label, cause.message)
                else:
                    name = signal.Signals(item.signum).name
                    if interrupted is not None:
                        # A second signal: the user is in a hurry.
                        log.warning("%s: got %s again; killing the ranks", label, name)
                        _signal_ranks(ranks, signal.SIGKILL)
                    else:
                        interrupted = item.signum
                        log.warning("%s: got %s; forwarding it to the ranks", label, name)
                        if stopping is None:
                            begin_stop(_Why.SIGNAL, item.signum)
                        else:
                            _signal_ranks(ranks, item.signum)

        if local_blame and interrupted is None:
            # The verdict on a peer that failed first may still be on its way: report the local
            # exits (the coordinator has announced the first failure before it answers them), then
            # look at what the stream brought.
            leaves = [task for task in background if not task.done()]
            if leaves:
                await asyncio.wait(leaves, timeout=client.timeout)
            await asyncio.sleep(min(0.2, config.heartbeat_interval))
            while not happenings.empty():
                item = happenings.get_nowait()
                if not isinstance(item, _PeerFailed):
                    continue
                cause = self._caused_elsewhere(item.event, ranks, joined)
                if cause is not None:
                    failure = cause
                    log.error("%s: %s", label, cause.message)
                    break
        heartbeat.cancel()
        if stop_task is not None:
            background.add(stop_task)
        # Leave calls are bounded by the client's timeout; this bound only guards against a hang.
        done, pending = await asyncio.wait({heartbeat, *background}, timeout=client.timeout + 5.0)
        for task in pending:
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s: agent task failed: %r", label, task.exception())

        for r in ranks:
            r.progress.close()
        if failure is not None:
            return AgentResult(failure.exit_code, failure.message), interrupted is None
        log.info("%s: every local rank exited with code 0", label)
        return AgentResult(0), False

    def _caused_elsewhere(self, event: Event, ranks: Sequence[_Rank], joined: JoinResult) -> _Failure | None:
        """The failure to report instead of a local rank's own exit, when the coordinator names a
        rank of another host as its generation's first failure; None otherwise."""
        local = {r.rank for r in ranks}
        if event.kind is not EventKind.MEMBER_FAILED or event.rank < 0 or event.rank in local:
            return None
        failed = ", ".join(str(r.rank) for r in ranks if r.returncode not in (None, 0))
        return _Failure(
            EXIT_PEER_FAILED,
            f"job {joined.job} generation {joined.generation}: {event.describe()}; local rank(s) "
            f"{failed} failed after it",
        )

    async def _heartbeat(
        self,
        client: CoordinatorClient,
        joined: JoinResult,
        reports: Callable[[], Sequence[MemberReport]],
        happenings: asyncio.Queue[_Happening],
        label: str,
    ) -> None:
        """One stream for all local ranks; failures of this generation go to ``happenings``."""
        mine = {a.member_id for a in joined.assignments}
        warned_unknown = False
        try:
            async with client.heartbeats(reports, self.config.heartbeat_interval) as stream:
                async for reply in stream:
                    for event in reply.events:
                        if (
                            event.job == joined.job
                            and event.generation == joined.generation
                            and event.kind in (EventKind.MEMBER_FAILED, EventKind.JOB_FAILED)
                        ):
                            happenings.put_nowait(_PeerFailed(event))
                    unknown = mine.intersection(reply.unknown_members)
                    if unknown and not warned_unknown:
                        warned_unknown = True
                        log.warning(
                            "%s: the coordinator no longer knows %d local member(s); ranks keep running",
                            label, len(unknown),
                        )  # fmt: skip
        except SarcommError as exc:
            # Collectives do not depend on the coordinator: the ranks keep running without it.
            log.error("%s: heartbeats stopped: %s; ranks keep running", label, exc)
        except Exception:  # a bug here must not take the ranks down; the coordinator will notice
            log.exception("%s: heartbeats stopped; ranks keep running", label)

    async def _leave(self, client: CoordinatorClient, r: _Rank, code: int, reason: str, label: str) -> None:
        try:
            state = await client.leave(r.member_id, r.secret, max(-255, min(255, code)), reason[:1024])
        except SarcommError as exc:
            log.warning("%s: could not report Leave of rank %d: %s", label, r.rank, exc)
        else:
            log.info("%s: rank %d left (%s); job is %s", label, r.rank, reason, state)

    async def _stop(self, ranks: Sequence[_Rank], signum: int, label: str) -> None:
        """Send ``signum`` to the running ranks' process groups; SIGKILL those left after the grace."""
        _signal_ranks(ranks, signum)
        # A stopped (SIGSTOP) rank only acts on the signal once continued.
        _signal_ranks(ranks, signal.SIGCONT)
        waits = [asyncio.ensure_future(r.proc.wait()) for r in ranks if r.running and r.proc is not None]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=self.config.stop_grace)
        if pending:
            stubborn = [r.rank for r in ranks if r.running]
            log.warning(
                "%s: rank(s) %s still running %g s after %s; sending SIGKILL",
                label, stubborn, self.config.stop_grace, signal.Signals(signum).name,
            )  # fmt: skip
            _signal_ranks(ranks, signal.SIGKILL)
            await asyncio.wait(pending, timeout=10.0)
            for task in pending:
                task.cancel()


async def _wait_exit(r: _Rank, happenings: asyncio.Queue[_Happening]) -> None:
    if r.proc is not None:
        happenings.put_nowait(_Exited(r, await r.proc.wait()))


def _signal_ranks(ranks: Sequence[_Rank], signum: int) -> None:
    """Signal each running rank's process group (the rank and the children it started)."""
    for r in ranks:
        if r.running and r.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.proc.pid, signum)


@contextlib.contextmanager
def _forward_signals(happenings: asyncio.Queue[_Happening]) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into queue items while the ranks run; restore handlers afterwards."""
    loop = asyncio.get_running_loop()
    installed: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, happenings.put_nowait, _Signalled(signum))
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no such API
            log.debug("cannot handle signal %d here; it keeps its default action", signum)
        else:
            installed.append(signum)
    try:
        yield
    finally:
        for installed_signum in installed:
            loop.remove_signal_handler(installed_signum)
