"""``torch.distributed``'s other collectives with torch's own signatures, each recorded by
:mod:`.timing`: ``broadcast``, ``all_gather``, ``reduce_scatter`` (with a fallback
where the backend lacks it), ``reduce``, ``gather``, ``scatter``, ``send``/``recv`` and ``barrier``."""

from __future__ import annotations

import datetime
import logging
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.library import comm
from sarcomm.worker.library.collectives.alltoall import all_to_all_impl
from sarcomm.worker.library.collectives.timing import (
    CollectiveHandle,
    Completed,
    ReduceOpLike,
    Unsupported,
    is_me,
    optional_kwarg,
    raise_not_ready,
    route,
    timed,
    timed_call,
)

__all__ = [
    "all_gather",
    "barrier",
    "broadcast",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]

log = logging.getLogger(__name__)

_STATE: Final = comm.STATE
_SUM: Final = dist.ReduceOp.SUM


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
        raise_not_ready("broadcast")
    if group is None and group_src is None and state.cpu_group is None:  # the common case, lean
        nbytes = tensor.nbytes if src == state.rank else 0
        return timed(state.stats["broadcast"], nbytes, dist.broadcast, tensor, src, None, async_op)
    group, stats = route("broadcast", group, tensor)
    nbytes = tensor.nbytes if is_me(src, group_src, group) else 0
    return timed(
        stats, nbytes, dist.broadcast, tensor, src, group, async_op, **optional_kwarg("group_src", group_src)
    )


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
        raise_not_ready("all_gather")
    if group is None and state.cpu_group is None:
        stats = state.stats["all_gather"]
    else:
        group, stats = route("all_gather", group, tensor)
    return timed(stats, tensor.nbytes, dist.all_gather, tensor_list, tensor, group, async_op)


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
        raise_not_ready("reduce_scatter")
    group, stats = route("reduce_scatter", group, output)
    me = state.rank if group is None else dist.get_rank(group)
    nbytes = sum(t.nbytes for i, t in enumerate(input_list) if i != me)
    if stats.backend not in _no_native_reduce_scatter:
        try:
            return timed(stats, nbytes, _native_reduce_scatter, output, input_list, op, group, async_op)
        except Unsupported:
            log.info(
                "reduce_scatter is not supported by %s; using all_to_all + local reduction", stats.backend
            )
            _no_native_reduce_scatter.add(stats.backend)
    return timed(stats, nbytes, _reduce_scatter_fallback, output, input_list, op, group, async_op)


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
            raise Unsupported(str(exc)) from exc
        raise


def _reduce_scatter_fallback(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOpLike,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> Completed | None:
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
    all_to_all_impl(parts, list(input_list), group)
    output.copy_(_reduce_local(parts, op, world))
    return Completed() if async_op else None


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
        raise_not_ready("reduce")
    if group is None and group_dst is None and state.cpu_group is None:
        nbytes = 0 if dst == state.rank else tensor.nbytes
        return timed(state.stats["reduce"], nbytes, dist.reduce, tensor, dst, op, None, async_op)
    group, stats = route("reduce", group, tensor)
    nbytes = 0 if is_me(dst, group_dst, group) else tensor.nbytes
    return timed(
        stats, nbytes, dist.reduce, tensor, dst, op, group, async_op, **optional_kwarg("group_dst", group_dst)
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
        raise_not_ready("gather")
    if group is None and group_dst is None and state.cpu_group is None:
        nbytes = 0 if dst == state.rank else tensor.nbytes
        return timed(state.stats["gather"], nbytes, dist.gather, tensor, gather_list, dst, None, async_op)
    group, stats = route("gather", group, tensor)
    nbytes = 0 if is_me(dst, group_dst, group) else tensor.nbytes
    return timed(
        stats,
        nbytes,
        dist.gather,
        tensor,
        gather_list,
        dst,
        group,
        async_op,
        **optional_kwarg("group_dst", group_dst),
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
        raise_not_ready("scatter")
    group, stats = route("scatter", group, tensor)
    nbytes = 0
    if scatter_list is not None and is_me(src, group_src, group):
        me = _STATE.rank if group is None else dist.get_rank(group)
        nbytes = sum(t.nbytes for i, t in enumerate(scatter_list) if i != me)
    return timed(
        stats,
        nbytes,
        dist.scatter,
        tensor,
        scatter_list,
        src,
        group,
        async_op,
        **optional_kwarg("group_src", group_src),
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
        raise_not_ready("send")
    if group is None and group_dst is None and state.cpu_group is None:
        timed(state.stats["send"], tensor.nbytes, dist.send, tensor, dst, None, tag)
        return
    group, stats = route("send", group, tensor)
    timed(stats, tensor.nbytes, dist.send, tensor, dst, group, tag, **optional_kwarg("group_dst", group_dst))


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
        raise_not_ready("recv")
    group, stats = route("recv", group, tensor)
    extra = optional_kwarg("group_src", group_src)
    return timed_call(stats, 0, lambda: int(dist.recv(tensor, src, group, tag, **extra)))


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
        raise_not_ready("barrier")
    stats = state.stats["barrier"]
    if device_ids is None and timeout is None:
        return timed(stats, 0, dist.barrier, group, async_op)
    return timed(
        stats,
        0,
        dist.barrier,
        group,
        async_op,
        **optional_kwarg("device_ids", device_ids),
        **optional_kwarg("timeout", timeout),
    )
