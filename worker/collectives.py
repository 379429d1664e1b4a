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

Where each lives: :mod:`sarcomm.worker.timing` (the recording wrapper and ``all_reduce``),
:mod:`sarcomm.worker.alltoall` (``all_to_all``, ``exchange_tensors``; how all_to_all runs on gloo),
:mod:`sarcomm.worker.model_sync` (``sync_params``, ``gather_grads``) and
:mod:`sarcomm.worker.torch_ops` (torch's other collectives). This module gathers them.
"""

from __future__ import annotations

from sarcomm.worker.alltoall import (
    AllToAllConfig,
    all_to_all,
    all_to_all_config,
    configure_all_to_all,
    exchange_tensors,
)
from sarcomm.worker.model_sync import gather_grads, sync_params
from sarcomm.worker.timing import CollectiveHandle, ProgressHook, all_reduce, set_progress_hook
from sarcomm.worker.torch_ops import (
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
