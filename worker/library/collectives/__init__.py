"""SAR-compatible collectives, each timed into the worker's Prometheus metrics.

SAR's own two (``all_to_all``, ``all_reduce``), its helpers (``exchange_tensors``, ``sync_params``,
``gather_grads``) and the rest of ``torch.distributed``'s collectives with torch's signatures.
Every call records its wall time, the bytes this rank sent and any error into
:mod:`sarcomm.worker.library.metrics` under its op name and the backend that carried it. With
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

SAR's keyword names are accepted where sarcomm's differ: ``all_to_all(recv_tensors=...,
send_tensors=...)`` (this module's thin entry resolves them, :mod:`sarcomm.worker.library.sar_keywords`) and
``all_reduce(red_tensor=...)``.

Where each lives: :mod:`.timing` (the recording wrapper and ``all_reduce``),
:mod:`.alltoall` (``all_to_all``, ``exchange_tensors``; how all_to_all runs on gloo),
:mod:`.model_sync` (``sync_params``, ``gather_grads``) and
:mod:`.torch_ops` (torch's other collectives). This module gathers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sarcomm.worker.library import sar_keywords
from sarcomm.worker.library.collectives import alltoall
from sarcomm.worker.library.collectives.alltoall import (
    AllToAllConfig,
    all_to_all_config,
    configure_all_to_all,
    exchange_tensors,
)
from sarcomm.worker.library.collectives.model_sync import gather_grads, sync_params
from sarcomm.worker.library.collectives.timing import (
    CollectiveHandle,
    ProgressHook,
    all_reduce,
    set_progress_hook,
)
from sarcomm.worker.library.collectives.torch_ops import (
    all_gather,
    barrier,
    broadcast,
    gather,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)

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


_all_to_all = alltoall.all_to_all


def all_to_all(
    recv_list: Sequence[torch.Tensor] | None = None,
    send_list: Sequence[torch.Tensor] | None = None,
    move_to_comm_device: bool = False,
    *,
    recv_tensors: Sequence[torch.Tensor] | None = None,
    send_tensors: Sequence[torch.Tensor] | None = None,
) -> None:
    """Send ``send_list[i]`` to rank ``i`` and receive rank ``i``'s tensor into ``recv_list[i]``,
    in place, as SAR's all_to_all (sizes may differ between peers, on every backend); the rules and
    errors are those of :func:`.alltoall.all_to_all`.

    ``recv_tensors`` and ``send_tensors`` are SAR's keyword names for ``recv_list`` and
    ``send_list``; passing both spellings of one is a ``TypeError`` naming both. This entry only
    resolves the names (two ``is None`` tests when sarcomm's are used) and calls the exchange.
    """
    if recv_list is None or send_list is None or recv_tensors is not None or send_tensors is not None:
        recv_list = sar_keywords.required("all_to_all", "recv_list", recv_list, "recv_tensors", recv_tensors)
        send_list = sar_keywords.required("all_to_all", "send_list", send_list, "send_tensors", send_tensors)
    _all_to_all(recv_list, send_list, move_to_comm_device)
