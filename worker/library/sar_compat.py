"""The rest of SAR's ``sar.comm`` names that SAR's own modules import: ``exchange_single_tensor``
(its sequential aggregation fetches each remote partition's features with it, from the
:mod:`~sarcomm.worker.library.task_thread`) and ``nfs_ip_init`` (the start-up sarcomm replaces).

``exchange_single_tensor(recv_idx, send_idx, recv_tensor, send_tensor)`` keeps SAR's semantics
(send ``send_tensor`` to ``send_idx``, fill ``recv_tensor`` from ``recv_idx``; both this rank: a
copy; tensors travel on :func:`~sarcomm.worker.library.comm.comm_device`, the result is copied back) but
not SAR's means: SAR runs a whole ``all_to_all`` over every rank with one-element dummies for
the ranks it does not talk to; here the two messages go point to point (one send, one receive),
which is what the call needs and is cheaper on every backend. Every rank SAR's aggregation calls
it on makes the matching call (rank ``r`` sends to ``r+k`` and receives from ``r-k``), so the
result is the same; what differs is that a rank no longer waits for ranks it exchanges nothing
with.
"""

from __future__ import annotations

import logging
from typing import Final

import torch
import torch.distributed as dist

from sarcomm.common.errors import FailedPreconditionError, InvalidArgumentError, shorten
from sarcomm.worker.launch_env import process_environ, rank_identity
from sarcomm.worker.library import comm
from sarcomm.worker.library.collectives.timing import dispatch_below, raise_not_ready, route, timed_call

__all__ = ["exchange_single_tensor", "nfs_ip_init"]

log = logging.getLogger(__name__)

_STATE: Final = comm.STATE
# Its own tag, so that its messages are never matched with a user's send/recv (tag 0) nor with
# all_to_all's point-to-point messages in flight at the same time.
_TAG: Final = 0x5E57


def exchange_single_tensor(
    recv_idx: int, send_idx: int, recv_tensor: torch.Tensor, send_tensor: torch.Tensor
) -> None:
    """Send ``send_tensor`` to rank ``send_idx`` and fill ``recv_tensor``, in place, with what rank
    ``recv_idx`` sends this rank, as SAR's ``exchange_single_tensor``.

    ``recv_idx == send_idx == rank()`` copies ``send_tensor`` into ``recv_tensor``. Otherwise
    both must be other ranks, and those ranks must make the matching call (``send_idx`` receiving
    from this rank, ``recv_idx`` sending to it) with ``recv_tensor`` shaped exactly as what
    ``recv_idx`` sends (SAR's rule; a larger message is a backend error). Empty tensors send and
    expect nothing. The tensors travel on :func:`~sarcomm.worker.library.comm.comm_device`; a
    ``recv_tensor`` that lives elsewhere is filled by a copy afterwards. Recorded in the metrics
    as op ``exchange_single_tensor`` (bytes: ``send_tensor``'s, when it goes to another rank).
    Blocks until both messages are done; safe to call from SAR's comm thread while the main thread
    waits for its result.

    Raises :class:`InvalidArgumentError` for a rank outside the world, one index this rank and the
    other not, or tensors of different dtypes (or shapes, for the copy);
    :class:`FailedPreconditionError` before initialize_comms; the recorded
    :class:`PeerFailedError` after a peer failed; and the backend's errors.
    """
    state = _STATE
    if not state.ready:
        raise_not_ready("exchange_single_tensor")
    world, me = state.world_size, state.rank
    for name, index in (("recv_idx", recv_idx), ("send_idx", send_idx)):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < world:
            raise InvalidArgumentError(
                f"{name}={shorten(index)} must be a rank in 0..{world - 1} (world size {world})."
            )
    if (recv_idx == me) != (send_idx == me):
        raise InvalidArgumentError(
            f"recv_idx={recv_idx} and send_idx={send_idx} on rank {me}: either both are this rank (a "
            "local copy) or neither is (an exchange with two peers)."
        )
    if send_tensor.dtype != recv_tensor.dtype:
        raise InvalidArgumentError(
            f"send_tensor has dtype {send_tensor.dtype} but recv_tensor has {recv_tensor.dtype}: "
            "exchange_single_tensor needs one dtype."
        )
    if send_idx == me:
        if recv_tensor.shape != send_tensor.shape:
            raise InvalidArgumentError(
                f"recv_tensor has shape {tuple(recv_tensor.shape)} but send_tensor has "
                f"{tuple(send_tensor.shape)}: rank {me} exchanges with itself, a copy of the same shape."
            )
        _, stats = route("exchange_single_tensor", None, send_tensor)
        timed_call(stats, 0, lambda: recv_tensor.copy_(send_tensor))
        return
    device = state.comm_device
    out = send_tensor.to(device).contiguous()
    into = (
        recv_tensor
        if recv_tensor.device == device and recv_tensor.is_contiguous()
        else torch.empty(recv_tensor.shape, dtype=recv_tensor.dtype, device=device)
    )
    group, stats = route("exchange_single_tensor", None, out)

    def run() -> None:
        works = []
        if out.numel():
            with dispatch_below():
                works.append(dist.isend(out, send_idx, group=group, tag=_TAG))
        if into.numel():
            with dispatch_below():
                works.append(dist.irecv(into, recv_idx, group=group, tag=_TAG))
        for work in works:
            if work is not None:
                work.wait()

    timed_call(stats, out.nbytes, run)
    if into is not recv_tensor:
        recv_tensor.copy_(into)


def nfs_ip_init(_rank: int, ip_file: str) -> str:
    """SAR's start-up by a shared file, kept by name only so that code swapped over from SAR gets
    an answer instead of an ``AttributeError``; no file is read or written.

    - In a process that is already a member of a job (started by ``sar-worker``, or after
      :func:`~sarcomm.worker.library.registration.coord_ip_init`): returns the master address handed out
      (``MASTER_ADDR``), so a SAR script runs unchanged under ``sar-worker``.
    - Anywhere else: raises :class:`FailedPreconditionError` saying how to move to
      ``coord_ip_init``.

    Why not a working file rendezvous: a file left by an earlier run is read as the truth, and a
    rank dials an address that is gone; that is the failure sarcomm exists to remove. Why not
    absent: users who swap the import expect SAR's names, and a message that names the
    replacement line is the quickest way over.

    Raises :class:`InvalidArgumentError` when ``_rank`` is not this member's rank.
    """
    identity = rank_identity(process_environ())
    master, rank_text = identity.master_addr, identity.rank
    if master and identity.member_id:
        if rank_text is not None and rank_text.strip() != str(_rank):
            raise InvalidArgumentError(
                f"nfs_ip_init(_rank={shorten(_rank)}, ...) but this process is rank {rank_text} of its job "
                "(RANK): pass the rank the coordinator handed out."
            )
        log.warning(
            "rank %s: nfs_ip_init(%r) ignores its file: this process is a member of job %s already, "
            "so it returns the master address handed out (%s); call coord_ip_init instead",
            _rank, ip_file, identity.job or "?", master,
        )  # fmt: skip
        return master
    raise FailedPreconditionError(
        f"nfs_ip_init({shorten(_rank)}, {shorten(ip_file)}): sarcomm does not rendezvous through a "
        "shared file (a file left by an earlier run points workers at an address that is gone). Start a "
        "coordinator (sar-coordinator) and replace the call with "
        "sar.coord_ip_init(rank, 'HEAD:50051', job='NAME', world_size=N), or run the script under "
        "sar-worker, where nfs_ip_init returns the master address handed out."
    )
