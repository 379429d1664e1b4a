"""Calls to a coordinator with replicas: :class:`ReplicaChannel` finds the leader and fails over.

Given several addresses (``--coord a:50051,b:50051``: coordinators sharing one etcd store, one
leading, the others standing by), :mod:`sarcomm.common.client.failover` decides where each call goes and
when; this module does the I/O around its decisions:

- a call goes to the replica that led last, once that replica's connection is up: at most
  :data:`CONNECT_S` seconds per replica, so a dead one costs seconds, not the call's deadline;
- a standby's refusal names the leader (:class:`~sarcomm.common.errors.NotLeaderError`) and the
  call goes there at once; a single address that answers as a standby is followed too;
- an unreachable replica, a standby that knows no leader, or a connection that breaks mid-call
  sends it to the next one, with backoff and jitter between rounds, until the call's deadline;
  while it waits it says so every ``STILL_TRYING_EVERY_S`` seconds, naming each replica's
  problem, and so does the error at the deadline;
- streams (:class:`~sarcomm.common.client.heartbeats.HeartbeatStream`, ``Watch``) ask :meth:`replica`
  where to open and :meth:`after_failure` where to reopen.

Join is safe to resend (its ``join_id``), and so are Leave and ListJobs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sarcomm.common.client.channel import (
    COORDINATOR_SERVICE,
    STILL_TRYING_EVERY_S,
    CoordinatorChannel,
    connection_broke,
    leader_hint,
)
from sarcomm.common.client.reach import Unreachable
from sarcomm.common.errors import CoordinatorUnavailableError, shorten
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CONNECT_S", "ReplicaChannel", "ReplicaRole", "cancel_call"]

log = logging.getLogger(__name__)

#: How long a call waits for one replica's connection before it tries the next, in seconds.
CONNECT_S = 3.0

_Response = TypeVar("_Response")
#: Starts a unary call: ``invoke(stub, timeout, wait_for_ready)``.
_Invoke: TypeAlias = Callable[
    ["pb_grpc.CoordinatorAsyncStub", float, bool], "grpc.aio.UnaryUnaryCall[Any, _Response]"
]


@dataclass
class _Attempt:
    """One call's progress through the replicas: ``method``, its monotonic start and end
    (``ends`` None: no deadline, a stream), and when it last said it still tries."""

    method: str
    started: float
    ends: float | None
    fail_fast: bool = False
    said_at: float | None = None

    def left(self) -> float:
        """Seconds to the deadline (infinite without one)."""
        return math.inf if self.ends is None else self.ends - time.monotonic()


@dataclass(frozen=True)
class ReplicaRole:
    """What one replica is now: ``role`` "leader" (its health says SERVING for the Coordinator
    service), "standby" (NOT_SERVING: it stands by, or it shuts down) or "down" (not reached;
    ``reason`` says why and what to do)."""

    address: str
    role: str
    reason: str = ""


class ReplicaChannel(CoordinatorChannel):
    """:class:`~sarcomm.common.client.channel.CoordinatorChannel` that follows the leader among
    replicas (see the module); with one address its calls behave as before replicas, but for a
    standby's hint."""

    def stub_for(self, target: str) -> pb_grpc.CoordinatorAsyncStub:
        """The stub of one replica (see :meth:`replica`)."""
        return self._connection(target)[1]

    async def _connect(self, target: str, budget: float) -> bool:
        """Whether ``target``'s connection is up, connecting for at most ``budget`` seconds. A
        replica whose last attempt failed counts as down at once: gRPC keeps trying it in the
        background (every second at most), so it is up on a later round when it is back."""
        channel = self._connection(target)[0]
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

    async def replica(self, method: str) -> str:
        """The replica to open a stream of ``method`` to, waiting as long as it takes: with one
        address, that address (the stream waits for it itself); with replicas, one whose
        connection is up, failing over with backoff while none is."""
        if not self.replicated:
            return self.target
        attempt = _Attempt(method, time.monotonic(), None)
        while True:
            target = self.target
            if await self._connect(target, CONNECT_S):
                return target
            await self._wait_next(attempt, self._failover.unreachable(target))

    def after_failure(self, target: str, err: grpc.aio.AioRpcError) -> float | None:
        """Note that a call to ``target`` failed with ``err`` and move to where the next one goes
        (:class:`~sarcomm.common.client.failover.Failover`). Returns the seconds to wait before it, or
        None when ``err`` is an answer for the caller: the leader refused the call, or (with one
        address, as before replicas) anything but a standby's refusal."""
        code = err.code()
        leader = leader_hint(err)
        if code is grpc.StatusCode.UNAVAILABLE and leader is not None:
            return self._failover.not_leader(target, leader)
        if not self.replicated or not connection_broke(err):
            return None
        found = self._channels.get(target)
        if found is not None and found[0].get_state() is grpc.ChannelConnectivity.READY:
            return self._failover.unreachable(target, f"unavailable ({shorten(err.details(), 200)})")
        return self._failover.unreachable(target, "unreachable (its connection broke)")

    def unreachable(self, target: str, reason: str) -> float:
        """Note that ``target`` cannot be used (``reason``, e.g. a stream it stopped answering)
        and move on; returns the seconds to wait before the next try."""
        return self._failover.unreachable(target, reason)

    def answered(self, target: str) -> None:
        """Note that ``target`` answered as leader; says so when that is a change of leader."""
        line = self._failover.succeeded(target)
        if line is not None:
            log.warning("%s", line)
            moved, self._moved = self._moved, None
            if moved is not None:
                moved.set()

    #: Set (and replaced) when the client follows another leader; see :meth:`left_behind`.
    _moved: asyncio.Event | None = None

    async def left_behind(self, target: str) -> None:
        """Return once the client turns to follow another leader than ``target`` (from now on):
        another call found that ``target`` no longer leads. A call or stream that hears nothing
        itself for long stretches (a waiting Join, a Watch, at a leader whose host hangs with its
        connection up) goes to the new leader then."""
        while True:
            if self._moved is None:
                self._moved = asyncio.Event()
            await self._moved.wait()
            if self._failover.leader != target:
                return

    async def _call(
        self,
        method: str,
        invoke: Callable[
            [pb_grpc.CoordinatorAsyncStub, float, bool], grpc.aio.UnaryUnaryCall[Any, _Response]
        ],
        deadline: float,
        started: float,
        *,
        fail_fast: bool = False,
        diagnose: bool = True,
    ) -> _Response:
        """One unary call, within ``deadline`` seconds of monotonic ``started``, to the leader:
        a standby's hint is followed, and with replicas every other problem fails over.
        ``invoke(stub, timeout, wait_for_ready)`` starts the call. ``diagnose`` (one address):
        probe the address while the call cannot connect (see :meth:`_diagnosed`).

        Raises:
            grpc.aio.AioRpcError: the coordinator's answer (with one address: any failure, as
                before replicas).
            CoordinatorUnavailableError: replicas: none led before the deadline (or, with
                ``fail_fast``, in one round); the message names each one's problem.
        """
        attempt = _Attempt(method, started, started + deadline, fail_fast)
        # A standby's last refusal: when the deadline cuts the next try, it says more than that.
        refusal: grpc.aio.AioRpcError | None = None
        while True:
            target = self.target
            try:
                if self.replicated:
                    if not await self._connect(target, min(attempt.left(), CONNECT_S)):
                        await self._wait_next(attempt, self._failover.unreachable(target))
                        continue
                    result = await self._unless_left_behind(
                        target, invoke(self.stub_for(target), max(attempt.left(), 0.001), False)
                    )
                    if result is None:
                        continue  # the client follows another leader now: the call goes there
                else:
                    call = invoke(self.stub, max(attempt.left(), 0.001), True)
                    result = await (self._diagnosed(call, method, fail_fast=fail_fast) if diagnose else call)
            except grpc.aio.AioRpcError as err:
                delay = self.after_failure(target, err)
                if delay is None and refusal is not None and err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise refusal from None
                if delay is None or (not self.replicated and attempt.left() <= delay):
                    raise
                refusal = err if leader_hint(err) is not None else None
                await self._wait_next(attempt, delay)
                continue
            self.answered(target)
            return result

    async def _unless_left_behind(
        self, target: str, call: grpc.aio.UnaryUnaryCall[Any, _Response]
    ) -> _Response | None:
        """``call``'s answer from ``target``, or None when the client follows another leader
        before it comes (another call found that ``target`` no longer leads: its host may hang
        with the connection up); the call is then cancelled."""
        moved = asyncio.ensure_future(self.left_behind(target))
        moved.add_done_callback(functools.partial(cancel_call, call))
        try:
            return await call
        except asyncio.CancelledError:
            if moved.done() and not moved.cancelled():
                log.info("%s: the client follows %s now; the call goes there", target, self.target)
                return None
            raise
        finally:
            moved.cancel()

    async def _wait_next(self, attempt: _Attempt, delay: float) -> None:
        """Wait ``delay`` seconds before the next try of ``attempt``. A delay means a round in
        which no replica led: that is said at once and then every ``STILL_TRYING_EVERY_S``
        seconds, and ends the call with ``fail_fast``, or when every replica has a lasting
        problem (not gRPC, TLS). Raises at the deadline instead of waiting past it."""
        if delay > 0 and self.replicated:
            now = time.monotonic()
            if attempt.fail_fast:
                raise await self._none_led(attempt)
            if attempt.said_at is None or now - attempt.said_at >= STILL_TRYING_EVERY_S:
                attempt.said_at = now
                found = await self._probe_replicas()
                if len(found) == len(self._failover.targets) and all(f.lasting for f in found.values()):
                    raise await self._none_led(attempt, found)
                left = attempt.left()
                log.warning(
                    "%s: no coordinator of %s leads yet (%s); still trying (%.0f s so far%s)",
                    attempt.method, ", ".join(self._failover.targets), self._reasons(found),
                    now - attempt.started, "" if math.isinf(left) else f", {left:.0f} s left",
                )  # fmt: skip
        if attempt.left() <= delay:
            await asyncio.sleep(max(0.0, attempt.left()))
            if self.replicated:
                raise await self._none_led(attempt)
            return
        await asyncio.sleep(delay)

    async def _probe_replicas(self) -> dict[str, Unreachable]:
        """What is wrong with each replica that could not be reached (those where :meth:`_probe`
        finds something)."""
        down = [t for t, why in self._failover.why.items() if why.startswith("unreachable")]
        found = await asyncio.gather(*(self._probe(t) for t in down))
        return {t: f for t, f in zip(down, found, strict=True) if f is not None}

    def _reasons(self, found: dict[str, Unreachable]) -> str:
        parts = []
        for target in self._failover.targets:
            why = self._failover.why.get(target, "not tried yet")
            problem = found.get(target)
            if problem is not None:
                why = f"unreachable ({problem.problem.value}: {problem.message})"
            parts.append(f"{target} is {why}")
        return "; ".join(parts)

    async def _none_led(
        self, attempt: _Attempt, found: dict[str, Unreachable] | None = None
    ) -> CoordinatorUnavailableError:
        """The error of a call that found no leader among the replicas, naming each one's problem."""
        if found is None:
            found = await self._probe_replicas()
        within = (
            f"within the {attempt.ends - attempt.started:g} s deadline of {attempt.method}"
            if attempt.ends is not None and not attempt.fail_fast
            else f"for {attempt.method}"
        )
        return CoordinatorUnavailableError(
            f"No coordinator of {', '.join(self._failover.targets)} led {within}: {self._reasons(found)}."
        )

    async def roles(self, timeout: float) -> list[ReplicaRole]:
        """Each given replica's role, from its ``grpc.health.v1.Health`` answer for the
        Coordinator service, asked of all at once; waits at most ``timeout`` seconds."""

        async def role(target: str) -> ReplicaRole:
            stub = health_pb2_grpc.HealthStub(self._connection(target)[0])
            request = health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE)
            try:
                answer = await stub.Check(request, timeout=timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                found = await self._probe(target)
                if found is not None:
                    return ReplicaRole(target, "down", f"{found.problem.value}: {found.message}")
                return ReplicaRole(target, "down", f"{err.code().name}: {err.details() or 'no details'}")
            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
            return ReplicaRole(target, "leader" if serving else "standby")

        return list(await asyncio.gather(*(role(t) for t in self.targets)))


def cancel_call(call: grpc.aio.Call, _: object = None) -> None:
    """Cancel ``call`` (a done-callback: the second argument is the future that fired)."""
    call.cancel()
