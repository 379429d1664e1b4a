"""Async client of the ``sarcomm.v1.Coordinator`` gRPC service.

One :class:`CoordinatorClient` holds the channel to a coordinator
(:class:`~sarcomm.common.client.channel.CoordinatorChannel`, which also explains how calls wait, retry and
fail), or to its replicas (``"a:50051,b:50051"``: :class:`~sarcomm.common.client.replicas.ReplicaChannel`
follows the leader and fails over). Failed calls raise the
:mod:`sarcomm.common.errors` class their status maps to. The client's own deadline becomes
:class:`CoordinatorUnavailableError` (never reached the coordinator) or, for ``Join``,
:class:`JoinTimeoutError`, with a message naming the target and the deadline. The long-lived
heartbeat stream is :class:`~sarcomm.common.client.heartbeats.HeartbeatStream`.

Example::

    async with CoordinatorClient("head:50051") as client:
        a = await client.join("gnn", world_size=8)
        ...
        await client.leave(a.member_id, a.secret, exit_code=0)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import grpc.aio

from sarcomm.common import netinfo
from sarcomm.common.client.heartbeats import HeartbeatStream
from sarcomm.common.client.replicas import ReplicaChannel, cancel_call
from sarcomm.common.constants import DEFAULT_JOIN_TIMEOUT
from sarcomm.common.errors import (
    CoordinatorUnavailableError,
    InvalidArgumentError,
    JobClosedError,
    NotLeaderError,
    SarcommError,
)
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.common.messages import (
    Assignment,
    Event,
    HeartbeatReply,
    JoinResult,
    MemberReport,
    interface_to_proto,
)
from sarcomm.v1 import coordinator_pb2 as pb

__all__ = ["CoordinatorClient"]

log = logging.getLogger(__name__)

#: While the coordinator answers a Join with UNAVAILABLE (it cannot write its state: a full disk),
#: the same Join is sent again this often, and said so at most this often.
_STATE_RETRY_S = 2.0
_STATE_WARN_EVERY_S = 15.0


class CoordinatorClient(ReplicaChannel):
    """Async client of a coordinator; use as ``async with CoordinatorClient(target) as c``.

    Args:
        target: ``HOST:PORT`` of the coordinator's gRPC listener (or a gRPC URI), or the
            replicas of one coordinator separated by commas (``"a:50051,b:50051"``): calls go to
            the leader and fail over within their deadline (:mod:`sarcomm.common.client.replicas`).
        token: bearer token sent as ``authorization: Bearer <token>`` on every call; None sends
            none.
        timeout: deadline in seconds for each call (default 30), including the time spent waiting
            for a coordinator that is not up yet. ``join`` adds its join timeout on top.
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
            join_timeout: seconds to wait for the world to form; None uses the coordinator's
                ``--join-timeout`` (assumed to be at most :data:`DEFAULT_JOIN_TIMEOUT` for the
                client's deadline). The call's deadline is this plus ``timeout``.
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
        if ranks is not None and len(ranks) != nproc:
            raise InvalidArgumentError(
                f"ranks={list(ranks)!r} must have nproc={nproc} entries, one per member."
            )
        if local_ranks is not None and len(local_ranks) != nproc:
            raise InvalidArgumentError(
                f"local_ranks={list(local_ranks)!r} must have nproc={nproc} entries, one per member."
            )
        if join_timeout is not None and not join_timeout > 0:
            raise InvalidArgumentError(f"join_timeout={join_timeout!r} must be a positive number of seconds.")
        lranks = list(local_ranks) if local_ranks is not None else list(range(nproc))
        lworld = nproc if local_world_size is None else local_world_size
        members: list[pb.MemberSpec] = []
        try:
            for i in range(nproc):
                # On the wire a member's local rank is its index in this request (the coordinator
                # checks 0..nproc-1); a process that joins alone may still be local rank 3 of its
                # host, which the answer carries from ``local_ranks``.
                spec = pb.MemberSpec(local_rank=i)
                if ranks is not None:
                    spec.rank = ranks[i]
                members.append(spec)
            request = pb.JoinRequest(
                job=job,
                world_size=world_size,
                host=host if host is not None else netinfo.host_name(),
                interfaces=[
                    interface_to_proto(i)
                    for i in (interfaces if interfaces is not None else netinfo.local_interfaces())
                ],
                members=members,
                # The coordinator needs a port for rank 0's store; a free one is a fine default for
                # callers that do not hold one (racy in theory, which is why the agent reserves).
                store_port=store_port or netinfo.free_port(),
                socket_name=socket_name,
                generation=generation,
                join_timeout_seconds=join_timeout or 0.0,
                backend=backend,
                max_restarts=max_restarts,
                min_members=min_members,
                max_members=max_members,
                last_call_timeout_seconds=last_call_timeout,
                rejoin_member_id=rejoin[0] if rejoin else "",
                rejoin_secret=rejoin[1] if rejoin else "",
            )
        except (ValueError, TypeError) as exc:  # protobuf: int32 overflow, wrong types
            raise InvalidArgumentError(f"A Join field does not fit its protobuf type: {exc}") from exc

        # The same on every try of this join: a retried Join gets the first one's answer.
        request.join_id = secrets.token_hex(16)
        deadline = (join_timeout if join_timeout is not None else DEFAULT_JOIN_TIMEOUT) + self.timeout
        started = time.monotonic()
        log.info(
            "job=%s ranks=%s generation=%d: joining at %s (world size %d, %d local member(s), deadline %g s)",
            job, list(ranks) if ranks is not None else "any", generation,
            self.target, world_size, nproc, deadline,
        )  # fmt: skip
        resp = await self._join_until_answered(request, deadline, started)
        if resp.closed:
            raise JobClosedError(resp.closed_reason, beyond_max=resp.beyond_max)
        if len(resp.assignments) != nproc:
            raise SarcommError(
                f"The coordinator at {self.target} answered Join for job {resp.job!r} with "
                f"{len(resp.assignments)} assignments for {nproc} members."
            )
        assignments = tuple(
            Assignment(
                rank=a.rank,
                world_size=resp.world_size,
                local_rank=lranks[i],
                local_world_size=lworld,
                master_addr=resp.master_addr,
                master_port=resp.master_port,
                interface=resp.interface,
                address=resp.address,
                generation=resp.generation,
                member_id=a.member_id,
                secret=a.secret,
                job=resp.job,
                restart_count=resp.restart_count,
            )
            for i, a in enumerate(resp.assignments)
        )
        result = JoinResult(
            job=resp.job,
            generation=resp.generation,
            world_size=resp.world_size,
            master_addr=resp.master_addr,
            master_port=resp.master_port,
            interface=resp.interface,
            address=resp.address,
            restart_count=resp.restart_count,
            heartbeat_interval=resp.heartbeat_interval_seconds,
            assignments=assignments,
        )
        log.info(
            "job=%s ranks=%s generation=%d: world formed after %.2f s; master %s:%d, interface %s (%s)",
            result.job, list(result.ranks), result.generation, time.monotonic() - started,
            result.master_addr, result.master_port, result.interface, result.address,
        )  # fmt: skip
        return result

    # -- Heartbeat -------------------------------------------------------------------------------

    async def _join_until_answered(
        self, request: pb.JoinRequest, deadline: float, started: float
    ) -> pb.JoinResponse:
        """Send ``request`` until the coordinator answers it or the deadline passes. The coordinator
        answers UNAVAILABLE while it cannot write its state (a full disk): the same Join (same
        ``join_id``) is sent again, at most every :data:`_STATE_RETRY_S` seconds, saying so."""
        warned = float("-inf")
        while True:
            try:
                return await self._call(
                    "Join",
                    lambda stub, timeout, ready: stub.Join(
                        request, timeout=timeout, metadata=self._metadata, wait_for_ready=ready
                    ),
                    deadline,
                    started,
                )
            except grpc.aio.AioRpcError as err:
                error = await self._explained(self.translate(err, "Join", deadline, started))
                answered = err.code() is grpc.StatusCode.UNAVAILABLE and self._connected()
                if not answered or deadline - (time.monotonic() - started) < _STATE_RETRY_S:
                    raise error from err
                if time.monotonic() - warned >= _STATE_WARN_EVERY_S:
                    warned = time.monotonic()
                    log.warning("job=%s: %s; trying again until the join deadline", request.job, error)
                await asyncio.sleep(_STATE_RETRY_S)

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
            iter([request]), timeout=self.timeout, metadata=self._metadata, wait_for_ready=True
        )
        try:
            replies = [HeartbeatReply.from_proto(r) async for r in call]
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "Heartbeat", self.timeout, started)) from err
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
    ) -> HeartbeatStream:
        """A long-lived heartbeat stream: ``async with client.heartbeats(fn, 1.0) as hb: async for
        reply in hb: ...``.

        ``reports()`` is called every ``interval`` seconds and its reports are sent as one batch
        (an empty batch is skipped). See :class:`HeartbeatStream`.
        """
        return HeartbeatStream(self, reports, interval, stream_timeout=stream_timeout)

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
        try:
            resp = await self._call(
                "Leave",
                lambda stub, timeout, ready: stub.Leave(
                    request, timeout=timeout, metadata=self._metadata, wait_for_ready=ready
                ),
                self.timeout,
                started,
                diagnose=False,
            )
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "Leave", self.timeout, started)) from err
        return resp.job_state

    async def watch(self, job: str, generation: int = 0, *, timeout: float = 3600.0) -> AsyncIterator[Event]:
        """Yield the job's events as they happen (from ``generation``; 0 = the current one).

        The stream has a deadline like every call: after ``timeout`` seconds (default one hour)
        the iteration ends quietly; call again to keep watching. With replicas, a stream that
        breaks (the leader died), or whose leader this client's other calls found replaced (a
        hung leader), is opened again at the new leader within the deadline; the job's state
        that a new stream starts with is not yielded twice.

        Raises:
            NotFoundError: unknown job.
            CoordinatorUnavailableError: the coordinator was not reached before the deadline, or
                went away (with replicas: no replica led before the deadline).
        """
        started = time.monotonic()
        seen: set[Event] = set()
        while True:
            target = await self.replica("Watch")
            left = timeout - (time.monotonic() - started)
            call = self.stub_for(target).Watch(
                pb.WatchRequest(job=job, generation=generation),
                timeout=max(left, 0.001),
                metadata=self._metadata,
                wait_for_ready=not self.replicated,
            )
            # Another call following a new leader: this stream goes there too (the old leader may
            # hang with its connection up, and a watch hears nothing for long stretches).
            moved = asyncio.ensure_future(self.left_behind(target))
            moved.add_done_callback(functools.partial(cancel_call, call))
            try:
                async for msg in call:
                    self.answered(target)
                    event = Event.from_proto(msg)
                    if event not in seen:
                        seen.add(event)
                        yield event
                return
            except asyncio.CancelledError:
                if not moved.done() or moved.cancelled():
                    raise
                log.info("Watch of job %s: re-attaching at the leader %s", job, self.target)
            except grpc.aio.AioRpcError as err:
                error = self.translate(err, "Watch", timeout, started)
                ended = (
                    isinstance(error, CoordinatorUnavailableError)
                    and not isinstance(error, NotLeaderError)
                    and self._connected()
                )
                if ended and (not self.replicated or err.code() is grpc.StatusCode.DEADLINE_EXCEEDED):
                    return  # our own deadline on an established stream: a normal end
                delay = self.after_failure(target, err)
                left = timeout - (time.monotonic() - started)
                if delay is None or left <= delay:
                    raise await self._explained(error) from err
                await asyncio.sleep(delay)
            finally:
                moved.cancel()
                call.cancel()

    async def list_jobs(self, job: str = "") -> list[pb.JobStatus]:
        """Jobs and their members (``job`` "" = all jobs), as ``sarcomm.v1.JobStatus`` messages.

        Raises:
            CoordinatorUnavailableError: not reached within ``timeout``.
        """
        started = time.monotonic()
        request = pb.ListJobsRequest(job=job)
        try:
            resp = await self._call(
                "ListJobs",
                lambda stub, timeout, ready: stub.ListJobs(
                    request, timeout=timeout, metadata=self._metadata, wait_for_ready=ready
                ),
                self.timeout,
                started,
                fail_fast=True,
            )
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "ListJobs", self.timeout, started)) from err
        return list(resp.jobs)
