"""The timing of every collective: the wrapper that records each call into the metrics.

Every sarcomm collective runs through :func:`timed` or :func:`timed_call` (or, for the common
``all_reduce``, an inlined copy of them): it notes the op in the progress hook the rank's agent
reads, measures the call's wall time, counts the bytes this rank sent and any error into
:mod:`sarcomm.worker.library.metrics` under the op and the backend that carried it, and turns a backend
error that follows a known peer failure into :class:`~sarcomm.common.errors.PeerFailedError`.
With ``async_op=True`` a :class:`CollectiveHandle` is returned and its ``wait()`` records the time
from the call to completion: on the host, or, for a call on CUDA tensors, by CUDA events (the end
event is recorded on the current stream once ``wait()`` has made it wait for the collective; work
the caller put on that stream between the call and ``wait()`` counts too, see docs/metrics.md).

``all_reduce`` lives here, beside the progress hook it reads: it is SAR's hot path, and its
whole cost is measured against a bare ``dist.all_reduce`` in ``benchmarks/overhead.py``, so it reads
this module's globals directly rather than through another module's attributes. For the same
reason the recording of all_to_all's equal-size path (:func:`timed_all_to_all`) is written out here
rather than going through :func:`timed`.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import torch
import torch.distributed as dist

from sarcomm.common.errors import FailedPreconditionError
from sarcomm.worker.library import comm, sar_keywords
from sarcomm.worker.library.backends import uses_cpu_side_group
from sarcomm.worker.library.comm import peer_failure_after
from sarcomm.worker.library.cuda_events import EventLike, EventTimer
from sarcomm.worker.library.metrics import CollectiveStats
from sarcomm.worker.library.services import add_progress_listener

__all__ = [
    "CollectiveHandle",
    "Completed",
    "DispatchBelow",
    "ProgressHook",
    "ReduceOpLike",
    "Unsupported",
    "all_reduce",
    "dispatch_below",
    "is_me",
    "optional_kwarg",
    "raise_failure",
    "raise_not_ready",
    "route",
    "set_dispatch_below",
    "set_progress_hook",
    "timed",
    "timed_all_to_all",
    "timed_call",
]

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType

_STATE: Final = comm.STATE
_SUM: Final = dist.ReduceOp.SUM
_now = time.perf_counter_ns
_T = TypeVar("_T")


class ProgressHook(Protocol):
    """Receives a note as each collective starts and ends (``sarcomm.worker.progress`` implements
    it, so that the agent can tell which collective a rank is stuck in). Both calls are on the hot
    path and must not block."""

    def enter(self, op: str) -> int: ...

    def leave(self) -> None: ...


_progress: ProgressHook | None = None

# Zero-code metrics (sarcomm.worker.library.zerocode) put a Python kernel in front of torch's c10d
# ops at the Autograd keys. A call of the library's own is recorded here, so while those kernels
# are on, the wrappers run their collective with the AutogradCPU key excluded from this thread's
# dispatch (the collective then goes straight to the backend's kernel, as it does below the
# Autograd key anyway): a CPU call never enters the Python kernel (about 55 us a call that it
# would only hand on). Set the key in this thread's exclude set by torch's TLS functions, not a
# guard object: 3 plain calls, under 1 us. CUDA calls still pass the kernel at AutogradCUDA (it
# notes them for the nccl completion hook, which must skip them: see zerocode's module).
_AUTOGRAD_CPU: Final = torch._C.DispatchKey.AutogradCPU
_is_excluded: Final = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded: Final = torch._C._dispatch_tls_set_dispatch_key_excluded
_below = False
# The collectives that are nothing but torch's collective (so dispatching them below Autograd
# changes nothing else): a wrapped function that also computes (the fallbacks) keeps Autograd.
_DIRECT: Final = frozenset(
    {dist.all_reduce, dist.broadcast, dist.all_gather, dist.reduce, dist.gather, dist.scatter,
     dist.send, dist.recv, dist.barrier}
)  # fmt: skip
# The options of every timed_all_to_all: a blocking call with the group's timeout.
_A2A_OPTIONS: Final = dist.AllToAllOptions()
if hasattr(_A2A_OPTIONS, "asyncOp"):  # newer torch: tell the backend the caller waits at once
    _A2A_OPTIONS.asyncOp = False


def set_progress_hook(hook: ProgressHook | None) -> None:
    """Install ``hook`` (None removes it); it is told of every later collective of this process."""
    global _progress
    _progress = hook


def set_dispatch_below(on: bool) -> None:
    """While on, the wrappers run torch's collectives below the Autograd keys' kernels (CPU
    tensors: the AutogradCPU key excluded in this thread for the call). Zero-code metrics turn it
    on with their kernels (their Python kernel then never runs for a call the library records)."""
    global _below
    _below = on


class DispatchBelow:
    """``with dispatch_below():`` around torch collectives inside a wrapper that also computes
    (the all_to_all exchanges, model sync, SAR's tensor exchange): they run below zero-code's
    kernels while those are on, as :func:`timed` runs torch's plain collectives. Only around the
    collective calls themselves: Autograd is off for CPU ops inside."""

    __slots__ = ("_undo",)

    def __enter__(self) -> None:
        self._undo = _enter_below()

    def __exit__(self, *exc: object) -> None:
        if self._undo:
            _set_excluded(_AUTOGRAD_CPU, False)


dispatch_below: Final = DispatchBelow


def _enter_below() -> bool:
    """Exclude AutogradCPU for the next call when on and not excluded already; True: undo after."""
    if _below and not _is_excluded(_AUTOGRAD_CPU):
        _set_excluded(_AUTOGRAD_CPU, True)
        return True
    return False


# -- shared plumbing -----------------------------------------------------------------------------


class _Waitable(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future[Any]: ...


class Completed:
    """Stands in for a ``dist.Work`` when the result was computed synchronously (a fallback)."""

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(None)
        return future


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class CollectiveHandle:
    """What the collectives return with ``async_op=True``, in place of torch's ``Work``.

    ``wait()`` blocks until the collective is done (at most ``timeout``, default the process
    group's) and records its latency, from the call to completion, and bytes once. Raises what the
    backend raises, or the recorded :class:`PeerFailedError` when a peer is known to have failed.
    """

    _work: _Waitable
    _stats: CollectiveStats
    _start_ns: int
    _nbytes: int
    _after: Callable[[], None] | None = None
    _recorded: bool = False
    # A call on CUDA tensors: the event recorded on the current stream before it, and the timer
    # that records the pair once ``wait()`` has made the stream wait for the collective.
    _begun: EventLike | None = None
    _events: EventTimer | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; True when it completed. Idempotent."""
        progress = _progress if not self._recorded else None
        if progress is not None:
            progress.enter(self._stats.op)
        try:
            done = self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:
            raise_failure(self._stats, exc)
            raise
        finally:
            if progress is not None:
                progress.leave()
        self._complete(waited=True)
        return done

    def is_completed(self) -> bool:
        """Whether the collective has finished (without blocking); records it when it has."""
        completed = self._work.is_completed()
        if completed and not self._recorded and self._after is None:
            self._complete()
        return completed

    def get_future(self) -> torch.futures.Future[Any]:
        """torch's future of the underlying work (latency is recorded only by ``wait()``)."""
        return self._work.get_future()

    def _complete(self, waited: bool = False) -> None:
        if self._recorded:
            return
        self._recorded = True
        if self._after is not None:
            self._after()
        # Only after wait() does the current stream wait for the collective, so that an event
        # recorded on it now completes with it; is_completed() alone records the host's time.
        if waited and self._begun is not None and self._events is not None:
            self._events.end(self._begun, self._stats, self._nbytes)
            return
        self._stats.observe(self._start_ns, self._nbytes)


class Unsupported(Exception):
    """The backend does not implement the op (raised before any data moved, on every rank alike);
    not counted as an error because the caller falls back."""


def raise_not_ready(op: str) -> None:
    failure = _STATE.peer_failure
    if failure is not None:
        raise failure
    raise FailedPreconditionError(
        f"{op} needs initialised communication: call initialize_comms(...) (or sar.init()) first."
    )


def raise_failure(stats: CollectiveStats, exc: BaseException) -> None:
    """Count the error; raise the known peer failure instead of the backend's error, if any (waiting
    briefly for the coordinator's verdict when the backend noticed a dead peer first)."""
    stats.error()
    failure = peer_failure_after(exc)
    if failure is not None and failure is not exc:
        raise failure from exc


def route(
    op: str, group: dist.ProcessGroup | None, tensor: torch.Tensor
) -> tuple[dist.ProcessGroup | None, CollectiveStats]:
    """The group to use and the stats to record into: CPU tensors of an nccl job go through the
    gloo side group unless the caller chose a group."""
    state = _STATE
    # The side-group test only runs in nccl jobs; gloo jobs (no side group) skip the call.
    if group is None and state.cpu_group is not None and uses_cpu_side_group(tensor.is_cpu, True):
        return state.cpu_group, state.cpu_stats[op]
    return group, state.stats[op]


def timed(
    stats: CollectiveStats,
    nbytes: int,
    fn: Callable[..., object],
    *args: Any,
    **kwargs: Any,
) -> CollectiveHandle | None:
    """Run the torch-style collective ``fn(*args, **kwargs)`` and record it. Its ``dist.Work``
    (async_op=True) or ``Completed`` result becomes a :class:`CollectiveHandle` that records on
    ``wait()``; otherwise the call is recorded now and None returned."""
    progress = _progress
    if progress is not None:
        progress.enter(stats.op)
    direct = fn in _DIRECT
    below = direct and _enter_below()
    events = _STATE.cuda_events
    begun = events.begin() if events is not None and direct and _on_cuda(args) else None
    start = _now()
    try:
        result = fn(*args, **kwargs)
    except Unsupported:
        raise
    except Exception as exc:
        raise_failure(stats, exc)
        raise
    finally:
        if below:
            _set_excluded(_AUTOGRAD_CPU, False)
        if progress is not None:
            progress.leave()
    if isinstance(result, (dist.Work, Completed)):  # async: timed to its wait()
        return CollectiveHandle(result, stats, start, nbytes, _begun=begun, _events=events)
    if begun is not None and events is not None:  # the GPU's time, recorded once the GPU is done
        events.end(begun, stats, nbytes)
        return None
    stats.observe(start, nbytes)
    return None


def _on_cuda(args: tuple[Any, ...]) -> bool:
    """Whether a torch collective's first argument (its tensor, or list of them) is on CUDA."""
    first = args[0] if args else None
    if isinstance(first, list) and first:
        first = first[0]
    return isinstance(first, torch.Tensor) and first.is_cuda


def timed_call(stats: CollectiveStats, nbytes: int, fn: Callable[[], _T]) -> _T:
    """Run the blocking ``fn()``, record it and return its result."""
    progress = _progress
    if progress is not None:
        progress.enter(stats.op)
    start = _now()
    try:
        result = fn()
    except Exception as exc:
        raise_failure(stats, exc)
        raise
    finally:
        if progress is not None:
            progress.leave()
    stats.observe(start, nbytes)
    return result


_NO_KWARGS: Final[dict[str, Any]] = {}


def optional_kwarg(name: str, value: object) -> dict[str, Any]:
    """``{name: value}``, or no keyword argument at all when ``value`` is None: newer torch
    parameters (group_src, timeout, ...) are passed only when used, so older torch keeps working."""
    return _NO_KWARGS if value is None else {name: value}


def is_me(global_rank: int | None, group_rank: int | None, group: dist.ProcessGroup | None) -> bool:
    if global_rank is not None:
        return global_rank == _STATE.rank
    if group_rank is not None:
        return group_rank == dist.get_rank(group)
    return False


# -- all_reduce (the hot path) ---------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor | None = None,
    op: ReduceOpLike = _SUM,
    move_to_comm_device: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    red_tensor: torch.Tensor | None = None,
) -> CollectiveHandle | None:
    """Reduce ``tensor`` across all ranks in place with ``op`` (default SUM), as SAR's all_reduce.
    ``red_tensor`` is SAR's keyword name for ``tensor`` (passing both is a ``TypeError``).

    ``move_to_comm_device=True`` reduces a copy on :func:`comm_device` and copies the result back
    (SAR's behaviour for tensors that live elsewhere). Blocks unless ``async_op``; then returns a
    :class:`CollectiveHandle` (the copy-back happens in its ``wait()``). Raises
    :class:`FailedPreconditionError` before initialize_comms, the recorded
    :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    if tensor is None or red_tensor is not None:
        tensor = sar_keywords.required("all_reduce", "tensor", tensor, "red_tensor", red_tensor)
    state = _STATE
    if not state.ready:
        raise_not_ready("all_reduce")
    if move_to_comm_device or async_op or group is not None or state.cpu_group is not None:
        return _all_reduce_general(tensor, op, move_to_comm_device, group, async_op)
    # The common case, kept free of helper calls: the wrapper's whole cost is measured against
    # a bare dist.all_reduce of 4 bytes in benchmarks/overhead.py.
    stats = state.stats["all_reduce"]
    nbytes = tensor.nbytes  # before the call: afterwards the tensor's memory is cold
    events = state.cuda_events  # None unless the comm device is CUDA
    begun = events.begin() if events is not None and tensor.is_cuda else None
    progress = _progress
    if progress is not None:
        progress.enter("all_reduce")
    below = _below and not _is_excluded(_AUTOGRAD_CPU)  # _enter_below, inlined
    if below:
        _set_excluded(_AUTOGRAD_CPU, True)
    start = _now()
    try:
        dist.all_reduce(tensor, op)
    except Exception as exc:
        raise_failure(stats, exc)
        raise
    finally:
        if below:
            _set_excluded(_AUTOGRAD_CPU, False)
        if progress is not None:
            progress.leave()
    if begun is not None and events is not None:  # the GPU's time, recorded once the GPU is done
        events.end(begun, stats, nbytes)
        return None
    stats.observe(start, nbytes)
    return None


def timed_all_to_all(
    stats: CollectiveStats,
    nbytes: int,
    recvs: list[torch.Tensor],
    sends: list[torch.Tensor],
    group: dist.ProcessGroup | None,
) -> None:
    """``dist.all_to_all(recvs, sends, group=group)`` for lists the caller has validated (lists of
    non-complex tensors of one dtype), recorded as :func:`timed` would, without its generic
    plumbing. It calls the process group itself: torch's Python layer would repeat the caller's
    checks at about 4 us a call. Raises :class:`Unsupported` (not counted as an error) when the
    backend has no list all_to_all (gloo before torch gained it), which it says before sending
    anything."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "all_to_all before the default process group exists"
    progress = _progress
    if progress is not None:
        progress.enter("all_to_all")
    below = _enter_below()
    start = _now()
    try:
        pg.alltoall(recvs, sends, _A2A_OPTIONS).wait()
    except Exception as exc:
        if isinstance(exc, RuntimeError) and "does not support alltoall" in str(exc):
            raise Unsupported(str(exc)) from exc
        raise_failure(stats, exc)
        raise
    finally:
        if below:
            _set_excluded(_AUTOGRAD_CPU, False)
        if progress is not None:
            progress.leave()
    stats.observe(start, nbytes)


def _all_reduce_general(
    tensor: torch.Tensor,
    op: ReduceOpLike,
    move_to_comm_device: bool,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> CollectiveHandle | None:
    target = tensor.to(_STATE.comm_device) if move_to_comm_device else tensor
    group, stats = route("all_reduce", group, target)
    copy_back = target is not tensor

    def after() -> None:
        tensor.copy_(target)

    if not async_op:
        timed(stats, tensor.nbytes, dist.all_reduce, target, op, group)
        if copy_back:
            after()
        return None
    handle = timed(stats, tensor.nbytes, dist.all_reduce, target, op, group, True)
    if copy_back and handle is not None:
        handle._after = after
    return handle


# The rank's progress record (sar-worker's, or a self-registered process's own), whenever it is
# made: before this module is imported (init under sar-worker) or after (coord_ip_init).
add_progress_listener(set_progress_hook)
