"""Async client of the ``sarcomm.v1.Coordinator`` gRPC service.

One :class:`CoordinatorClient` holds one channel. Robustness comes from gRPC itself rather than
from hand-written loops:

- every call is made with ``wait_for_ready=True`` and a deadline, so a coordinator that is still
  starting (or restarting) is waited for until the deadline, and never longer;
- the channel's service config carries a ``retryPolicy`` that retries ``UNAVAILABLE`` answers with
  exponential backoff and jitter (gRPC's built-in transparent retries);
- keepalive pings notice a dead connection during long blocking calls such as ``Join``.

Failed calls raise the :mod:`sarcomm.common.errors` class their status maps to. The client's
own deadline becomes :class:`CoordinatorUnavailableError` (never reached the coordinator) or, for
``Join``, :class:`JoinTimeoutError`, with a message naming the target and the deadline.

Example::

    async with CoordinatorClient("head:50051") as client:
        a = await client.join("gnn", world_size=8)
        ...
        await client.leave(a.member_id, a.secret, exit_code=0)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from sarcomm.common import netinfo
from sarcomm.common.addresses import split_target, validate_target
from sarcomm.common.constants import DEFAULT_JOIN_TIMEOUT
from sarcomm.common.errors import (
    CoordinatorUnavailableError,
    InvalidArgumentError,
    JoinTimeoutError,
    SarcommError,
    UnauthenticatedError,
    from_rpc_error,
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
from sarcomm.common.tls import ClientTls, Diagnosis, Rejection, diagnose
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CoordinatorClient", "HeartbeatStream"]

log = logging.getLogger(__name__)


_SERVICE = "sarcomm.v1.Coordinator"

# gRPC retries UNAVAILABLE answers itself, with exponential backoff and jitter; wait_for_ready
# (set on every call) covers the "nothing listens yet" case, which never produces an answer.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": _SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

# A server drops a client that pings more often than its min_recv_ping_interval_without_data
# (5 min by default) while it sends no data, which is exactly what a blocked Join looks like; so
# the client pings no more often than that. Heartbeat traffic keeps busy connections fresh anyway.
_KEEPALIVE_TIME_MS = 300_000
_KEEPALIVE_TIMEOUT_MS = 20_000
_MAX_RECONNECT_BACKOFF_MS = 2_000

# How long an orderly end of a heartbeat stream may take before the stream is cancelled instead.
_ORDERLY_CLOSE_S = 1.0

# While a join cannot connect, how often the TLS handshake is tried by hand, and how long a try
# may take (see CoordinatorClient._diagnosed).
_PROBE_EVERY_S = 1.0
_PROBE_TIMEOUT_S = 3.0

_Response = TypeVar("_Response")

# grpc core's text for a deadline that the client itself set and that expired.
_OWN_DEADLINE_DETAILS = "Deadline Exceeded"


class CoordinatorClient:
    """Async client of one coordinator; use as ``async with CoordinatorClient(target) as c``.

    Args:
        target: ``HOST:PORT`` of the coordinator's gRPC listener (or a gRPC URI).
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

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.target = validate_target(target)
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds.")
        if tls is not None and credentials is not None:
            raise InvalidArgumentError("give tls= or credentials=, not both.")
        self.timeout = float(timeout)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self._credentials = tls.channel_credentials() if tls is not None else credentials
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.CoordinatorAsyncStub | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> CoordinatorClient:
        self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def open(self) -> None:
        """Create the channel (no I/O: connecting happens on the first call). Needs a running
        event loop; ``async with`` calls it."""
        if self._channel is not None:
            return
        options: list[tuple[str, str | int]] = [
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC backs off reconnecting up to 120 s by default; a coordinator that starts late
            # (or restarts) should be found within seconds.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
            ("grpc.primary_user_agent", "sarcomm-worker"),
        ]
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=options)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close(None)

    @property
    def stub(self) -> pb_grpc.CoordinatorAsyncStub:
        """The raw generated stub (for callers that need a field this class does not expose)."""
        if self._stub is None:
            raise RuntimeError("CoordinatorClient is not open: use `async with CoordinatorClient(...)`.")
        return self._stub

    # -- error translation -----------------------------------------------------------------------

    def _connected(self) -> bool:
        return self._channel is not None and (
            self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY
        )

    def translate(self, err: grpc.RpcError, method: str, deadline: float, started: float) -> SarcommError:
        """The sarcomm error for a failed call of ``method`` made with ``deadline`` seconds at
        monotonic time ``started``."""
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        elapsed = time.monotonic() - started
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and (
            details == _OWN_DEADLINE_DETAILS or elapsed >= deadline - 0.05
        ):
            if not self._connected():
                return CoordinatorUnavailableError(
                    f"The coordinator at {self.target} could not be reached within the {deadline:g} s "
                    f"deadline of {method}: check the address and that sar-coordinator is running there."
                )
            if method == "Join":
                return JoinTimeoutError(
                    f"The coordinator at {self.target} did not answer Join within the client deadline "
                    f"of {deadline:g} s (join timeout plus {self.timeout:g} s to reach the coordinator)."
                )
            return CoordinatorUnavailableError(
                f"The coordinator at {self.target} did not answer {method} within {deadline:g} s."
            )
        if code is grpc.StatusCode.UNAVAILABLE:
            return CoordinatorUnavailableError(
                f"The coordinator at {self.target} is unavailable ({method}): {details or 'no details'}"
            )
        return from_rpc_error(err)

    # -- TLS diagnosis ---------------------------------------------------------------------------

    async def _diagnose(self) -> Diagnosis | None:
        """Why the connection fails at the TLS layer (see :func:`~sarcomm.common.tls.diagnose`),
        or None: not a TLS problem, a target that is not HOST:PORT, or ready-made credentials."""
        split = split_target(self.target)
        if split is None or (self._credentials is not None and self.tls is None):
            return None
        host, port = split
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(diagnose, host, port, self.tls, _PROBE_TIMEOUT_S),
                _PROBE_TIMEOUT_S * 3,
            )
        except (TimeoutError, OSError):
            return None

    def _tls_error(self, diagnosis: Diagnosis) -> SarcommError:
        message = f"TLS with the coordinator at {self.target} failed: {diagnosis.message}."
        if diagnosis.rejection is Rejection.PROTOCOL_MISMATCH:
            return CoordinatorUnavailableError(message)
        return UnauthenticatedError(message)

    async def _explained(self, error: SarcommError) -> SarcommError:
        """``error``, or the TLS problem behind it when the coordinator was never reached."""
        if not isinstance(error, CoordinatorUnavailableError) or self._connected():
            return error
        diagnosis = await self._diagnose()
        return error if diagnosis is None else self._tls_error(diagnosis)

    async def _diagnosed(self, call: grpc.aio.UnaryUnaryCall[Any, _Response]) -> _Response:
        """Await ``call``; while the channel cannot connect, find out whether TLS is the reason.

        A call with ``wait_for_ready`` waits through connection failures until its deadline, which
        for a join is the join timeout (minutes): right for a coordinator that is not up yet, but a
        wrong certificate never heals. So while the channel is in TRANSIENT_FAILURE the handshake
        is tried again by :meth:`_diagnose`, and a TLS rejection ends the call at once.
        """
        found: list[Diagnosis] = []

        async def watch() -> None:
            while True:
                await asyncio.sleep(_PROBE_EVERY_S)
                channel = self._channel
                if channel is None or channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                    continue
                diagnosis = await self._diagnose()
                if diagnosis is not None:
                    found.append(diagnosis)
                    call.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            return await call
        except asyncio.CancelledError:
            if found:  # our watcher cancelled the call, not the caller its task
                raise self._tls_error(found[0]) from None
            raise
        finally:
            watcher.cancel()

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

        Returns:
            the shared answer, with one :class:`Assignment` per member in request order.

        Raises:
            InvalidArgumentError: a field breaks its rule (message names field, value and rule).
            FailedPreconditionError: world-size mismatch with the job, stale generation, job done.
            AlreadyExistsError: a requested rank is held by another member.
            JoinTimeoutError: the world did not form before the join timeout.
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
            )
        except (ValueError, TypeError) as exc:  # protobuf: int32 overflow, wrong types
            raise InvalidArgumentError(f"A Join field does not fit its protobuf type: {exc}") from exc

        deadline = (join_timeout if join_timeout is not None else DEFAULT_JOIN_TIMEOUT) + self.timeout
        started = time.monotonic()
        log.info(
            "job=%s ranks=%s generation=%d: joining at %s (world size %d, %d local member(s), deadline %g s)",
            job, list(ranks) if ranks is not None else "any", generation,
            self.target, world_size, nproc, deadline,
        )  # fmt: skip
        try:
            resp = await self._diagnosed(
                self.stub.Join(request, timeout=deadline, metadata=self._metadata, wait_for_ready=True)
            )
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "Join", deadline, started)) from err
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
            resp = await self.stub.Leave(
                request, timeout=self.timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "Leave", self.timeout, started)) from err
        return resp.job_state

    async def watch(self, job: str, generation: int = 0, *, timeout: float = 3600.0) -> AsyncIterator[Event]:
        """Yield the job's events as they happen (from ``generation``; 0 = the current one).

        The stream has a deadline like every call: after ``timeout`` seconds (default one hour)
        the iteration ends quietly; call again to keep watching.

        Raises:
            NotFoundError: unknown job.
            CoordinatorUnavailableError: the coordinator was not reached before the deadline, or
                went away.
        """
        started = time.monotonic()
        call = self.stub.Watch(
            pb.WatchRequest(job=job, generation=generation),
            timeout=timeout,
            metadata=self._metadata,
            wait_for_ready=True,
        )
        try:
            async for msg in call:
                yield Event.from_proto(msg)
        except grpc.aio.AioRpcError as err:
            error = self.translate(err, "Watch", timeout, started)
            if isinstance(error, CoordinatorUnavailableError) and self._connected():
                return  # our own deadline on an established stream: a normal end
            raise await self._explained(error) from err
        finally:
            call.cancel()

    async def list_jobs(self, job: str = "") -> list[pb.JobStatus]:
        """Jobs and their members (``job`` "" = all jobs), as ``sarcomm.v1.JobStatus`` messages.

        Raises:
            CoordinatorUnavailableError: not reached within ``timeout``.
        """
        started = time.monotonic()
        try:
            resp = await self.stub.ListJobs(
                pb.ListJobsRequest(job=job),
                timeout=self.timeout,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as err:
            raise await self._explained(self.translate(err, "ListJobs", self.timeout, started)) from err
        return list(resp.jobs)


class HeartbeatStream:
    """One bidi ``Heartbeat`` stream kept open in a background task.

    Every ``interval`` seconds it sends ``reports()`` as one request; each answer is queued and
    handed out by ``async for reply in stream``. The stream has a deadline (``stream_timeout``,
    default one hour) like every call; when it passes, or when the connection drops
    (``UNAVAILABLE``, e.g. the coordinator restarts), the stream is opened again, waiting for the
    coordinator like any call (gRPC reconnects with exponential backoff and jitter). Ranks keep
    running meanwhile: collectives never depend on the coordinator being up. Any other failure
    (``UNAUTHENTICATED`` ...), or an exception from ``reports()``, ends the iteration by raising it
    (gRPC statuses as their :mod:`sarcomm.common.errors` class).

    ``connected`` says whether the current stream has had an answer. Use as an async context
    manager; leaving it ends the stream in order (a half-close), which the coordinator tells apart
    from a broken stream: a broken one means the reporter most likely died, and the members it
    reported fail unless another stream reports them within one interval.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        reports: Callable[[], Sequence[MemberReport]],
        interval: float,
        *,
        stream_timeout: float = 3600.0,
    ) -> None:
        if not interval > 0:
            raise InvalidArgumentError(f"interval={interval!r} must be a positive number of seconds.")
        if not stream_timeout > interval:
            raise InvalidArgumentError(
                f"stream_timeout={stream_timeout!r} must be longer than the interval ({interval!r} s)."
            )
        self._client = client
        self._reports = reports
        self.interval = float(interval)
        self.stream_timeout = float(stream_timeout)
        # None marks the end of the iteration.
        self._queue: asyncio.Queue[HeartbeatReply | Exception | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._ended = False
        # Set by aclose: the writer half-closes the stream and the task ends.
        self._closing = asyncio.Event()
        # Whether the last stream had answers before it broke: then it is reopened at once.
        self._was_connected = False
        self.connected = False

    async def __aenter__(self) -> HeartbeatStream:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def start(self) -> None:
        """Start the background task (``async with`` does this); needs a running event loop."""
        if self._task is None and not self._ended:
            self._task = asyncio.ensure_future(self._run())

    async def aclose(self) -> None:
        """Stop sending and end the stream in order (at most about one second; cancelled after
        that, e.g. while the coordinator is unreachable); waits for the background task."""
        task, self._task = self._task, None
        self._ended = True
        self._closing.set()
        if task is not None and not task.done():
            # The writer half-closes and the coordinator ends the stream; the shield keeps the
            # timeout from cancelling the task half-way.
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=_ORDERLY_CLOSE_S)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout=5.0)

    def __aiter__(self) -> HeartbeatStream:
        return self

    async def __anext__(self) -> HeartbeatReply:
        if self._task is None and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # later calls end too
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    async def _writer(
        self, call: grpc.aio.StreamStreamCall[pb.HeartbeatRequest, pb.HeartbeatResponse]
    ) -> None:
        """Send a batch every interval; returns when ``reports()`` raised (error queued) or, after a
        half-close, when :meth:`aclose` asked for the end."""
        while not self._closing.is_set():
            try:
                request = pb.HeartbeatRequest(reports=[r.to_proto() for r in self._reports()])
            except Exception as exc:  # a broken callback must not silently stop the heartbeats
                self._queue.put_nowait(exc)
                return
            if request.reports:
                await call.write(request)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.interval)
        await call.write(pb.HeartbeatRequest(closing=True))
        await call.done_writing()

    async def _reader(
        self, call: grpc.aio.StreamStreamCall[pb.HeartbeatRequest, pb.HeartbeatResponse]
    ) -> None:
        async for resp in call:
            self.connected = True
            self._queue.put_nowait(HeartbeatReply.from_proto(resp))

    async def _one_stream(self) -> bool:
        """Run one stream until it ends; True when another one should be opened."""
        client = self._client
        started = time.monotonic()
        call = client.stub.Heartbeat(
            None, timeout=self.stream_timeout, metadata=client._metadata, wait_for_ready=True
        )
        reader = asyncio.ensure_future(self._reader(call))
        writer = asyncio.ensure_future(self._writer(call))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done and writer.exception() is None:
                if self._closing.is_set():
                    # Half-closed: let the coordinator end the stream before anything cancels it,
                    # or it would take the end for a broken stream.
                    await asyncio.wait({reader}, timeout=_ORDERLY_CLOSE_S)
                return False  # closing, or reports() raised and its error is queued
            # A failed write means the call is over; the reader has the status.
            await asyncio.wait({reader}, timeout=self.interval + 5.0)
            err = reader.exception() if reader.done() else None
            if self._closing.is_set():
                return False
            if not reader.done() or err is None:
                log.info("Heartbeat stream to %s closed; reopening it", client.target)
                return True
            if not isinstance(err, grpc.aio.AioRpcError):
                raise err
            code = err.code()
            own_deadline = (
                code is grpc.StatusCode.DEADLINE_EXCEEDED
                and time.monotonic() - started >= self.stream_timeout - 0.05
            )
            if own_deadline or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                if self.connected and not own_deadline:
                    log.warning(
                        "Heartbeat stream to %s ended (%s: %s); reopening it; ranks keep running",
                        client.target, code.name, err.details(),
                    )  # fmt: skip
                self._was_connected = self.connected
                self.connected = False
                return True
            self._queue.put_nowait(client.translate(err, "Heartbeat", self.stream_timeout, started))
            return False
        finally:
            for task in (reader, writer):
                task.cancel()
            call.cancel()
            await asyncio.wait({reader, writer}, timeout=5.0)
            for task in (reader, writer):  # retrieve results so asyncio does not log them as lost
                if task.done() and not task.cancelled():
                    task.exception()

    async def _run(self) -> None:
        try:
            reopen = await self._one_stream()
            while reopen and not self._closing.is_set():
                # A stream that had answers is reopened at once (jittered, so that reporters do not
                # all arrive in one instant): the coordinator judges the members of a broken stream
                # after one interval. Otherwise one interval between streams, so a coordinator that
                # answers at once with an error (e.g. while shutting down) is not hammered; waiting
                # for a restart is wait_for_ready's, with gRPC's backoff and jitter.
                quick, self._was_connected = self._was_connected, False
                await asyncio.sleep(random.uniform(0.0, 0.1) * self.interval if quick else self.interval)
                reopen = await self._one_stream()
        finally:
            self._ended = True
            self._queue.put_nowait(None)
