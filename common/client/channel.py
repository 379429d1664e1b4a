"""The connection to a coordinator (or to its replicas): the gRPC channels, their deadlines, and
what a failed call means.

Robustness comes from gRPC itself rather than from hand-written loops:

- every call is made with ``wait_for_ready=True`` and a deadline, so a coordinator that is still
  starting (or restarting) is waited for until the deadline, and never longer;
- the channel's service config carries a ``retryPolicy`` that retries ``UNAVAILABLE`` answers with
  exponential backoff and jitter (gRPC's built-in transparent retries);
- keepalive pings notice a dead connection during long blocking calls such as ``Join``.

A failed call becomes the :mod:`sarcomm.common.errors` class its status maps to
(:meth:`CoordinatorChannel.translate`); when the coordinator was never reached, the address
is probed by hand (:mod:`sarcomm.common.client.reach`) to say what is wrong with it.

Several addresses (``a:50051,b:50051``) make one channel per replica;
:class:`~sarcomm.common.client.replicas.ReplicaChannel` fails over between them. gRPC's own retries are
off for those (they would resend a standby's refusal four times before its hint is seen).
:class:`~.coordinator_client.CoordinatorClient` makes the calls over this;
:class:`~sarcomm.common.client.heartbeats.HeartbeatStream` keeps its stream on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from sarcomm.common.addresses import parse_targets, split_target
from sarcomm.common.client.failover import Failover
from sarcomm.common.client.reach import Problem, Unreachable, probe
from sarcomm.common.errors import (
    LEADER_METADATA_KEY,
    CoordinatorUnavailableError,
    InvalidArgumentError,
    JoinTimeoutError,
    NotLeaderError,
    SarcommError,
    UnauthenticatedError,
)
from sarcomm.common.status import from_rpc_error
from sarcomm.common.tls import ClientTls, Rejection
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "COORDINATOR_SERVICE",
    "STILL_TRYING_EVERY_S",
    "CoordinatorChannel",
    "connection_broke",
    "leader_hint",
]

log = logging.getLogger(__name__)


#: The gRPC service of the coordinator (also its name in ``grpc.health.v1.Health``).
COORDINATOR_SERVICE = "sarcomm.v1.Coordinator"

# gRPC retries UNAVAILABLE answers itself, with exponential backoff and jitter; wait_for_ready
# (set on every call) covers the "nothing listens yet" case, which never produces an answer.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": COORDINATOR_SERVICE}],
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
# With replicas, a leader whose host died (no RST: the connection looks up) must be left within
# seconds, not minutes, for a waiting Join to go on at the new leader: sar-coordinator accepts a
# ping every 10 s without data (its grpc.http2.min_ping_interval_without_data_ms), so 15 s.
_REPLICA_KEEPALIVE_TIME_MS = 15_000
_REPLICA_KEEPALIVE_TIMEOUT_MS = 5_000
_MAX_RECONNECT_BACKOFF_MS = 2_000

# While a call cannot connect, how often the address is probed by hand, how long a probe may take,
# and how often a waiting call says it still tries (see CoordinatorChannel._diagnosed).
_PROBE_EVERY_S = 1.0
_PROBE_TIMEOUT_S = 3.0
STILL_TRYING_EVERY_S = 15.0

_Response = TypeVar("_Response")


_Self = TypeVar("_Self", bound="CoordinatorChannel")

# grpc core's text for a deadline that the client itself set and that expired.
_OWN_DEADLINE_DETAILS = "Deadline Exceeded"
# grpc core's text for a call that it could not start or carry on because its connection went
# away at that moment (seen as INTERNAL on a stream opened as the coordinator died).
_CORE_INTERNAL_DETAILS = "Internal error from Core"


class CoordinatorChannel:
    """The channels to a coordinator (one per replica), the call deadline and the error
    translation; the base of :class:`~.coordinator_client.CoordinatorClient`, whose docstring
    explains the arguments.

    ``target`` is the replica calls go to now; ``targets`` the addresses given; ``_failover``
    the plan that :class:`~sarcomm.common.client.replicas.ReplicaChannel` follows between them.

    Raises:
        InvalidArgumentError: for a malformed target (or list), a non-positive timeout, unreadable
            TLS files, or both ``tls`` and ``credentials``.
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
        self.targets = parse_targets(target)
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds.")
        if tls is not None and credentials is not None:
            raise InvalidArgumentError("give tls= or credentials=, not both.")
        self.timeout = float(timeout)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self._credentials = tls.channel_credentials() if tls is not None else credentials
        self._failover = Failover(self.targets)
        # Whether one address was given: gRPC's transparent retries and slow keepalive, as before
        # replicas (see the module's docstring).
        self._single = len(self.targets) == 1
        self._open = False
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.CoordinatorAsyncStub]] = {}

    @property
    def target(self) -> str:
        """The replica calls go to now (the address given, for a single one)."""
        return self._failover.current

    @property
    def replicated(self) -> bool:
        """Whether calls fail over between replicas: several addresses were given, or a standby
        named a leader."""
        return len(self._failover.targets) > 1

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self: _Self) -> _Self:
        self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def open(self) -> None:
        """Make the client usable (no I/O: connecting happens on the first call). Needs a running
        event loop; ``async with`` calls it."""
        self._open = True
        self._connection(self.target)

    def _connection(self, target: str) -> tuple[grpc.aio.Channel, pb_grpc.CoordinatorAsyncStub]:
        """The channel and stub of one replica, made on first use."""
        if not self._open:
            raise RuntimeError("CoordinatorClient is not open: use `async with CoordinatorClient(...)`.")
        found = self._channels.get(target)
        if found is not None:
            return found
        # gRPC backs off reconnecting up to 120 s by default; a coordinator that starts late
        # (or restarts) should be found within seconds, a replica taking over within one.
        single = self._single  # options a list's channels get differ (see the constants)
        backoff_ms = _MAX_RECONNECT_BACKOFF_MS if single else 1_000
        options: list[tuple[str, str | int]] = [
            ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS if single else _REPLICA_KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS if single else _REPLICA_KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", min(200, backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ("grpc.primary_user_agent", "sarcomm-worker"),
        ]
        if single:
            options += [("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        else:
            options += [("grpc.enable_retries", 0)]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options=options)
        else:
            channel = grpc.aio.secure_channel(target, self._credentials, options=options)
        found = self._channels[target] = (channel, pb_grpc.CoordinatorStub(channel))
        return found

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        self._open = False
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(None)

    @property
    def _channel(self) -> grpc.aio.Channel | None:
        found = self._channels.get(self.target)
        return found[0] if found is not None else None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (the bearer token, when there is one)."""
        return self._metadata

    @property
    def stub(self) -> pb_grpc.CoordinatorAsyncStub:
        """The raw generated stub of the replica calls go to now (for callers that need a field
        this class does not expose)."""
        return self._connection(self.target)[1]

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
                    f"of {deadline:g} s."
                )
            return CoordinatorUnavailableError(
                f"The coordinator at {self.target} did not answer {method} within {deadline:g} s."
            )
        leader = leader_hint(err)
        if code is grpc.StatusCode.UNAVAILABLE and leader is not None:
            named = f"it names the leader at {leader}" if leader else "it knows no leader yet"
            return NotLeaderError(
                f"The coordinator at {self.target} is a standby ({method}): {named}; "
                f"{details or 'no details'}",
                leader=leader,
            )
        if code is grpc.StatusCode.UNAVAILABLE:
            return CoordinatorUnavailableError(
                f"The coordinator at {self.target} is unavailable ({method}): {details or 'no details'}"
            )
        return from_rpc_error(err)

    # -- diagnosis of an address that cannot be used -----------------------------------------------

    async def _probe(self, target: str | None = None) -> Unreachable | None:
        """What is wrong with the address (``target``, default the current one; see
        :func:`~sarcomm.common.client.reach.probe`), or None: nothing found, a target that is not
        HOST:PORT, or ready-made credentials."""
        split = split_target(self.target if target is None else target)
        if split is None or (self._credentials is not None and self.tls is None):
            return None
        host, port = split
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(probe, host, port, self.tls, _PROBE_TIMEOUT_S),
                _PROBE_TIMEOUT_S * 3,
            )
        except (TimeoutError, OSError):
            return None

    def _unreachable_error(self, found: Unreachable) -> SarcommError:
        if found.problem is Problem.TLS:
            message = f"TLS with the coordinator at {self.target} failed: {found.message}."
            if found.rejection is Rejection.PROTOCOL_MISMATCH:
                return CoordinatorUnavailableError(message)
            return UnauthenticatedError(message)
        return CoordinatorUnavailableError(
            f"Cannot use the coordinator address {self.target} ({found.problem.value}): {found.message}."
        )

    async def _explained(self, error: SarcommError) -> SarcommError:
        """``error``, or the problem behind it when the coordinator was never reached."""
        if not isinstance(error, CoordinatorUnavailableError) or self._connected():
            return error
        found = await self._probe()
        if found is None:
            return error
        if found.problem is Problem.TLS:
            return self._unreachable_error(found)
        return CoordinatorUnavailableError(f"{error} Found: {found.problem.value}: {found.message}.")

    async def _diagnosed(
        self, call: grpc.aio.UnaryUnaryCall[Any, _Response], method: str, *, fail_fast: bool = False
    ) -> _Response:
        """Await ``call``; while the channel cannot connect, find out why and say so.

        A call with ``wait_for_ready`` waits through connection failures until its deadline, which
        for a join is the join timeout (minutes): right for a coordinator that is not up yet, but
        the coordinator's HTTP port or a wrong certificate never heals. So while the channel is in
        TRANSIENT_FAILURE the address is probed (:meth:`_probe`): a lasting problem (not gRPC, TLS)
        ends the call at once, and so does any problem with ``fail_fast`` (a one-shot command such
        as ``status``); otherwise the problem is logged at once and then every
        ``STILL_TRYING_EVERY_S`` seconds while the call keeps waiting.
        """
        found: list[Unreachable] = []
        started = time.monotonic()

        async def watch() -> None:
            said_at: float | None = None
            while True:
                await asyncio.sleep(_PROBE_EVERY_S)
                channel = self._channel
                if channel is None or channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                    continue
                problem = await self._probe()
                if problem is None:
                    continue
                if problem.lasting or fail_fast:
                    found.append(problem)
                    call.cancel()
                    return
                now = time.monotonic()
                if said_at is None or now - said_at >= STILL_TRYING_EVERY_S:
                    said_at = now
                    left = call.time_remaining()
                    log.warning(
                        "%s: cannot reach the coordinator at %s (%s): %s; still trying (%.0f s so far, "
                        "%s left)", method, self.target, problem.problem.value, problem.message,
                        now - started, "no deadline" if left is None else f"{left:.0f} s",
                    )  # fmt: skip

        watcher = asyncio.ensure_future(watch())
        try:
            return await call
        except asyncio.CancelledError:
            if found:  # our watcher cancelled the call, not the caller its task
                raise self._unreachable_error(found[0]) from None
            raise
        finally:
            watcher.cancel()


def leader_hint(err: grpc.RpcError) -> str | None:
    """The leader a standby named in its refusal (``""``: it knows none), or None when the answer
    did not come from a standby (no :data:`~sarcomm.common.errors.LEADER_METADATA_KEY`)."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return None
    # A grpc.aio.Metadata (a mapping) at run time; the stubs call it a tuple.
    metadata: Any = err.trailing_metadata()
    value: object = metadata.get(LEADER_METADATA_KEY) if metadata is not None else None
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def connection_broke(err: grpc.aio.AioRpcError) -> bool:
    """Whether ``err`` says the connection broke (or the server cancelled the call, e.g. in its
    shutdown) rather than the coordinator answering: UNAVAILABLE, CANCELLED, or grpc core's own
    INTERNAL for a call caught by a connection going away."""
    code = err.code()
    if code is grpc.StatusCode.INTERNAL:
        return err.details() == _CORE_INTERNAL_DETAILS
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
