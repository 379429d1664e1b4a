"""The torchrun plugin's threads and ends, in this process: a TimeoutError the call raises is not
the loop thread's own deadline (a node left alone gets ``RendezvousTimeoutError`` at its
``join_timeout``), heartbeat status of an earlier generation never overwrites a later one's, a
heartbeat stream's close lets its caller's cancellation through, and ``shutdown()`` (called by
torch's launcher in a ``finally``) never hides the error the launcher is raising. Real coordinator
on port 0 where one is needed (tests/coordinator_fixture.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.loop_thread import LoopThread
from sarcomm.common.constants import EventKind
from sarcomm.common.errors import JoinTimeoutError
from sarcomm.common.messages import Event, HeartbeatReply, MemberReport
from sarcomm.worker.torchrun.handler import SarcommRendezvousHandler
from sarcomm.worker.torchrun.session import GenerationStatus, RendezvousSession
from sarcomm.worker.torchrun.settings import RendezvousSettings
from tests.coordinator_fixture import InProcessCoordinator, in_process_coordinator
from tests.helpers import FakeClock, free_port

#: Bounds every wait here: each thing waited for comes at once or at a join timeout of 1 s.
WAIT_S = 15.0


@pytest.fixture
async def coordinator() -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(FakeClock()) as coord:
        yield coord


def settings(
    coord: InProcessCoordinator, run_id: str, low: int, high: int, **conf: str
) -> RendezvousSettings:
    params = RendezvousParameters("sarcomm", coord.target, run_id, low, high, **conf)
    return RendezvousSettings.from_parameters(params, {})


def test_the_loop_thread_lets_a_timeout_error_of_the_call_through_as_it_was_raised() -> None:
    thread = LoopThread("test-loop")
    try:

        async def join_timed_out() -> None:
            raise JoinTimeoutError("join_timeout_seconds 4: job 'x' generation 1 did not form in time")

        with pytest.raises(JoinTimeoutError, match=r"^join_timeout_seconds 4: job 'x'"):
            thread.run(join_timed_out(), 44.0)

        cancelled = asyncio.Event()

        async def hangs() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        with pytest.raises(TimeoutError, match=r"^a coordinator call did not finish within 0\.1 s$") as own:
            thread.run(hangs(), 0.1)
        assert not isinstance(own.value, JoinTimeoutError)
        deadline = time.monotonic() + WAIT_S
        while not cancelled.is_set():  # the call its deadline cut is cancelled
            assert time.monotonic() < deadline, "the cut call was not cancelled"
            time.sleep(0.01)
    finally:
        thread.stop()


async def test_a_node_left_alone_gets_rendezvous_timeout_error_at_its_join_timeout(
    coordinator: InProcessCoordinator,
) -> None:
    s = settings(coordinator, "alone", 2, 2, join_timeout="1")
    handler = SarcommRendezvousHandler(s, RendezvousSession(s), environ={})
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousTimeoutError) as raised:
            await asyncio.wait_for(asyncio.to_thread(handler.next_rendezvous), WAIT_S)
        took = time.monotonic() - started
    finally:
        await asyncio.to_thread(handler.shutdown)
    message = str(raised.value)
    assert message.startswith("job alone: no world formed within --rdzv-conf join_timeout=1 s: "), message
    assert "join_timeout_seconds 1: job 'alone' generation 1 did not form in time: 1 of 2" in message, message
    # At the join timeout (the coordinator's answer), well before the client's deadline (3 s) and
    # nowhere near the loop thread's (41 s).
    assert 0.9 <= took < 3.0, took


async def test_news_of_an_earlier_generation_never_overwrites_a_later_ones(
    coordinator: InProcessCoordinator,
) -> None:
    session = RendezvousSession(settings(coordinator, "status", 1, 1))
    try:
        first = await asyncio.to_thread(session.join, free_port(), None)
        member = first.assignments[0]
        second = await asyncio.to_thread(session.join, free_port(), (member.member_id, member.secret))
        assert (first.generation, second.generation) == (1, 2)
        assert session.status == GenerationStatus(2)
        # What the first generation's heartbeat watcher, still running on the loop thread, hears
        # after the agent's thread joined the second: the re-rendezvous that ended generation 1.
        late = HeartbeatReply(events=(Event(EventKind.JOB_RESTARTING, "status", 1, reason="re-join"),))
        stop = await asyncio.to_thread(session._hear, late, first, member.member_id)
        assert session.status == GenerationStatus(2)  # generation 2 runs: no node waits, nothing ended
        assert stop  # that watcher ends
    finally:
        await asyncio.to_thread(session.close)


async def test_closing_a_heartbeat_stream_lets_the_callers_cancellation_through() -> None:
    client = CoordinatorClient(f"127.0.0.1:{free_port()}", timeout=5.0)  # nothing listens there
    client.open()
    stream = client.heartbeats(lambda: [MemberReport("m", "s")], 0.5)
    stream.start()
    await asyncio.sleep(0.05)  # the stream's task tries to connect
    closing = asyncio.ensure_future(stream.aclose())
    await asyncio.sleep(0.05)  # aclose waits for the stream's task to end in order
    assert not closing.done()
    closing.cancel()
    await asyncio.wait({closing}, timeout=WAIT_S)
    assert closing.cancelled()  # not swallowed: the caller's cancellation reaches it
    await client.close()


class _LoopThreadStuck(RendezvousSession):
    """A session whose coordinator calls end at the loop thread's own deadline. For real that takes
    the client's timeout plus 10 s (40 s) of a loop that does not come round; raised here at once,
    with the loop thread's own error."""

    def leave(self, member_id: str, secret: str, exit_code: int, reason: str) -> str:
        raise TimeoutError("a coordinator call did not finish within 40 s")

    def stop_heartbeats(self) -> None:
        super().stop_heartbeats()
        if self._closing:
            raise TimeoutError("a coordinator call did not finish within 40 s")

    _closing = False

    def close(self) -> None:
        self._closing = True
        super().close()


async def test_shutdown_never_hides_the_error_torchs_launcher_is_raising(
    coordinator: InProcessCoordinator,
) -> None:
    s = settings(coordinator, "hide", 1, 1)
    handler = SarcommRendezvousHandler(s, _LoopThreadStuck(s), environ={})
    await asyncio.to_thread(handler.next_rendezvous)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file="")
    heard: list[bool] = []

    def launcher() -> None:
        # torch's launcher: ``try: agent.run() ... finally: rdzv_handler.shutdown()``.
        try:
            raise ChildFailedError("train.py", {0: failure})
        finally:
            heard.append(handler.shutdown())

    with pytest.raises(ChildFailedError):
        await asyncio.to_thread(launcher)
    assert heard == [False]  # the leave was not heard, and said so in a warning
