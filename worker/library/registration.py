"""Registration with the coordinator by the process itself, when no ``sar-worker`` started it.

:func:`coord_ip_init` is the drop-in for SAR's ``nfs_ip_init(rank, ip_file)``: the process joins
its job at the coordinator (asking for ``rank``), exports ``MASTER_ADDR``/``MASTER_PORT`` and the
``SAR_*`` variables, and returns the master address for ``initialize_comms``; ``init(coord=...)``
registers through the same :func:`register`.

A process that registered itself is kept alive at the coordinator by a heartbeat stream running on
a private event-loop thread, carrying the progress its collectives note; it reports ``Leave`` when
the interpreter exits (exit code 1 after an uncaught exception, else 0), when it is a
``multiprocessing`` child whose target ends (such a child ends with ``os._exit``, so atexit never
runs there: a multiprocessing finalizer does it, 0 when the target returned, else 1 and the
exception), or when :func:`leave` (``sar.finalize()``) says so. A failure of another rank
that the heartbeats report is logged, kept for :func:`peer_failure` and handed to every listener of
:func:`add_peer_failure_listener` (the communication state registers one, so that the next
collective, and one already waiting, raises :class:`~sarcomm.common.errors.PeerFailedError`
instead of waiting for a peer that is gone).

Imports no torch: the communication side depends on this module, never the other way round.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from types import TracebackType
from typing import Any

from sarcomm.common import netinfo
from sarcomm.common.addresses import host_port, parse_targets
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.heartbeats import HeartbeatStream
from sarcomm.common.client.loop_thread import LoopThread
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import InvalidArgumentError, PeerFailedError, SarcommError
from sarcomm.common.messages import JoinResult, MemberReport, Progress, paced_interval
from sarcomm.common.ports import PortBlock, check_extra_ports
from sarcomm.common.tls import ClientTls
from sarcomm.worker.launch_env import (
    member_environment,
    metrics_report_host,
    process_environ,
    registration_settings,
)
from sarcomm.worker.library.services import install_progress
from sarcomm.worker.progress import ProgressWriter

__all__ = [
    "add_peer_failure_listener",
    "coord_ip_init",
    "leave",
    "peer_failure",
    "peer_verdict_wait",
    "register",
]

log = logging.getLogger(__name__)


class _Registration:
    """A process registered with the coordinator by itself: its heartbeats and its ``Leave``."""

    def __init__(
        self,
        coord: str,
        token: str | None,
        heartbeat_interval: float,
        tls: ClientTls | None = None,
    ) -> None:
        self._thread = LoopThread("sarcomm-coordinator")
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
        #: The extra ports (extra_ports=K) this process holds while it is the job's master.
        self.ports = PortBlock([])

    def join_deadline(self, join_timeout: float | None) -> float:
        """The client's deadline of a Join (see ``CoordinatorClient.join_deadline``)."""
        return self._client.join_deadline(join_timeout)

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

    def start_heartbeats(self, result: JoinResult, progress: ProgressWriter, metrics_host: str) -> None:
        """Heartbeat for the joined member, with the progress the collectives note in ``progress``
        and its ``/metrics`` endpoint, bound on ``metrics_host``."""
        member = result.assignments[0]
        report_host = metrics_report_host(metrics_host, member.address)

        def reports() -> list[MemberReport]:
            seq, op, in_collective, since = progress.current  # one tuple, swapped whole by the writer
            port = progress.metrics_port
            metrics_address = host_port(report_host, port) if port else ""
            return [
                MemberReport(
                    member.member_id, member.secret, Progress(seq, op, in_collective, since), metrics_address
                )
            ]

        self._interval = paced_interval(self._interval, result.heartbeat_interval)
        # Per-interval, not by exception (issue 28): the reporter is the rank itself, with no agent
        # reading its progress stamp; by exception a rank wedged with its gRPC thread still answering
        # pings would be caught only by the lease (tens of seconds), not in interval x misses.
        self._stream = stream = self._client.heartbeats(reports, self._interval)
        self._watcher = self._thread.submit(self._watch(stream, result))
        self._install_hooks()
        # Return only once the coordinator has heard from this member: until its first report
        # arrives it is judged by silence alone, and the caller may hold the GIL next (a long C call)
        # and keep the heartbeat thread from sending one; after it, the open connection stands for
        # it. Bounded: collectives never depend on the coordinator, and the stream keeps trying.
        wait = self._client.timeout

        async def _heard() -> bool:
            stream.start()  # idempotent: the watcher's `async with` starts it too
            return await stream.first_answer(wait)

        if self._thread.run(_heard(), wait + 5.0):
            return
        if stream.ended:  # the watcher logged why ("heartbeats stopped: ...")
            why = "its heartbeat stream ended before the coordinator answered it"
        else:
            why = f"no answer to its first heartbeat in {wait:g} s (the heartbeats keep trying)"
        log.warning(
            "job=%s rank=%d generation=%d: %s; going on (a member the coordinator never hears from is "
            "failed after its liveness timeout)", result.job, member.rank, result.generation, why,
        )  # fmt: skip

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
                            # Collectives now raise this at once instead of waiting for a peer
                            # that is gone until the backend's timeout.
                            for listener in _peer_failure_listeners:
                                listener(self.failure)
            except SarcommError as exc:
                log.error("job=%s rank=%d generation=%d: heartbeats stopped: %s", job, rank, generation, exc)

    def _install_hooks(self) -> None:
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            self._uncaught = value
            previous(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(self.close)
        # A multiprocessing child (fork, forkserver) ends with os._exit, so atexit never runs
        # there; multiprocessing runs its own finalizers first, in every start method, inside the
        # `finally` around the process's target, where an exception in flight is still visible.
        multiprocessing.util.Finalize(None, self._close_at_process_exit, exitpriority=100)

    def _close_at_process_exit(self) -> None:
        """Leave as a multiprocessing child ends: 0 when its target returned, else the status and
        the reason of the exception that is ending it."""
        error = sys.exc_info()[1]
        if error is None:
            self.close()
        elif isinstance(error, SystemExit):
            code = error.code  # sys.exit(None) is 0; sys.exit("message") is 1 with that message
            if not isinstance(code, int | None):
                self.close(1, str(code)[:512])
                return
            # torch.multiprocessing.spawn's wrapper turns an exception into sys.exit(1): name it.
            cause = error.__context__
            reason = (
                f"exited with code {code} after {type(cause).__name__}: {cause}" if code and cause else ""
            )
            self.close(code or 0, reason[:512])
        else:
            self._uncaught = error
            self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, exit_code: int | None = None, reason: str = "") -> None:
        """Stop heartbeating and report ``Leave`` (bounded by the client's timeout); idempotent.

        ``exit_code`` None means 1 after an uncaught exception, else 0.
        """
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self.ports.close()
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


_registration: _Registration | None = None
_registration_lock = threading.Lock()
_peer_failure_listeners: list[Callable[[PeerFailedError], None]] = []


def leave(exit_code: int = 0, reason: str = "") -> bool:
    """Report ``Leave`` with ``exit_code`` for this self-registered process now and stop its
    heartbeats (bounded by the client's timeout); True when it was a member that had not left.
    Later calls, and the exit hooks, do nothing. Under ``sar-worker`` (not self-registered) it does
    nothing and returns False: the agent reports the rank's exit."""
    registration = _registration
    if registration is None or registration.closed:
        return False
    registration.close(exit_code, reason)
    return True


def add_peer_failure_listener(listener: Callable[[PeerFailedError], None]) -> None:
    """Have ``listener`` called (from the heartbeat thread) with the first failure of another rank
    that the coordinator reports to this self-registered process."""
    _peer_failure_listeners.append(listener)


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


def register(
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
    extra_ports_count: int = 0,
) -> JoinResult:
    """Join at ``coord``, start heartbeats, export the variables; shared by both entry points.
    ``extra_ports_count`` ports after the master port are reserved with it (see
    :class:`~sarcomm.common.ports.PortBlock`) and held until this process leaves."""
    global _registration
    coord = ",".join(parse_targets(coord))
    check_extra_ports(extra_ports_count, "extra_ports")
    # The agent's settings, for processes that register themselves: SARCOMM_TOKEN_FILE and
    # SARCOMM_TLS_CA/_CERT/_KEY mean here what they mean to sar-worker.
    settings = registration_settings(environ, heartbeat_interval, token)
    interval = settings.interval
    if settings.socket_name:
        # Checked here so a typo is reported on the host that made it, with the names that exist.
        netinfo.check_socket_name(settings.socket_name)
    with _registration_lock:
        if _registration is not None:
            raise SarcommError(
                "This process already registered with a coordinator (coord_ip_init or init(coord=...) "
                "ran before); a process is one member."
            )
        registration = _Registration(coord, settings.token, interval, settings.tls)
        registration.ports = PortBlock.reserve(extra_ports_count)
        try:
            result = registration.join(
                registration.join_deadline(timeout),
                job=job,
                world_size=world_size,
                nproc=1,
                ranks=None if rank is None else [rank],
                local_ranks=[local_rank],
                local_world_size=local_world_size,
                socket_name=settings.socket_name,
                store_port=registration.ports.store_port,
                join_timeout=timeout,
                backend="" if backend == "auto" else backend,
            )
        except BaseException:
            registration.close(0, "join failed")
            raise
        # The store port is released now so that rank 0's TCPStore (this process, in
        # initialize_comms) can bind it; the extra ports stay held while this process is the master.
        registration.ports.keep_if_master(result.master_port)
        registration.start_heartbeats(result, install_progress(None, interval), settings.metrics_host)
        _registration = registration
    member = result.assignments[0]
    environ.update(
        member_environment(
            result, 0, coord, result.restart_count, None if backend == "auto" else backend, extra_ports_count
        )
    )
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
    extra_ports: int = 0,
) -> str:
    """Drop-in for SAR's ``nfs_ip_init(rank, ip_file)``: join ``job`` at the coordinator ``coord``
    as ``rank`` and return the master address. ``coord`` may list the coordinator's replicas
    (``"a:50051,b:50051"``): the process follows the leader and its heartbeats fail over.

    Blocks until all ``world_size`` members joined, or ``timeout`` seconds (None: the
    coordinator's ``--join-timeout``), and then until the coordinator answered this process's first
    heartbeat (at most the client's call timeout, 30 s; a warning if not), so that a long C call
    holding the GIL right after it cannot get the member failed as never heard from.
    Afterwards ``os.environ`` holds ``MASTER_ADDR``,
    ``MASTER_PORT`` (so ``initialize_comms(..., master_port_number=None)`` uses the port handed
    out), ``SAR_COORD``, ``SAR_JOB``, ``SAR_GENERATION``, ``SAR_SOCKET_NAME`` (the interface the
    coordinator chose; a ``SAR_SOCKET_NAME`` set before is honoured as the forced choice) and
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``SAR_MEMBER_ID``,
    ``SAR_MEMBER_SECRET``, ``SAR_RESTART_COUNT``. Heartbeats then run on a private thread every
    ``heartbeat_interval`` seconds (default ``SARCOMM_HEARTBEAT_INTERVAL``, else 1), and ``Leave``
    is reported at interpreter exit. ``extra_ports=K`` (0..64) reserves the K ports after the master
    port with it, for SAR's sampling workers (``master_port() + k + 1``), held by the master's
    process until it leaves, and exports them as ``SAR_EXTRA_PORTS`` (comma-separated); every rank
    of a job must give the same K.

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
    result = register(
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
        environ=process_environ(),
        extra_ports_count=extra_ports,
    )
    return result.master_addr
