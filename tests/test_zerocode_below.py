"""The library's own calls dispatch below zero-code's kernels (fast, in process: a one-rank gloo
group on a HashStore, threads only).

A kernel like zerocode's (a Python kernel at AutogradCPU on torch's c10d ops, counting the calls
that reach it) stands in front of allreduce_, broadcast_ and alltoall_. With the wrappers'
dispatch-below switch on (what zero-code turns on), the library's calls never reach it, their
values are right and each is recorded once by its wrapper; a bare ``dist.all_reduce`` still
reaches it; with the switch off (before this change) the library's calls reach it too.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from sarcomm.worker.library.collectives import timing
from sarcomm.worker.library.metrics import CollectiveStats

pytestmark = pytest.mark.fast

_BELOW = torch._C._after_autograd_keyset


@pytest.fixture
def counting_kernels() -> Iterator[dict[str, int]]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    hits: dict[str, int] = {}
    library = torch.library.Library("c10d", "IMPL")  # type: ignore[no-untyped-call]
    for name in ("allreduce_", "broadcast_", "alltoall_"):
        redispatch = getattr(torch.ops.c10d, name).default.redispatch

        def kernel(keyset: Any, *args: Any, _name: str = name, _redispatch: Any = redispatch) -> Any:
            hits[_name] = hits.get(_name, 0) + 1
            return _redispatch(keyset & _BELOW, *args)

        library.impl(name, kernel, "AutogradCPU", with_keyset=True)  # type: ignore[no-untyped-call]
    try:
        yield hits
    finally:
        library._destroy()  # type: ignore[no-untyped-call]
        timing.set_dispatch_below(False)
        dist.destroy_process_group()


def _library_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, CollectiveStats]:
    """One call of each wrapper path (the hot all_reduce, timed(), timed_all_to_all); their values
    checked; the stats they recorded into."""
    stats = {op: CollectiveStats(op, "gloo") for op in ("all_reduce", "broadcast", "all_to_all")}
    state = types.SimpleNamespace(ready=True, cpu_group=None, stats=stats, cuda_events=None)
    monkeypatch.setattr(timing, "_STATE", state)
    tensor = torch.tensor([1.5, 2.0])
    assert timing.all_reduce(tensor) is None
    assert tensor.tolist() == [1.5, 2.0]  # one rank: the sum is itself
    tensor = torch.tensor([7.0])
    assert timing.timed(stats["broadcast"], 4, dist.broadcast, tensor, 0) is None
    assert tensor.tolist() == [7.0]
    recv = [torch.zeros(3)]
    timing.timed_all_to_all(stats["all_to_all"], 0, recv, [torch.tensor([1.0, 2.0, 3.0])], None)
    assert recv[0].tolist() == [1.0, 2.0, 3.0]
    return stats


def test_library_calls_skip_the_kernels_and_are_recorded_once(
    counting_kernels: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    timing.set_dispatch_below(True)
    stats = _library_calls(monkeypatch)
    assert counting_kernels == {}
    assert {op: s.snapshot().count for op, s in stats.items()} == {
        "all_reduce": 1, "broadcast": 1, "all_to_all": 1,
    }  # fmt: skip
    # the switch is per call: after them, a bare call (a user's, DDP's) reaches the kernel again
    tensor = torch.tensor([3.0])
    dist.all_reduce(tensor)
    assert tensor.tolist() == [3.0]
    assert counting_kernels == {"allreduce_": 1}
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)


def test_without_the_switch_the_library_calls_reach_the_kernels(
    counting_kernels: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _library_calls(monkeypatch)
    assert counting_kernels == {"allreduce_": 1, "broadcast_": 1, "alltoall_": 1}


def test_a_failing_call_leaves_the_dispatch_as_it_was(
    counting_kernels: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    timing.set_dispatch_below(True)
    stats = CollectiveStats("broadcast", "gloo")
    with pytest.raises(RuntimeError, match="invalid root rank"):
        timing.timed(stats, 4, dist.broadcast, torch.zeros(1), 5)  # no rank 5 in a world of one
    assert stats.snapshot().errors == 1
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)


def test_dispatch_below_around_a_wrappers_inner_collectives(counting_kernels: dict[str, int]) -> None:
    # What the all_to_all exchanges, model sync and SAR's tensor exchange put around their calls.
    tensor = torch.tensor([2.0])
    with timing.dispatch_below():
        dist.all_reduce(tensor)
    assert counting_kernels == {"allreduce_": 1}  # the switch off: the kernel sees it
    timing.set_dispatch_below(True)
    with timing.dispatch_below(), timing.dispatch_below():  # nested: the outer one restores
        dist.all_reduce(tensor)
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)
    assert tensor.tolist() == [2.0]
    assert counting_kernels == {"allreduce_": 1}
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)
