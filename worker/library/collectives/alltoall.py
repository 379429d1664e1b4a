"""SAR's ``all_to_all`` and ``exchange_tensors``: tensors of unequal sizes on every backend.

How all_to_all runs
-------------------
- **Equal sizes on gloo** (both lists plain lists of host-memory tensors of one shape and one
  non-complex dtype, each message at most 64 KiB and at most ``small_message_bytes``) go straight
  to gloo's own all_to_all, the process group's call itself: nothing is packed or copied in
  Python, and what torch's ``dist.all_to_all`` would check again (4 us a call) is not. Above 64 KiB
  gloo's list all_to_all is slower than the packed exchange (on 2 cores with 2 and 4 ranks: level
  at 96 to 128 KiB a message, 1.4x slower at 256 KiB, 2x at 1 MiB), so larger equal messages take
  the hybrid path. Each rank decides by its own lists alone, so ranks
  can decide differently (a rank whose messages are all equal can have a peer whose messages are
  not), and that is safe: gloo's equal-size all_to_all and the packed ``all_to_all_single`` of the
  other path are the same exchange on the wire (one message per pair of ranks, on the same slot,
  in the same order; ``tests/test_alltoall.py`` runs such mixtures), and a message that fits the
  condition is small, hence packed, at its other end too. Equal messages above the threshold take
  the hybrid path (whose point-to-point messages are faster there). On a torch whose gloo lacks the
  list all_to_all the first call finds that out before anything is sent, and the process uses the
  hybrid path from then on.
- **Everything else on gloo**: the hybrid exchange of :mod:`.alltoall_gloo` (packed
  small messages, point-to-point large ones).
- **Other backends** (nccl, mpi, ucc, ccl) take unequal sizes natively and get ``dist.all_to_all``.

Rounds (``max_collective_size``)
--------------------------------
SAR's ``Config.max_collective_size`` caps the elements of one collective call. When a limit is in
force, ``all_to_all`` and ``exchange_tensors`` run in rounds as SAR's all_to_all does: the number of
rounds is ``max(1, elements this rank sends and receives // limit)``, agreed as the maximum over
the ranks with one all_reduce, and round ``r`` of ``R`` carries rows ``[n*r//R, n*(r+1)//R)`` of
every tensor of ``n`` rows (a 0-dimensional tensor counts as one row); both ends of a message cut
the same rows. The limit in force (:func:`max_collective_size`) is sarcomm's own,
``configure_all_to_all(max_collective_size=N)``, when N > 0; otherwise SAR's
``sar.Config.max_collective_size`` when SAR's ``sar.config`` module is loaded in the process (read
at every call, as SAR reads it); otherwise none. Like the rest of the configuration it must be the
same on every rank.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.library import comm
from sarcomm.worker.library.collectives.alltoall_checks import (
    check_exchange_lists,
    check_sizes_with_peers,
    checked_sizes,
)
from sarcomm.worker.library.collectives.alltoall_gloo import hybrid_all_to_all
from sarcomm.worker.library.collectives.timing import (
    Unsupported,
    dispatch_below,
    raise_not_ready,
    route,
    timed,
    timed_all_to_all,
    timed_call,
)

__all__ = [
    "AllToAllConfig",
    "all_to_all",
    "all_to_all_config",
    "all_to_all_impl",
    "configure_all_to_all",
    "exchange_tensors",
    "max_collective_size",
]

log = logging.getLogger(__name__)

_STATE: Final = comm.STATE
#: Equal-size messages up to this many bytes go through gloo's list all_to_all (see above).
NATIVE_MAX_BYTES: Final = 64 * 1024
#: Where SAR keeps its Config class (read, never imported: importing SAR imports DGL).
_SAR_CONFIG_MODULE: Final = "sar.config"


def _check_count(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}={shorten(value)} must be an integer {meaning}.")
    if value < 0:
        raise InvalidArgumentError(f"{name}={value} must be at least 0 ({meaning}; 0 = {_ZERO[name]}).")


_ZERO: Final = {
    "small_message_bytes": "all point to point",
    "max_collective_size": "no limit",
    "sar.Config.max_collective_size": "no limit",
}


@dataclass(frozen=True)
class AllToAllConfig:
    """How :func:`all_to_all` runs. Must be the same on every rank: both ends of a message
    classify it by ``small_message_bytes``, and ``check_sizes`` and ``max_collective_size`` add
    collectives."""

    #: Messages of at most this many bytes are packed into one all_to_all_single; larger ones go
    #: point to point. 0 sends everything point to point.
    small_message_bytes: int = 1024 * 1024
    #: Exchange and compare the message sizes first (two extra small collectives per call), so
    #: that a sender/receiver size mismatch raises InvalidArgumentError on every rank instead of
    #: aborting the receiving process inside gloo.
    check_sizes: bool = False
    #: Elements (sent plus received by a rank) above which all_to_all and exchange_tensors run in
    #: rounds, as SAR's ``Config.max_collective_size``; 0 leaves it to SAR's Config (see the
    #: module's documentation), which by default sets no limit.
    max_collective_size: int = 0

    def __post_init__(self) -> None:
        _check_count("small_message_bytes", self.small_message_bytes, "number of bytes")
        _check_count("max_collective_size", self.max_collective_size, "number of elements")


_a2a_config = AllToAllConfig()
# Whether a call may take the equal-size path as far as the configuration goes (no size check, no
# sarcomm limit; SAR's limit is read at each call), and whether gloo has the list all_to_all.
_plain = True
_gloo_lists = True


def configure_all_to_all(
    *,
    small_message_bytes: int | None = None,
    check_sizes: bool | None = None,
    max_collective_size: int | None = None,
) -> None:
    """Change how :func:`all_to_all` runs (see :class:`AllToAllConfig`); arguments left None keep
    their value. Every rank must make the same call, between collectives. Raises
    :class:`InvalidArgumentError` for a negative or non-integer ``small_message_bytes`` or
    ``max_collective_size``."""
    global _a2a_config, _plain
    current = _a2a_config
    _a2a_config = AllToAllConfig(
        small_message_bytes=current.small_message_bytes
        if small_message_bytes is None
        else small_message_bytes,
        check_sizes=current.check_sizes if check_sizes is None else check_sizes,
        max_collective_size=current.max_collective_size
        if max_collective_size is None
        else max_collective_size,
    )
    _plain = not _a2a_config.check_sizes and _a2a_config.max_collective_size == 0


def all_to_all_config() -> AllToAllConfig:
    """The :class:`AllToAllConfig` in force."""
    return _a2a_config


def max_collective_size() -> int:
    """The limit in force, in elements (0: none): sarcomm's ``max_collective_size`` when above 0,
    else SAR's ``Config.max_collective_size`` when ``sar.config`` is loaded, else 0. Raises
    :class:`InvalidArgumentError` when SAR's value is not a non-negative integer."""
    own = _a2a_config.max_collective_size
    if own:
        return own
    module = sys.modules.get(_SAR_CONFIG_MODULE)
    return 0 if module is None else _sar_limit(module)


def _sar_limit(module: object) -> int:
    value = getattr(getattr(module, "Config", None), "max_collective_size", 0)
    if value is None:
        return 0
    _check_count("sar.Config.max_collective_size", value, "number of elements")
    return int(value)


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
    copied back). Runs in rounds when a ``max_collective_size`` is in force. Blocks until this
    rank's part is done. Raises :class:`InvalidArgumentError` for lists that break these rules,
    :class:`FailedPreconditionError` before initialize_comms, the recorded
    :class:`PeerFailedError` after a peer failed, and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        raise_not_ready("all_to_all")
    # Equal sizes on gloo: gloo's own all_to_all, directly (see the module's documentation).
    group = state.cpu_group
    if (
        _plain
        and _gloo_lists
        and (group is not None or state.backend == "gloo")
        and (_SAR_CONFIG_MODULE not in sys.modules or max_collective_size() == 0)
        and (not move_to_comm_device or state.comm_device.type == "cpu")
        and isinstance(recv_list, list)
        and isinstance(send_list, list)
        and _equal_small_cpu(recv_list, send_list, state.world_size)
    ):
        stats = state.stats["all_to_all"] if group is None else state.cpu_stats["all_to_all"]
        nbytes = send_list[0].nbytes * (state.world_size - 1)
        try:
            timed_all_to_all(stats, nbytes, recv_list, send_list, group)
            return
        except Unsupported as exc:
            _no_gloo_lists(exc)
    _all_to_all_general(recv_list, send_list, move_to_comm_device)


def _equal_small_cpu(recv_list: list[torch.Tensor], send_list: list[torch.Tensor], world: int) -> bool:
    """Whether both lists hold ``world`` host-memory tensors of one shape and one non-complex
    dtype, each at most :data:`NATIVE_MAX_BYTES` and ``small_message_bytes``. False for anything
    else (the general path judges it). The lists' type is checked by the caller."""
    if len(send_list) != world or len(recv_list) != world:
        return False
    try:
        first = send_list[0]
        shape, dtype = first.shape, first.dtype
        nbytes = first.nbytes
        if nbytes > NATIVE_MAX_BYTES or nbytes > _a2a_config.small_message_bytes or dtype.is_complex:
            return False
        for t in send_list:
            if t.shape != shape or t.dtype is not dtype or not t.is_cpu:
                return False
        for t in recv_list:
            if t.shape != shape or t.dtype is not dtype or not t.is_cpu:
                return False
    except AttributeError:  # not a tensor
        return False
    return True


def _no_gloo_lists(exc: Unsupported) -> None:
    global _gloo_lists
    _gloo_lists = False
    log.info("gloo has no list all_to_all in this torch (%s); equal sizes take the hybrid path", exc)


def _all_to_all_general(
    recv_list: Sequence[torch.Tensor], send_list: Sequence[torch.Tensor], move_to_comm_device: bool
) -> None:
    state = _STATE
    world, me = state.world_size, state.rank
    check_exchange_lists(recv_list, send_list, world, me, move_to_comm_device)
    if move_to_comm_device:
        device = state.comm_device
        sends = [t.to(device) for t in send_list]
        recvs = [t if t.device == device else torch.empty_like(t, device=device) for t in recv_list]
    else:
        sends, recvs = list(send_list), list(recv_list)
    nbytes = sum([t.nbytes for t in sends]) - sends[me].nbytes
    group, stats = route("all_to_all", None, sends[me])
    timed(stats, nbytes, all_to_all_impl, recvs, sends, group, max_collective_size())
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

    limit = max_collective_size()

    def run() -> list[torch.Tensor]:
        if recv_sizes is None:
            rows = _exchange_rows([t.shape[0] for t in sends], group)
        else:
            rows = checked_sizes(recv_sizes, world)
            if rows[me] != sends[me].shape[0]:
                raise InvalidArgumentError(
                    f"recv_sizes[{me}]={rows[me]} but tensors[{me}] has {sends[me].shape[0]} rows: rank {me} "
                    "keeps its own part, so they must be equal."
                )
        recvs = [torch.empty((n, *trailing), dtype=dtype, device=device) for n in rows]
        all_to_all_impl(recvs, sends, group, limit)
        return recvs

    received = timed_call(stats, nbytes, run)
    return [t.to(first.device) for t in received]


def _exchange_rows(rows: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's row count for this rank: one equal-split all_to_all_single of int64."""
    mine = torch.tensor(rows, dtype=torch.int64)
    theirs = torch.empty_like(mine)
    with dispatch_below():
        dist.all_to_all_single(theirs, mine, group=_cpu_side(group))
    return [int(n) for n in theirs.tolist()]


def all_to_all_impl(
    recvs: list[torch.Tensor], sends: list[torch.Tensor], group: dist.ProcessGroup | None, limit: int = 0
) -> None:
    """The exchange itself, unrecorded; ``recvs`` are filled in place. Validated lists, one device.
    ``limit`` > 0 runs it in rounds of about that many elements (see the module's documentation)."""
    state = _STATE
    if group is None or group is state.cpu_group:
        me, world, peers = state.rank, state.world_size, None
    else:  # a caller's subgroup (reduce_scatter's fallback): point-to-point needs global ranks
        me, world = dist.get_rank(group), dist.get_world_size(group)
        peers = [dist.get_global_rank(group, r) for r in range(world)]
    if _a2a_config.check_sizes:
        check_sizes_with_peers(recvs, sends, _cpu_side(group))
    if not limit:
        _exchange(recvs, sends, me, world, group, peers)
        return
    rounds = _agreed_rounds(recvs, sends, limit, group)
    recv_rows = [_as_rows(t) for t in recvs]
    send_rows = [_as_rows(t) for t in sends]
    for r in range(rounds):
        _exchange(
            [_round_slice(t, r, rounds) for t in recv_rows],
            [_round_slice(t, r, rounds) for t in send_rows],
            me,
            world,
            group,
            peers,
        )


def _exchange(
    recvs: list[torch.Tensor],
    sends: list[torch.Tensor],
    me: int,
    world: int,
    group: dist.ProcessGroup | None,
    peers: list[int] | None,
) -> None:
    state = _STATE
    if world == 1:
        recvs[0].copy_(sends[0])
    elif sends[me].is_cpu and (group is not None or state.backend == "gloo"):
        hybrid_all_to_all(recvs, sends, me, world, group, peers, _a2a_config.small_message_bytes)
    else:
        # nccl, mpi, ucc and ccl take unequal sizes; they want contiguous tensors.
        targets = [
            t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in recvs
        ]
        contiguous = [t.contiguous() for t in sends]
        with dispatch_below():
            dist.all_to_all(targets, contiguous, group=group)
        for mine, target in zip(recvs, targets, strict=True):
            if mine is not target:
                mine.copy_(target)


def _agreed_rounds(
    recvs: list[torch.Tensor], sends: list[torch.Tensor], limit: int, group: dist.ProcessGroup | None
) -> int:
    """SAR's count of rounds, ``max(1, elements sent and received // limit)``, as the maximum over
    the ranks (one all_reduce of a CPU int64)."""
    elements = sum(t.numel() for t in recvs) + sum(t.numel() for t in sends)
    rounds = torch.tensor([max(1, elements // limit)], dtype=torch.int64)
    dist.all_reduce(rounds, dist.ReduceOp.MAX, group=_cpu_side(group))
    return int(rounds.item())


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a one-row view of a 0-dimensional tensor."""
    return t.view(1) if t.dim() == 0 else t


def _round_slice(t: torch.Tensor, r: int, rounds: int) -> torch.Tensor:
    """Round ``r``'s rows of ``t``: ``[n*r//rounds, n*(r+1)//rounds)``, a view (possibly empty)."""
    n = t.shape[0]
    return t[n * r // rounds : n * (r + 1) // rounds]


def _cpu_side(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group that carries CPU tensors for an exchange on ``group``: an nccl job's gloo side
    group in place of its default group."""
    cpu_group = _STATE.cpu_group
    return cpu_group if group is None and cpu_group is not None else group
