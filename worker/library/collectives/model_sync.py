"""SAR's model helpers: ``sync_params`` (rank 0's state dict to every rank) and ``gather_grads``
(gradients summed or averaged over ranks), in flat buckets of about 25 MiB per dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.worker.library import comm
from sarcomm.worker.library.collectives.timing import dispatch_below, raise_not_ready, timed_call

__all__ = ["BUCKET_BYTES", "gather_grads", "sync_params"]

_STATE: Final = comm.STATE
#: Bucket size of sync_params and gather_grads: as DistributedDataParallel's default, large
#: enough that per-call latency is amortised, small enough to bound the extra memory.
BUCKET_BYTES: Final = 25 * 1024 * 1024


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
        raise_not_ready("sync_params")
    tensors = list(model.state_dict().values())
    sending = state.rank == 0
    nbytes = sum(t.nbytes for t in tensors) if sending else 0

    def broadcast_from_0(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        with dispatch_below():
            dist.broadcast(flat, 0, group=group)

    def run() -> None:
        with torch.no_grad():
            _bucketed(tensors, broadcast_from_0, write_back=not sending)

    timed_call(state.stats["sync_params"], nbytes, run)


def gather_grads(model: torch.nn.Module, average: bool = False, *, bucketed: bool = True) -> None:
    """Sum (``average=True``: average) every parameter's gradient across ranks, in place, as SAR's
    gather_grads; call it before ``optimizer.step()``.

    ``bucketed=True`` (the default): dense gradients go in flat buckets of about 25 MiB per dtype,
    one all_reduce per bucket. ``bucketed=False`` sums in SAR's order, bit for bit: one all_reduce
    per parameter with a gradient, in ``model.parameters()`` order, each on that gradient alone
    (on :func:`comm_device`, copied back where it lives elsewhere), as SAR does. The two can differ
    in the last bits above two ranks, because the backend splits a large flat buffer into other
    chunks than a single gradient, so the additions happen in another order. Cost of SAR's order:
    one collective per parameter instead of one per bucket (a model of P parameters in B buckets:
    1 + P all_reduce calls instead of 1 + B), each paying the backend's per-call latency (about
    40 us on gloo over loopback) where a bucket pays it once; see ``benchmarks/RESULTS.md``.

    Ranks may differ in which parameters have a gradient: a first, small all_reduce agrees on that
    set, a missing gradient counts as zeros and then holds the sum; a parameter without a gradient
    on every rank keeps ``grad`` None. Every rank must pass a model of the same architecture and
    the same ``bucketed``. Blocks. Raises :class:`FailedPreconditionError` before initialize_comms,
    the recorded :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        raise_not_ready("gather_grads")
    params = list(model.parameters())
    if not params:
        return
    nbytes = sum(p.grad.nbytes for p in params if p.grad is not None)

    def run() -> None:
        with torch.no_grad():
            _gather_grads(params, average, bucketed)

    timed_call(state.stats["gather_grads"], nbytes, run)


def _gather_grads(params: list[torch.nn.Parameter], average: bool, bucketed: bool) -> None:
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
            with dispatch_below():
                dist.all_reduce(grad, group=group)
            if average:
                grad.div_(state.world_size)
        else:
            dense.append(grad)
    world = state.world_size

    def reduce(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        with dispatch_below():
            dist.all_reduce(flat, group=group)
        if average:
            flat.div_(world)

    if bucketed:
        _bucketed(dense, reduce, write_back=True)
        return
    # SAR's order: one all_reduce per gradient, on the comm device as SAR does (in an nccl job a CPU
    # gradient goes to the GPU and through NCCL, not through the gloo side group, so that the sums
    # are the ones SAR gets).
    for grad in dense:
        target = grad if grad.device == state.comm_device else grad.to(state.comm_device)
        reduce(target, None)
        if target is not grad:
            grad.copy_(target)
