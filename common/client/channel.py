"""The gRPC channels to a coordinator's addresses, and what a failed call on one of them means.

:class:`Channels` makes one channel per address on first use, all alike: TLS or plaintext, the
bearer token, and these options:

- no retries by gRPC (``grpc.enable_retries`` 0, no retry policy): every call is sent once per
  try, and :meth:`~sarcomm.common.client.replicas.Replicas.call` alone decides whether to send
  it again (see :mod:`sarcomm.common.client.replicas` for why that layer and no other);
- keepalive pings every :data:`_KEEPALIVE_TIME_MS`, so that a coordinator whose host died (no
  RST: the connection looks up) is left within seconds, not minutes, even under a waiting Join;
- reconnecting backs off to at most :data:`_MAX_RECONNECT_BACKOFF_MS` (gRPC's default is 120 s),
  so that a coordinator that starts late or restarts is found within a second.

A failed call becomes the :mod:`sarcomm.common.errors` class its status maps to
(:func:`translate`); an address that cannot be used is probed by hand
(:mod:`sarcomm.common.client.reach`, :meth:`Channels.probe`) to say what is wrong with it
(:func:`unreachable_error`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import grpc.aio

from sarcomm.common.addresses import split_target
from sarcomm.common.client.reach import Problem, Unreachable, probe
from sarcomm.common.errors import (
    LEADER_METADATA_KEY,
    CoordinatorUnavailableError,
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
    "Channels",
    "connection_broke",
    "leader_hint",
    "translate",
    "unreachable_error",
]

#: The gRPC service of the coordinator (also its name in ``grpc.health.v1.Health``).
COORDINATOR_SERVICE = "sarcomm.v1.Coordinator"

#: While a call finds no coordinator to answer it, how often it says that it still tries.
STILL_TRYING_EVERY_S = 15.0

# sar-coordinator accepts a ping every 10 s without data (its
# grpc.http2.min_ping_interval_without_data_ms), so 15 s; a dead host is noticed 20 s after its
# last answer at most, inside members' --reconnect-grace for a replica taking over.
_KEEPALIVE_TIME_MS = 15_000
_KEEPALIVE_TIMEOUT_MS = 5_000
_INITIAL_RECONNECT_BACKOFF_MS = 200
_MAX_RECONNECT_BACKOFF_MS = 1_000
_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ("grpc.primary_user_agent", "sarcomm-worker"),
    ("grpc.enable_retries", 0),
]

# How long a probe of an address may take.
_PROBE_TIMEOUT_S = 3.0

# grpc core's text for a deadline that the client itself set and that expired.
_OWN_DEADLINE_DETAILS = "Deadline Exceeded"
# grpc core's text for a call that it could not start or carry on because its connection went
# away at that moment (seen as INTERNAL on a stream opened as the coordinator died).
_CORE_INTERNAL_DETAILS = "Internal error from Core"


class Channels:
    """The channels of one client, one per address, made on first use (see the module).

    ``token`` is sent as ``authorization: Bearer <token>`` on every call (:attr:`metadata`);
    ``tls`` makes TLS channels (and lets :meth:`probe` say what TLS problem an address has);
    ``credentials`` are ready-made channel credentials instead (not diagnosed).

    Raises:
        InvalidArgumentError: unreadable TLS files.
    """

    def __init__(
        self,
        token: str | None = None,
        *,
        tls: ClientTls | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        #: The metadata every call carries (the bearer token, when there is one).
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self._credentials = tls.channel_credentials() if tls is not None else credentials
        self._open = False
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.CoordinatorAsyncStub]] = {}

    def open(self) -> None:
        """Allow channels to be made (no I/O). Needs a running event loop."""
        self._open = True

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        self._open = False
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(None)

    def get(self, target: str) -> tuple[grpc.aio.Channel, pb_grpc.CoordinatorAsyncStub]:
        """The channel and stub of ``target``, made on first use.

        Raises:
            RuntimeError: the client is not open.
        """
        if not self._open:
            raise RuntimeError("CoordinatorClient is not open: use `async with CoordinatorClient(...)`.")
        found = self._channels.get(target)
        if found is not None:
            return found
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options=_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(target, self._credentials, options=_OPTIONS)
        found = self._channels[target] = (channel, pb_grpc.CoordinatorStub(channel))
        return found

    def connected(self, target: str) -> bool:
        """Whether ``target``'s connection is up now (without trying to connect)."""
        found = self._channels.get(target)
        return found is not None and found[0].get_state() is grpc.ChannelConnectivity.READY

    async def connect(self, target: str, budget: float) -> bool:
        """Whether ``target``'s connection is up, connecting for at most ``budget`` seconds. An
        address whose last attempt failed counts as down at once: gRPC keeps trying it in the
        background (every second at most), so it is up on a later try when it is back."""
        channel = self.get(target)[0]
        ends = time.monotonic() + budget
        state = channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            left = ends - time.monotonic()
            if left <= 0 or state in (
                grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                grpc.ChannelConnectivity.SHUTDOWN,
            ):
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True

    async def probe(self, target: str) -> Unreachable | None:
        """What is wrong with ``target`` (see :func:`~sarcomm.common.client.reach.probe`), or None:
        nothing found, a target that is not HOST:PORT, or ready-made credentials."""
        split = split_target(target)
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


def translate(
    err: grpc.RpcError, method: str, deadline: float, started: float, target: str, connected: bool
) -> SarcommError:
    """The sarcomm error for a failed call of ``method`` to ``target``, made with ``deadline``
    seconds at monotonic time ``started``; ``connected``: whether ``target``'s connection is up."""
    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
    details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
    if own_deadline(err, deadline, started):
        if not connected:
            return CoordinatorUnavailableError(
                f"The coordinator at {target} could not be reached within the {deadline:g} s "
                f"deadline of {method}: check the address and that sar-coordinator is running there."
            )
        if method == "Join":
            return JoinTimeoutError(
                f"The coordinator at {target} did not answer Join within the client deadline "
                f"of {deadline:g} s."
            )
        return CoordinatorUnavailableError(
            f"The coordinator at {target} did not answer {method} within {deadline:g} s."
        )
    leader = leader_hint(err)
    if code is grpc.StatusCode.UNAVAILABLE and leader is not None:
        named = f"it names the leader at {leader}" if leader else "it knows no leader yet"
        return NotLeaderError(
            f"The coordinator at {target} is a standby ({method}): {named}; {details or 'no details'}",
            leader=leader,
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return CoordinatorUnavailableError(
            f"The coordinator at {target} is unavailable ({method}): {details or 'no details'}"
        )
    return from_rpc_error(err)


def own_deadline(err: grpc.RpcError, deadline: float, started: float) -> bool:
    """Whether ``err`` is the client's own deadline of ``deadline`` seconds from monotonic
    ``started`` passing, not the coordinator's answer (a Join's ``join_timeout``, also
    ``DEADLINE_EXCEEDED``)."""
    if not isinstance(err, grpc.aio.AioRpcError) or err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return err.details() == _OWN_DEADLINE_DETAILS or time.monotonic() - started >= deadline - 0.05


def unreachable_error(target: str, found: Unreachable) -> SarcommError:
    """The error for an address that cannot be used, as a probe ``found`` it."""
    if found.problem is Problem.TLS:
        message = f"TLS with the coordinator at {target} failed: {found.message}."
        if found.rejection is Rejection.PROTOCOL_MISMATCH:
            return CoordinatorUnavailableError(message)
        return UnauthenticatedError(message)
    return CoordinatorUnavailableError(
        f"Cannot use the coordinator address {target} ({found.problem.value}): {found.message}."
    )


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
