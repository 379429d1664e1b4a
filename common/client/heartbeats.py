"""The long-lived ``Heartbeat`` stream of an agent or a self-registered process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc
import grpc.aio

from sarcomm.common import durations
from sarcomm.common.client.by_exception import SentState, decide
from sarcomm.common.client.channel import connection_broke
from sarcomm.common.client.replicas import Replicas
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import HeartbeatReply, MemberReport, ReportPolicy, paced_interval
from sarcomm.v1 import coordinator_pb2 as pb

__all__ = ["REPLICATED_LEASE_S", "SILENT_BEATS", "SILENT_MIN_S", "HeartbeatStream"]

log = logging.getLogger(__name__)

# How long an orderly end of a heartbeat stream may take before the stream is cancelled instead.
_ORDERLY_CLOSE_S = 1.0
# With replicas, a stream whose reports go unanswered this long (this many intervals, at least
# the seconds below) is given up for the other replicas: the leader's host died or hangs, and its
# connection can look up for minutes. The coordinator answers every report at once, and judges a
# member silent for interval x misses (3 x 1 s by default): a leader that has not answered for that
# long is of no use, and leaving it then keeps inside the grace a new leader gives (10 s default).
SILENT_BEATS = 3
SILENT_MIN_S = 3.0
# With replicas, a stream reporting by exception renews its lease at least this often: the watchdog
# above measures requests that go unanswered, and by exception a request may be a whole lease
# (10 to 60 s) away. A hung leader is then left within this + SILENT_MIN_S (and an interval), inside
# the leader TTL + --reconnect-grace (5 + 10 s by default) after which a new leader fails members
# that have not re-attached. One address: the connection's keepalive decides, the policy's lease holds.
REPLICATED_LEASE_S = 5.0


class HeartbeatStream:
    """One bidi ``Heartbeat`` stream kept open in a background task.

    Every ``interval`` seconds it sends ``reports()`` as one request; each answer is queued and
    handed out by ``async for reply in stream``. The stream has a deadline (``stream_timeout``,
    default one hour) like every call; when it passes, or when the connection drops
    (``UNAVAILABLE``, e.g. the coordinator restarts), the stream is opened again where
    :meth:`~sarcomm.common.client.replicas.Replicas.replica` says, once that replica's connection is
    up: a broken stream is reopened at once at the next replica (with one address, the same one),
    a standby's refusal sends it to the leader it names, and rounds in which none leads are spaced
    by the failover backoff (:mod:`sarcomm.common.client.replicas`). With replicas
    (``a:50051,b:50051``) a stream whose reports go unanswered for :data:`SILENT_BEATS` intervals
    (a hung leader: its connection stays up) is given up for another replica too: a new leader
    gives members ``--reconnect-grace`` to re-attach, and they do within about a second of its
    taking over.
    Ranks keep running meanwhile: collectives never depend on the coordinator being up. Any other failure
    (``UNAUTHENTICATED`` ...), or an exception from ``reports()``, ends the iteration by raising it
    (gRPC statuses as their :mod:`sarcomm.common.errors` class).

    ``connected`` says whether the current stream has had an answer. Use as an async context
    manager; leaving it ends the stream in order (a half-close), which the coordinator tells apart
    from a broken stream: a broken one means the reporter most likely died, and the members it
    reported fail unless another stream reports them within one interval.

    ``by_exception=True`` (the ``sar-worker`` agent; ``job``: its members' job) takes the
    :class:`~sarcomm.common.messages.ReportPolicy` a coordinator offers on a stream: from then on
    ``reports()`` is still called every interval, but each request carries ``by_exception`` and only
    what :func:`~sarcomm.common.client.by_exception.decide` says goes (an empty request renews the
    lease); a ``progress_wanted`` answer wakes the writer so that the job's members go at once. Each
    new stream (a reconnect, a failover) starts over: a full report, then per-interval reports until
    that coordinator offers the policy (one that never does is an older one: per-interval
    throughout). ``policy`` is the policy taken on the current stream (None: per-interval).
    """

    def __init__(
        self,
        replicas: Replicas,
        reports: Callable[[], Sequence[MemberReport]],
        interval: float,
        *,
        stream_timeout: float = 3600.0,
        by_exception: bool = False,
        job: str = "",
    ) -> None:
        durations.checked(interval, f"interval={interval!r}")
        if not stream_timeout > interval:
            raise InvalidArgumentError(
                f"stream_timeout={stream_timeout!r} must be longer than the interval ({interval!r} s)."
            )
        self._replicas = replicas
        self._reports = reports
        self.interval = float(interval)
        # What the caller asked for; the coordinator's answers may make the beats faster (never
        # slower than this): a coordinator restarted with a shorter interval is followed at once.
        self._configured = self.interval
        self._wake = asyncio.Event()
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
        # Set by the first answer on any stream: the coordinator has heard from this reporter.
        self._first_answer = asyncio.Event()
        # The replica the current stream goes to; since when a report of it waits for an answer.
        self._target = replicas.target
        self._unanswered_since: float | None = None
        # Reports by exception: whether to take an offered policy; per stream, the policy taken,
        # what was sent, and the progress asks (job: Unix time of the ask).
        self._by_exception = by_exception
        self._job = job
        self.policy: ReportPolicy | None = None
        self._sent = SentState()
        self._asked: dict[str, float] = {}
        #: Requests written, all streams together (for tests and benchmarks).
        self.requests_sent = 0

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
        that, e.g. while the coordinator is unreachable); waits for the background task.

        Cancellable: a caller cancelled while it waits gets its ``CancelledError`` (the background
        task is cancelled, not waited for); only the task's own end is kept quiet."""
        task, self._task = self._task, None
        self._ended = True
        self._closing.set()
        self._wake.set()
        if task is None:
            return
        try:
            if not task.done():
                # The writer half-closes and the coordinator ends the stream. asyncio.wait neither
                # cancels the task at the timeout nor raises what the task raised; it raises only
                # this caller's own cancellation.
                await asyncio.wait({task}, timeout=_ORDERLY_CLOSE_S)
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=5.0)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: asyncio would log it as never retrieved

    @property
    def ended(self) -> bool:
        """Whether the stream is over for good: closed, or ended by an error (the iteration raises it)."""
        return self._ended

    async def first_answer(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the coordinator's first answer on this stream (on
        any of its reopened streams); True once it came. A member the coordinator has never heard
        from is failed after the liveness timeout, so a process that may hold the GIL right after it
        registered (a long C call) waits for this first: from then on the stream's connection, whose
        keepalive pings gRPC's core answers without the GIL, stands for it.

        Returns False at once when the stream has ended (closed, or refused: the iteration raises
        why), or was never started."""
        task = self._task
        if task is None or task.done():
            return self._first_answer.is_set()
        answered = asyncio.ensure_future(self._first_answer.wait())
        try:
            await asyncio.wait({answered, task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            answered.cancel()
        return self._first_answer.is_set()

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
                request = self._request()
            except Exception as exc:  # a broken callback must not silently stop the heartbeats
                self._queue.put_nowait(exc)
                return
            if request is not None:
                if self._unanswered_since is None:
                    self._unanswered_since = time.monotonic()
                self.requests_sent += 1
                await call.write(request)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
        await call.write(pb.HeartbeatRequest(closing=True))
        await call.done_writing()

    def _request(self) -> pb.HeartbeatRequest | None:
        """This interval's request: every report (per-interval; none when there are none), or
        what the policy taken says goes (None: nothing, the lease is not due)."""
        reports = self._reports()
        policy = self.policy
        if policy is None:
            return pb.HeartbeatRequest(reports=[r.to_proto() for r in reports]) if reports else None
        if self._replicas.replicated and policy.lease_seconds > REPLICATED_LEASE_S:
            policy = dataclasses.replace(policy, lease_seconds=REPLICATED_LEASE_S)
        decision = decide(reports, policy, time.time(), self._asked, self._sent, self._job)
        if not decision.send:
            return None
        return pb.HeartbeatRequest(reports=[r.to_proto() for r in decision.reports], by_exception=True)

    def _take(self, reply: HeartbeatReply) -> None:
        """Follow a by-exception answer: take (or update) the policy offered, note progress asks;
        either wakes the writer so that what it changes goes at once."""
        if reply.policy is not None and reply.policy != self.policy:
            if self.policy is None:
                log.info(
                    "Heartbeat stream to %s: reporting by exception (lease every %g s)",
                    self._target, reply.policy.lease_seconds,
                )  # fmt: skip
            self.policy = reply.policy
            self._wake.set()
        if reply.progress_wanted:
            now = time.time()
            for job in reply.progress_wanted:
                self._asked[job] = now
            self._wake.set()

    async def _reader(
        self, call: grpc.aio.StreamStreamCall[pb.HeartbeatRequest, pb.HeartbeatResponse]
    ) -> None:
        async for resp in call:
            self._unanswered_since = None
            if not self.connected:
                self._replicas.answered(self._target)
            self.connected = True
            self._first_answer.set()
            reply = HeartbeatReply.from_proto(resp)
            paced = paced_interval(self._configured, reply.heartbeat_interval)
            if paced != self.interval:
                log.info(
                    "heartbeating every %g s: the coordinator at %s expects reports every %g s",
                    paced, self._target, reply.heartbeat_interval,
                )  # fmt: skip
                self.interval = paced
                self._wake.set()  # the next report goes at the new pace, not after the old interval
            if self._by_exception:
                self._take(reply)
            for line in reply.refused:  # the coordinator tells each once; the rest was taken
                log.warning("the coordinator at %s dropped from a heartbeat: %s", self._target, line)
            self._queue.put_nowait(reply)

    async def _one_stream(self) -> float | None:
        """Run one stream until it ends; returns the seconds to wait before opening another one,
        or None when none should be."""
        replicas = self._replicas
        self._target = target = await replicas.replica("Heartbeat")
        started = time.monotonic()
        call = replicas.stub_for(target).Heartbeat(
            None, timeout=self.stream_timeout, metadata=replicas.metadata, wait_for_ready=False
        )
        self._unanswered_since = None
        # A new stream starts per-interval with a full report and waits for this coordinator's offer.
        self.policy, self._sent, self._asked = None, SentState(), {}
        reader = asyncio.ensure_future(self._reader(call))
        writer = asyncio.ensure_future(self._writer(call))
        tasks = {reader, writer}
        # A silent leader is left only for another replica (one address: its keepalive decides).
        watchdog = asyncio.ensure_future(self._silence()) if replicas.replicated else None
        if watchdog is not None:
            tasks.add(watchdog)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if watchdog in done:
                silent = time.monotonic() - (self._unanswered_since or started)
                log.warning(
                    "Heartbeat stream to %s: no answer for %.1f s; trying the other coordinators; ranks "
                    "keep running", target, silent,
                )  # fmt: skip
                self._was_connected = self.connected
                self.connected = False
                return self._pause(replicas.silent(target, f"no answer for {silent:.0f} s"))
            if writer in done and writer.exception() is None:
                if self._closing.is_set():
                    # Half-closed: let the coordinator end the stream before anything cancels it,
                    # or it would take the end for a broken stream.
                    await asyncio.wait({reader}, timeout=_ORDERLY_CLOSE_S)
                return None  # closing, or reports() raised and its error is queued
            # A failed write means the call is over; the reader has the status.
            await asyncio.wait({reader}, timeout=self.interval + 5.0)
            err = reader.exception() if reader.done() else None
            if self._closing.is_set():
                return None
            if not reader.done() or err is None:
                log.info("Heartbeat stream to %s closed; reopening it", target)
                return self._pause(None)
            if not isinstance(err, grpc.aio.AioRpcError):
                raise err
            code = err.code()
            own_deadline = (
                code is grpc.StatusCode.DEADLINE_EXCEEDED
                and time.monotonic() - started >= self.stream_timeout - 0.05
            )
            failover = None if own_deadline else replicas.after_failure(target, err)
            # connection_broke: a coordinator killed mid-call can end the stream with grpc core's
            # INTERNAL rather than UNAVAILABLE; that is a broken connection too, not an answer.
            if failover is not None or own_deadline or connection_broke(err):
                if self.connected and not own_deadline:
                    log.warning(
                        "Heartbeat stream to %s ended (%s: %s); reopening it; ranks keep running",
                        target, code.name, err.details(),
                    )  # fmt: skip
                self._was_connected = self.connected
                self.connected = False
                return self._pause(failover)
            self._queue.put_nowait(replicas.translate(err, "Heartbeat", self.stream_timeout, started))
            return None
        finally:
            for task in tasks:
                task.cancel()
            call.cancel()
            await asyncio.wait(tasks, timeout=5.0)
            for task in tasks:  # retrieve results so asyncio does not log them as lost
                if task.done() and not task.cancelled():
                    task.exception()

    async def _silence(self) -> None:
        """Return once a report has waited :data:`SILENT_BEATS` intervals (at least
        :data:`SILENT_MIN_S`) for its answer. Only a request sent and not answered counts: a stream
        by exception sends seldom (a lease, a change), and each request still gets its answer."""
        while True:
            await asyncio.sleep(self.interval)
            waiting = self._unanswered_since
            limit = max(SILENT_BEATS * self.interval, SILENT_MIN_S)
            if waiting is not None and time.monotonic() - waiting > limit:
                return

    def _pause(self, failover: float | None) -> float:
        """Seconds before the next stream. A stream that had answers is reopened at once (jittered,
        so that reporters do not all arrive in one instant): the coordinator judges the members of
        a broken stream after one interval. With replicas, the failover's wait (none before the
        first other replica). Otherwise one interval between streams, so that a coordinator that
        answers at once with an error (e.g. while shutting down) is not hammered; waiting for a
        restart is :meth:`~sarcomm.common.client.replicas.Replicas.replica`'s, with backoff and
        jitter."""
        quick, self._was_connected = self._was_connected, False
        jitter = random.uniform(0.0, 0.1) * self.interval if quick else 0.0
        if failover is not None:
            return failover + jitter
        return jitter if quick else self.interval

    async def _run(self) -> None:
        try:
            pause = await self._one_stream()
            while pause is not None and not self._closing.is_set():
                await asyncio.sleep(pause)
                pause = await self._one_stream()
        finally:
            self._ended = True
            self._queue.put_nowait(None)
