"""Async client of the ``sarcomm.v1.Coordinator`` gRPC service.

One :class:`CoordinatorClient` has the coordinator's addresses, one or its replicas
(``"a:50051,b:50051"``), as one :class:`~sarcomm.common.client.replicas.Replicas` over
:class:`~sarcomm.common.client.channel.Channels`: every unary call is one
:meth:`~sarcomm.common.client.replicas.Replicas.call`, the client's one retry layer, which follows
the leader, sends the call again while nothing answers it, and ends at the call's deadline (the
module explains the rules and why that layer). Failed calls raise the
:mod:`sarcomm.common.errors` class their status maps to. The client's own deadline becomes
:class:`CoordinatorUnavailableError` (never reached the coordinator) or, for ``Join``,
:class:`JoinTimeoutError`, with a message naming the target and the deadline. The long-lived
heartbeat stream is :class:`~sarcomm.common.client.heartbeats.HeartbeatStream`, the Watch stream
:func:`~sarcomm.common.client.watch.watch_events`, and a Join's request and answer are built and
read in :mod:`sarcomm.common.client.join`.

Example::

    async with CoordinatorClient("head:50051") as client:
        a = await client.join("gnn", world_size=8)
        ...
        await client.leave(a.member_id, a.secret, exit_code=0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType

import grpc
import grpc.aio

from sarcomm.common import durations
from sarcomm.common.addresses import parse_targets
from sarcomm.common.client.channel import Channels
from sarcomm.common.client.heartbeats import HeartbeatStream
from sarcomm.common.client.join import join_deadline, join_request, join_result
from sarcomm.common.client.replicas import ReplicaRole, Replicas
from sarcomm.common.client.watch import watch_events
from sarcomm.common.errors import (
    InvalidArgumentError,
    SarcommError,
)
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.common.messages import (
    Assignment,
    Event,
    HeartbeatReply,
    JoinResult,
    MemberReport,
)
from sarcomm.common.tls import ClientTls
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CoordinatorClient"]

log = logging.getLogger(__name__)


class CoordinatorClient:
    """Async client of a coordinator; use as ``async with CoordinatorClient(target) as c``.

    Args:
        target: ``HOST:PORT`` of the coordinator's gRPC listener (or a gRPC URI), or the
            replicas of one coordinator separated by commas (``"a:50051,b:50051"``): calls go to
            the leader and fail over within their deadline (:mod:`sarcomm.common.client.replicas`).
        token: bearer token sent as ``authorization: Bearer <token>`` on every call; None sends
            none.
        timeout: deadline in seconds for each call (default 30), including the time spent waiting
            for a coordinator that is not up yet. ``join`` has its own deadline
            (:meth:`join_deadline`).
        tls: TLS settings (:class:`~sarcomm.common.tls.ClientTls`: the CA that signed the
            coordinator's certificate, and this client's certificate and key for mutual TLS);
            None (and no ``credentials``) makes a plaintext channel. When the coordinator
            refuses the connection at the TLS layer, calls fail with a message naming which side
            rejected what (:class:`UnauthenticatedError` for a certificate, else
            :class:`CoordinatorUnavailableError`), and ``join`` fails within seconds rather than
            at its deadline.
        credentials: ready-made channel credentials (``grpc.ssl_channel_credentials(...)``),
            instead of ``tls``; failures are then not diagnosed.

    Raises:
        InvalidArgumentError: for a malformed target, a non-positive timeout, unreadable TLS
            files, or both ``tls`` and ``credentials``.
    """

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        targets = parse_targets(target)
        durations.checked(timeout, f"timeout={timeout!r}")
        if tls is not None and credentials is not None:
            raise InvalidArgumentError("give tls= or credentials=, not both.")
        self.timeout = float(timeout)
        self.tls = tls
        self._replicas = Replicas(targets, Channels(token, tls=tls, credentials=credentials))

    @property
    def targets(self) -> tuple[str, ...]:
        """The addresses given (one, or the replicas), in order."""
        return self._replicas.targets

    @property
    def target(self) -> str:
        """The replica calls go to now (the address given, for a single one)."""
        return self._replicas.target

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (the bearer token, when there is one)."""
        return self._replicas.metadata

    @property
    def stub(self) -> pb_grpc.CoordinatorAsyncStub:
        """The raw generated stub of the replica calls go to now (for callers that need a field
        this class does not expose)."""
        return self._replicas.stub_for(self.target)

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> CoordinatorClient:
        self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def open(self) -> None:
        """Make the client usable (no I/O: connecting happens on the first call). Needs a running
        event loop; ``async with`` calls it."""
        self._replicas.channels.open()
        self._replicas.channels.get(self.target)

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        await self._replicas.channels.close()

    async def roles(self, timeout: float) -> list[ReplicaRole]:
        """Each given replica's role (see :meth:`~sarcomm.common.client.replicas.Replicas.roles`);
        waits at most ``timeout`` seconds."""
        return await self._replicas.roles(timeout)

    # -- Join ------------------------------------------------------------------------------------

    async def join(
        self,
        job: str,
        world_size: int,
        rank: int | None = None,
        *,
        local_rank: int = 0,
        local_world_size: int = 1,
        host: str | None = None,
        interfaces: Sequence[InterfaceInfo] | None = None,
        socket_name: str = "",
        store_port: int = 0,
        generation: int = 0,
        join_timeout: float | None = None,
        backend: str = "",
    ) -> Assignment:
        """Register one member and block until the job's world has formed.

        ``rank`` None lets the coordinator deal one. ``local_rank``/``local_world_size`` describe
        the process on its host (they only travel in the answer). The other arguments are those of
        :meth:`join_many`.

        Raises:
            the errors of :meth:`join_many`.
        """
        result = await self.join_many(
            job,
            world_size,
            nproc=1,
            ranks=None if rank is None else [rank],
            local_ranks=[local_rank],
            local_world_size=local_world_size,
            host=host,
            interfaces=interfaces,
            socket_name=socket_name,
            store_port=store_port,
            generation=generation,
            join_timeout=join_timeout,
            backend=backend,
        )
        return result.assignments[0]

    async def join_many(
        self,
        job: str,
        world_size: int,
        *,
        nproc: int = 1,
        ranks: Sequence[int] | None = None,
        local_ranks: Sequence[int] | None = None,
        local_world_size: int | None = None,
        host: str | None = None,
        interfaces: Sequence[InterfaceInfo] | None = None,
        socket_name: str = "",
        store_port: int = 0,
        generation: int = 0,
        join_timeout: float | None = None,
        backend: str = "",
        max_restarts: int = 0,
        min_members: int = 0,
        max_members: int = 0,
        last_call_timeout: float = 0.0,
        rejoin: tuple[str, str] | None = None,
    ) -> JoinResult:
        """Register ``nproc`` members of this host in ``job`` and block until the world forms.

        Args:
            job: job name.
            world_size: total number of members of the job.
            nproc: members this call registers (one per local rank, default 1).
            ranks: requested global rank of each member (None: the coordinator deals them, keeping
                a host's ranks contiguous).
            local_ranks: local rank of each member on this host, for the answer (default
                ``0..nproc-1``); a process registering alone passes its launcher's local rank.
            local_world_size: members on this host (default ``nproc``).
            host: host name (default :func:`sarcomm.common.netinfo.host_name`).
            interfaces: this host's interfaces (default
                :func:`sarcomm.common.netinfo.local_interfaces`).
            socket_name: interface to force ("" lets the coordinator choose).
            store_port: TCP port reserved on this host for the torch.distributed store, used when a
                member here gets rank 0 (0: a port that is free now, see
                :func:`sarcomm.common.netinfo.free_port`).
            generation: generation this host last belonged to (0 = none); a stale one is refused.
            join_timeout: seconds to wait for the world to form, reaching the coordinator included;
                None uses the coordinator's ``--join-timeout``. The call's deadline is
                :meth:`join_deadline`.
            backend: the torch.distributed backend the members will use (informational).
            max_restarts: how often this host restarts the job after a failure (informational:
                ``status`` shows it beside the restart count).
            min_members, max_members, last_call_timeout: an elastic world (``max_members`` > 0;
                ``world_size`` must then be 0): it forms with between ``min_members`` and
                ``max_members`` members, at once with max_members, else once
                ``last_call_timeout`` seconds pass without a new arrival (see
                :mod:`sarcomm.coordinator.domain.elastic`).
            rejoin: ``(member_id, secret)`` of the member of the job's running generation this
                host was: a re-rendezvous of an elastic job (that generation ends, not failed).

        Returns:
            the shared answer, with one :class:`Assignment` per member in request order.

        Raises:
            InvalidArgumentError: a field breaks its rule (message names field, value and rule).
            FailedPreconditionError: world-size mismatch with the job, stale generation, job done.
            AlreadyExistsError: a requested rank is held by another member.
            JoinTimeoutError: the world did not form before the join timeout.
            JobClosedError: the elastic job's rendezvous is closed (a member finished or closed
                it, or the job failed): no new world forms under it while it runs.
            CoordinatorUnavailableError: the coordinator could not be reached before the deadline.
            UnauthenticatedError: the token was missing or wrong.
        """
        request = join_request(
            job,
            world_size,
            nproc=nproc,
            ranks=ranks,
            local_ranks=local_ranks,
            host=host,
            interfaces=interfaces,
            socket_name=socket_name,
            store_port=store_port,
            generation=generation,
            join_timeout=join_timeout,
            backend=backend,
            max_restarts=max_restarts,
            min_members=min_members,
            max_members=max_members,
            last_call_timeout=last_call_timeout,
            rejoin=rejoin,
        )
        deadline = self.join_deadline(join_timeout)
        started = time.monotonic()
        log.info(
            "job=%s ranks=%s generation=%d: joining at %s (world size %d, %d local member(s), deadline %g s)",
            job, list(ranks) if ranks is not None else "any", generation,
            self.target, world_size, nproc, deadline,
        )  # fmt: skip
        resp = await self._replicas.call("Join", lambda stub: stub.Join, request, deadline, started)
        result = join_result(resp, nproc, local_ranks, local_world_size, self.target)
        log.info(
            "job=%s ranks=%s generation=%d: world formed after %.2f s; master %s:%d, interface %s (%s)",
            result.job, list(result.ranks), result.generation, time.monotonic() - started,
            result.master_addr, result.master_port, result.interface, result.address,
        )  # fmt: skip
        return result

    def join_deadline(self, join_timeout: float | None) -> float:
        """The deadline of a Join, in seconds (:func:`~sarcomm.common.client.join.join_deadline`
        with this client's ``timeout``): ``join_timeout`` plus the slack for the answer to arrive,
        or, without one, the coordinator's ``--join-timeout`` (assumed at most
        :data:`~sarcomm.common.constants.DEFAULT_JOIN_TIMEOUT`) plus ``timeout``."""
        return join_deadline(join_timeout, self.timeout)

    # -- Heartbeat -------------------------------------------------------------------------------

    async def heartbeat(self, reports: Sequence[MemberReport]) -> HeartbeatReply:
        """Send one batch of reports over a short-lived stream and return the coordinator's answer.

        Raises:
            CoordinatorUnavailableError: not reached within ``timeout``.
            UnauthenticatedError, InvalidArgumentError: as the coordinator answers.
        """
        # closing: this stream ends after one batch, in order (not a reporter that died).
        request = pb.HeartbeatRequest(reports=[r.to_proto() for r in reports], closing=True)
        started = time.monotonic()
        call = self.stub.Heartbeat(
            iter([request]), timeout=self.timeout, metadata=self.metadata, wait_for_ready=True
        )
        try:
            replies = [HeartbeatReply.from_proto(r) async for r in call]
        except grpc.aio.AioRpcError as err:
            error = self._replicas.translate(err, "Heartbeat", self.timeout, started)
            raise await self._replicas.explained(error) from err
        if not replies:
            raise SarcommError(
                f"The coordinator at {self.target} closed the Heartbeat stream without an answer."
            )
        return replies[0]

    def heartbeats(
        self,
        reports: Callable[[], Sequence[MemberReport]],
        interval: float = 1.0,
        *,
        stream_timeout: float = 3600.0,
        by_exception: bool = False,
        job: str = "",
    ) -> HeartbeatStream:
        """A long-lived heartbeat stream: ``async with client.heartbeats(fn, 1.0) as hb: async for
        reply in hb: ...``.

        ``reports()`` is called every ``interval`` seconds and its reports are sent as one batch
        (an empty batch is skipped). ``by_exception=True``: take the coordinator's offer to report
        only changes (all reports are of ``job``). See :class:`HeartbeatStream`.
        """
        return HeartbeatStream(
            self._replicas, reports, interval, stream_timeout=stream_timeout, by_exception=by_exception,
            job=job,
        )  # fmt: skip

    # -- Leave, Watch, ListJobs --------------------------------------------------------------------

    async def leave(self, member_id: str, secret: str, exit_code: int, reason: str = "") -> str:
        """Report that a member is done with ``exit_code`` (``reason``: free text, e.g. "killed by
        signal 9"). Returns the job's state afterwards ("RUNNING", "FINISHED", "FAILED", ...).

        Raises:
            NotFoundError, UnauthenticatedError: unknown member or wrong secret.
            CoordinatorUnavailableError: not reached within ``timeout``.
        """
        started = time.monotonic()
        request = pb.LeaveRequest(member_id=member_id, secret=secret, exit_code=exit_code, reason=reason)
        resp = await self._replicas.call("Leave", lambda stub: stub.Leave, request, self.timeout, started)
        return resp.job_state

    def watch(self, job: str, generation: int = 0, *, timeout: float = 3600.0) -> AsyncIterator[Event]:
        """Yield the job's events as they happen (from ``generation``; 0 = the current one).

        The stream has a deadline like every call: after ``timeout`` seconds (default one hour)
        the iteration ends quietly; call again to keep watching. A stream that breaks (the
        coordinator restarted, the leader died), or whose leader this client's other calls found
        replaced (a hung leader), is opened again at the leader within the deadline, once its
        connection is up (:meth:`~sarcomm.common.client.replicas.Replicas.replica`); the job's
        state that a new stream starts with is not yielded twice.

        Raises:
            NotFoundError: unknown job.
            CoordinatorUnavailableError: the stream broke and could not be opened again before the
                deadline.
        """
        return watch_events(self._replicas, job, generation, timeout)

    async def list_jobs(
        self,
        job: str = "",
        *,
        member_limit: int = 0,
        member_offset: int = 0,
        member_states: Sequence[str] = (),
    ) -> list[pb.JobStatus]:
        """Jobs and their members (``job`` "" = all jobs), as ``sarcomm.v1.JobStatus`` messages:
        every member, or at most ``member_limit`` (0: no limit) from the ``member_offset``-th on in
        rank order, of those in ``member_states`` (empty: any); each job's ``member_counts`` counts
        all of them by state.

        Raises:
            CoordinatorUnavailableError: not reached within ``timeout``.
        """
        started = time.monotonic()
        request = pb.ListJobsRequest(
            job=job, member_limit=member_limit, member_offset=member_offset, member_states=member_states
        )
        resp = await self._replicas.call(
            "ListJobs", lambda stub: stub.ListJobs, request, self.timeout, started, fail_fast=True
        )
        return list(resp.jobs)
