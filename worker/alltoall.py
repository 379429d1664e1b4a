"""SAR's ``all_to_all`` and ``exchange_tensors``: tensors of unequal sizes on every backend.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker import comm
from sarcomm.worker.timing import raise_not_ready, route, timed, timed_call

__all__ = [
    "AllToAllConfig",
    "all_to_all",
    "all_to_all_config",
    "all_to_all_impl",
    "configure_all_to_all",
    "exchange_tensors",
]

_STATE: Final = comm.STATE
# all_to_all's point-to-point messages use their own tag so that they can never be matched with
# a user's send/recv (tag 0 by default) that is in flight at the same time.
_A2A_TAG: Final = 0x5A2A


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
        raise_not_ready("all_to_all")
    world, me = state.world_size, state.rank
    _check_exchange_lists(recv_list, send_list, world, me, move_to_comm_device)
    if move_to_comm_device:
        device = state.comm_device
        sends = [t.to(device) for t in send_list]
        recvs = [t if t.device == device else torch.empty_like(t, device=device) for t in recv_list]
    else:
        sends, recvs = list(send_list), list(recv_list)
    nbytes = sum([t.nbytes for t in sends]) - sends[me].nbytes
    group, stats = route("all_to_all", None, sends[me])
    timed(stats, nbytes, all_to_all_impl, recvs, sends, group)
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
        raise_not_ready("exchange_tensors")
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
    group, stats = route("exchange_tensors", None, sends[0])
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
        all_to_all_impl(recvs, sends, group)
        return recvs

    received = timed_call(stats, nbytes, run)
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


def all_to_all_impl(
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
