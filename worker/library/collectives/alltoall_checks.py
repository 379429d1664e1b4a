"""The checks on what :mod:`.alltoall`'s exchanges are given: the lists' lengths,
dtypes, shapes and devices (on this rank alone), ``exchange_tensors``' receive sizes, and the
optional comparison of message sizes with the peers (``check_sizes``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.library import comm

__all__ = ["check_exchange_lists", "check_sizes_with_peers", "checked_sizes"]

_STATE: Final = comm.STATE


def checked_sizes(recv_sizes: Sequence[int], world: int) -> list[int]:
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


def check_exchange_lists(
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


def check_sizes_with_peers(
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
