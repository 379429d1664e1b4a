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
        host=f"p{config['proc']}-a{agent}",
        interfaces=[lo],
        store_port=29500,
        join_timeout_seconds=config["join_timeout"],
        # A single-rank member sends no member list (the coordinator deals it local rank 0).
        members=[pb.MemberSpec(local_rank=k) for k in range(members)] if members > 1 else [],
    )
    return request.SerializeToString()


def beat_requests(answer: pb.JoinResponse, now: float) -> tuple[bytes, bytes]:
    """Two serialized requests carrying every member's report, with progress one collective
    apart, as sar-worker sends them (each report names its rank's metrics endpoint)."""
    variants = []
    for seq in (1, 2):
        reports = [
            pb.MemberReport(
                member_id=a.member_id,
                secret=a.secret,
                progress=pb.Progress(seq=seq, op="all_reduce", in_collective=seq % 2 == 1, since=now),
                metrics_address=f"{LOOPBACK}:{20000 + a.rank % 40000}",
                age_seconds=REPORTED_AGE_S,
            )
            for a in answer.assignments
        ]
        variants.append(pb.HeartbeatRequest(reports=reports).SerializeToString())
    return variants[0], variants[1]


class Agents:
    """The agents of one process and what they measured."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        count = config["agents"]
        per_channel = config["channels"] or count
        self.channels = [own_channel(config["target"]) for _ in range(min(count, per_channel))]
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
        self.acked: list[float] = []
        self.latencies: list[tuple[float, float]] = []
        self.events: dict[int, float] = {}
        self.errors: list[str] = []
        self.calls: list[Any] = []
        self.stop = asyncio.Event()
        self.ack_bytes = b""

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
        interval = self.config["interval"]
        ack = pb.HeartbeatResponse(heartbeat_interval_seconds=self.config["coordinator_interval"])
        self.ack_bytes = ack.SerializeToString()
        streams = [
            ch.stream_stream(HEARTBEAT, request_serializer=_identity, response_deserializer=_identity)
            for ch in self.channels
        ]
        now = time.time()
        tasks = []
        for i, answer in enumerate(self.answers):
            if answer is None:
                continue
            call = streams[self.channel(i)](timeout=3600)  # type: ignore[call-arg]  # written to, not iterated
            self.calls.append(call)
            variants = beat_requests(answer, now)
            offset = (i * 0.618034) % 1.0 * interval  # spread over one interval, evenly
            tasks.append(asyncio.ensure_future(self._stream(i, call, variants, until, offset, timed)))
        await asyncio.gather(*tasks)
        start, end = window
        return {
            "written": sum(1 for t in self.written if start <= t < end),
            "acked": sum(1 for t in self.acked if start <= t < end),
            "latencies": [round(lat, 6) for at, lat in self.latencies if start <= at < end],
            "events": {str(k): v for k, v in self.events.items()},
            "streams": len(tasks),
            # Seconds from each agent's Join answer to its first beat written, and to its first ack.
            "first_written_s": _since(self.answered, self.first_written),
            "first_acked_s": _since(self.answered, self.first_acked),
        }

    async def _stream(
        self, agent: int, call: Any, variants: tuple[bytes, bytes], until: float, offset: float, timed: bool
    ) -> None:
        interval = self.config["interval"]
        sent: list[float] = []

        async def read() -> None:
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
                    return
                if data == self.ack_bytes:
                    now = time.monotonic()
                    self.acked.append(now)
                    if not self.first_acked[agent]:
                        self.first_acked[agent] = now
                    if sent:
                        at = sent.pop(0)
                        if timed:
                            self.latencies.append((at, now - at))
                elif agent not in self.events:
                    message = pb.HeartbeatResponse.FromString(data)
                    if message.events:
                        self.events[agent] = time.monotonic()
                    elif sent:  # an ack with unknown members: a written request answered
                        sent.pop(0)
                        self.acked.append(time.monotonic())

        reader = asyncio.ensure_future(read())
        try:
            next_at = time.monotonic() + offset
            beat = 0
            while next_at < until and not self.stop.is_set():
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                now = time.monotonic()
                sent.append(now)
                self.written.append(now)
                if not self.first_written[agent]:
                    self.first_written[agent] = now
                await call.write(variants[beat % 2])
                beat += 1
                next_at += interval
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), max(0.0, until - time.monotonic()))
            await call.write(pb.HeartbeatRequest(closing=True).SerializeToString())
            await call.done_writing()
            await asyncio.wait_for(reader, 30)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as error:
            # (InvalidStateError: a write after the coordinator ended the stream.)
            self.errors.append(f"Heartbeat: {error!r}"[:200])
        finally:
            reader.cancel()

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
        elif "fail" in command:
            _say({"failed_at": await agents.fail_one()})
        elif "results" in command:
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
