"""SAR-compatible collectives, each timed into the worker's Prometheus metrics.

SAR's own two (``all_to_all``, ``all_reduce``), its helpers (``exchange_tensors``, ``sync_params``,
``gather_grads``) and the rest of ``torch.distributed``'s collectives with torch's signatures.
Every call records its wall time, the bytes this rank sent and any error into
:mod:`sarcomm.worker.metrics` under its op name and the backend that carried it. With
``async_op=True`` a :class:`CollectiveHandle` is returned and its ``wait()`` records the time from
the call to completion.

Bytes counted as sent (``sar_collective_bytes_total``), the payload this rank contributes for other
ranks, independent of the algorithm the backend runs:

====================  ===============================================================
all_to_all            sum of ``send_list[i]`` bytes for every other rank ``i``
exchange_tensors      sum of ``tensors[i]`` bytes for every other rank ``i``
all_reduce            the tensor's bytes
gather_grads          bytes of the gradients reduced
sync_params           bytes of the state dict on the source rank (rank 0), 0 elsewhere
broadcast             the tensor's bytes on ``src``, 0 elsewhere
all_gather            the input tensor's bytes
reduce_scatter        sum of ``input_list[i]`` bytes for every other rank ``i``
reduce, gather        the tensor's bytes on every rank but ``dst``, 0 on ``dst``
scatter               sum of ``scatter_list[i]`` bytes for every other rank on ``src``, 0 elsewhere
send                  the tensor's bytes
recv, barrier         0
====================  ===============================================================

all_to_all on gloo
------------------
gloo's ``all_to_all`` takes only tensors of one size, and SAR's fallback (``isend`` to everyone,
blocking ``recv`` in rank order, then a ``barrier``) serialises the receives and adds a whole
collective. Here each message is classified by its size, which its sender and its receiver both
know, so every rank classifies every message the same way without talking:

- small messages (at most ``small_message_bytes``, 1 MiB by default) are packed into one
  buffer and go through one ``all_to_all_single`` with split sizes, which pays gloo's per-message
  latency once. It is issued asynchronously by every rank on every call, even with nothing to
  pack, because it is a collective: skipping it would need knowledge of the other ranks' sizes.
- large messages go point to point, straight from and into the caller's tensors (no packing
  copies): all sends are posted first, then all receives, pairing rank ``r`` with ``r+s`` and
  ``r-s`` at step ``s`` so that every link is busy at once, and nothing waits for a barrier.

The threshold was chosen with ``benchmarks/all_to_all.py`` (results in ``benchmarks/results``).
Other backends (nccl, mpi, ucc, ccl) take unequal sizes natively and get ``dist.all_to_all``.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import torch
import torch.distributed as dist

from sarcomm.common.errors import FailedPreconditionError, InvalidArgumentError, shorten
from sarcomm.worker import comm
from sarcomm.worker.metrics import CollectiveStats

__all__ = [
    "AllToAllConfig",
    "CollectiveHandle",
    "ProgressHook",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_config",
    "barrier",
    "broadcast",
    "configure_all_to_all",
    "exchange_tensors",
    "gather",
    "gather_grads",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "set_progress_hook",
    "sync_params",
]

log = logging.getLogger(__name__)

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType

_STATE: Final = comm.STATE
_SUM: Final = dist.ReduceOp.SUM
_now = time.perf_counter_ns
_T = TypeVar("_T")
# all_to_all's point-to-point messages use their own tag so that they can never be matched with
# a user's send/recv (tag 0 by default) that is in flight at the same time.
_A2A_TAG: Final = 0x5A2A
#: Bucket size of sync_params and gather_grads: as DistributedDataParallel's default, large
#: enough that per-call latency is amortised, small enough to bound the extra memory.
BUCKET_BYTES: Final = 25 * 1024 * 1024


@dataclass(frozen=True)
class AllToAllConfig:
    """How :func:`all_to_all` runs on gloo. Must be the same on every rank: both ends of a message
    classify it by ``small_message_bytes``, and ``check_sizes`` adds collectives."""

    #: Messages of at most this many bytes are packed into one all_to_all_single; larger ones go
    #: point to point. 0 sends everything point to point.
    small_message_bytes: int = 1024 * 1024
    #: Exchange and compare the message sizes first (two extra small collectives per call), so
    #: that a sender/receiver size mismatch raises InvalidArgumentError on every rank instead of
    #: aborting the receiving process inside gloo.
    check_sizes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.small_message_bytes, bool) or not isinstance(self.small_message_bytes, int):
            raise InvalidArgumentError(
                f"small_message_bytes={shorten(self.small_message_bytes)} must be an integer number of bytes."
            )
        if self.small_message_bytes < 0:
            raise InvalidArgumentError(
                f"small_message_bytes={self.small_message_bytes} must be at least 0 (0 = all point to point)."
            )


_a2a_config = AllToAllConfig()


def configure_all_to_all(*, small_message_bytes: int | None = None, check_sizes: bool | None = None) -> None:
    """Change how :func:`all_to_all` runs on gloo (see :class:`AllToAllConfig`); arguments left None
    keep their value. Every rank must make the same call, between collectives. Raises
    :class:`InvalidArgumentError` for a negative or non-integer ``small_message_bytes``."""
    global _a2a_config
    current = _a2a_config
    _a2a_config = AllToAllConfig(
        small_message_bytes=current.small_message_bytes
        if small_message_bytes is None
        else small_message_bytes,
        check_sizes=current.check_sizes if check_sizes is None else check_sizes,
    )


def all_to_all_config() -> AllToAllConfig:
    """The :class:`AllToAllConfig` in force."""
    return _a2a_config


class ProgressHook(Protocol):
    """Receives a note as each collective starts and ends (``sarcomm.worker.progress`` implements
    it, so that the agent can tell which collective a rank is stuck in). Both calls are on the hot
    path and must not block."""

    def enter(self, op: str) -> int: ...

    def leave(self) -> None: ...


_progress: ProgressHook | None = None


def set_progress_hook(hook: ProgressHook | None) -> None:
    """Install ``hook`` (None removes it); it is told of every later collective of this process."""
    global _progress
    _progress = hook


# -- shared plumbing -----------------------------------------------------------------------------


class _Waitable(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future[Any]: ...


class _Completed:
    """Stands in for a ``dist.Work`` when the result was computed synchronously (a fallback)."""

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(None)
        return future


class CollectiveHandle:
    """What the collectives return with ``async_op=True``, in place of torch's ``Work``.

    ``wait()`` blocks until the collective is done (at most ``timeout``, default the process
    group's) and records its latency, from the call to completion, and bytes once. Raises what the
    backend raises, or the recorded :class:`PeerFailedError` when a peer is known to have failed.
    """

    __slots__ = ("_after", "_nbytes", "_recorded", "_start_ns", "_stats", "_work")

    def __init__(
        self,
        work: _Waitable,
        stats: CollectiveStats,
        start_ns: int,
        nbytes: int,
        after: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._stats = stats
        self._start_ns = start_ns
        self._nbytes = nbytes
        self._after = after
        self._recorded = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; True when it completed. Idempotent."""
        progress = _progress if not self._recorded else None
        if progress is not None:
            progress.enter(self._stats.op)
        try:
            done = self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:
            _raise_failure(self._stats, exc)
            raise
        finally:
            if progress is not None:
                progress.leave()
        self._complete()
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

    def _complete(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        if self._after is not None:
            self._after()
        self._stats.observe(self._start_ns, self._nbytes)


class _Unsupported(Exception):
    """The backend does not implement the op (raised before any data moved, on every rank alike);
    not counted as an error because the caller falls back."""


def _raise_not_ready(op: str) -> None:
    failure = _STATE.peer_failure
    if failure is not None:
        raise failure
    raise FailedPreconditionError(
        f"{op} needs initialised communication: call initialize_comms(...) (or sar.init()) first."
    )


def _raise_failure(stats: CollectiveStats, exc: BaseException) -> None:
    """Count the error; raise the known peer failure instead of the backend's error, if any (waiting
    briefly for the coordinator's verdict when the backend noticed a dead peer first)."""
    stats.error()
    failure = comm.peer_failure_after(exc)
    if failure is not None and failure is not exc:
        raise failure from exc


def _route(
    op: str, group: dist.ProcessGroup | None, tensor: torch.Tensor
) -> tuple[dist.ProcessGroup | None, CollectiveStats]:
    """The group to use and the stats to record into: CPU tensors of an nccl job go through the
    gloo side group unless the caller chose a group."""
    state = _STATE
    # The side-group test only runs in nccl jobs; gloo jobs (no side group) skip the call.
    if group is None and state.cpu_group is not None and comm.uses_cpu_side_group(tensor.is_cpu, True):
        return state.cpu_group, state.cpu_stats[op]
    return group, state.stats[op]


def _timed(
    stats: CollectiveStats,
    nbytes: int,
    fn: Callable[..., object],
    *args: Any,
    **kwargs: Any,
) -> CollectiveHandle | None:
    """Run the torch-style collective ``fn(*args, **kwargs)`` and record it. Its ``dist.Work``
    (async_op=True) or ``_Completed`` result becomes a :class:`CollectiveHandle` that records on
    ``wait()``; otherwise the call is recorded now and None returned."""
    progress = _progress
    if progress is not None:
        progress.enter(stats.op)
    start = _now()
    try:
        result = fn(*args, **kwargs)
    except _Unsupported:
        raise
    except Exception as exc:
        _raise_failure(stats, exc)
        raise
    finally:
        if progress is not None:
            progress.leave()
    if isinstance(result, (dist.Work, _Completed)):
        return CollectiveHandle(result, stats, start, nbytes)
    stats.observe(start, nbytes)
    return None


def _timed_call(stats: CollectiveStats, nbytes: int, fn: Callable[[], _T]) -> _T:
    """Run the blocking ``fn()``, record it and return its result."""
    progress = _progress
    if progress is not None:
        progress.enter(stats.op)
    start = _now()
    try:
        result = fn()
    except Exception as exc:
        _raise_failure(stats, exc)
        raise
    finally:
        if progress is not None:
            progress.leave()
    stats.observe(start, nbytes)
    return result


_NO_KWARGS: Final[dict[str, Any]] = {}


def _opt(name: str, value: object) -> dict[str, Any]:
    """``{name: value}``, or no keyword argument at all when ``value`` is None: newer torch
    parameters (group_src, timeout, ...) are passed only when used, so older torch keeps working."""
    return _NO_KWARGS if value is None else {name: value}


def _is_me(global_rank: int | None, group_rank: int | None, group: dist.ProcessGroup | None) -> bool:
    if global_rank is not None:
        return global_rank == _STATE.rank
    if group_rank is not None:
        return group_rank == dist.get_rank(group)
    return False


# -- all_reduce (the hot path) ---------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = _SUM,
    move_to_comm_device: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """Reduce ``tensor`` across all ranks in place with ``op`` (default SUM), as SAR's all_reduce.

    ``move_to_comm_device=True`` reduces a copy on :func:`comm_device` and copies the result back
    (SAR's behaviour for tensors that live elsewhere). Blocks unless ``async_op``; then returns a
    :class:`CollectiveHandle` (the copy-back happens in its ``wait()``). Raises
    :class:`FailedPreconditionError` before initialize_comms, the recorded
    :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        _raise_not_ready("all_reduce")
    if move_to_comm_device or async_op or group is not None or state.cpu_group is not None:
        return _all_reduce_general(tensor, op, move_to_comm_device, group, async_op)
    # The common case, kept free of helper calls: the wrapper's whole cost is measured against
    # a bare dist.all_reduce of 4 bytes in benchmarks/overhead.py.
    stats = state.stats["all_reduce"]
    nbytes = tensor.nbytes  # before the call: afterwards the tensor's memory is cold
    progress = _progress
    if progress is not None:
        progress.enter("all_reduce")
    start = _now()
    try:
        dist.all_reduce(tensor, op)
    except Exception as exc:
        _raise_failure(stats, exc)
        raise
    finally:
        if progress is not None:
            progress.leave()
    stats.observe(start, nbytes)
    return None


def _all_reduce_general(
    tensor: torch.Tensor,
    op: ReduceOpLike,
    move_to_comm_device: bool,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> CollectiveHandle | None:
    target = tensor.to(_STATE.comm_device) if move_to_comm_device else tensor
    group, stats = _route("all_reduce", group, target)
    copy_back = target is not tensor

    def after() -> None:
        tensor.copy_(target)

    if not async_op:
        _timed(stats, tensor.nbytes, dist.all_reduce, target, op, group)
        if copy_back:
            after()
        return None
    handle = _timed(stats, tensor.nbytes, dist.all_reduce, target, op, group, True)
    if copy_back and handle is not None:
        handle._after = after
    return handle


# -- all_to_all and exchange_tensors -------------------------------------------------------------


def all_to_all(
    recv_list: Sequence[torch.Tensor], send_list: Sequence[torch.Tensor], move_to_comm_device: bool = False
) -> None:
    """Send ``send_list[i]`` to rank ``i`` and receive rank ``i``'s tensor into ``recv_list[i]``,
    in place, as SAR's all_to_all. Sizes may differ between peers (on every backend), rows may be
    zero, inputs may be non-contiguous.

    ``recv_list[i]`` must have exactly the shape rank ``i`` sends (as in SAR; see
    ``configure_all_to_all(check_sizes=True)`` to have that verified). ``send_list[i]`` and
    ``recv_list[i]`` must share dtype and trailing shape (all but the first dimension), and
    ``send_list[rank]`` and ``recv_list[rank]`` the whole shape; all tensors one device, unless
    ``move_to_comm_device`` (then everything is moved to :func:`comm_device` and results are
    copied back). Blocks until this rank's part is done. Raises :class:`InvalidArgumentError` for
    lists that break these rules, :class:`FailedPreconditionError` before initialize_comms, the
    recorded :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        _raise_not_ready("all_to_all")
    world, me = state.world_size, state.rank
    _check_exchange_lists(recv_list, send_list, world, me, move_to_comm_device)
    if move_to_comm_device:
        device = state.comm_device
        sends = [t.to(device) for t in send_list]
        recvs = [t if t.device == device else torch.empty_like(t, device=device) for t in recv_list]
    else:
        sends, recvs = list(send_list), list(recv_list)
    nbytes = sum([t.nbytes for t in sends]) - sends[me].nbytes
    group, stats = _route("all_to_all", None, sends[me])
    _timed(stats, nbytes, _all_to_all_impl, recvs, sends, group)
    if move_to_comm_device:
        for mine, moved in zip(recv_list, recvs, strict=True):
            if mine is not moved:
                mine.copy_(moved)


def exchange_tensors(
    tensors: Sequence[torch.Tensor], recv_sizes: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Send ``tensors[i]`` to rank ``i``; return the tensors received, ``result[i]`` from rank
    ``i``, on the device of ``tensors[0]``, as SAR's exchange_tensors.

    All tensors must share dtype and trailing shape; they travel on :func:`comm_device`. The first
    dimension of what each rank sends is exchanged first unless ``recv_sizes`` gives it (then
    ``recv_sizes[i]`` rows are expected from rank ``i``). Blocks. Raises
    :class:`InvalidArgumentError` for mismatched tensors or sizes,
    :class:`FailedPreconditionError` before initialize_comms, the recorded
    :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        _raise_not_ready("exchange_tensors")
    world, me, device = state.world_size, state.rank, state.comm_device
    if len(tensors) != world:
        raise InvalidArgumentError(
            f"tensors has {len(tensors)} tensors; exchange_tensors needs one per rank (world size {world})."
        )
    first = tensors[0]
    if first.dim() == 0:
        raise InvalidArgumentError("tensors[0] is 0-dimensional; exchange_tensors splits along dimension 0.")
    trailing, dtype = first.shape[1:], first.dtype
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise InvalidArgumentError(
                f"tensors[{i}] has dtype {t.dtype} but tensors[0] has {dtype}: "
                "exchange_tensors needs one dtype."
            )
        if t.dim() == 0 or t.shape[1:] != trailing:
            raise InvalidArgumentError(
                f"tensors[{i}] has shape {tuple(t.shape)} but tensors[0] has {tuple(first.shape)}: all "
                "must share every dimension but the first."
            )
    sends = [t.to(device) for t in tensors]
    group, stats = _route("exchange_tensors", None, sends[0])
    nbytes = sum(t.nbytes for i, t in enumerate(sends) if i != me)

    def run() -> list[torch.Tensor]:
        if recv_sizes is None:
            rows = _exchange_rows([t.shape[0] for t in sends], group)
        else:
            rows = _checked_sizes(recv_sizes, world)
            if rows[me] != sends[me].shape[0]:
                raise InvalidArgumentError(
                    f"recv_sizes[{me}]={rows[me]} but tensors[{me}] has {sends[me].shape[0]} rows: rank {me} "
                    "keeps its own part, so they must be equal."
                )
        recvs = [torch.empty((n, *trailing), dtype=dtype, device=device) for n in rows]
        _all_to_all_impl(recvs, sends, group)
        return recvs

    received = _timed_call(stats, nbytes, run)
    return [t.to(first.device) for t in received]


def _checked_sizes(recv_sizes: Sequence[int], world: int) -> list[int]:
    if len(recv_sizes) != world:
        raise InvalidArgumentError(
            f"recv_sizes has {len(recv_sizes)} entries; exchange_tensors needs one per rank "
            f"(world size {world})."
        )
    rows = []
    for i, n in enumerate(recv_sizes):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"recv_sizes[{i}]={shorten(n)} must be a non-negative integer.")
        rows.append(n)
    return rows


def _exchange_rows(rows: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's row count for this rank: one equal-split all_to_all_single of int64 (on the
    CPU group for nccl jobs, where the default group cannot carry CPU tensors)."""
    size_group = _STATE.cpu_group if _STATE.cpu_group is not None else group
    mine = torch.tensor(rows, dtype=torch.int64)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=size_group)
    return [int(n) for n in theirs.tolist()]


def _check_exchange_lists(
    recv_list: Sequence[torch.Tensor], send_list: Sequence[torch.Tensor], world: int, me: int, moving: bool
) -> None:
    for name, tensors in (("recv_list", recv_list), ("send_list", send_list)):
        if len(tensors) != world:
            raise InvalidArgumentError(
                f"{name} has {len(tensors)} tensors; all_to_all needs one per rank (world size {world})."
            )
    # One pass, cheap tests first: this runs on every call, and at small sizes the call's cost is
    # mostly Python (torch.Size slices and torch.device objects are built only when needed; a
    # non-tensor is looked for only once an attribute lookup failed).
    try:
        _check_pairs(recv_list, send_list, world, me, moving)
    except AttributeError:
        for name, tensors in (("recv_list", recv_list), ("send_list", send_list)):
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgumentError(
                        f"{name}[{i}] is a {type(t).__name__}, not a torch.Tensor."
                    ) from None
        raise


def _check_pairs(
    recv_list: Sequence[torch.Tensor], send_list: Sequence[torch.Tensor], world: int, me: int, moving: bool
) -> None:
    first = send_list[0]
    on_cpu = first.is_cpu
    device = first.device
    for i in range(world):
        sent, got = send_list[i], recv_list[i]
        if sent.dtype != got.dtype:
            raise InvalidArgumentError(
                f"send_list[{i}] has dtype {sent.dtype} but recv_list[{i}] has dtype {got.dtype}: the "
                f"tensors exchanged with rank {i} must share a dtype."
            )
        dims = sent.dim()
        if dims != got.dim() or (dims > 1 and sent.shape[1:] != got.shape[1:]):
            raise InvalidArgumentError(
                f"send_list[{i}] has shape {tuple(sent.shape)} but recv_list[{i}] has {tuple(got.shape)}: "
                f"the tensors exchanged with rank {i} must share every dimension but the first."
            )
        if i == me and sent.shape != got.shape:
            raise InvalidArgumentError(
                f"send_list[{i}] has shape {tuple(sent.shape)} but recv_list[{i}] has {tuple(got.shape)}: "
                f"rank {me} keeps its own part, so both must have the same shape."
            )
        if moving or (on_cpu and sent.is_cpu and got.is_cpu):
            continue
        for name, t in (("send_list", sent), ("recv_list", got)):
            if t.device != device:
                raise InvalidArgumentError(
                    f"{name}[{i}] is on {t.device} but send_list[0] is on {device}: all tensors must "
                    "be on one device (or pass move_to_comm_device=True)."
                )


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's memory as a flat uint8 tensor (no copy when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _all_to_all_impl(
    recvs: list[torch.Tensor], sends: list[torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """The exchange itself, unrecorded; ``recvs`` are filled in place. Validated lists, one device."""
    state = _STATE
    if group is None or group is state.cpu_group:
        me, world, peers = state.rank, state.world_size, None
    else:  # a caller's subgroup (reduce_scatter's fallback): point-to-point needs global ranks
        me, world = dist.get_rank(group), dist.get_world_size(group)
        peers = [dist.get_global_rank(group, r) for r in range(world)]
    if _a2a_config.check_sizes:
        # The sizes are CPU tensors: an nccl job compares them on its CPU side group.
        _check_sizes_with_peers(recvs, sends, state.cpu_group if group is None and state.cpu_group else group)
    if world == 1:
        recvs[0].copy_(sends[0])
    elif sends[me].is_cpu and (group is not None or state.backend == "gloo"):
        _all_to_all_gloo(recvs, sends, me, world, group, peers, _a2a_config.small_message_bytes)
    else:
        # nccl, mpi, ucc and ccl take unequal sizes; they want contiguous tensors.
        targets = [
            t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in recvs
        ]
        dist.all_to_all(targets, [t.contiguous() for t in sends], group=group)
        for mine, target in zip(recvs, targets, strict=True):
            if mine is not target:
                mine.copy_(target)


def _all_to_all_gloo(
    recvs: list[torch.Tensor],
    sends: list[torch.Tensor],
    me: int,
    world: int,
    group: dist.ProcessGroup | None,
    peers: list[int] | None,
    small: int,
) -> None:
    """Hybrid exchange for gloo (see the module docstring) of CPU tensors. ``me`` and ``world``
    are within ``group``; ``peers`` maps its ranks to global ones (None: identity).

    At small sizes the cost is the number of torch calls (each a few microseconds, and more on a
    busy host), so the packed part takes as few as possible: one ``cat``, one ``empty``, the
    collective, one ``split`` and one ``_foreach_copy_`` for every received part and this rank's
    own, where writing it with ``all_to_all_single`` takes a slice and a copy per peer. That holds
    when the small messages share the dtype and trailing shape of this rank's own part (always so
    for SAR's tensors): they are packed as they are and split by rows. Mixed lists go through byte
    views.
    """
    mine = sends[me]
    dims = mine.dim()
    dtype = mine.dtype
    trailing = mine.shape[1:] if dims > 1 else None
    by_rows = dims > 0
    # Rows (by_rows) and bytes of every small message, in rank order as all_to_all_single wants.
    send_rows = [0] * world
    recv_rows = [0] * world
    send_bytes = [0] * world
    recv_bytes = [0] * world
    small_sends: list[int] = []
    small_recvs: list[int] = []
    large_sends: list[int] = []
    large_recvs: list[int] = []
    for p in range(world):
        if p == me:
            continue
        for t, rows, nbytes, small_list, large_list in (
            (sends[p], send_rows, send_bytes, small_sends, large_sends),
            (recvs[p], recv_rows, recv_bytes, small_recvs, large_recvs),
        ):
            n = t.nbytes
            if n > small:
                large_list.append(p)
            elif n:
                small_list.append(p)
                nbytes[p] = n
                if by_rows:
                    if (
                        t.dtype != dtype
                        or t.dim() != dims
                        or (trailing is not None and t.shape[1:] != trailing)
                    ):
                        by_rows = False
                    else:
                        rows[p] = t.shape[0]
    if by_rows:
        send_splits, recv_splits = send_rows, recv_rows
        parts = [sends[p] for p in small_sends]
        packed_out = torch.empty((sum(recv_rows), *mine.shape[1:]), dtype=dtype)
    else:
        send_splits, recv_splits = send_bytes, recv_bytes
        parts = [_byte_view(sends[p]) for p in small_sends]
        packed_out = torch.empty(sum(recv_bytes), dtype=torch.uint8)
    if len(parts) == 1 and parts[0].is_contiguous():
        packed_in = parts[0]
    elif parts:
        packed_in = torch.cat(parts)
    else:
        packed_in = packed_out.new_empty((0, *packed_out.shape[1:]))
    # The collective first (gloo's worker thread runs it), then the point-to-point messages, which
    # gloo's transport threads carry while this thread posts the next one. Every rank issues the
    # collective, even with nothing to pack: it cannot know that no peer has a small message.
    overlap = bool(large_sends or large_recvs)
    packed = dist.all_to_all_single(
        packed_out, packed_in, recv_splits, send_splits, group=group, async_op=overlap
    )
    if overlap:
        large_targets: list[tuple[torch.Tensor, torch.Tensor]] = []
        works = _post_large(recvs, sends, me, world, group, peers, large_sends, large_recvs, large_targets)
        recvs[me].copy_(mine)  # while the large messages travel
        for work in works:
            if work is not None:
                work.wait()
        if packed is not None:
            packed.wait()
        for into, target in large_targets:
            if into is not target:
                into.copy_(target)
    # Without large messages this rank's own part is copied with the small ones, in one call.
    _unpack_small(recvs, packed_out, recv_splits, small_recvs, by_rows, None if overlap else mine, me)


def _post_large(
    recvs: list[torch.Tensor],
    sends: list[torch.Tensor],
    me: int,
    world: int,
    group: dist.ProcessGroup | None,
    peers: list[int] | None,
    large_sends: list[int],
    large_recvs: list[int],
    targets: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[dist.Work | None]:
    """Post the large messages straight from and into the caller's tensors (a contiguous staging
    tensor where one is not contiguous, listed in ``targets`` as (caller's, staging)): all sends
    first, then all receives, pairing rank ``me`` with ``me+s`` and ``me-s`` at step ``s`` so that
    every link is busy at once."""
    large_sends.sort(key=lambda p: (p - me) % world)
    large_recvs.sort(key=lambda p: (me - p) % world)
    works: list[dist.Work | None] = []
    for dst in large_sends:
        out = sends[dst]
        out = out if out.is_contiguous() else out.contiguous()
        works.append(dist.isend(out, peers[dst] if peers is not None else dst, group=group, tag=_A2A_TAG))
    for src in large_recvs:
        into = recvs[src]
        target = (
            into if into.is_contiguous() else torch.empty_like(into, memory_format=torch.contiguous_format)
        )
        targets.append((into, target))
        works.append(dist.irecv(target, peers[src] if peers is not None else src, group=group, tag=_A2A_TAG))
    return works


def _unpack_small(
    recvs: list[torch.Tensor],
    packed_out: torch.Tensor,
    recv_splits: list[int],
    small_recvs: list[int],
    by_rows: bool,
    mine: torch.Tensor | None,
    me: int,
) -> None:
    """Copy the received small parts out of ``packed_out`` into their tensors, and ``mine`` (when
    given) into ``recvs[me]``, with one ``_foreach_copy_`` where the parts are rows."""
    targets = [recvs[me]] if mine is not None else []
    sources = [mine] if mine is not None else []
    if small_recvs:
        # split_with_sizes directly: torch.split goes through two Python layers first (3 us).
        chunks = packed_out.split_with_sizes([recv_splits[p] for p in small_recvs])
        if by_rows:
            targets += [recvs[p] for p in small_recvs]
            sources += chunks
        else:
            for p, chunk in zip(small_recvs, chunks, strict=True):
                into = recvs[p]
                if into.is_contiguous():
                    _byte_view(into).copy_(chunk)  # a view of `into` itself
                else:
                    staging = torch.empty_like(into, memory_format=torch.contiguous_format)
                    _byte_view(staging).copy_(chunk)
                    into.copy_(staging)
    if targets:
        torch._foreach_copy_(targets, sources)


def _check_sizes_with_peers(
    recvs: Sequence[torch.Tensor], sends: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """Compare what each peer will send with what this rank expects; raise on every rank alike."""
    state = _STATE
    mine = torch.tensor([t.nbytes for t in sends], dtype=torch.int64)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    expected = [t.nbytes for t in recvs]
    wrong = [(i, int(n), expected[i]) for i, n in enumerate(theirs.tolist()) if int(n) != expected[i]]
    flag = torch.tensor([1 if wrong else 0], dtype=torch.int32)
    dist.all_reduce(flag, dist.ReduceOp.MAX, group=group)
    if wrong:
        i, sent, want = wrong[0]
        raise InvalidArgumentError(
            f"recv_list[{i}] holds {want} bytes but rank {i} sends {sent}: the receiving tensor must have "
            "exactly the size the peer sends."
        )
    if int(flag.item()):
        raise InvalidArgumentError(
            f"all_to_all message sizes do not match on another rank (rank {state.rank}'s are right): a "
            "recv_list tensor there differs from what its peer sends; that rank's error names it."
        )


# -- model helpers -----------------------------------------------------------------------------


def _buckets(tensors: Iterable[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Tensors grouped by (device, dtype) in first-seen order, cut into buckets of about ``cap``
    bytes. Deterministic, so equal models give equal buckets on every rank."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        runs = by_kind.setdefault(key, [[]])
        if runs[-1] and sizes[key] + t.nbytes > cap:
            runs.append([])
            sizes[key] = 0
        runs[-1].append(t)
        sizes[key] = sizes.get(key, 0) + t.nbytes
    return [bucket for runs in by_kind.values() for bucket in runs if bucket]


def _bucketed(
    tensors: list[torch.Tensor],
    run: Callable[[torch.Tensor, dist.ProcessGroup | None], None],
    write_back: bool,
) -> None:
    """Apply a collective ``run(flat, group)`` to each bucket of ``tensors`` as one flat tensor on
    the comm device (or the CPU side group), writing the results back when ``write_back``."""
    state = _STATE
    for bucket in _buckets(tensors, BUCKET_BYTES):
        first = bucket[0]
        if first.is_cpu and state.cpu_group is not None:
            device, group = first.device, state.cpu_group
        else:
            device, group = state.comm_device, None
        if len(bucket) == 1 and first.is_contiguous() and first.device == device:
            run(first, group)  # nothing to pack: run in place
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket]).to(device)
        run(flat, group)
        if write_back:
            for t, chunk in zip(bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True):
                t.copy_(chunk.view(t.shape))


def sync_params(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers (its whole state dict) to every rank, as SAR's
    sync_params. One broadcast per bucket of about 25 MiB of one dtype. Every rank must pass a
    model of the same architecture. Blocks. Raises :class:`FailedPreconditionError` before
    initialize_comms, the recorded :class:`PeerFailedError` after a peer failed, and the backend's
    errors."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("sync_params")
    tensors = list(model.state_dict().values())
    sending = state.rank == 0
    nbytes = sum(t.nbytes for t in tensors) if sending else 0

    def broadcast_from_0(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        dist.broadcast(flat, 0, group=group)

    def run() -> None:
        with torch.no_grad():
            _bucketed(tensors, broadcast_from_0, write_back=not sending)

    _timed_call(state.stats["sync_params"], nbytes, run)


def gather_grads(model: torch.nn.Module, average: bool = False) -> None:
    """Sum (``average=True``: average) every parameter's gradient across ranks, in place, as SAR's
    gather_grads; call it before ``optimizer.step()``.

    Dense gradients go in flat buckets of about 25 MiB per dtype (one all_reduce each, not one per
    parameter). Ranks may differ in which parameters have a gradient: a first, small all_reduce
    agrees on that set, a missing gradient counts as zeros and then holds the sum; a parameter
    without a gradient on every rank keeps ``grad`` None. Every rank must pass a model of the same
    architecture. Blocks. Raises :class:`FailedPreconditionError` before initialize_comms, the
    recorded :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        _raise_not_ready("gather_grads")
    params = list(model.parameters())
    if not params:
        return
    nbytes = sum(p.grad.nbytes for p in params if p.grad is not None)

    def run() -> None:
        with torch.no_grad():
            _gather_grads(params, average)

    _timed_call(state.stats["gather_grads"], nbytes, run)


def _gather_grads(params: list[torch.nn.Parameter], average: bool) -> None:
    state = _STATE
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    # MAX over ranks: a parameter has a gradient when any rank has one.
    dist.all_reduce(has, dist.ReduceOp.MAX, group=state.cpu_group)
    dense: list[torch.Tensor] = []
    for param, anyone in zip(params, has.tolist(), strict=True):
        if not anyone:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        if grad.is_sparse:
            group = state.cpu_group if grad.is_cpu else None
            dist.all_reduce(grad, group=group)
            if average:
                grad.div_(state.world_size)
        else:
            dense.append(grad)
    world = state.world_size

    def reduce(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(world)

    _bucketed(dense, reduce, write_back=True)


# -- torch.distributed's other collectives, same signatures ------------------------------------------


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> CollectiveHandle | None:
    """``torch.distributed.broadcast``, recorded. Returns a :class:`CollectiveHandle` when
    ``async_op``, else None; raises what torch raises, :class:`FailedPreconditionError` before
    initialize_comms and the recorded :class:`PeerFailedError` after a peer failed."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("broadcast")
    if group is None and group_src is None and state.cpu_group is None:  # the common case, lean
        nbytes = tensor.nbytes if src == state.rank else 0
        return _timed(state.stats["broadcast"], nbytes, dist.broadcast, tensor, src, None, async_op)
    group, stats = _route("broadcast", group, tensor)
    nbytes = tensor.nbytes if _is_me(src, group_src, group) else 0
    return _timed(stats, nbytes, dist.broadcast, tensor, src, group, async_op, **_opt("group_src", group_src))


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """``torch.distributed.all_gather``, recorded. Returns a :class:`CollectiveHandle` when
    ``async_op``, else None; raises as :func:`broadcast`."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("all_gather")
    if group is None and state.cpu_group is None:
        stats = state.stats["all_gather"]
    else:
        group, stats = _route("all_gather", group, tensor)
    return _timed(stats, tensor.nbytes, dist.all_gather, tensor_list, tensor, group, async_op)


# Backends whose reduce_scatter raised "not supported" in this process: use the fallback.
_no_native_reduce_scatter: set[str] = set()


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOpLike = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """``torch.distributed.reduce_scatter``, recorded: ``output`` becomes the reduction over ranks
    of their ``input_list[rank]``. Where the backend lacks it (gloo in older torch) the same result
    comes from one all_to_all and a local reduction (then the call completes before returning,
    even with ``async_op``). Returns a :class:`CollectiveHandle` when ``async_op``, else None;
    raises as :func:`broadcast`, and :class:`InvalidArgumentError` for an op the fallback cannot
    apply (PREMUL_SUM)."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("reduce_scatter")
    group, stats = _route("reduce_scatter", group, output)
    me = state.rank if group is None else dist.get_rank(group)
    nbytes = sum(t.nbytes for i, t in enumerate(input_list) if i != me)
    if stats.backend not in _no_native_reduce_scatter:
        try:
            return _timed(stats, nbytes, _native_reduce_scatter, output, input_list, op, group, async_op)
        except _Unsupported:
            log.info(
                "reduce_scatter is not supported by %s; using all_to_all + local reduction", stats.backend
            )
            _no_native_reduce_scatter.add(stats.backend)
    return _timed(stats, nbytes, _reduce_scatter_fallback, output, input_list, op, group, async_op)


def _native_reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOpLike,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> dist.Work | None:
    try:
        work: dist.Work | None = dist.reduce_scatter(output, input_list, op, group, async_op)
        return work
    except RuntimeError as exc:
        text = str(exc).lower()
        if "not support" in text or "not implemented" in text:
            raise _Unsupported(str(exc)) from exc
        raise


def _reduce_scatter_fallback(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOpLike,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> _Completed | None:
    """reduce_scatter as an all_to_all (rank i gets everyone's ``input_list[i]``) plus a local
    reduction: each rank sends (world-1)/world of its input once, as a ring reduce_scatter does.
    Synchronous; returns a completed stand-in for ``async_op``."""
    world = len(input_list)
    for i, t in enumerate(input_list):
        if t.shape != output.shape or t.dtype != output.dtype:
            raise InvalidArgumentError(
                f"input_list[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; reduce_scatter needs "
                f"the output's, {tuple(output.shape)} and {output.dtype}."
            )
    parts = [torch.empty_like(output, memory_format=torch.contiguous_format) for _ in range(world)]
    _all_to_all_impl(parts, list(input_list), group)
    output.copy_(_reduce_local(parts, op, world))
    return _Completed() if async_op else None


def _reduce_local(parts: list[torch.Tensor], op: ReduceOpLike, world: int) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op == dist.ReduceOp.SUM:
        return stacked.sum(0, dtype=stacked.dtype)
    if op == dist.ReduceOp.AVG:
        return stacked.sum(0, dtype=stacked.dtype) / world
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(0, dtype=stacked.dtype)
    if op == dist.ReduceOp.MIN:
        return stacked.amin(0)
    if op == dist.ReduceOp.MAX:
        return stacked.amax(0)
    bitwise = {
        dist.ReduceOp.BAND: torch.bitwise_and,
        dist.ReduceOp.BOR: torch.bitwise_or,
        dist.ReduceOp.BXOR: torch.bitwise_xor,
    }
    for red_op, fn in bitwise.items():
        if op == red_op:
            result = parts[0].clone()
            for part in parts[1:]:
                result = fn(result, part)
            return result
    raise InvalidArgumentError(
        f"op={shorten(op)} is not supported by the reduce_scatter fallback; it applies SUM, AVG, "
        "PRODUCT, MIN, MAX, BAND, BOR and BXOR."
    )


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOpLike = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CollectiveHandle | None:
    """``torch.distributed.reduce``, recorded. Returns a :class:`CollectiveHandle` when
    ``async_op``, else None; raises as :func:`broadcast`."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("reduce")
    if group is None and group_dst is None and state.cpu_group is None:
        nbytes = 0 if dst == state.rank else tensor.nbytes
        return _timed(state.stats["reduce"], nbytes, dist.reduce, tensor, dst, op, None, async_op)
    group, stats = _route("reduce", group, tensor)
    nbytes = 0 if _is_me(dst, group_dst, group) else tensor.nbytes
    return _timed(
        stats, nbytes, dist.reduce, tensor, dst, op, group, async_op, **_opt("group_dst", group_dst)
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CollectiveHandle | None:
    """``torch.distributed.gather``, recorded. Returns a :class:`CollectiveHandle` when
    ``async_op``, else None; raises as :func:`broadcast`."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("gather")
    if group is None and group_dst is None and state.cpu_group is None:
        nbytes = 0 if dst == state.rank else tensor.nbytes
        return _timed(state.stats["gather"], nbytes, dist.gather, tensor, gather_list, dst, None, async_op)
    group, stats = _route("gather", group, tensor)
    nbytes = 0 if _is_me(dst, group_dst, group) else tensor.nbytes
    return _timed(
        stats, nbytes, dist.gather, tensor, gather_list, dst, group, async_op, **_opt("group_dst", group_dst)
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> CollectiveHandle | None:
    """``torch.distributed.scatter``, recorded. Returns a :class:`CollectiveHandle` when
    ``async_op``, else None; raises as :func:`broadcast`."""
    if not _STATE.ready:
        _raise_not_ready("scatter")
    group, stats = _route("scatter", group, tensor)
    nbytes = 0
    if scatter_list is not None and _is_me(src, group_src, group):
        me = _STATE.rank if group is None else dist.get_rank(group)
        nbytes = sum(t.nbytes for i, t in enumerate(scatter_list) if i != me)
    return _timed(
        stats,
        nbytes,
        dist.scatter,
        tensor,
        scatter_list,
        src,
        group,
        async_op,
        **_opt("group_src", group_src),
    )


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """``torch.distributed.send``, recorded; blocks until the tensor is sent. Raises as
    :func:`broadcast`."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("send")
    if group is None and group_dst is None and state.cpu_group is None:
        _timed(state.stats["send"], tensor.nbytes, dist.send, tensor, dst, None, tag)
        return
    group, stats = _route("send", group, tensor)
    _timed(stats, tensor.nbytes, dist.send, tensor, dst, group, tag, **_opt("group_dst", group_dst))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """``torch.distributed.recv``, recorded; blocks until ``tensor`` is filled and returns the
    sender's rank (``src=None`` receives from any rank). Raises as :func:`broadcast`."""
    if not _STATE.ready:
        _raise_not_ready("recv")
    group, stats = _route("recv", group, tensor)
    extra = _opt("group_src", group_src)
    return _timed_call(stats, 0, lambda: int(dist.recv(tensor, src, group, tag, **extra)))


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: datetime.timedelta | None = None,
) -> CollectiveHandle | None:
    """``torch.distributed.barrier``, recorded: blocks until every rank has called it (or, with
    ``async_op``, returns a :class:`CollectiveHandle`). Raises as :func:`broadcast`."""
    state = _STATE
    if not state.ready:
        _raise_not_ready("barrier")
    stats = state.stats["barrier"]
    if device_ids is None and timeout is None:
        return _timed(stats, 0, dist.barrier, group, async_op)
    return _timed(
        stats, 0, dist.barrier, group, async_op, **_opt("device_ids", device_ids), **_opt("timeout", timeout)
    )
