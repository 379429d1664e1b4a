"""Simulated agents for ``big_job.py``: cheap enough that a few processes on a 2-core machine offer
4,096 streams x 8 reports a second.

One process runs ``python load_agents.py CONFIG_JSON`` and talks to its parent in JSON lines (the
parent writes commands on stdin, the process answers on stdout):

- at start it opens its channels (``channels`` of them, agents spread over them; 0: one per agent)
  and answers ``{"ready": ...}``; every channel is a TCP connection of its own
  (:func:`harness.own_channel`), as a real agent's;
- ``{"join": T}``: at monotonic time T (one clock for every process on Linux) it sends every
  agent's ``Join`` at once (one call per agent with its ``members`` members) and answers with the
  time of each answer;
- ``{"beat": {"until": T, "window": [A, B]}}``: every agent opens its ``Heartbeat`` stream and
  writes one request a ``interval`` (its beats spread over the first interval) until T; the answer
  counts the requests written and acknowledged between A and B (the measured window), the ack
  latencies of the streams this process times (``timed``: every stream of a probe process), and the
  first event each stream received (a failure's fan-out);
  With ``protocol`` ``exception`` in the config, a stream whose first answer carries a
  ``policy`` switches, as sar-worker's agent does: every later request has ``by_exception`` set,
  an empty one every ``policy.lease_seconds`` renews the lease, and a full report of its ranks
  goes when the coordinator asks for progress (``progress_wanted``), when its ranks went quiet
  (``quiet_seconds`` inside one collective) or when a rank went silent (``silence_seconds``); a
  coordinator that offers no policy gets every rank's report every interval, as before. With
  ``reconnect``, a broken stream (a coordinator restarted) is opened again with a full report;
- ``{"lease": true}``: the longest lease offered to a stream here (None: no policy), how many
  streams report by exception, have had an answer, were asked for progress, and were opened again
  and answered after a broken one (with the last such answer's time);
- ``{"progress": {"seq": S, "in_collective": B}}``: every rank here stays at collective S from now
  (inside it or before it): a stall's waiting ranks, or the ranks it waits for;
- ``{"silence": true}``: the first rank of every agent here stops: its reports carry a growing age
  (by exception: one report once it is older than ``silence_seconds``), as a real agent's;
- ``{"stick": true}``: every agent loop here is stuck: streams stay open, nothing more is written;
- ``{"fail": true}``: the first member of the first agent leaves with exit code 1 (which fails the
  job); the answer is the monotonic time the Leave was sent;
- ``{"quit": true}``: streams end in order, channels close, the process exits.

Cheap: requests are built and serialized once per agent (two variants whose progress differs, sent
in turn, so the coordinator sees progress change at every beat as in training), written as bytes
through a stream whose serializer is the identity, and answers are read as bytes: an ack is
recognised by comparing bytes, and only an answer that is not an ack is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import own_channel

from sarcomm.common.client.channel import _OPTIONS as AGENT_CHANNEL_OPTIONS
from sarcomm.coordinator.fdlimit import raise_open_file_limit
from sarcomm.v1 import coordinator_pb2 as pb

JOIN = "/sarcomm.v1.Coordinator/Join"
HEARTBEAT = "/sarcomm.v1.Coordinator/Heartbeat"
LEAVE = "/sarcomm.v1.Coordinator/Leave"
LOOPBACK = "127.0.0.1"
#: What a member reports as its age (seconds since its own last sign of life), as agents do.
REPORTED_AGE_S = 0.05


def _identity(data: bytes) -> bytes:
    return data


def join_request(config: dict[str, Any], agent: int) -> bytes:
    """The serialized Join of one simulated agent (host ``p<proc>-a<agent>``)."""
    lo = pb.NetworkInterface(name="lo", addresses=[LOOPBACK], kind=pb.INTERFACE_KIND_LOOPBACK)
    members = config["members"]
    request = pb.JoinRequest(
        job=config["job"],
        world_size=config["world"],
        host=f"{config.get('host_prefix') or 'p' + str(config['proc'])}-a{agent}",
        interfaces=[lo],
        store_port=29500,
        join_timeout_seconds=config["join_timeout"],
        # A single-rank member sends no member list (the coordinator deals it local rank 0).
        members=[pb.MemberSpec(local_rank=k) for k in range(members)] if members > 1 else [],
    )
    return request.SerializeToString()


def beat_requests(
    answer: pb.JoinResponse, now: float, seq: int = 0, in_collective: bool = False
) -> tuple[bytes, bytes]:
    """Two serialized requests carrying every member's report, with progress one collective
    apart, as sar-worker sends them (each report names its rank's metrics endpoint); with ``seq``,
    both at that collective (``in_collective`` or not), since ``now``."""
    variants = []
    for step in (seq, seq) if seq else (1, 2):
        inside = in_collective if seq else step % 2 == 1
        reports = [
            pb.MemberReport(
                member_id=a.member_id,
                secret=a.secret,
                progress=pb.Progress(seq=step, op="all_reduce", in_collective=inside, since=now),
                metrics_address=f"{LOOPBACK}:{20000 + a.rank % 40000}",
                age_seconds=REPORTED_AGE_S,
            )
            for a in answer.assignments
        ]
        variants.append(pb.HeartbeatRequest(reports=reports).SerializeToString())
    return variants[0], variants[1]


def _by_exception(request: bytes) -> bytes:
    """``request`` with ``by_exception`` set."""
    message = pb.HeartbeatRequest.FromString(request)
    message.by_exception = True
    return message.SerializeToString()


#: A reporter by exception's lease renewal: no reports.
EMPTY_BY_EXCEPTION = pb.HeartbeatRequest(by_exception=True).SerializeToString()


async def _sleep_until(at: float, wake: asyncio.Event | None) -> bool:
    """Sleep until monotonic ``at``, or until ``wake`` is set (then True)."""
    delay = max(0.0, at - time.monotonic())
    if wake is None:
        await asyncio.sleep(delay)
        return False
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), delay)
        return True
    return False


class Agents:
    """The agents of one process and what they measured."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        count = config["agents"]
        per_channel = config["channels"] or count
        # The real agent's channel options (its keepalive pings, its reconnect backoff of 0.2 to 1 s).
        self.channels = [
            own_channel(config["target"], AGENT_CHANNEL_OPTIONS) for _ in range(min(count, per_channel))
        ]
        self.joins = [
            ch.unary_unary(
                JOIN, request_serializer=_identity, response_deserializer=pb.JoinResponse.FromString
            )
            for ch in self.channels
        ]
        self.requests = [join_request(config, i) for i in range(count)]
        self.answers: list[pb.JoinResponse | None] = [None] * count
        # When each agent got its Join answer, wrote its first beat, and had its first ack.
        self.answered = [0.0] * count
        self.first_written = [0.0] * count
        self.first_acked = [0.0] * count
        self.written: list[float] = []
        #: When each request that carried reports was written (the others renew a lease).
        self.reported: list[float] = []
        self.acked: list[float] = []
        self.latencies: list[tuple[float, float]] = []
        self.events: dict[int, float] = {}
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self.ack_bytes = b""
        self.heartbeats: list[Any] = []
        #: The measured window, when the parent names it only at the end.
        self.window: tuple[float, float] | None = None
        self.streams: dict[int, Stream] = {}

    def channel(self, agent: int) -> int:
        return agent % len(self.channels)

    async def connect(self) -> None:
        await asyncio.gather(*(ch.channel_ready() for ch in self.channels))

    async def join_all(self, at: float) -> list[float]:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        timeout = self.config["join_timeout"] + 10

        async def one(i: int) -> float:
            try:
                self.answers[i] = await self.joins[self.channel(i)](self.requests[i], timeout=timeout)
            except grpc.aio.AioRpcError as error:
                self.errors.append(f"Join: {error.code().name}: {error.details()}"[:200])
                return -1.0
            self.answered[i] = time.monotonic()
            return self.answered[i]

        return await asyncio.gather(*(one(i) for i in range(len(self.requests))))

    async def beat_all(self, until: float, window: tuple[float, float], timed: bool) -> dict[str, Any]:
        ack = pb.HeartbeatResponse(heartbeat_interval_seconds=self.config["coordinator_interval"])
        self.ack_bytes = ack.SerializeToString()
        self.heartbeats = [
            ch.stream_stream(HEARTBEAT, request_serializer=_identity, response_deserializer=_identity)
            for ch in self.channels
        ]
        now = time.time()
        tasks = []
        interval = self.config["interval"]
        for i, answer in enumerate(self.answers):
            if answer is None:
                continue
            stream = Stream(self, i, answer, now)
            self.streams[i] = stream
            offset = (i * 0.618034) % 1.0 * interval  # spread over one interval, evenly
            tasks.append(asyncio.ensure_future(stream.run(until, offset, timed)))
        await asyncio.gather(*tasks)
        start, end = self.window or window
        streams = list(self.streams.values())
        return {
            "written": sum(1 for t in self.written if start <= t < end),
            "reported": sum(1 for t in self.reported if start <= t < end),
            "acked": sum(1 for t in self.acked if start <= t < end),
            "latencies": [round(lat, 6) for at, lat in self.latencies if start <= at < end],
            "events": {str(k): v for k, v in self.events.items()},
            "failed_events": {str(s.agent): s.failed_at for s in streams if s.failed_at},
            "streams": len(tasks),
            "by_exception": sum(1 for s in streams if s.lease is not None),
            "progress_asked": sum(s.asked for s in streams),
            "reattached": {str(s.agent): s.reattached for s in streams if s.reattached},
            "reconnects": sum(s.reconnects for s in streams),
            # Seconds from each agent's Join answer to its first beat written, and to its first ack.
            "first_written_s": _since(self.answered, self.first_written),
            "first_acked_s": _since(self.answered, self.first_acked),
        }

    def set_progress(self, seq: int, in_collective: bool) -> None:
        """Every agent's ranks now stay at collective ``seq`` (inside it or not): their reports
        carry that progress from now on; by exception, ranks inside it are reported quiet once
        ``quiet_seconds`` later, as an agent does."""
        since = time.time()
        for stream in self.streams.values():
            stream.set_variants(seq, in_collective, since)
            if in_collective:
                stream.quiet_from = time.monotonic()
                stream.wake.set()

    def silence(self) -> None:
        """The first rank of every agent here stops (its own sign of life ages from now)."""
        for stream in self.streams.values():
            stream.silent_from = time.monotonic()
            stream.wake.set()

    def stick(self) -> None:
        """Every agent's loop here is stuck: its streams stay open and write nothing more."""
        for stream in self.streams.values():
            stream.stuck = True

    async def fail_one(self) -> float:
        answer = next(a for a in self.answers if a is not None)
        leave = self.channels[0].unary_unary(
            LEAVE,
            request_serializer=pb.LeaveRequest.SerializeToString,
            response_deserializer=pb.LeaveResponse.FromString,
        )
        member = answer.assignments[0]
        sent = time.monotonic()
        try:
            await leave(
                pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=1), timeout=60
            )
        except grpc.aio.AioRpcError as error:  # e.g. the member was failed for silence already
            self.errors.append(f"Leave: {error.code().name}: {error.details()}"[:200])
            return 0.0
        return sent


class Stream:
    """One simulated agent's Heartbeat stream: per second (every rank's report every interval), or,
    once the coordinator offers a ``policy`` and the configured protocol is ``exception``, by
    exception (an empty request every ``lease_seconds``, a full report when asked for progress or
    when its ranks go quiet or silent). It reopens a broken stream (a coordinator restarted)."""

    def __init__(self, agents: Agents, agent: int, answer: pb.JoinResponse, now: float) -> None:
        self.agents = agents
        self.agent = agent
        self.answer = answer
        self.config = agents.config
        self.variants = beat_requests(answer, now)
        # (the variant outside a collective: a rank reported by exception is not quiet)
        self.exception_full = _by_exception(self.variants[1])
        self.lease: float | None = None
        self.silence_s = 0.0
        self.quiet_s = 0.0
        self.wake = asyncio.Event()
        self.want_full = False
        self.asked = 0
        self.quiet_from = 0.0
        self.silent_from = 0.0
        self.silence_told = False
        self.stuck = False
        self.failed_at = 0.0
        self.reattached = 0.0
        self.reconnects = 0
        self.sent: list[float] = []

    def set_variants(self, seq: int, in_collective: bool, since: float) -> None:
        fixed = beat_requests(self.answer, since, seq=seq, in_collective=in_collective)[0]
        self.variants = (fixed, fixed)
        self.exception_full = _by_exception(fixed)

    def _silent_request(self, by_exception: bool, base: bytes) -> bytes:
        """Every rank's report (``base``), the first rank's own sign of life as old as its silence."""
        request = pb.HeartbeatRequest.FromString(base)
        request.reports[0].age_seconds = time.monotonic() - self.silent_from + REPORTED_AGE_S
        request.by_exception = by_exception
        return request.SerializeToString()

    async def run(self, until: float, offset: float, timed: bool) -> None:
        agents = self.agents
        first = True
        while not agents.stop.is_set() and time.monotonic() < until:
            call = agents.heartbeats[agents.channel(self.agent)](timeout=3600)
            try:
                await self._one(call, until, offset if first else 0.0, timed)
                return
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, ConnectionError) as error:
                # (InvalidStateError: a write after the coordinator ended the stream.)
                if not self.config.get("reconnect"):
                    agents.errors.append(f"Heartbeat: {error!r}"[:200])
                    return
                self.reconnects += 1
                self.lease = None
                first = False
                call.cancel()
                await asyncio.sleep(0.1 + (self.agent * 0.618034) % 1.0 * 0.4)

    async def _one(self, call: Any, until: float, offset: float, timed: bool) -> None:
        agents = self.agents
        interval = self.config["interval"]
        exception = self.config.get("protocol") == "exception"
        reconnected = self.reconnects > 0
        sent = self.sent
        sent.clear()

        async def read() -> None:
            try:
                await take_answers()
            finally:
                self.wake.set()  # the stream ended: a writer waiting for its lease learns it now

        async def take_answers() -> None:
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
                    return
                now = time.monotonic()
                if reconnected and not self.reattached:
                    self.reattached = now
                if data == agents.ack_bytes:
                    agents.acked.append(now)
                    if not agents.first_acked[self.agent]:
                        agents.first_acked[self.agent] = now
                    if sent:
                        at = sent.pop(0)
                        if timed:
                            agents.latencies.append((at, now - at))
                    continue
                message = pb.HeartbeatResponse.FromString(data)
                if message.events:
                    agents.events.setdefault(self.agent, now)
                    if not self.failed_at and any(
                        e.kind == pb.JobEvent.MEMBER_FAILED for e in message.events
                    ):
                        self.failed_at = now
                if exception and message.HasField("policy") and message.policy.lease_seconds > 0:
                    self.lease = message.policy.lease_seconds
                    self.silence_s = message.policy.silence_seconds
                    self.quiet_s = message.policy.quiet_seconds
                if message.progress_wanted:
                    self.asked += 1
                    self.want_full = True
                    self.wake.set()
                if not message.events and not message.progress_wanted and sent:
                    sent.pop(0)  # an answer to a written request (with unknown members or a policy)
                    agents.acked.append(now)
                    if not agents.first_acked[self.agent]:
                        agents.first_acked[self.agent] = now

        async def write(data: bytes) -> None:
            now = time.monotonic()
            sent.append(now)
            agents.written.append(now)
            if data is not EMPTY_BY_EXCEPTION:
                agents.reported.append(now)
            if not agents.first_written[self.agent]:
                agents.first_written[self.agent] = now
            await call.write(data)

        reader = asyncio.ensure_future(read())
        try:
            next_at = time.monotonic() + offset
            # The first request is the variant outside a collective: a stream (re)opened late
            # never reports its ranks inside one since long ago (quiet, or a stall's waiters).
            beat = 1
            while not agents.stop.is_set():
                if self.lease is None:  # per second (or not offered the policy yet)
                    if next_at >= until:
                        break
                    await _sleep_until(next_at, self.wake if exception else None)
                    self.wake.clear()
                    if reader.done() and not agents.stop.is_set():
                        raise ConnectionError("the coordinator ended the stream")
                    if self.stuck:
                        break
                    if exception and self.switched():
                        next_at = time.monotonic()  # the lease's first renewal comes due at once
                        continue
                    request = self.variants[beat % 2]
                    if self.silent_from:
                        request = self._silent_request(False, request)
                    await write(request)
                    beat += 1
                    next_at += interval
                    continue
                # By exception: what changed, else the lease's renewal.
                due = min([t for t in (next_at, self._quiet_due(), self._silence_due()) if t] + [until])
                if time.monotonic() >= until:
                    break
                woken = await _sleep_until(due, self.wake)
                self.wake.clear()
                if reader.done() and not agents.stop.is_set():
                    raise ConnectionError("the coordinator ended the stream")
                if self.stuck:
                    break
                now = time.monotonic()
                if self.want_full or (self.quiet_from and now >= self._quiet_due()):
                    self.want_full = False
                    self.quiet_from = 0.0
                    full = self.exception_full
                    if self.silent_from:  # (its silent rank stays silent in every report)
                        full = self._silent_request(True, full)
                    await write(full)
                elif self.silent_from and not self.silence_told and now >= self._silence_due():
                    self.silence_told = True
                    await write(self._silent_request(True, self.exception_full))
                elif not woken and now >= next_at:
                    await write(EMPTY_BY_EXCEPTION)
                else:
                    continue
                next_at = time.monotonic() + self.lease
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(agents.stop.wait(), max(0.0, until - time.monotonic()))
            await call.write(pb.HeartbeatRequest(closing=True).SerializeToString())
            await call.done_writing()
            await asyncio.wait_for(reader, 30)
        except asyncio.TimeoutError as error:
            agents.errors.append(f"Heartbeat: {error!r}"[:200])
        finally:
            reader.cancel()

    def switched(self) -> bool:
        """Whether this stream reports by exception now (the coordinator offered a policy)."""
        return self.lease is not None

    def _quiet_due(self) -> float:
        return self.quiet_from + self.quiet_s if self.quiet_from else 0.0

    def _silence_due(self) -> float:
        return self.silent_from + self.silence_s if self.silent_from and not self.silence_told else 0.0


def _since(starts: list[float], ends: list[float]) -> list[float]:
    """Seconds from each start to its end, where both happened."""
    return [round(end - start, 3) for start, end in zip(starts, ends, strict=True) if start and end]


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main(config: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    agents = Agents(config)
    await agents.connect()
    _say({"ready": len(agents.channels)})
    beating: asyncio.Future[dict[str, Any]] | None = None
    while True:
        line = await reader.readline()
        if not line:
            break
        command = json.loads(line)
        if "join" in command:
            times = await agents.join_all(command["join"])
            _say({"joined": times, "errors": agents.errors[:5]})
        elif "beat" in command:
            beat = command["beat"]
            beating = asyncio.ensure_future(
                agents.beat_all(beat["until"], tuple(beat["window"]), config.get("timed", False))
            )
            _say({"beating": True})
        elif "lease" in command:
            leases = [s.lease for s in agents.streams.values() if s.lease is not None]
            streams = agents.streams.values()
            _say(
                {
                    "lease": max(leases) if leases else None,
                    "by_exception": len(leases),
                    "acked": sum(1 for t in agents.first_acked if t),
                    "asked": sum(1 for s in streams if s.asked),
                    "reattached": sum(1 for s in streams if s.reattached),
                    "last_reattached": max((s.reattached for s in streams), default=0.0),
                }
            )
        elif "progress" in command:
            agents.set_progress(command["progress"]["seq"], command["progress"]["in_collective"])
            _say({"progress": True})
        elif "silence" in command:
            agents.silence()
            _say({"silenced": time.monotonic()})
        elif "stick" in command:
            agents.stick()
            _say({"stuck": time.monotonic()})
        elif "fail" in command:
            _say({"failed_at": await agents.fail_one()})
        elif "results" in command:
            if isinstance(command["results"], dict):
                agents.window = tuple(command["results"]["window"])
            agents.stop.set()
            assert beating is not None
            result = await beating
            _say({"results": result, "errors": agents.errors[:5]})
        elif "quit" in command:
            break
    for channel in agents.channels:
        await channel.close(None)


if __name__ == "__main__":
    raise_open_file_limit()
    try:
        import uvloop

        uvloop.run(main(json.loads(sys.argv[1])))
    except ImportError:
        asyncio.run(main(json.loads(sys.argv[1])))
