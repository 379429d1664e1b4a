"""Halo exchange, SAR's way: feature rows of remote source nodes travel with ``exchange_tensors``,
and in the backward pass their gradients travel back to the ranks that own them.

The plan is made once (:func:`make_plan`): each rank tells every owner which of its rows it
needs, so that each rank knows which rows to send whom. Every later exchange moves only feature
rows, with sizes both ends already know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

import sarcomm.worker as sar

# isort: split
from graph import LocalPart

__all__ = ["HaloExchange", "HaloPlan", "make_plan", "make_propagate"]


@dataclass(frozen=True)
class HaloPlan:
    """Who sends which rows to whom, from one rank's point of view.

    ``send_idx[r]``: the local rows rank ``r`` needs from this rank, in the order it asked for them.
    ``recv_counts[r]``: how many rows this rank gets from rank ``r`` (its ``halo_counts``)."""

    num_local: int
    send_idx: list[torch.Tensor]
    recv_counts: list[int]

    @property
    def send_counts(self) -> list[int]:
        return [len(idx) for idx in self.send_idx]


def make_plan(part: LocalPart) -> HaloPlan:
    """Exchange the request lists (one collective; every rank must call it). Blocks."""
    # Sizes unknown here: exchange_tensors exchanges them first.
    send_idx = sar.exchange_tensors(part.requests())
    return HaloPlan(part.num_local, send_idx, list(part.halo_counts))


class HaloExchange(torch.autograd.Function):
    """``apply(h, plan)``: this rank's rows ``h`` followed by the halo rows from every other rank
    (rank order, as ``LocalPart``'s extended index expects). Differentiable: the backward pass
    returns each halo row's gradient to its owner, which adds it to the gradient of the row it
    sent. Both passes are collectives: every rank must run them, in the same order, so ``h`` must
    require grad on every rank or on none (autograd skips the backward of a Function whose inputs
    need no gradient)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
        ctx.plan = plan
        received = sar.exchange_tensors([h[idx] for idx in plan.send_idx], plan.recv_counts)
        return torch.cat([h, *received])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan: HaloPlan = ctx.plan
        grad = grad.contiguous()
        grad_h = grad[: plan.num_local].clone()
        halo_grads = list(torch.split(grad[plan.num_local :], plan.recv_counts))
        # Rank r returns the gradients of the rows it got from here, in the order they were sent.
        returned = sar.exchange_tensors(halo_grads, plan.send_counts)
        for idx, rows in zip(plan.send_idx, returned, strict=True):
            # Accumulate: a row's gradient sums its local uses and those of every rank that read it.
            grad_h.index_add_(0, idx, rows)
        return grad_h, None


def make_propagate(
    part: LocalPart, plan: HaloPlan, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """GCN's aggregation on this rank's nodes: ``h -> (D^-1/2 (A + I) D^-1/2 h)[local rows]``.

    Degrees are global: a local node's in-degree is complete here (every edge into it is local),
    and the halo nodes' degrees come from their owners in one exchange, as a halo row would."""
    n = part.num_local
    degree = torch.bincount(part.dst, minlength=n).to(dtype)
    halo_degree = sar.exchange_tensors([degree[idx] for idx in plan.send_idx], plan.recv_counts)
    ext_degree = torch.cat([degree, *halo_degree])
    norm = (ext_degree[part.src] * degree[part.dst]).rsqrt().unsqueeze(1)
    src, dst = part.src, part.dst

    def propagate(h: torch.Tensor) -> torch.Tensor:
        # Function.apply is untyped in torch; it returns forward's result.
        ext = cast(torch.Tensor, HaloExchange.apply(h, plan))  # type: ignore[no-untyped-call]
        messages = ext[src] * norm
        return torch.zeros((n, h.shape[1]), dtype=h.dtype).index_add(0, dst, messages)

    return propagate
