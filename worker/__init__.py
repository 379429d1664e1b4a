"""sarcomm's worker side: ``import sarcomm.worker as sar`` in training code.

A drop-in for SAR's ``sar.comm`` start-up and collectives, every collective timed into Prometheus
metrics, plus the coordinator client. Names load lazily (PEP 562) so that the ``sar-worker`` agent,
which imports this package too, does not pay for importing torch.

Start-up::

    master_ip = sar.coord_ip_init(rank, "head:50051", job="gnn", world_size=8)  # replaces nfs_ip_init
    sar.initialize_comms(rank, world_size, master_ip, "gloo")
    # or, under sar-worker / torchrun / mpirun / srun:
    info = sar.init()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # start-up
    "coord_ip_init": "startup",
    "init": "startup",
    "WorkerInfo": "startup",
    "initialize_comms": "comm",
    "is_initialized": "comm",
    "rank": "comm",
    "world_size": "comm",
    "comm_device": "comm",
    "backend": "comm",
    # collectives
    "all_to_all": "collectives",
    "all_reduce": "collectives",
    "exchange_tensors": "collectives",
    "sync_params": "collectives",
    "gather_grads": "collectives",
    "broadcast": "collectives",
    "all_gather": "collectives",
    "reduce_scatter": "collectives",
    "reduce": "collectives",
    "gather": "collectives",
    "scatter": "collectives",
    "send": "collectives",
    "recv": "collectives",
    "barrier": "collectives",
    # coordinator client
    "CoordinatorClient": "client",
    "Assignment": "client",
    # errors
    "PeerFailedError": "errors",
    "SarcommError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sarcomm.worker' has no attribute {name!r}")
    if module == "errors":
        value = getattr(importlib.import_module("sarcomm.coordinator.errors"), name)
    else:
        value = getattr(importlib.import_module(f"sarcomm.worker.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from sarcomm.coordinator.errors import PeerFailedError, SarcommError
    from sarcomm.worker.client import Assignment, CoordinatorClient
    from sarcomm.worker.collectives import (
        all_gather,
        all_reduce,
        all_to_all,
        barrier,
        broadcast,
        exchange_tensors,
        gather,
        gather_grads,
        recv,
        reduce,
        reduce_scatter,
        scatter,
        send,
        sync_params,
    )
    from sarcomm.worker.comm import backend, comm_device, initialize_comms, is_initialized, rank, world_size
    from sarcomm.worker.startup import WorkerInfo, coord_ip_init, init
