"""The coordinator side of one torchrun agent: its joins, its heartbeat stream, and the status that
stream brings, on a private event loop (torch's agent is synchronous).

One sarcomm member per node: the agent. It joins the elastic job with one member (node rank and
node count come back), heartbeats for it while its workers run, and reads from every answer how
many nodes wait to join and whether the rendezvous is closed; a job event that ends its generation
(a node lost, another node re-joining, the job failed) is kept too. :meth:`RendezvousSession.status`
is what ``num_nodes_waiting()`` and ``is_closed()`` answer from: no call to the coordinator.

The sessions of one process share one client (one channel, one loop thread) per coordinator:
torchrun runs one handler per agent process, and a process that drives many (a test, the
benchmark) keeps one connection, as a process with many members should.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from sarcomm.common import netinfo
from sarcomm.common.addresses import host_port
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.heartbeats import HeartbeatStream
from sarcomm.common.client.loop_thread import LoopThread
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import SarcommError
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.common.messages import (
    Event,
    HeartbeatReply,
    JoinResult,
    MemberReport,
    WorkerEndpoint,
    paced_interval,
)
from sarcomm.common.tls import ClientTls
from sarcomm.worker.endpoints import EndpointNote, NoteReader
from sarcomm.worker.launch_env import metrics_report_host
from sarcomm.worker.torchrun.settings import RendezvousSettings

__all__ = ["GenerationStatus", "RendezvousSession"]

log = logging.getLogger(__name__)

#: The job events that end a running generation for its members: it re-forms (a node was lost,
#: another re-joins, nodes wait) or the job failed.
_ENDING = frozenset({EventKind.MEMBER_FAILED, EventKind.JOB_FAILED, EventKind.JOB_RESTARTING})
#: Heartbeats of the node's member, in seconds, unless the coordinator asks for more (its
#: --heartbeat-interval, which its answers carry).
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class GenerationStatus:
    """What the heartbeat stream said of the node's generation, replaced whole on each answer.

    ``waiting``: nodes parked for the next generation that fit in it; ``closed``: its rendezvous is
    closed; ``ended``: why the generation is over ("" while it runs)."""

    generation: int = 0
    waiting: int = 0
    closed: bool = False
    ended: str = ""


class _WorkerReports:
    """The node's report with its workers' endpoints, read afresh from their notes each interval
    (a few small files; the report is made again only when they changed)."""

    def __init__(self, report: MemberReport, directory: Path | None, result: JoinResult) -> None:
        self._report, self._directory, self._result = report, directory, result
        self._notes: list[EndpointNote] = []
        # The node's own workers' notes only (node rank: the one assignment of the node's member).
        node_rank = result.assignments[0].rank
        self._reader = None if directory is None else NoteReader(directory, result.generation, node_rank)
        # A node with a directory always sends its list (empty: none yet); the coordinator reads an
        # absent one as unchanged.
        self._reports = [report if directory is None else dataclasses.replace(report, worker_endpoints=())]

    def __call__(self) -> list[MemberReport]:
        if self._reader is None:
            return self._reports
        notes = self._reader.read()
        if notes != self._notes:
            self._notes = notes
            endpoints = _endpoints(notes, self._result)
            self._reports = [dataclasses.replace(self._report, worker_endpoints=endpoints)]
        return self._reports


def _endpoints(notes: list[EndpointNote], result: JoinResult) -> tuple[WorkerEndpoint, ...]:
    """What the coordinator is told of ``notes``: a wildcard listener at the node's address (the
    one it handed this node), any other where it listens."""
    endpoints = []
    for note in notes:
        try:
            host = metrics_report_host(note.host, result.address)
        except ValueError:  # not an IP address: not a note the library wrote
            continue
        endpoints.append(WorkerEndpoint(note.rank, note.local_rank, host_port(host, note.port)))
    return tuple(endpoints)


_Key = tuple[str, str | None, ClientTls | None]


@dataclass
class _SharedClient:
    """One process's client of one coordinator (its endpoint, token and TLS), and its users."""

    thread: LoopThread
    client: CoordinatorClient
    users: int = 0
    probed: bool = field(default=False)


_shared: dict[_Key, _SharedClient] = {}
_shared_lock = threading.Lock()


class RendezvousSession:
    """The coordinator client of one torchrun agent. Every method blocks the calling thread (the
    agent's) until the loop thread has done the work; they raise :mod:`sarcomm.common.errors`.

    :attr:`status` has one owner, this object, under its lock (as torch's own rendezvous holds its
    state under one): the agent's thread replaces it when a world forms, the loop thread's watcher
    of that generation updates it, and a watcher of an earlier generation, should one still run,
    never writes over a later one's."""

    def __init__(self, settings: RendezvousSettings, socket_name: str = "") -> None:
        self.settings = settings
        self._socket_name = socket_name
        self._key: _Key = (settings.endpoint, settings.token, settings.tls)
        with _shared_lock:
            shared = _shared.get(self._key)
            if shared is None:
                client = CoordinatorClient(settings.endpoint, settings.token, tls=settings.tls)
                shared = _shared[self._key] = _SharedClient(LoopThread("sarcomm-rendezvous"), client)
            shared.users += 1
        self._shared = shared
        self._thread, self._client = shared.thread, shared.client
        self._stream: HeartbeatStream | None = None
        self._watcher: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()
        self._status = GenerationStatus()
        self._closed = False
        # The host's interfaces, read when the session connects, for its first join (every later
        # join reads them afresh).
        self._interfaces: list[InterfaceInfo] | None = None

    @property
    def status(self) -> GenerationStatus:
        """What the heartbeat stream said of the node's generation (see :class:`GenerationStatus`)."""
        with self._lock:
            return self._status

    @property
    def _margin(self) -> float:
        """Beyond the client's own deadlines: a guard against a hang, never reached normally."""
        return self._client.timeout + 10.0

    def join(self, store_port: int, rejoin: tuple[str, str] | None) -> JoinResult:
        """Join the job with this node's one member (re-joining from ``rejoin``: its member of the
        running generation, ``(member_id, secret)``) and block until a world with it forms.
        ``store_port``: where this node serves the store should it become node rank 0.

        Raises:
            JobClosedError, JoinTimeoutError, CoordinatorUnavailableError, UnauthenticatedError,
            InvalidArgumentError, FailedPreconditionError: as the coordinator answers.
        """
        s = self.settings
        self.connect()
        interfaces, self._interfaces = self._interfaces or netinfo.local_interfaces(), None
        result = self._thread.run(
            self._client.join_many(
                s.run_id,
                0,
                interfaces=interfaces,
                socket_name=self._socket_name,
                store_port=store_port,
                join_timeout=s.join_timeout,
                min_members=s.min_nodes,
                max_members=s.max_nodes,
                last_call_timeout=s.last_call_timeout,
                rejoin=rejoin,
            ),
            s.join_timeout + self._margin,
        )
        with self._lock:
            self._status = GenerationStatus(result.generation)
        return result

    def connect(self) -> None:
        """Reach the coordinator (once; the first join does it too).

        Raises:
            CoordinatorUnavailableError, UnauthenticatedError: as :meth:`_probe` finds.
        """
        if not self._shared.probed:
            self._thread.run(self._probe(), self._margin)
            self._shared.probed = True
        if self._interfaces is None and self.status.generation == 0:
            self._interfaces = netinfo.local_interfaces()

    async def _probe(self) -> None:
        """Reach the coordinator once, failing fast: an endpoint with nothing listening, a wrong
        token or a TLS mismatch is named in seconds instead of at the join deadline."""
        self._client.open()
        await self._client.list_jobs(self.settings.run_id)

    def watch(self, result: JoinResult, endpoints: Path | None = None) -> None:
        """Heartbeat for the node's member of ``result`` and keep the status of its generation. Each
        report carries the ``/metrics`` endpoints its workers noted in ``endpoints`` (the node's
        ``SAR_ENDPOINTS_DIR``), for the coordinator's ``/sd``."""
        member = result.assignments[0]
        reports = _WorkerReports(MemberReport(member.member_id, member.secret), endpoints, result)
        interval = paced_interval(HEARTBEAT_INTERVAL_S, result.heartbeat_interval)
        # Per-interval, not by exception (issue 28): the node's member is torchrun's own agent loop,
        # with no observer beside it stamping its liveness; by exception a wedged loop whose gRPC
        # still answers pings would be caught only by the lease (tens of seconds), not in interval
        # x misses. One small report a node a second is cheap.
        self._stream = stream = self._client.heartbeats(reports, interval)
        self._watcher = self._thread.submit(self._watch(stream, result))

    async def _watch(self, stream: HeartbeatStream, result: JoinResult) -> None:
        member = result.assignments[0]
        async with stream:
            try:
                async for reply in stream:
                    if self._hear(reply, result, member.member_id):
                        return
            except SarcommError as exc:
                log.error(
                    "job=%s node_rank=%d generation=%d: heartbeats stopped: %s",
                    result.job, member.rank, result.generation, exc,
                )  # fmt: skip

    def _hear(self, reply: HeartbeatReply, result: JoinResult, member_id: str) -> bool:
        """Take the status of ``reply`` for ``result``'s generation; True when the generation is over
        (heartbeats stop). A read-modify-write of :attr:`status`, under the lock: the agent's thread
        may replace it meanwhile with a later generation's, which this one must not touch."""
        with self._lock:
            if self._status.generation != result.generation:
                return True  # a later world formed: this generation's status is nobody's any more
            status = self._status = self._heard(self._status, reply, result, member_id)
        return bool(status.ended) and member_id in reply.unknown_members

    @staticmethod
    def _heard(
        status: GenerationStatus, reply: HeartbeatReply, result: JoinResult, member_id: str
    ) -> GenerationStatus:
        """``status`` (of ``result``'s generation) after ``reply``."""
        before = status
        ended = status.ended
        if member_id in reply.unknown_members:
            ended = ended or "the coordinator no longer knows this node's member: its generation ended"
        mine = (e for e in reply.events if e.job == result.job and e.generation == result.generation)
        event: Event | None = next((e for e in mine if e.kind in _ENDING), None)
        if event is not None and not ended:
            # The coordinator's members are torchrun's nodes: "rank" alone would read as a worker's.
            failed = event.kind is EventKind.MEMBER_FAILED and event.rank >= 0
            ended = f"node {event.describe()}" if failed else event.describe()
        state = next(
            (r for r in reply.rendezvous if r.job == result.job and r.generation == result.generation), None
        )
        if state is not None:
            status = dataclasses.replace(status, waiting=state.waiting, closed=state.closed)
        if ended and not status.ended:
            log.warning(
                "job=%s node_rank=%d generation=%d: %s; the nodes re-form",
                result.job, result.assignments[0].rank, result.generation, ended,
            )  # fmt: skip
        elif status.waiting and not before.waiting:
            log.warning(
                "job=%s node_rank=%d generation=%d: %d node(s) wait to join; the nodes re-form",
                result.job, result.assignments[0].rank, result.generation, status.waiting,
            )  # fmt: skip
        return dataclasses.replace(status, ended=ended)

    def stop_heartbeats(self) -> None:
        """End the heartbeat stream in order (the coordinator then judges the member by silence
        alone: the next join, or the leave, comes well within that). Never raises: a stream or
        watcher that does not end in time is cancelled, and said so."""
        stream, self._stream = self._stream, None
        watcher, self._watcher = self._watcher, None
        if stream is not None:
            try:
                self._thread.run(stream.aclose(), self._margin)
            except TimeoutError as exc:  # run() cancelled the close, and with it the stream
                run_id = self.settings.run_id
                log.warning("job=%s: the heartbeat stream did not end in order: %s", run_id, exc)
        if watcher is not None:
            done, _ = concurrent.futures.wait([watcher], timeout=self._margin)
            if not done:
                watcher.cancel()
                log.warning(
                    "job=%s: the heartbeat stream's reader did not end within %g s; cancelled",
                    self.settings.run_id, self._margin,
                )  # fmt: skip

    def close_job(self, member_id: str, secret: str) -> None:
        """Close the job's rendezvous (torch's ``set_closed``), through a one-off report."""
        report = MemberReport(member_id, secret, close_job=True)
        self._thread.run(self._client.heartbeat([report]), self._margin)

    def leave(self, member_id: str, secret: str, exit_code: int, reason: str) -> str:
        """Report that the node is done; returns the job's state afterwards."""
        return self._thread.run(self._client.leave(member_id, secret, exit_code, reason), self._margin)

    def close(self) -> None:
        """Stop heartbeating; the process's last session of this coordinator also closes the
        channel and the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _shared_lock:
            self._shared.users -= 1
            last = self._shared.users == 0
            if last:
                del _shared[self._key]
        try:
            self.stop_heartbeats()
            if last:
                self._thread.run(self._client.close(), self._margin)
        finally:
            if last:
                self._thread.stop()
