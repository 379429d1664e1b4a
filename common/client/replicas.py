"""A coordinator's addresses as one list (one address is a list of one), and the client's one
retry layer: :meth:`Replicas.call`.

Given several addresses (``--coord a:50051,b:50051``: coordinators sharing one etcd store, one
leading, the others standing by) or one, :mod:`sarcomm.common.client.failover` decides where each
try goes and when; this module does the I/O around its decisions. A unary call (``Join``,
``Leave``, ``ListJobs``, each safe to send again: a Join by its ``join_id``, which the coordinator
dedupes) goes like this until its deadline:

- a try goes to the replica that led last, once that replica's connection is up: at most
  :data:`CONNECT_S` seconds per try, so a dead replica costs seconds, not the call's deadline;
- a standby's refusal names the leader (:class:`~sarcomm.common.errors.NotLeaderError`) and the
  next try goes there at once, even when one address was given;
- an unreachable replica, a connection that breaks mid-call, or an ``UNAVAILABLE`` answer (a
  standby that knows no leader, a coordinator that cannot write its state) sends the next try to
  the next replica, with backoff and jitter between rounds (with one address, every try is a
  round);
- any other answer, a success or a refusal, ends the call: an answered call is never sent again;
- after a round in which none led, the replicas that could not be reached are probed
  (:mod:`sarcomm.common.client.reach`): a lasting problem with every one (not gRPC, TLS) ends the
  call at once, and so does any problem with every one for ``fail_fast`` (a one-shot command such
  as ``status``); otherwise what is wrong is said at once and then every
  ``STILL_TRYING_EVERY_S`` seconds, and at the deadline the error says it.

This is the only layer that sends a call again. gRPC's own retries are off (:mod:`.channel`):
its retry policy sees neither a standby's hint (a refusal it would resend blindly) nor the call's
deadline across replicas, and cannot say what is wrong while a call waits; nothing above this
layer resends either (the client's ``join`` is one :meth:`Replicas.call`).

Streams (:class:`~sarcomm.common.client.heartbeats.HeartbeatStream`, ``Watch``) ask
:meth:`Replicas.replica` where to open and :meth:`Replicas.after_failure` where to reopen.

One address and several differ in words only: an error or a warning names "the coordinator at
HOST:PORT" and its own answer, or "no coordinator of a, b" and each one's problem
(:meth:`Replicas._failed`, :meth:`Replicas._still_trying`); and a heartbeat stream leaves a
silent leader only when there is another replica to go to (:attr:`Replicas.replicated`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sarcomm.common.client.channel import (
    COORDINATOR_SERVICE,
    STILL_TRYING_EVERY_S,
    Channels,
    connection_broke,
    leader_hint,
    own_deadline,
    translate,
    unreachable_error,
)
from sarcomm.common.client.failover import Failover, Miss, MissKind
from sarcomm.common.client.reach import Problem, Unreachable
from sarcomm.common.errors import CoordinatorUnavailableError, SarcommError, shorten
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CONNECT_S", "ReplicaRole", "Replicas", "cancel_call"]

log = logging.getLogger(__name__)

#: How long a try waits for one replica's connection before it counts it unreachable, in seconds.
CONNECT_S = 3.0

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


@dataclass
class _Attempt:
    """One call's progress through the replicas: ``method``, its monotonic start and end
    (``ends`` None: no deadline, a stream), when it last said it still tries, its last failure
    and the last standby's refusal among them."""

    method: str
    started: float
    ends: float | None
    fail_fast: bool = False
    said_at: float | None = None
    last: grpc.aio.AioRpcError | None = None
    refusal: grpc.aio.AioRpcError | None = None

    def left(self) -> float:
        """Seconds to the deadline (infinite without one)."""
        return math.inf if self.ends is None else self.ends - time.monotonic()

    @property
    def deadline(self) -> float:
        """The call's deadline in seconds (infinite without one)."""
        return math.inf if self.ends is None else self.ends - self.started


@dataclass(frozen=True)
class ReplicaRole:
    """What one replica is now: ``role`` "leader" (its health says SERVING for the Coordinator
    service), "standby" (NOT_SERVING: it stands by, or it shuts down) or "down" (not reached;
    ``reason`` says why and what to do)."""

    address: str
    role: str
    reason: str = ""


class Replicas:
    """The addresses ``targets`` of one coordinator (its replicas, or one address), the plan that
    follows the leader among them, and the calls to it over ``channels`` (see the module). Shared
    by every call and stream of one client: they all follow the same leader."""

    def __init__(self, targets: Sequence[str], channels: Channels) -> None:
        #: The addresses given, in order.
        self.targets: tuple[str, ...] = tuple(targets)
        self.channels = channels
        self._failover = Failover(self.targets)
        # Set (and replaced) when the client follows another leader; see left_behind.
        self._moved: asyncio.Event | None = None

    @property
    def target(self) -> str:
        """The replica the next try goes to (the address given, for a single one)."""
        return self._failover.current

    @property
    def replicated(self) -> bool:
        """Whether there is another replica to go to: several addresses were given, or a standby
        named a leader."""
        return len(self._failover.targets) > 1

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (the bearer token, when there is one)."""
        return self.channels.metadata

    def stub_for(self, target: str) -> pb_grpc.CoordinatorAsyncStub:
        """The stub of one replica (see :meth:`replica`)."""
        return self.channels.get(target)[1]

    def connected(self) -> bool:
        """Whether the connection to :attr:`target` is up now."""
        return self.channels.connected(self.target)

    def translate(self, err: grpc.RpcError, method: str, deadline: float, started: float) -> SarcommError:
        """The sarcomm error for a failed call of ``method`` to :attr:`target` (see
        :func:`~sarcomm.common.client.channel.translate`)."""
        return translate(err, method, deadline, started, self.target, self.connected())

    async def explained(self, error: SarcommError) -> SarcommError:
        """``error``, or the problem behind it when :attr:`target` was never reached."""
        if not isinstance(error, CoordinatorUnavailableError) or self.connected():
            return error
        found = await self.channels.probe(self.target)
        if found is None:
            return error
        if found.problem is Problem.TLS:
            return unreachable_error(self.target, found)
        return CoordinatorUnavailableError(f"{error} Found: {found.problem.value}: {found.message}.")

    # -- the one retry layer -----------------------------------------------------------------------

    async def call(
        self,
        method: str,
        pick: Callable[[pb_grpc.CoordinatorAsyncStub], grpc.aio.UnaryUnaryMultiCallable[_Request, _Response]],
        request: _Request,
        deadline: float,
        started: float,
        *,
        fail_fast: bool = False,
    ) -> _Response:
        """Send ``request`` to the leader with ``pick(stub)`` (e.g. ``lambda s: s.Join``) until it
        answers, within ``deadline`` seconds of monotonic ``started`` (see the module's rules).

        Raises:
            SarcommError: the coordinator's refusal as its :mod:`sarcomm.common.errors` class; or
                :class:`CoordinatorUnavailableError` (:class:`UnauthenticatedError` for a
                certificate) when no coordinator led before the deadline (or, for a lasting
                problem or with ``fail_fast``, as soon as a probe found what is wrong with each),
                naming each one's problem.
        """
        attempt = _Attempt(method, started, started + deadline, fail_fast)
        while True:
            target = self.target
            if not await self.channels.connect(target, min(attempt.left(), CONNECT_S)):
                await self._wait_next(attempt, self._failover.unreachable(target))
                continue
            call = pick(self.stub_for(target))(
                request, timeout=max(attempt.left(), 0.001), metadata=self.metadata, wait_for_ready=False
            )
            try:
                result = await self._unless_left_behind(target, call)
            except grpc.aio.AioRpcError as err:
                delay = self.after_failure(target, err)
                if delay is None:  # the coordinator's answer: the call ends
                    # When the deadline cut a try that followed the coordinator's own answer (a
                    # standby's refusal; UNAVAILABLE while it cannot write its state: a full
                    # disk), that answer says more than the deadline: it is the last cause.
                    last = self._own_answer(attempt, target) if own_deadline(err, deadline, started) else None
                    error = last if last is not None else self.translate(err, method, deadline, started)
                    raise await self.explained(error) from err
                attempt.last = err
                attempt.refusal = err if leader_hint(err) is not None else None
                await self._wait_next(attempt, delay)
                continue
            if result is None:
                continue  # the client follows another leader now: the call goes there
            self.answered(target)
            return result

    async def replica(self, method: str) -> str:
        """The replica to open a stream of ``method`` to: one whose connection is up, failing over
        with backoff while none is, as long as it takes.

        Raises:
            SarcommError: every replica has a lasting problem (see the module).
        """
        attempt = _Attempt(method, time.monotonic(), None)
        while True:
            target = self.target
            if await self.channels.connect(target, CONNECT_S):
                return target
            await self._wait_next(attempt, self._failover.unreachable(target))

    def after_failure(self, target: str, err: grpc.aio.AioRpcError) -> float | None:
        """Note that a call to ``target`` failed with ``err`` and move to where the next try goes
        (:class:`~sarcomm.common.client.failover.Failover`). Returns the seconds to wait before it,
        or None when ``err`` is an answer for the caller: anything but a standby's refusal, an
        ``UNAVAILABLE`` answer or a broken connection."""
        leader = leader_hint(err)
        if err.code() is grpc.StatusCode.UNAVAILABLE and leader is not None:
            return self._failover.not_leader(target, leader)
        if not connection_broke(err):
            return None
        if self.channels.connected(target):
            return self._failover.unreachable(target, Miss(MissKind.UNAVAILABLE, shorten(err.details(), 200)))
        return self._failover.unreachable(target, Miss(MissKind.UNREACHABLE, "its connection broke"))

    def silent(self, target: str, detail: str) -> float:
        """Note that ``target``, though connected, stopped answering (``detail``, e.g. a stream
        that heard nothing for too long) and move on; returns the seconds to wait before the next
        try."""
        return self._failover.unreachable(target, Miss(MissKind.SILENT, detail))

    def answered(self, target: str) -> None:
        """Note that ``target`` answered as leader; says so when that is a change of leader."""
        line = self._failover.succeeded(target)
        if line is not None:
            log.warning("%s", line)
            moved, self._moved = self._moved, None
            if moved is not None:
                moved.set()

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
        which no replica led: the replicas that could not be reached are probed, which may end the
        call (see the module), and what is wrong is said at once and then every
        ``STILL_TRYING_EVERY_S`` seconds. Raises at the deadline instead of waiting past it."""
        if delay > 0:
            now = time.monotonic()
            if attempt.said_at is None or now - attempt.said_at >= STILL_TRYING_EVERY_S:
                attempt.said_at = now
                found = await self._probe_unreachable()
                if len(found) == len(self._failover.targets) and (
                    attempt.fail_fast or all(f.lasting for f in found.values())
                ):
                    raise self._failed(attempt, found)
                log.warning("%s", self._still_trying(attempt, found, now))
        if attempt.left() <= delay:
            await asyncio.sleep(max(0.0, attempt.left()))
            raise self._failed(attempt, await self._probe_unreachable())
        await asyncio.sleep(delay)

    async def _probe_unreachable(self) -> dict[str, Unreachable]:
        """What is wrong with each replica that could not be reached (those where a probe finds
        something)."""
        down = [t for t, why in self._failover.why.items() if why.kind is MissKind.UNREACHABLE]
        found = await asyncio.gather(*(self.channels.probe(t) for t in down))
        return {t: f for t, f in zip(down, found, strict=True) if f is not None}

    def _reasons(self, found: dict[str, Unreachable]) -> str:
        parts = []
        for target in self._failover.targets:
            miss = self._failover.why.get(target)
            why = str(miss) if miss is not None else "not tried yet"
            problem = found.get(target)
            if problem is not None:
                why = f"unreachable ({problem.problem.value}: {problem.message})"
            parts.append(f"{target} is {why}")
        return "; ".join(parts)

    def _own_answer(self, attempt: _Attempt, target: str) -> SarcommError | None:
        """The coordinator's own last answer to ``attempt`` when ``target`` was reached (a standby's
        refusal, ``UNAVAILABLE`` while it cannot write its state), as its error."""
        miss = self._failover.why.get(target)
        if attempt.last is None or (miss is not None and miss.kind is MissKind.UNREACHABLE):
            return None
        return self.translate(attempt.last, attempt.method, attempt.deadline, attempt.started)

    def _still_trying(self, attempt: _Attempt, found: dict[str, Unreachable], now: float) -> str:
        """The line a call says while no coordinator leads: one address names its problem or its
        own answer, several name each one's."""
        targets = self._failover.targets
        if len(targets) == 1:
            problem = found.get(targets[0])
            answer = self._own_answer(attempt, targets[0])
            if problem is not None:
                what = (
                    f"cannot reach the coordinator at {targets[0]} ({problem.problem.value}): "
                    f"{problem.message}"
                )
            elif answer is not None:
                what = str(answer)
            else:
                why = self._failover.why.get(targets[0], Miss(MissKind.UNREACHABLE))
                what = f"the coordinator at {targets[0]} is {why}"
        else:
            what = f"no coordinator of {', '.join(targets)} leads yet ({self._reasons(found)})"
        left = attempt.left()
        tail = "" if math.isinf(left) else f", {left:.0f} s left"
        return f"{attempt.method}: {what}; still trying ({now - attempt.started:.0f} s so far{tail})"

    def _failed(self, attempt: _Attempt, found: dict[str, Unreachable]) -> SarcommError:
        """The error of a call that found no leader: for one address, its problem or its own last
        answer; for several, each one's problem."""
        targets = self._failover.targets
        if len(targets) == 1:
            problem = found.get(targets[0])
            if problem is not None and (problem.lasting or attempt.fail_fast):
                return unreachable_error(targets[0], problem)
            answer = self._own_answer(attempt, targets[0])
            if answer is not None:
                return answer
            message = (
                f"The coordinator at {targets[0]} could not be reached within the {attempt.deadline:g} s "
                f"deadline of {attempt.method}: check the address and that sar-coordinator is running there."
            )
            if problem is not None:
                message += f" Found: {problem.problem.value}: {problem.message}."
            return CoordinatorUnavailableError(message)
        within = (
            f"within the {attempt.deadline:g} s deadline of {attempt.method}"
            if attempt.ends is not None and not attempt.fail_fast
            else f"for {attempt.method}"
        )
        return CoordinatorUnavailableError(
            f"No coordinator of {', '.join(targets)} led {within}: {self._reasons(found)}."
        )

    # -- health ------------------------------------------------------------------------------------

    async def roles(self, timeout: float) -> list[ReplicaRole]:
        """Each given replica's role, from its ``grpc.health.v1.Health`` answer for the
        Coordinator service, asked of all at once; waits at most ``timeout`` seconds."""

        async def role(target: str) -> ReplicaRole:
            stub = health_pb2_grpc.HealthStub(self.channels.get(target)[0])
            request = health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE)
            try:
                answer = await stub.Check(request, timeout=timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                found = await self.channels.probe(target)
                if found is not None:
                    return ReplicaRole(target, "down", f"{found.problem.value}: {found.message}")
                return ReplicaRole(target, "down", f"{err.code().name}: {err.details() or 'no details'}")
            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
            return ReplicaRole(target, "leader" if serving else "standby")

        return list(await asyncio.gather(*(role(t) for t in self.targets)))


def cancel_call(call: grpc.aio.Call, _: object = None) -> None:
    """Cancel ``call`` (a done-callback: the second argument is the future that fired)."""
    call.cancel()
