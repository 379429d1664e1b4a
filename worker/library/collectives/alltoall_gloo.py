"""How :func:`.alltoall.all_to_all` exchanges tensors of unequal sizes on gloo.

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
"""

from __future__ import annotations

from typing import Final

import torch
import torch.distributed as dist

from sarcomm.worker.library.collectives.timing import dispatch_below

__all__ = ["byte_view", "hybrid_all_to_all"]

# all_to_all's point-to-point messages use their own tag so that they can never be matched with
# a user's send/recv (tag 0 by default) that is in flight at the same time.
_A2A_TAG: Final = 0x5A2A


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's memory as a flat uint8 tensor (no copy when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def hybrid_all_to_all(
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
        parts = [byte_view(sends[p]) for p in small_sends]
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
    with dispatch_below():
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
        with dispatch_below():
            works.append(dist.isend(out, peers[dst] if peers is not None else dst, group=group, tag=_A2A_TAG))
    for src in large_recvs:
        into = recvs[src]
        target = (
            into if into.is_contiguous() else torch.empty_like(into, memory_format=torch.contiguous_format)
        )
        targets.append((into, target))
        with dispatch_below():
            works.append(
                dist.irecv(target, peers[src] if peers is not None else src, group=group, tag=_A2A_TAG)
            )
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
                    byte_view(into).copy_(chunk)  # a view of `into` itself
                else:
                    staging = torch.empty_like(into, memory_format=torch.contiguous_format)
                    byte_view(staging).copy_(chunk)
                    into.copy_(staging)
    if targets:
        torch._foreach_copy_(targets, sources)
