"""Start-up of a rank: from a launcher's environment, or by registering with the coordinator.

Two entry points:

- :func:`coord_ip_init` is the drop-in for SAR's ``nfs_ip_init(rank, ip_file)``: the process joins
  its job at the coordinator (asking for ``rank``), exports ``MASTER_ADDR``/``MASTER_PORT`` and the
  ``SAR_*`` variables, and returns the master address for ``initialize_comms``.
- :func:`init` reads what ``sar-worker`` set, or else the torchrun, Open MPI, MPICH/PMI or Slurm
  variables (:func:`parse_launch_env`), or registers the process itself when given a coordinator,
  and then initialises ``torch.distributed`` through :func:`sarcomm.worker.comm.initialize_comms`.

A process that registered itself (no agent) is kept alive at the coordinator by a heartbeat
stream running on a private event-loop thread, carrying the progress its collectives note; it
reports ``Leave`` when the interpreter exits (exit code 1 after an uncaught exception, else 0). A
failure of another rank that the heartbeats report is logged, kept for :func:`peer_failure` and
handed to :func:`sarcomm.worker.comm.mark_peer_failed`, so that the next collective, and one already
waiting, raises :class:`~sarcomm.common.errors.PeerFailedError` instead of waiting for a peer
that is gone.

Under ``sar-worker``, :func:`init` keeps the progress record the agent reads
(``SAR_PROGRESS_FILE``, stamped every ``SARCOMM_HEARTBEAT_INTERVAL`` seconds); the agent stops the
ranks itself when a peer fails, and a rank whose agent is gone (``SAR_AGENT_PID``) stops itself.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from sarcomm.common.addresses import host_port, validate_target
from sarcomm.common.client import CoordinatorClient, HeartbeatStream
from sarcomm.common.constants import DEFAULT_JOIN_TIMEOUT, EventKind
from sarcomm.common.errors import InvalidArgumentError, PeerFailedError, SarcommError, shorten
from sarcomm.common.messages import JoinResult, MemberReport, Progress, paced_interval
from sarcomm.common.tls import ClientTls, read_token_file
from sarcomm.worker.progress import ProgressWriter

__all__ = [
    "AGENT_PID_VARIABLE",
    "BACKENDS",
    "METRICS_PORT_VARIABLE",
    "PROGRESS_FILE_VARIABLE",
    "LaunchEnv",
    "WorkerInfo",
    "coord_ip_init",
    "detect_launcher",
    "init",
    "metrics_port_setting",
    "parse_launch_env",
    "peer_failure",
    "peer_verdict_wait",
    "start_rank_services",
]

log = logging.getLogger(__name__)

#: Backends ``SAR_BACKEND`` / ``backend=`` may name; "auto" lets ``initialize_comms`` choose.
BACKENDS = ("auto", "gloo", "nccl", "ccl", "mpi", "ucc")

#: Where ``sar-worker`` tells a rank to keep its progress record (a small memory-mapped file it
#: reads every heartbeat interval); see :mod:`sarcomm.worker.progress`.
PROGRESS_FILE_VARIABLE = "SAR_PROGRESS_FILE"
#: The port a rank serves ``/metrics`` on; see :func:`metrics_port_setting`.
METRICS_PORT_VARIABLE = "SAR_METRICS_PORT"
#: The pid of the ``sar-worker`` that started a rank. Ranks run in sessions of their own (so the
#: agent can signal each rank's process group), so they outlive an agent that is killed; a rank
#: whose agent is gone stops itself (SIGTERM) instead of running on unwatched.
AGENT_PID_VARIABLE = "SAR_AGENT_PID"

#: Seconds between heartbeats of a self-registered process when neither the ``heartbeat_interval``
#: argument nor ``SARCOMM_HEARTBEAT_INTERVAL`` says otherwise (the coordinator's default).
DEFAULT_HEARTBEAT_INTERVAL = 1.0

_T = TypeVar("_T")


@dataclass(frozen=True)
class WorkerInfo:
    """Who this process is in its job.

    ``backend`` is the one ``torch.distributed`` was initialised with (after "auto" was resolved)
    when :func:`init` initialised it, else the requested one. ``generation`` is the coordinator's
    world generation (0 when no coordinator is involved); ``job`` is "" then too.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    generation: int
    job: str
    restart_count: int


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher's environment says, validated; see :func:`parse_launch_env`.

    ``launcher`` is one of "sar-worker", "torchrun", "env" (RANK/WORLD_SIZE set by hand),
    "openmpi", "mpich", "slurm". ``master_addr``/``master_port`` are None when MASTER_ADDR/
    MASTER_PORT are not set (MPI and Slurm do not set them); ``backend`` is None without
    SAR_BACKEND; ``coord`` is None without SAR_COORD.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    generation: int = 0
    job: str = ""
    restart_count: int = 0
    coord: str | None = None


# (launcher, rank, world size, local rank, local world size) variable names, in detection order.
_LAUNCHERS: tuple[tuple[str, str, str, str, str], ...] = (
    ("env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)  # fmt: skip


def detect_launcher(env: Mapping[str, str]) -> str | None:
    """Which launcher started this process, judged from ``env``; None when none did.

    RANK wins (sar-worker when SAR_JOB or SAR_MEMBER_ID is set too, torchrun when LOCAL_RANK or
    TORCHELASTIC_RUN_ID is, else "env"), then Open MPI, MPICH/PMI and Slurm, in that order: a
    launcher run inside another (torchrun inside an ``srun`` step) sets the inner variables.
    """
    if "RANK" in env:
        if "SAR_JOB" in env or "SAR_MEMBER_ID" in env:
            return "sar-worker"
        if "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env:
            return "torchrun"
        return "env"
    for launcher, rank_var, *_ in _LAUNCHERS[1:]:
        if rank_var in env:
            return launcher
    return None


def _parse_int(env: Mapping[str, str], var: str, low: int, high: int | None, rule: str) -> int:
    text = env[var]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise InvalidArgumentError(f"{var}={shorten(text)} must be {rule}.")
    return value


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks on this node from SLURM_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID, or None."""
    spec, node = env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if spec is None or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise InvalidArgumentError(
                f"SLURM_TASKS_PER_NODE={shorten(spec)} must be a list like '2(x3),1' (tasks per node)."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    index = _parse_int(env, "SLURM_NODEID", 0, len(counts) - 1, f"an integer in 0..{len(counts) - 1}")
    return counts[index]


def _parse_local(
    env: Mapping[str, str],
    launcher: str,
    size_var: str,
    world_size: int,
    local_rank_var: str,
    local_size_var: str,
) -> tuple[int, int]:
    """Local rank and local world size; without local variables a process is alone on its host."""
    local_size: int | None = None
    size_source = local_size_var
    if local_size_var in env:
        local_size = _parse_int(
            env, local_size_var, 1, world_size, f"an integer in 1..{size_var} ({size_var}={world_size})"
        )
    elif launcher == "slurm":
        local_size = _slurm_local_size(env)
        size_source = "SLURM_TASKS_PER_NODE"
    if local_rank_var not in env:
        if local_size not in (None, 1):
            raise InvalidArgumentError(
                f"{local_rank_var} is not set although {size_source} says this host runs {local_size} "
                "ranks; set both."
            )
        return 0, 1
    if local_size is None:
        raise InvalidArgumentError(
            f"{local_size_var} is not set although {local_rank_var} is; set both "
            "(torchrun and sar-worker do)."
        )
    local_rank = _parse_int(
        env, local_rank_var, 0, local_size - 1,
        f"an integer in 0..{local_size_var}-1 ({local_size_var}={local_size})",
    )  # fmt: skip
    return local_rank, local_size


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Rank, world size, local rank and size, master and ``SAR_*`` settings from ``env``.

    Pure: reads only ``env``. Rules: the world size is an integer >= 1, the rank one in
    0..world_size-1, the local world size one in 1..world_size, the local rank one in
    0..local_world_size-1 (without local variables, a process counts as alone on its host: 0 of
    1); MASTER_PORT is an integer in 1..65535, MASTER_ADDR is not empty; SAR_GENERATION and
    SAR_RESTART_COUNT are integers >= 0; SAR_BACKEND is one of :data:`BACKENDS`.

    Raises:
        InvalidArgumentError: no launcher's variables are set, one is missing, or a value breaks
            its rule; the message names the variable, its value and the rule, e.g.
            ``RANK='x' must be an integer in 0..WORLD_SIZE-1 (WORLD_SIZE=4).``
    """
    launcher = detect_launcher(env)
    if launcher is None:
        raise InvalidArgumentError(
            "No launcher variables are set: RANK and WORLD_SIZE (sar-worker, torchrun), "
            "OMPI_COMM_WORLD_RANK (Open MPI), PMI_RANK (MPICH) or SLURM_PROCID (Slurm). Start the "
            "process with one of them, or register it with a coordinator: init(coord=..., job=..., "
            "world_size=...)."
        )
    names = next(
        n for n in _LAUNCHERS if n[0] == ("env" if launcher in ("sar-worker", "torchrun") else launcher)
    )
    _, rank_var, size_var, local_rank_var, local_size_var = names
    if size_var not in env:
        raise InvalidArgumentError(f"{size_var} is not set although {rank_var} is; a launcher sets both.")
    world_size = _parse_int(env, size_var, 1, None, "an integer >= 1")
    rank = _parse_int(
        env, rank_var, 0, world_size - 1, f"an integer in 0..{size_var}-1 ({size_var}={world_size})"
    )
    local_rank, local_size = _parse_local(env, launcher, size_var, world_size, local_rank_var, local_size_var)
    master_addr = env.get("MASTER_ADDR")
    if master_addr is not None and not master_addr.strip():
        raise InvalidArgumentError("MASTER_ADDR='' must be the host name or address of rank 0.")
    master_port = (
        _parse_int(env, "MASTER_PORT", 1, 65535, "an integer in 1..65535 (a TCP port)")
        if "MASTER_PORT" in env
        else None
    )
    backend = env.get("SAR_BACKEND")
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"SAR_BACKEND={shorten(backend)} must be one of {', '.join(BACKENDS)}.")
    generation = (
        _parse_int(env, "SAR_GENERATION", 0, None, "an integer >= 0") if "SAR_GENERATION" in env else 0
    )
    restarts = (
        _parse_int(env, "SAR_RESTART_COUNT", 0, None, "an integer >= 0") if "SAR_RESTART_COUNT" in env else 0
    )
    return LaunchEnv(
        launcher=launcher,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_size,
        master_addr=master_addr.strip() if master_addr is not None else None,
        master_port=master_port,
        backend=backend,
        generation=generation,
        job=env.get("SAR_JOB", ""),
        restart_count=restarts,
        coord=env.get("SAR_COORD") or None,
    )


# -- running the async client from sync code --------------------------------------------------------


class _LoopThread:
    """A private event loop on a daemon thread, for the client calls and the heartbeat stream.

    gRPC's asyncio channels belong to one loop, and a self-registered process needs its
    heartbeats to keep flowing while the main thread trains; a loop of its own does both, and
    works whether or not the caller already runs an event loop.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``coro`` on the loop; block until it is done or ``timeout`` seconds passed.

        Raises:
            TimeoutError: ``timeout`` passed (the coroutine is cancelled), or what ``coro`` raised.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"a coordinator call did not finish within {timeout:g} s") from None

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class _Registration:
    """A process registered with the coordinator by itself: its heartbeats and its ``Leave``."""

    def __init__(
        self,
        coord: str,
        token: str | None,
        heartbeat_interval: float,
        tls: ClientTls | None = None,
    ) -> None:
        self._thread = _LoopThread("sarcomm-coordinator")
        self._client = CoordinatorClient(coord, token, tls=tls)
        self._interval = heartbeat_interval
        self._stream: HeartbeatStream | None = None
        self._watcher: concurrent.futures.Future[None] | None = None
        self._closed = False
        self.result: JoinResult | None = None
        self.failure: PeerFailedError | None = None
        self._uncaught: BaseException | None = None
        # A forked child (a DataLoader worker) inherits the atexit hook but is not the member.
        self._pid = os.getpid()

    @property
    def client_timeout(self) -> float:
        return self._client.timeout

    @property
    def interval(self) -> float:
        return self._interval

    def join(self, deadline: float, **kwargs: Any) -> JoinResult:
        async def _join() -> JoinResult:
            self._client.open()
            return await self._client.join_many(**kwargs)

        # The client's own deadline ends the call first; the margin only guards against a hang.
        self.result = self._thread.run(_join(), deadline + 10.0)
        return self.result

    def start_heartbeats(self, result: JoinResult, progress: ProgressWriter) -> None:
        """Heartbeat for the joined member, with the progress the collectives note in ``progress``."""
        member = result.assignments[0]

        def reports() -> list[MemberReport]:
            seq, op, in_collective, since = progress.current  # one tuple, swapped whole by the writer
            port = progress.metrics_port
            metrics_address = host_port(member.address, port) if port else ""
            return [
                MemberReport(
                    member.member_id, member.secret, Progress(seq, op, in_collective, since), metrics_address
                )
            ]

        self._interval = paced_interval(self._interval, result.heartbeat_interval)
        self._stream = self._client.heartbeats(reports, self._interval)
        self._watcher = self._thread.submit(self._watch(self._stream, result))
        self._install_hooks()

    async def _watch(self, stream: HeartbeatStream, result: JoinResult) -> None:
        member = result.assignments[0]
        job, rank, generation = result.job, member.rank, result.generation
        async with stream:
            try:
                async for reply in stream:
                    if member.member_id in reply.unknown_members:
                        log.warning(
                            "job=%s rank=%d generation=%d: the coordinator no longer knows this member "
                            "(its job ended); heartbeats stop", job, rank, generation,
                        )  # fmt: skip
                        return
                    for event in reply.events:
                        if (
                            event.job == job
                            and event.generation == generation
                            and event.kind in (EventKind.MEMBER_FAILED, EventKind.JOB_FAILED)
                            and self.failure is None
                        ):
                            self.failure = PeerFailedError(
                                f"job {job} generation {generation}: {event.describe()}",
                                rank=event.rank if event.rank >= 0 else None,
                                host=event.host,
                                reason=event.reason,
                            )
                            log.error("job=%s rank=%d generation=%d: %s", job, rank, generation, self.failure)
                            comm = sys.modules.get("sarcomm.worker.comm")
                            if comm is not None:
                                # Collectives now raise this at once instead of waiting for a peer
                                # that is gone until the backend's timeout.
                                comm.mark_peer_failed(self.failure)
            except SarcommError as exc:
                log.error("job=%s rank=%d generation=%d: heartbeats stopped: %s", job, rank, generation, exc)

    def _install_hooks(self) -> None:
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            self._uncaught = value
            previous(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(self.close)

    def close(self, exit_code: int | None = None, reason: str = "") -> None:
        """Stop heartbeating and report ``Leave`` (bounded by the client's timeout); idempotent.

        ``exit_code`` None means 1 after an uncaught exception, else 0.
        """
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        if exit_code is None:
            exit_code = 1 if self._uncaught is not None else 0
            if self._uncaught is not None and not reason:
                reason = f"uncaught {type(self._uncaught).__name__}: {self._uncaught}"[:512]
        result = self.result
        stream = self._stream

        async def _leave() -> None:
            if stream is not None:
                await stream.aclose()
            try:
                if result is not None:
                    member = result.assignments[0]
                    state = await self._client.leave(member.member_id, member.secret, exit_code, reason)
                    log.info(
                        "job=%s rank=%d generation=%d: left with code %d; job is %s",
                        result.job, member.rank, result.generation, exit_code, state,
                    )  # fmt: skip
            except SarcommError as exc:
                log.warning("could not report Leave to the coordinator: %s", exc)
            finally:
                await self._client.close()

        try:
            self._thread.run(_leave(), self._client.timeout + 5.0)
        except TimeoutError as exc:
            log.warning("could not report Leave to the coordinator: %s", exc)
        finally:
            self._thread.stop()


#: Seconds an exiting rank's last progress stamp vouches for it while the interpreter finalises.
EXIT_GRACE_S = 60.0

_registration: _Registration | None = None
_registration_lock = threading.Lock()
_progress: ProgressWriter | None = None


def _install_progress(path: Path | None, interval: float, agent_pid: int | None = None) -> ProgressWriter:
    """Note every collective's progress in a :class:`ProgressWriter` (once per process).

    With ``path`` (under ``sar-worker``) a daemon thread stamps the shared record every
    ``interval`` seconds: a rank blocked inside a collective still stamps, a stopped or wedged one
    does not, which is how its agent tells them apart. The same thread stops this rank (SIGTERM to
    itself) once the agent ``agent_pid`` is gone. Without ``path`` the record stays in this
    process, read by its own heartbeats.
    """
    global _progress
    if _progress is not None:
        return _progress
    from sarcomm.worker import collectives  # local: imports torch

    writer = ProgressWriter(path)
    collectives.set_progress_hook(writer)
    if path is not None:
        stop = threading.Event()

        def stamp() -> None:
            # Four stamps per interval: the agent reports the stamp's age once per interval, and the
            # coordinator counts a rank's silence from its last stamp, so a stamp a whole interval
            # old would eat an interval of the interval x misses budget of a healthy rank.
            while not stop.wait(interval / 4):
                writer.publish()
                if agent_pid is not None and not _alive(agent_pid):
                    log.error(
                        "rank %s: its sar-worker (pid %d) is gone, so nobody watches it or tells it of "
                        "failures; stopping", os.environ.get("RANK", "?"), agent_pid,
                    )  # fmt: skip
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        thread = threading.Thread(target=stamp, name="sarcomm-progress", daemon=True)
        thread.start()

        def end() -> None:
            # Ended before the interpreter finalises: a daemon thread still running then is torn
            # down with pthread_exit, which aborts the process ("terminate called without an
            # active exception") once torch's C++ runtime is loaded.
            stop.set()
            thread.join(interval + 1.0)
            # Finalising (torch's teardown) can take seconds with nobody left to stamp: vouch for
            # that long, so the agent does not take an exiting rank for a wedged one.
            writer.publish(stamp=time.time() + EXIT_GRACE_S)

        atexit.register(end)
    _progress = writer
    return writer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _agent_pid(env: Mapping[str, str]) -> int | None:
    """``SAR_AGENT_PID`` as a pid, or None (unset, or not a positive integer: then not watched)."""
    text = env.get(AGENT_PID_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def metrics_port_setting(environ: Mapping[str, str], member: bool) -> int | None:
    """The port this rank serves ``/metrics`` on (0: any free port), or None for no endpoint.

    ``SAR_METRICS_PORT`` decides when set (``sar-worker`` always sets it): a port, 0 or -1 (none).
    Unset, a process that is a member at a coordinator (``member``) serves on any free port, so
    that ``/sd`` lists it; any other process serves none (a plain torchrun job opts in with the
    variable). Raises :class:`InvalidArgumentError` for a value that is not an integer in -1..65535.
    """
    raw = environ.get(METRICS_PORT_VARIABLE, "").strip()
    if not raw:
        return 0 if member else None
    try:
        port = int(raw)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise InvalidArgumentError(
            f"{METRICS_PORT_VARIABLE}={shorten(raw)} must be an integer in -1..65535 "
            "(0: any free port, -1: no metrics endpoint)."
        )
    return None if port == -1 else port


def start_rank_services(environ: Mapping[str, str] | None = None) -> None:
    """Start what a rank runs beside its training once communication is up; idempotent.

    ``initialize_comms`` calls this, so that SAR-style scripts that call it directly (not
    :func:`init`) get the same: under ``sar-worker`` the progress record its agent reads
    (``SAR_PROGRESS_FILE``), and the ``/metrics`` endpoint (:func:`metrics_port_setting`), whose
    bound port goes to the coordinator through the agent's or this process's own heartbeats.

    A metrics port that cannot be bound is logged, not raised: losing the endpoint must not stop
    a training run. Raises :class:`InvalidArgumentError` for a malformed variable.
    """
    from sarcomm.worker import metrics  # local: the agent imports this module without torch

    env = os.environ if environ is None else environ
    writer = _progress
    progress_file = env.get(PROGRESS_FILE_VARIABLE)
    if writer is None and progress_file and _registration is None:
        writer = _install_progress(Path(progress_file), _heartbeat_interval(env, None), _agent_pid(env))
    port = metrics_port_setting(env, member=bool(env.get("SAR_MEMBER_ID")))
    if port is None:
        return
    bound = metrics.serving_port()
    if bound is None:
        try:
            _, bound = metrics.start_metrics_server(port)
        except OSError as exc:
            log.error(
                "rank %s: cannot serve /metrics on port %d (%s); continuing without the endpoint",
                env.get("RANK", "?"), port, exc,
            )  # fmt: skip
            return
    if writer is not None:
        # The stamping thread (or this process's heartbeats) carries it from the next interval on.
        writer.metrics_port = bound


def peer_failure() -> PeerFailedError | None:
    """The failure of another rank that this self-registered process heard of, else None.

    Only a process registered by :func:`coord_ip_init` or ``init(coord=...)`` hears of failures
    here; under ``sar-worker`` the agent stops the ranks itself.
    """
    return _registration.failure if _registration is not None else None


def peer_verdict_wait() -> float:
    """Seconds a collective whose backend saw a peer vanish waits for the coordinator to say which
    rank failed and why, before it raises the backend's own error; 0 when no coordinator watches
    this process (it did not register itself).

    The coordinator judges a rank whose connection broke after one heartbeat interval and a silent
    one after interval x misses (3 by default); the extra 2 s cover the sweep and the event's trip.
    """
    registration = _registration
    return 0.0 if registration is None else 3 * registration.interval + 2.0


def _heartbeat_interval(env: Mapping[str, str], value: float | None) -> float:
    if value is None:
        text = env.get("SARCOMM_HEARTBEAT_INTERVAL")
        if text is None:
            return DEFAULT_HEARTBEAT_INTERVAL
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0:
            raise InvalidArgumentError(
                f"SARCOMM_HEARTBEAT_INTERVAL={shorten(text)} must be a positive number of seconds."
            )
    if not value > 0:
        raise InvalidArgumentError(f"heartbeat_interval={value!r} must be a positive number of seconds.")
    return value


def _register(
    coord: str,
    *,
    job: str,
    world_size: int,
    rank: int | None,
    local_rank: int,
    local_world_size: int,
    backend: str,
    timeout: float | None,
    token: str | None,
    heartbeat_interval: float | None,
    environ: MutableMapping[str, str],
) -> JoinResult:
    """Join at ``coord``, start heartbeats, export the variables; shared by both entry points."""
    global _registration
    from sarcomm.common import netinfo  # local: only self-registration needs it

    validate_target(coord)
    interval = _heartbeat_interval(environ, heartbeat_interval)
    socket_name = environ.get("SAR_SOCKET_NAME", "")
    if socket_name:
        # Checked here so a typo is reported on the host that made it, with the names that exist.
        netinfo.check_socket_name(socket_name)
    with _registration_lock:
        if _registration is not None:
            raise SarcommError(
                "This process already registered with a coordinator (coord_ip_init or init(coord=...) "
                "ran before); a process is one member."
            )
        # The agent's settings, for processes that register themselves: SARCOMM_TOKEN_FILE and
        # SARCOMM_TLS_CA/_CERT/_KEY mean here what they mean to sar-worker.
        tls = ClientTls.from_env(environ)
        if token is None and environ.get("SARCOMM_TOKEN_FILE"):
            token = read_token_file(environ["SARCOMM_TOKEN_FILE"], "SARCOMM_TOKEN_FILE")
        registration = _Registration(coord, token, interval, tls)
        reservation = netinfo.reserve_port("")
        try:
            result = registration.join(
                (timeout or DEFAULT_JOIN_TIMEOUT) + registration.client_timeout,
                job=job,
                world_size=world_size,
                nproc=1,
                ranks=None if rank is None else [rank],
                local_ranks=[local_rank],
                local_world_size=local_world_size,
                socket_name=socket_name,
                store_port=int(reservation.getsockname()[1]),
                join_timeout=timeout,
                backend="" if backend == "auto" else backend,
            )
        except BaseException:
            registration.close(0, "join failed")
            raise
        finally:
            # Released now so that rank 0's TCPStore (this process, in initialize_comms) can bind it.
            reservation.close()
        registration.start_heartbeats(result, _install_progress(None, interval))
        _registration = registration
    member = result.assignments[0]
    environ.update(
        {
            "RANK": str(member.rank),
            "WORLD_SIZE": str(result.world_size),
            "LOCAL_RANK": str(member.local_rank),
            "LOCAL_WORLD_SIZE": str(member.local_world_size),
            "MASTER_ADDR": result.master_addr,
            "MASTER_PORT": str(result.master_port),
            "SAR_COORD": coord,
            "SAR_JOB": result.job,
            "SAR_GENERATION": str(result.generation),
            "SAR_SOCKET_NAME": result.interface,
            "SAR_MEMBER_ID": member.member_id,
            "SAR_MEMBER_SECRET": member.secret,
            "SAR_RESTART_COUNT": str(result.restart_count),
        }
    )
    if backend != "auto":
        environ["SAR_BACKEND"] = backend
    log.info(
        "job=%s rank=%d generation=%d: registered at %s; master %s:%d, interface %s",
        result.job, member.rank, result.generation, coord, result.master_addr, result.master_port,
        result.interface,
    )  # fmt: skip
    return result


def coord_ip_init(
    rank: int,
    coord: str,
    job: str,
    world_size: int,
    timeout: float | None = None,
    *,
    token: str | None = None,
    backend: str = "auto",
    heartbeat_interval: float | None = None,
) -> str:
    """Drop-in for SAR's ``nfs_ip_init(rank, ip_file)``: join ``job`` at the coordinator ``coord``
    as ``rank`` and return the master address.

    Blocks until all ``world_size`` members joined, or ``timeout`` seconds (None: the
    coordinator's ``--join-timeout``). Afterwards ``os.environ`` holds ``MASTER_ADDR``,
    ``MASTER_PORT`` (so ``initialize_comms(..., master_port_number=None)`` uses the port handed
    out), ``SAR_COORD``, ``SAR_JOB``, ``SAR_GENERATION``, ``SAR_SOCKET_NAME`` (the interface the
    coordinator chose; a ``SAR_SOCKET_NAME`` set before is honoured as the forced choice) and
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``SAR_MEMBER_ID``,
    ``SAR_MEMBER_SECRET``, ``SAR_RESTART_COUNT``. Heartbeats then run on a private thread every
    ``heartbeat_interval`` seconds (default ``SARCOMM_HEARTBEAT_INTERVAL``, else 1), and ``Leave``
    is reported at interpreter exit.

    Raises:
        InvalidArgumentError: a bad argument, or ``SAR_SOCKET_NAME`` names no interface here.
        AlreadyExistsError: another member holds ``rank``.
        FailedPreconditionError: the job exists with another world size or is running.
        JoinTimeoutError: the world did not form in time.
        CoordinatorUnavailableError: the coordinator could not be reached.
    """
    if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank={rank!r} must be an integer in 0..world_size-1 (world_size={world_size!r})."
        )
    result = _register(
        coord,
        job=job,
        world_size=world_size,
        rank=rank,
        local_rank=0,
        local_world_size=1,
        backend=backend,
        timeout=timeout,
        token=token,
        heartbeat_interval=heartbeat_interval,
        environ=os.environ,
    )
    return result.master_addr


def init(
    coord: str | None = None,
    job: str | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    *,
    initialize: bool = True,
    timeout: float | None = None,
    token: str | None = None,
) -> WorkerInfo:
    """Find out who this process is and (``initialize=True``) initialise ``torch.distributed``.

    - Started by ``sar-worker``: reads the variables it set (``RANK``, ``MASTER_ADDR``,
      ``SAR_*`` ...). ``coord``, ``job`` and ``world_size`` are then only checked against them.
    - ``coord`` given, or ``SAR_COORD`` set without ``RANK``: registers the process with the
      coordinator (like :func:`coord_ip_init`). The rank asked for is the launcher's (Open MPI,
      MPICH, Slurm) when there is one, else any; ``job`` defaults to ``SAR_JOB`` and
      ``world_size`` to the launcher's or ``WORLD_SIZE``.
    - Otherwise: the torchrun, Open MPI, MPICH/PMI or Slurm variables (:func:`parse_launch_env`);
      ``MASTER_ADDR`` and ``MASTER_PORT`` must be set.

    ``backend`` defaults to ``SAR_BACKEND``, else "auto". ``timeout`` bounds a join (seconds;
    None: the coordinator's ``--join-timeout``); ``token`` is the coordinator's bearer token.

    Raises:
        InvalidArgumentError: a variable or argument breaks its rule (the message names it, its
            value and the rule), or a needed one is missing.
        the errors of :func:`coord_ip_init` when registering.
    """
    env = os.environ
    launcher = detect_launcher(env)
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}.")
    coord = coord or (env.get("SAR_COORD") if "RANK" not in env else None) or None
    if launcher == "sar-worker" and "SAR_MEMBER_ID" in env:
        coord = None  # the agent registered this rank already; joining again would double it

    if coord is not None:
        launch = parse_launch_env(env) if launcher is not None else None
        job = job or env.get("SAR_JOB") or ""
        if not job:
            raise InvalidArgumentError("init(coord=...) needs a job name: pass job= or set SAR_JOB.")
        if world_size is None:
            if launch is None:
                raise InvalidArgumentError(
                    "init(coord=...) needs the world size: pass world_size= or set WORLD_SIZE."
                )
            world_size = launch.world_size
        chosen_backend = backend or env.get("SAR_BACKEND") or "auto"
        if chosen_backend not in BACKENDS:
            raise InvalidArgumentError(
                f"SAR_BACKEND={shorten(chosen_backend)} must be one of {', '.join(BACKENDS)}."
            )
        result = _register(
            coord,
            job=job,
            world_size=world_size,
            rank=launch.rank if launch is not None and launch.world_size == world_size else None,
            local_rank=launch.local_rank if launch is not None else 0,
            local_world_size=launch.local_world_size if launch is not None else 1,
            backend=chosen_backend,
            timeout=timeout,
            token=token,
            heartbeat_interval=None,
            environ=env,
        )
        member = result.assignments[0]
        info = WorkerInfo(
            rank=member.rank,
            world_size=result.world_size,
            local_rank=member.local_rank,
            local_world_size=member.local_world_size,
            master_addr=result.master_addr,
            master_port=result.master_port,
            backend=chosen_backend,
            generation=result.generation,
            job=result.job,
            restart_count=result.restart_count,
        )
    else:
        launch = parse_launch_env(env)
        if launch.master_addr is None or launch.master_port is None:
            missing = " and ".join(
                v for v, val in (("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port))
                if val is None
            )  # fmt: skip
            raise InvalidArgumentError(
                f"{missing} not set (launcher: {launch.launcher}): set MASTER_ADDR and MASTER_PORT to "
                "rank 0's host and a free port there, or pass coord= to let the coordinator hand them out."
            )
        if job is not None and launch.job and job != launch.job:
            raise InvalidArgumentError(
                f"job={job!r} does not match SAR_JOB={launch.job!r} set by the launcher."
            )
        if world_size is not None and world_size != launch.world_size:
            raise InvalidArgumentError(
                f"world_size={world_size!r} does not match WORLD_SIZE={launch.world_size} set by the "
                f"launcher ({launch.launcher})."
            )
        info = WorkerInfo(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            local_world_size=launch.local_world_size,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            backend=backend or launch.backend or "auto",
            generation=launch.generation,
            job=launch.job,
            restart_count=launch.restart_count,
        )

    progress_file = env.get(PROGRESS_FILE_VARIABLE)
    if coord is None and progress_file:
        # Under sar-worker: keep the record its agent reads, so that it reports this rank's
        # progress and notices when the rank is stopped or wedged. Started before the rendezvous,
        # which can take long, so that the agent sees the rank alive meanwhile.
        _install_progress(Path(progress_file), _heartbeat_interval(env, None), _agent_pid(env))
    if not initialize:
        start_rank_services(env)  # initialize_comms does it otherwise
    else:
        from sarcomm.worker import comm  # local: imports torch

        comm.initialize_comms(
            info.rank, info.world_size, info.master_addr, info.backend, master_port_number=info.master_port
        )
        info = dataclasses.replace(info, backend=comm.backend())
    log.info(
        "job=%s rank=%d generation=%d: world size %d, local rank %d of %d, master %s:%d, backend %s",
        info.job, info.rank, info.generation, info.world_size, info.local_rank, info.local_world_size,
        info.master_addr, info.master_port, info.backend,
    )  # fmt: skip
    return info
