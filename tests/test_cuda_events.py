"""The CUDA-event timing of the library's calls on CUDA tensors (:mod:`cuda_events`), in process.

The events are a FAKE of ``torch.cuda.Event(enable_timing=True)`` (``record``, ``query``,
``elapsed_time``): there is no GPU here. The fake GPU completes events in the order they were
recorded, as one stream does, when the test advances it; ``elapsed_time`` is the difference of
their GPU times in milliseconds. ``scripts/gpu-check.sh`` runs the real events on a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import generate_latest

from sarcomm.worker.library import metrics
from sarcomm.worker.library.collectives.timing import CollectiveHandle
from sarcomm.worker.library.cuda_events import EventTimer
from sarcomm.worker.library.metrics import CollectiveStats

pytestmark = pytest.mark.fast


class FakeGpu:
    """One stream: event n completes once ``done`` > n; its GPU time is ``times[n]`` ms."""

    def __init__(self) -> None:
        self.recorded = 0
        self.done = 0
        self.times: list[float] = []
        self.fail: Exception | None = None

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.index = -1

    def record(self) -> None:
        self.index = self.gpu.recorded
        self.gpu.recorded += 1
        self.gpu.times.append(self.index * 1.5)  # 1.5 ms of GPU time between events

    def query(self) -> bool:
        if self.gpu.fail is not None:
            raise self.gpu.fail
        return self.index < self.gpu.done

    def elapsed_time(self, end: Any) -> float:
        return float(self.gpu.times[end.index] - self.gpu.times[self.index])


def _timer(gpu: FakeGpu, said: list[str], max_pending: int = 8) -> EventTimer:
    return EventTimer(gpu.event, said.append, max_pending)


def _call(timer: EventTimer, stats: CollectiveStats, nbytes: int) -> None:
    begun = timer.begin()
    assert begun is not None
    timer.end(begun, stats, nbytes)


def test_pairs_wait_for_the_gpu_and_are_recorded_in_order_without_blocking() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_reduce", "nccl")
    for nbytes in (10, 20, 30):
        _call(timer, stats, nbytes)
    assert timer.pending() == 3
    assert stats.snapshot().count == 0
    gpu.done = 3  # events 0 to 2: the first pair and the second's start: one pair done
    assert timer.poll() == 1
    snap = stats.snapshot()
    assert (snap.count, snap.bytes_sent, snap.sum_seconds) == (1, 10, 0.0015)
    gpu.done = 6  # all done: the rest, oldest first
    assert timer.poll() == 2
    snap = stats.snapshot()
    assert (snap.count, snap.bytes_sent, timer.pending(), said) == (3, 60, 0, [])
    assert snap.sum_seconds == pytest.approx(0.0045)


def test_a_pair_not_done_holds_back_the_later_ones() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    first, second = CollectiveStats("broadcast", "nccl"), CollectiveStats("all_reduce", "nccl")
    _call(timer, first, 1)
    _call(timer, second, 2)
    gpu.done = 1  # only the first pair's start
    assert timer.poll() == 0
    assert (first.snapshot().count, second.snapshot().count, timer.pending()) == (0, 0, 2)


def test_the_next_call_records_what_is_done() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_gather", "nccl")
    _call(timer, stats, 5)
    gpu.done = 2
    _call(timer, stats, 5)  # its end polls
    assert (stats.snapshot().count, timer.pending()) == (1, 1)


def test_a_full_queue_drops_its_oldest_and_says_so_once() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said, max_pending=3)
    stats = CollectiveStats("all_reduce", "nccl")
    for _ in range(6):  # a stream that never progresses
        _call(timer, stats, 1)
    assert (timer.pending(), timer.dropped) == (3, 3)
    assert said == [
        "more than 3 library collectives on CUDA pending on the GPU: the oldest go unrecorded "
        "(is a stream stuck?)"
    ]
    gpu.done = gpu.recorded
    assert timer.poll() == 3  # the three newest
    assert stats.snapshot().count == 3


def test_close_with_pairs_pending_never_waits_or_raises() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_reduce", "nccl")
    _call(timer, stats, 1)
    begun = timer.begin()
    assert begun is not None
    timer.close()  # the GPU never finishes: nothing waits for it
    assert timer.pending() == 0
    timer.end(begun, stats, 1)  # a call that straddled the close: dropped
    assert timer.begin() is None
    assert timer.pending() == 0
    gpu.done = gpu.recorded
    assert timer.poll() == 0
    assert stats.snapshot().count == 0
    assert said == []


def test_a_cuda_error_while_polling_turns_the_timer_off_once() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_reduce", "nccl")
    _call(timer, stats, 1)
    gpu.fail = RuntimeError("CUDA error: driver shutting down")
    assert timer.poll() == 0
    _call_after = timer.begin()
    assert _call_after is None
    assert timer.pending() == 0
    assert said == [
        "CUDA events for the library's calls are off: RuntimeError: CUDA error: driver shutting down"
    ]


def test_a_scrape_records_what_the_gpu_finished() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = metrics.collective_stats("cuda_events_test_op", "nccl")
    _call(timer, stats, 7)
    gpu.done = 2
    metrics.set_before_scrape("cuda_events_test", timer.poll)
    try:
        text = generate_latest(metrics.REGISTRY).decode()
    finally:
        metrics.set_before_scrape("cuda_events_test", None)
    assert 'sar_collective_bytes_total{backend="nccl",op="cuda_events_test_op"} 7.0' in text
    assert 'sar_collective_duration_seconds_count{backend="nccl",op="cuda_events_test_op"} 1.0' in text


class FakeWork:
    """A FAKE of an nccl ``dist.Work`` (no GPU here): ``wait()`` returns at once, as nccl's does,
    having made the current stream wait for the collective (here: nothing to do)."""

    def __init__(self, completed: bool = True) -> None:
        self.completed = completed
        self.waits = 0

    def wait(self, timeout: object = None) -> bool:
        self.waits += 1
        return True

    def is_completed(self) -> bool:
        return self.completed

    def get_future(self) -> Any:
        raise NotImplementedError


def test_an_async_call_on_cuda_is_timed_by_events_from_the_call_to_after_its_wait() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_gather_into_tensor", "nccl")
    begun = timer.begin()  # what timed() records before the call
    for _ in range(2):  # the caller's own kernels between the call and wait(): they count too
        gpu.event().record()
    handle = CollectiveHandle(FakeWork(), stats, 0, 64, _begun=begun, _events=timer)
    assert handle.wait() is True
    assert (stats.snapshot().count, timer.pending()) == (0, 1)  # never blocks on the GPU
    gpu.done = gpu.recorded
    assert timer.poll() == 1
    snap = stats.snapshot()
    # From the start event (#0) to the end event recorded after wait() (#3): 3 x 1.5 ms, on the GPU.
    assert (snap.count, snap.bytes_sent, said) == (1, 64, [])
    assert snap.sum_seconds == pytest.approx(0.0045)
    assert handle.wait() is True  # idempotent: recorded once
    gpu.done = gpu.recorded
    timer.poll()
    assert stats.snapshot().count == 1


def test_an_async_call_on_cuda_only_polled_with_is_completed_records_the_hosts_time() -> None:
    gpu, said = FakeGpu(), list[str]()
    timer = _timer(gpu, said)
    stats = CollectiveStats("all_reduce", "nccl")
    # Without wait() the current stream never waits for the collective: an event recorded on it
    # would not end with it, so the host's time from the call is recorded instead.
    handle = CollectiveHandle(
        FakeWork(), stats, time.perf_counter_ns(), 8, _begun=timer.begin(), _events=timer
    )
    assert handle.is_completed()
    assert (stats.snapshot().count, timer.pending()) == (1, 0)
